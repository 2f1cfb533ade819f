"""Transductive soft k-means baseline (BAVARDAGE's initialiser, docs/design/bavardage.md §3.4)."""

from __future__ import annotations

import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.background import isotropic_scale
from probfsl.inference.soft_kmeans import (
    isotropic_background_logit,
    soft_kmeans_gram,
    soft_kmeans_gram_open,
)
from probfsl.models.base import (
    BACKGROUND,
    BASE_MEAN,
    OPEN_PRIOR,
    BaseMeanCentering,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.schema import EstimatorSchema, Flag, Int, Real


class SoftKMeans(OpenSetBackground, BaseMeanCentering, FewShotClassifier):
    """Soft k-means on centred, L2-normalised features, seeded by the support means.

    Args:
        temperature: T_km, the inverse temperature multiplying squared distances
            (finite, positive).
        n_iter: number of passes (5 in the reference code; a positive integer).
        center: centre the features on the base-class mean first (needs ``fit_base``).
        open_prior: prior mean of the open fraction π_0 (:meth:`predict_proba_open`).

    Open set (:meth:`predict_proba_open`): one more component, the predictive of a new
    class whose centre is drawn from the base classes' isotropic between-class spread,
    under the same tempered isotropic model
    (:func:`~probfsl.inference.soft_kmeans.isotropic_background_logit`), with its weight
    π_0 inferred per task inside the passes
    (:func:`~probfsl.inference.soft_kmeans.soft_kmeans_gram_open`).
    """

    transductive = True
    schema = EstimatorSchema(
        params={
            "temperature": Real(positive=True),
            "n_iter": Int(low=1),
            "center": Flag(),
            "open_prior": OPEN_PRIOR,
        },
        fitted=(BASE_MEAN, BACKGROUND),
    )

    def __init__(
        self,
        temperature: float = 10.0,
        n_iter: int = 5,
        center: bool = True,
        open_prior: float = 0.5,
    ) -> None:
        self.temperature = temperature
        self.n_iter = n_iter
        self.center = center
        self.open_prior = open_prior

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

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """Query responsibilities ``[T, Q, K+1]`` of soft k-means with the background
        component (class docstring), the background last."""
        self._check_params()
        mean = self.checked_centring_mean(episodes)
        x = center_and_normalize(episodes.points(), mean)
        stats = self.background_stats(x)
        between = isotropic_scale(stats.between)
        logit = isotropic_background_logit(x, stats.mean, between, self.temperature)
        p = soft_kmeans_gram_open(
            x @ x.transpose(1, 2),
            episodes.support_labels,
            episodes.way,
            logit,
            self.open_prior,
            self.temperature,
            int(self.n_iter),
        )
        return p[:, episodes.support.shape[1] :]
