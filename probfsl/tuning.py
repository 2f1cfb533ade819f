"""Hyperparameters from the data: a search on episodes drawn from the base classes.

The published hyperparameters of few-shot methods were tuned on other backbones and
data sets. Here a candidate is judged on labelled episodes sampled from the *base*
classes with the target setting (way, shot, queries, balance): the base classes are
split in two seeded halves (:mod:`probfsl.data.base_episodes`), one plays the base
classes (statistics such as centring means or within-class scatter), the other plays
the novel classes (episodes). Novel
classes and their labels are never read. Because the engines are batched, a few
hundred episodes per candidate cost seconds.

The search is a coarse grid followed by one refinement around the best candidate
(geometric midpoints towards each neighbour of every numeric hyperparameter).
Candidates are ranked by base-episode accuracy, or by the per-task ELBO / log
evidence where the estimator offers ``episode_objective_`` ([T], of its last
``predict_proba``). Estimators with ``with_params`` (BAVARDAGE) fit their base
statistics once for all candidates.

Zero-shot (:func:`tune_zero_shot`): candidates are judged on zero-shot tasks drawn from
the base classes only. :class:`AutoPreset` is ``preset="auto"`` as an estimator: it tunes
for each task shape it meets, on the base features given to ``fit_base``;
:func:`make_estimator` (``probfsl.make_estimator``, the public builder) builds it by name,
and every other preset with :func:`probfsl.methods.build_estimator`, the registry's builder
(the registry knows nothing of tuning).

The search runs on the device and in the dtype given (``device``, ``dtype``; for
:class:`AutoPreset`, those of the tasks it meets): candidates are fitted and scored there,
with one copy of each candidate's per-task accuracies to the host.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import numpy as np
import torch

from probfsl import methods, tuning_cache
from probfsl.data.base_episodes import (
    MIN_STATISTICS_CLASSES,
    base_as_novel,
    base_classes_only,
    base_episode_shape,
    base_episode_split,
    class_sizes,
    class_subset_views,
    hardest_episode_shape,
    open_base_episode_shape,
)
from probfsl.data.featureset import FeatureSet
from probfsl.data.simplex import zero_shot_probabilities
from probfsl.data.tasks import Episodes, sample_episodes, sample_zero_shot_tasks
from probfsl.evaluation.protocol import accuracy_ci
from probfsl.models.base import FewShotClassifier, shared_backgrounds
from probfsl.schema import (
    FEATURE_BOUND,
    Choice,
    EstimatorSchema,
    Flag,
    Group,
    Int,
    ListOf,
    Nested,
    Param,
    ParamDict,
    Real,
    Record,
    Tensor,
    Text,
)
from probfsl.temperature import MIN_CLASSES as MIN_TEMPERATURE_CLASSES
from probfsl.validation import as_device, check_base, check_count, check_float_dtype

log = logging.getLogger(__name__)

CRITERIA = ("accuracy", "objective")

#: the inductive baseline every tuned method is held against on base episodes
BASELINE = "nearest-centroid"

#: coarse search spaces per method (the refinement adds midpoints around the best)
SEARCH_SPACES: dict[str, dict[str, list]] = {
    "soft-kmeans": {"temperature": [1.0, 3.0, 10.0, 30.0, 100.0]},
    # in the units of scale="relative" (the published presets map to T_vb 0.07-0.08 and
    # s_max 0.65-1.9 there); the balanced model is a candidate on any tasks; T_km stays
    # at 10 (little effect in the paper's Fig. 5)
    "bavardage": {
        "whitening": ["global"],
        "scale": ["relative"],
        "temperature_vb": [0.03, 0.1, 0.3, 1.0, 3.0],
        "s_max": [0.25, 0.5, 1.0, 2.0, 4.0],
        "balanced": [False, True],
    },
    # on weak encoders the unbounded Dirichlet likelihood makes late EM iterations split
    # clusters (benchmarks/results/em_dirichlet.md), so the iteration count is searched
    "em-dirichlet": {
        "temperature": [10.0, 30.0],
        "n_iter": [2, 5, 20],
        "lambda_coef": [4.0, 8.0],
    },
    "gp-tree": {"outputscale": [4.0, 16.0, 64.0], "lengthscale": [0.5, 1.0, 2.0, 4.0]},
    "slem": {"rel_lam": [0.1, 1.0, 10.0, 100.0]},
    # the VMP sweeps start from soft k-means, whose temperature decides which cluster
    # each query starts in (on Omniglot's base episodes 1 beats the default 10 by 4
    # points at 1 shot; WordNet's prefer 10-30)
    "vmp-gmm": {"temperature": [1.0, 3.0, 10.0, 30.0, 100.0]},
    # nothing to search (the evidence sets lambda): the defaults are the one candidate,
    # held against nearest centroid like every choice
    "evidence-lssvm": {},
}
# bavardage-gamma's Gamma precisions have BAVARDAGE's T_vb as their prior mean, and it
# shares BAVARDAGE's preprocessing (at its constructor defaults, the published code's
# units, it lost to nearest centroid on WordNet's base episodes): the same grid
SEARCH_SPACES["bavardage-gamma"] = SEARCH_SPACES["bavardage"]


#: hyperparameters of the open-set posterior alone, tried at the best candidate of a
#: search on base episodes with open queries (:func:`tune` with ``open_queries``; a value
#: given in ``fixed`` is kept): the frame of the background contrast of the BAVARDAGE
#: mixtures (the base mean, their default, or the task's queries); and the VMP sweeps of
#: vmp-gmm's nested open model after its soft k-means start, where open queries the
#: contrast leaves "closed" pull the class factors a little more with every sweep.
#: BAVARDAGE's free components (``n_free``) are not tried: the mass they take of closed
#: queries enters P(open), whose calibration then fails (docs/methods/open-set.md)
OPEN_SEARCH_SPACES: dict[str, dict[str, list]] = {
    "soft-kmeans": {"open_frame": ["base", "queries"]},
    "bavardage": {"open_frame": ["base", "queries"]},
    "bavardage-gamma": {"open_frame": ["base", "queries"]},
    "vmp-gmm": {"max_iter": [1, 30], "open_frame": ["base", "queries"]},
}


#: base episodes per candidate of ``preset="auto"`` where 300 would cost minutes: each
#: GP-Tree candidate runs Gibbs chains at every node of every episode
SEARCH_EPISODES: dict[str, int] = {"gp-tree": 100}


#: the seed of the base episodes of ``probfsl run``'s search and temperature, whatever
#: the run's ``--seed`` (which draws the evaluation tasks): one search and one temperature
#: per data set and setting, shared by the runs of every seed
SEARCH_SEED = 0

#: a search's base episodes separate the candidates unless both the best candidate and
#: nearest centroid misclassify fewer than this many of their queries ...
SEPARATING_ERRORS = 5
#: ... or score at least this accuracy (%) on them
SATURATED_ACCURACY = 99.0
#: class draws of the harder episodes (:func:`probfsl.data.base_episodes.class_subset_views`)
HARDER_DRAWS = 10
#: the most ways of the harder episodes (or the tasks' way, if more): with 400 base classes
#: of 20 samples, 398-way episodes of 7,960 points asked for 7.6 GB Gram matrices
HARDER_MAX_WAY = 20
#: the share of the base episodes (at least :data:`SCREEN_MIN` episodes) on which the
#: coarse grid is first held against nearest centroid: a search whose every candidate
#: loses there by more than its 95% interval stops
SCREEN_SHARE = 0.1
SCREEN_MIN = 20


def search_episodes(method: str, n_episodes: int | None) -> int:
    """``n_episodes``, or the method's default for ``preset="auto"`` (300 unless
    :data:`SEARCH_EPISODES` says otherwise)."""
    return SEARCH_EPISODES.get(method, 300) if n_episodes is None else n_episodes


def search_space(method: str, fixed: Mapping | None = None) -> dict[str, list]:
    """The default coarse search space of ``method`` less the hyperparameters ``fixed``
    holds (those stay as the user gave them; ``{}`` where every one is fixed: the one
    candidate is then ``fixed`` itself); ``ValueError`` if the method has none."""
    if method not in SEARCH_SPACES:
        raise ValueError(
            f"no search space for method {method!r}; tunable: {', '.join(SEARCH_SPACES)}"
        )
    fixed = fixed or {}
    return {k: v for k, v in SEARCH_SPACES[method].items() if k not in fixed}


@dataclass
class TuneResult:
    """The chosen hyperparameters and the search trace."""

    method: str
    best: dict
    criterion: str
    trace: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def table_rows(self) -> list[dict]:
        return [
            {**row["params"], **{k: v for k, v in row.items() if k != "params"}}
            for row in self.trace
        ]


def _grid(space: Mapping[str, Sequence]) -> list[dict]:
    keys = list(space)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*space.values())]


def _refinements(space: Mapping[str, Sequence], best: dict) -> list[dict]:
    """Geometric (or arithmetic, around zero) midpoints between ``best`` and its grid neighbours."""
    out = []
    for key, values in space.items():
        values = sorted(values)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        i = values.index(best[key])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                a, b = best[key], values[j]
                mid = float(np.sqrt(a * b)) if a > 0 and b > 0 else (a + b) / 2
                if isinstance(a, int) and isinstance(b, int):
                    mid = round(mid)
                if mid not in (a, b):
                    out.append({**best, key: mid})
    return out


class _Candidates:
    """Fitted estimators of one method for each candidate, sharing base statistics when the
    estimator offers ``with_params`` (the base fit is then paid once)."""

    def __init__(
        self,
        method: str,
        fs: FeatureSet,
        fixed: Mapping,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.method, self.fs, self.fixed = method, fs, dict(fixed)
        self.dtype, self.device = dtype, device
        self.shared = None

    def fitted(self, params: dict):
        if self.shared is None:
            model = make_estimator(self.method, **{**self.fixed, **params})
            model = model.fit_featureset(self.fs, self.dtype, self.device)
            if hasattr(model, "with_params"):
                self.shared = model
            return model
        return self.shared.with_params(**params)


def _row(
    params: dict,
    proba: torch.Tensor,
    labels: torch.Tensor,
    open_mask: torch.Tensor | None = None,
) -> dict:
    """A trace row of ``proba`` [T, Q, K] against ``labels`` [T, Q]: accuracy and its 95%
    interval (percent), the mean query NLL (nats) and its interval, the misclassified
    queries (``errors``) and the ``queries`` scored.

    Open-set episodes (``open_mask`` [T, Q], True on the open queries, whose label is K;
    ``proba`` [T, Q, K + 1] from ``predict_proba_open``): accuracy and errors are those of
    the argmax over the K classes on the known-class queries, the NLL is that of the
    K + 1 outcomes on every query (a proper score of both the classes and P(open)), and
    the row adds the open queries' AUROC (``auroc``, ``auroc_ci95``, percent)."""
    labels = labels.to(proba.device)
    if open_mask is None:
        hits = proba.argmax(-1) == labels
        per_task = hits.double().mean(-1)
        closed = torch.ones_like(hits)
    else:
        from probfsl.evaluation.open_set import auroc

        open_mask = open_mask.to(proba.device)
        closed = ~open_mask
        hits = (proba[..., :-1].argmax(-1) == labels) & closed
        per_task = hits.double().sum(-1) / closed.double().sum(-1).clamp_min(1)
    accuracy, ci95 = accuracy_ci(per_task.cpu().numpy())
    p_true = proba.gather(-1, labels.unsqueeze(-1)).squeeze(-1).double()
    nll = -p_true.clamp_min(torch.finfo(proba.dtype).tiny).log().mean(-1).cpu().numpy()
    nll_ci = 1.96 * nll.std(ddof=1) / np.sqrt(nll.size) if nll.size > 1 else 0.0
    row = {
        "params": params,
        "accuracy": accuracy,
        "ci95": ci95,
        "nll": float(nll.mean()),
        "nll_ci95": float(nll_ci),
        "errors": int((closed & ~hits).sum()),
        "queries": int(closed.sum()),
    }
    if open_mask is not None:
        row["auroc"], row["auroc_ci95"] = accuracy_ci(
            auroc(proba[..., -1], open_mask).double().cpu().numpy()
        )
    return row


def _open_mask(episodes: Episodes) -> torch.Tensor | None:
    """The open queries of ``episodes`` [T, Q], or ``None`` for closed episodes (one
    look at the labels on the host, outside any iteration)."""
    mask = episodes.open_mask
    return mask if bool(mask.any()) else None


def _predict(model, episodes: Episodes) -> torch.Tensor:
    """``predict_proba_open`` on open-set episodes, else ``predict_proba``."""
    if _open_mask(episodes) is not None:
        return model.predict_proba_open(episodes)
    return model.predict_proba(episodes)


def _score(candidates: _Candidates, params: dict, episodes: Episodes, criterion: str) -> dict:
    tic = time.perf_counter()
    model = candidates.fitted(params)
    proba = _predict(model, episodes)
    mask = _open_mask(episodes)
    row = _row(params, proba, episodes.query_labels, mask)
    # predict_proba_open (open-set episodes) traces no closed-set objective
    if mask is None and hasattr(type(model), "episode_objective_"):
        row["objective"] = float(torch.as_tensor(model.episode_objective_).mean())
    elif criterion == "objective":
        raise ValueError(
            f"method {candidates.method!r} has no episode objective; use criterion='accuracy'"
        )
    row["seconds"] = time.perf_counter() - tic
    return row


def _check_data(
    fs: FeatureSet,
    n_episodes: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> torch.device:
    """``TypeError``/``ValueError`` naming the argument, before any sampling; the device."""
    if not isinstance(fs, FeatureSet):
        raise TypeError(f"fs must be a FeatureSet, got {type(fs).__name__}")
    check_count("n_episodes", n_episodes)
    check_count("seed", seed, low=0)
    check_float_dtype("dtype", dtype)
    return as_device(device)


def _checked(
    method: str, space: Mapping[str, Sequence] | None, criterion: str, fixed: Mapping | None
) -> Mapping[str, Sequence]:
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    if space is None:  # may be {}: the defaults (with ``fixed``) are the one candidate
        return search_space(method, fixed)
    if not isinstance(space, Mapping) or not space:
        raise ValueError(f"space must be a non-empty mapping of name -> values, got {space!r}")
    for name, values in space.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"space[{name!r}] must be a non-empty list of values, got {values!r}")
    both = sorted(set(space) & set(fixed or {}))
    if both:
        raise ValueError(f"{', '.join(both)}: both fixed and in the search space; give one")
    return space


def _best_row(rows: Sequence[dict], criterion: str = "accuracy") -> dict:
    """The best row: the highest ``criterion``; with ``"accuracy"``, equal accuracies
    go to the lower query NLL (a proper score that still orders them). Rows of open-set
    episodes rank the same way, by the accuracy of their known-class queries (their
    AUROC is reported, not ranked on: breaking accuracy ties within the 95% interval by
    it chose candidates that lost up to 2 points of accuracy on novel tasks)."""
    if criterion != "accuracy":
        return max(rows, key=lambda r: r[criterion])
    return max(rows, key=lambda r: (r["accuracy"], -r.get("nll", 0.0)))


def _frame_row(rows: Sequence[dict], top: dict, defaults: Mapping | None = None) -> dict:
    """The row of the open contrast's frame (``open_frame``) at ``top``'s other
    hyperparameters: of the rows as accurate as ``top`` within its 95% interval whose
    hyperparameters differ from ``top``'s in the frame alone (a value a row does not name
    being its ``defaults`` one), the one of the highest open-query AUROC.

    The frame moves the open score far more than the known classes' accuracy: the
    queries' mean stands for the population of the task's classes only where many of its
    queries are open. Beside 75 closed queries, the queries' frame raised the AUROC by 1.5
    to 3 points with 75 open queries and lowered it by 5 to 9 with 8 (soft-kmeans, 1 shot,
    three data sets; docs/methods/open-set.md), the closed accuracies within their
    intervals."""
    defaults = dict(defaults or {})

    def others(row: dict) -> dict:
        return {k: v for k, v in {**defaults, **row["params"]}.items() if k != "open_frame"}

    alike = [
        r
        for r in rows
        if others(r) == others(top) and r["accuracy"] >= top["accuracy"] - top["ci95"]
    ]
    return max(alike, key=lambda r: r["auroc"], default=top)


def _nll_best_row(rows: Sequence[dict]) -> dict:
    """The lowest query NLL among the rows whose accuracy lies within the 95% interval of
    the most accurate one (the ranking on :func:`_harder_pool`'s episodes)."""
    top = _best_row(rows)
    tied = [r for r in rows if r["accuracy"] >= top["accuracy"] - top["ci95"]]
    return min(tied, key=lambda r: r["nll"])


def _prefer(a: dict, b: dict) -> bool:
    """Whether row ``a`` beats row ``b``: more accurate by more than ``a``'s 95% interval,
    or not less accurate by more than ``b``'s and of lower query NLL."""
    if a["accuracy"] - a["ci95"] > b["accuracy"]:
        return True
    if b["accuracy"] - b["ci95"] > a["accuracy"]:
        return False
    return a["nll"] < b["nll"]


def _separates(*rows: dict) -> bool:
    """Whether episodes on which these rows were scored can rank candidates by accuracy:
    not every row near-perfect (:data:`SEPARATING_ERRORS`, :data:`SATURATED_ACCURACY`)."""
    return any(
        r.get("errors", SEPARATING_ERRORS) >= SEPARATING_ERRORS
        and r["accuracy"] < SATURATED_ACCURACY
        for r in rows
    )


def _search(
    method: str,
    space: Mapping[str, Sequence] | None,
    criterion: str,
    refine: bool,
    fixed: Mapping | None,
    score,
    progress: bool = False,
    best=None,
) -> TuneResult:
    """Coarse grid, then one refinement around the best; ``score(params) -> row``.

    ``space`` comes checked (:func:`_checked`); ``progress`` shows the candidates done
    (:func:`probfsl.progress.progress`); ``best(rows) -> row`` ranks (default
    :func:`_best_row` on ``criterion``)."""
    from probfsl.progress import progress as progress_display

    tic = time.perf_counter()
    grid = _grid(space)
    bar = progress_display(len(grid), f"tuning {method}", "candidates", progress)

    def scored(params):
        row = score(params)
        bar.update()
        return row

    with bar:
        trace = [scored(p) for p in grid]

        def best_of(rows):
            return (best or (lambda r: _best_row(r, criterion)))(rows)["params"]

        if refine:
            seen = [r["params"] for r in trace]
            todo = [p for p in _refinements(space, best_of(trace)) if p not in seen]
            bar.total += len(todo)
            if hasattr(bar, "refresh"):  # tqdm: redraw with the new total
                bar.refresh()
            trace += [scored(p) for p in todo]
    return TuneResult(
        method=method,
        best={**(fixed or {}), **best_of(trace)},
        criterion=criterion,
        trace=trace,
        seconds=time.perf_counter() - tic,
    )


def tune(
    method: str,
    fs: FeatureSet,
    space: Mapping[str, Sequence] | None = None,
    way: int = 5,
    shot: int = 1,
    n_query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    n_episodes: int = 300,
    seed: int = 0,
    criterion: str = "accuracy",
    refine: bool = True,
    fixed: Mapping | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    progress: bool = False,
    open_queries: int = 0,
) -> TuneResult:
    """Choose ``method``'s hyperparameters from ``space`` on base-class episodes.

    Args:
        method: a registered method name.
        fs: the data; only its base classes are read.
        space: hyperparameter name -> candidate values (the coarse grid); default
            :data:`SEARCH_SPACES` of the method.
        way, shot, n_query, balance, alpha: the target task setting.
        n_episodes: base episodes per candidate (the same episodes for every candidate).
        seed: seeds the base-class halves and the episodes.
        criterion: ``"accuracy"`` or ``"objective"`` (the estimator's ELBO/evidence).
        refine: add one refinement round around the best coarse candidate.
        fixed: hyperparameters passed unchanged to every candidate.
        dtype, device: where the candidates are fitted and run (default float32 on the
            CPU).
        progress: show a progress bar over the candidates.
        open_queries: open queries per episode, drawn from other base classes of the
            half that plays the novel classes (the open-set protocol,
            :mod:`probfsl.data.open_set`): candidates are then scored by
            ``predict_proba_open``, on the accuracy of the known-class queries
            (:func:`_row`; the open queries' AUROC is in the trace), and the values of
            :data:`OPEN_SEARCH_SPACES` are tried at the best one (``open_frame`` taken
            by :func:`_frame_row`).
    """
    space = _checked(method, space, criterion, fixed)  # before any sampling
    device = _check_data(fs, n_episodes, seed, dtype, device)
    check_count("open_queries", open_queries, low=0)
    if open_queries and criterion != "accuracy":
        raise ValueError("open_queries > 0 ranks candidates by accuracy; use criterion='accuracy'")
    view = base_episode_split(fs, seed)
    episodes = sample_episodes(
        view, n_episodes, way, shot, n_query, balance, alpha, seed, dtype=dtype, device=device,
        n_open=open_queries,
    )  # fmt: skip
    candidates = _Candidates(method, view, fixed or {}, dtype, device)

    def score(params: dict) -> dict:
        return _score(candidates, params, episodes, criterion)

    with shared_backgrounds():  # every candidate's background from the same base classes
        result = _search(method, space, criterion, refine, fixed, score, progress)
        extra = open_search_space(method, fixed) if open_queries else {}
        if extra:  # the open-set hyperparameters, at the search's best
            best = _best_row(result.trace, criterion)["params"]
            seen = [r["params"] for r in result.trace]
            todo = [{**best, **params} for params in _grid(extra)]
            result.trace += [score(params) for params in todo if params not in seen]
            chosen = _best_row(result.trace, criterion)
            if "open_frame" in extra:
                defaults = {**make_estimator(method).get_params(), **(fixed or {})}
                chosen = _frame_row(result.trace, chosen, defaults)
            result.best = {**(fixed or {}), **chosen["params"]}
    return result


def open_search_space(method: str, fixed: Mapping | None = None) -> dict[str, list]:
    """The values of :data:`OPEN_SEARCH_SPACES` tried at the best candidate of an
    open-set search, less the hyperparameters ``fixed`` holds (those stay as given)."""
    fixed = fixed or {}
    return {k: v for k, v in OPEN_SEARCH_SPACES.get(method, {}).items() if k not in fixed}


def tune_zero_shot(
    method: str,
    fs: FeatureSet,
    space: Mapping[str, Sequence] | None = None,
    min_classes: int = 3,
    max_classes: int = 10,
    n_query: int = 75,
    n_tasks: int = 300,
    seed: int = 0,
    refine: bool = True,
    fixed: Mapping | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> TuneResult:
    """Choose a zero-shot method's hyperparameters on zero-shot tasks of the base classes.

    The tasks follow the target protocol (``min_classes``..``max_classes`` classes, Q
    queries, probabilities over every class embedding) but draw their classes and
    queries from the base classes only
    (:func:`probfsl.data.base_episodes.base_classes_only`); ranked by accuracy after
    cluster-to-class matching. ``temperature`` (of the probabilities) may be tuned.
    The probabilities are computed in ``dtype`` and the candidates run on ``device``.
    """
    space = _checked(method, space, "accuracy", fixed)
    device = _check_data(fs, n_tasks, seed, dtype, device)
    view = base_classes_only(fs)
    max_classes = min(max_classes, view.classes_in("base").size)
    tasks = sample_zero_shot_tasks(
        view, n_tasks, min(min_classes, max_classes), max_classes, n_query, seed
    )
    fixed = dict(fixed or {})
    labels = tasks.query_labels.to(device)

    def score(params: dict) -> dict:
        tic = time.perf_counter()
        model = make_estimator(method, **{**fixed, **params})
        if not hasattr(model, "predict_zero_shot"):
            raise ValueError(f"method {method!r} has no zero-shot mode")
        probs = zero_shot_probabilities(view, tasks, model.temperature, dtype).to(device)
        hits = (model.predict_zero_shot(probs) == labels).double().mean(-1)
        accuracy, ci95 = accuracy_ci(hits.cpu().numpy())
        return {
            "params": params,
            "accuracy": accuracy,
            "ci95": ci95,
            "seconds": time.perf_counter() - tic,
        }

    return _search(method, space, "accuracy", refine, fixed, score, progress)


#: what ``preset="auto"`` uses when the base classes cannot form base episodes:
#: BAVARDAGE's published presets in scale-relative units (they mean the same on any
#: data), by task balance; every other method keeps its defaults
FALLBACK_PRESETS: dict[str, dict[str, str]] = {
    "bavardage": {"balanced": "mini-balanced-relative", "dirichlet": "mini-unbalanced-relative"},
}


@dataclass
class AutoChoice:
    """What ``preset="auto"`` chose: a search result, or a documented fallback.

    Attributes:
        params: the hyperparameters to run with.
        preset: a named preset to apply under ``params`` (fallback only), else ``None``.
        result: the search (``None`` when the fallback was used).
        note: one line saying what was used when it differs from the plain search on
            the target task shape ("" otherwise).
        reason: why no search ran (fallback only).
        method: the method that runs: the one tuned, or :data:`BASELINE` when the tuned
            method scored below it on the same base episodes.
        baseline_accuracy: :data:`BASELINE`'s accuracy on those base episodes (``None``
            when no search ran).
    """

    params: dict
    preset: str | None = None
    result: TuneResult | None = None
    note: str = ""
    reason: str = ""
    method: str | None = None
    baseline_accuracy: float | None = None

    def method_run(self, requested: str) -> str:
        """The method that runs when ``requested`` was asked for: ``requested``, or
        :data:`BASELINE` where the choice fell back to it."""
        return self.method or requested

    def describe(self) -> str:
        """One line for result files: how the hyperparameters were chosen."""
        if self.result is None:
            return self.note
        return self.note or "tuned on base episodes of the target task shape"

    def to_json(self) -> dict:
        """A JSON-able copy (for the cache, :mod:`probfsl.tuning_cache`)."""
        out = {k: getattr(self, k) for k in ("params", "preset", "note", "reason", "method")}
        out["baseline_accuracy"] = self.baseline_accuracy
        out["result"] = None if self.result is None else asdict(self.result)
        return out

    @classmethod
    def from_json(cls, data: dict) -> AutoChoice:
        result = data.pop("result")
        return cls(**data, result=None if result is None else TuneResult(**result))


def _cached(kind: str, fs: FeatureSet, settings: dict, compute) -> AutoChoice:
    """``compute()``, or its stored outcome for the same data and ``settings``."""
    key = {
        "kind": kind,
        "data": tuning_cache.fingerprint(fs),
        "probfsl": _version(),
        **settings,
    }
    stored = tuning_cache.load(key)
    if stored is not None:
        try:
            choice = AutoChoice.from_json(stored)
        except (TypeError, ValueError):
            choice = None
        if choice is not None:
            log.debug("preset auto: %s read from the cache", settings.get("method"))
            return choice
    choice = compute()
    tuning_cache.store(key, choice.to_json())
    return choice


def _version() -> str:
    from probfsl import __version__

    return __version__


@dataclass
class _Pool:
    """Labelled base episodes to score on: one or more (view, episodes) pairs of the same
    task ``shape`` (each view with its own base classes), and how to name them."""

    parts: list[tuple[FeatureSet, Episodes]]
    shape: tuple[int, int, int]
    where: str

    @property
    def labels(self) -> torch.Tensor:
        return torch.cat([episodes.query_labels for _, episodes in self.parts])

    @property
    def open_mask(self) -> torch.Tensor | None:
        """The open queries of every episode, or ``None`` for closed episodes."""
        masks = [_open_mask(episodes) for _, episodes in self.parts]
        return None if masks[0] is None else torch.cat(masks)


def _pool_row(
    method: str, preset: str | None, params: dict, pool: _Pool, dtype, device, candidates=None
) -> dict:
    """:func:`_row` of ``method`` (fitted on each view's base classes, or taken from
    ``candidates``, one :class:`_Candidates` per view) on every episode of ``pool``."""
    probas = []
    for i, (view, episodes) in enumerate(pool.parts):
        if candidates is not None:
            model = candidates[i].fitted(params)
        else:
            model = make_estimator(method, preset, **params)
            model = model.fit_featureset(view, dtype, device)
        probas.append(_predict(model, episodes))
    return _row(params, torch.cat(probas), pool.labels, pool.open_mask)


def _accuracy(
    method: str, preset: str | None, params: dict, view: FeatureSet, episodes, dtype, device
) -> float:
    """Accuracy (%) on ``episodes`` of ``method`` fitted on the base classes of ``view``."""
    pool = _Pool([(view, episodes)], (episodes.way, episodes.shot, episodes.n_query), "")
    return _pool_row(method, preset, params, pool, dtype, device)["accuracy"]


def _view_episodes(
    views, n_episodes, shape, balance, alpha, seed, dtype, device
) -> list[tuple[FeatureSet, Episodes]]:
    """About ``n_episodes`` episodes of ``shape`` shared out over ``views`` (class draws
    of :func:`class_subset_views`), each with its view; a view that cannot form them is
    left out."""
    per_view = max(1, -(-n_episodes // max(len(views), 1)))
    parts = []
    for view in views:
        try:
            episodes = sample_episodes(
                view, per_view, *shape, balance, alpha, seed, dtype=dtype, device=device
            )
        except ValueError:
            continue
        parts.append((view, episodes))
    return parts


def _harder_pool(fs, way, shot, balance, alpha, seed, n_episodes, dtype, device) -> _Pool | None:
    """Episodes as hard as the base classes allow: as many ways as leave two base classes
    for the statistics (at most :data:`HARDER_MAX_WAY` or ``way``), the most queries the
    smallest class allows, over :data:`HARDER_DRAWS` draws of classes
    (:func:`class_subset_views`); ``None`` when they cannot be formed."""
    shape = hardest_episode_shape(fs, shot, max_way=max(HARDER_MAX_WAY, way))
    if shape is None:
        return None
    views = class_subset_views(fs, shape[0], HARDER_DRAWS, seed)
    parts = _view_episodes(views, n_episodes, shape, balance, alpha, seed, dtype, device)
    if not parts:
        return None
    w, s, q = shape
    n_base = int(fs.classes_in("base").size)
    draws = f"{len(parts)} draws of the {n_base} base classes"
    return _Pool(parts, shape, f"{w}-way {s}-shot {q}-query episodes of {draws}")


def _screen(method, preset, fixed, view, episodes, n_episodes, dtype, device) -> dict | None:
    """Nearest centroid's row, and the best coarse candidate's, on the first base
    episodes when every coarse candidate (and ``preset``, where given) scores below
    nearest centroid there by more than its 95% interval; else ``None``."""
    n_first = min(n_episodes, max(SCREEN_MIN, round(SCREEN_SHARE * n_episodes)))
    if n_first >= n_episodes:
        return None
    first = episodes[:n_first]
    w, s, q = first.way, first.shot, first.n_query
    pool = _Pool([(view, first)], (w, s, q), f"the first {n_first} {w}-way {s}-shot base episodes")
    baseline = _pool_row(BASELINE, None, {}, pool, dtype, device)
    candidates = [_Candidates(method, view, fixed, dtype, device)]
    rows = [
        _pool_row(method, None, {**fixed, **params}, pool, dtype, device, candidates)
        for params in _grid(search_space(method, fixed))
    ]
    if preset is not None:
        rows.append(_pool_row(method, preset, dict(fixed), pool, dtype, device))
    if all(r["accuracy"] + r["ci95"] < baseline["accuracy"] for r in rows):
        return {"baseline": baseline, "best": _best_row(rows), "where": pool.where}
    return None


def auto_preset(
    method: str,
    fs: FeatureSet,
    way: int = 5,
    shot: int = 1,
    n_query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    n_episodes: int | None = None,
    seed: int = 0,
    criterion: str = "accuracy",
    fixed: Mapping | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    progress: bool = False,
    cache: bool = True,
    open_queries: int = 0,
) -> AutoChoice:
    """``preset="auto"``: :func:`tune` on base episodes, with a documented fallback.

    1. When the base classes can form episodes of the target shape, the search runs on
       them (``note`` is empty).
    2. When they cannot (say 5 base classes for 5-way tasks: 2 play the novel classes),
       the search runs on the largest smaller shape
       (:func:`probfsl.data.base_episodes.base_episode_shape`) and ``note`` names it.
    3. When not even 2-way 1-shot base episodes fit (fewer than 4 base classes, none at
       all, or one-sample classes), no search runs: :data:`FALLBACK_PRESETS` (BAVARDAGE:
       the scale-relative mini-ImageNet preset for the balance) or the method's
       defaults, named in ``note``.

    On smaller episodes the search may not tell candidates apart (2-way tasks are easy)
    while its choice transfers badly to the target shape, so in case 2 the reference of
    case 3 (:data:`FALLBACK_PRESETS` or the defaults) is scored on the same base
    episodes and kept unless the best candidate beats it by more than the candidate's
    95% interval (accuracy).

    In cases 1 and 2 the inductive :data:`BASELINE` (nearest centroid) is scored on the
    same base episodes too. A method whose best candidate scores below it there does not
    suit these features at this setting (for example GP-Tree's node classifiers with one
    shot, or EM-Dirichlet on embeddings that are not class probabilities): the choice is
    then to run the baseline (``method``), and ``note`` says so with both accuracies.

    Where the base episodes cannot separate the candidates (neither the best candidate nor
    nearest centroid misclassifies :data:`SEPARATING_ERRORS` queries, or both score
    :data:`SATURATED_ACCURACY`), the search runs again on the hardest episodes the base
    classes allow, up to :data:`HARDER_MAX_WAY` ways (:func:`_harder_pool`), and ranks by
    query NLL among the candidates within the most accurate one's 95% interval; the
    reference and nearest centroid are then held to the same rule (:func:`_prefer`).
    Wherever the episodes searched have fewer ways than the target, the choice of any method
    is held against nearest centroid at the target way (:func:`_full_way_comparison`). With
    fewer base classes than a temperature needs (:data:`probfsl.temperature.MIN_CLASSES`)
    the probabilities are used as they come, so there too a choice not clearly more accurate
    than nearest centroid must have the lower query NLL (:func:`_prefer`). A search whose
    every coarse candidate scores below nearest centroid on its first episodes
    (:data:`SCREEN_SHARE`) stops there and runs nearest centroid (``result`` ``None``).

    ``fixed`` hyperparameters are kept in every case. Novel classes are never read.
    The search and the reference run in ``dtype`` on ``device``; ``progress`` shows a
    bar over the candidates. With ``cache`` the outcome is stored on disk and read back
    for the same data and settings, whatever the dtype and device
    (:mod:`probfsl.tuning_cache`).

    ``open_queries`` > 0 (an open-set run): the base episodes of the search (and of the
    screen, the reference and nearest centroid held against it) get that many open
    queries from other base classes of the half that plays the novel classes, and the
    candidates are scored by ``predict_proba_open`` on the accuracy of the known-class
    queries (:func:`tune`); the chosen one's ``open_scale``, where the method has one, is
    learnt on the same episodes, and its ``open_shift`` where they clearly ask for one
    (:func:`learn_open_calibration`). Where the base classes cannot
    hold the open queries, the episodes have fewer known classes or fewer queries
    (:func:`probfsl.data.base_episodes.open_base_episode_shape`), and where not even
    those fit the search runs on closed episodes; ``note`` says which.
    """
    _checked(method, None, criterion, fixed)  # ValueError for a method without a search space
    n_episodes = search_episodes(method, n_episodes)
    device = _check_data(fs, n_episodes, seed, dtype, device)
    check_count("open_queries", open_queries, low=0)
    if open_queries and criterion != "accuracy":
        raise ValueError("open_queries > 0 ranks candidates by accuracy; use criterion='accuracy'")
    fixed = dict(fixed or {})

    def compute() -> AutoChoice:
        with shared_backgrounds():  # one background per base-class view and preprocessing
            return _auto_preset(
                method,
                fs,
                (way, shot, n_query),
                balance,
                alpha,
                n_episodes,
                seed,
                criterion,
                fixed,
                dtype,
                device,
                progress,
                open_queries,
            )

    if not cache:
        return compute()
    settings = {
        "method": method,
        "space": search_space(method, fixed),
        "baseline": BASELINE,
        "shape": [way, shot, n_query],
        "balance": balance,
        "alpha": alpha if balance == "dirichlet" else None,  # balanced episodes ignore it
        "n_episodes": n_episodes,
        "seed": seed,
        "criterion": criterion,
        "fixed": fixed,
    }
    if open_queries:  # closed searches keep their cache entries
        settings["open_queries"] = open_queries
        open_space = open_search_space(method, fixed)
        settings["open_space"] = open_space
        # the constructor defaults the candidates take (those of the open-set posterior
        # have changed within a version: a choice made under others is not reused)
        defaults = make_estimator(method).get_params()
        settings["defaults"] = {k: v for k, v in defaults.items() if k not in fixed}
        # learn_open_calibration on the chosen candidate: the held-out bias taken out, or
        # a shift of its own where the episodes clearly ask for one
        # (on the exact log-odds of P(open) as inferred, read last in both frames)
        settings["open_scale"] = "brier on log-odds, held-out bias"
        settings["open_shift"] = f"brier, where it lowers it by {SHIFT_GAIN}"
        settings["open_rank"] = "accuracy"  # of the known-class queries alone
        if "open_frame" in open_space:  # the frame: AUROC within the accuracy interval
            settings["open_frame_rank"] = "auroc within the accuracy interval"
        # the frames of the open contrast that open_scale may be learnt with: searched, or
        # the given one, or the method's own
        frame = fixed.get("open_frame", defaults.get("open_frame"))
        frames = open_space.get("open_frame", [frame])
        settings["open_frame"] = frames[0] if len(frames) == 1 else frames
        if "queries" in frames:  # whose background's mean is the task's own
            settings["open_background_mean"] = "inferred, read last"
        # where the base classes cannot hold the open queries asked, the episodes they can
        # (choices made on closed episodes before this rule are not reused)
        shape = base_episode_shape(fs, way, shot, n_query, balance, seed)
        if shape is not None:
            view = base_episode_split(fs, seed)
            found = open_base_episode_shape(view, shape, open_queries, balance, alpha, seed)
            if found != (shape, open_queries):
                settings["open_episodes"] = None if found is None else [*found[0], found[1]]
    return _cached("few-shot", fs, settings, compute)


def _auto_preset(
    method,
    fs,
    target,
    balance,
    alpha,
    n_episodes,
    seed,
    criterion,
    fixed,
    dtype,
    device,
    progress,
    open_queries=0,
) -> AutoChoice:
    """:func:`auto_preset` without the cache."""
    way, shot, n_query = target
    n_base = int(fs.classes_in("base").size)
    shape = base_episode_shape(fs, way, shot, n_query, balance, seed)
    preset = FALLBACK_PRESETS.get(method, {}).get(balance)
    used = f"preset {preset!r}" if preset else "the method's defaults"
    if shape is None:
        if n_base < 4:
            why = f"{n_base} base classes, tuning needs 4 (half of them play novel classes)"
        else:
            why = "the base classes hold a single sample each"
        return AutoChoice(
            params=fixed,
            preset=preset,
            note=f"no base episodes possible: {why}; using {used}",
            reason=f"no base episodes possible: {why}",
        )
    w, s, q = shape
    notes = []
    if shape != target:
        notes.append(
            f"tuned on {w}-way {s}-shot {q}-query base episodes (the {n_base} base classes "
            f"cannot form {way}-way {shot}-shot {n_query}-query ones)"
        )
    view = base_episode_split(fs, seed)
    n_open = open_queries
    if n_open:
        found = open_base_episode_shape(view, shape, n_open, balance, alpha, seed)
        if found is None:
            notes.append(
                f"the {n_base} base classes cannot hold open queries beside {w}-way base "
                "episodes (half of them play the known and open classes): tuned on closed "
                "episodes"
            )
            n_open = 0
        elif found != (shape, n_open):
            (w, s, q), n_open = found
            notes.append(
                f"the {n_base} base classes cannot hold {open_queries} open queries beside "
                f"{shape[0]}-way {shape[2]}-query base episodes (half of them play the known "
                f"and open classes): tuned on {w}-way {s}-shot {q}-query ones"
            )
            shape = found[0]
    episodes = sample_episodes(  # tune's
        view, n_episodes, *shape, balance, alpha, seed, dtype=dtype, device=device,
        n_open=n_open,
    )  # fmt: skip
    if n_open:
        frame = (
            "; open_frame by the open queries' AUROC within that accuracy's 95% interval"
            if "open_frame" in open_search_space(method, fixed)
            else ""
        )
        notes.append(
            f"tuned on base episodes with {n_open} open queries from other base classes "
            f"(ranked by the accuracy of the known-class queries{frame})"
        )
    reference = preset if shape != target else None
    screened = _screen(method, reference, fixed, view, episodes, n_episodes, dtype, device)
    if screened is not None:  # every candidate clearly below the baseline: stop here
        best, base = screened["best"], screened["baseline"]
        notes.append(
            f"every candidate of {method} scored below {BASELINE} on {screened['where']} "
            f"(best {best['accuracy']:.1f}% against {base['accuracy']:.1f}%): search stopped, "
            f"running {BASELINE}"
        )
        return AutoChoice(
            params={},
            note="; ".join(notes),
            method=BASELINE,
            baseline_accuracy=base["accuracy"],
        )
    result = tune(
        method,
        fs,
        None,
        *shape,
        balance,
        alpha,
        n_episodes,
        seed,
        criterion,
        True,
        fixed,
        dtype=dtype,
        device=device,
        progress=progress,
        open_queries=n_open,
    )
    with_open = f" with {n_open} open queries" if n_open else ""
    pool = _Pool([(view, episodes)], shape, f"{w}-way {s}-shot base episodes{with_open}")
    baseline = _pool_row(BASELINE, None, {}, pool, dtype, device)
    best = _best_row(result.trace, criterion)
    ranked_by_nll = False
    if criterion == "accuracy" and not _separates(best, baseline):
        harder = _harder_pool(fs, way, shot, balance, alpha, seed, n_episodes, dtype, device)
        if harder is not None:
            candidates = [_Candidates(method, v, fixed, dtype, device) for v, _ in harder.parts]
            result = _search(
                method,
                search_space(method, fixed),
                "accuracy",
                True,
                fixed,
                lambda params: _pool_row(
                    method, None, {**fixed, **params}, harder, dtype, device, candidates
                ),
                progress,
                best=_nll_best_row,
            )
            result.criterion = "nll among the most accurate"
            notes.append(
                f"the {w}-way {s}-shot {q}-query base episodes could not separate the "
                f"candidates ({best['errors']} of {best['queries']} queries misclassified "
                f"by the best, {baseline['errors']} by {BASELINE}): searched on "
                f"{harder.where}, ranked by query NLL among the candidates within the most "
                "accurate one's 95% interval"
            )
            pool, best, ranked_by_nll = harder, _nll_best_row(result.trace), True
            baseline = _pool_row(BASELINE, None, {}, pool, dtype, device)
    choice = AutoChoice(params=result.best, result=result, baseline_accuracy=baseline["accuracy"])
    chosen = best
    saturated = not _separates(best, baseline)
    if shape != target or ranked_by_nll:
        ref = _pool_row(method, preset, dict(fixed), pool, dtype, device)
        if saturated:  # no errors to rank by: only a clearly more accurate candidate counts
            keep = best["accuracy"] - best["ci95"] <= ref["accuracy"]
            why = f"these too hold too few errors to rank candidates; none beat {used}"
        elif ranked_by_nll:
            keep = not _prefer(best, ref)
            why = f"no candidate beat {used} there ({ref['accuracy']:.1f}%, NLL {ref['nll']:.3f})"
        else:
            keep = best["accuracy"] - best["ci95"] <= ref["accuracy"]
            why = (
                f"no candidate beat {used} there ({ref['accuracy']:.1f}%) by more than its 95% "
                "interval"
            )
        if keep:
            notes.append(f"{why}: using {used}")
            choice.params, choice.preset, chosen = fixed, preset, ref
    below = None
    if pool.shape[0] < way:  # a choice made on fewer ways: checked at the target way
        ps = pool.shape[1]
        q_full = way * max(1, round(pool.shape[2] / pool.shape[0]))
        full = _full_way_comparison(
            method, choice, fs, (way, ps, q_full), balance, alpha, seed, dtype, device
        )
        if full is None and _base_statistics(choice.method_run(method)):
            below = (
                f"{method} could not be checked at {way} ways on base classes it was not "
                f"fitted on ({n_base} base classes: with {way} playing novel ones, fewer "
                f"than the {MIN_STATISTICS_CLASSES} it needs are left for its statistics), "
                f"and on its own base classes its projection looks better than it is: "
                f"running {BASELINE} (--preset defaults runs {method} anyway)"
            )
        elif full is not None and full[0] < full[1]:
            below = (
                f"{method} scored {full[0]:.1f}% on {full[2]}, below {BASELINE} "
                f"({full[1]:.1f}%): running {BASELINE}"
            )
    # where no temperature will be fitted (too few base classes), the probabilities are
    # used as the method gives them: a method that is not clearly more accurate than
    # nearest centroid must then also have the lower query NLL
    uncalibrated = n_base < MIN_TEMPERATURE_CLASSES
    if below is None and (ranked_by_nll or uncalibrated) and _prefer(baseline, chosen):
        below = (
            f"{method} scored {chosen['accuracy']:.1f}% (NLL {chosen['nll']:.3f}) on "
            f"{pool.where}, not above {BASELINE} ({baseline['accuracy']:.1f}%, NLL "
            f"{baseline['nll']:.3f}) by its 95% interval and of higher NLL: running {BASELINE}"
        )
    elif below is None and chosen["accuracy"] < baseline["accuracy"]:
        below = (
            f"{method} scored {chosen['accuracy']:.1f}% on {pool.where}, below {BASELINE} "
            f"({baseline['accuracy']:.1f}%): running {BASELINE}"
        )
    if below is not None:
        notes.append(below)
        choice.params, choice.preset, choice.method = {}, None, BASELINE
    if n_open and choice.method is None and "open_scale" not in fixed:
        if {"open_scale", "open_shift"} <= make_estimator(method).get_params().keys():
            # the log-odds of P(open) as inferred, whose scale the open/closed labels then
            # choose, with the held-out base classes' bias taken out (or with the
            # open_shift given)
            model = make_estimator(method, choice.preset, **choice.params)
            model.fit_featureset(view, dtype, device)
            log_odds = model.inferred_open_log_odds(episodes)
            held_scale, held_shift = model.held_out_calibration()
            learnt, note = learn_open_calibration(
                log_odds, episodes.open_mask, held_shift / held_scale, fixed.get("open_shift")
            )
            choice.params = {**choice.params, **learnt}
            notes.append(note)
    choice.note = "; ".join(notes)
    return choice


#: the least relative fall of the base episodes' Brier score for which the search learns
#: P(open)'s shift beside its scale (:func:`learn_open_calibration`)
SHIFT_GAIN = 0.10


def learn_open_calibration(
    log_odds: torch.Tensor, is_open: torch.Tensor, bias: float, shift: float | None = None
) -> tuple[dict[str, float], str]:
    """The calibration of a transductive method's P(open) that base-class episodes with
    open queries ask for (``log_odds`` of P(open) as inferred and ``is_open``, [T, Q];
    :meth:`~probfsl.models.base.OpenSetBackground.inferred_open_log_odds`):
    ``({"open_scale": a}, note)`` or ``({"open_scale": a, "open_shift": b}, note)``.

    a is :func:`fit_open_scale` with the held-out base classes' ``bias`` (β = b_h / a_h)
    taken out, the estimator then shifting the log-odds by a β of its own base classes;
    ``shift`` given (the user's ``open_shift``), with that shift. Where no shift is given,
    Platt's two parameters (1999) are fitted too, the (a, b) of least Brier score
    (:func:`fit_open_scale_and_shift`), and kept where they lower the episodes' Brier
    score by more than :data:`SHIFT_GAIN` of the first's: a bias of the transductive
    posterior itself, which the contrast's held-out bias does not hold (on synthetic
    2,048-d features, heavy-tailed and of unequal class spreads, soft-kmeans' novel
    ECE-open fell from 0.193 to 0.101, its base episodes' Brier score by 31%). A smaller
    gain is within what the base episodes' own bias gives, their background fitted on half
    the base classes: on WordNet's (21 base classes) the fitted shift lowered it by 3.5%
    and 7.7% at 1 and 5 shots and raised the novel ECE-open from 0.113 to 0.134 and 0.150;
    on Omniglot's by under 1%."""
    scale = fit_open_scale(log_odds, is_open, bias, shift)
    params = {"open_scale": scale}
    note = (
        f"open_scale {scale:.3g}: the scale of P(open)'s log-odds that those episodes' "
        "open/closed labels prefer (Brier score)"
    )
    if shift is not None:
        return params, note
    held = open_brier(log_odds, is_open, scale, scale * bias)
    a, b, fitted = fit_open_scale_and_shift(log_odds, is_open)
    if fitted < (1 - SHIFT_GAIN) * held:
        params = {"open_scale": a, "open_shift": b}
        note = (
            f"open_scale {a:.3g}, open_shift {b:.3g}: the scale and shift of P(open)'s "
            f"log-odds that those episodes' open/closed labels prefer (Brier score {fitted:.3f}, "
            f"{held:.3f} with the held-out base classes' shift)"
        )
    return params, note


def _flat(log_odds: torch.Tensor, is_open: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_odds`` and ``is_open`` (both [T, Q]) flat in float64; ``ValueError`` for shapes
    that differ or log-odds that are NaN."""
    if log_odds.shape != is_open.shape:
        raise ValueError(f"log_odds {tuple(log_odds.shape)} and is_open {tuple(is_open.shape)}")
    if bool(log_odds.isnan().any()):
        raise ValueError("log_odds hold NaN")
    return log_odds.double().flatten(), is_open.flatten().to(torch.float64)


def open_brier(log_odds: torch.Tensor, is_open: torch.Tensor, scale: float, shift: float) -> float:
    """The Brier score of σ(``scale`` ``log_odds`` + ``shift``) against ``is_open``."""
    logit, target = _flat(log_odds, is_open)
    return float((torch.sigmoid(scale * logit + shift) - target).square().mean())


def fit_open_scale_and_shift(
    log_odds: torch.Tensor, is_open: torch.Tensor
) -> tuple[float, float, float]:
    """(a, b, Brier score): the a of :data:`probfsl.inference.open_temperature.GRID` and the
    b of [-:data:`~probfsl.inference.open_temperature.MAX_SHIFT`, MAX_SHIFT] in steps of
    0.1 whose σ(a ``log_odds`` + b) has the least Brier score against ``is_open`` (both
    [T, Q]; ``log_odds`` those of P(open) as inferred): Platt scaling (1999) by a proper
    score bounded per query."""
    from probfsl.inference.open_temperature import GRID, MAX_SHIFT

    logit, target = _flat(log_odds, is_open)
    steps = round(2 * MAX_SHIFT / 0.1)
    shifts = torch.linspace(
        -MAX_SHIFT, MAX_SHIFT, steps + 1, dtype=logit.dtype, device=logit.device
    ).unsqueeze(1)
    # one scale at a time ([shifts, queries] at once), read back once: [scales, shifts]
    brier = torch.stack(
        [(torch.sigmoid(a * logit + shifts) - target).square().mean(1) for a in GRID]
    )
    best = int(brier.argmin())
    i, k = divmod(best, shifts.shape[0])
    return GRID[i], round(float(shifts[k]), 10), float(brier[i, k])


def fit_open_scale(
    log_odds: torch.Tensor, is_open: torch.Tensor, bias: float = 0.0, shift: float | None = None
) -> float:
    """The a of :data:`probfsl.inference.open_temperature.GRID` minimising the Brier score
    of σ(a (``log_odds`` + ``bias``)) against ``is_open`` (both [T, Q]; ``log_odds`` those
    of P(open) as inferred), or of σ(a ``log_odds`` + ``shift``) where ``shift`` is given:
    the temperature (Guo et al.,
    ICML 2017) of a transductive method's P(open), ``open_scale``
    (:meth:`probfsl.models.base.OpenSetBackground.open_calibration`, whose ``bias`` is
    the held-out base classes' b_h / a_h), learnt on base-class episodes with open
    queries. The order of the queries (the AUROC) is unchanged.

    The Brier score (mean squared error of the probability) is a proper score bounded by
    1 per query; the log loss is not, and the few open queries a mixture holds for closed
    with log-odds of tens dominate it (on the built-in base-class episodes it chose
    a = 0.01-0.06, P(open) near 1/2 for every query, at three of four settings)."""
    from probfsl.inference.open_temperature import GRID

    logit, target = _flat(log_odds, is_open)
    scales = torch.tensor(GRID, dtype=logit.dtype, device=logit.device).unsqueeze(1)
    if shift is None:
        logits = scales * (logit + bias)
    else:
        logits = scales * logit + shift
    brier = (torch.sigmoid(logits) - target).square().mean(1)
    return float(GRID[int(brier.argmin())])


def _way_dependent(method: str) -> bool:
    info = methods.METHODS.get(method)
    return bool(info and info.way_dependent)


def _base_statistics(method: str) -> bool:
    info = methods.METHODS.get(method)
    return bool(info and info.base_statistics)


def _full_way_comparison(
    method, choice, fs, shape, balance, alpha, seed, dtype, device, n_episodes=100
) -> tuple[float, float, str] | None:
    """Accuracy (%) of ``choice`` and of :data:`BASELINE` on episodes of the target way
    drawn from the base classes, and where; ``None`` when they cannot form one on base
    classes the method was not fitted on (or, for a method that only centres on them,
    at all).

    When the base classes are too few for base episodes of the target way (half of them
    play the novel classes), the search runs on fewer ways, where any method can look
    better than it is: 2-way tasks are easy, and a method whose behaviour depends on the
    way (GP-Tree's class tree is a single node at 2 ways,
    :attr:`probfsl.methods.MethodInfo.way_dependent`) even more so. Here draws of the
    target way's number of base classes play the novel classes and the other base
    classes the base classes (:func:`probfsl.data.base_episodes.class_subset_views`):
    at least two of them, else one. One class is a poor base for the statistics a
    method learns (BAVARDAGE's whitening and projection, SLEM's negatives), so that
    check is pessimistic for the method, which is the safe side for a guard: the
    classes it is scored on are never those it was fitted on. Only where not even one
    base class is left does every base class play both
    (:func:`probfsl.data.base_episodes.base_as_novel`: it suits methods that only centre
    on the base classes and handicaps SLEM's negatives). It is never used for a method
    that learns more than a centre from the base classes
    (:attr:`probfsl.methods.MethodInfo.base_statistics`: BAVARDAGE's projection would
    look better than it is on the classes it was learnt from)."""
    way, s, _ = shape
    n_base = int(fs.classes_in("base").size)
    attempts = [
        (class_subset_views(fs, way, HARDER_DRAWS, seed, min_base), left)
        for min_base, left in ((2, "the others"), (1, "the other one"))
    ]
    if not _base_statistics(choice.method_run(method)):
        attempts.append(([base_as_novel(fs)], None))
    for views, left in attempts:
        if not views:
            continue
        if left is None:
            where = f"{way}-way {s}-shot episodes of all {n_base} base classes"
        else:
            where = (
                f"{way}-way {s}-shot episodes of {len(views)} draws of the {n_base} base "
                f"classes ({left} left for the base statistics)"
            )
        parts = _view_episodes(views, n_episodes, shape, balance, alpha, seed, dtype, device)
        if not parts:
            continue
        pool = _Pool(parts, shape, where)
        try:
            ran = _pool_row(
                choice.method_run(method), choice.preset, choice.params, pool, dtype, device
            )
        except ValueError as err:  # the method cannot fit on one base class
            log.debug("target-way check on %s skipped: %s", where, err)
            continue
        baseline = _pool_row(BASELINE, None, {}, pool, dtype, device)["accuracy"]
        return ran["accuracy"], baseline, where
    return None


def auto_preset_zero_shot(
    method: str,
    fs: FeatureSet,
    min_classes: int = 3,
    max_classes: int = 10,
    n_query: int = 75,
    n_tasks: int = 300,
    seed: int = 0,
    fixed: Mapping | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    progress: bool = False,
    cache: bool = True,
) -> AutoChoice:
    """Zero-shot ``preset="auto"``: :func:`tune_zero_shot` on tasks of the base classes,
    with fewer classes or queries per task when the base classes are too few or too
    small, and the method's defaults when fewer than 2 base classes exist. ``progress``
    and ``cache`` as in :func:`auto_preset`."""
    search_space(method)
    device = _check_data(fs, n_tasks, seed, dtype, device)
    fixed = dict(fixed or {})

    def compute() -> AutoChoice:
        sizes = class_sizes(fs, "base")
        hi = min(max_classes, sizes.size)
        lo = min(min_classes, hi)
        if lo < 2:
            reason = f"no zero-shot base tasks possible: {sizes.size} base classes, tuning needs 2"
            return AutoChoice(params=fixed, note=f"{reason}; using the defaults", reason=reason)
        q = min(n_query, int(np.sort(sizes)[:lo].sum()))
        result = tune_zero_shot(
            method,
            fs,
            None,
            lo,
            hi,
            q,
            n_tasks,
            seed,
            True,
            fixed,
            dtype=dtype,
            device=device,
            progress=progress,
        )
        note = ""
        if (lo, hi, q) != (min_classes, max_classes, n_query):
            note = (
                f"tuned on zero-shot base tasks of {lo}-{hi} classes and {q} queries "
                f"({sizes.size} base classes)"
            )
        return AutoChoice(params=result.best, result=result, note=note)

    if not cache:
        return compute()
    settings = {
        "method": method,
        "space": search_space(method, fixed),
        "classes": [min_classes, max_classes],
        "n_query": n_query,
        "n_tasks": n_tasks,
        "seed": seed,
        "fixed": fixed,
    }
    return _cached("zero-shot", fs, settings, compute)


class _MethodName(Param):
    """The name of a registered method (:data:`probfsl.methods.METHODS`, read when
    checked, so that methods registered later count)."""

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a method name (a string), got {type(value).__name__}")
        methods.method_info(value)  # ValueError listing the methods

    def describe(self) -> str:
        return "the name of a registered method"


@dataclass
class FittedEstimator:
    """An estimator :class:`AutoPreset` fitted with one of its choices, in one dtype."""

    #: ``"float32"`` or ``"float64"``: the dtype of the tasks it was fitted for
    dtype: str
    estimator: FewShotClassifier


@dataclass
class ResolvedChoice:
    """What :class:`AutoPreset` chose for one task shape, as it saves it: the shape, the
    :class:`AutoChoice` (without its search table) and the estimators fitted with it.

    ``method`` is :attr:`AutoChoice.method` (``None``: the tuned method ran), ``searched``
    whether a search ran (``False``: the documented fallback of :func:`auto_preset`).
    ``n_open`` > 0: a choice for open-set tasks (:meth:`AutoPreset.predict_proba_open`),
    searched on base episodes with ``n_query`` closed and ``n_open`` open queries."""

    way: int
    shot: int
    n_query: int
    params: dict
    preset: str | None
    note: str
    reason: str
    method: str | None
    baseline_accuracy: float | None
    searched: bool
    fitted: list[FittedEstimator] = field(default_factory=list)
    n_open: int = 0

    def shape(self) -> tuple[int, ...]:
        """The key of the choice in :class:`AutoPreset`: the task shape ``(way, shot,
        n_query)``, or ``(way, shot, n_query, n_open)`` for open-set tasks."""
        closed = (self.way, self.shot, self.n_query)
        return (*closed, self.n_open) if self.n_open else closed

    def choice(self) -> AutoChoice:
        """The :class:`AutoChoice` (its ``result``, the search table, is not saved)."""
        return AutoChoice(
            params=dict(self.params),
            preset=self.preset,
            note=self.note,
            reason=self.reason,
            method=self.method,
            baseline_accuracy=self.baseline_accuracy,
        )


def _plain(value: Any) -> Any:
    """NumPy scalars as Python numbers (what a saved file holds)."""
    return value.item() if isinstance(value, np.generic) else value


_FLOAT_NAMES = {torch.float32: "float32", torch.float64: "float64"}


class AutoPreset(FewShotClassifier):
    """``preset="auto"``: ``method`` with hyperparameters tuned on base-class episodes.

    At the first task batch of each shape (way, shot, queries) it runs :func:`auto_preset`
    on the base features given to :meth:`fit_base` (or ``fit``) with that shape and
    ``balance`` (a search on base episodes, or its documented fallback when the base
    classes are too few; nearest centroid where the method scores below it there), keeps
    the choice in ``choices_`` and the search in ``tuning_`` (``None`` for a fallback),
    logs what it chose (``logging``, logger ``probfsl.tuning``), and predicts with the
    chosen estimator; ``methods_run_`` (task shape to method) and ``method_run_`` say
    which method ran. The search and the chosen estimator run in the dtype and on the
    device of the tasks (the estimator is refitted for a new dtype or device; the choice
    is kept). :meth:`predict_proba_open` makes a choice of its own for open-set tasks,
    searched on base episodes with open queries (its key ``(way, shot, closed queries,
    open queries)``). Novel classes and query labels are never read. Built by name with
    :func:`make_estimator` (``preset="auto"``).

    **Saving.** ``save(path)`` writes the hyperparameters, the base features and labels,
    and for every task shape met so far the choice (method, preset, hyperparameters,
    note, the base-episode accuracy of nearest centroid) with the estimators fitted with
    it (one per dtype); the search tables (``tuning_``) are not saved. ``AutoPreset.load``
    (or ``FewShotClassifier.load``) gives an AutoPreset that predicts tasks of those
    shapes with the saved estimators, identically and without a search (on another device
    or dtype the estimator is refitted from the saved base features with the same
    choice). A task of a shape it has no choice for is tuned for as before, on the saved
    base features, with a ``UserWarning`` naming the shape and the saved ones, so that a
    loaded estimator never re-tunes silently.
    """

    needs_base = True
    schema = EstimatorSchema(
        params={
            "method": _MethodName(),
            "balance": Choice(("balanced", "dirichlet")),
            "alpha": Real(positive=True),
            "n_episodes": Int(low=1, optional=True),
            "seed": Int(),
            "criterion": Choice(CRITERIA),
            "fixed": ParamDict(),
        },
        fitted=(
            Group(
                "fit_base",
                {
                    "base_features_": Tensor("N", "D", bound=FEATURE_BOUND),
                    "base_labels_": Tensor("N", kind="int"),
                    "resolved_": ListOf(
                        Record(
                            ResolvedChoice,
                            {
                                "way": Int(low=1),
                                "shot": Int(low=1),
                                "n_query": Int(low=1),
                                "params": ParamDict(),
                                "preset": Text(optional=True),
                                "note": Text(),
                                "reason": Text(),
                                "method": Text(optional=True),
                                "baseline_accuracy": Real(optional=True),
                                "searched": Flag(),
                                "n_open": Int(low=0),
                                "fitted": ListOf(
                                    Record(
                                        FittedEstimator,
                                        {
                                            "dtype": Choice(tuple(_FLOAT_NAMES.values())),
                                            "estimator": Nested(),
                                        },
                                    )
                                ),
                            },
                        )
                    ),
                },
                dtype=torch.float64,
            ),
        ),
    )

    def __init__(
        self,
        method: str,
        balance: str = "dirichlet",
        alpha: float = 2.0,
        n_episodes: int | None = None,
        seed: int = 0,
        criterion: str = "accuracy",
        fixed: Mapping | None = None,
    ) -> None:
        self.method = method
        self.balance = balance
        self.alpha = alpha
        self.n_episodes = n_episodes
        self.seed = seed
        self.criterion = criterion
        self.fixed = dict(fixed or {})

    @property
    def transductive(self) -> bool:
        return methods.method_info(self.method).load().transductive

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        features, labels = check_base(features, labels)
        self.base_ = FeatureSet.of_base_classes(features.double(), labels)
        self.tuning_, self.choices_, self.estimators_ = {}, {}, {}
        self.methods_run_ = {}
        self._loaded_shapes: tuple[tuple[int, int, int], ...] | None = None
        self._searched: dict[tuple[int, int, int], bool] = {}
        return self

    @property
    def method_run_(self) -> str | None:
        """The method that ran on the tasks met so far: :attr:`method`, or
        :data:`BASELINE` where the choice fell back to it (``"A, B"`` when task shapes
        differed in it; ``None`` before any task)."""
        ran = list(dict.fromkeys(getattr(self, "methods_run_", {}).values()))
        return ", ".join(ran) if ran else None

    def prepare(self, episodes: Episodes) -> None:
        """The choice for the tasks' shape (the search, or the cache) and the chosen
        estimator fitted in their dtype and on their device."""
        self._estimator_for(episodes)

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        return self._estimator_for(episodes).predict_proba(episodes)

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K + 1]``: the open-set posterior of the estimator chosen for open-set
        tasks of this shape, P(none of these classes) in the last column
        (:meth:`~probfsl.models.base.FewShotClassifier.predict_proba_open`).

        Its search is that of ``probfsl run --open-queries`` (:func:`auto_preset` with
        ``open_queries``), on base episodes whose queries are open in the proportion the
        method expects a priori, ``open_prior`` (its default, or the value in ``fixed``):
        of a task's Q queries, ``n_open`` = round(``open_prior`` Q) are drawn from other
        base classes (:meth:`open_split`). Its choice is kept under the key ``(way, shot,
        Q - n_open, n_open)``; the queries' labels are not read."""
        return self._estimator_for(episodes, open_set=True).predict_proba_open(episodes)

    def open_background_note(self) -> str | None:
        """The note of :meth:`~probfsl.models.base.FewShotClassifier.open_background_note`
        of the estimators chosen for open-set tasks so far (``None`` when they have
        none)."""
        notes = [
            estimator.open_background_note()
            for (shape, _, _), estimator in self.estimators_.items()
            if len(shape) == 4  # (way, shot, closed queries, open queries)
        ]
        return "; ".join(dict.fromkeys(n for n in notes if n)) or None

    def open_split(self, way: int, n_query: int) -> tuple[int, int]:
        """``(closed, open)`` queries of the base episodes that choose for open-set tasks
        of ``n_query`` queries: ``open`` = round(``open_prior`` n_query), kept between 1
        and ``n_query`` - ``way`` (one closed query per class at least); balanced episodes
        (``balance="balanced"``) have the nearest multiple of ``way`` closed queries."""
        if n_query <= way:
            raise ValueError(
                f"AutoPreset.predict_proba_open tunes on base episodes with open queries "
                f"beside at least one closed query per class: {n_query} queries for "
                f"{way} classes are too few"
            )
        prior = self.fixed.get("open_prior")
        if prior is None:
            prior = methods.build_estimator(self.method).get_params().get("open_prior", 0.5)
        closed = n_query - min(max(round(prior * n_query), 1), n_query - way)
        if self.balance == "balanced":  # the nearest multiple of way that leaves one open
            closed = way * max(1, min(round(closed / way), (n_query - 1) // way))
        return closed, n_query - closed

    def _estimator_for(self, episodes: Episodes, open_set: bool = False) -> FewShotClassifier:
        if getattr(self, "base_", None) is None:
            raise ValueError("base features missing: call fit_base(features, labels) first")
        shape = (episodes.way, episodes.shot, episodes.n_query)
        n_open = 0
        if open_set:
            closed, n_open = self.open_split(episodes.way, episodes.n_query)
            shape = (episodes.way, episodes.shot, closed, n_open)
        dtype, device = episodes.support.dtype, episodes.support.device
        if shape not in self.choices_:
            saved = getattr(self, "_loaded_shapes", None)
            if saved is not None:
                warnings.warn(
                    f"AutoPreset({self.method!r}) was loaded with choices for task shapes "
                    f"{list(saved)} (way, shot, queries[, open queries]); a {shape[0]}-way "
                    f"{shape[1]}-shot task of {episodes.n_query} queries"
                    f"{' (open set)' if open_set else ''} is new, so the search runs on the "
                    "saved base features",
                    UserWarning,
                    stacklevel=3,
                )
            self.choices_[shape] = choice = auto_preset(
                self.method,
                self.base_,
                *shape[:3],
                balance=self.balance,
                alpha=self.alpha,
                n_episodes=self.n_episodes,
                seed=self.seed,
                criterion=self.criterion,
                fixed=self.fixed,
                dtype=dtype,
                device=device,
                open_queries=n_open,
            )
            self.tuning_[shape] = choice.result
            self.methods_run_[shape] = choice.method_run(self.method)
            log.info(
                "preset auto, %s %d-way %d-shot%s: %s %s%s",
                self.method,
                shape[0],
                shape[1],
                f", {n_open} open queries" if n_open else "",
                choice.method or self.method,
                choice.params,
                f" ({choice.note})" if choice.note else "",
            )
        key = (shape, dtype, device)
        if key not in self.estimators_:
            choice = self.choices_[shape]
            name = choice.method or self.method
            estimator = methods.build_estimator(name, choice.preset, **choice.params)
            self.estimators_[key] = estimator.fit_featureset(self.base_, dtype, device)
        return self.estimators_[key]

    def fitted_state(self) -> dict[str, Any]:
        """What :meth:`save` writes (see the class docstring): ``base_features_``
        [N, D] (float64), ``base_labels_`` [N] and ``resolved_``, a
        :class:`ResolvedChoice` per task shape met; empty before :meth:`fit_base`."""
        base = getattr(self, "base_", None)
        if base is None:
            return {}
        resolved = []
        for shape, choice in self.choices_.items():
            fitted, dtypes = [], set()
            for (key_shape, dtype, _), estimator in self.estimators_.items():
                if key_shape == shape and dtype in _FLOAT_NAMES and dtype not in dtypes:
                    dtypes.add(dtype)
                    fitted.append(FittedEstimator(_FLOAT_NAMES[dtype], estimator))
            resolved.append(
                ResolvedChoice(
                    *shape[:3],
                    params={k: _plain(v) for k, v in choice.params.items()},
                    preset=choice.preset,
                    note=choice.note,
                    reason=choice.reason,
                    method=choice.method,
                    baseline_accuracy=_plain(choice.baseline_accuracy),
                    searched=self._searched.get(shape, choice.result is not None),
                    fitted=fitted,
                    n_open=shape[3] if len(shape) > 3 else 0,
                )
            )
        return {
            "base_features_": torch.as_tensor(base.features, dtype=torch.float64),
            "base_labels_": torch.as_tensor(base.labels, dtype=torch.int64),
            "resolved_": resolved,
        }

    def restore_fitted_state(self, state: dict[str, Any]) -> None:
        """The inverse of :meth:`fitted_state` (used by :meth:`load`): the base features,
        the choices and their fitted estimators (on the CPU); later task shapes are
        tuned for with a warning (class docstring)."""
        if not state:
            return
        self.fit_base(state["base_features_"], state["base_labels_"])
        for entry in state["resolved_"]:
            shape = entry.shape()
            choice = entry.choice()
            self.choices_[shape] = choice
            self.tuning_[shape] = None
            self._searched[shape] = entry.searched
            self.methods_run_[shape] = choice.method_run(self.method)
            for fitted in entry.fitted:
                dtype = getattr(torch, fitted.dtype)
                self.estimators_[(shape, dtype, torch.device("cpu"))] = fitted.estimator
        self._loaded_shapes = tuple(self.choices_)


def make_estimator(name: str, preset: str | None = None, **params) -> FewShotClassifier:
    """A new estimator of the registered method ``name`` (:data:`probfsl.methods.METHODS`,
    ``probfsl run --method``) with hyperparameters ``params``, checked at once.

    ``preset`` sets the hyperparameters that ``params`` do not give:

    * ``None`` (the default) or ``"defaults"``: the estimator's constructor defaults;
    * the name of a published setting, for methods that have them (``probfsl run
      --help`` lists them, e.g. BAVARDAGE's ``"mini-balanced"``);
    * ``"auto"``: an :class:`AutoPreset`, which tunes the method on episodes of the base
      classes given to ``fit``/``fit_base``/``fit_featureset``, for each task shape it
      meets (``params`` stay fixed during the search). ``probfsl run`` does this by
      default wherever the data have base classes; in Python it is asked for.

    ``ValueError`` for an unknown method, preset or hyperparameter, or ``"auto"`` for a
    method without a search space (:data:`SEARCH_SPACES`). Every estimator it returns can
    be saved and loaded (``save(path)``, ``load(path)``), ``"auto"`` included.

    This is ``probfsl.make_estimator``; :func:`probfsl.methods.build_estimator` is the
    registry's builder, without ``"auto"``.
    """
    if preset != "auto":
        return methods.build_estimator(name, preset, **params)
    methods.build_estimator(name, **params)  # unknown method or hyperparameters
    search_space(name)
    return AutoPreset(name, fixed=params).check_params()
