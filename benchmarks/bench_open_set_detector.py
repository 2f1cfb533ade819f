"""How good must the open/closed contrast be for the transductive methods to keep their
accuracy? An ablation of the open-set benchmark (``bench_open_set.py``).

The transductive open-set mixtures (soft-kmeans, vmp-gmm, BAVARDAGE) weight every query
by its posterior probability of being closed, o_q = σ(logit π_0 + ℓ_q), where ℓ_q is the
full-space contrast ln p_0(x_q) - ln p̄(x_q) of the base classes' two-covariance model
(:meth:`probfsl.inference.background.TwoCovarianceReading.open_log_odds`). Here ℓ_q is
replaced, for the task's iterations and its last reading alike, by a *synthetic
detector of known quality*: s_q ~ N(d, 1) for the open queries and N(0, 1) for the
closed ones, drawn independently of the features, read as calibrated log-odds
ℓ_q = d s_q - d² / 2 (the log-likelihood ratio of the two Gaussians). Its AUROC is
Φ(d / √2). Each method runs at the defaults of ``probfsl run --open-queries 75``
(:func:`probfsl.running.auto_choice`, cached as for the benchmark) on the same seeded
5-way tasks as ``bench_open_set.py`` (15 closed queries a class, 75 open queries from 5
other novel classes); the row with ``d`` = ``contrast`` is the method's own contrast.
The closed-set accuracy with open queries, against the method's accuracy on the same
tasks without them (*closed only*), shows what the open queries cost at each AUROC.

This is an experiment on the method, not a way to run it: the contrast is swapped with
``unittest.mock.patch.object`` after the background's held-out choices are made
(``fitted_state``), and every task of a cell goes to one ``predict_proba_open`` call so
that the synthetic scores line up with the tasks.

    python benchmarks/bench_open_set_detector.py [--tasks 200] [--methods bavardage ...]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from unittest import mock

import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes
from probfsl.evaluation.calibration import mean_ci
from probfsl.evaluation.open_set import auroc
from probfsl.inference.background import TwoCovarianceReading
from probfsl.running import auto_choice
from probfsl.tuning import SEARCH_SEED

WAY, PER_CLASS, N_OPEN, SEED = 5, 15, 75, 0
#: separations d of the synthetic detector (AUROC Φ(d / √2): 71, 80, 87, 92, 96, 98)
SEPARATIONS = (0.8, 1.2, 1.6, 2.0, 2.5, 3.0)
OUT = Path(__file__).parent / "results" / "open_set_detector"


def synthetic_log_odds(is_open: torch.Tensor, d: float, seed: int) -> torch.Tensor:
    """Calibrated log-odds d s - d² / 2 of s ~ N(d · is_open, 1), independent of the data."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(is_open.shape, generator=gen, dtype=torch.float64) + d * is_open.double()
    return d * s - d * d / 2


def fitted(method: str, fs, shot: int, n_open: int):
    """The estimator of ``probfsl run`` (``--preset auto``) for the cell, fitted, with its
    background's held-out choices made."""
    choice = auto_choice(
        method, fs, {}, torch.device("cpu"), torch.float32, False,
        way=WAY, shot=shot, query=WAY * PER_CLASS, seed=SEARCH_SEED, open_queries=n_open,
    )  # fmt: skip
    ran = choice.method_run(method)
    if ran != method:
        raise SystemExit(f"{method}: the search chose {ran}; nothing transductive to ablate")
    if "chunk" in make_estimator(ran).get_params():  # every task in one call (see above)
        choice.params = {**choice.params, "chunk": 10**9}
    model = make_estimator(ran, choice.preset, **choice.params).fit_featureset(fs)
    model.fitted_state()  # the held-out choices, read with the method's own contrast
    return model, choice.params


def closed_accuracy(proba: torch.Tensor, labels: torch.Tensor, is_open: torch.Tensor):
    """Per-task accuracy (%) of the argmax over the known classes on the closed queries."""
    right = (proba[..., :WAY].argmax(-1) == labels) & ~is_open
    return 100 * right.double().sum(-1) / (~is_open).sum(-1)


def run_cell(method: str, data: str, shot: int, tasks: int) -> list[dict]:
    fs = load_dataset(data)
    closed_model, _ = fitted(method, fs, shot, 0)
    closed = sample_episodes(fs, tasks, WAY, shot, WAY * PER_CLASS, seed=SEED)
    only = 100 * (closed_model.predict_proba(closed).argmax(-1) == closed.query_labels).double()
    only = mean_ci(only.mean(-1))
    model, params = fitted(method, fs, shot, N_OPEN)
    episodes = sample_episodes(fs, tasks, WAY, shot, WAY * PER_CLASS, seed=SEED, n_open=N_OPEN)
    is_open = episodes.open_mask
    rows = []
    for d in ("contrast", *SEPARATIONS):
        if d == "contrast":
            proba = model.predict_proba_open(episodes)
        else:
            odds = synthetic_log_odds(is_open, d, SEED + 1)

            def swapped(reading, query_weights=None, odds=odds):
                if reading.yq.shape[:2] != odds.shape:
                    raise RuntimeError("the tasks reached the contrast in pieces")
                return odds.to(reading.yq)

            with mock.patch.object(TwoCovarianceReading, "open_log_odds", swapped):
                proba = model.predict_proba_open(episodes)
        acc = mean_ci(closed_accuracy(proba, episodes.query_labels, is_open))
        area = mean_ci(100 * auroc(proba[..., -1].double(), is_open))
        rows.append({
            "method": method, "data": data, "shot": shot, "tasks": tasks,
            "detector": d if d == "contrast" else f"synthetic d={d}",
            "expected_auroc": None if d == "contrast" else 100 * _phi(d / math.sqrt(2)),
            "closed_only": only, "closed_acc": acc, "auroc": area, "params": params,
        })  # fmt: skip
        r = rows[-1]
        print(
            f"{data} {shot}-shot {method:12s} {r['detector']:16s} closed acc "
            f"{acc[0]:.2f}±{acc[1]:.2f} (closed only {only[0]:.2f})  AUROC {area[0]:.2f}",
            flush=True,
        )
    return rows


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--datasets", nargs="+", default=["wordnet", "omniglot"])
    parser.add_argument("--shots", nargs="+", type=int, default=[1, 5])
    parser.add_argument("--methods", nargs="+", default=["soft-kmeans", "vmp-gmm", "bavardage"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tic = time.perf_counter()
    rows = [
        row
        for data in args.datasets
        for shot in args.shots
        for method in args.methods
        for row in run_cell(method, data, shot, args.tasks)
    ]
    write(rows, args, time.perf_counter() - tic)


def write_json(out: Path, rows: list[dict], seconds: float) -> None:
    """``rows`` with the run's time and machine, as ``out`` + ``.json``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"rows": rows, "seconds": seconds, "machine": platform.platform()}, indent=1)
        + "\n"
    )


def write(rows: list[dict], args, seconds: float) -> None:
    write_json(args.out, rows, seconds)
    lines = [
        "# The open/closed contrast against a synthetic detector of known AUROC",
        "",
        f"5-way tasks, {PER_CLASS} closed queries a class and {N_OPEN} open queries from 5 "
        f"other novel classes, {args.tasks} seeded tasks a cell (seed {SEED}), each method at "
        "the defaults of `probfsl run --open-queries 75`. *contrast*: the method as it "
        "runs; *synthetic d*: its contrast replaced by calibrated log-odds of scores drawn "
        "independently of the features, N(d, 1) for open and N(0, 1) for closed queries "
        "(expected AUROC Φ(d/√2)). Closed-set accuracy with the open queries and AUROC "
        "(%, mean over tasks ± 95% CI); *closed only*: the same tasks without them.",
        "",
        "| data, shot | method | detector | expected AUROC | AUROC | closed acc. | closed only "
        "| loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        expected = "—" if r["expected_auroc"] is None else f"{r['expected_auroc']:.1f}"
        lines.append(
            f"| {r['data']}, {r['shot']} | {r['method']} | {r['detector']} | {expected} | "
            f"{r['auroc'][0]:.2f} ± {r['auroc'][1]:.2f} | "
            f"{r['closed_acc'][0]:.2f} ± {r['closed_acc'][1]:.2f} | "
            f"{r['closed_only'][0]:.2f} | {r['closed_only'][0] - r['closed_acc'][0]:.2f} |"
        )
    lines += ["", f"{len(rows)} rows in {seconds / 60:.1f} min on {args.threads} thread(s)."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
