"""Transductive soft k-means baseline (BAVARDAGE's initialiser, docs/design/bavardage.md §3.4)."""

from __future__ import annotations

import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.soft_kmeans import soft_kmeans_gram, soft_kmeans_gram_open
from probfsl.inference.vb_mixture_open import OPEN_FRAMES
from probfsl.models.base import (
    BACKGROUND,
    BASE_MEAN,
    OPEN_NEIGHBOURS,
    OPEN_PRIOR,
    BaseMeanCentering,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.schema import Choice, EstimatorSchema, Flag, Int, Real


class SoftKMeans(OpenSetBackground, BaseMeanCentering, FewShotClassifier):
    """Soft k-means on centred, L2-normalised features, seeded by the support means.

    Args:
        temperature: T_km, the inverse temperature multiplying squared distances
            (finite, positive).
        n_iter: number of passes (5 in the reference code; a positive integer).
        center: centre the features on the base-class mean first (needs ``fit_base``).
        open_prior: prior mean of the open fraction π_0 (:meth:`predict_proba_open`).
        open_scale, open_shift: a and b of P'(open) = σ(a logit P(open) + b), the
            calibration of :meth:`predict_proba_open`'s last column (``preset="auto"``
            learns a); ``None`` (the defaults): as held-out base classes ask
            (:meth:`~probfsl.models.base.OpenSetBackground.open_calibration`).
        open_frame: the frame of the open contrast of :meth:`predict_proba_open`:
            ``"queries"`` (the task re-centred on its queries' mean and normalised again,
            and, after the passes, the background's mean inferred from the queries for
            the last reading of P(open); transductive) or
            ``"base"`` (centred on the base mean only;
            :class:`~probfsl.inference.background.TwoCovarianceReading`,
            ``query_centring``). Default ``"queries"``, the higher AUROC where about
            half the queries are open, as ``open_prior`` = 1/2 assumes; with a tenth
            open, ``"base"`` ranks better, and ``preset="auto"`` chooses between them on
            base episodes with the run's open queries (docs/methods/open-set.md).
        open_neighbours: k, the nearest queries each query's P(open) log-odds are
            averaged with (:meth:`~probfsl.models.base.OpenSetBackground.tempered_open`);
            default 0, none.

    Open set (:meth:`predict_proba_open`): one more component, the background, whose
    responsibility is taken in the full feature space: the two-covariance predictive of a
    new class of the base classes against the classes' predictives given the support and
    the queries weighted by their current class responsibilities
    (:class:`~probfsl.inference.background.TwoCovarianceReading`), with its weight π_0
    inferred per task inside the passes; among the classes, soft k-means'
    responsibilities, times 1 - o_q0; centroids move by the class responsibilities only
    (:func:`~probfsl.inference.soft_kmeans.soft_kmeans_gram_open`). In the queries'
    frame the passes use the base classes' background, and P(open) is read last under
    the task's own, its mean inferred from the queries, the class factors fixed
    (:meth:`~probfsl.models.base.OpenSetBackground.final_open`).
    """

    transductive = True
    schema = EstimatorSchema(
        params={
            "temperature": Real(positive=True),
            "n_iter": Int(low=1),
            "center": Flag(),
            "open_prior": OPEN_PRIOR,
            "open_scale": Real(positive=True, optional=True),
            "open_shift": Real(optional=True),
            "open_frame": Choice(OPEN_FRAMES),
            "open_neighbours": OPEN_NEIGHBOURS,
        },
        fitted=(BASE_MEAN, BACKGROUND),
    )

    def __init__(
        self,
        temperature: float = 10.0,
        n_iter: int = 5,
        center: bool = True,
        open_prior: float = 0.5,
        open_scale: float | None = None,
        open_shift: float | None = None,
        open_frame: str = "queries",
        open_neighbours: int = 0,
    ) -> None:
        self.temperature = temperature
        self.n_iter = n_iter
        self.center = center
        self.open_prior = open_prior
        self.open_scale = open_scale
        self.open_shift = open_shift
        self.open_frame = open_frame
        self.open_neighbours = open_neighbours

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

    @property
    def infers_open_fraction(self) -> bool:
        """True: q(π_0) per task, ``open_prior`` its prior mean."""
        return True

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """Query responsibilities ``[T, Q, K+1]`` of soft k-means with the background
        component (class docstring), the background last."""
        return self.tempered_open(episodes)

    def inferred_open(self, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """The known classes' shares [T, Q, K] and the log-odds of P(open) [T, Q] as
        inferred (:meth:`final_open`), before ``open_scale`` and ``open_shift``."""
        self._check_params()
        mean = self.checked_centring_mean(episodes)
        x = center_and_normalize(episodes.points(), mean)
        n_s = episodes.support.shape[1]
        reading = self.open_reading(
            x[:, :n_s], episodes.support_labels, x[:, n_s:], episodes.way, self.in_queries_frame
        )
        p = soft_kmeans_gram_open(
            x @ x.transpose(1, 2),
            episodes.support_labels,
            episodes.way,
            None,
            self.open_prior,
            self.temperature,
            int(self.n_iter),
            open_log_odds=reading.open_log_odds(),
        )
        return self.final_open(reading, p[:, n_s:])  # P(open) read last
