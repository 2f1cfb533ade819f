"""Synthetic data shared by the tests: seeded, small, the same on every run.

Import from here (``from tests.synthetic import ...``) rather than redefining a helper in
each test file; ``tests/conftest.py`` re-exports :func:`make_featureset` and serves it as
the ``synthetic`` fixture.
"""

from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import torch

from probfsl.data import FeatureSet
from probfsl.data.tasks import Episodes


def make_featureset(
    n_base=6, n_novel=8, per_class=30, dim=5, spread=4.0, seed=0, name="synthetic"
) -> FeatureSet:
    """Gaussian classes around random centres: the first ``n_base`` are base classes."""
    rng = np.random.default_rng(seed)
    n_classes = n_base + n_novel
    centres = spread * rng.standard_normal((n_classes, dim))
    labels = np.repeat(np.arange(n_classes), per_class)
    features = centres[labels] + rng.standard_normal((labels.size, dim))
    split = np.where(labels < n_base, "base", "novel")
    return FeatureSet(
        features=features.astype(np.float32),
        labels=labels,
        class_names=[f"class{c}" for c in range(n_classes)],
        split=split,
        name=name,
    )


def gaussian_base(
    dim: int,
    n_classes: int = 8,
    per_class: int = 25,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Base features ``[n_classes * per_class, dim]`` (``dtype``), unit-variance points
    around class centres drawn with standard deviation 3, and their labels (class-major)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    centres = 3 * torch.randn(n_classes, dim, generator=g, dtype=dtype)
    return centres[labels] + torch.randn(labels.numel(), dim, generator=g, dtype=dtype), labels


def episodes_from_tensors(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    way: int | None = None,
    query_labels: torch.Tensor | None = None,
) -> Episodes:
    """An :class:`Episodes` batch of the given tensors: ``support [T, N, D]`` with
    task-local ``support_labels [T, N]`` and ``query [T, Q, D]``; ``way`` (default the
    largest support label + 1) classes numbered ``0..way-1`` in every task; query labels
    zero unless given, row indices zero."""
    t, n = support_labels.shape
    n_query = query.shape[1]
    way = int(support_labels.max()) + 1 if way is None else way
    return Episodes(
        support=support,
        support_labels=support_labels,
        query=query,
        query_labels=(
            torch.zeros(t, n_query, dtype=torch.long) if query_labels is None else query_labels
        ),
        classes=torch.arange(way).expand(t, way).clone(),
        support_index=torch.zeros(t, n, dtype=torch.long),
        query_index=torch.zeros(t, n_query, dtype=torch.long),
    )


def bayesian_pca(y, k=2):
    """x_n ~ N(0, I_k); W_d ~ N(0, diag(1/alpha)) with alpha_k ~ Gamma; y_nd ~ N(W_d · x_n,
    1/tau) with tau ~ Gamma (Bishop, PRML §12.2.3)."""
    t, n, d = y.shape
    with pyro.plate("tasks", t, dim=-3):
        alpha = pyro.sample("alpha", dist.Gamma(y.new_full((k,), 1e-3), 1e-3).to_event(1))
        tau = pyro.sample("tau", dist.Gamma(y.new_tensor(1e-3), 1e-3))
        dims = pyro.plate("dims", d, dim=-1)
        with dims:
            w = pyro.sample("W", dist.Normal(y.new_zeros(k), alpha.rsqrt()).to_event(1))
        with pyro.plate("points", n, dim=-2):
            x = pyro.sample("x", dist.Normal(y.new_zeros(k), 1.0).to_event(1))
            with dims:
                pyro.sample("y", dist.Normal((w * x).sum(-1), tau.rsqrt()), obs=y)
