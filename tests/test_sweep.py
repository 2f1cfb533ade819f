"""Sweeps: the YAML schema and its checks, cells as ``probfsl run``, the results store,
resuming, failing cells, and the same table on the local executor and on Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import probfsl
from probfsl.cli import main
from probfsl.sweeps import (
    MethodEntry,
    ResultsStore,
    RunOptions,
    Source,
    SweepConfig,
    config_from_dict,
    load_config,
    stable_columns,
    sweep,
)
from probfsl.sweeps.config import Resources
from probfsl.sweeps.executors import local_devices

SMALL = {
    "data": {"omniglot": {"dataset": "omniglot"}},
    "methods": ["nearest-centroid", {"method": "soft-kmeans", "preset": "defaults"}],
    "grid": {"shot": [1, 5], "seed": [0, 1]},
    "run": {"tasks": 40, "device": "cpu"},
}


def _frame_equal(a, b) -> None:
    cols = stable_columns(a)
    assert cols == stable_columns(b)
    a, b = a[cols].reset_index(drop=True), b[cols].reset_index(drop=True)
    import pandas.testing as pdt

    pdt.assert_frame_equal(a, b)


@pytest.fixture(scope="module")
def local_table(tmp_path_factory):
    """The small sweep on two local worker processes."""
    root = tmp_path_factory.mktemp("local")
    return sweep(config_from_dict(SMALL), root, workers=2), root


# -- the schema -------------------------------------------------------------------------


def test_yaml_and_dataclasses_give_the_same_cells(tmp_path):
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    from_yaml = load_config(path)
    by_hand = SweepConfig(
        data=[Source("omniglot", dataset="omniglot")],
        methods=[MethodEntry("nearest-centroid"), MethodEntry("soft-kmeans", preset="defaults")],
        grid={"shot": [1, 5], "seed": [0, 1]},
        run=RunOptions(tasks=40, device="cpu"),
    )
    assert from_yaml.cells() == by_hand.cells()
    assert len(by_hand.cells()) == 2 * 2 * 2


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"datas": {}}, "datas: unknown key"),
        ({"data": {"x": {"dataset": "nope"}}}, "data.x.dataset"),
        ({"data": {"x": {"features": "missing.npz"}}}, "data.x.features: file not found"),
        ({"data": {"x": {"dataset": "omniglot", "features": "a.npz"}}}, "data.x: give exactly"),
        ({"methods": ["bavardag"]}, "methods[0].method: 'bavardag'"),
        ({"methods": [{"method": "bavardage", "parms": {}}]}, "methods[0].parms: unknown key"),
        ({"methods": [{"method": "bavardage", "params": {"nope": 1}}]}, "methods[0]"),
        ({"grid": {"shots": [1]}}, "grid.shots: not an axis"),
        ({"grid": {"seed": []}}, "grid.seed: an empty list"),
        ({"grid": {"balance": "skewed"}}, "invalid choice: 'skewed'"),
        ({"run": {"tasks": "many"}}, "run.tasks: expected int"),
        ({"run": {"taks": 3}}, "run.taks: unknown key"),
        ({"resources": {"cpus": 0}}, "resources.cpus"),
    ],
)
def test_config_errors_name_the_key(change, key):
    raw = {**SMALL, **change}
    with pytest.raises(ValueError) as err:
        config_from_dict(raw)
    assert key in str(err.value)
    assert str(err.value).startswith("sweep: ")


def test_unused_axes_collapse():
    """A zero-shot entry ignores way, shot and balance; a one-engine method the engine
    axis: each such combination is one cell."""
    config = config_from_dict(
        {
            "data": {"wordnet": {"dataset": "wordnet"}},
            "methods": [
                "nearest-centroid",
                {"method": "em-dirichlet", "zero_shot": True},
                {"method": "bavardage", "preset": "defaults"},
            ],
            "grid": {"shot": [1, 5], "engine": ["handwritten", "derived"]},
        }
    )
    cells = config.cells()
    count = {m: sum(c.method == m for c in cells) for m in ("nearest-centroid", "em-dirichlet")}
    assert count == {"nearest-centroid": 2, "em-dirichlet": 2}  # its two engines
    assert sum(c.method == "bavardage" for c in cells) == 4
    assert {c.engine for c in cells if c.method == "bavardage"} == {"handwritten", "derived"}


def test_cell_keys_follow_options_data_and_code():
    cells = config_from_dict(SMALL).cells()
    keys = {c.key("v1", "d") for c in cells}
    assert len(keys) == len(cells)
    assert cells[0].key("v1", "d") == cells[0].key("v1", "d")
    assert cells[0].key("v2", "d") != cells[0].key("v1", "d")
    assert cells[0].key("v1", "e") != cells[0].key("v1", "d")


def test_local_devices():
    assert local_devices(Resources(cpus=1), cpu_count=4) == ["cpu"] * 4
    assert local_devices(Resources(cpus=3), cpu_count=4) == ["cpu"]


# -- running ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_cell_is_one_probfsl_run(local_table, tmp_path):
    """Each stored row holds the result fields of ``probfsl run --out`` for its options."""
    table, _ = local_table
    assert (table["status"] == "ok").all()
    assert len(table) == 8
    cell = config_from_dict(SMALL).cells()[3]
    out = tmp_path / "row.json"
    assert main(["run", *cell.argv(), "--out", str(out)]) == 0
    ran = json.loads(out.read_text())
    row = table[
        (table["label"] == cell.label) & (table["shot"] == cell.shot) & (table["seed"] == cell.seed)
    ].iloc[0]
    for key in ("accuracy", "ci95", "baseline_accuracy", "ece", "nll", "brier", "tasks"):
        assert row[key] == pytest.approx(ran[key], rel=1e-12), key
    assert row["code_version"].startswith(probfsl.__version__ + "+")
    assert row["torch_version"] and row["machine"]


@pytest.mark.slow
def test_store_tables_and_skip(local_table):
    table, root = local_table
    import pandas as pd

    stored = pd.read_parquet(root / "results.parquet")
    _frame_equal(stored, table)
    assert len(pd.read_csv(root / "results.csv")) == len(table)
    # a second run finds every cell stored and runs none (same rows, timings included)
    again = sweep(config_from_dict(SMALL), root, workers=2)
    assert again["finished"].tolist() == table["finished"].tolist()


@pytest.mark.slow
def test_ray_and_local_give_the_same_table(local_table, tmp_path):
    """A local Ray cluster of 2 CPUs started by the test runs the sweep: same table."""
    if os.environ.get("CI"):
        import ray  # noqa: F401  (CI installs the extra: a missing Ray is a failure there)
    else:
        pytest.importorskip("ray")
    table, _ = local_table
    on_ray = sweep(config_from_dict(SMALL), tmp_path, executor="ray", workers=2)
    assert (on_ray["status"] == "ok").all()
    _frame_equal(on_ray, table)


def test_ray_missing_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r'pip install -c constraints.txt -e "\.\[distributed\]"'):
        sweep(config_from_dict(SMALL), tmp_path, executor="ray")


def _three_class_file(path: Path, novel: int = 3) -> Path:
    """Features of 3 (``novel``) novel and 4 base classes: 5-way tasks cannot be formed."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4 + novel), 12)
    np.savez(
        path,
        features=rng.normal(size=(labels.size, 8)).astype(np.float32) + labels[:, None],
        labels=labels,
        split=np.where(labels < 4, "base", "novel"),
    )
    return path


@pytest.mark.slow
def test_a_failing_cell_is_recorded_and_the_others_finish(tmp_path):
    """The feature file has five novel classes when the sweep is checked and three when
    its cells run (a file changed under a sweep): its 5-way cells fail as cells."""
    path = _three_class_file(tmp_path / "f.npz", novel=5)
    config = {
        "data": {"small": {"features": str(path)}},
        "methods": ["nearest-centroid"],
        "grid": {"way": [3, 5], "seed": [0, 1]},
        "run": {"tasks": 10, "device": "cpu"},
    }
    config["grid"]["query"] = 15
    checked = config_from_dict(config)
    _three_class_file(path)
    table = sweep(checked, tmp_path / "r", workers=2)
    failed = table[table["status"] == "failed"]
    assert sorted(failed["way"]) == [5, 5]
    assert failed["error"].str.contains("ValueError").all()
    assert (table[table["way"] == 3]["status"] == "ok").all()
    assert table[table["way"] == 3]["accuracy"].notna().all()
    logs = [(tmp_path / "r" / "logs" / f"{k}.log").read_text() for k in failed["cell_key"]]
    assert all("Traceback" in text for text in logs)
    # stored failures are not run again, unless asked
    again = sweep(checked, tmp_path / "r", workers=1)
    assert again["finished"].tolist() == table["finished"].tolist()
    retried = sweep(checked, tmp_path / "r", workers=1, retry_failed=True)
    changed = retried["finished"] != table["finished"]
    assert retried[changed]["way"].tolist() in ([], [5, 5])  # same second: equal stamps
    assert (retried["status"] == table["status"]).all()


@pytest.mark.slow
def test_killed_sweep_resumes_to_the_same_table(local_table, tmp_path):
    """``probfsl sweep`` killed (SIGKILL, workers included) after its first cell, then run
    again: the table equals the uninterrupted one."""
    import yaml

    table, _ = local_table
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    results = tmp_path / "r"
    command = [sys.executable, "-m", "probfsl.cli", "sweep", str(path), "--results", str(results)]
    proc = subprocess.Popen(
        [*command, "--workers", "1"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # a stored row, not any *.json: a cell is written to a hidden temporary file of the
    # same suffix first (atomic_path), and a kill before its rename stores nothing
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (results / "cells").is_dir() and ResultsStore(results).stored():
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the sweep ended before the kill (exit code {proc.returncode})"
    workers = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the sweep's process only: its workers must follow
    proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers), "workers outlived the killed sweep"
    done = len(ResultsStore(results).stored())
    assert 1 <= done < len(table), "the kill came after the first cell and before the last"
    assert subprocess.run([*command, "--workers", "2"], capture_output=True).returncode == 0
    _frame_equal(ResultsStore(results).table(), table)


def _children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid`` (from /proc; empty where there is none)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_cli_dry_run_lists_cells(tmp_path, capsys):
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    assert main(["sweep", str(path), "--results", str(tmp_path / "r"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "8 cells, 0 stored, 8 to run" in out
    assert "probfsl run --method soft-kmeans --dataset omniglot" in out


def test_cli_bad_sweep_file_is_a_clean_error(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("data: {x: {dataset: omniglot}}\nmethods: [nope]\n")
    assert main(["sweep", str(path)]) == 2
    assert "sweep: methods[0].method: 'nope'" in capsys.readouterr().err


def test_keys_follow_the_content_not_the_place_of_a_file(tmp_path):
    a = _three_class_file(tmp_path / "a.npz")
    (tmp_path / "b").mkdir()
    b = tmp_path / "b" / "a.npz"
    b.write_bytes(a.read_bytes())
    from probfsl.sweeps.runner import plan

    def keys(path):
        raw = {"data": {"x": {"features": str(path)}}, "methods": ["nearest-centroid"]}
        raw["grid"] = {"way": 3, "query": 6}
        return plan(config_from_dict(raw), ResultsStore(tmp_path / "r"))[1]

    assert keys(a) == keys(b)
    np.savez(b, **{**np.load(a), "features": np.load(a)["features"] + 1})
    assert keys(a) != keys(b)


def test_optional_sources_are_left_out_when_absent(tmp_path):
    raw = {
        "data": {
            "omniglot": {"dataset": "omniglot"},
            "big": {"features": "nowhere.npz", "optional": True},
        },
        "methods": ["nearest-centroid"],
    }
    assert [s.name for s in config_from_dict(raw, tmp_path).data] == ["omniglot"]
    by_hand = SweepConfig(
        data=[Source("omniglot", dataset="omniglot"), Source("big", features="x", optional=True)],
        methods=[MethodEntry("nearest-centroid")],
    )
    assert [s.name for s in by_hand.data] == ["omniglot"]
    raw["data"]["big"]["optional"] = False
    with pytest.raises(ValueError, match="data.big.features: file not found"):
        config_from_dict(raw, tmp_path)


@pytest.mark.slow
def test_cli_report_from_a_store(local_table, tmp_path, capsys):
    _, root = local_table
    assert main(["report", str(root), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| omniglot | 5 | 1 | balanced | 2 |" in text  # two seeds pooled
    assert "soft-kmeans" in text and "nearest centroid" in text
    assert (tmp_path / "rep" / "report.html").read_text().lstrip().startswith("<!DOCTYPE html>")
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "not a results folder" in capsys.readouterr().err


def test_local_workers_share_gpus_by_fraction(monkeypatch):
    """Without a GPU here: the slots of ``gpus: 0.25`` on two CUDA devices, as the
    local executor would bind its workers."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    slots = local_devices(Resources(cpus=1, gpus=0.25), cpu_count=16)
    assert slots == ["cuda:0", "cuda:1"] * 4
    assert local_devices(Resources(cpus=4, gpus=0.25), cpu_count=16) == ["cuda:0", "cuda:1"] * 2
    assert local_devices(Resources(cpus=1, gpus=1), cpu_count=16) == ["cuda:0", "cuda:1"]


@pytest.mark.slow
def test_a_store_lists_the_last_sweep_in_its_order(local_table):
    """A report of the folder shows the sweep file's order (here soft-kmeans after
    nearest-centroid, shots and seeds as the grid lists them)."""
    table, root = local_table
    from probfsl.sweeps import read_table

    assert read_table(root)["cell_key"].tolist() == table["cell_key"].tolist()
    assert table["label"].tolist() == ["nearest-centroid"] * 4 + ["soft-kmeans"] * 4


# -- task files -------------------------------------------------------------------------


def _task_files(folder: Path) -> tuple[Path, Path]:
    """A closed 5-way 5-shot and an open-set 5-way 1-shot task file of built-in Omniglot."""
    from probfsl.data import load_dataset, sample_task_indices, save_task_file

    fs = load_dataset("omniglot")
    closed = sample_task_indices(fs, 12, way=5, shot=5, n_query=20, seed=3)
    opened = sample_task_indices(fs, 12, way=5, shot=1, n_query=15, seed=4, n_open=10)
    return (
        save_task_file(folder / "closed.npz", closed),
        save_task_file(folder / "open.npz", opened),
    )


def _task_file_sweep(folder: Path) -> dict:
    return {
        "data": {"om": {"dataset": "omniglot", "tasks": ["closed.npz", "open.npz"]}},
        "methods": ["nearest-centroid", {"method": "soft-kmeans", "preset": "defaults"}],
        "grid": {"shot": [1, 5], "seed": [0, 1], "open": [0, 75], "balance": ["dirichlet"]},
        "run": {"tasks": 500, "device": "cpu"},
    }


def test_task_files_replace_the_axes_they_fix(tmp_path):
    """One cell per task file and method: way, shot, queries and open queries are the
    file's, and the grid's axes but the engine (and run.tasks) do not multiply them."""
    _task_files(tmp_path)
    config = config_from_dict(_task_file_sweep(tmp_path), tmp_path)
    cells = config.cells()
    assert len(cells) == 2 * 2
    shapes = {(Path(c.task_file).name, c.way, c.shot, c.query, c.open_queries) for c in cells}
    assert shapes == {("closed.npz", 5, 5, 20, 0), ("open.npz", 5, 1, 15, 10)}
    assert {(c.seed, c.balance, c.alpha, c.tasks) for c in cells} == {(0, "file", 0.0, 12)}
    argv = cells[0].argv()
    assert argv[argv.index("--task-file") + 1] == str(tmp_path / "closed.npz")
    for flag in ("--way", "--shot", "--query", "--seed", "--tasks", "--open-queries", "--alpha"):
        assert flag not in argv
    raw = _task_file_sweep(tmp_path)
    raw["methods"] = [{"method": "bavardage", "preset": "defaults"}]
    raw["grid"]["engine"] = ["handwritten", "derived"]
    assert len(config_from_dict(raw, tmp_path).cells()) == 2 * 2  # files × engines
    spec = cells[1].spec()
    assert spec.task_file == str(tmp_path / "open.npz") and spec.open_queries == 0


def test_zero_shot_entries_draw_their_tasks_beside_task_files(tmp_path):
    from probfsl.data import load_dataset, sample_task_indices, save_task_file

    fs = load_dataset("wordnet")
    save_task_file(tmp_path / "t.npz", sample_task_indices(fs, 4, way=3, shot=1, n_query=6))
    raw = {
        "data": {"w": {"dataset": "wordnet", "tasks": "t.npz"}},
        "methods": [{"method": "em-dirichlet", "zero_shot": True}, "nearest-centroid"],
        "grid": {"seed": [0, 1]},
    }
    cells = config_from_dict(raw, tmp_path).cells()
    zero = [c for c in cells if c.zero_shot]
    assert len(zero) == 2 and all(c.task_file is None for c in zero)
    assert [c.task_file for c in cells if not c.zero_shot] == [str(tmp_path / "t.npz")]


def test_task_file_cells_keep_drawn_cells_keys_and_follow_the_file(tmp_path):
    """A task file is part of its cells' identity by content (not by place); the cells
    of drawn tasks keep the keys they had without task files."""
    from probfsl.sweeps.runner import plan

    closed, _ = _task_files(tmp_path)
    (tmp_path / "b").mkdir()
    for name in ("closed.npz", "open.npz"):
        (tmp_path / "b" / name).write_bytes((tmp_path / name).read_bytes())

    def keys(folder, tasks=("closed.npz", "open.npz")):
        raw = _task_file_sweep(folder)
        raw["data"]["om"]["tasks"] = list(tasks)
        raw["data"]["drawn"] = {"dataset": "omniglot"}
        return plan(config_from_dict(raw, folder), ResultsStore(tmp_path / "r"))[1]

    here, there = keys(tmp_path), keys(tmp_path / "b")
    assert here == there
    drawn = {"data": {"drawn": {"dataset": "omniglot"}}}
    drawn_keys = plan(
        config_from_dict({**_task_file_sweep(tmp_path), **drawn}, tmp_path),
        ResultsStore(tmp_path / "r"),
    )[1]
    assert set(drawn_keys) <= set(here) and len(here) == len(drawn_keys) + 4
    from probfsl.data import load_dataset, sample_task_indices, save_task_file

    other = sample_task_indices(load_dataset("omniglot"), 12, way=5, shot=5, n_query=20, seed=9)
    save_task_file(tmp_path / "b" / "closed.npz", other)
    changed = keys(tmp_path / "b")
    assert len(set(changed) - set(here)) == 2  # the two cells of the changed file


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("absent", "data.x.tasks: file not found"),
        ("rows", "data.x.tasks: .*must hold row indices in 0..119"),
        ("open without base classes", "data.x.tasks = .*needs at least 2"),
    ],
)
def test_task_file_errors_name_the_source(tmp_path, problem, message):
    from probfsl.data import load_features, sample_task_indices, save_task_file

    features = _three_class_file(tmp_path / "f.npz", novel=6)
    fs = load_features(features)
    if problem == "rows":
        idx = sample_task_indices(fs, 2, way=3, shot=1, n_query=6)
        idx["query"] = idx["query"] + 1000
        save_task_file(tmp_path / "t.npz", idx)
    elif problem == "open without base classes":
        np.savez(features, **{**np.load(features), "split": np.array(["novel"] * 120)})
        fs = load_features(features)
        save_task_file(
            tmp_path / "t.npz", sample_task_indices(fs, 2, way=3, shot=1, n_query=6, n_open=3)
        )
    raw = {"data": {"x": {"features": "f.npz", "tasks": "t.npz"}}, "methods": ["nearest-centroid"]}
    with pytest.raises(ValueError, match=message) as err:
        config_from_dict(raw, tmp_path)
    assert str(err.value).startswith("sweep: ")


@pytest.mark.slow
def test_a_task_file_cell_is_probfsl_run_with_the_file(tmp_path):
    """The stored row of a task-file cell is ``probfsl run --task-file``'s, closed and
    open; the report names the file in its settings."""
    _task_files(tmp_path)
    raw = _task_file_sweep(tmp_path)
    raw["methods"] = ["nearest-centroid"]
    table = sweep(config_from_dict(raw, tmp_path), tmp_path / "r", workers=1)
    assert (table["status"] == "ok").all() and len(table) == 2
    for name in ("closed.npz", "open.npz"):
        out = tmp_path / f"{name}.json"
        argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot"]
        assert main([*argv, "--task-file", str(tmp_path / name), "--out", str(out)]) == 0
        ran = json.loads(out.read_text())
        row = table[table["task_file"] == os.path.join("..", name)].iloc[0]
        assert row["tasks"] == ran["tasks"] == 12
        for key in ("accuracy", "ci95", "ece", "auroc", "ece_open"):
            if key in ran:
                assert row[key] == pytest.approx(ran[key], rel=1e-12), key
    assert "auroc" in ran  # the open-set file was scored as such
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "| om | 5 | 1 | file | 15 | 10 | open.npz |" in text
    assert "| om | 5 | 5 | file | 20 | 0 | closed.npz |" in text
