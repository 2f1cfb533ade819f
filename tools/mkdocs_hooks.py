"""MkDocs hooks: the pages that are generated from the repository, so they cannot drift.

* ``cli.md``: the help of ``probfsl`` and of every subcommand, from ``probfsl.cli.build_parser()``.
* ``api/<module>.md``: one mkdocstrings page per public module of the package (found on
  disk, so a new module gets its page without editing ``mkdocs.yml``).
* ``benchmarks/results/<name>.md``: the tables that ``benchmarks/run_all.py`` writes to
  ``benchmarks/results/*.md``.
* ``tutorials/<name>.ipynb``: the committed executed notebooks (rendered by
  mkdocs-jupyter without executing them) and ``figures/<name>-<k>.png``, the k-th PNG
  output of a notebook, for the method pages.
* Sphinx roles in docstrings (``:class:`X```) are shown as code, without the role.
* Math written as ``$...$`` / ``$$...$$`` (pymdownx.arithmatex) becomes MathML at build
  time (latex2mathml), so pages need no JavaScript or network to show equations.

``mkdocs.yml`` names the generated navigation sections by the placeholders
``generated:tutorials``, ``generated:benchmarks`` and ``generated:api``.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import os
import re
from pathlib import Path

import nbformat
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "probfsl"


# ----------------------------------------------------------------------------- sources
def tutorials() -> list[Path]:
    """The committed executed notebooks, in order."""
    return sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.ipynb"))


def benchmark_tables() -> list[Path]:
    """``benchmarks/results/*.md``, the collected REPORT.md left out (it repeats them)."""
    return sorted(p for p in (ROOT / "benchmarks" / "results").glob("*.md") if p.stem != "REPORT")


def public_modules() -> list[str]:
    """Dotted names of the package's modules and subpackages, private ones left out."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        names.append(".".join(parts))
    return sorted(names)


def title_of(path: Path) -> str:
    """The first ``# `` heading of a markdown file, else its stem."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip().replace("`", "")
    return path.stem


def notebook_title(path: Path) -> str:
    """The notebook's first markdown heading without its number prefix."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return path.stem


# ----------------------------------------------------------------------------- page text
def cli_reference() -> str:
    """Markdown with the ``--help`` of ``probfsl`` and of each subcommand."""
    import argparse

    from probfsl.cli import build_parser

    parser = build_parser()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "90"  # argparse wraps to the terminal width: make it fixed
    try:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        lines = [
            "# Command-line reference",
            "",
            "Generated from `probfsl.cli.build_parser()` when the site is built, so it always",
            "matches the installed command. Every subcommand ends with one line",
            "`probfsl: error: ...` and exit status 2 on bad input.",
            "",
            "## `probfsl`",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for name, subparser in sub.choices.items():
            lines += ["", f"## `probfsl {name}`", "", "```text"]
            lines += [subparser.format_help().rstrip(), "```"]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines) + "\n"


def api_page(module: str) -> str:
    """One mkdocstrings block; a package page shows its docstring and its submodules."""
    is_package = (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()
    if not is_package:
        return f"# `{module}`\n\n::: {module}\n"
    children = [m for m in public_modules() if m.rpartition(".")[0] == module]
    lines = [f"# `{module}`", "", f"::: {module}", "    options:", "      members: false", ""]
    if children:
        lines += ["Modules:", ""]
        here = os.path.dirname(api_uri(module))
        lines += [f"* [`{c}`]({os.path.relpath(api_uri(c), here)})" for c in children]
    return "\n".join(lines) + "\n"


def api_uri(module: str) -> str:
    """``probfsl.data.tasks`` -> ``api/data/tasks.md``; a package -> ``.../index.md``."""
    parts = module.split(".")[1:]
    is_package = (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()
    if is_package:
        return "/".join(["api", *parts, "index.md"])
    return "/".join(["api", *parts]) + ".md"


def notebook_pngs(path: Path) -> list[bytes]:
    """The PNG outputs of a notebook, in order."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                out.append(base64.b64decode(data["image/png"]))
    return out


# ----------------------------------------------------------------------------- events
def _nav_for(key: str) -> list:
    if key == "tutorials":
        return [{notebook_title(p): f"tutorials/{p.name}"} for p in tutorials()]
    if key == "benchmarks":
        tables = benchmark_tables()
        titles = [title_of(p) for p in tables]
        return ["benchmarks/index.md"] + [
            {t if titles.count(t) == 1 else f"{t} ({p.stem})": p.relative_to(ROOT).as_posix()}
            for t, p in zip(titles, tables, strict=True)
        ]
    if key == "api":
        return ["api/index.md"] + [{m: api_uri(m)} for m in public_modules() if m != "probfsl"]
    raise ValueError(f"unknown generated navigation section {key!r}")


def on_config(config):
    """Replace the ``generated:<section>`` placeholders of the navigation."""

    def fill(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                ((title, value),) = item.items()
                if isinstance(value, str) and value.startswith("generated:"):
                    value = _nav_for(value.partition(":")[2])
                elif isinstance(value, list):
                    value = fill(value)
                out.append({title: value})
            else:
                out.append(item)
        return out

    config["nav"] = fill(config["nav"])
    return config


@event_priority(100)  # before mkdocs-jupyter wraps the notebooks
def on_files(files: Files, config) -> Files:
    """Add the generated pages, the notebooks and the notebook figures."""
    files.append(File.generated(config, "cli.md", content=cli_reference()))
    for module in public_modules():
        if module != "probfsl":
            files.append(File.generated(config, api_uri(module), content=api_page(module)))
    for path in [*benchmark_tables(), *tutorials()]:  # real files, outside docs/
        uri = path.relative_to(ROOT).as_posix()
        files.append(File(uri, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    for notebook in tutorials():
        for k, png in enumerate(notebook_pngs(notebook), start=1):
            uri = f"figures/{notebook.stem}-{k}.png"
            files.append(File.generated(config, uri, content=png))
    return files


_MATH = re.compile(
    r'<(span|div) class="arithmatex">\s*(?:\\\((.*?)\\\)|\\\[(.*?)\\\])\s*</\1>', re.DOTALL
)


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):<code>~?([^<]*)</code>")


def _role(match: re.Match) -> str:
    """``:class:`~a.b.C``` as Sphinx shows it: ``C`` (with ``~``) or the full name."""
    name = match.group(1)
    shown = name.rpartition(".")[2] if match.group(0).count("~") else name
    return f"<code>{shown}</code>"


def on_page_content(content: str, page, config, files) -> str:
    """``$...$`` and ``$$...$$`` (arithmatex, generic mode) to MathML; the docstrings'
    Sphinx roles (``:class:`X```) shown as plain code."""
    content = _ROLE.sub(_role, content)
    from latex2mathml.converter import convert

    def mathml(match: re.Match) -> str:
        inline, block = match.group(2), match.group(3)
        tex = html.unescape(inline if inline is not None else block)
        # latex2mathml has no `aligned`; an {rl} array is the same layout
        tex = tex.replace(r"\begin{aligned}", r"\begin{array}{rl}")
        tex = tex.replace(r"\end{aligned}", r"\end{array}")
        with contextlib.redirect_stderr(io.StringIO()):
            return convert(tex.strip(), display="inline" if inline is not None else "block")

    return _MATH.sub(mathml, content)
