"""Few-shot open-set recognition (FSOSR): metrics per task with 95% intervals over tasks.

The protocol of Boudiaf, Bennequin, Tami, Toubhans, Piantanida, Hudelot & Ben Ayed,
"Model-Agnostic Few-Shot Open-Set Recognition" (2022): each task has closed queries of
its K known classes and open queries of other classes (:mod:`probfsl.data.open_set`;
``Episodes.open_mask``). A method answers with ``predict_proba_open(episodes)``,
``[T, Q, K+1]`` probabilities whose last column is P(none of the K classes | data).
Per task:

* **closed accuracy**: argmax over the first K columns, on the closed queries only;
* **AUROC** of the outlier score (the last column; positives: the open queries), the
  Mann-Whitney statistic with tied scores at their average rank;
* **AUPR**: the average precision ``Σ_n (R_n − R_{n−1}) P_n`` over the distinct scores
  as thresholds (scikit-learn's ``average_precision_score``);
* **precision at 90% recall**: the precision at the highest threshold whose recall of
  the open queries is at least 0.9;
* **ECE-open**: calibration of the binary open/closed probability: the last column's
  values in ``n_bins`` equal-width bins, ``Σ_b |Σ_{i∈b} (1[open_i] − p_i)| / Q``
  (with 150 queries a perfectly calibrated probability still scores above 0: see
  :mod:`probfsl.evaluation.calibration`);
* and the closed-set calibration (ECE, adaptive ECE, NLL, Brier) of the first K
  columns renormalised, on the closed queries.

Every metric is computed batched over tasks in torch and reported as its mean over tasks
and 95% half-width ``1.96·std/√T``; accuracy, AUROC, AUPR and precision in percent.

The inductive baselines (scored by the same functions): nearest centroid's argmax for
the closed queries with, as outlier score, the mean Euclidean distance of a query to its
k nearest support samples (:class:`KNNDistanceBaseline`, the paper's strong baseline;
features centred and normalised as nearest centroid does; k = 1 at 1 shot and 3 at more
shots, the reference code's defaults) or one minus the maximum softmax probability
(:class:`MaxSoftmaxBaseline`). Their outlier scores are not probabilities: they have no
ECE-open.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.evaluation.calibration import _binned_gap, calibration_per_task, mean_ci
from probfsl.evaluation.protocol import evaluate_stream

#: the open-set metrics, in table order (:func:`open_set_per_task`)
OPEN_METRICS = ("accuracy", "auroc", "aupr", "prec_at_90_recall", "ece_open")
#: the metrics reported in percent
PERCENT = ("accuracy", "auroc", "aupr", "prec_at_90_recall")
#: the recall of "precision at 90% recall"
RECALL = 0.9


# --- rank statistics, batched over tasks ---------------------------------------------------


def _check_scores(scores: torch.Tensor, positive: torch.Tensor) -> None:
    if scores.ndim != 2 or positive.shape != scores.shape:
        raise ValueError(
            f"scores and positive must both be [T, N], got {tuple(scores.shape)} and "
            f"{tuple(positive.shape)}"
        )
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor, got {scores.dtype}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite (a NaN or infinite outlier score)")


def average_ranks(scores: torch.Tensor) -> torch.Tensor:
    """1-based ranks of each row of ``scores`` ``[T, N]`` in ascending order, tied values
    at the average of their ranks (``scipy.stats.rankdata(method="average")``), float64."""
    scores = scores.contiguous()
    ordered = scores.sort(-1).values
    below = torch.searchsorted(ordered, scores, side="left")
    up_to = torch.searchsorted(ordered, scores, side="right")
    return (below + up_to + 1).double() / 2


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of each task ``[T]``: the probability that a positive
    scores above a negative, ties counting one half (the Mann-Whitney U statistic over
    ``n_pos · n_neg``, from average ranks). NaN for a task without a positive or a
    negative. As ``sklearn.metrics.roc_auc_score`` per row."""
    _check_scores(scores, positive)
    pos = positive.to(torch.float64)
    n_pos = pos.sum(-1)
    n_neg = scores.shape[1] - n_pos
    u = (average_ranks(scores) * pos).sum(-1) - n_pos * (n_pos + 1) / 2
    pairs = n_pos * n_neg
    return torch.where(pairs > 0, u / pairs.clamp_min(1), torch.nan)


def _precision_recall(
    scores: torch.Tensor, positive: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element, with its score as the threshold (``score >= s_i`` flagged):
    ``(precision, true positives, flagged, positives per task)``, float64."""
    scores = scores.contiguous()
    pos = positive.to(torch.float64)
    n = scores.shape[1]
    order = scores.argsort(-1, descending=True)
    true_pos = pos.gather(-1, order).cumsum(-1)
    ordered = scores.sort(-1).values
    flagged = n - torch.searchsorted(ordered, scores, side="left")  # scores >= s_i
    tp = true_pos.gather(-1, flagged - 1)
    return tp / flagged, tp, flagged, pos.sum(-1)


def average_precision(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Average precision (area under the precision-recall curve) of each task ``[T]``:
    ``Σ_n (R_n − R_{n−1}) P_n`` with the distinct scores as thresholds, as
    ``sklearn.metrics.average_precision_score`` per row. NaN for a task without a
    positive."""
    _check_scores(scores, positive)
    precision, _, _, n_pos = _precision_recall(scores, positive)
    total = (precision * positive.to(torch.float64)).sum(-1)
    return torch.where(n_pos > 0, total / n_pos.clamp_min(1), torch.nan)


def precision_at_recall(
    scores: torch.Tensor, positive: torch.Tensor, recall: float = RECALL
) -> torch.Tensor:
    """Precision of each task ``[T]`` at the highest threshold (a distinct score) whose
    recall of the positives is at least ``recall``. NaN for a task without a positive."""
    _check_scores(scores, positive)
    if not 0 < recall <= 1:
        raise ValueError(f"recall must lie in (0, 1], got {recall}")
    precision, tp, flagged, n_pos = _precision_recall(scores, positive)
    reaches = tp >= recall * n_pos.unsqueeze(-1) - 1e-9
    # the highest threshold that reaches the recall flags the fewest queries
    fewest = torch.where(reaches, flagged, scores.shape[1] + 1).argmin(-1, keepdim=True)
    chosen = precision.gather(-1, fewest).squeeze(-1)
    return torch.where(n_pos > 0, chosen, torch.nan)


def open_ece(p_open: torch.Tensor, positive: torch.Tensor, n_bins: int = 15) -> torch.Tensor:
    """ECE of the binary open/closed probability per task ``[T]``: ``p_open`` in
    ``n_bins`` equal-width bins of [0, 1], ``Σ_b |Σ_{i∈b} (1[open_i] − p_i)| / N``.
    ``ValueError`` for a ``p_open`` outside [0, 1] (beyond rounding: an outlier score
    that is not a probability has no ECE)."""
    _check_scores(p_open, positive)
    if n_bins < 1:
        raise ValueError(f"n_bins must be positive, got {n_bins}")
    slack = 1e-6  # rounding of a probability computed in single precision
    if p_open.numel() and bool(((p_open < -slack) | (p_open > 1 + slack)).any()):
        raise ValueError(
            f"p_open must be probabilities in [0, 1], got values from "
            f"{float(p_open.min()):.4g} to {float(p_open.max()):.4g}"
        )
    p = p_open.to(torch.float64)
    bins = (p * n_bins).long().clamp(0, n_bins - 1)
    return _binned_gap(positive.to(torch.float64), p, bins, n_bins)


# --- the metrics of a batch of tasks --------------------------------------------------------


def open_set_per_task(
    closed_proba: torch.Tensor,
    outlier_score: torch.Tensor,
    labels: torch.Tensor,
    p_open: torch.Tensor | None = None,
    n_bins: int = 15,
) -> dict[str, torch.Tensor]:
    """The open-set metrics of each task, each ``[T]`` (fractions, not percent).

    ``closed_proba`` ``[T, Q, K]``: scores of the K known classes (their argmax is the
    closed prediction); ``outlier_score`` ``[T, Q]``: higher means more likely open;
    ``labels`` ``[T, Q]``: task-local labels, ``K`` for an open query; ``p_open``
    ``[T, Q]``: the probability that a query is open, scored for ECE-open where given.
    Returns ``accuracy`` (on the closed queries), ``auroc``, ``aupr``,
    ``prec_at_90_recall`` and, with ``p_open``, ``ece_open``; and the closed-set
    calibration of :data:`probfsl.evaluation.calibration.METRICS` on the closed queries
    (``closed_proba`` renormalised; tasks may hold different numbers of them).
    ``ValueError`` for a label outside ``0..K`` or a task without an open or a closed
    query.
    """
    if closed_proba.ndim != 3 or labels.shape != closed_proba.shape[:2]:
        raise ValueError(
            f"closed_proba must be [T, Q, K] and labels [T, Q], got "
            f"{tuple(closed_proba.shape)} and {tuple(labels.shape)}"
        )
    labels = labels.to(closed_proba.device).long()
    way = closed_proba.shape[2]
    if labels.numel() and bool(((labels < 0) | (labels > way)).any()):
        raise ValueError(
            f"labels must lie in 0..{way} for {way} known classes (K = {way} marks an open "
            f"query), got values from {int(labels.min())} to {int(labels.max())}"
        )
    is_open = labels == way
    n_open = is_open.sum(-1)
    if bool(((n_open == 0) | (n_open == labels.shape[1])).any()):
        raise ValueError(
            "every task needs closed and open queries (label == way marks an open query); "
            "sample open-set tasks with sample_episodes(..., n_open=N)"
        )
    closed = ~is_open
    correct = (closed_proba.argmax(-1) == labels) & closed
    out = {"accuracy": correct.double().sum(-1) / closed.double().sum(-1)}
    outlier_score = outlier_score.to(closed_proba.device)
    out["auroc"] = auroc(outlier_score, is_open)
    out["aupr"] = average_precision(outlier_score, is_open)
    out["prec_at_90_recall"] = precision_at_recall(outlier_score, is_open, RECALL)
    if p_open is not None:
        out["ece_open"] = open_ece(p_open.to(closed_proba.device), is_open, n_bins)
    tiny = torch.finfo(closed_proba.dtype).tiny
    proba = closed_proba / closed_proba.sum(-1, keepdim=True).clamp_min(tiny)
    out.update(calibration_per_task(proba, labels.clamp(max=way - 1), n_bins, mask=closed))
    return out


def open_set_scores(
    proba_open: torch.Tensor, labels: torch.Tensor, n_bins: int = 15
) -> dict[str, torch.Tensor]:
    """:func:`open_set_per_task` of an open-set posterior ``[T, Q, K+1]`` (the last
    column, P(none of the K classes), is the outlier score and the open probability)."""
    if proba_open.ndim != 3 or proba_open.shape[2] < 3:
        raise ValueError(
            f"proba_open must be [T, Q, K+1] with K >= 2, got {tuple(proba_open.shape)}"
        )
    p_open = proba_open[..., -1]
    return open_set_per_task(proba_open[..., :-1], p_open, labels, p_open, n_bins)


# --- what is scored: a method's posterior, or a baseline -------------------------------------


class OpenSetOutputs(NamedTuple):
    """What a scorer gives for a batch of open-set tasks (see :func:`open_set_per_task`)."""

    closed_proba: torch.Tensor
    outlier_score: torch.Tensor
    p_open: torch.Tensor | None


def has_open_posterior(model: Any) -> bool:
    """Whether ``model`` gives an open-set posterior: a ``predict_proba_open`` of its own.

    Every estimator inherits :meth:`~probfsl.models.base.FewShotClassifier.predict_proba_open`,
    which only raises, so ``hasattr`` cannot tell; this can, before any work. A wrapper
    says for itself (its ``has_open_posterior()``, as
    :class:`~probfsl.temperature.TemperatureScaled`)."""
    own = getattr(model, "has_open_posterior", None)
    if callable(own):
        return bool(own())
    method = getattr(model, "predict_proba_open", None)
    if method is None:
        return False
    from probfsl.models.base import FewShotClassifier

    return getattr(method, "__func__", method) is not FewShotClassifier.predict_proba_open


class OpenPosterior:
    """A method scored through its ``predict_proba_open`` ``[T, Q, K+1]``."""

    def __init__(self, estimator: Any) -> None:
        if not has_open_posterior(estimator):
            raise ValueError(
                f"{type(estimator).__name__} has no open-set posterior (predict_proba_open)"
            )
        self.estimator = estimator

    def open_set_outputs(self, episodes: Episodes) -> OpenSetOutputs:
        proba = self.estimator.predict_proba_open(episodes)
        expected = (episodes.n_tasks, episodes.n_query, episodes.way + 1)
        if tuple(proba.shape) != expected:
            raise ValueError(
                f"{type(self.estimator).__name__}.predict_proba_open returned shape "
                f"{tuple(proba.shape)}, expected [T, Q, K+1] = {expected}"
            )
        return OpenSetOutputs(proba[..., :-1], proba[..., -1], proba[..., -1])


def _centred(classifier: Any, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
    """Support and query features centred (where ``classifier`` centres on a base mean)
    and L2-normalised, as nearest centroid sees them."""
    check = getattr(classifier, "checked_centring_mean", None)
    mean = check(episodes) if check is not None else None
    return center_and_normalize(episodes.support, mean), center_and_normalize(episodes.query, mean)


class KNNDistanceBaseline:
    """Nearest centroid for the closed queries; as outlier score, the mean Euclidean
    distance of each query to its ``k`` nearest support samples (features centred and
    normalised as ``classifier`` does). ``k=None``: 1 at 1 shot, 3 at more shots (the
    reference code's defaults), at most the support size.

    ``classifier`` is a fitted closed-set estimator (nearest centroid)."""

    def __init__(self, classifier: Any, k: int | None = None) -> None:
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be a positive integer or None, got {k!r}")
        self.classifier = classifier
        self.k = k

    def neighbours(self, episodes: Episodes) -> int:
        """The k used for ``episodes``."""
        k = self.k if self.k is not None else (1 if episodes.shot == 1 else 3)
        return min(k, episodes.support.shape[1])

    def open_set_outputs(self, episodes: Episodes) -> OpenSetOutputs:
        closed = self.classifier.predict_proba(episodes)
        support, query = _centred(self.classifier, episodes)
        distance = torch.cdist(query, support)
        nearest = distance.topk(self.neighbours(episodes), -1, largest=False).values
        return OpenSetOutputs(closed, nearest.mean(-1), None)


class MaxSoftmaxBaseline:
    """Nearest centroid (or any closed-set ``classifier``) with one minus its maximum
    softmax probability as the outlier score (Hendrycks & Gimpel, 2017)."""

    def __init__(self, classifier: Any) -> None:
        self.classifier = classifier

    def open_set_outputs(self, episodes: Episodes) -> OpenSetOutputs:
        closed = self.classifier.predict_proba(episodes)
        return OpenSetOutputs(closed, 1 - closed.max(-1).values, None)


def open_set_baselines(classifier: Any, k: int | None = None) -> dict[str, Any]:
    """The two inductive baselines on a fitted ``classifier`` (nearest centroid):
    ``{"knn": KNNDistanceBaseline, "msp": MaxSoftmaxBaseline}``."""
    return {"knn": KNNDistanceBaseline(classifier, k), "msp": MaxSoftmaxBaseline(classifier)}


def _scorer(model: Any) -> Any:
    return model if hasattr(model, "open_set_outputs") else OpenPosterior(model)


# --- evaluation over tasks -------------------------------------------------------------------


@dataclass
class OpenSetResult:
    """The open-set metrics of a model over tasks: ``metrics`` maps each to its mean over
    tasks and 95% half-width (accuracy, AUROC, AUPR and precision at 90% recall in
    percent; ECE-open and the closed-set calibration as fractions or nats), with the
    per-task values in ``per_task``."""

    n_tasks: int
    seconds: float
    tasks_per_second: float
    metrics: dict[str, tuple[float, float]]
    per_task: dict[str, np.ndarray] = field(repr=False)

    def summary(self, prefix: str = "") -> dict:
        """The JSON-friendly fields: each metric as ``NAME`` and ``NAME_ci95`` (closed
        accuracy as ``accuracy`` and ``ci95``), each name after ``prefix``."""
        out = {}
        for name, (mean, ci) in self.metrics.items():
            half = "ci95" if name == "accuracy" else f"{name}_ci95"
            out[prefix + name], out[prefix + half] = mean, ci
        if not prefix:
            out.update(seconds=self.seconds, tasks_per_second=self.tasks_per_second)
        return out

    def __str__(self) -> str:
        parts = []
        for name, (mean, ci) in self.metrics.items():
            if name in OPEN_METRICS:
                digits = 2 if name in PERCENT else 3
                parts.append(f"{name} {mean:.{digits}f} ± {ci:.{digits}f}")
        return "  ".join(parts) + f"  ({self.tasks_per_second:.0f} tasks/s)"


class _OpenTally:
    """Per-task open-set metrics of one scorer's batches and the time spent: the tally
    of :func:`evaluate_open_set_stream` in :func:`~probfsl.evaluation.protocol.evaluate_stream`."""

    def __init__(self, n_tasks: int, scorer: Any, n_bins: int) -> None:
        self.n_tasks, self.scorer, self.n_bins = n_tasks, scorer, n_bins
        self.values: dict[str, np.ndarray] = {}
        self.done, self.seconds = 0, 0.0

    def score(
        self, episodes: Episodes, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        """The scorer's outputs on the batch (moved to ``device`` and ``dtype``), timed,
        and their metrics tallied."""
        out = self.timed(_outputs_on, self.scorer, episodes, device, dtype)
        self.add(out, episodes.query_labels, self.n_bins)

    def timed(self, predict: Callable[..., OpenSetOutputs], *args) -> OpenSetOutputs:
        tic = time.perf_counter()
        out = predict(*args)
        if out.closed_proba.device.type == "cuda":
            torch.cuda.synchronize(out.closed_proba.device)
        self.seconds += time.perf_counter() - tic
        return out

    def add(self, out: OpenSetOutputs, labels: torch.Tensor, n_bins: int) -> None:
        scores = open_set_per_task(out.closed_proba, out.outlier_score, labels, out.p_open, n_bins)
        rows = slice(self.done, self.done + labels.shape[0])
        for name, values in scores.items():
            if name not in self.values:
                self.values[name] = np.full(self.n_tasks, np.nan)
            self.values[name][rows] = values.double().cpu().numpy()
        self.done = rows.stop

    def result(self) -> OpenSetResult:
        per_task = {k: v[: self.done] for k, v in self.values.items()}
        metrics = {}
        for name, values in per_task.items():
            mean, ci = mean_ci(values)
            scale = 100.0 if name in PERCENT else 1.0
            metrics[name] = (scale * mean, scale * ci)
        return OpenSetResult(
            n_tasks=self.done,
            seconds=self.seconds,
            tasks_per_second=self.done / max(self.seconds, 1e-9),
            metrics=metrics,
            per_task=per_task,
        )


def _outputs_on(scorer: Any, episodes: Episodes, device, dtype) -> OpenSetOutputs:
    return scorer.open_set_outputs(episodes.to(device, dtype))


def evaluate_open_set_stream(
    models: Mapping[str, Any],
    batch: Callable[[int, int], Episodes],
    n_tasks: int,
    batch_size: int = 1000,
    progress: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    n_bins: int = 15,
) -> dict[str, OpenSetResult]:
    """Every model of ``models`` on the same open-set tasks, made one batch at a time by
    ``batch(start, stop)`` (as :func:`probfsl.evaluation.protocol.evaluate_stream`).

    A model is an estimator with ``predict_proba_open`` or a baseline with
    ``open_set_outputs`` (:func:`open_set_baselines`). Timing covers each model's work
    on the batches, not the making of the tasks or the scoring.
    """

    def tally(n: int, model: Any) -> _OpenTally:
        return _OpenTally(n, _scorer(model), n_bins)

    return evaluate_stream(models, batch, n_tasks, batch_size, progress, device, dtype, tally)


def evaluate_open_set(
    model: Any,
    episodes: Episodes,
    batch_size: int = 1000,
    progress: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    n_bins: int = 15,
) -> OpenSetResult:
    """Score ``model`` (an estimator with ``predict_proba_open``, or a baseline of
    :func:`open_set_baselines`) on open-set ``episodes`` (``sample_episodes(...,
    n_open=N)``) in batches: closed accuracy, AUROC, AUPR, precision at 90% recall and
    ECE-open, each with its 95% interval over tasks (see the module's doc)."""
    return evaluate_open_set_stream(
        {"model": model},
        lambda start, stop: episodes[start:stop],
        len(episodes),
        batch_size,
        progress,
        device,
        dtype,
        n_bins,
    )["model"]
