"""What ``probfsl sweep`` and ``probfsl report`` do (their parser is the ``probfsl``
command's, which imports this module only once one of them runs). A sweep's cells are
runs of :func:`probfsl.running.run`, as ``probfsl run``'s are: both sit above it."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger("probfsl.sweep")

#: damaged row files named one by one in a report's header (the rest are counted)
NAMED_IN_REPORT = 20


def cmd_sweep(args: argparse.Namespace) -> int:
    from probfsl.sweeps import ResultsStore, load_config, sweep
    from probfsl.sweeps.runner import LOST, plan

    config = load_config(args.config)
    results = Path(args.results or f"{Path(args.config).stem}-results")
    if args.dry_run:
        jobs, keys = plan(config, ResultsStore(results), args.retry_failed)
        to_run = {job.key for job in jobs}
        for cell, key in zip(config.cells(), keys, strict=True):
            state = "to run" if key in to_run else "stored"
            print(f"{state:7} {key}  {cell.describe()}  probfsl run {' '.join(cell.argv())}")
        print(f"{len(keys)} cells, {len(keys) - len(jobs)} stored, {len(jobs)} to run")
        return 0
    table = sweep(
        config,
        results,
        executor=args.executor,
        address=args.address,
        workers=args.workers,
        retry_failed=args.retry_failed,
        progress=True,
    )
    status = table["status"]
    n, ok = len(table), int((status == "ok").sum())
    failed, lost = table[status == "failed"], table[status == LOST]
    counts = f"{ok} ok, {len(failed)} failed" + (f", {len(lost)} lost" if len(lost) else "")
    print(
        f"{n} cells in {results}: {counts} "
        f"(tables: {results / 'results.parquet'}, {results / 'results.csv'})"
    )
    for _, row in failed.iterrows():
        path = results / "logs" / f"{row['cell_key']}.log"
        where = f" (log: {path})" if path.is_file() else ""
        print(f"failed: {_describe(row)}: {row['error']}{where}")
    for _, row in lost.iterrows():
        print(f"lost: {_describe(row)}: {row['error']} (not stored: it runs again next time)")
    if len(failed):
        print(
            f"{len(failed)} of {n} cells failed: their errors are stored "
            f"(--retry-failed runs them again), their logs are in {results / 'logs'}"
        )
    if args.report:
        _write_report(results, Path(args.report), "probfsl sweep report")
    if n and ok == 0:
        print(
            f"probfsl: error: every cell failed ({n - ok} of {n}); "
            f"see the errors above and the logs in {results / 'logs'}",
            file=sys.stderr,
        )
        return 1
    if len(lost):
        print(
            f"probfsl: error: {len(lost)} of {n} cells lost their worker process and were not "
            "stored; run the same command again to run them",
            file=sys.stderr,
        )
        return 1
    return 0


def _describe(row) -> str:
    """A table row's cell in a few words: data, method label, setting and seed, as
    :meth:`~probfsl.sweeps.cell.Cell.describe` names it (``open N`` for open-set tasks)."""
    if bool(row.get("zero_shot")):
        setting = "zero-shot"
    else:
        setting = f"{row['way']}w{row['shot']}s {row['balance']}"
        try:  # absent from rows stored before the axis, NaN beside rows that have it
            n_open = int(row.get("open_queries") or 0)
        except (TypeError, ValueError):
            n_open = 0
        if n_open:
            setting += f" open {n_open}"
    return f"{row['data']}/{row['label']} {setting} seed {row['seed']}"


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(args.results) / "report"
    _write_report(
        Path(args.results),
        out,
        args.title,
        code_version=getattr(args, "code_version", None),
        prune=getattr(args, "prune", False),
    )
    return 0


def _write_report(
    results: Path, out: Path, title: str, code_version: str | None = None, prune: bool = False
) -> None:
    """Read the results (naming each problem met), prune the store on request, and write
    the report of one code version."""
    from probfsl.sweeps.report import select_version, write_report
    from probfsl.sweeps.store import ResultsStore, read_results

    if prune and not results.is_dir():
        raise ValueError(f"--prune removes rows from a results folder; {results} is not one")
    table, problems = read_results(results)
    for problem in problems:
        log.warning("%s", problem)
    damaged = [p for p in problems if ": not a results row (" in p]
    notes = []
    if damaged:
        notes.append(
            f"{len(damaged)} damaged row file{'s' * (len(damaged) > 1)} left out "
            "(not results rows; the next sweep that has their cells runs them again):"
        )
        notes += [p.removesuffix("; left out") for p in damaged[:NAMED_IN_REPORT]]
        if len(damaged) > NAMED_IN_REPORT:
            notes.append(f"... and {len(damaged) - NAMED_IN_REPORT} more (listed on stderr)")
    notes += [p for p in problems if p not in damaged]
    if prune:
        _, choice = select_version(table, code_version)
        removed, gone = ResultsStore(results).prune(choice.version)
        what = ", ".join(f"{v}: {n}" for v, n in removed.items())
        rows, files = sum(removed.values()), len(gone)
        message = (
            f"pruned {results}: removed {rows} row{'s' * (rows != 1)} of other code versions"
            + (f" ({what})" if what else "")
            + f" and {files} damaged row file{'s' * (files != 1)}; "
            f"kept the rows of code version {choice.version}"
        )
        print(message)
        notes = [message, *(p for p in problems if p not in damaged)]
        table, _ = read_results(results)
        code_version = choice.version
    paths = write_report(table, out, title, code_version=code_version, notes=notes)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
