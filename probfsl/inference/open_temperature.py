"""A temperature for the open-vs-closed odds of the inductive open-set posterior.

The inductive reading of "none of these classes" (:mod:`probfsl.inference.background`)
is P(open | x) = σ(ln p_0(x) - ln p̄(x) + logit π_0), p_0 the background and
p̄ = (1/K) Σ_k p_k the known classes' two-covariance predictives. In hundreds of
dimensions these Gaussians are far more certain than they should be: the features are
neither Gaussian nor independent given the class, and the log-odds grow with the
dimension (ECE of P(open) 0.16-0.25 on the built-in sets). As the temperature of a
classifier's logits (Guo et al., "On Calibration of Modern Neural Networks", ICML 2017),
one scale a multiplies the log-odds, P(open | x) = σ(a (ln p_0 - ln p̄) + logit π_0): the
ranking of the queries (AUROC) is unchanged, only the probabilities move.

a is learnt where no task is: on base classes the background has not seen. In each fold
of classes (:func:`~probfsl.inference.background_shrinkage.class_folds`) the background is
fitted without the fold, and open-set episodes are drawn from the fold's classes (K of
them known, the rest open, as many open queries as closed; 1 and 5 shots); a minimises
the log loss of their open/closed labels over a grid. Without enough held-out classes
(three, each with the samples an episode needs) a stays 1.
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.background import TwoCovarianceReading, fit_background
from probfsl.inference.background_shrinkage import FOLDS, class_folds

__all__ = ["GRID", "held_out_open_log_odds", "fit_scale", "select_open_temperature"]

#: the scales tried (1 included: no change)
GRID = tuple(10 ** (-2 + 0.1 * i) for i in range(26)) + (1.0,)
#: episodes per fold and shot, known classes, shots and closed queries per class
TASKS, WAY, SHOTS, QUERIES = 16, 5, (1, 5), 5


def _episodes(
    fold_classes: torch.Tensor,
    inverse: torch.Tensor,
    way: int,
    shot: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:data:`TASKS` episodes of ``way`` classes drawn from ``fold_classes``: sample
    indices of the support [T, way * shot] and queries [T, 2 * way * QUERIES] (closed, then
    as many open ones from the fold's other classes), the support labels and the queries'
    open mask; None when the fold cannot hold them."""
    device = inverse.device
    in_fold = torch.isin(inverse, fold_classes)
    pool = in_fold.nonzero().squeeze(1)  # the fold's samples
    pool_class = inverse[pool]
    sizes = torch.bincount(pool_class, minlength=int(inverse.max()) + 1)[fold_classes]
    ready = fold_classes[sizes >= shot + QUERIES]
    n_ready = ready.shape[0]
    if n_ready < 3:
        return None
    way = min(way, n_ready - 1)
    per_class = shot + QUERIES
    order = torch.rand(
        TASKS, n_ready, generator=generator, dtype=torch.float64, device="cpu"
    ).argsort(1)
    known = ready[order[:, :way].to(device)]  # [T, way]
    keys = torch.rand(
        TASKS, pool.shape[0], generator=generator, dtype=torch.float64, device="cpu"
    ).to(device)
    member = pool_class.view(1, 1, -1) == known.unsqueeze(-1)  # [T, way, P]
    chosen = torch.where(member, keys.unsqueeze(1), math.inf).topk(per_class, largest=False)
    picked = pool[chosen.indices]  # [T, way, shot + QUERIES]
    is_known = member.any(1)  # [T, P]
    n_open = way * QUERIES
    if int((~is_known).sum(1).min()) < n_open:
        return None
    opened = torch.where(is_known, math.inf, keys).topk(n_open, largest=False).indices
    support = picked[:, :, :shot].reshape(TASKS, -1)
    query = torch.cat([picked[:, :, shot:].reshape(TASKS, -1), pool[opened]], 1)
    labels = torch.arange(way, device=device).repeat_interleave(shot).expand(TASKS, -1)
    open_mask = torch.arange(query.shape[1], device=device) >= way * QUERIES
    return support, query, labels, open_mask.expand(TASKS, -1)


def held_out_open_log_odds(
    features: torch.Tensor, labels: torch.Tensor, shrinkage: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-odds ln p_0 - ln p̄ [M] of the queries of held-out-class episodes, and
    whether each query is open [M] (module docstring); both empty where no fold can
    form an episode."""
    inverse, fold_of, n_folds = class_folds(labels.to(features.device), FOLDS, seed)
    generator = torch.Generator().manual_seed(seed)
    odds, is_open = (
        [features.new_zeros(0)],
        [torch.zeros(0, dtype=torch.bool, device=features.device)],
    )
    for fold in range(n_folds):
        fold_classes = (fold_of == fold).nonzero().squeeze(1)
        train = (fold_of != fold)[inverse]
        if int(torch.unique(inverse[train]).numel()) < 2:
            continue
        stats = fit_background(features[train], inverse[train], shrinkage)
        for shot in SHOTS:
            drawn = _episodes(fold_classes, inverse, WAY, shot, generator)
            if drawn is None:
                continue
            support, query, support_labels, open_mask = drawn
            way = int(support_labels.max()) + 1
            reading = TwoCovarianceReading(
                features[support], support_labels, features[query], way, stats
            )
            odds.append(reading.open_log_odds().reshape(-1))
            is_open.append(open_mask.reshape(-1))
    return torch.cat(odds), torch.cat(is_open)


def fit_scale(odds: torch.Tensor, is_open: torch.Tensor, grid: tuple[float, ...] = GRID) -> float:
    """The a of ``grid`` with the smallest log loss of σ(a · odds + logit f) against
    ``is_open``, f the open fraction of the episodes, over the finite odds; 1 for none."""
    finite = torch.isfinite(odds)  # degenerate base classes can give infinite odds
    odds, is_open = odds[finite], is_open[finite]
    if odds.numel() == 0:
        return 1.0
    scales = torch.tensor(grid, dtype=odds.dtype, device=odds.device)
    fraction = is_open.to(odds).mean().clamp(1e-3, 1 - 1e-3)
    logits = scales.unsqueeze(1) * odds.unsqueeze(0) + torch.logit(fraction)
    target = is_open.to(odds).expand_as(logits)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, target, reduction="none"
    ).mean(1)
    return float(grid[int(loss.argmin())])


def select_open_temperature(
    features: torch.Tensor, labels: torch.Tensor, shrinkage: float
) -> float:
    """:func:`fit_scale` of :func:`held_out_open_log_odds`: the scale of the open log-odds
    that held-out base classes ask for (1 where they cannot be split)."""
    return fit_scale(*held_out_open_log_odds(features, labels, shrinkage))
