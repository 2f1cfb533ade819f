"""Inputs on the probability simplex (EM-Dirichlet, docs/design/em-dirichlet.md §9).

EM-Dirichlet (Martin et al., CVPR 2024) classifies class-probability vectors
``x_n`` in the simplex of R^K. A user can bring them in one of three forms:

1. probabilities ``[..., N, K]`` from any classifier (rows non-negative, summing to 1):
   :func:`check_probabilities`;
2. logits ``[..., N, K]`` plus a temperature, x = softmax(T * logits) (for CLIP use
   cosine similarities with T = 30, not CLIP's logit scale of 100):
   :func:`probabilities_from_logits`;
3. sample embeddings ``[..., N, D]`` and one embedding per class ``[K, D]`` (or per task
   ``[..., K, D]``), both L2-normalised here, x = softmax(T * cosine) (paper eq. 2):
   :func:`probabilities_from_embeddings`.

:func:`zero_shot_probabilities` builds the third form for a batch of zero-shot tasks of a
feature set (the zero-shot protocol's input). Every function raises ``ValueError``
naming the argument for NaN/inf, negative entries, rows that do not sum to one, fewer
than two classes, or a class-embedding count or width that does not match, and
``TypeError`` for a non-tensor or a dtype other than float32/float64 (float16 logs and
digammas of the Dirichlet fit overflow: all-NaN output), before any computation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from probfsl.validation import FLOAT_DTYPES, check_temperature

if TYPE_CHECKING:
    from probfsl.data.featureset import FeatureSet
    from probfsl.data.tasks import ZeroShotTasks

#: default tolerance on |sum_k x_nk - 1|
SUM_TOL = 1e-4


def _check_tensor(x, name: str, ndim: int | None, min_ndim: int = 2) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(x).__name__} "
            "(convert NumPy arrays with torch.from_numpy)"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must be at least {min_ndim}-d [..., N, K], got {tuple(x.shape)}")


def _check_finite(x: torch.Tensor, name: str) -> None:
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")


def _check_classes(k: int, name: str) -> None:
    if k < 2:
        raise ValueError(f"{name} must have at least K=2 classes in its last dimension, got {k}")


def check_probabilities(
    probs: torch.Tensor,
    name: str = "probs",
    ndim: int | None = None,
    tol: float = SUM_TOL,
    allow_empty: bool = False,
) -> None:
    """``ValueError`` unless ``probs`` [..., N, K] holds probability rows.

    Rows must be finite, non-negative and sum to one within ``tol``; K >= 2; at least
    one row unless ``allow_empty``.
    """
    _check_tensor(probs, name, ndim)
    _check_classes(probs.shape[-1], name)
    if probs.shape[-2] == 0 and not allow_empty:
        raise ValueError(f"{name} has no rows (shape {tuple(probs.shape)})")
    if probs.numel() == 0:
        return
    _check_finite(probs, name)
    if (probs < 0).any():
        raise ValueError(f"{name} has negative entries (min {probs.min().item():.3g})")
    err = (probs.sum(-1) - 1).abs().max().item()
    if err > tol:
        raise ValueError(
            f"{name} rows must sum to one (largest deviation {err:.3g} > tol {tol:g}); "
            "pass logits with a temperature, or normalise the rows"
        )


def probabilities_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """x = softmax(temperature * logits) over the last dimension (design §9, input 2)."""
    _check_tensor(logits, "logits", None)
    _check_classes(logits.shape[-1], "logits")
    check_temperature(temperature)
    _check_finite(logits, "logits")
    return torch.softmax(temperature * logits, -1)


def softmax_cosine(
    embeddings: torch.Tensor, class_embeddings: torch.Tensor, temperature: float
) -> torch.Tensor:
    """softmax_k(T cos(e_n, t_k)) without input checks (the engine of
    :func:`probfsl.data.simplex.probabilities_from_embeddings`).

    An all-zero row on either side has cosine 0 with everything (``normalize`` leaves it
    zero): estimators use this for prototypes that may vanish in degenerate tasks (a
    class whose normalised support rows cancel, D = 1), which gives them logit 0.
    """
    e = torch.nn.functional.normalize(embeddings, dim=-1)
    t = torch.nn.functional.normalize(class_embeddings.to(e), dim=-1)
    return torch.softmax(temperature * (e @ t.transpose(-1, -2)), -1)


def probabilities_from_embeddings(
    embeddings: torch.Tensor,
    class_embeddings: torch.Tensor,
    temperature: float = 30.0,
) -> torch.Tensor:
    """x_n = softmax_k(T cos(e_n, t_k)) (paper eq. 2; design §9, input 3).

    Args:
        embeddings: ``[..., N, D]`` sample embeddings (image or sentence embeddings).
        class_embeddings: ``[K, D]`` one embedding per class (text prompt, class
            description or prototype), or ``[..., K, D]`` per task (batch dims matching).
        temperature: T; 30 is the paper's choice for CLIP cosines.

    Both sides are L2-normalised here. Returns ``[..., N, K]`` probabilities.
    """
    _check_tensor(embeddings, "embeddings", None)
    _check_tensor(class_embeddings, "class_embeddings", None)
    check_temperature(temperature)
    k, d = class_embeddings.shape[-2], class_embeddings.shape[-1]
    _check_classes(k, "class_embeddings (rows)")
    if embeddings.shape[-1] != d:
        raise ValueError(
            f"class_embeddings width {d} does not match the embeddings width {embeddings.shape[-1]}"
        )
    if class_embeddings.ndim > 2 and class_embeddings.shape[:-2] != embeddings.shape[:-2]:
        raise ValueError(
            f"class_embeddings batch shape {tuple(class_embeddings.shape[:-2])} does not match "
            f"the embeddings batch shape {tuple(embeddings.shape[:-2])}"
        )
    _check_finite(embeddings, "embeddings")
    _check_finite(class_embeddings, "class_embeddings")
    if (class_embeddings.norm(dim=-1) == 0).any():
        raise ValueError("class_embeddings has an all-zero row (no direction for a class)")
    return softmax_cosine(embeddings, class_embeddings, temperature)


def zero_shot_probabilities(
    fs: FeatureSet,
    tasks: ZeroShotTasks,
    temperature: float = 30.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[T, Q, C]`` probabilities softmax(T cos(embedding, class embedding)) over all C classes.

    Input form 3 (paper eq. 2) for zero-shot tasks: ``fs`` is a
    :class:`~probfsl.data.featureset.FeatureSet` with ``class_features`` (e.g. WordNet's
    class-description embeddings), ``tasks`` from
    :func:`~probfsl.data.tasks.sample_zero_shot_tasks`; row ``[t, n]`` is the query
    ``tasks.query_index[t, n]`` of ``fs`` against every class embedding.
    """
    if fs.class_features is None:
        raise ValueError(f"{fs.name}: zero-shot needs class_features (one embedding per class)")
    embeddings = torch.as_tensor(fs.features)[tasks.query_index].to(dtype)
    class_features = torch.as_tensor(fs.class_features).to(dtype)
    return probabilities_from_embeddings(embeddings, class_features, temperature)
