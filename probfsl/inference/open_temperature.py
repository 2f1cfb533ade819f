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
(three in a fold, each with the samples an episode needs, and samples of the fold's other
classes for the open queries: about nine base classes in all) a stays 1, and the
background reads its covariances half (within-class) and fully (between-class) isotropic
(:data:`UNSPLIT_READING`).

The same held-out log loss, the predictive likelihood of the open/closed labels of
classes the background has not seen, chooses how far each background covariance is
blended with its isotropic part (:meth:`~probfsl.inference.background.BackgroundStats.
blended`, a_W and a_B on :data:`MIX_GRID`), jointly with a (:func:`select_open_reading`).
The base classes' covariances carry over to new classes when there are many base
classes in few dimensions (Omniglot: 136 classes, 64 dimensions: a_W = a_B = 0, the
covariances as estimated); with 21 classes of text embeddings in 384 dimensions, the
between-class covariance has rank 20 and the directions in which new classes differ are
mostly outside it, and the held-out classes ask for nearly isotropic covariances
(a_W = 1, a_B = 0.9). The restricted likelihood of the held-out classes' samples
(:mod:`~probfsl.inference.background_shrinkage`) does not see this: it keeps the
anisotropic within-class covariance that describes each class's samples best, not the
one that tells a new class from the known ones. The transductive reading in the
queries' frame (``query_centring``) has its own choice.

Once the blends and a are chosen, the inductive reading also gets a shift b of its
log-odds, P(open | x) = σ(a (ln p_0 - ln p̄) + b + logit π_0), fitted by the same log
loss with a held (Platt's intercept, "Probabilistic Outputs for Support Vector Machines",
1999): the two-covariance densities can sit too wide or too narrow for new classes as a
whole, so that P(open) is too low or too high on average whatever its scale, and b takes
that out. It is fitted on episodes with as many open queries as closed, with their open
fraction as the prior, so it is a correction of the densities, not of π_0 (``open_prior``
still sets the latter). The transductive methods infer π_0 per task, but a bias of the
contrast of tens of nats (a small a) is beyond what π_0 can take up, so their last reading
takes the scale and shift of their frame too
(:meth:`~probfsl.models.base.OpenSetBackground.open_calibration`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from probfsl.inference.background import fit_background
from probfsl.inference.background_shrinkage import FOLDS, class_folds
from probfsl.inference.blended_odds import BlendedOdds, HeldTasks, between_factor

__all__ = [
    "GRID",
    "MIX_GRID",
    "OpenReading",
    "UNSPLIT_READING",
    "fit_scale",
    "fit_shift",
    "held_out_open_log_odds",
    "scale_and_log_loss",
    "select_open_reading",
    "select_open_readings",
    "select_open_temperature",
]

#: the scales tried (1 included: no change)
GRID = tuple(10 ** (-2 + 0.1 * i) for i in range(26)) + (1.0,)
#: episodes per fold and shot, known classes, shots and closed queries per class
TASKS, WAY, SHOTS, QUERIES = 16, 5, (1, 5), 5
#: the isotropic blends of the background covariances tried (:func:`select_open_reading`)
MIX_GRID = (0.0, 0.3, 0.6, 0.9, 1.0)
#: episodes per fold and shot when the blends are chosen
SELECTION_TASKS = 32
#: the largest shift of the inductive log-odds (:func:`fit_shift`) in either direction
MAX_SHIFT = 5.0


def _episodes(
    fold_classes: torch.Tensor,
    inverse: torch.Tensor,
    way: int,
    shot: int,
    generator: torch.Generator,
    tasks: int = TASKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``tasks`` episodes of ``way`` classes drawn from ``fold_classes``: sample
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
        tasks, n_ready, generator=generator, dtype=torch.float64, device="cpu"
    ).argsort(1)
    known = ready[order[:, :way].to(device)]  # [T, way]
    keys = torch.rand(
        tasks, pool.shape[0], generator=generator, dtype=torch.float64, device="cpu"
    ).to(device)
    member = pool_class.view(1, 1, -1) == known.unsqueeze(-1)  # [T, way, P]
    chosen = torch.where(member, keys.unsqueeze(1), math.inf).topk(per_class, largest=False)
    picked = pool[chosen.indices]  # [T, way, shot + QUERIES]
    is_known = member.any(1)  # [T, P]
    n_open = way * QUERIES
    if int((~is_known).sum(1).min()) < n_open:
        return None
    opened = torch.where(is_known, math.inf, keys).topk(n_open, largest=False).indices
    support = picked[:, :, :shot].reshape(tasks, -1)
    query = torch.cat([picked[:, :, shot:].reshape(tasks, -1), pool[opened]], 1)
    labels = torch.arange(way, device=device).repeat_interleave(shot).expand(tasks, -1)
    open_mask = torch.arange(query.shape[1], device=device) >= way * QUERIES
    return support, query, labels, open_mask.expand(tasks, -1)


class _HeldOutEpisodes(NamedTuple):
    """One batch of held-out-class episodes and the background of the other folds.

    ``rows`` [R, D] are the held-out fold's samples that its episodes use, each once,
    shared by the fold's batches; ``support`` [T, S] and ``query`` [T, Q] index them, so
    that a row is projected once, not once per episode, frame and blend
    (:func:`_open_log_odds`)."""

    background: BlendedOdds
    rows: torch.Tensor
    support: torch.Tensor
    support_labels: torch.Tensor
    query: torch.Tensor
    way: int
    open_mask: torch.Tensor


def _held_out_episodes(
    features: torch.Tensor, labels: torch.Tensor, shrinkage: float, seed: int, tasks: int
) -> list[_HeldOutEpisodes]:
    """For every fold of classes and shot of :data:`SHOTS`: ``tasks`` episodes of the
    fold's classes and the background fitted without them (shrinkage ``shrinkage``)."""
    inverse, fold_of, n_folds = class_folds(labels.to(features.device), FOLDS, seed)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for fold in range(n_folds):
        fold_classes = (fold_of == fold).nonzero().squeeze(1)
        train = (fold_of != fold)[inverse]
        if int(torch.unique(inverse[train]).numel()) < 2:
            continue
        stats = fit_background(features[train], inverse[train], shrinkage)
        background = BlendedOdds(stats, between_factor(features[train], inverse[train]), shrinkage)
        drawn = [_episodes(fold_classes, inverse, WAY, shot, generator, tasks) for shot in SHOTS]
        drawn = [d for d in drawn if d is not None]
        if not drawn:
            continue
        # the rows the fold's episodes use, each once (not the whole fold: it may be large)
        used = torch.cat([torch.cat([d[0], d[1]], 1).reshape(-1) for d in drawn]).unique()
        local = torch.full_like(inverse, -1)
        local[used] = torch.arange(used.shape[0], device=used.device)
        rows = features[used]
        for support, query, support_labels, open_mask in drawn:
            way = int(support_labels.max()) + 1
            out.append(
                _HeldOutEpisodes(
                    background, rows, local[support], support_labels, local[query], way, open_mask
                )
            )
    return out


def _query_frame(batch: _HeldOutEpisodes) -> tuple[torch.Tensor, torch.Tensor]:
    """The reciprocal norms [T, S] and [T, Q] of ``batch``'s support and query rows less
    their task's query mean (the queries' frame of
    :func:`~probfsl.inference.background.centre_on_queries`). A row equal to its task's
    query mean gets 0, so that it stays at the frame's origin however the projection
    rounds it."""
    centre = batch.rows[batch.query].mean(-2, keepdim=True)  # [T, 1, D]
    norms = [(batch.rows[i] - centre).norm(dim=-1) for i in (batch.support, batch.query)]
    return tuple(torch.where(n > 0, n.reciprocal(), 0.0) for n in norms)


def _open_log_odds(
    episodes: list[_HeldOutEpisodes],
    blends: list[tuple[float, float]],
    frames: tuple[bool, ...],
) -> dict[tuple[float, float], list[tuple[torch.Tensor, torch.Tensor]]]:
    """For each blend (a_W, a_B) of ``blends``: the log-odds [M] and open labels
    [M] of ``episodes``, their backgrounds blended, read in each frame of ``frames``
    (``query_centring`` of :class:`~probfsl.inference.background.TwoCovarianceReading`),
    one pair per frame.

    Each fold's rows are projected once onto the eigenbasis of the within-class
    covariance, P = X U, which every blend keeps, and each batch's coordinates in each
    frame are gathered once for all blends (:class:`~probfsl.inference.blended_odds.
    HeldTasks`; :meth:`~probfsl.inference.blended_odds.BlendedOdds.open_log_odds`)."""
    if not episodes:
        empty = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
        return {blend: [empty for _ in frames] for blend in blends}
    odds = {blend: {f: [] for f in frames} for blend in blends}
    projected, is_open = {}, []
    for batch in episodes:
        background = batch.background
        key = id(background)
        if key not in projected:  # one projection per fold
            projected[key] = background.project(batch.rows), background.project(background.mean)
        shot = batch.support.shape[1] // batch.way
        for frame in frames:
            norms = _query_frame(batch) if frame else None
            tasks = HeldTasks(*projected[key], batch.support, batch.query, norms)
            for blend in blends:
                read = background.open_log_odds(
                    tasks, batch.support_labels, batch.way, shot, *blend
                )
                odds[blend][frame].append(read.reshape(-1))
        is_open.append(batch.open_mask.reshape(-1))
    is_open = torch.cat(is_open)
    return {blend: [(torch.cat(odds[blend][f]), is_open) for f in frames] for blend in blends}


def held_out_open_log_odds(
    features: torch.Tensor,
    labels: torch.Tensor,
    shrinkage: float,
    seed: int = 0,
    within_mix: float = 0.0,
    between_mix: float = 0.0,
    tasks: int = TASKS,
    query_centring: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-odds ln p_0 - ln p̄ [M] of the queries of held-out-class episodes, and
    whether each query is open [M] (module docstring); both empty where no fold can
    form an episode. The background of each fold is
    ``fit_background(..., shrinkage, within_mix, between_mix)``; ``tasks`` episodes per
    fold and shot (the same episodes for every background, given ``seed``);
    ``query_centring`` reads each episode in its queries' frame (transductive;
    :class:`~probfsl.inference.background.TwoCovarianceReading`)."""
    episodes = _held_out_episodes(features, labels, shrinkage, seed, tasks)
    blend = (within_mix, between_mix)
    [(odds, is_open)] = _open_log_odds(episodes, [blend], (query_centring,))[blend]
    return odds.to(features), is_open.to(features.device)


def fit_scale(odds: torch.Tensor, is_open: torch.Tensor, grid: tuple[float, ...] = GRID) -> float:
    """The a of ``grid`` with the smallest log loss of σ(a · odds + logit f) against
    ``is_open``, f the open fraction of the episodes, over the finite odds; 1 for none."""
    return scale_and_log_loss(odds, is_open, grid)[0]


def scale_and_log_loss(
    odds: torch.Tensor, is_open: torch.Tensor, grid: tuple[float, ...] = GRID
) -> tuple[float, float]:
    """:func:`fit_scale`'s a and its mean log loss (nats per query; ``inf`` where no odds
    are finite, with a = 1)."""
    scale, log_mean = _scale_and_log_mean_loss(odds, is_open, grid)
    return scale, math.exp(log_mean)


def _log_softplus(x: torch.Tensor) -> torch.Tensor:
    """ln ln(1 + e^x) without underflow: x itself where e^x is below the dtype's relative
    precision (ln(1 + y) = y (1 - y/2 + ...))."""
    threshold = math.log(torch.finfo(x.dtype).eps)
    softplus = torch.nn.functional.softplus(x.clamp_min(threshold))
    return torch.where(x < threshold, x, softplus.log())


def _scale_and_log_mean_loss(
    odds: torch.Tensor, is_open: torch.Tensor, grid: tuple[float, ...]
) -> tuple[float, float]:
    """The a of ``grid`` with the smallest mean log loss of σ(a · odds + logit f), and the
    logarithm of that loss, over the finite odds (a = 1 and ``inf`` for none).

    The losses are compared in the log domain: where the held-out episodes are separated
    (margins of hundreds of nats on wide, well-separated features) the mean loss itself
    underflows to 0 for many scales, first in float32, and the first of the tied scales
    would win in one dtype and another in the other; the logarithm keeps the order, so the
    larger scale, the maximum-likelihood one on separated labels, wins in both."""
    finite = torch.isfinite(odds)  # degenerate base classes can give infinite odds
    odds, is_open = odds[finite], is_open[finite]
    if odds.numel() == 0:
        return 1.0, math.inf
    scales = torch.tensor(grid, dtype=odds.dtype, device=odds.device)
    target = is_open.to(odds)
    fraction = target.mean().clamp(1e-3, 1 - 1e-3)
    logits = scales.unsqueeze(1) * odds.unsqueeze(0) + torch.logit(fraction)
    # the log loss of one query is softplus(-m), m = ±logit its signed margin
    margins = torch.where(is_open, logits, -logits)
    log_mean = torch.logsumexp(_log_softplus(-margins), 1) - math.log(odds.numel())
    best = int(log_mean.argmin())
    return float(grid[best]), float(log_mean[best])


def fit_shift(odds: torch.Tensor, is_open: torch.Tensor, scale: float, steps: int = 64) -> float:
    """The b with the smallest mean log loss of σ(``scale`` · odds + b + logit f) against
    ``is_open`` (f the episodes' open fraction), over the finite odds: Platt's intercept
    (1999) with the slope held, clamped to [-:data:`MAX_SHIFT`, :data:`MAX_SHIFT`]; 0
    where no odds are finite or the labels are all one kind.

    The loss is convex in b, and its derivative Σ_closed σ(z_q) - Σ_open σ(-z_q) (z the
    logits) is zero where ln Σ_closed σ(z_q) = ln Σ_open σ(-z_q); the root is found by
    ``steps`` bisections of that difference, taken in the log domain so that it keeps its
    sign where both sums underflow (held-out episodes separated by hundreds of nats) and
    float32 finds float64's b."""
    finite = torch.isfinite(odds)
    odds, is_open = odds[finite], is_open[finite]
    if odds.numel() == 0 or bool(is_open.all() | ~is_open.any()):
        return 0.0
    logits = scale * odds + torch.logit(is_open.to(odds).mean())
    closed_logits, open_logits = logits[~is_open], logits[is_open]

    def excess(shift: torch.Tensor) -> torch.Tensor:  # > 0: P(open) too high on the whole
        log_sigmoid = torch.nn.functional.logsigmoid
        return torch.logsumexp(log_sigmoid(closed_logits + shift), 0) - torch.logsumexp(
            log_sigmoid(-(open_logits + shift)), 0
        )

    low = torch.tensor(-MAX_SHIFT, dtype=odds.dtype, device=odds.device)
    high = torch.tensor(MAX_SHIFT, dtype=odds.dtype, device=odds.device)
    for _ in range(steps):  # an excess at a bound keeps the bisection at that bound
        middle = (low + high) / 2
        above = excess(middle) > 0
        low, high = torch.where(above, low, middle), torch.where(above, middle, high)
    return float((low + high) / 2)


def select_open_temperature(
    features: torch.Tensor, labels: torch.Tensor, shrinkage: float
) -> float:
    """:func:`fit_scale` of :func:`held_out_open_log_odds`: the scale of the open log-odds
    that held-out base classes ask for (1 where they cannot be split)."""
    return fit_scale(*held_out_open_log_odds(features, labels, shrinkage))


class OpenReading(NamedTuple):
    """The background's isotropic blends (:func:`~probfsl.inference.background.
    fit_background`'s ``within_mix`` and ``between_mix``), the scale of its open
    log-odds, the held-out log loss (nats per query) that chose them, and the shift of the
    scaled log-odds fitted after them (:func:`fit_shift`)."""

    within_mix: float
    between_mix: float
    odds_scale: float
    log_loss: float
    odds_shift: float = 0.0


#: the reading where the base classes cannot be split into held-out folds (too few of
#: them), so nothing measures how their covariances carry over to new classes: C base
#: classes give a between-class covariance of rank C - 1, which misses most directions
#: in which a new class can differ, so it is read isotropic (a_B = 1); how well the
#: within-class covariance carries over depends on the features, so it is read half
#: isotropic (a_W = 0.5); the odds keep scale 1 and no shift (measurements:
#: docs/methods/open-set.md, "Too few base classes to hold out")
UNSPLIT_READING = OpenReading(0.5, 1.0, 1.0, math.inf)


def select_open_readings(
    features: torch.Tensor,
    labels: torch.Tensor,
    shrinkage: float,
    frames: tuple[bool, ...] = (False, True),
    mix_grid: tuple[float, ...] = MIX_GRID,
    tasks: int = SELECTION_TASKS,
) -> list[OpenReading]:
    """:func:`select_open_reading` for each frame of ``frames`` (``query_centring``), on
    the same episodes, each fold's rows projected once for all blends and frames; each
    with the shift of its chosen reading (:func:`fit_shift`)."""
    for mix in mix_grid:
        if not 0 <= mix <= 1:
            raise ValueError(f"mix_grid must lie in [0, 1], got {mix_grid}")
    episodes = _held_out_episodes(features, labels, shrinkage, 0, tasks)
    if not episodes:
        return [UNSPLIT_READING for _ in frames]
    best = [OpenReading(0.0, 0.0, 1.0, math.inf) for _ in frames]
    best_log = [math.inf for _ in frames]  # compared in the log domain (no underflow)
    best_odds: list[tuple[torch.Tensor, torch.Tensor] | None] = [None for _ in frames]
    blends = [(a_w, a_b) for a_w in mix_grid for a_b in mix_grid]
    for (within_mix, between_mix), read in _open_log_odds(episodes, blends, frames).items():
        for i, (odds, is_open) in enumerate(read):
            scale, log_mean = _scale_and_log_mean_loss(odds, is_open, GRID)
            if log_mean < best_log[i]:
                best[i] = OpenReading(within_mix, between_mix, scale, math.exp(log_mean))
                best_log[i], best_odds[i] = log_mean, (odds, is_open)
    for i, kept in enumerate(best_odds):
        if kept is not None:
            best[i] = best[i]._replace(odds_shift=fit_shift(*kept, best[i].odds_scale))
    return best


def select_open_reading(
    features: torch.Tensor,
    labels: torch.Tensor,
    shrinkage: float,
    query_centring: bool = False,
    mix_grid: tuple[float, ...] = MIX_GRID,
    tasks: int = SELECTION_TASKS,
) -> OpenReading:
    """The blends (a_W, a_B) of ``mix_grid`` x ``mix_grid`` and the scale a whose tempered
    open posterior σ(a (ln p_0 - ln p̄) + logit f) has the smallest log loss on the
    episodes of held-out base classes (``tasks`` per fold and shot, the same episodes for
    every pair; ``query_centring`` reads them in their queries' frame): the predictive
    likelihood of the open/closed labels of classes the background has not seen (module
    docstring), and the shift b of that reading (:func:`fit_shift`). The first pair of
    the grid wins ties; :data:`UNSPLIT_READING` (an infinite loss) where the base classes
    cannot be split."""
    [best] = select_open_readings(features, labels, shrinkage, (query_centring,), mix_grid, tasks)
    return best
