"""Calibration of every method before and after base-episode temperature scaling.

For each data set and few-shot setting (5-way, 75 queries, Dirichlet-unbalanced
alpha* = 2 and balanced, 1- and 5-shot): accuracy, ECE (15 equal-width bins), adaptive
ECE, NLL and Brier score of the query probabilities, each the mean over novel-class
tasks ± 95% CI, for the method as it is and wrapped in
:class:`probfsl.temperature.TemperatureScaled` (one temperature fitted on base-class
episodes of the same setting; novel classes never read). Accuracy must be unchanged.

    python benchmarks/bench_calibration.py [--data-dir DIR] [--tasks 500] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from bench_bavardage import load_sets  # a sibling script

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes
from probfsl.evaluation.calibration import METRICS, calibration_per_task, mean_ci, pooled_ece
from probfsl.methods import METHODS
from probfsl.temperature import TemperatureScaled

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()
#: tasks per setting are divided by this for methods that fit per-task models
SLOW = {"gp-tree": 20, "em-dirichlet": 10}


def scores(proba: torch.Tensor, labels: torch.Tensor) -> dict:
    per_task = calibration_per_task(proba.double(), labels)
    out = {}
    acc = (proba.argmax(-1) == labels).double().mean(-1)
    out["accuracy"], out["accuracy_ci"] = (100 * v for v in mean_ci(acc.numpy()))
    for name in METRICS:
        out[name], out[f"{name}_ci"] = mean_ci(per_task[name].numpy())
    out["pooled_ece"] = pooled_ece(proba.double(), labels)
    return out


def rows_for(fs, data_name, method, shot, balance, n_tasks, n_episodes, seed) -> list[dict]:
    n = max(10, n_tasks // SLOW.get(method, 1))
    episodes = sample_episodes(fs, n, 5, shot, 75, balance=balance, seed=seed)
    tic = time.perf_counter()
    plain = make_estimator(method).fit_featureset(fs)
    p_plain = plain.predict_proba(episodes)
    scaled = TemperatureScaled(
        make_estimator(method),
        balance=balance,
        n_episodes=max(20, n_episodes // SLOW.get(method, 1)),
    ).fit_featureset(fs)
    p_scaled = scaled.predict_proba(episodes)
    setting = dict(
        data=data_name,
        method=method,
        shot=shot,
        balance=balance,
        tasks=n,
        temperature=scaled.temperature_[(5, shot, 75)],
        seconds=time.perf_counter() - tic,
        same_labels=bool(torch.equal(p_plain.argmax(-1), p_scaled.argmax(-1))),
    )
    return [
        {**setting, "calibration": "none", **scores(p_plain, episodes.query_labels)},
        {**setting, "calibration": "temperature", **scores(p_scaled, episodes.query_labels)},
    ]


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| data | method | shot | balance | tasks | τ | accuracy | pooled ECE before → after | "
        "ECE before → after | adaptive ECE before → after | NLL before → after | "
        "Brier before → after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for before, after in zip(rows[::2], rows[1::2], strict=True):
        cells = [f"{before['pooled_ece']:.3f} → {after['pooled_ece']:.3f}"] + [
            f"{before[m]:.3f} ± {before[m + '_ci']:.3f} → {after[m]:.3f} ± {after[m + '_ci']:.3f}"
            for m in METRICS
        ]
        acc = f"{before['accuracy']:.2f} ± {before['accuracy_ci']:.2f}"
        if not before["same_labels"]:
            acc += " (labels changed!)"
        lines.append(
            f"| {before['data']} | {before['method']} | {before['shot']} | {before['balance']} "
            f"| {before['tasks']} | {before['temperature']:.3g} | {acc} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--episodes", type=int, default=300, help="base episodes for τ")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--balances", nargs="*", default=["dirichlet", "balanced"])
    parser.add_argument("--shots", nargs="*", type=int, default=[1, 5])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.tasks, args.episodes, args.balances, args.shots = 40, 40, ["dirichlet"], [1]
    sets = {"omniglot-pca64": load_dataset("omniglot"), "wordnet": load_dataset("wordnet")}
    if (args.data_dir / "omniglot_small").exists() and not args.quick:
        sets.update(load_sets(args.data_dir, ["omniglot-1280"]))
    rows = []
    for data_name, fs in sets.items():
        for method in args.methods:
            for shot in args.shots:
                for balance in args.balances:
                    rows += rows_for(
                        fs, data_name, method, shot, balance, args.tasks, args.episodes, args.seed
                    )
                    print(markdown(rows[-2:], "").splitlines()[-1], flush=True)
    header = (
        "## Calibration before and after base-episode temperature scaling\n\n"
        f"5-way, 75 queries, seed {args.seed}; means over novel-class tasks ± 95% CI. "
        "Pooled ECE: 15 equal-width bins over all queries of all tasks; ECE: the same "
        "per task; adaptive ECE: 15 equal-mass bins (both per task, so they "
        "include the finite-sample bias of 75 queries); NLL in nats; Brier summed over "
        f"classes. τ fitted on {args.episodes} base-class episodes per setting (fewer for "
        f"slow methods: {SLOW}). Machine: {os.cpu_count()} CPUs ({platform.machine()}), "
        f"torch {torch.__version__}, {args.threads} thread(s)."
    )
    args.out = args.out or HERE / ("results-quick" if args.quick else "results")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "calibration"
    (args.out / f"{name}.md").write_text(markdown(rows, header))
    (args.out / f"{name}.json").write_text(
        json.dumps({"rows": rows}, indent=1, default=lambda v: float(np.asarray(v)))
    )
    print(f"wrote {args.out / name}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
