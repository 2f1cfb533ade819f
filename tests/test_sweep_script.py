"""The local executor's worker processes: a sweep run from a script with or without an
``if __name__ == "__main__":`` guard, and a worker that dies losing only its own call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from probfsl.sweeps import ResultsStore
from probfsl.sweeps.executors import RETRIES, LocalExecutor, Resources

#: the Python example of docs/sweeps.md, on a small configuration
EXAMPLE = """\
import probfsl
from probfsl.sweeps import MethodEntry, RunOptions, Source, SweepConfig

config = SweepConfig(
    data=[Source("omniglot", dataset="omniglot")],
    methods=[MethodEntry("nearest-centroid")],
    grid={"shot": [1], "seed": [0, 1]},
    run=RunOptions(tasks=20, device="cpu"),
)
"""
CALL = """\
table = probfsl.sweep(config, "results/my-sweep", workers=2)
print(table["status"].tolist())
"""


@pytest.mark.parametrize("guard", [False, True], ids=["no-guard", "guard"])
@pytest.mark.slow
def test_the_documented_sweep_runs_as_a_script(tmp_path, guard):
    """The workers do not run the script again, so it works with or without the
    ``if __name__ == "__main__":`` guard, every cell stored as a result."""
    call = "if __name__ == '__main__':\n" + textwrap.indent(CALL, "    ") if guard else CALL
    script = tmp_path / "my_sweep.py"
    script.write_text(EXAMPLE + call)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['ok', 'ok']", done.stdout + done.stderr
    assert "WorkerLost" not in done.stderr
    stored = ResultsStore(tmp_path / "results" / "my-sweep").stored()
    assert sorted(stored.values()) == ["ok", "ok"]


def test_a_function_of_the_main_script_is_refused_with_the_fix():
    def double(item, shared):
        return 2 * item

    double.__module__ = "__main__"
    with pytest.raises(ValueError, match="define the function in a module"):
        list(LocalExecutor(Resources(), workers=1).stream(double, [1]))


# -- a worker that dies -------------------------------------------------------------------


def die_on(item: tuple[str, Path | None], shared) -> str:
    """``item = (name, marks)``: a name ``die`` ends its worker process at once (after
    writing a line to the file ``marks``); ``die-once`` does so only the first time (while
    ``marks`` does not exist); any other name is returned in capitals."""
    name, marks = item
    if name == "die" or (name == "die-once" and not marks.exists()):
        with open(marks, "a") as file:
            file.write("tried\n")
        os._exit(7)
    return name.upper()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_a_call_that_kills_its_worker_is_lost_and_the_others_finish(tmp_path, workers):
    marks = tmp_path / "tries"
    items = [("a", None), ("b", None), ("die", marks), ("c", None), ("d", None), ("e", None)]
    out = {i: (result, error) for i, result, error in LocalExecutor(
        Resources(), workers=workers
    ).stream(die_on, items)}  # fmt: skip
    assert sorted(out) == list(range(len(items)))
    assert [out[i] for i in (0, 1, 3, 4, 5)] == [(n.upper(), "") for n in "abcde"]
    result, error = out[2]
    assert result is None
    assert (
        error
        == f"WorkerLost: its worker process died (exit status 7; on each of {RETRIES + 1} tries)"
    )
    # it ran once, and again RETRIES times on a new worker each time, then was given up
    assert marks.read_text().splitlines() == ["tried"] * (RETRIES + 1)


@pytest.mark.slow
def test_a_call_whose_worker_died_once_runs_again(tmp_path):
    marks = tmp_path / "tries"
    items = [("a", None), ("die-once", marks), ("b", None)]
    results = LocalExecutor(Resources(), workers=2).map(die_on, items)
    assert results == ["A", "DIE-ONCE", "B"]
    assert marks.read_text() == "tried\n"


@pytest.mark.slow
def test_no_retries_gives_a_dead_workers_call_up_at_once(tmp_path):
    marks = tmp_path / "tries"
    items = [("die", marks), ("a", None)]
    out = list(LocalExecutor(Resources(), workers=1, retries=0).stream(die_on, items))
    assert sorted(out) == [
        (0, None, "WorkerLost: its worker process died (exit status 7; once)"),
        (1, "A", ""),
    ]
    assert marks.read_text() == "tried\n"


@pytest.mark.slow
def test_a_call_that_raises_keeps_its_worker():
    """An exception is the call's error (the worker goes on with the next call)."""
    out = dict(
        (i, (r, e))
        for i, r, e in LocalExecutor(Resources(), workers=1).stream(
            exec, ["x = 1", "raise KeyError('k')", "y = 2"]
        )
    )
    assert out == {0: (None, ""), 1: (None, "KeyError: 'k'"), 2: (None, "")}
