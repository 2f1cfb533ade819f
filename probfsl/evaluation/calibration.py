"""Calibration of query probabilities: ECE, adaptive ECE, NLL, Brier, temperature scaling.

Every metric is computed per task, batched over tasks (``proba`` [T, Q, K], ``labels``
[T, Q]), so that it gets the same 95% interval over tasks as the accuracy.

* ECE (Naeini et al., AAAI 2015; Guo et al., ICML 2017): the confidence
  ``max_k p_k`` of each query is put in one of ``n_bins`` equal-width bins and
  ``ECE = Σ_b |Σ_{i∈b} (1[ŷ_i = y_i] − conf_i)| / Q``.
* Adaptive ECE (Nixon et al., CVPR Workshops 2019): the same sum over bins holding
  equal numbers of queries (ranks of the confidence) instead of equal widths.
* NLL: ``−(1/Q) Σ_i log p_{i, y_i}``; Brier (Brier, 1950): ``(1/Q) Σ_i Σ_k (p_ik − 1[k = y_i])²``.

With few queries per task (75 in the protocol) the binned ECE of a perfectly
calibrated predictor is not zero: each bin's accuracy is a binomial estimate, so
per-task ECE carries a positive finite-sample bias of order ``sqrt(n_bins / Q)``.
Compare methods at the same Q; NLL and Brier are proper scoring rules without bins.

Temperature scaling (Guo et al., 2017) divides the log-probabilities by one
``τ > 0`` and renormalises; it never changes the argmax, so accuracy is unchanged.
:func:`fit_temperature` picks ``τ`` by minimising the NLL on labelled episodes (the
base classes, never the novel ones), with SciPy's bounded scalar minimiser: one scalar
for all tasks, fitted once before prediction, so it is outside the ``run`` engine
contract of :mod:`probfsl.inference.base`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: the metrics :func:`calibration_per_task` returns, in table order
METRICS = ("ece", "adaptive_ece", "nll", "brier")


def _check(proba: torch.Tensor, labels: torch.Tensor) -> None:
    if proba.ndim != 3 or labels.shape != proba.shape[:2]:
        raise ValueError(
            f"proba must be [T, Q, K] and labels [T, Q], got {tuple(proba.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if not proba.is_floating_point():
        raise TypeError(f"proba must be a floating-point tensor, got {proba.dtype}")


def _binned_gap(
    correct: torch.Tensor,
    conf: torch.Tensor,
    bins: torch.Tensor,
    n_bins: int,
    count: torch.Tensor | int | None = None,
):
    """``Σ_b |Σ_{i∈b} (correct_i − conf_i)| / Q`` per task, from bin indices [T, Q]
    (``count`` [T]: each task's Q where not every query counts; those that do not carry
    ``correct`` = ``conf`` = 0)."""
    gap = torch.zeros(conf.shape[0], n_bins, dtype=conf.dtype, device=conf.device)
    gap.scatter_add_(1, bins, correct - conf)
    return gap.abs().sum(1) / (conf.shape[1] if count is None else count)


def calibration_per_task(
    proba: torch.Tensor,
    labels: torch.Tensor,
    n_bins: int = 15,
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """ECE, adaptive ECE, NLL and Brier score of each task, each ``[T]`` (see module doc).

    ``mask`` [T, Q] (bool): only the queries it marks count, so tasks may have different
    numbers of them (the closed queries of open-set tasks, :mod:`probfsl.evaluation.
    open_set`); each task needs one."""
    _check(proba, labels)
    if n_bins < 1:
        raise ValueError(f"n_bins must be positive, got {n_bins}")
    labels = labels.to(proba.device).long()
    conf, pred = proba.max(-1)
    correct = (pred == labels).to(proba.dtype)
    p_true = proba.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    tiny = torch.finfo(proba.dtype).tiny
    onehot = torch.nn.functional.one_hot(labels, proba.shape[-1]).to(proba.dtype)
    nll = -p_true.clamp_min(tiny).log()
    brier = (proba - onehot).pow(2).sum(-1)
    width_bins = (conf * n_bins).long().clamp(0, n_bins - 1)
    if mask is None:
        ranks = conf.argsort(-1).argsort(-1)
        mass_bins = (ranks * n_bins) // proba.shape[1]
        return {
            "ece": _binned_gap(correct, conf, width_bins, n_bins),
            "adaptive_ece": _binned_gap(correct, conf, mass_bins, n_bins),
            "nll": nll.mean(-1),
            "brier": brier.mean(-1),
        }
    if mask.shape != labels.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool [T, Q] {tuple(labels.shape)}, got {mask.shape}")
    mask = mask.to(proba.device)
    weight = mask.to(proba.dtype)
    count = weight.sum(-1)
    # the queries left out rank last, so the others' equal-mass bins are their own
    ranks = conf.masked_fill(~mask, torch.inf).argsort(-1).argsort(-1)
    mass_bins = ((ranks * n_bins) // mask.sum(-1, keepdim=True)).clamp(max=n_bins - 1)
    correct, conf = correct * weight, conf * weight
    return {
        "ece": _binned_gap(correct, conf, width_bins, n_bins, count),
        "adaptive_ece": _binned_gap(correct, conf, mass_bins, n_bins, count),
        "nll": (nll * weight).sum(-1) / count,
        "brier": (brier * weight).sum(-1) / count,
    }


def mean_ci(per_task: np.ndarray) -> tuple[float, float]:
    """Mean and 95% half-width 1.96·std/√T (ddof=1) of a per-task quantity."""
    per_task = np.asarray(per_task, dtype=np.float64)
    if per_task.size == 0:
        raise ValueError("mean_ci needs at least one task")
    std = per_task.std(ddof=1) if per_task.size > 1 else 0.0
    return float(per_task.mean()), float(1.96 * std / math.sqrt(per_task.size))


def reliability_curve(
    proba: torch.Tensor, labels: torch.Tensor, n_bins: int = 15
) -> dict[str, np.ndarray]:
    """Pooled reliability diagram data over every query of every task.

    Returns ``confidence`` and ``accuracy`` (means per equal-width bin, NaN in an
    empty bin), ``count`` per bin and the bin ``edges`` [n_bins + 1].
    """
    _check(proba, labels)
    conf, pred = proba.detach().max(-1)
    correct = (pred == labels.to(proba.device)).double().flatten().cpu().numpy()
    conf = conf.double().flatten().cpu().numpy()
    bins = np.clip((conf * n_bins).astype(np.int64), 0, n_bins - 1)
    count = np.bincount(bins, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "confidence": np.bincount(bins, conf, n_bins) / count,
            "accuracy": np.bincount(bins, correct, n_bins) / count,
            "count": count,
            "edges": np.linspace(0.0, 1.0, n_bins + 1),
        }


def pooled_ece(proba: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    """ECE over every query of every task pooled (equal-width bins), as most papers
    report it: with many queries its finite-sample bias is small, unlike the per-task
    ECE of 75 queries."""
    curve = reliability_curve(proba, labels, n_bins)
    keep = curve["count"] > 0
    gap = np.abs(curve["accuracy"][keep] - curve["confidence"][keep])
    return float((gap * curve["count"][keep]).sum() / curve["count"].sum())


def plot_reliability(curves: dict[str, dict[str, np.ndarray]], ax=None):
    """Reliability diagram: accuracy against confidence per bin, one line per entry of
    ``curves`` (name -> :func:`reliability_curve` output), with the diagonal. Needs
    matplotlib (the ``plots`` extra)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="calibrated")
    for name, curve in curves.items():
        keep = curve["count"] > 0
        ax.plot(curve["confidence"][keep], curve["accuracy"][keep], marker="o", ms=3, label=name)
    ax.set_xlabel("confidence (max probability)")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    return ax


def apply_temperature(proba: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``softmax(log p / τ)`` over the last dimension: temperature-scaled probabilities.

    ``τ > 1`` softens, ``τ < 1`` sharpens; the argmax is unchanged. Computed in float64
    and returned in ``proba``'s dtype, so that nearly tied float32 probabilities keep
    their order. Zero probabilities stay zero (their log is clamped to float64's
    smallest normal number).
    """
    logp = proba.double().clamp_min(torch.finfo(torch.float64).tiny).log()
    return torch.softmax(logp / temperature, -1).to(proba.dtype)


def fit_temperature(
    proba: torch.Tensor, labels: torch.Tensor, bounds: tuple[float, float] = (1e-3, 1e3)
) -> float:
    """The ``τ`` in ``bounds`` that minimises the mean NLL of ``apply_temperature(proba, τ)``.

    A one-dimensional convex problem in ``1/τ`` (the NLL of a softmax is convex in a
    common scale of its logits), solved by SciPy's bounded scalar minimiser on ``log τ``
    in float64. Fit it on labelled base-class episodes, never on the tasks evaluated.
    """
    from scipy.optimize import minimize_scalar

    _check(proba, labels)
    if not (0 < bounds[0] < bounds[1] and math.isfinite(bounds[1])):
        raise ValueError(f"bounds must satisfy 0 < low < high < inf, got {bounds}")
    logp = proba.detach().double().clamp_min(torch.finfo(torch.float64).tiny).log()
    logp = logp.reshape(-1, proba.shape[-1]).cpu()
    target = labels.reshape(-1).long().cpu()

    def nll(log_tau: float) -> float:
        z = logp / math.exp(log_tau)
        return float(torch.nn.functional.cross_entropy(z, target))

    res = minimize_scalar(nll, bounds=(math.log(bounds[0]), math.log(bounds[1])), method="bounded")
    return float(math.exp(res.x))
