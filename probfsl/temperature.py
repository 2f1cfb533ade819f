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

A temperature is applied whatever it does only from :data:`MIN_CLASSES` base classes or
more. How hard episodes are varies from class to class, and with a handful of base
classes the base episodes are as likely to be much harder than the novel tasks as much
easier (on draws of 4-5 classes of the built-in sets, nearest centroid's base error rate
was 0.4 to 2.2 times its novel one), so the temperature fitted on them flattens or
sharpens the novel probabilities by chance: on those draws, a temperature fitted on
episodes of all their base classes raised nearest centroid's novel NLL in five of six.
From fewer base classes it is applied only where it at least halves the NLL of their
episodes (:data:`FEW_CLASSES_GAIN`): probabilities that far off (a transductive mixture
in hundreds of dimensions, sure of every answer) are far off on the novel tasks too.

A temperature sets the spread of the probabilities over the task's classes, so it is
fitted at the tasks' way. Where the base classes are too few for base episodes of the
tasks' shape (half of them playing novel classes), it is fitted on episodes of the
tasks' way whose classes are drawn from the base classes, the others (two, else one)
giving the base statistics (:func:`probfsl.data.base_episodes.class_subset_views`);
where not even that is possible it is not applied (``τ`` = 1) and ``notes_`` says so:
a temperature fitted on 2-way episodes sharpens or flattens 4-way probabilities by the
wrong amount (on a 4-base-class Omniglot draw, soft k-means' NLL on novel 4-way tasks
rose from 0.20 to 0.34 with the 2-way temperature).

Open-set tasks (``n_open`` open queries a task, :mod:`probfsl.data.open_set`): the
temperature applies to the known classes alone. :meth:`TemperatureScaled.predict_proba_open`
tempers the wrapped estimator's K known columns given "known", P(k | known) ∝ P(k)^(1/τ),
and keeps its P(none of these classes) as it is (that column has its own calibration,
:meth:`~probfsl.models.base.OpenSetBackground.open_calibration`). ``τ`` is then fitted on
base episodes with as many open queries, from other base classes, on the closed
queries' known columns; where the base classes cannot hold them, on closed episodes (a
note says so). On WordNet at 1 shot, BAVARDAGE's known columns in open-set tasks had an
ECE of 0.32 untempered and 0.16 tempered (NLL 2.16 and 1.05; 200 novel tasks), with
``τ`` 4.1 fitted on open base episodes and 4.5 on closed ones.

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
from probfsl.data.base_episodes import (
    base_episode_shape,
    base_episode_split,
    class_sizes,
    class_subset_views,
    open_base_episode_shape,
)
from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import Episodes, sample_episodes
from probfsl.evaluation.calibration import (
    apply_temperature,
    calibration_per_task,
    fit_temperature,
)
from probfsl.evaluation.open_set import has_open_posterior
from probfsl.models.base import FewShotClassifier
from probfsl.validation import check_base, check_choice, check_hyperparameter

log = logging.getLogger(__name__)

#: fewest misclassified base queries a temperature is fitted from (below, ``τ`` = 1)
MIN_ERRORS = 20
#: lowest share of misclassified base queries a temperature is fitted from
MIN_ERROR_RATE = 0.02
#: fewest base classes a temperature is applied from whatever it does (below, only where
#: it divides their episodes' NLL by :data:`FEW_CLASSES_GAIN` or more)
MIN_CLASSES = 10
#: the largest NLL ratio (tempered / as given) on the episodes of fewer than
#: :data:`MIN_CLASSES` base classes at which their temperature is applied
FEW_CLASSES_GAIN = 0.5
#: class draws of the episodes of the tasks' way where the base classes cannot form
#: episodes of the tasks' shape
WAY_DRAWS = 10


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


def _few_classes_temperature(
    proba: torch.Tensor, labels: torch.Tensor, tau: float, n_base: int
) -> tuple[float | None, str]:
    """``(τ, note)`` on fewer than :data:`MIN_CLASSES` base classes: ``tau`` (fitted on
    their episodes ``proba`` [T, Q, K], ``labels`` [T, Q]) where it at least halves their
    NLL (:data:`FEW_CLASSES_GAIN`), else ``None``; the note says which."""

    def nll(p: torch.Tensor) -> float:  # the episodes hold as many queries each
        return float(calibration_per_task(p.double(), labels)["nll"].mean())

    before, after = nll(proba), nll(apply_temperature(proba, tau))
    change = f"NLL {before:.3g} -> {after:.3g} on their episodes"
    if after <= FEW_CLASSES_GAIN * before:
        return tau, (
            f"fitted on only {n_base} base classes ({change}: the probabilities were far "
            "off, by more than a few classes' chance)"
        )
    return None, (
        f"{n_base} base classes are too few to fit a temperature that carries over to "
        f"other classes (it needs {MIN_CLASSES}, or to at least halve their episodes' "
        f"NLL: {change}): not applied (temperature 1)"
    )


class TemperatureScaled(FewShotClassifier):
    """``estimator`` with its query probabilities tempered by a base-episode ``τ``.

    ``n_open`` > 0: the tasks to come are open-set tasks with that many open queries
    each; ``τ`` is fitted for their closed queries (the module's doc) and
    :meth:`predict_proba_open` applies it.

    Fitted attributes: ``temperature_`` (dict from task shape to ``τ``),
    ``estimator_`` (the wrapped estimator fitted on all base classes) and ``notes_``
    (task shape to a note when ``τ`` was fitted on other episodes than the tasks' shape
    or not at all: on a smaller shape of the tasks' way
    (:func:`probfsl.data.base_episodes.base_episode_shape`) or on draws of base classes
    at the tasks' way; left at 1 where neither is possible, or where the base episodes
    hold too few errors to estimate it (:func:`fit_base_temperature`)).
    """

    needs_base = True

    def __init__(
        self,
        estimator: FewShotClassifier,
        balance: str = "dirichlet",
        alpha: float = 2.0,
        n_episodes: int = 300,
        seed: int = 0,
        n_open: int = 0,
    ) -> None:
        self.estimator = estimator
        self.balance = balance
        self.alpha = alpha
        self.n_episodes = n_episodes
        self.seed = seed
        self.n_open = n_open

    @property
    def transductive(self) -> bool:
        return self.estimator.transductive

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        check_choice("balance", self.balance, ("balanced", "dirichlet"))
        check_hyperparameter("alpha", self.alpha, positive=True)
        check_hyperparameter("n_episodes", self.n_episodes, integer=True, low=2)
        check_hyperparameter("n_open", self.n_open, integer=True, low=0)
        if self.n_open and not has_open_posterior(self.estimator):
            name = type(self.estimator).__name__
            raise ValueError(f"n_open={self.n_open}: {name} has no open-set posterior")
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
        """Fit (or return) ``τ`` for tasks of this shape (``n_query`` closed queries,
        with :attr:`n_open` open ones besides) on base-class episodes of ``dtype`` on
        ``device`` (default the CPU)."""
        shape = (way, shot, n_query)
        if shape not in self.temperature_:
            tau, where, note = self._fitted_or_cached(shape, dtype, device)
            notes = [note] if note else []
            if where is not None and tau is not None:
                notes.insert(0, f"temperature fitted on {where}")
            if notes:
                self.notes_[shape] = "; ".join(notes)
            self.temperature_[shape] = 1.0 if tau is None else float(tau)
            if tau is not None:
                log.info(
                    "temperature scaling: tau = %.3f for %d-way %d-shot %d-query tasks, "
                    "fitted on %s",
                    self.temperature_[shape],
                    *shape,
                    where or "base episodes of that shape",
                )
        return self.temperature_[shape]

    def _fitted_or_cached(
        self, shape: tuple[int, int, int], dtype: torch.dtype, device
    ) -> tuple[float | None, str | None, str]:
        """``τ`` (``None``: not applied), the episodes it was fitted on where they differ
        from the tasks' shape, and a note, for tasks of ``shape``."""
        way, shot, n_query = shape
        n_base = class_sizes(self.base_, "base").size
        fitted_on = base_episode_shape(self.base_, way, shot, n_query, self.balance, self.seed)
        n_open, open_note = self.n_open, ""
        if fitted_on is not None and fitted_on[0] == way:
            where = None if fitted_on == shape else f"{fitted_on} (way, shot, queries)"
            split = [base_episode_split(self.base_, self.seed)]  # half the classes each
            if n_open:  # the tasks' shape with their open queries, or closed episodes
                held = open_base_episode_shape(
                    split[0], fitted_on, n_open, self.balance, self.alpha, self.seed
                )
                n_open = n_open if held == (fitted_on, n_open) else 0
            parts = self._view_parts(split, fitted_on, dtype, device, n_open)
        else:
            n_open = 0
            fitted_on = self._way_shape(shape)
            views = self._way_views(way)
            if fitted_on is None or not views:
                return (
                    None,
                    None,
                    (
                        f"the {n_base} base classes cannot form "
                        f"episodes of the tasks' {way} ways on classes apart from those giving "
                        "the base statistics, and a temperature fitted on fewer ways does not "
                        "carry over: not applied (temperature 1)"
                    ),
                )
            where = (
                f"{fitted_on} (way, shot, queries) episodes of {len(views)} draws of the "
                "base classes"
            )
            parts = self._view_parts(views, fitted_on, dtype, device)
        if self.n_open and not n_open:
            open_note = (
                f"the base classes cannot hold {self.n_open} open queries beside these "
                "episodes: fitted on closed ones"
            )
        key = self._cache_key(fitted_on, n_open)
        stored = tuning_cache.load(key)
        if stored is not None and "temperature" in stored:
            log.debug("temperature scaling: tau read from the cache")
            note = "; ".join(n for n in (open_note, stored.get("note", "")) if n)
            return stored["temperature"], where, note
        probas, labels = [], []
        for model, episodes in parts:  # generators: nothing is fitted on a cache hit
            if n_open:  # the closed queries' known columns (as many in every episode)
                closed = ~episodes.open_mask
                known = _known_given_closed(model.predict_proba_open(episodes))
                shape = (episodes.n_tasks, -1, episodes.way)
                probas.append(known[closed].view(shape))
                labels.append(episodes.query_labels[closed].view(shape[:2]))
            else:
                probas.append(model.predict_proba(episodes))
                labels.append(episodes.query_labels)
        tau, note = fit_base_temperature(torch.cat(probas), torch.cat(labels))
        if tau is not None and n_base < MIN_CLASSES:
            tau, note = _few_classes_temperature(torch.cat(probas), torch.cat(labels), tau, n_base)
        tuning_cache.store(key, {"temperature": tau, "note": note})
        return tau, where, "; ".join(n for n in (open_note, note) if n)

    def _way_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """Episodes of the tasks' way with the shot and queries per class the smallest
        base class allows; ``None`` when a class holds a single row."""
        way, shot, n_query = shape
        smallest = int(class_sizes(self.base_, "base").min())
        if smallest < 2:
            return None
        s = min(shot, smallest - 1)
        per_class = min(max(1, n_query // way), smallest - s)
        return way, s, way * per_class

    def _way_views(self, way: int) -> list[FeatureSet]:
        """Draws of ``way`` base classes playing novel ones, two other base classes (else
        one) giving the statistics; those the estimator cannot fit on are left out."""
        for min_base in (2, 1):
            views = class_subset_views(self.base_, way, WAY_DRAWS, self.seed, min_base)
            try:
                if views:
                    copy.deepcopy(self.estimator).fit_featureset(views[0])
                    return views
            except ValueError as err:  # a method that needs more base classes
                log.debug("temperature scaling: %d base classes too few: %s", min_base, err)
        return []

    def _view_parts(self, views, shape, dtype, device, n_open: int = 0):
        """The estimator fitted on each view's base classes, with episodes of its novel
        ones (:attr:`n_episodes` shared out over the views; ``n_open`` open queries each)."""
        per_view = max(1, -(-self.n_episodes // len(views)))
        for view in views:
            episodes = sample_episodes(
                view,
                per_view,
                *shape,
                balance=self.balance,
                alpha=self.alpha,
                seed=self.seed,
                dtype=dtype,
                device=device,
                n_open=n_open,
            )
            yield copy.deepcopy(self.estimator).fit_featureset(view, dtype, device), episodes

    def _cache_key(self, shape: tuple[int, int, int], n_open: int = 0) -> dict:
        """What the temperature depends on: the base data, the estimator and its
        hyperparameters, the base episodes and the thresholds (not the dtype or device)."""
        from probfsl import __version__

        cls = type(self.estimator)
        open_queries = {"open_queries": n_open, "columns": "known given closed"} if n_open else {}
        return {
            "kind": "temperature",
            "data": tuning_cache.fingerprint(self.base_),
            "probfsl": __version__,
            "estimator": f"{cls.__module__}.{cls.__qualname__}",
            "params": self.estimator.get_params(),
            "shape": list(shape),
            "episodes": "target way",
            "balance": self.balance,
            "alpha": self.alpha if self.balance == "dirichlet" else None,
            "n_episodes": self.n_episodes,
            "seed": self.seed,
            "thresholds": [MIN_ERRORS, MIN_ERROR_RATE],
            **open_queries,
        }

    def prepare(self, episodes: Episodes) -> None:
        """The wrapped estimator's preparation and ``τ`` for the tasks' shape."""
        if getattr(self, "estimator_", None) is None:
            raise ValueError("base features missing: call fit_base(features, labels) first")
        self.estimator_.prepare(episodes)
        self._tau(episodes)

    def _tau(self, episodes: Episodes) -> float:
        """``τ`` for the tasks of ``episodes`` (their queries but :attr:`n_open` closed)."""
        if getattr(self, "estimator_", None) is None:
            raise ValueError("base features missing: call fit_base(features, labels) first")
        n_closed = episodes.n_query - self.n_open
        if n_closed < 1:
            raise ValueError(
                f"the tasks have {episodes.n_query} queries, not more than n_open={self.n_open}"
            )
        return self.fit_shape(
            episodes.way, episodes.shot, n_closed, episodes.support.dtype, episodes.support.device
        )

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        return apply_temperature(self.estimator_.predict_proba(episodes), self._tau(episodes))

    def has_open_posterior(self) -> bool:
        """Whether :meth:`predict_proba_open` answers: open-set tasks (``n_open``) and a
        wrapped estimator with an open-set posterior."""
        return bool(self.n_open) and has_open_posterior(self.estimator)

    def open_background_note(self) -> str | None:
        """The fitted wrapped estimator's note on P(open) (the temperature leaves P(open)
        as it is)."""
        fitted = getattr(self, "estimator_", None)
        return None if fitted is None else fitted.open_background_note()

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K+1]``: the wrapped estimator's open-set posterior with its known
        columns tempered given "known" (P(open) as it is; the module's doc). Needs
        ``n_open``, the open queries a task holds."""
        if not self.n_open:
            raise ValueError("TemperatureScaled(n_open=0) tempers closed tasks; set n_open")
        tau = self._tau(episodes)
        proba = self.estimator_.predict_proba_open(episodes)
        known = proba[..., :-1].sum(-1, keepdim=True)
        tempered = apply_temperature(_known_given_closed(proba), tau) * known
        return torch.cat([tempered, proba[..., -1:]], -1)


def _known_given_closed(proba: torch.Tensor) -> torch.Tensor:
    """The K known columns of an open-set posterior ``[..., K+1]`` given "known"."""
    known = proba[..., :-1]
    return known / known.sum(-1, keepdim=True).clamp_min(torch.finfo(proba.dtype).tiny)
