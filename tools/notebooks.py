"""Build the executed tutorial notebooks from their jupytext sources, or check them.

``python tools/notebooks.py`` converts every ``tutorials/NN_*.py`` (jupytext percent
format) to a notebook, executes it with a fresh Python kernel in a temporary working
directory and writes ``tutorials/NN_*.ipynb`` with its outputs. ``--check`` only
verifies that every committed notebook holds the code cells of its source and was
executed (what ``tests/test_tutorials.py`` asserts); names restrict the run::

    python tools/notebooks.py                    # build all
    python tools/notebooks.py 04 05              # build the tutorials whose name starts so
    python tools/notebooks.py --check            # compare code cells, exit 1 on a mismatch

Figures are the inline backend's PNGs at matplotlib's default 100 dpi, so a notebook
stays a few hundred kB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"


def sources(names: list[str] | None = None) -> list[Path]:
    """The jupytext sources ``tutorials/NN_*.py``, optionally those starting with a name."""
    paths = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
    if names:
        paths = [p for p in paths if any(p.stem.startswith(n) for n in names)]
    return paths


def notebook_path(source: Path) -> Path:
    """Where the executed notebook of a source lives: next to it, ``.ipynb``."""
    return source.with_suffix(".ipynb")


def code_cells(nb) -> list[str]:
    """The sources of a notebook's code cells, trailing whitespace removed."""
    return [c.source.rstrip() for c in nb.cells if c.cell_type == "code"]


def differences(source: Path) -> list[str]:
    """Why the committed notebook of ``source`` is stale; empty when it is up to date.

    Compares code cells only (the jupytext conversion of the source against the
    committed notebook), so outputs and markdown rendering never matter; also
    reports a missing notebook and code cells that were never executed.
    """
    import jupytext
    import nbformat

    target = notebook_path(source)
    if not target.exists():
        return [f"{target.name} is missing (run `make notebooks`)"]
    expected = code_cells(jupytext.read(source))
    committed_nb = nbformat.read(target, as_version=4)
    committed = code_cells(committed_nb)
    problems = []
    if len(expected) != len(committed):
        problems.append(
            f"{target.name}: {len(committed)} code cells, {source.name} has {len(expected)}"
        )
    for i, (a, b) in enumerate(zip(expected, committed, strict=False)):
        if a != b:
            first = a.splitlines()[0] if a else "(empty)"
            problems.append(f"{target.name}: code cell {i + 1} differs from the source ({first})")
    unexecuted = [
        i + 1
        for i, c in enumerate(c for c in committed_nb.cells if c.cell_type == "code")
        if c.source.strip() and c.get("execution_count") is None
    ]
    if unexecuted:
        problems.append(f"{target.name}: code cells {unexecuted} were not executed")
    return problems


def build(source: Path, timeout: int = 600) -> Path:
    """Convert ``source`` to a notebook, execute it and write it next to the source."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(source)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.metadata.pop("jupytext", None)  # the .py header stays the single source of that
    env = {
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYTHONHASHSEED": "0",
        # tqdm.auto asks for ipywidgets in a kernel; its text progress bars are what we want
        "PYTHONWARNINGS": "ignore:IProgress not found",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory() as cwd:
            client = NotebookClient(
                nb,
                timeout=timeout,
                kernel_name="python3",
                resources={"metadata": {"path": cwd}},
                record_timing=False,
            )
            client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    target = notebook_path(source)
    nbformat.write(nb, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="tutorial name prefixes (default: all)")
    parser.add_argument("--check", action="store_true", help="compare only, build nothing")
    args = parser.parse_args(argv)
    paths = sources(args.names)
    if not paths:
        parser.error(f"no tutorial matches {args.names}")
    if args.check:
        problems = [p for s in paths for p in differences(s)]
        print("\n".join(problems) or f"{len(paths)} notebooks match their sources")
        return 1 if problems else 0
    for source in paths:
        start = time.perf_counter()
        target = build(source)
        size = target.stat().st_size / 1024
        print(f"{target.relative_to(ROOT)}: {time.perf_counter() - start:.0f} s, {size:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
