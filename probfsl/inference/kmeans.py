"""Soft k-means with labelled support rows (BAVARDAGE's initialiser).

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), §3 and spec bavardage.md §3.4.
"""

from __future__ import annotations

import torch


def one_hot_support(support_labels: torch.Tensor, way: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, n_support, K]`` one-hot rows of the support labels."""
    return torch.nn.functional.one_hot(support_labels, way).to(dtype)


def class_means(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted class means ``[T, K, D]`` from ``x`` [T, N, D] and weights ``[T, N, K]``."""
    return weights.transpose(1, 2) @ x / weights.sum(1).unsqueeze(-1).clamp_min(1e-12)


def softmax_last(logits: torch.Tensor) -> torch.Tensor:
    """Max-shifted softmax over a short last dimension (K classes).

    Same values as ``torch.softmax(logits, -1)`` up to rounding, several times faster
    than torch's CPU kernel for K ~ 5 and many rows.
    """
    e = (logits - logits.amax(-1, keepdim=True)).exp_()
    return e.div_(e.sum(-1, keepdim=True))


def soft_kmeans(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    way: int,
    temperature: float = 10.0,
    n_iter: int = 5,
) -> torch.Tensor:
    """Responsibilities ``[T, K*L + Q, K]`` of soft k-means seeded by the support.

    Centroids start at the support class means. Each of ``n_iter`` passes computes
    p_nk = softmax_k(-T_km ||x_n - c_k||^2), resets the support rows to their one-hot
    labels and moves every centroid to the p-weighted mean of all samples. The
    returned p is the one computed in the last pass (before its centroid update).
    """
    x = torch.cat([support, query], 1)
    # Centroids are weighted means of the samples, c = W^T x with W = p / sum_n p, so every
    # distance follows from the Gram matrix: ||x_n - c_k||^2 = G_nn - 2 (G W)_nk + (W^T G W)_kk.
    # One [N, N] Gram matrix per task replaces 2 passes over the D-dim features per iteration.
    gram = x @ x.transpose(1, 2)
    return soft_kmeans_gram(gram, support_labels, way, temperature, n_iter)


def soft_kmeans_gram(
    gram: torch.Tensor,
    support_labels: torch.Tensor,
    way: int,
    temperature: float = 10.0,
    n_iter: int = 5,
) -> torch.Tensor:
    """:func:`soft_kmeans` from the task Gram matrices ``gram`` [T, N, N] (support first).

    Only inner products between a task's points enter soft k-means, so this is the whole
    algorithm (same passes, same outputs) for callers that already hold the Gram matrix.
    """
    n_support = support_labels.shape[1]
    labels = one_hot_support(support_labels, way, gram.dtype)
    sq_norms = gram.diagonal(dim1=1, dim2=2).unsqueeze(-1)
    n_query = gram.shape[1] - n_support
    weights = torch.cat([labels, labels.new_zeros(gram.shape[0], n_query, way)], 1)
    p = None
    for _ in range(n_iter):
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1e-12)
        cross = (weights.transpose(1, 2) @ gram).transpose(1, 2)  # G W, G symmetric
        sq_dist = sq_norms - 2 * cross + (weights * cross).sum(1, keepdim=True)
        p = softmax_last(-temperature * sq_dist)
        p = torch.cat([labels, p[:, n_support:]], 1)
        weights = p
    return p
