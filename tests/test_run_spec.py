"""A run as a typed value: :class:`probfsl.run_spec.RunSpec`, checked when it is made,
and :func:`probfsl.running.run`, the one path of ``probfsl run``, a sweep's cells and
Python code."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import probfsl
from probfsl.cli import main, parse_run_args
from probfsl.commands import run_row, spec_from_args
from probfsl.run_spec import RunSpec, run_choices
from probfsl.running import run
from probfsl.sweeps import MethodEntry, RunOptions, Source, SweepConfig

#: the fields of a row that time the run (they differ between two runs of one setting)
TIMING = ("seconds", "tasks_per_second", "tuning_seconds")
SMALL = {"method": "nearest-centroid", "dataset": "omniglot", "query": 15, "tasks": 6}


def _same(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING}


def test_the_spec_module_imports_no_torch():
    code = (
        "import sys\n"
        "import probfsl\n"
        "spec = probfsl.RunSpec('slem', dataset='omniglot', shot=5, params={'lam': 1.0})\n"
        "from probfsl.run_spec import run_choices\n"
        "run_choices()\n"
        "print(sorted(m for m in ('torch', 'pyro', 'probfsl.running') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_package_exports_the_spec_and_its_run():
    assert probfsl.RunSpec is RunSpec and probfsl.run is run
    assert {"RunSpec", "run"} <= set(probfsl.__all__) and "RunSpec" in dir(probfsl)


def test_defaults_are_the_command_lines():
    args = parse_run_args(["--method", "slem", "--dataset", "omniglot"])
    assert spec_from_args(args) == RunSpec("slem", dataset="omniglot")


def test_values_are_normalised_and_params_copied(tmp_path):
    params = {"temperature": 2.0}
    spec = RunSpec(
        "soft-kmeans",
        features=tmp_path / "f.npz",
        device=torch.device("cpu"),
        dtype=torch.float64,
        way=np.int64(3),
        alpha=3,
        params=params,
    )
    params["temperature"] = 5.0
    assert spec.features == str(tmp_path / "f.npz") and spec.device == "cpu"
    assert spec.dtype == "float64" and type(spec.way) is int and spec.alpha == 3.0
    assert spec.params == {"temperature": 2.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.way = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dataset": None}, "give exactly one of dataset and features"),
        ({"features": "x.npz"}, "give exactly one of dataset and features"),
        ({"method": "bavardge"}, "unknown method 'bavardge'"),
        ({"dataset": "omniglott"}, "unknown dataset 'omniglott'"),
        ({"features": 3, "dataset": None}, "features: expected a feature file's path"),
        ({"way": 0}, "way: must be an integer >= 1, got 0"),
        ({"shot": 1.0}, "shot: expected an integer, got 1.0"),
        ({"tasks": True}, "tasks: expected an integer, got True"),
        ({"open_queries": -1}, "open_queries: must be an integer >= 0"),
        ({"batch_size": 0}, "batch_size: must be an integer >= 1"),
        ({"alpha": float("inf")}, "alpha: must be a finite positive number"),
        ({"alpha": 0}, "alpha: must be a finite positive number"),
        ({"balance": "skewed"}, "balance: invalid choice: 'skewed' (choose from balanced,"),
        ({"dtype": "float16"}, "dtype: invalid choice: 'float16'"),
        ({"calibrate": "platt"}, "calibrate: invalid choice: 'platt'"),
        ({"zero_shot": "yes"}, "zero_shot: expected True or False"),
        ({"params": {"nope": 1}}, "nearest-centroid: unknown hyperparameter(s) ['nope']"),
        ({"params": [("center", True)]}, "params: expected a mapping"),
        ({"engine": "derived"}, "--engine: nearest-centroid has one engine"),
        ({"preset": "cub"}, "method 'nearest-centroid' has no presets"),
        ({"preset": "auto"}, "no search space for method 'nearest-centroid'"),
        ({"open_queries": 15, "task_file": "t.npz"}, "it does not apply to --task-file"),
    ],
)
def test_a_bad_value_is_a_value_error_that_names_it(fields, message):
    with pytest.raises(ValueError) as err:
        RunSpec(**{**SMALL, **fields})
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"preset": "mini-balanced"}, "--zero-shot takes no named --preset (only auto)"),
        ({"calibrate": "temperature"}, "--calibrate temperature applies to few-shot runs"),
        ({"open_queries": 5}, "--open-queries applies to few-shot runs, not --zero-shot"),
        ({"task_file": "t.npz"}, "--task-file applies to few-shot runs, not --zero-shot"),
    ],
)
def test_zero_shot_refuses_the_few_shot_options(fields, message):
    with pytest.raises(ValueError) as err:
        RunSpec("em-dirichlet", dataset="wordnet", zero_shot=True, **fields)
    assert message in str(err.value)
    RunSpec("em-dirichlet", dataset="wordnet", zero_shot=True, preset="auto")  # allowed


def test_engine_and_param_engine_must_agree():
    with pytest.raises(ValueError, match="--engine derived and --param engine=handwritten"):
        RunSpec("bavardage", dataset="omniglot", engine="derived", params={"engine": "handwritten"})


def test_the_parser_and_the_sweep_schema_read_the_same_choices():
    from probfsl.cli import build_parser
    from probfsl.sweeps.config import run_choices as sweep_choices

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    parsed = {a.dest: list(a.choices) for a in sub.choices["run"]._actions if a.choices}
    assert parsed == run_choices() == sweep_choices()


def test_a_cell_is_the_run_its_command_line_gives():
    """``Cell.spec`` (what a sweep runs) equals the spec of ``probfsl run`` on the cell's
    command line (what ``--dry-run`` shows), axis by axis."""
    run_options = RunOptions(tasks=7, device="auto", batch_size=3, episodes=4, dtype="float64")
    few_shot = SweepConfig(
        data=[Source("omniglot", dataset="omniglot")],
        methods=[
            MethodEntry("soft-kmeans", preset=["defaults", None], params={"temperature": 2.0}),
            MethodEntry("bavardage", engine=["handwritten", "derived"], preset="defaults"),
            MethodEntry("nearest-centroid", calibrate="none"),
        ],
        grid={"balance": ["balanced", "dirichlet"], "alpha": [0.5], "query": 15, "open": [0, 5]},
        run=run_options,
    )
    zero_shot = SweepConfig(
        data=[Source("wordnet", dataset="wordnet")],
        methods=[MethodEntry("em-dirichlet", zero_shot=True, params={"temperature": 10.0})],
        grid={"query": 20, "seed": [0, 1]},
        run=run_options,
    )
    cells = few_shot.cells() + zero_shot.cells()
    assert len(cells) > 10 and any(cell.zero_shot for cell in cells)
    for cell in cells:
        for device in (None, "cpu"):
            spec = cell.spec(device)
            assert spec == spec_from_args(parse_run_args(cell.argv(device))), cell.describe()


def test_run_gives_the_command_lines_row(tmp_path, capsys):
    argv = ["--method", "nearest-centroid", "--dataset", "omniglot", "--query", "15"]
    argv += ["--tasks", "6", "--balance", "dirichlet", "--seed", "2"]
    out = tmp_path / "row.json"
    assert main(["run", *argv, "--out", str(out)]) == 0
    capsys.readouterr()
    written = json.loads(out.read_text())  # one row: one object
    spec = RunSpec(**{**SMALL, "balance": "dirichlet", "seed": 2})
    row = run(spec, progress=False)
    assert list(row) == list(written)
    assert json.loads(json.dumps(_same(row), default=float)) == _same(written)
    assert _same(run_row(parse_run_args(argv), progress=False)) == _same(row)


def test_a_feature_set_in_memory_runs_as_its_file(tmp_path):
    from probfsl.data import load_dataset

    fs = load_dataset("omniglot")
    path = tmp_path / "omniglot.npz"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    spec = RunSpec(**{**SMALL, "dataset": None, "features": fs})
    in_memory = run(spec, progress=False)
    from_file = run(dataclasses.replace(spec, features=path), progress=False)
    built_in = run(RunSpec(**SMALL), progress=False)
    assert in_memory["dataset"] == built_in["dataset"] == "omniglot"
    assert from_file["accuracy"] == in_memory["accuracy"] == built_in["accuracy"]


def test_what_needs_torch_or_the_data_is_checked_when_the_run_starts(tmp_path, monkeypatch):
    import probfsl.running

    def no_loading(*args, **kwargs):
        raise AssertionError("the data were loaded before the run was checked")

    monkeypatch.setattr(probfsl.running, "load_dataset", no_loading)
    for fields, message in [
        ({"device": "warp-drive"}, "--device 'warp-drive' is not a device"),
        ({"task_file": str(tmp_path / "none.npz")}, "--task-file: file not found"),
        ({"params": {"center": "yes"}}, "center"),
    ]:
        spec = RunSpec(**{**SMALL, **fields})  # valid as a value
        with pytest.raises((ValueError, TypeError)) as err:
            run(spec, progress=False)
        assert message in str(err.value)


def test_the_sweep_package_imports_neither_the_command_line_nor_its_commands():
    root = Path(probfsl.__file__).parent / "sweeps"
    for path in root.glob("*.py"):
        text = path.read_text()
        for name in ("probfsl.cli", "probfsl.commands", "from probfsl import cli"):
            assert name not in text, f"{path.name} names {name}"
