"""What ``probfsl sweep`` and ``probfsl report`` do (their parser is :mod:`probfsl.cli`,
which imports this module only once one of them runs). A sweep's cells run ``probfsl
run`` (:mod:`probfsl.commands`), so these commands sit above it."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_sweep(args: argparse.Namespace) -> int:
    from probfsl.sweeps import ResultsStore, load_config, sweep
    from probfsl.sweeps.runner import plan

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
    failed = table[table["status"] != "ok"]
    print(
        f"{len(table)} cells in {results}: {len(table) - len(failed)} ok, {len(failed)} "
        f"failed (tables: {results / 'results.parquet'}, {results / 'results.csv'})"
    )
    for _, row in failed.iterrows():
        print(f"failed: {row['data']}/{row['label']} seed {row['seed']}: {row['error']}")
    if args.report:
        _write_report(results, Path(args.report), "probfsl sweep report")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(args.results) / "report"
    _write_report(Path(args.results), out, args.title)
    return 0


def _write_report(results: Path, out: Path, title: str) -> None:
    from probfsl.sweeps.report import write_report
    from probfsl.sweeps.store import read_table

    paths = write_report(read_table(results), out, title)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
