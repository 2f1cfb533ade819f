"""The estimator interface shared by every few-shot method.

An estimator holds its hyperparameters from ``__init__``; ``fit_base`` learns the
statistics a method is allowed to take from the labelled base classes (centring
means, within-class scatter, ...); ``predict_proba`` classifies the queries of a
batch of tasks at once. Fitted attributes end in ``_``.

Input checks come from :mod:`probfsl.validation` (re-exported here as
``check_base`` / ``check_episodes`` for the estimators): every ``fit_base`` accepts
tensors or NumPy arrays and every ``predict_proba`` checks its episodes before
computing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Self

import torch

from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import Episodes
from probfsl.validation import (
    check_base,
    check_episodes,
    check_float_dtype,
    check_hyperparameter,
)

__all__ = [
    "BaseMeanCentering",
    "FewShotClassifier",
    "check_base",
    "check_episodes",
    "check_hyperparameter",
    "check_temperature",
]


def check_temperature(value: Any, name: str = "temperature") -> float:
    """A softmax (inverse) temperature: finite and positive (a negative one would invert
    the ranking silently, NaN would make every probability NaN)."""
    return check_hyperparameter(name, value, positive=True)


class FewShotClassifier(ABC):
    """Batched few-shot classifier: ``[T]`` tasks in, ``[T, Q, K]`` query probabilities out."""

    #: whether the method uses the unlabelled queries of a task jointly
    transductive: bool = False
    #: whether ``fit_base`` must be called before ``predict_proba``
    needs_base: bool = False

    def fit_base(self, features: Any, labels: Any) -> Self:
        """Learn base-class statistics from ``features`` [N, D] and ``labels`` [N]
        (tensors or NumPy arrays; checked by :func:`~probfsl.validation.check_base`)."""
        check_base(features, labels)
        return self

    def fit_featureset(self, fs: FeatureSet, dtype: torch.dtype = torch.float32) -> Self:
        """Learn what the method may take from a FeatureSet before any task (its base classes)."""
        if not isinstance(fs, FeatureSet):
            raise TypeError(f"fs must be a FeatureSet, got {type(fs).__name__}")
        check_float_dtype("dtype", dtype)
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

    def fit_base(self, features: Any, labels: Any) -> Self:
        """Store the mean of the base ``features`` [N, D] (tensor or NumPy array)."""
        features, _ = check_base(features, labels)
        self.base_mean_ = features.mean(0)
        return self

    def centring_mean(self) -> torch.Tensor | None:
        """The base mean to subtract, ``None`` without centring; ``ValueError`` if not fitted."""
        if not self.center:
            return None
        if getattr(self, "base_mean_", None) is None:
            raise ValueError("center=True needs base features: call fit_base first")
        return self.base_mean_

    def checked_centring_mean(self, episodes: Episodes) -> torch.Tensor | None:
        """:meth:`centring_mean` after :func:`~probfsl.validation.check_episodes` of
        ``episodes`` (with the base width when centring, so that tasks wider or narrower
        than the base features are a ``ValueError``, not a broadcasting error)."""
        mean = self.centring_mean()
        check_episodes(episodes, dim=None if mean is None else mean.shape[0])
        return mean
