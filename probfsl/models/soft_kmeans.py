"""Transductive soft k-means baseline (BAVARDAGE's initialiser, docs/design/bavardage.md §3.4)."""

from __future__ import annotations

import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.soft_kmeans import soft_kmeans_gram
from probfsl.models.base import BASE_MEAN, BaseMeanCentering, FewShotClassifier
from probfsl.schema import EstimatorSchema, Flag, Int, Real


class SoftKMeans(BaseMeanCentering, FewShotClassifier):
    """Soft k-means on centred, L2-normalised features, seeded by the support means.

    Args:
        temperature: T_km, the inverse temperature multiplying squared distances
            (finite, positive).
        n_iter: number of passes (5 in the reference code; a positive integer).
        center: centre the features on the base-class mean first (needs ``fit_base``).
    """

    transductive = True
    schema = EstimatorSchema(
        params={"temperature": Real(positive=True), "n_iter": Int(low=1), "center": Flag()},
        fitted=(BASE_MEAN,),
    )

    def __init__(self, temperature: float = 10.0, n_iter: int = 5, center: bool = True) -> None:
        self.temperature = temperature
        self.n_iter = n_iter
        self.center = center

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Query responsibilities ``[T, Q, K]`` after ``n_iter`` soft k-means passes."""
        self._check_params()
        mean = self.checked_centring_mean(episodes)
        x = center_and_normalize(episodes.points(), mean)
        p = soft_kmeans_gram(
            x @ x.transpose(1, 2),
            episodes.support_labels,
            episodes.way,
            self.temperature,
            int(self.n_iter),
        )
        return p[:, episodes.support.shape[1] :]
