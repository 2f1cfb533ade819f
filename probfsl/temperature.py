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

A temperature is fitted only where it can be estimated: on base episodes that the
method classifies (almost) perfectly, the NLL keeps falling as ``τ`` shrinks, so the
"optimal" temperature merely sharpens the probabilities and is driven by a handful of
errors; on novel classes, which are seldom as easy, that ruins them. So ``τ`` is fitted
only when the base episodes hold at least :data:`MIN_ERRORS` misclassified queries
making at least :data:`MIN_ERROR_RATE` of them (:func:`fit_base_temperature`);
otherwise the probabilities are left as they are (``τ`` = 1) and ``notes_`` says why.

The fitted temperature is stored in the tuning cache (:mod:`probfsl.tuning_cache`)
under the base data, the estimator and its hyperparameters, and the episode setting, so
a second run with the same choice does not fit it again.
"""

from __future__ import annotations

import copy
import logging
from typing import Self

import torch

from probfsl import tuning_cache
from probfsl.data.base_episodes import base_episode_shape, base_episode_split
from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import Episodes, sample_episodes
from probfsl.evaluation.calibration import apply_temperature, fit_temperature
from probfsl.models.base import FewShotClassifier
from probfsl.validation import check_base, check_choice, check_hyperparameter

log = logging.getLogger(__name__)

#: fewest misclassified base queries a temperature is fitted from (below, ``τ`` = 1)
MIN_ERRORS = 20
#: lowest share of misclassified base queries a temperature is fitted from
MIN_ERROR_RATE = 0.02


def fit_base_temperature(
    proba: torch.Tensor,
    labels: torch.Tensor,
    min_errors: int = MIN_ERRORS,
    min_error_rate: float = MIN_ERROR_RATE,
) -> tuple[float | None, str]:
    """The NLL-optimal temperature of ``proba`` [T, Q, K] on ``labels`` [T, Q], or ``None``
    with the reason when it cannot be estimated.

    It can when at least ``min_errors`` queries, and a share ``min_error_rate`` of them,
    are misclassified: with fewer, the NLL falls as ``τ`` shrinks (every correct query
    gains confidence) and the minimiser is set by a few errors, a sharpening that does not
    carry over to harder tasks.
    """
    errors = int((proba.argmax(-1) != labels.to(proba.device)).sum())
    total = labels.numel()
    if errors < min_errors or errors < min_error_rate * total:
        return None, (
            f"the base episodes hold {errors} misclassified queries of {total} (a "
            f"temperature needs at least {min_errors} and {min_error_rate:.0%}): not "
            "fitted, the probabilities are left as the method gives them"
        )
    return fit_temperature(proba, labels), ""


class TemperatureScaled(FewShotClassifier):
    """``estimator`` with its query probabilities tempered by a base-episode ``τ``.

    Fitted attributes: ``temperature_`` (dict from task shape to ``τ``),
    ``estimator_`` (the wrapped estimator fitted on all base classes) and ``notes_``
    (task shape to a note when the base classes could not form episodes of that
    shape: ``τ`` is then fitted on the largest shape they allow
    (:func:`probfsl.data.base_episodes.base_episode_shape`), or left at 1 with fewer than 4 base
    classes; or when the base episodes hold too few errors to estimate ``τ``
    (:func:`fit_base_temperature`): it is then left at 1, not applied).
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
            key = self._cache_key(fitted_on)
            stored = tuning_cache.load(key)
            if stored is not None and "temperature" in stored:
                tau, note = stored["temperature"], stored.get("note", "")
                log.debug("temperature scaling: tau read from the cache")
            else:
                tau, note = self._fit(fitted_on, dtype, device)
                tuning_cache.store(key, {"temperature": tau, "note": note})
            notes = [note] if note else []
            if fitted_on != shape and tau is not None:
                notes.insert(0, f"temperature fitted on {fitted_on} (way, shot, queries)")
            if notes:
                self.notes_[shape] = "; ".join(notes)
            self.temperature_[shape] = 1.0 if tau is None else float(tau)
            if tau is not None:
                log.info(
                    "temperature scaling: tau = %.3f for %d-way %d-shot %d-query tasks, "
                    "fitted on %d-way %d-shot %d-query base-class episodes",
                    self.temperature_[shape],
                    *shape,
                    *fitted_on,
                )
        return self.temperature_[shape]

    def _fit(
        self, shape: tuple[int, int, int], dtype: torch.dtype, device
    ) -> tuple[float | None, str]:
        """``τ`` (or ``None``) and the note, fitted on base episodes of ``shape``."""
        view = base_episode_split(self.base_, self.seed)
        episodes = sample_episodes(
            view,
            self.n_episodes,
            *shape,
            balance=self.balance,
            alpha=self.alpha,
            seed=self.seed,
            dtype=dtype,
            device=device,
        )
        pseudo = copy.deepcopy(self.estimator).fit_featureset(view, dtype, device)
        return fit_base_temperature(pseudo.predict_proba(episodes), episodes.query_labels)

    def _cache_key(self, shape: tuple[int, int, int]) -> dict:
        """What the temperature depends on: the base data, the estimator and its
        hyperparameters, the base episodes and the thresholds (not the dtype or device)."""
        from probfsl import __version__

        cls = type(self.estimator)
        return {
            "kind": "temperature",
            "data": tuning_cache.fingerprint(self.base_),
            "probfsl": __version__,
            "estimator": f"{cls.__module__}.{cls.__qualname__}",
            "params": self.estimator.get_params(),
            "shape": list(shape),
            "balance": self.balance,
            "alpha": self.alpha if self.balance == "dirichlet" else None,
            "n_episodes": self.n_episodes,
            "seed": self.seed,
            "thresholds": [MIN_ERRORS, MIN_ERROR_RATE],
        }

    def prepare(self, episodes: Episodes) -> None:
        """The wrapped estimator's preparation and ``τ`` for the tasks' shape."""
        if getattr(self, "estimator_", None) is None:
            raise ValueError("base features missing: call fit_base(features, labels) first")
        self.estimator_.prepare(episodes)
        self.fit_shape(
            episodes.way,
            episodes.shot,
            episodes.n_query,
            episodes.support.dtype,
            episodes.support.device,
        )

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
