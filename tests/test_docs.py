"""The documentation site builds with ``mkdocs build --strict`` (needs the ``docs`` extra).

Broken links, missing figures, a notebook or API page that cannot be rendered and
docstrings mkdocstrings cannot parse all fail the build. Skipped when mkdocs is not
installed (``pip install -c constraints.txt -e ".[docs]"``).
"""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location(
        "mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_covers_every_public_module():
    pytest.importorskip("mkdocs")
    hooks = _hooks()
    modules = hooks.public_modules()
    for name in ("probfsl.cli", "probfsl.models.bavardage", "probfsl.inference.base"):
        assert name in modules
    assert not any(part.startswith("_") for m in modules for part in m.split("."))
    uris = [hooks.api_uri(m) for m in modules if m != "probfsl"]
    assert len(set(uris)) == len(uris)


def test_cli_reference_lists_every_subcommand():
    pytest.importorskip("mkdocs")
    from probfsl.cli import build_parser

    text = _hooks().cli_reference()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        assert f"## `probfsl {name}`" in text


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocs_jupyter")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        # what `make docs` runs (without -q, which hides the warnings --strict counts)
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]
    # the API reference documents every public top-level class and function
    hooks, missing, count = _hooks(), [], 0
    for module in hooks.public_modules():
        source = ROOT / (module.replace(".", "/") + ".py")
        if not source.exists():  # a package: its page holds its docstring only
            continue
        page = tmp_path / "site" / hooks.api_uri(module).removesuffix(".md") / "index.html"
        html = page.read_text(encoding="utf-8")
        for node in ast.parse(source.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                count += 1
                if f'id="{module}.{node.name}"' not in html:
                    missing.append(f"{module}.{node.name}")
    assert count > 100 and not missing, missing
