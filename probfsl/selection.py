"""Backbone selection from feature files by Bayesian evidence (``probfsl select``).

Of several backbones that embed the same labelled samples, which one gives the best
few-shot classifier? Two evidence criteria, after Kim, Jang, Han & Choi (CVPR 2016):

* ``"episodes"`` (default): the few-shot question. Episodes of the requested way, shot
  and queries are drawn from the base classes (the same rows for every backbone); the
  one-vs-rest Bayesian linear regression of the paper (eq. 3-5) is fitted on each
  episode's support, with ``lambda`` and the noise precisions shared by the episodes
  and set by their evidence (eq. 17, Algorithm 2), and each backbone is scored by the
  mean conditional evidence of the query labels given the support,
  ``log p(y_query | y_support, X)`` (:func:`probfsl.models.evidence.episode_evidence`).
* ``"all-rows"``: the paper's §3.4, the summed log evidence of one many-class problem
  over all labelled rows (:func:`probfsl.models.evidence.rank_backbones`). It answers
  "which features fit a linear probe of every class best", which need not be the
  backbone that is best with five examples per class: on Omniglot it put
  EfficientNet-Lite0 ahead of Lite1, which has the better 5-shot nearest-centroid
  accuracy (``benchmarks/results/select.md``).

This module reads the files, checks that they hold the same samples, draws the episodes
and ranks the files. The command line prints the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet
from probfsl.data.loaders import load_features
from probfsl.data.tasks import sample_task_indices
from probfsl.models.evidence import (
    BackboneScore,
    EpisodeScore,
    rank_backbones,
    rank_backbones_on_episodes,
)
from probfsl.validation import as_device, check_choice, check_count, check_float_dtype

__all__ = ["CRITERIA", "FileRanking", "rank_feature_files"]

#: selection criteria of :func:`rank_feature_files` (the first is the default)
CRITERIA = ("episodes", "all-rows")


@dataclass
class FileRanking:
    """Feature files ranked by evidence, best first, and the samples they were judged on.

    ``ranking`` holds :class:`~probfsl.models.evidence.EpisodeScore` (criterion
    ``"episodes"``) or :class:`~probfsl.models.evidence.BackboneScore` (``"all-rows"``)
    entries. ``n_samples``, ``n_classes``: the labelled rows and classes used (those the
    episodes are drawn from). ``source``: which classes those are, in words; ``note``: a
    remark for the user (e.g. no base classes in the files), or None. ``way``, ``shot``,
    ``n_query``, ``n_episodes``, ``seed``: the episodes (None for ``"all-rows"``).
    """

    ranking: list[EpisodeScore] | list[BackboneScore]
    n_samples: int
    n_classes: int
    criterion: str = "all-rows"
    source: str = "labelled classes"
    note: str | None = None
    way: int | None = None
    shot: int | None = None
    n_query: int | None = None
    n_episodes: int | None = None
    seed: int | None = None

    @property
    def best(self) -> str:
        """The path of the best file."""
        return self.ranking[0].name


def _check_episode_options(way: int, shot: int, n_query: int, episodes: int, seed: int) -> None:
    check_count("way", way, low=2)
    check_count("shot", shot)
    check_count("n_query", n_query)
    check_count("episodes", episodes)
    check_count("seed", seed, low=0)
    if n_query % way:
        raise ValueError(
            f"select: the {n_query} queries of an episode must be divisible by the way "
            f"({way}): each class gets n_query / way queries"
        )


def _check_episodes_fit(labels: np.ndarray, source: str, way: int, shot: int, n_query: int):
    classes, sizes = np.unique(labels, return_counts=True)
    if classes.size < way:
        raise ValueError(
            f"select: {way}-way episodes need {way} classes but there are {classes.size} "
            f"{source}: use a smaller --way"
        )
    need = shot + n_query // way
    if sizes.min() < need:
        raise ValueError(
            f"select: {way}-way {shot}-shot episodes with {n_query // way} queries per class "
            f"need {need} samples per class, but the smallest of the {classes.size} {source} "
            f"has {sizes.min()}: use a smaller --shot or --query"
        )


def rank_feature_files(
    paths: Sequence[str | Path],
    split: str | None = None,
    allow_pickle: bool = False,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device | None = None,
    criterion: str = "episodes",
    way: int = 5,
    shot: int = 5,
    n_query: int = 75,
    episodes: int = 500,
    seed: int = 0,
    center: bool = True,
    progress: bool = False,
) -> FileRanking:
    """Rank feature files of the same samples by Bayesian evidence, best first
    (``progress``: show the backbones scored).

    The files must hold the same rows with the same labels (``ValueError`` otherwise,
    before any computation). The evidence is computed in ``dtype`` on ``device``
    (default float64 on the CPU: it sums a log term per sample, which float32 rounds
    visibly).

    ``criterion="episodes"`` (default): ``episodes`` balanced ``way``-way ``shot``-shot
    episodes with ``n_query`` queries in all (``n_query / way`` per class) are drawn,
    with ``seed``, from the labelled rows of ``split`` when given, else from the base
    classes (``split == "base"``), else, when the files have no base rows, from all
    labelled rows (said in ``note``); the same episodes serve every file. Each file is
    scored by the mean conditional evidence of the query labels given the support
    (:func:`probfsl.models.evidence.episode_evidence`; with ``center`` the features are
    centred on the mean of those rows first). Options that the rows cannot form (more
    classes than there are, fewer samples per class than ``shot + n_query / way``) are
    a ``ValueError`` before any computation.

    ``criterion="all-rows"``: the summed log evidence of the one-vs-rest regressions on
    all labelled rows (of ``split`` when given) as one problem (Kim et al., CVPR 2016,
    §3.4; :func:`probfsl.models.evidence.rank_backbones`); the episode options are
    unused.
    """
    check_float_dtype("dtype", dtype)
    check_choice("criterion", criterion, CRITERIA)
    if criterion == "episodes":
        _check_episode_options(way, shot, n_query, episodes, seed)
    device = as_device(device)
    if len(paths) < 1:
        raise ValueError("select needs at least one feature file")
    sets = [load_features(p, allow_pickle=allow_pickle) for p in paths]
    first = sets[0]
    for p, fs in zip(paths, sets, strict=True):
        if fs.features.shape[0] != first.features.shape[0]:
            raise ValueError(
                f"feature files have different row counts: {paths[0]} has "
                f"{first.features.shape[0]}, {p} has {fs.features.shape[0]}"
            )
        if not np.array_equal(fs.labels, first.labels):
            raise ValueError(f"{p} and {paths[0]} have different labels: not the same samples")
    rows = first.labels >= 0
    note = None
    if split is not None:
        rows &= first.split == split
        source = f"classes of split {split!r}"
    elif criterion == "episodes" and (rows & (first.split == "base")).any():
        rows &= first.split == "base"
        source = "base classes"
    else:
        source = "labelled classes"
        if criterion == "episodes":
            note = (
                f"{paths[0]} has no base classes: the episodes are drawn from all "
                f"{len(np.unique(first.labels[rows]))} labelled classes"
            )
    labels = first.labels[rows]
    if labels.size == 0:
        raise ValueError(
            f"{paths[0]}: no labelled rows" + (f" in split {split!r}" if split else "")
        )
    n_classes = len(np.unique(labels))
    if criterion == "all-rows":
        features = {
            str(p): torch.as_tensor(fs.features[rows], dtype=dtype, device=device)
            for p, fs in zip(paths, sets, strict=True)
        }
        ranking = rank_backbones(features, torch.as_tensor(labels, device=device), dtype=dtype)
        return FileRanking(ranking, int(rows.sum()), n_classes, "all-rows", source)
    _check_episodes_fit(labels, source, way, shot, n_query)
    pool = FeatureSet(
        features=np.zeros((labels.size, 1), np.float32),  # the sampler reads labels only
        labels=labels,
        class_names=first.class_names,
        split=np.full(labels.size, "novel"),
        name=f"{paths[0]} ({source})",
    )
    indices = sample_task_indices(pool, episodes, way, shot, n_query, seed=seed)
    features = {
        str(p): torch.as_tensor(fs.features[rows], dtype=dtype, device=device)
        for p, fs in zip(paths, sets, strict=True)
    }
    ranking = rank_backbones_on_episodes(
        features, indices, center=center, dtype=dtype, progress=progress
    )
    return FileRanking(
        ranking, int(rows.sum()), n_classes, "episodes", source, note,
        way, shot, n_query, episodes, seed,
    )  # fmt: skip
