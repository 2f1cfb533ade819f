"""Soft k-means with labelled support rows (BAVARDAGE's initialiser), in Gram form.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), §3 and docs/design/bavardage.md §3.4.

**Outside the engine contract** (:mod:`probfsl.inference.base`): soft k-means runs a
fixed number of passes (``n_iter``, 5 in the reference code) as an initialiser, every
pass on every task, with no tolerance and no objective traced: the reference's output
is the responsibilities of the last pass, so a convergence test (what
:func:`probfsl.inference.base.run` adds) would change it. Its loop is fixed-count,
branch-free and sync-free: batched tensor operations on the data's device. (Each pass
is an EM step of an isotropic Gaussian mixture with variance 1 / (2 T_km), equal
weights and the support labels observed.)
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.class_stats import one_hot_support, softmax_last

__all__ = [
    "isotropic_background_logit",
    "soft_kmeans",
    "soft_kmeans_gram",
    "soft_kmeans_gram_open",
]


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


def soft_kmeans_gram_open(
    gram: torch.Tensor,
    support_labels: torch.Tensor,
    way: int,
    background_logit: torch.Tensor | None,
    open_prior: float = 0.5,
    temperature: float = 10.0,
    n_iter: int = 5,
    open_log_odds: torch.Tensor | None = None,
    n_free: int = 0,
) -> torch.Tensor:
    """:func:`soft_kmeans_gram` with a background component: responsibilities
    ``[T, N, K + J + 1]``, the K classes, then ``n_free`` = J free components, the
    background last (open-set recognition, :mod:`probfsl.inference.background`).

    ``background_logit`` [T, N] is the background's log-density on the scale of the class
    logits -T_km ||x_n - c_k||^2 (the same normalising constant left out). Each pass is
    an EM step of the mixture with weights ((1 - π_0) / K, ..., π_0): the class
    centroids are the means weighted by the class responsibilities only (the background's
    share of a query does not pull them), and π_0 is the mean of its Beta posterior
    (prior mean ``open_prior``) given the queries' background responsibilities. Without
    any background mass the passes are those of :func:`soft_kmeans_gram`.

    With ``open_log_odds`` [T, Q] (the queries' ln p_0(x) - ln p_closed(x) in the full
    feature space, e.g. the two-covariance contrast of
    :meth:`~probfsl.inference.background.TwoCovarianceReading.open_log_odds`), the
    background is taken from it instead (``background_logit`` is then unused): a
    query's responsibility is o_q0 = σ(ln π_0 - ln(1 - π_0) + ``open_log_odds``), π_0
    still inferred in every pass, and its class responsibilities are
    (1 - o_q0) softmax_k(-T_km ||x - c_k||^2), those of soft k-means among the classes.

    Free components (``n_free`` = J > 0, with ``open_log_odds`` only): J more clusters
    without support, for the open queries to gather in rather than pull the known
    classes. Component j starts at the query of rank j by ``open_log_odds`` (the J
    queries the background odds rank most open); in every pass the softmax runs over the
    K + J centroids (each the mean of its responsibilities), so a query's share
    1 - o_q0 is split among the known classes and the free clusters. π_0 is the
    background's weight alone (Beta posterior of the o_q0). With J = 0 the passes are
    those above.
    """
    from probfsl.inference.background import open_fraction_prior

    if isinstance(n_free, bool) or not isinstance(n_free, int) or n_free < 0:
        raise ValueError(f"n_free must be a non-negative integer, got {n_free!r}")
    n_support = support_labels.shape[1]
    n_query = gram.shape[1] - n_support
    if n_free and open_log_odds is None:
        raise ValueError("n_free > 0 needs open_log_odds (free components start from them)")
    if n_free > n_query:
        raise ValueError(f"n_free ({n_free}) cannot exceed the queries per task ({n_query})")
    a_open, a_closed = open_fraction_prior(open_prior)
    labels = one_hot_support(support_labels, way, gram.dtype)
    sq_norms = gram.diagonal(dim1=1, dim2=2).unsqueeze(-1)
    t = gram.shape[0]
    if n_free:
        labels = torch.cat([labels, labels.new_zeros(t, n_support, n_free)], -1)
    n_comp = way + n_free
    query_weights = labels.new_zeros(t, n_query, n_comp)
    if n_free:  # free component j starts at the query ranked j-th most open
        rank = open_log_odds.topk(n_free, -1).indices  # [T, J]
        seeds = torch.nn.functional.one_hot(rank, n_query).to(gram.dtype)  # [T, J, Q]
        query_weights[..., way:] = seeds.transpose(1, 2)
    weights = torch.cat([labels, query_weights], 1)
    support = torch.cat([labels, labels.new_zeros(labels.shape[:2] + (1,))], -1)
    log_open = gram.new_full((t, 1), open_prior).log()
    p = None
    for _ in range(n_iter):
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1e-12)
        cross = (weights.transpose(1, 2) @ gram).transpose(1, 2)
        sq_dist = sq_norms - 2 * cross + (weights * cross).sum(1, keepdim=True)
        if open_log_odds is None:
            log_closed = torch.log1p(-log_open.exp()) - math.log(way)
            class_logit = -temperature * sq_dist + log_closed.unsqueeze(-1)
            logits = torch.cat([class_logit, (background_logit + log_open).unsqueeze(-1)], -1)
            p = torch.cat([support, softmax_last(logits)[:, n_support:]], 1)
        else:
            log_closed = torch.log1p(-log_open.exp())
            logit = open_log_odds + log_open - log_closed
            open_resp = torch.sigmoid(logit)
            classes = softmax_last(-temperature * sq_dist[:, n_support:])
            closed = classes * torch.sigmoid(-logit).unsqueeze(-1)  # exact near o_q0 = 1
            query = torch.cat([closed, open_resp.unsqueeze(-1)], -1)
            p = torch.cat([support, query], 1)
        open_mass = p[:, n_support:, -1].sum(-1, keepdim=True)
        log_open = ((open_mass + a_open) / (n_query + a_open + a_closed)).log()
        weights = p[..., :n_comp]
    return p


def isotropic_background_logit(
    x: torch.Tensor, mean: torch.Tensor, between: float, temperature: float
) -> torch.Tensor:
    """The background logit [T, N] of :func:`soft_kmeans_gram_open` for rows ``x``
    [T, N, D]: the predictive of a new class whose centre is drawn from N(``mean``,
    ``between`` I) (the base classes' mean and average between-class variance) under the
    tempered isotropic model exp(-T ||x - c||^2) of soft k-means,
    -T ||x - mean||^2 / (1 + 2 T s^2) - (D/2) ln(1 + 2 T s^2)."""
    inflate = 1 + 2 * temperature * between
    sq = (x - mean).square().sum(-1)
    return -temperature * sq / inflate - 0.5 * x.shape[-1] * math.log(inflate)
