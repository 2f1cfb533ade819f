"""Every tutorial runs top to bottom (they are jupytext percent-format scripts), and the
committed executed notebooks hold exactly the code of their sources."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))


def _notebook_tools():
    spec = importlib.util.spec_from_file_location("notebook_tools", ROOT / "tools" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0")
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_committed_notebook_matches_source(path):
    """tutorials/NN_x.ipynb exists, was executed, and its code cells are the source's."""
    pytest.importorskip("jupytext")
    problems = _notebook_tools().differences(path)
    assert not problems, "; ".join(problems) + " (run `make notebooks`)"


def test_notebook_check_detects_an_edited_source(tmp_path):
    """The comparison is not vacuous: editing one code line of a source is caught."""
    pytest.importorskip("jupytext")
    tools = _notebook_tools()
    source = TUTORIALS[0]
    if not source.with_suffix(".ipynb").exists():
        pytest.skip("no committed notebook")
    copy = tmp_path / source.name
    shutil.copy(source.with_suffix(".ipynb"), copy.with_suffix(".ipynb"))
    text = source.read_text(encoding="utf-8")
    copy.write_text(text, encoding="utf-8")
    assert tools.differences(copy) == []
    edited = text.replace("import torch\n", "import torch  # edited\n", 1)
    assert edited != text
    copy.write_text(edited, encoding="utf-8")
    assert any("differs" in p for p in tools.differences(copy))
    copy.with_suffix(".ipynb").unlink()
    assert any("missing" in p for p in tools.differences(copy))
