"""Transductive soft k-means baseline (the initialiser of BAVARDAGE, spec §3.4)."""

from __future__ import annotations

import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.kmeans import soft_kmeans_gram
from probfsl.models.base import BaseMeanCentering, FewShotClassifier, check_episodes


class SoftKMeans(BaseMeanCentering, FewShotClassifier):
    """Soft k-means on centred, L2-normalised features, seeded by the support means.

    Args:
        temperature: T_km, the inverse temperature multiplying squared distances.
        n_iter: number of passes (5 in the reference code).
        center: centre the features on the base-class mean first (needs ``fit_base``).
    """

    transductive = True

    def __init__(self, temperature: float = 10.0, n_iter: int = 5, center: bool = True) -> None:
        self.temperature = temperature
        self.n_iter = n_iter
        self.center = center

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        check_episodes(episodes)
        mean = self.centring_mean()
        x = center_and_normalize(episodes.points(), mean)
        p = soft_kmeans_gram(
            x @ x.transpose(1, 2),
            episodes.support_labels,
            episodes.way,
            self.temperature,
            self.n_iter,
        )
        return p[:, episodes.support.shape[1] :]
