"""The results store under damage and upgrades: damaged row files named and skipped or
rerun, rows of other code versions never reused nor pooled, ``--prune``, failed and
lost cells in the sweep's summary and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import probfsl.sweeps.runner as runner
from probfsl.cli import main
from probfsl.sweeps import ResultsStore, config_from_dict, read_table, sweep
from probfsl.sweeps.cell import code_version
from probfsl.sweeps.executors import LocalExecutor, Resources
from probfsl.sweeps.store import read_results, row_problem

TINY = {
    "data": {"omniglot": {"dataset": "omniglot"}},
    "methods": ["nearest-centroid"],
    "grid": {"seed": [0, 1], "query": 15},
    "run": {"tasks": 20, "device": "cpu"},
}
OLD = "0.0.1+0123456789ab"


class InProcess:
    """An executor that runs the calls in this process (one code version for the whole
    test session, no worker start); the indices in ``lose`` come back as a dead worker's."""

    def __init__(self, lose: set[int] | None = None) -> None:
        self.lose = lose or set()
        self.ran: list = []

    def describe(self) -> str:
        return "this test's process"

    def stream(self, fn, items, share=None):
        for i, item in enumerate(items):
            if i in self.lose:
                yield i, None, "WorkerLost: its worker process died"
                continue
            self.ran.append(item)
            shared = None
            if share is not None:
                _, loader, args = share(item)
                shared = loader(*args)
            yield i, fn(item, shared), ""


@pytest.fixture
def executor(monkeypatch):
    """The sweeps of a test run on :class:`InProcess` (``executor.lose`` loses cells)."""
    fake = InProcess()
    monkeypatch.setattr(runner, "make_executor", lambda *args, **kwargs: fake)
    return fake


def _yaml(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _good_row(key: str = "ab12", **change) -> dict:
    row = {
        "cell_key": key,
        "status": "ok",
        "error": "",
        "code_version": "0.1+abc",
        "data": "omniglot",
        "label": "nearest-centroid",
        "method": "nearest-centroid",
        "zero_shot": False,
        "way": 5,
        "shot": 1,
        "query": 15,
        "balance": "balanced",
        "seed": 0,
        "tasks": 20,
        "accuracy": 75.0,
        "ci95": 2.0,
        "baseline": "nearest-centroid",
        "baseline_accuracy": 75.0,
        "baseline_ci95": 2.0,
    }
    row.update(change)
    return row


def _old_copy(root: Path, key: str, accuracy: float = 11.0) -> str:
    """A copy of the stored row ``key`` as an older code version wrote it (another key,
    the given accuracy, an earlier time): the store of a sweep run again after an
    upgrade."""
    row = json.loads((root / "cells" / f"{key}.json").read_text())
    old_key = "0" * 24
    row.update(
        cell_key=old_key,
        code_version=OLD,
        accuracy=accuracy,
        finished="2020-01-01T00:00:00+00:00",
    )
    (root / "cells" / f"{old_key}.json").write_text(json.dumps(row))
    (root / "logs").mkdir(exist_ok=True)
    (root / "logs" / f"{old_key}.log").write_text("old run\n")
    return old_key


# -- damaged row files ---------------------------------------------------------------


DAMAGE = [
    (b"", "empty file"),
    (b"  \n", "empty file"),
    (b"\xff\xfe\x00\x81binary", "binary file, not UTF-8 text"),
    (b"\x00\x01\x02", "binary file, not JSON text"),
    (b'{"cell_key": "ab12", ', "not JSON: Expecting property name enclosed in double quotes"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b"null", "a JSON null, not an object"),
    (b'"text"', "a JSON string, not an object"),
    (b'{"cell_key": "ab12"}', "missing fields status, code_version, data, label"),
    (json.dumps(_good_row(seed="0")).encode(), "field seed is a string, expected an integer"),
    (json.dumps(_good_row(way=5.5)).encode(), "field way is a number, expected an integer"),
    (json.dumps(_good_row(zero_shot=1)).encode(), "field zero_shot is a number, expected a"),
    (json.dumps(_good_row(accuracy="75")).encode(), "field accuracy is a string, expected a"),
    (json.dumps(_good_row(accuracy=None)).encode(), "field accuracy is null, expected a number"),
    (json.dumps(_good_row(status="done")).encode(), "status 'done' is not one of ok, failed"),
    (json.dumps(_good_row("zz99")).encode(), "its cell_key 'zz99' is not its file's name"),
]


@pytest.mark.parametrize(("content", "reason"), DAMAGE)
def test_a_damaged_row_file_is_named_and_left_out(tmp_path, content, reason):
    cells = tmp_path / "cells"
    cells.mkdir()
    (cells / "ab12.json").write_bytes(content)
    (cells / "cd34.json").write_text(json.dumps(_good_row("cd34")))
    store = ResultsStore(tmp_path)
    [bad] = store.damaged()
    assert str(bad).startswith(f"{cells / 'ab12.json'}: not a results row ({reason}")
    assert store.stored() == {"cd34": "ok"}
    assert store.table()["cell_key"].tolist() == ["cd34"]
    assert [r["cell_key"] for r in store.rows(["ab12", "cd34"])] == ["cd34"]
    table, problems = read_results(tmp_path)
    assert len(table) == 1 and problems == [f"{bad}; left out"]


def test_writes_in_progress_are_no_rows(tmp_path):
    """A cell is written to a hidden temporary file of the same suffix, then renamed
    (``atomic_path``); one left by a writer killed in between, empty or whole, is neither
    a row nor a damaged file."""
    cells = tmp_path / "cells"
    cells.mkdir()
    (cells / "cd34.json").write_text(json.dumps(_good_row("cd34")))
    (cells / ".ab12.json.4242.x1y2.tmp.json").write_text("")
    (cells / ".ef56.json.4242.z3w4.tmp.json").write_text(json.dumps(_good_row("ef56")))
    store = ResultsStore(tmp_path)
    assert store.stored() == {"cd34": "ok"}
    assert store.damaged() == []


def test_a_good_row_and_a_failed_row_pass_the_check():
    assert row_problem(_good_row()) is None
    failed = {k: v for k, v in _good_row().items() if "accuracy" not in k and k != "ci95"}
    assert row_problem({**failed, "status": "failed"}) is None  # no results needed
    assert row_problem({**failed, "status": "ok"}).startswith("missing fields")


def test_a_store_of_only_damaged_files_is_a_clear_error(tmp_path):
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "ab12.json").write_text("")
    with pytest.raises(ValueError, match=r"no stored cells \(1 damaged row files\)"):
        read_table(tmp_path)


def test_a_damaged_order_file_keeps_the_sorted_order(tmp_path):
    store = ResultsStore(tmp_path)
    store.record("b", _good_row("b", seed=1))
    store.record("a", _good_row("a", seed=0))
    (tmp_path / "order.json").write_text("{not json")
    assert store.order() == []
    assert store.table()["seed"].tolist() == [0, 1]


def test_report_skips_damaged_files_and_counts_them(executor, tmp_path, capsys):
    root = tmp_path / "r"
    sweep(config_from_dict(TINY), root)
    (root / "cells" / "ab12.json").write_bytes(b"")
    (root / "cells" / "cd34.json").write_text("[1, 2]")
    (root / "cells" / "ef56.json").write_bytes(b"\x00\x01\x02")
    capsys.readouterr()
    assert main(["report", str(root), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert f"{root / 'cells' / 'ab12.json'}: not a results row (empty file); left out" in err
    assert f"{root / 'cells' / 'cd34.json'}: not a results row (a JSON list" in err
    assert f"{root / 'cells' / 'ef56.json'}: not a results row (binary file, not JSON text)" in err
    markdown = (tmp_path / "rep" / "report.md").read_text()
    assert "- 3 damaged row files left out (not results rows" in markdown
    assert f"- {root / 'cells' / 'ab12.json'}: not a results row (empty file)" in markdown
    assert "2 cells: 2 ok, 0 failed." in markdown


def test_sweep_reruns_a_damaged_cell_and_replaces_its_file(executor, tmp_path, caplog):
    root = tmp_path / "r"
    first = sweep(config_from_dict(TINY), root)
    damaged, kept = first["cell_key"].tolist()
    (root / "cells" / f"{damaged}.json").write_bytes(b"\xff\xfe")
    (root / "cells" / "ab12.json").write_text("[]")  # not a cell of the sweep
    executor.ran.clear()
    with caplog.at_level("INFO", logger="probfsl"):
        again = sweep(config_from_dict(TINY), root)
    assert [cell.seed for cell in executor.ran] == [0]  # the damaged cell only
    assert again["cell_key"].tolist() == [damaged, kept]
    assert (again["status"] == "ok").all()
    assert json.loads((root / "cells" / f"{damaged}.json").read_text())["cell_key"] == damaged
    text = caplog.text
    assert f"{damaged}.json: not a results row (binary file, not UTF-8 text); its cell" in text
    assert "ab12.json: not a results row (a JSON list, not an object); not a cell" in text
    assert [bad.path.name for bad in ResultsStore(root).damaged()] == ["ab12.json"]


def test_a_corrupt_table_file_is_rebuilt_from_the_cells_or_named(executor, tmp_path, capsys):
    root = tmp_path / "r"
    table = sweep(config_from_dict(TINY), root)
    (root / "results.parquet").write_bytes(b"PAR1 not really")
    rebuilt, problems = read_results(root / "results.parquet")
    assert rebuilt["cell_key"].tolist() == table["cell_key"].tolist()
    assert problems[0].startswith(f"{root / 'results.parquet'}: not a readable table (")
    assert problems[0].endswith(f"rebuilt from {root / 'cells'}")
    assert len(read_table(root / "results.parquet")) == 2  # readable again
    # a table file outside a store: named, not a traceback
    for name, content in (("t.parquet", b"garbage"), ("t.csv", b"\xff\xfe\x00\x81")):
        (tmp_path / name).write_bytes(content)
        assert main(["report", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert f"probfsl: error: {tmp_path / name}: not a readable results table (" in err
    (tmp_path / "u.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"u\.csv: not a results table"):
        read_table(tmp_path / "u.csv")


# -- code versions -------------------------------------------------------------------


def test_sweep_reruns_a_row_of_another_code_version(executor, tmp_path):
    root = tmp_path / "r"
    first = sweep(config_from_dict(TINY), root)
    stale = first["cell_key"].iloc[1]
    path = root / "cells" / f"{stale}.json"
    row = json.loads(path.read_text())
    path.write_text(json.dumps({**row, "code_version": OLD, "accuracy": 11.0}))
    old_key = _old_copy(root, first["cell_key"].iloc[0])
    executor.ran.clear()
    again = sweep(config_from_dict(TINY), root)
    assert [cell.seed for cell in executor.ran] == [1]  # the stale row is not reused
    assert (again["code_version"] == code_version()).all()
    assert again["accuracy"].tolist() == first["accuracy"].tolist()
    assert old_key not in again["cell_key"].tolist()  # an older version's row: not shown
    assert ResultsStore(root).versions() == {code_version(): 2, OLD: 1}


@pytest.mark.slow
def test_cli_report_uses_one_code_version(executor, tmp_path, capsys):
    """A store of two current seeds and an older version's row (accuracy 11): the report
    shows the current version only and says what it left out; --code-version picks the
    older one."""
    root = tmp_path / "r"
    table = sweep(config_from_dict(TINY), root)
    _old_copy(root, table["cell_key"].iloc[0])
    pooled = (table["accuracy"] * table["tasks"]).sum() / table["tasks"].sum()
    capsys.readouterr()
    assert main(["report", str(root), "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    note = (
        f"1 row of another code version left out ({OLD}: 1 row): this report shows code "
        f"version {code_version()} only (the installed code's version), and never pools "
        "two versions; --code-version picks another."
    )
    assert note in err
    markdown = (tmp_path / "a" / "report.md").read_text()
    assert f"- {note}" in markdown
    assert "2 cells: 2 ok, 0 failed." in markdown
    assert f"| omniglot | 5 | 1 | balanced | 2 | {pooled:.2f} ± " in markdown
    assert OLD not in markdown.split("## Accuracy")[1]
    assert main(["report", str(root), "--out", str(tmp_path / "b"), "--code-version", OLD]) == 0
    markdown = (tmp_path / "b" / "report.md").read_text()
    assert "| omniglot | 5 | 1 | balanced | 1 | 11.00 ± " in markdown
    assert "1 cells: 1 ok, 0 failed." in markdown and "(as asked)" in markdown
    assert main(["report", str(root), "--code-version", "9.9+none"]) == 2
    err = capsys.readouterr().err
    assert "no rows of code version '9.9+none'; the results hold" in err
    assert f"{OLD} (1 row)" in err


def test_cli_report_prune_removes_other_versions(executor, tmp_path, capsys):
    root = tmp_path / "r"
    table = sweep(config_from_dict(TINY), root)
    old_key = _old_copy(root, table["cell_key"].iloc[0])
    (root / "cells" / "ab12.json").write_bytes(b"")
    capsys.readouterr()
    assert main(["report", str(root), "--prune"]) == 0
    out = capsys.readouterr().out
    assert (
        f"pruned {root}: removed 1 row of other code versions ({OLD}: 1) and 1 damaged "
        f"row file; kept the rows of code version {code_version()}"
    ) in out
    assert not (root / "cells" / f"{old_key}.json").exists()
    assert not (root / "logs" / f"{old_key}.log").exists()
    assert not (root / "cells" / "ab12.json").exists()
    assert ResultsStore(root).versions() == {code_version(): 2}
    assert OLD not in read_table(root / "results.csv")["code_version"].tolist()
    markdown = (root / "report" / "report.md").read_text()
    assert "left out" not in markdown and "pruned" in markdown
    assert main(["report", str(root / "results.csv"), "--prune"]) == 2
    assert "--prune removes rows from a results folder" in capsys.readouterr().err


# -- failed and lost cells -----------------------------------------------------------


@pytest.fixture
def failing(monkeypatch):
    """The runs of the seeds in the returned set raise (in ``probfsl run`` itself, so
    that the cell records its error and traceback as a real failure does)."""
    import probfsl.running

    seeds: set[int] = set()
    real = probfsl.running.run

    def run(spec, *rest, **kwargs):
        if spec.seed in seeds:
            raise RuntimeError(f"seed {spec.seed} cannot run")
        return real(spec, *rest, **kwargs)

    monkeypatch.setattr(probfsl.running, "run", run)
    return seeds


def test_a_sweep_whose_cells_all_failed_exits_1(executor, failing, tmp_path, capsys):
    failing.update({0, 1})
    path = _yaml(tmp_path, TINY)
    results = tmp_path / "r"
    assert main(["sweep", str(path), "--results", str(results)]) == 1
    captured = capsys.readouterr()
    assert f"2 cells in {results}: 0 ok, 2 failed" in captured.out
    assert "2 of 2 cells failed: their errors are stored" in captured.out
    assert f"their logs are in {results / 'logs'}" in captured.out
    [summary] = [line for line in captured.err.splitlines() if "error:" in line]
    assert summary == (
        f"probfsl: error: every cell failed (2 of 2); see the errors above and the logs in "
        f"{results / 'logs'}"
    )
    failed = [x for x in captured.out.splitlines() if x.startswith("failed: ")]
    assert len(failed) == 2
    for line in failed:
        assert "RuntimeError: seed" in line and "(log: " in line
        assert "Traceback" in Path(line.rsplit("(log: ", 1)[1].rstrip(")")).read_text()


def test_a_sweep_with_some_failures_says_how_many(executor, failing, tmp_path, capsys):
    failing.add(1)
    path = _yaml(tmp_path, TINY)
    results = tmp_path / "r"
    assert main(["sweep", str(path), "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert f"2 cells in {results}: 1 ok, 1 failed" in out
    assert "1 of 2 cells failed: their errors are stored (--retry-failed runs them" in out
    [failed] = [x for x in out.splitlines() if x.startswith("failed: ")]
    assert failed.startswith(
        "failed: omniglot/nearest-centroid 5w1s balanced seed 1: RuntimeError: seed 1 cannot "
        f"run (log: {results / 'logs'}"
    )


def test_a_lost_cell_is_not_stored_and_runs_again(executor, tmp_path, capsys):
    path = _yaml(tmp_path, TINY)
    results = tmp_path / "r"
    executor.lose = {0}
    assert main(["sweep", str(path), "--results", str(results)]) == 1
    captured = capsys.readouterr()
    assert f"2 cells in {results}: 1 ok, 0 failed, 1 lost" in captured.out
    assert (
        "lost: omniglot/nearest-centroid 5w1s balanced seed 0: WorkerLost: its worker "
        "process died (not stored: it runs again next time)"
    ) in captured.out
    assert "1 of 2 cells lost their worker process and were not stored" in captured.err
    assert len(ResultsStore(results).stored()) == 1
    assert "WorkerLost" not in read_table(results)["error"].fillna("").str.cat()
    executor.lose, executor.ran = set(), []
    table = sweep(config_from_dict(TINY), results)
    assert [cell.seed for cell in executor.ran] == [0]  # the lost cell, and only it
    assert table["status"].tolist() == ["ok", "ok"]
    executor.lose, executor.ran = {1}, []
    sweep(config_from_dict(TINY), results)
    assert executor.ran == []  # nothing left to run: both are stored
    assert main(["sweep", str(path), "--results", str(results)]) == 0


def test_lost_cells_are_in_the_returned_table(executor, tmp_path):
    executor.lose = {1}
    table = sweep(config_from_dict(TINY), tmp_path)
    assert table["status"].tolist() == ["ok", "lost"]
    assert table["seed"].tolist() == [0, 1]
    assert table["error"].iloc[1] == "WorkerLost: its worker process died"
    assert list(ResultsStore(tmp_path).stored().values()) == ["ok"]


@pytest.mark.slow
def test_the_local_executor_reports_a_dead_worker_as_lost():
    """A call whose worker process exits gives the executor's ``WorkerLost`` error (what
    a sweep never stores)."""
    stream = LocalExecutor(Resources(cpus=1), workers=1).stream(exec, ["import os; os._exit(3)"])
    [(index, result, error)] = list(stream)
    assert (index, result) == (0, None)
    assert error.startswith("WorkerLost")


def test_the_defaults_benchmark_reads_one_code_version(tmp_path, capsys):
    """``benchmarks/bench_defaults.py`` makes its tables from the rows of one code version
    over both its stores (the installed code's where they hold it, else the newest rows',
    or the one asked for), never from rows of two versions."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_defaults.py"
    spec = importlib.util.spec_from_file_location("bench_defaults", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    new, old = code_version(), OLD
    few, zero = ResultsStore(tmp_path / "defaults"), ResultsStore(tmp_path / "zero_shot")
    few.record("a1", _good_row("a1", code_version=new, accuracy=80.0))
    few.record("a2", _good_row("a2", code_version=old, accuracy=11.0))
    zero.record("b1", _good_row("b1", code_version=old, zero_shot=True, accuracy=12.0))
    zero.record("b2", _good_row("b2", code_version=new, zero_shot=True, accuracy=60.0))
    rows = bench.stored_rows([few.root, zero.root])
    assert sorted((r["cell_key"], r["accuracy"]) for r in rows) == [("a1", 80.0), ("b2", 60.0)]
    assert "2 rows of another code version left out" in capsys.readouterr().err
    rows = bench.stored_rows([few.root, zero.root], code_version=old)
    assert sorted(r["cell_key"] for r in rows) == ["a2", "b1"]
