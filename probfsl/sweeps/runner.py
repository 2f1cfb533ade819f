"""Run a sweep: its cells not yet in the store, on an executor, each row stored as it ends."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from probfsl.progress import progress as progress_bar
from probfsl.sweeps.cell import (
    Cell,
    cell_job,
    code_version,
    data_digest,
    file_digest,
    source_of,
)
from probfsl.sweeps.config import SweepConfig, load_config
from probfsl.sweeps.executors import make_executor
from probfsl.sweeps.store import ResultsStore

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("probfsl.sweep")


@dataclass(frozen=True)
class Job:
    """A cell to run and its key in the results store."""

    key: str
    cell: Cell


#: the ``status`` of a cell whose run did not end with a row (its worker process died,
#: the executor failed): shown in the sweep's table, never stored
LOST = "lost"

#: seconds between rewrites of the results tables while a sweep runs
TABLE_EVERY = 30.0


def plan(
    config: SweepConfig, store: ResultsStore, retry_failed: bool = False
) -> tuple[list[Job], list[str]]:
    """``(jobs to run, keys of every cell)``: the cells of ``config`` that ``store`` does
    not hold as a row of this code version (a cell with no row, a damaged row file, or a
    row that another code version computed), and its failed cells with
    ``retry_failed``; and all the sweep's keys."""
    code = code_version()
    digests = {s.name: data_digest(s.dataset, s.features) for s in config.data}
    task_digests = {path: file_digest(path) for s in config.data for path in s.tasks}
    stored, _ = store.scan()
    jobs, keys = [], []
    for cell in config.cells():
        key = cell.key(code, digests[cell.data], task_digests.get(cell.task_file))
        keys.append(key)
        row = stored.get(key)
        if (
            row is None
            or row["code_version"] != code
            or (row["status"] == "failed" and retry_failed)
        ):
            jobs.append(Job(key, cell))
    return jobs, keys


def _note_store(store: ResultsStore, keys: list[str], code: str) -> None:
    """Log what of ``store`` a sweep of ``keys`` (code version ``code``) does not use:
    damaged row files (by name) and rows of other code versions."""
    rows, damaged = store.scan()
    mine = set(keys)
    for bad in damaged:
        if bad.path.stem in mine:
            log.warning("%s; its cell runs again", bad)
        else:
            log.warning(
                "%s; not a cell of this sweep, left alone (probfsl report --prune removes it)",
                bad,
            )
    other = sum(row["code_version"] != code for row in rows.values())
    if other:
        log.info(
            "sweep: the store holds %d row(s) of other code versions: they are not reused, "
            "nor reported with this version's rows (probfsl report --prune removes them)",
            other,
        )


def sweep(
    config: SweepConfig | str | Path,
    results: str | Path,
    executor: str = "local",
    address: str | None = None,
    workers: int | None = None,
    retry_failed: bool = False,
    progress: bool = False,
) -> pd.DataFrame:
    """Run every cell of ``config`` (a :class:`SweepConfig` or a YAML file) that the
    results store ``results`` (a folder) does not hold; return the sweep's table (a pandas
    ``DataFrame``, one row per cell, stored ones included).

    ``executor``: ``"local"`` (worker processes on this machine, ``workers`` of them) or
    ``"ray"`` (``address``: ``None`` for a local cluster of ``workers`` CPUs, ``"auto"``,
    or ``"ray://host:port"``). A cell that fails is stored with its error and the others
    go on; it is run again only with ``retry_failed``. Rows are stored as cells end, so
    an interrupted sweep, run again, resumes where it stopped.

    A cell whose run did not return a row (its worker process died, the executor
    failed) is not stored: it has ``status`` ``"lost"`` in the returned table and runs
    again in the next sweep (the local executor first runs a cell whose worker died once
    more, on a new worker, while the others go on). A stored row that another code
    version computed, or a damaged row file (named in a warning), is run again and
    replaced.
    """
    if not isinstance(config, SweepConfig):
        config = load_config(config)
    store = ResultsStore(results)
    runner = make_executor(executor, config.resources, address, workers)
    jobs, keys = plan(config, store, retry_failed)
    code = code_version()
    _note_store(store, keys, code)
    store.set_order(keys)
    log.info(
        "sweep: %d cells, %d stored, %d to run on %s",
        len(keys),
        len(keys) - len(jobs),
        len(jobs),
        runner.describe(),
    )
    last = time.monotonic()
    lost: dict[str, dict] = {}

    cells = [job.cell for job in jobs]
    try:
        with progress_bar(len(jobs), "sweep", "cells", progress) as bar:
            for index, result, error in runner.stream(cell_job, cells, source_of):
                key, cell = jobs[index].key, cells[index]
                bar.update(1)
                if error:  # the executor's failure, not the cell's: not a result
                    row = {"status": LOST, "error": error}
                    lost[key] = _full_row(cell, row, code, store.root)
                    log.warning(
                        "sweep: %s lost: %s (not stored: it runs again)", cell.describe(), error
                    )
                    continue
                row, text = result
                store.record(key, _full_row(cell, row, code, store.root), text)
                if row["status"] != "ok":
                    log.info("sweep: %s failed: %s", cell.describe(), row["error"])
                if time.monotonic() - last > TABLE_EVERY:
                    store.write_tables()
                    last = time.monotonic()
    finally:
        store.write_tables()
    return store.table(keys, extra=lost)


#: the cell's options that name its setting in the table (a zero-shot run's own row says
#: ``way`` "3-10"; the cell's ``0`` keeps the column whole)
_CELL_WINS = ("data", "label", "zero_shot", "way", "shot", "query", "balance", "alpha", "seed")


def _full_row(cell, row: dict, code: str, root: Path) -> dict:
    """A stored row: the cell's options, the run's result fields, versions, time; a
    feature file's path relative to the store's folder ``root``."""
    import torch

    import probfsl

    out = dict(row)
    fields = cell.fields()
    ran_params, ran_preset = out.pop("params", None), out.pop("preset", None)
    for key, value in fields.items():
        if key in _CELL_WINS or key not in out:
            out[key] = value
    for name in ("features", "task_file"):  # files named from the store's folder
        if getattr(cell, name) is not None:
            out[name] = os.path.relpath(getattr(cell, name), root.resolve())
    out["device_requested"] = cell.device
    if cell.device != "auto":
        out.setdefault("device", cell.device)
    out["ran_preset"] = ran_preset
    out["ran_params"] = ran_params if out["status"] == "ok" else None
    out.setdefault("probfsl_version", probfsl.__version__)
    out.setdefault("torch_version", torch.__version__)
    if out.setdefault("code_version", code) != code:
        log.warning(
            "sweep: %s ran probfsl %s, this process has %s: install the same probfsl on every node",
            cell.describe(),
            out["code_version"],
            code,
        )
    out["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    return out
