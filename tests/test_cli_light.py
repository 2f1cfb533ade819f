"""The command line answers help, ``probfsl datasets`` and argument errors without
importing torch, from a table of the methods that stays in step with the estimators."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from probfsl.method_table import METHOD_TABLE

ROOT = Path(__file__).resolve().parents[1]

#: runs ``probfsl ARGV`` in a fresh interpreter; prints its exit status and which heavy
#: modules were imported by then
PROBE = """
import json, sys
from probfsl.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as stop:
    status = stop.code
heavy = sorted(m for m in ("torch", "pyro", "gpytorch", "pandas") if m in sys.modules)
print(json.dumps({"status": status, "heavy": heavy}), file=sys.stderr)
"""


def _probe(argv: list[str], cwd: Path) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=cwd
    )
    *lines, last = done.stderr.strip().splitlines()
    return json.loads(last), "\n".join(lines) + done.stdout


def test_method_table_matches_the_estimators():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from method_table import current_table
    finally:
        sys.path.pop(0)
    assert current_table() == METHOD_TABLE, "run python tools/method_table.py"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["run", "--help"],
        ["tune", "--help"],
        ["select", "--help"],
        ["extract", "--help"],
        ["sweep", "--help"],
        ["report", "--help"],
        ["merge", "--help"],
        ["datasets"],
    ],
)
def test_help_and_datasets_import_no_torch(argv, tmp_path):
    result, text = _probe(argv, tmp_path)
    assert result == {"status": 0, "heavy": []}
    if argv == ["run", "--help"]:  # every method's presets and keys, from the table
        for name, row in METHOD_TABLE.items():
            assert f"  {name}: " in text
            assert f"params: {', '.join(row['params'])}" in text
        assert "presets: mini-balanced" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--method", "slem", "--features", "nope.npz"], "feature file not found: nope.npz"),
        (
            ["run", "--method", "slem", "--dataset", "omniglot", "--param", "rel_lamm=1"],
            "slem: unknown hyperparameter(s) ['rel_lamm']; accepted: lam, rel_lam,",
        ),
        (
            ["run", "--method", "bavardage", "--dataset", "omniglot", "--preset", "minx"],
            "unknown preset 'minx'; presets: mini-balanced,",
        ),
        (["run", "--method", "slem", "--dataset", "omniglot", "--preset", "x"], "has no presets"),
        (
            ["run", "--method", "nearest-centroid", "--dataset", "omniglot", "--preset", "auto"],
            "no search space for method 'nearest-centroid'",
        ),
        (
            ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--engine", "derived"],
            "--engine: soft-kmeans has one engine",
        ),
        (
            ["run", "--method", "slem", "--dataset", "omniglot", "--task-file", "t.npz"],
            "--task-file: file not found: t.npz",
        ),
        (["tune", "--method", "slem", "--features", "a.npz"], "feature file not found: a.npz"),
        (["select", "--features", "a.npz", "b.npz"], "feature file not found: a.npz"),
        (["merge", "a.npz", "b.npz", "--out", "c.npz"], "feature file not found: a.npz"),
        (["extract", "nope", "--out", "x.npz"], "images must be a folder or a .zip archive"),
        (["run", "--method", "slemm", "--dataset", "omniglot"], "did you mean 'slem'"),
    ],
)
def test_argument_errors_import_no_torch(argv, message, tmp_path):
    result, text = _probe(argv, tmp_path)
    assert result == {"status": 2, "heavy": []}
    assert message in text
    assert text.strip().startswith("probfsl: error:")


def test_datasets_summary_counts_as_the_feature_sets():
    from probfsl.data import DATASETS, load_dataset
    from probfsl.data.builtin import dataset_summary

    for name in DATASETS:
        fs = load_dataset(name)
        summary = dataset_summary(name)
        assert summary["dim"] == fs.dim
        assert summary["base"] == len(fs.classes_in("base"))
        assert summary["novel"] == len(fs.classes_in("novel"))
        assert summary["samples"] == int((fs.labels >= 0).sum())
