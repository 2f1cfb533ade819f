"""Centred Gram matrices of a batch of tasks, BAVARDAGE's fast path (docs/design/bavardage.md §8).

BAVARDAGE (Hu, Pateux & Gripon, AISTATS 2023) centres every row on the base mean
("M" of MESV, design §3.1) and only ever needs inner products between a task's rows:
soft k-means, the global whitening (metric G = W W^T,
:class:`~probfsl.inference.plda.GlobalWhitening`) and the centroid projection
(:func:`~probfsl.inference.plda.centroid_projection_gram`) all work on the task's
[N, N] Gram matrix. These helpers form those matrices:

* :func:`centred_grams`: E = (x - m)(x - m)^T (and K = (x - m) G (x - m)^T for a
  low-rank metric) straight from the raw rows, with no centred copy, and a per-task
  flag of the tasks where that expansion loses too many bits;
* :func:`task_grams`: the same, with the flagged tasks recomputed explicitly;
* :func:`centred_rows`: the explicitly centred rows and their Gram matrices.

One-shot computations (no iteration). The precision checks (``bool`` of a flag) run
once per batch, outside any engine loop.
"""

from __future__ import annotations

import torch

from probfsl.inference.plda import GlobalWhitening

__all__ = ["TINY_SQ_NORM", "centred_grams", "centred_rows", "task_grams"]

#: squared row norms below this are rescaled before the Gram product (see centred_rows)
TINY_SQ_NORM = 1e-20


def _centre_gram_(raw: torch.Tensor, dots: torch.Tensor, m_sq: torch.Tensor) -> torch.Tensor:
    """(a - m).(b - m) = a.b - a.m - b.m + m.m from raw = a.b and dots = a.m, in place."""
    return raw.sub_(dots.unsqueeze(-1)).sub_(dots.unsqueeze(1)).add_(m_sq)


def centred_grams(
    points: torch.Tensor, mean: torch.Tensor, metric: GlobalWhitening | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Centred Gram matrices of ``points`` [T, N, D] about ``mean`` [D], with no centred copy.

    Returns ``(E, K, bad)``: E = (x - m)(x - m)^T [T, N, N] and, for a ``metric`` with a
    low-rank form G = s_max^2 I + R_u diag(c) R_u^T (c < 0), K = (x - m) G (x - m)^T
    = s_max^2 E - (x - m) V V^T (x - m)^T with V = R_u diag(sqrt(-c)); K is None without
    ``metric`` (or when it has no low-rank form). The D-wide work is one batched Gram
    product of the rows and one thin product with [m, V]; centring uses
    (a - m).(b - m) = a.b - a.m - b.m + m.m. The expansion loses about
    log2(||a||^2 / ||a - m||^2) bits, so ``bad`` [T] marks the tasks where some row would
    lose more than 4 bits, where a product overflows (huge features) or where squared
    norms are denormal-small (tiny features): :func:`task_grams` recomputes those tasks
    explicitly, task by task, so that no task's path depends on the others.
    """
    low_rank = None if metric is None else metric.low_rank()
    if low_rank is None:
        thin = mean.unsqueeze(-1)
    else:
        v = low_rank[0] * (-low_rank[1]).sqrt()
        thin = torch.cat([mean.unsqueeze(-1), v], 1)
    c = (points.reshape(-1, points.shape[-1]) @ thin).view(*points.shape[:2], -1)  # [T, N, 1+r]
    gram = points @ points.transpose(1, 2)
    raw_sq = gram.diagonal(dim1=1, dim2=2).clone()  # ||a||^2, for the precision check
    gram = _centre_gram_(gram, c[..., 0], mean.square().sum())
    # (a NaN or inf diagonal fails the comparison: overflowed products are bad too)
    ok = (gram.diagonal(dim1=1, dim2=2) * 16 >= raw_sq) & torch.isfinite(raw_sq)
    ok &= (raw_sq == 0) | (raw_sq >= TINY_SQ_NORM)
    if low_rank is None:
        return gram, None, ~ok.all(-1)
    low = c[..., 1:]
    mv = mean @ v
    low = _centre_gram_(low @ low.transpose(1, 2), low @ mv, mv.square().sum())
    k = low.neg_().add_(gram, alpha=metric.s_max**2)
    # the low-rank form's own terms are of size s_max^2 E; its centring may add 4 bits more
    ok &= gram.diagonal(dim1=1, dim2=2) * metric.s_max**2 * 16 >= raw_sq
    bad = ~ok.all(-1) | ~torch.isfinite(k).flatten(1).all(-1)
    return gram, k, bad


def task_grams(
    points: torch.Tensor, mean: torch.Tensor, metric: GlobalWhitening | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(E, K)`` of :func:`centred_grams`, with its ``bad`` tasks recomputed from
    explicitly centred (and, where needed, rescaled) rows (:func:`centred_rows`)."""
    gram, k, bad = centred_grams(points, mean, metric)
    if bool(bad.any()):
        index = bad.nonzero().squeeze(1)
        rows, sub = centred_rows(points[index], mean)
        gram[index] = sub
        if k is not None:
            k[index] = metric.gram(rows, euclidean=sub)
    return gram, k


def centred_rows(points: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centred rows x = points - mean [T, N, D] and their Gram matrices x x^T [T, N, N].

    BAVARDAGE normalises every centred row (MESV "E"), so a row's scale is irrelevant.
    When some squared norm overflows (features near the float range) or is so small
    that the 1e-12 norm floor would leave the row unnormalised, every row is first
    divided by an exact power of two that brings its largest entry into [0.5, 1):
    exact in floating point, so other rows' (and tasks') results do not change.
    """
    x = points - mean
    gram = x @ x.transpose(1, 2)
    diag = gram.diagonal(dim1=1, dim2=2)
    if bool((~torch.isfinite(diag) | ((diag > 0) & (diag < TINY_SQ_NORM))).any()):
        peak = x.abs().amax(-1, keepdim=True)
        x = torch.ldexp(x, -torch.frexp(peak).exponent.clamp(-100, 100))
        gram = x @ x.transpose(1, 2)
    return x, gram
