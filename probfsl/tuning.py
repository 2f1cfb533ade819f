"""Hyperparameters from the data: a search on episodes drawn from the base classes.

The published hyperparameters of few-shot methods were tuned on other backbones and
data sets. Here a candidate is judged on labelled episodes sampled from the *base*
classes with the target setting (way, shot, queries, balance): the base classes are
split in two seeded halves, one plays the base classes (statistics such as centring
means or within-class scatter), the other plays the novel classes (episodes). Novel
classes and their labels are never read. Because the engines are batched, a few
hundred episodes per candidate cost seconds.

The search is a coarse grid followed by one refinement around the best candidate
(geometric midpoints towards each neighbour of every numeric hyperparameter).
Candidates are ranked by base-episode accuracy, or by the per-task ELBO / log
evidence where the estimator offers ``episode_objective(episodes) -> [T]``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import Episodes, sample_episodes
from probfsl.evaluation.protocol import accuracy_ci
from probfsl.methods import make_estimator

CRITERIA = ("accuracy", "objective")

#: coarse search spaces per method (the refinement adds midpoints around the best)
SEARCH_SPACES: dict[str, dict[str, list]] = {
    "soft-kmeans": {"temperature": [1.0, 3.0, 10.0, 30.0, 100.0]},
    "bavardage": {
        "temperature_km": [10.0, 50.0],
        "temperature_vb": [4.0, 16.0, 50.0],
        "s_max": [1.0, 2.0, 5.0],
    },
    "em-dirichlet": {"lambda_coef": [0.0, 1.0, 4.0, 8.0], "temperature": [10.0, 30.0]},
    "gp-tree": {"outputscale": [1.0, 4.0, 8.0, 16.0], "lengthscale": [0.5, 1.0, 2.0]},
    "slem": {"rel_lam": [0.1, 1.0, 10.0, 100.0]},
}


def search_space(method: str) -> dict[str, list]:
    """The default coarse search space of ``method``; ``ValueError`` if it has none."""
    if method not in SEARCH_SPACES:
        raise ValueError(
            f"no search space for method {method!r}; tunable: {', '.join(SEARCH_SPACES)}"
        )
    return SEARCH_SPACES[method]


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


def base_episode_split(fs: FeatureSet, seed: int = 0) -> FeatureSet:
    """A view of ``fs`` in which half of the base classes act as novel classes.

    The other half stays base; every original novel row is marked ``"held_out"``
    (never sampled, never used for statistics).
    """
    base_classes = fs.classes_in("base")
    if base_classes.size < 4:
        raise ValueError(
            f"{fs.name}: tuning on base episodes needs at least 4 base classes, "
            f"got {base_classes.size}"
        )
    rng = np.random.default_rng([seed, 7919])
    pseudo_novel = rng.permutation(base_classes)[: base_classes.size // 2]
    split = np.where(fs.split == "base", "base", "held_out")
    split[np.isin(fs.labels, pseudo_novel) & (fs.split == "base")] = "novel"
    return FeatureSet(
        features=fs.features,
        labels=fs.labels,
        class_names=fs.class_names,
        split=split,
        class_features=fs.class_features,
        name=f"{fs.name}[base episodes]",
    )


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


def _score(
    method: str,
    params: dict,
    fs: FeatureSet,
    episodes: Episodes,
    criterion: str,
    fixed: Mapping,
) -> dict:
    tic = time.perf_counter()
    model = make_estimator(method, **fixed, **params).fit_featureset(fs)
    proba = model.predict_proba(episodes)
    hits = (proba.argmax(-1) == episodes.query_labels).double().mean(-1).numpy()
    accuracy, ci95 = accuracy_ci(hits)
    row = {"params": params, "accuracy": accuracy, "ci95": ci95}
    if hasattr(model, "episode_objective"):
        row["objective"] = float(torch.as_tensor(model.episode_objective(episodes)).mean())
    elif criterion == "objective":
        raise ValueError(f"method {method!r} has no episode objective; use criterion='accuracy'")
    row["seconds"] = time.perf_counter() - tic
    return row


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
    """
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    space = search_space(method) if space is None else space
    if not space:
        raise ValueError("the search space is empty")
    tic = time.perf_counter()
    view = base_episode_split(fs, seed)
    episodes = sample_episodes(view, n_episodes, way, shot, n_query, balance, alpha, seed)
    fixed = dict(fixed or {})
    trace = [_score(method, p, view, episodes, criterion, fixed) for p in _grid(space)]

    def best_of(rows):
        return max(rows, key=lambda r: r[criterion])["params"]

    if refine:
        seen = [r["params"] for r in trace]
        extra = [p for p in _refinements(space, best_of(trace)) if p not in seen]
        trace += [_score(method, p, view, episodes, criterion, fixed) for p in extra]
    return TuneResult(
        method=method,
        best={**fixed, **best_of(trace)},
        criterion=criterion,
        trace=trace,
        seconds=time.perf_counter() - tic,
    )
