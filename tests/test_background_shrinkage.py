"""The background's shrinkage, chosen by the evidence of held-out base classes: the
closed form against a brute-force restricted likelihood, the choice on data whose
answer is known, and the fallbacks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import MultivariateNormal

from probfsl import make_estimator
from probfsl.inference.background import fit_background
from probfsl.inference.background_shrinkage import (
    DEFAULT,
    GRID,
    held_out_evidence,
    select_shrinkage,
)
from probfsl.models.base import FewShotClassifier


def _classes(n_classes, per_class, dim, within_sd, seed=0, dtype=torch.float64):
    """Gaussian classes: means N(0, I), samples N(mean, diag(within_sd)^2)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(n_classes, dim, generator=g, dtype=dtype)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    noise = torch.randn(len(labels), dim, generator=g, dtype=dtype) * within_sd
    return means[labels] + noise, labels


def _helmert(n: int) -> torch.Tensor:
    """An orthonormal [n-1, n] basis of the vectors orthogonal to the ones vector."""
    basis = torch.zeros(n - 1, n, dtype=torch.float64)
    for i in range(1, n):
        basis[i - 1, :i] = 1.0
        basis[i - 1, i] = -float(i)
        basis[i - 1] /= math.sqrt(i * (i + 1))
    return basis


def test_the_evidence_is_the_restricted_likelihood_of_the_held_out_classes():
    """With one fold per class, each class's score is the likelihood of its n - 1
    Helmert contrasts, i.i.d. N(0, W_λ) with W from the other classes (brute force)."""
    x, labels = _classes(3, 5, 4, torch.tensor([1.0, 0.5, 2.0, 0.3]), seed=1)
    grid = (1e-3, 0.1, 1.0)
    got = held_out_evidence(x, labels, grid, folds=3)
    want = torch.zeros(len(grid), dtype=torch.float64)
    for c in range(3):
        train = labels != c
        within = fit_background(x[train], labels[train], 0.0).within
        within = within - torch.finfo(torch.float64).eps * torch.eye(4, dtype=torch.float64)
        contrasts = _helmert(5) @ x[labels == c]
        for i, lam in enumerate(grid):
            cov = within + lam * within.trace() / 4 * torch.eye(4, dtype=torch.float64)
            want[i] += (
                MultivariateNormal(torch.zeros(4, dtype=torch.float64), cov)
                .log_prob(contrasts)
                .sum()
            )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-8)


def test_many_samples_of_anisotropic_classes_want_little_shrinkage():
    sd = torch.logspace(-1, 1, 8, dtype=torch.float64)  # variances over four decades
    x, labels = _classes(30, 40, 8, sd, seed=2)
    assert select_shrinkage(x, labels) == GRID[0]


def test_few_samples_in_many_dimensions_want_more_shrinkage():
    """Isotropic within-class noise, 3 samples a class in 60 dimensions: the pooled W of
    the other classes is far from its truth, and shrinking it towards the identity wins."""
    x, labels = _classes(12, 3, 60, torch.ones(60, dtype=torch.float64), seed=3)
    assert select_shrinkage(x, labels) >= 0.3


def test_float32_chooses_as_float64():
    x, labels = _classes(20, 6, 16, torch.linspace(0.3, 1.5, 16, dtype=torch.float64), seed=4)
    assert select_shrinkage(x.float(), labels) == select_shrinkage(x, labels)


def test_the_folds_follow_the_classes_not_their_label_values():
    x, labels = _classes(9, 5, 6, torch.ones(6, dtype=torch.float64), seed=5)
    a = held_out_evidence(x, labels)
    b = held_out_evidence(x, labels * 10 + 7)  # the same classes under other names
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("per_class", [[1, 1, 1], [4]])
def test_classes_that_cannot_be_split_fall_back_to_the_default(per_class):
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(per_class)])
    x = torch.randn(len(labels), 3, generator=torch.Generator().manual_seed(0))
    assert torch.isinf(held_out_evidence(x, labels)).all()
    assert select_shrinkage(x, labels) == DEFAULT


def test_an_estimator_keeps_the_chosen_shrinkage_and_loads_files_without_it(tmp_path):
    x, labels = _classes(12, 3, 60, torch.ones(60, dtype=torch.float64), seed=3)
    est = make_estimator("nearest-centroid").fit_base(x.float(), labels)
    assert est.background_shrinkage_ == select_shrinkage(
        torch.nn.functional.normalize(x.float() - x.float().mean(0), dim=-1), labels
    )
    path = tmp_path / "nc.pt"
    est.save(path)
    assert FewShotClassifier.load(path).background_shrinkage_ == est.background_shrinkage_
    del est.background_shrinkage_  # a file saved before the shrinkage was chosen
    est.save(path)
    assert not hasattr(FewShotClassifier.load(path), "background_shrinkage_")


def test_identical_samples_fall_back_to_the_default():
    """Every class a single repeated point: no within-class spread to score."""
    labels = torch.arange(6).repeat_interleave(4)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))[labels]
    assert select_shrinkage(x, labels) == DEFAULT
