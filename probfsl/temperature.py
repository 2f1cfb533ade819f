"""Temperature scaling of a few-shot method, fitted on base-class episodes only.

:class:`TemperatureScaled` wraps any estimator. At the first task batch of each shape
(way, shot, queries) it samples labelled episodes from the base classes exactly as
the hyperparameter search does (:func:`probfsl.data.base_episodes.base_episode_split`: half of
the base classes play the novel classes, the other half the base classes), fits one
temperature ``τ`` on them by minimising the query NLL
(:func:`probfsl.evaluation.calibration.fit_temperature`; Guo et al., ICML 2017), then
predicts ``softmax(log p / τ)`` with the wrapped estimator fitted on all base classes.
Novel classes and query labels are never read, and the argmax (hence the accuracy)
is unchanged. The base episodes are drawn in the dtype and on the device of the tasks.
"""

from __future__ import annotations

import copy
import logging
from typing import Self

import torch

from probfsl.data.base_episodes import base_episode_shape, base_episode_split
from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import Episodes, sample_episodes
from probfsl.evaluation.calibration import apply_temperature, fit_temperature
from probfsl.models.base import FewShotClassifier
from probfsl.validation import check_base, check_choice, check_hyperparameter

log = logging.getLogger(__name__)


class TemperatureScaled(FewShotClassifier):
    """``estimator`` with its query probabilities tempered by a base-episode ``τ``.

    Fitted attributes: ``temperature_`` (dict from task shape to ``τ``),
    ``estimator_`` (the wrapped estimator fitted on all base classes) and ``notes_``
    (task shape to a note when the base classes could not form episodes of that
    shape: ``τ`` is then fitted on the largest shape they allow
    (:func:`probfsl.data.base_episodes.base_episode_shape`), or left at 1 with fewer than 4 base
    classes).
    """

    needs_base = True

    def __init__(
        self,
        estimator: FewShotClassifier,
        balance: str = "dirichlet",
        alpha: float = 2.0,
        n_episodes: int = 300,
        seed: int = 0,
    ) -> None:
        self.estimator = estimator
        self.balance = balance
        self.alpha = alpha
        self.n_episodes = n_episodes
        self.seed = seed

    @property
    def transductive(self) -> bool:
        return self.estimator.transductive

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        check_choice("balance", self.balance, ("balanced", "dirichlet"))
        check_hyperparameter("alpha", self.alpha, positive=True)
        check_hyperparameter("n_episodes", self.n_episodes, integer=True, low=2)
        features, labels = check_base(features, labels)
        self.base_ = FeatureSet.of_base_classes(features, labels)
        self.estimator_ = copy.deepcopy(self.estimator).fit_base(features, labels)
        self.temperature_, self.notes_ = {}, {}
        return self

    def fit_shape(
        self,
        way: int,
        shot: int,
        n_query: int,
        dtype: torch.dtype,
        device: str | torch.device | None = None,
    ) -> float:
        """Fit (or return) ``τ`` for tasks of this shape on base-class episodes of
        ``dtype`` on ``device`` (default the CPU)."""
        shape = (way, shot, n_query)
        if shape not in self.temperature_:
            fitted_on = base_episode_shape(self.base_, way, shot, n_query, self.balance, self.seed)
            if fitted_on is None:
                self.notes_[shape] = "too few base classes for base episodes: temperature 1"
                self.temperature_[shape] = 1.0
                return 1.0
            if fitted_on != shape:
                self.notes_[shape] = f"temperature fitted on {fitted_on} (way, shot, queries)"
            view = base_episode_split(self.base_, self.seed)
            episodes = sample_episodes(
                view,
                self.n_episodes,
                *fitted_on,
                balance=self.balance,
                alpha=self.alpha,
                seed=self.seed,
                dtype=dtype,
                device=device,
            )
            pseudo = copy.deepcopy(self.estimator).fit_featureset(view, dtype, device)
            proba = pseudo.predict_proba(episodes)
            self.temperature_[shape] = fit_temperature(proba, episodes.query_labels)
            log.info(
                "temperature scaling: tau = %.3f for %d-way %d-shot %d-query tasks (fitted on "
                "base-class episodes)",
                self.temperature_[shape],
                *shape,
            )
        return self.temperature_[shape]

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        if getattr(self, "estimator_", None) is None:
            raise ValueError("base features missing: call fit_base(features, labels) first")
        tau = self.fit_shape(
            episodes.way,
            episodes.shot,
            episodes.n_query,
            episodes.support.dtype,
            episodes.support.device,
        )
        return apply_temperature(self.estimator_.predict_proba(episodes), tau)
