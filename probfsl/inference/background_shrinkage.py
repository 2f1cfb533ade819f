"""How far to shrink the background covariances: the evidence of held-out base classes.

The background density of open-set recognition (:mod:`probfsl.inference.background`)
is the two-covariance model of the base classes (Ioffe, ECCV 2006; Prince & Elder, ICCV
2007): within-class covariance W and between-class covariance B, each shrunk towards a
multiple of the identity, W_λ = W + λ (tr W / D) I and B_λ = B + λ (tr B / D) I. How much
depends on the data: 136 classes in 64 dimensions pin W down, 21 classes of text
embeddings in 384 dimensions do not, and the classes a task brings are never the base
classes. So λ is chosen the way a new class would judge it, by cross-validation over
classes: the base classes are split into folds; W is estimated on the other folds; and
the held-out classes' within-class deviations score each λ of a grid by their exact
Gaussian log-likelihood (the restricted likelihood of W, Patterson & Thompson 1971):

    ln p(dev | W_λ) = -1/2 Σ_c [(n_c - 1) ln |2π W_λ| + tr(W_λ⁻¹ S_c)],

S_c the scatter of class c about its own mean. With W = U diag(w) Uᵀ once per fold, every
λ of the grid costs a sum over the D eigenvalues: ln |W_λ| = Σ_j ln(w_j + λ w̄) and
tr(W_λ⁻¹ S) = Σ_j (Uᵀ S U)_jj / (w_j + λ w̄), w̄ = tr W / D. The λ of the largest total
is used for both covariances (the within-class term dominates the held-out classes'
evidence; the between-class covariance of a few classes is the less reliable of the two).
How much of each covariance's anisotropy carries over to new classes is then chosen on
open-set episodes of held-out base classes
(:func:`~probfsl.inference.open_temperature.select_open_reading`).
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.eigh import stable_eigh

__all__ = ["FOLDS", "GRID", "class_folds", "held_out_evidence", "select_shrinkage"]

#: the shrinkages tried, λ (a fraction of the mean variance added to every variance)
GRID = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
#: folds of base classes
FOLDS = 3
#: λ where the base classes cannot be split (fewer than two classes with two samples)
DEFAULT = 1e-3


def _class_scatter(features: torch.Tensor, inverse: torch.Tensor, n_classes: int):
    """Each sample's deviation from its class mean [N, D], and the classes' sizes [C]."""
    onehot = torch.nn.functional.one_hot(inverse, n_classes).to(features)
    counts = onehot.sum(0)
    means = onehot.T @ features / counts.clamp_min(1).unsqueeze(-1)
    return features - means[inverse], counts


def class_folds(
    labels: torch.Tensor, folds: int = FOLDS, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each sample's class index ``inverse`` [N] (0..C-1, in the sorted order of the
    labels), each class's fold ``fold_of`` [C] (a seeded permutation of the classes dealt
    round-robin) and the number of folds, min(``folds``, C)."""
    _, inverse = labels.unique(return_inverse=True)
    n_classes = int(inverse.max()) + 1
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_classes, generator=generator, device="cpu").to(labels.device)
    n_folds = min(folds, n_classes)
    fold_of = torch.empty_like(order)
    fold_of[order] = torch.arange(n_classes, device=labels.device) % n_folds
    return inverse, fold_of, n_folds


def held_out_evidence(
    features: torch.Tensor,
    labels: torch.Tensor,
    grid: tuple[float, ...] = GRID,
    folds: int = FOLDS,
    seed: int = 0,
) -> torch.Tensor:
    """The held-out classes' within-class log-likelihood per λ of ``grid`` ``[len(grid)]``,
    summed over ``folds`` folds of classes (a seeded split; module docstring). ``-inf``
    everywhere when fewer than two classes have two samples."""
    inverse, fold_of, n_folds = class_folds(labels.to(features.device), folds, seed)
    dev, counts = _class_scatter(features, inverse, fold_of.shape[0])
    lam = torch.tensor(grid, dtype=features.dtype, device=features.device)
    usable = counts >= 2
    if int(usable.sum()) < 2:
        return torch.full_like(lam, -math.inf)
    d = features.shape[1]
    total, scored = torch.zeros_like(lam), False
    for fold in range(n_folds):
        held = (fold_of == fold) & usable
        train = (fold_of != fold)[inverse]
        if not (bool(held.any()) and bool((usable & (fold_of != fold)).any())):
            continue  # no held-out class to score, or no within-class spread to fit
        scored = True
        within = dev[train].T @ dev[train] / train.sum()
        eigenvalues, vectors = stable_eigh(within)
        eigenvalues = eigenvalues.clamp_min(0)
        mean_variance = eigenvalues.mean()
        test = held[inverse]
        projected = (dev[test] @ vectors).square().sum(0)  # diag(Uᵀ S U) over held-out classes
        dof = (counts[held] - 1).sum()
        variances = eigenvalues.unsqueeze(0) + lam.unsqueeze(1) * mean_variance  # [G, D]
        total = total - 0.5 * (
            dof * (variances.log().sum(-1) + d * math.log(2 * math.pi))
            + (projected / variances).sum(-1)
        )
    return total if scored else torch.full_like(lam, -math.inf)


def select_shrinkage(
    features: torch.Tensor, labels: torch.Tensor, grid: tuple[float, ...] = GRID
) -> float:
    """The λ of ``grid`` with the largest :func:`held_out_evidence` of the base
    ``features`` [N, D] and ``labels`` [N]; :data:`DEFAULT` where the classes cannot be
    split."""
    evidence = held_out_evidence(features, labels, grid).nan_to_num(nan=-math.inf)
    if not bool(torch.isfinite(evidence).any()):  # degenerate spreads score nothing
        return DEFAULT
    return float(grid[int(evidence.argmax())])
