"""Per-class statistics of a batch of tasks: one-hot labels, weighted class means and
the softmax over the K classes.

Shared by the estimators and engines that turn labels or responsibilities
``w_nk`` into class means ``m_k = sum_n w_nk x_n / sum_n w_nk`` (nearest centroid,
soft k-means, the VB mixture's M-step). One-shot computations, no iteration.
"""

from __future__ import annotations

import torch

__all__ = ["class_means", "one_hot_support", "softmax_last"]


def one_hot_support(support_labels: torch.Tensor, way: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, n_support, K]`` one-hot rows of the support labels ``[T, n_support]``."""
    return torch.nn.functional.one_hot(support_labels, way).to(dtype)


def class_means(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted class means ``[T, K, D]``: ``m_k = sum_n w_nk x_n / sum_n w_nk`` from
    ``x`` [T, N, D] and weights ``[T, N, K]`` (a class of zero weight gets ``0``)."""
    return weights.transpose(1, 2) @ x / weights.sum(1).unsqueeze(-1).clamp_min(1e-12)


def softmax_last(logits: torch.Tensor) -> torch.Tensor:
    """Max-shifted softmax over a short last dimension (K classes).

    Same values as ``torch.softmax(logits, -1)`` up to rounding, several times faster
    than torch's CPU kernel for K ~ 5 and many rows.
    """
    e = (logits - logits.amax(-1, keepdim=True)).exp_()
    return e.div_(e.sum(-1, keepdim=True))
