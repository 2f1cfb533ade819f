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
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((results / "cells").glob("*.json"))) >= 1:
            break
        time.sleep(0.05)
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
