"""The zero-shot evaluation protocol (EM-Dirichlet, Martin et al., CVPR 2024, §4.3).

A zero-shot task is a set of queries drawn from k ~ U{min..max} classes of a data set
(:func:`probfsl.data.tasks.sample_zero_shot_tasks`); each query is a probability vector
over all C classes of the data set (:func:`probfsl.data.simplex.zero_shot_probabilities`)
and a method predicts, per query, one of the C data-set labels. Accuracy is the mean
per-task fraction of correct predictions, with its 95 % confidence interval.
"""

from __future__ import annotations

from typing import Protocol

import torch

from probfsl.evaluation.protocol import EvalResult, score_batches


class ZeroShotPredictor(Protocol):
    """Anything with ``predict_zero_shot(probs [T, Q, C]) -> [T, Q]`` data-set labels."""

    def predict_zero_shot(self, probs: torch.Tensor) -> torch.Tensor: ...


def evaluate_zero_shot(
    estimator: ZeroShotPredictor,
    probs: torch.Tensor,
    query_labels: torch.Tensor,
    batch_size: int = 1000,
    progress: bool = False,
) -> EvalResult:
    """Accuracy ± 95% CI of ``estimator.predict_zero_shot`` over zero-shot tasks.

    ``probs`` [T, Q, K] (e.g. from :func:`probfsl.data.simplex.zero_shot_probabilities`),
    ``query_labels`` [T, Q] data-set labels. Any object with
    ``predict_zero_shot(probs) -> [T, Q]`` works (baselines included). The tasks are
    scored in batches of ``batch_size``; timing covers ``predict_zero_shot`` (matching
    included), not the computation of the probabilities.
    """
    if not isinstance(probs, torch.Tensor) or probs.ndim != 3:
        raise ValueError(f"probs must be a [T, Q, K] tensor, got {getattr(probs, 'shape', probs)}")
    if not isinstance(query_labels, torch.Tensor) or query_labels.shape != probs.shape[:2]:
        raise ValueError(
            f"query_labels must be [T, Q]={tuple(probs.shape[:2])}, got "
            f"{tuple(getattr(query_labels, 'shape', ()))}"
        )
    return score_batches(
        lambda start, stop: estimator.predict_zero_shot(probs[start:stop]),
        query_labels,
        batch_size,
        progress,
    )


def evaluate_argmax(
    probs: torch.Tensor,
    query_labels: torch.Tensor,
    classes: torch.Tensor | None = None,
    batch_size: int = 1000,
) -> EvalResult:
    """The inductive zero-shot baseline: each query's most probable class on its own.

    Over all C classes of ``probs [T, Q, C]`` (the information a transductive method
    has; the paper's inductive baseline), or, given ``classes [T, k_max]`` (each task's
    data-set labels padded with -1, :class:`~probfsl.data.tasks.ZeroShotTasks`), over
    the task's own classes only: an oracle that knows which classes a task holds.
    """

    def predict(start: int, stop: int) -> torch.Tensor:
        p = probs[start:stop]
        if classes is not None:
            c = classes[start:stop].to(p.device)
            allowed = torch.zeros(p.shape[0], p.shape[-1], dtype=torch.bool, device=p.device)
            allowed.scatter_(1, c.clamp_min(0), c >= 0)
            p = p.masked_fill(~allowed.unsqueeze(1), -1.0)
        return p.argmax(-1)

    return score_batches(predict, query_labels, batch_size)
