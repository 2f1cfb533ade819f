"""Every method at the command line's defaults on small data sets, against nearest centroid.

A user's own folder of images is often small: a handful of base and novel classes of a
few images each. This benchmark makes such data sets from real features (the built-in
Omniglot and WordNet sets): for each of several seeds it draws a few base and novel
classes and keeps 5-10 items of each, then runs every tunable method as ``probfsl run``
does by default (``--preset auto``: the search on base-class episodes, its nearest
centroid fallback and temperature calibration), once more with ``--calibrate none``,
and reports accuracy, nearest centroid's accuracy on the same tasks and the query NLL
with and without calibration, each ± 95% CI, and the method that ran.

Acceptance: accuracy not below nearest centroid's (within the 95% intervals) and the
calibrated NLL not above the uncalibrated one. Each run starts with an empty tuning
cache of its own (so every search runs).

    python benchmarks/bench_small_data.py [--quick] [--tasks 300] [--sets 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SOURCES = ("omniglot", "wordnet")


def small_set(source: str, seed: int):
    """A small data set drawn from the built-in ``source``: 4-6 base and 3-5 novel classes
    (from the source's own base and novel classes), 5-10 items each."""
    from probfsl.data import FeatureSet, load_dataset

    fs = load_dataset(source)
    rng = np.random.default_rng([seed, 2024])
    n_base, n_novel = int(rng.integers(4, 7)), int(rng.integers(3, 6))
    per_class = int(rng.integers(5, 11))
    rows, labels, split = [], [], []
    for part, count in (("base", n_base), ("novel", n_novel)):
        for c in rng.choice(fs.classes_in(part), count, replace=False):
            members = np.flatnonzero((fs.labels == c) & (fs.split == part))
            take = rng.choice(members, min(per_class, members.size), replace=False)
            rows.extend(take)
            labels.extend([len(set(labels))] * take.size)
            split.extend([part] * take.size)
    name = f"{source}-s{seed} ({n_base}b/{n_novel}n x {per_class})"
    small = FeatureSet(
        features=fs.features[rows],
        labels=np.array(labels),
        class_names=[str(c) for c in range(len(set(labels)))],
        split=np.array(split),
        name=name,
    )
    return small, n_novel, per_class


def run(method: str, fs, way: int, query: int, tasks: int, calibrate: str | None) -> dict:
    """``probfsl run`` at its defaults on ``fs`` (``calibrate`` None: the default)."""
    import probfsl

    spec = probfsl.RunSpec(
        method, features=fs, way=way, shot=1, query=query, tasks=tasks, calibrate=calibrate
    )
    return probfsl.run(spec, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 set per source, 100 tasks")
    parser.add_argument("--tasks", type=int, default=300, help="novel tasks per cell")
    parser.add_argument("--sets", type=int, default=3, help="small data sets per source")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "small_data")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.sets = 100, 1
    torch.set_num_threads(1)
    import logging

    logging.getLogger("probfsl").setLevel(logging.WARNING)  # the table says what ran
    from probfsl.tuning import SEARCH_SPACES

    rows, tic = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["PROBFSL_CACHE_DIR"] = cache
        for source in SOURCES:
            for seed in range(args.sets):
                fs, way, per_class = small_set(source, seed)
                query = way * min(5, per_class - 1)
                for method in SEARCH_SPACES:
                    start = time.perf_counter()
                    cal = run(method, fs, way, query, args.tasks, None)
                    raw = run(method, fs, way, query, args.tasks, "none")
                    row = {
                        "data": fs.name,
                        "way": way,
                        "query": query,
                        "method": method,
                        "ran": cal["method_run"],
                        "accuracy": cal["accuracy"],
                        "ci95": cal["ci95"],
                        "nc_accuracy": cal["baseline_accuracy"],
                        "nc_ci95": cal["baseline_ci95"],
                        "nll_calibrated": cal["nll"],
                        "nll_calibrated_ci95": cal["nll_ci95"],
                        "nll_uncalibrated": raw["nll"],
                        "nll_uncalibrated_ci95": raw["nll_ci95"],
                        "temperature": cal.get("temperature") or 1.0,
                        "seconds": time.perf_counter() - start,
                        "auto": cal.get("auto", ""),
                    }
                    row["accuracy_ok"] = bool(
                        row["accuracy"] + row["ci95"] >= row["nc_accuracy"] - row["nc_ci95"]
                    )
                    # τ = 1 (not fitted) leaves the NLL as it is up to float rounding
                    slack = 1e-6 * max(1.0, row["nll_uncalibrated"])
                    row["nll_ok"] = bool(row["nll_calibrated"] <= row["nll_uncalibrated"] + slack)
                    rows.append(row)
                    print(
                        f"{fs.name:32} {method:16} ran {row['ran']:16} "
                        f"{row['accuracy']:6.2f} ± {row['ci95']:4.2f} "
                        f"(NC {row['nc_accuracy']:6.2f}) "
                        f"NLL {row['nll_calibrated']:.3f} / {row['nll_uncalibrated']:.3f} "
                        f"tau {row['temperature']:.3g} {row['seconds']:.0f} s",
                        flush=True,
                    )
    seconds = time.perf_counter() - tic
    write(rows, args, seconds)


def _pm(value: float, ci: float, digits: int = 2) -> str:
    return f"{value:.{digits}f} ± {ci:.{digits}f}"


def write(rows: list[dict], args, seconds: float) -> None:
    """``OUT.json`` (every row) and ``OUT.md`` (the table and the acceptance counts)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "tasks": args.tasks,
        "sets_per_source": args.sets,
        "seconds": round(seconds, 1),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
    }
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    command = "python benchmarks/bench_small_data.py" + (" --quick" if args.quick else "")
    lines = [
        f"# Small data sets: defaults against nearest centroid (`{command}`)",
        "",
        "| data | method | ran | accuracy (%) | nearest centroid (%) | NLL calibrated | "
        "NLL uncalibrated | τ | acc ok | NLL ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['data']} | {r['method']} | {r['ran']} | {_pm(r['accuracy'], r['ci95'])} | "
            f"{_pm(r['nc_accuracy'], r['nc_ci95'])} | "
            f"{_pm(r['nll_calibrated'], r['nll_calibrated_ci95'], 3)} | "
            f"{_pm(r['nll_uncalibrated'], r['nll_uncalibrated_ci95'], 3)} | "
            f"{r['temperature']:.3g} | {'yes' if r['accuracy_ok'] else 'NO'} | "
            f"{'yes' if r['nll_ok'] else 'NO'} |"
        )
    acc_ok = sum(r["accuracy_ok"] for r in rows)
    nll_ok = sum(r["nll_ok"] for r in rows)
    lines += [
        "",
        f"Accuracy not below nearest centroid (within the 95% intervals): {acc_ok} of "
        f"{len(rows)} cells; calibrated NLL not above uncalibrated: {nll_ok} of {len(rows)}. "
        f"{args.tasks} novel tasks a cell (1-shot, balanced), {len(rows)} cells in "
        f"{seconds / 60:.1f} min on one thread.",
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
