"""What do open queries cost when the model is exactly right? The open-set loss of the
true two-covariance model, beside probfsl's transductive methods, on data drawn from it.

Features come from the two-covariance (PLDA) model itself (Ioffe, ECCV 2006; Prince &
Elder, ICCV 2007): a class mean μ_c ~ N(0, B) with B = diag(s b_1, ..., s b_D), a row
x ~ N(μ_c, I). The spectrum b_i = exp(-i / 8) is fixed; the scale s sets how far apart
the classes lie, reported as nearest centroid's 1-shot accuracy. 64 base classes and 40
novel classes of 100 rows each; the tasks are the open-set protocol's (5-way, 15 closed
queries a class, 75 open queries from 5 other novel classes, seed 0).

The *true model* rows read every task with the generating B and I, by soft EM
(Dempster, Laird & Rubin, 1977) of a mixture whose known classes are anchored by their
support rows: the responsibility of component c for query q is proportional to
π_c N(x_q | m_c, I + V_c), with m_c and V_c the posterior mean and covariance of μ_c given
the support rows and the queries weighted by their responsibilities, and π the true
proportions. It is run

- *closed only*: the K known classes on the closed queries (π uniform);
- *background*: with the open queries, the K classes and one background component,
  the predictive N(0, B + I) of a new class (the component probfsl's open-set methods
  add), π_0 = 1/2;
- *5 free classes*: with the open queries, the K classes and J = 5 components without
  support rows, their means under the prior N(0, B) (the open queries' true structure),
  each of weight 1/10, started at the J queries the background contrast ranks most
  open;
- *5 free classes, best of 16 starts*: the same from 16 k-means++ starts, each task
  keeping the fit of the highest likelihood (the objective of :func:`true_model_em`);
- *5 free classes, oracle start*: the same, started at the open classes' true query
  means (a start no method has).

The probfsl rows are ``probfsl run --open-queries 75`` and its closed-only run at
their defaults (``--preset auto``, chosen on base episodes), on the same tasks.

    python benchmarks/bench_open_set_model_limit.py [--tasks 300] [--scales 0.5 0.8 1.2]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from bench_open_set_detector import closed_accuracy as closed_accuracy_of  # a sibling script
from bench_open_set_detector import write_json

from probfsl import make_estimator
from probfsl.data import FeatureSet, sample_episodes
from probfsl.evaluation.calibration import mean_ci
from probfsl.running import auto_choice
from probfsl.tuning import SEARCH_SEED

WAY, SHOT, PER_CLASS, N_OPEN, SEED = 5, 1, 15, 75, 0
DIM, N_BASE, N_NOVEL, ROWS = 32, 64, 40, 100
EM_STEPS = 50
N_STARTS = 16
OUT = Path(__file__).parent / "results" / "open_set_model_limit"


def spectrum(scale: float) -> torch.Tensor:
    """The between-class variances s b_i, b_i = exp(-i / 8), i = 0..D-1."""
    return scale * torch.exp(-torch.arange(DIM, dtype=torch.float64) / 8)


def draw_features(scale: float, seed: int = 0) -> FeatureSet:
    """Base and novel classes of the two-covariance model, within-class covariance I."""
    gen = np.random.default_rng(seed)
    b = spectrum(scale).numpy()
    n_classes = N_BASE + N_NOVEL
    means = gen.standard_normal((n_classes, DIM)) * np.sqrt(b)
    labels = np.repeat(np.arange(n_classes), ROWS)
    features = means[labels] + gen.standard_normal((labels.size, DIM))
    split = np.where(labels < N_BASE, "base", "novel")
    names = [f"class {c}" for c in range(n_classes)]
    return FeatureSet(features.astype(np.float32), labels, names, split, name=f"s={scale}")


def _posterior(total: torch.Tensor, count: torch.Tensor, b: torch.Tensor):
    """Mean and (diagonal) covariance of μ ~ N(0, B) given ``count`` rows summing to
    ``total`` with noise I: precision 1/b + n, mean total / precision."""
    precision = 1 / b + count[..., None]
    return total / precision, 1 / precision


def _log_predictive(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """ln N(x_q | m_c, I + V_c) for x [T, Q, D], m and V [T, C, D] -> [T, Q, C]."""
    v = 1 + var[:, None]
    return -0.5 * (((x[:, :, None] - mean[:, None]) ** 2 / v) + v.log()).sum(-1)


def true_model_em(
    episodes, b: torch.Tensor, *, closed_only: bool, background: bool, n_free: int, start=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft EM of the generating model (module docstring). Returns the known classes'
    log predictives of every query [T, Q, K] and the fit's objective [T]: the queries'
    mixture log-likelihood and the supports' log predictive at the last means, plus the
    means' log prior density (up to constants)."""
    query = episodes.query.double()
    if closed_only:
        query = query.masked_fill(episodes.open_mask[..., None], 0.0)
    onehot = torch.nn.functional.one_hot(episodes.support_labels, WAY).double()
    support_total = torch.einsum("tsk,tsd->tkd", onehot, episodes.support.double())
    support_count = onehot.sum(1)
    t = query.shape[0]
    log_weight = torch.full((WAY,), math.log(1 / WAY), dtype=torch.float64)
    if not closed_only:
        share = 0.5 / WAY
        log_weight = torch.full((WAY + n_free,), math.log(share), dtype=torch.float64)
        if background:
            log_weight = torch.cat([log_weight, torch.tensor([math.log(0.5)])])
    background_var = b + 1
    log_background = -0.5 * ((query**2 / background_var) + background_var.log()).sum(-1)
    mean, var = _posterior(support_total, support_count, b)
    if n_free:
        if start is None:  # the queries the background ranks most open against the supports
            contrast = log_background - _log_predictive(query, mean, var).logsumexp(-1)
            first = contrast.topk(n_free, dim=-1).indices
            start = torch.gather(query, 1, first[..., None].expand(-1, -1, DIM))
        mean = torch.cat([mean, start], 1)
        var = torch.cat([var, torch.ones(t, n_free, DIM, dtype=torch.float64)], 1)
    components = WAY + n_free
    for _ in range(EM_STEPS):
        log_r = _log_predictive(query, mean, var)
        if background:
            log_r = torch.cat([log_r, log_background[..., None]], -1)
        r = (log_r + log_weight).softmax(-1)
        if closed_only:
            r = r.masked_fill(episodes.open_mask[..., None], 0.0)
        total = torch.einsum("tqc,tqd->tcd", r[..., :components], query)
        count = r[..., :components].sum(1)
        total[:, :WAY] += support_total
        count[:, :WAY] += support_count
        mean, var = _posterior(total, count, b)
    log_r = _log_predictive(query, mean, var)
    if background:
        log_r = torch.cat([log_r, log_background[..., None]], -1)
    mixture = (log_r + log_weight).logsumexp(-1)
    if closed_only:
        mixture = mixture.masked_fill(episodes.open_mask, 0.0)
    supports = _log_predictive(episodes.support.double(), mean[:, :WAY], var[:, :WAY])
    objective = (
        mixture.sum(-1)
        + (supports * onehot).sum((-1, -2))
        - 0.5 * (mean[:, :components] ** 2 / b).sum((-1, -2))
    )
    return log_r[..., :WAY], objective


def kmeanspp_start(episodes, n_free: int, gen: torch.Generator) -> torch.Tensor:
    """n_free queries drawn by k-means++ seeding (Arthur & Vassilvitskii, SODA 2007), the
    support rows counted as centres already chosen, [T, n_free, D]."""
    query = episodes.query.double()
    centres = episodes.support.double()
    for _ in range(n_free):
        d2 = torch.cdist(query, centres).pow(2).min(-1).values
        pick = torch.multinomial(d2 / d2.sum(-1, keepdim=True), 1, generator=gen)
        chosen = torch.gather(query, 1, pick[..., None].expand(-1, -1, DIM))
        centres = torch.cat([centres, chosen], 1)
    return centres[:, -n_free:]


def best_of_starts(episodes, b: torch.Tensor, n_starts: int) -> torch.Tensor:
    """The 5-free-class EM from ``n_starts`` k-means++ starts, each task keeping the fit
    of the highest objective."""
    gen = torch.Generator().manual_seed(SEED)
    fits = [
        true_model_em(
            episodes, b, closed_only=False, background=False, n_free=WAY,
            start=kmeanspp_start(episodes, WAY, gen),
        )
        for _ in range(n_starts)
    ]  # fmt: skip
    scores = torch.stack([f[0] for f in fits])
    best = torch.stack([f[1] for f in fits]).argmax(0)
    return scores[best, torch.arange(scores.shape[1])]


def closed_accuracy(scores: torch.Tensor, episodes) -> torch.Tensor:
    """Per-task accuracy (%) of the argmax over the known classes on the closed queries."""
    return closed_accuracy_of(scores, episodes.query_labels, episodes.open_mask)


def open_class_means(episodes, labels: np.ndarray, n_open_classes: int = WAY) -> torch.Tensor:
    """The mean of each open class's queries in every task (the oracle start), [T, J, D]."""
    source = torch.from_numpy(labels)[episodes.query_index]  # data-set label of each query
    member = torch.nn.functional.one_hot(source, int(labels.max()) + 1).double()
    member = member * episodes.open_mask[..., None]
    count = member.sum(1)  # [T, C]: nonzero for the task's open classes only
    total = torch.einsum("tqc,tqd->tcd", member, episodes.query.double())
    chosen = count.topk(n_open_classes, dim=-1).indices
    index = chosen[..., None].expand(-1, -1, total.shape[-1])
    return torch.gather(total, 1, index) / torch.gather(count, 1, chosen)[..., None]


def probfsl_rows(method: str, fs: FeatureSet, closed, episodes) -> dict:
    """Closed accuracy of ``probfsl run``'s defaults without and with the open queries."""
    row = {}
    for n_open, eps in ((0, closed), (N_OPEN, episodes)):
        choice = auto_choice(
            method, fs, {}, torch.device("cpu"), torch.float32, False,
            way=WAY, shot=SHOT, query=WAY * PER_CLASS, seed=SEARCH_SEED, open_queries=n_open,
        )  # fmt: skip
        ran = choice.method_run(method)
        model = make_estimator(ran, choice.preset, **choice.params).fit_featureset(fs)
        if n_open:
            acc = closed_accuracy(model.predict_proba_open(eps), eps)
        else:
            acc = 100 * (model.predict_proba(eps).argmax(-1) == eps.query_labels).double().mean(-1)
        row["open" if n_open else "closed_only"] = acc
        row[f"choice_{'open' if n_open else 'closed'}"] = {"ran": ran, **choice.params}
    return row


def run_scale(scale: float, tasks: int, methods: list[str]) -> dict:
    fs = draw_features(scale)
    b = spectrum(scale)
    closed = sample_episodes(fs, tasks, WAY, SHOT, WAY * PER_CLASS, seed=SEED)
    episodes = sample_episodes(fs, tasks, WAY, SHOT, WAY * PER_CLASS, seed=SEED, n_open=N_OPEN)
    onehot = torch.nn.functional.one_hot(episodes.support_labels, WAY).double()
    support_mean = torch.einsum("tsk,tsd->tkd", onehot, episodes.support.double()) / SHOT
    nearest = -torch.cdist(episodes.query.double(), support_mean)
    em = {
        "closed only": dict(closed_only=True, background=False, n_free=0),
        "background": dict(closed_only=False, background=True, n_free=0),
        "5 free classes": dict(closed_only=False, background=False, n_free=WAY),
    }
    read = {name: true_model_em(episodes, b, **kw)[0] for name, kw in em.items()}
    read[f"5 free classes, best of {N_STARTS} starts"] = best_of_starts(episodes, b, N_STARTS)
    oracle = open_class_means(episodes, fs.labels)
    read["5 free classes, oracle start"] = true_model_em(
        episodes, b, closed_only=False, background=False, n_free=WAY, start=oracle
    )[0]
    row = {
        "scale": scale,
        "tasks": tasks,
        "nearest_centroid": mean_ci(closed_accuracy(nearest, episodes)),
        "true_model": {name: mean_ci(closed_accuracy(s, episodes)) for name, s in read.items()},
        "probfsl": {},
    }
    for method in methods:
        got = probfsl_rows(method, fs, closed, episodes)
        row["probfsl"][method] = {
            "closed_only": mean_ci(got["closed_only"]),
            "open": mean_ci(got["open"]),
            "choices": {k: v for k, v in got.items() if k.startswith("choice")},
        }
    print(json.dumps(row, default=str), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--scales", nargs="+", type=float, default=[0.5, 0.8, 1.2])
    parser.add_argument("--methods", nargs="+", default=["soft-kmeans", "bavardage"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tic = time.perf_counter()
    rows = [run_scale(s, args.tasks, args.methods) for s in args.scales]
    write(rows, args, time.perf_counter() - tic)


def write(rows: list[dict], args, seconds: float) -> None:
    write_json(args.out, rows, seconds)
    lines = [
        "# The open-set loss on data from the two-covariance model itself",
        "",
        f"{DIM}-d features drawn from the model (between-class variances s·exp(-i/8), "
        f"within-class I; {N_BASE} base, {N_NOVEL} novel classes of {ROWS} rows), 5-way "
        f"{SHOT}-shot tasks with {PER_CLASS} closed queries a class and {N_OPEN} open queries "
        f"from 5 other novel classes, {args.tasks} seeded tasks a scale (seed {SEED}). "
        "Closed-set accuracy (%, mean over tasks ± 95% CI). *True model*: soft EM of the "
        "generating model with its true covariances; *closed only*: the same tasks without "
        "the open queries; *loss*: closed only minus with open queries.",
        "",
        "| s | nearest centroid | reader | closed only | with open queries | loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        nc = f"{r['nearest_centroid'][0]:.2f}"
        only = r["true_model"]["closed only"][0]
        for name, (acc, ci) in r["true_model"].items():
            if name == "closed only":
                continue
            lines.append(
                f"| {r['scale']} | {nc} | true model, {name} | {only:.2f} | "
                f"{acc:.2f} ± {ci:.2f} | {only - acc:.2f} |"
            )
        for method, m in r["probfsl"].items():
            lines.append(
                f"| {r['scale']} | {nc} | probfsl {method} | {m['closed_only'][0]:.2f} | "
                f"{m['open'][0]:.2f} ± {m['open'][1]:.2f} | "
                f"{m['closed_only'][0] - m['open'][0]:.2f} |"
            )
    lines.append("")
    for r in rows:
        for method, m in r["probfsl"].items():
            lines.append(f"- s = {r['scale']}, {method}: {m['choices']}")
    lines += ["", f"{len(rows)} scales in {seconds / 60:.1f} min on {args.threads} thread(s)."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
