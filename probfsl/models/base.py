"""The estimator interface shared by every few-shot method.

An estimator holds its hyperparameters from ``__init__``; ``fit_base`` learns the
statistics a method is allowed to take from the labelled base classes (centring
means, within-class scatter, ...); ``predict_proba`` classifies the queries of a
batch of tasks at once. Fitted attributes end in ``_``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self

import torch

from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import Episodes
from probfsl.inference.base import check_task_tensors


class FewShotClassifier(ABC):
    """Batched few-shot classifier: ``[T]`` tasks in, ``[T, Q, K]`` query probabilities out."""

    #: whether the method uses the unlabelled queries of a task jointly
    transductive: bool = False
    #: whether ``fit_base`` must be called before ``predict_proba``
    needs_base: bool = False

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        """Learn base-class statistics from ``features`` [N, D] and ``labels`` [N]."""
        check_base(features, labels)
        return self

    def fit_featureset(self, fs: FeatureSet, dtype: torch.dtype = torch.float32) -> Self:
        """Learn what the method may take from a FeatureSet before any task (its base classes)."""
        if self.needs_base:
            self.fit_base(*fs.base(dtype))
        return self

    @abstractmethod
    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Class probabilities ``[T, Q, K]`` for the queries of every task."""

    def predict(self, episodes: Episodes) -> torch.Tensor:
        """Predicted task-local labels ``[T, Q]``."""
        return self.predict_proba(episodes).argmax(-1)

    def fit_predict(self, episodes: Episodes) -> torch.Tensor:
        """Fit on each task's support (and queries, when transductive) and predict its queries."""
        return self.predict(episodes)

    def get_params(self) -> dict:
        """Hyperparameters as given to ``__init__`` (public attributes not ending in ``_``)."""
        return {
            k: v for k, v in vars(self).items() if not k.startswith("_") and not k.endswith("_")
        }

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"


class BaseMeanCentering:
    """Mixin for estimators that centre features on the base-class mean (SimpleShot).

    The estimator sets ``self.center``; ``fit_base`` stores ``base_mean_`` (the mean
    of all base features) and :meth:`centring_mean` returns it, or ``None`` when
    ``center`` is off.
    """

    center: bool = True

    @property
    def needs_base(self) -> bool:
        return self.center

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        check_base(features, labels)
        self.base_mean_ = features.mean(0)
        return self

    def centring_mean(self) -> torch.Tensor | None:
        """The base mean to subtract, ``None`` without centring; ``ValueError`` if not fitted."""
        if not self.center:
            return None
        if getattr(self, "base_mean_", None) is None:
            raise ValueError("center=True needs base features: call fit_base first")
        return self.base_mean_


def check_base(features: torch.Tensor, labels: torch.Tensor, min_classes: int = 1) -> None:
    """``ValueError`` unless base ``features`` [N, D] and ``labels`` [N] are usable."""
    if features is None or features.ndim != 2 or features.shape[0] == 0:
        shape = None if features is None else tuple(features.shape)
        raise ValueError(f"base features must be a non-empty [N, D] tensor, got shape {shape}")
    if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(
            f"base labels must be [N={features.shape[0]}], got shape {tuple(labels.shape)}"
        )
    if not torch.isfinite(features).all():
        raise ValueError("base features contain NaN or inf")
    n_classes = labels.unique().numel()
    if n_classes < min_classes:
        raise ValueError(f"base features need at least {min_classes} classes, got {n_classes}")


def check_episodes(episodes: Episodes, dim: int | None = None) -> None:
    """``ValueError`` unless the episode tensors are consistent (and ``dim`` wide)."""
    s, q = episodes.support, episodes.query
    check_task_tensors(s, episodes.support_labels, q, episodes.way)
    if dim is not None and s.shape[2] != dim:
        raise ValueError(f"query/support width {s.shape[2]} does not match the base width {dim}")
    if not (all_finite(s) and all_finite(q)):
        raise ValueError("support or query features contain NaN or inf")


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite, from one reduction in the common case.

    A NaN or ±inf entry makes the sum NaN or ±inf, so a finite sum proves every entry
    finite; only a non-finite sum (bad entries, or an overflow of finite ones) runs the
    element-wise test. This keeps validation cheap on [T, n, 1280] task tensors.
    """
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())
