"""Nearest class mean with cosine similarity (SimpleShot; Wang et al. 2019)."""

from __future__ import annotations

from typing import Self

import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.kmeans import class_means, one_hot_support
from probfsl.models.base import FewShotClassifier, check_base, check_episodes


class NearestCentroid(FewShotClassifier):
    """Inductive baseline: cosine similarity to the mean of each class's support.

    Features are centred on the base-class mean (when ``center`` and base features
    are given) and L2-normalised; the prototype of a class is the mean of its
    normalised support features. Probabilities are softmax(temperature * cosine).
    """

    def __init__(self, center: bool = True, temperature: float = 10.0) -> None:
        self.center = center
        self.temperature = temperature

    @property
    def needs_base(self) -> bool:
        return self.center

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        check_base(features, labels)
        self.base_mean_ = features.mean(0)
        return self

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        check_episodes(episodes)
        mean = getattr(self, "base_mean_", None) if self.center else None
        if self.center and mean is None:
            raise ValueError("center=True needs base features: call fit_base first")
        support = center_and_normalize(episodes.support, mean)
        query = center_and_normalize(episodes.query, mean)
        labels = one_hot_support(episodes.support_labels, episodes.way, support.dtype)
        prototypes = torch.nn.functional.normalize(class_means(support, labels), dim=-1)
        cosine = query @ prototypes.transpose(1, 2)
        return torch.softmax(self.temperature * cosine, -1)
