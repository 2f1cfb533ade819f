"""Sweeps against the shell loop they replace, and one cell of a million tasks.

1. **Throughput.** The same cells (built-in Omniglot; nearest centroid, soft k-means and
   BAVARDAGE at their defaults; 1 and 5 shots; ``--seeds`` seeds) run three ways, each
   timed as a whole:

   * the peer: one ``probfsl run`` process per cell, one after another (what a shell
     loop, or ``subprocess.call`` in a script, does);
   * ``probfsl sweep`` on the local executor (worker processes, no server);
   * ``probfsl sweep --executor ray`` on a local Ray cluster started for it.

   The accuracies of the three must agree exactly (same tasks, same threads).
2. **Memory.** ``probfsl sweep`` of one nearest-centroid cell with ``--tasks`` tasks
   (default 1,000,000) under an address-space limit (``--limit-gb``), against the same
   cell with 10,000 tasks: the peak resident memory of the worker processes.

Writes ``results/sweep.md`` and ``results/sweep.json``.

    python benchmarks/bench_sweep.py [--tasks-per-cell 500] [--seeds 4] [--tasks 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
PROBFSL = [sys.executable, "-m", "probfsl.cli"]


def sweep_file(folder: Path, name: str, config: dict) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def timed(command: list[str], limit_gb: float | None = None) -> tuple[float, int]:
    """Wall seconds of ``command`` and the peak resident memory (bytes) of its processes."""

    def limit() -> None:
        if limit_gb:
            size = int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    script = (
        "import resource, subprocess, sys\n"
        "code = subprocess.call(sys.argv[1:])\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(code)\n"
    )
    tic = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script, *command],
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    seconds = time.perf_counter() - tic
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds, int(done.stdout.split()[-1]) * 1024


def throughput(folder: Path, tasks: int, seeds: int, workers: int) -> dict:
    config = {
        "data": {"omniglot": {"dataset": "omniglot"}},
        "methods": [
            {"method": m, "preset": "defaults"}
            for m in ("nearest-centroid", "soft-kmeans", "bavardage")
        ],
        "grid": {"shot": [1, 5], "seed": list(range(seeds))},
        "run": {"tasks": tasks, "device": "cpu"},
    }
    path = sweep_file(folder, "throughput", config)
    from probfsl.sweeps import load_config, read_table

    cells = load_config(path).cells()
    loop_rows = []
    tic = time.perf_counter()
    for i, cell in enumerate(cells):  # the peer: one process per cell, in turn
        out = folder / f"loop-{i}.json"
        subprocess.run(
            [*PROBFSL, "--threads", "1", "run", *cell.argv(), "--out", str(out)],
            check=True,
            capture_output=True,
        )
        loop_rows.append(json.loads(out.read_text()))
    loop = time.perf_counter() - tic
    local, _ = timed(
        [*PROBFSL, "sweep", str(path), "--results", str(folder / "local"),
         "--workers", str(workers)]
    )  # fmt: skip
    ray, _ = timed(
        [*PROBFSL, "sweep", str(path), "--results", str(folder / "ray"),
         "--executor", "ray", "--workers", str(workers)]
    )  # fmt: skip
    tables = {name: read_table(folder / name) for name in ("local", "ray")}
    by_cell = {(r["method"], r["shot"], r["seed"]): r["accuracy"] for r in loop_rows}
    agree = all(
        by_cell[(r.method, r.shot, r.seed)] == r.accuracy
        for t in tables.values()
        for r in t.itertuples()
    )
    return {
        "cells": len(cells),
        "tasks_per_cell": tasks,
        "workers": workers,
        "loop_seconds": loop,
        "local_seconds": local,
        "ray_seconds": ray,
        "local_speedup": loop / local,
        "ray_speedup": loop / ray,
        "accuracies_agree": agree,
    }


def memory(folder: Path, tasks: int, limit_gb: float) -> list[dict]:
    rows = []
    for n in (10_000, tasks):
        config = {
            "data": {"omniglot": {"dataset": "omniglot"}},
            "methods": [{"method": "nearest-centroid", "preset": "defaults"}],
            "run": {"tasks": n, "device": "cpu"},
        }
        path = sweep_file(folder, f"memory-{n}", config)
        seconds, peak = timed(
            [*PROBFSL, "sweep", str(path), "--results", str(folder / f"memory-{n}"),
             "--workers", "1"],
            limit_gb,
        )  # fmt: skip
        from probfsl.sweeps import read_table

        row = read_table(folder / f"memory-{n}").iloc[0]
        rows.append(
            {
                "tasks": n,
                "status": row["status"],
                "accuracy": row["accuracy"],
                "ci95": row["ci95"],
                "peak_rss_mb": peak / 2**20,
                "limit_gb": limit_gb,
                "seconds": seconds,
            }
        )
    return rows


def markdown(result: dict) -> str:
    t = result["throughput"]
    lines = [
        "# Sweeps: against a shell loop, and a million tasks in one cell",
        "",
        f"Machine: {os.cpu_count()} CPU cores, CPU only. `python benchmarks/bench_sweep.py`.",
        "",
        f"## Throughput: {t['cells']} cells of {t['tasks_per_cell']} tasks (built-in "
        "Omniglot; nearest centroid, soft k-means, BAVARDAGE; 1 and 5 shots; seeds)",
        "",
        "| how | seconds | speed-up over the loop |",
        "|---|---|---|",
        f"| one `probfsl run` process per cell, in turn (the peer) | {t['loop_seconds']:.1f} "
        "| 1.00 |",
        f"| `probfsl sweep`, local executor, {t['workers']} workers | {t['local_seconds']:.1f} "
        f"| {t['local_speedup']:.2f} |",
        f"| `probfsl sweep --executor ray`, local cluster of {t['workers']} CPUs | "
        f"{t['ray_seconds']:.1f} | {t['ray_speedup']:.2f} |",
        "",
        "Accuracies of the three identical, cell by cell: "
        f"{'yes' if t['accuracies_agree'] else 'NO'}.",
        "",
        "## Memory: one nearest-centroid cell",
        "",
        "| tasks | status | accuracy | peak resident memory (MB) | address-space limit (GB) "
        "| seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["memory"]:
        lines.append(
            f"| {r['tasks']:,} | {r['status']} | {r['accuracy']:.2f} ± {r['ci95']:.2f} | "
            f"{r['peak_rss_mb']:.0f} | {r['limit_gb']:g} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        "Tasks are made and scored one batch at a time; what grows with the tasks is the "
        "per-task scores kept for the intervals (about 100 bytes a task for the method and "
        "its baseline).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks-per-cell", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--limit-gb", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--quick", action="store_true", help="100 tasks a cell, 20,000 in one")
    parser.add_argument("--data-dir", type=Path, help="unused: the sweeps use built-in data")
    args = parser.parse_args()
    if args.quick:
        args.tasks_per_cell, args.seeds, args.tasks = 100, 1, 20_000
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result = {
            "throughput": throughput(folder, args.tasks_per_cell, args.seeds, args.workers),
            "memory": memory(folder, args.tasks, args.limit_gb),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (args.out / "sweep.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
