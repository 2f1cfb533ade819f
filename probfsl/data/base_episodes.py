"""Labelled episodes from the base classes alone (for tuning and calibration).

A method's hyperparameters (:mod:`probfsl.tuning`) and its temperature
(:mod:`probfsl.temperature`) are chosen on episodes whose labels may be read: the base
classes are split in two seeded halves, one plays the base classes (statistics such as
centring means or within-class scatter), the other plays the novel classes (episodes).
Novel classes and their labels are never read. :func:`base_episode_shape` says which
task shape such episodes can have; :func:`base_classes_only` is the zero-shot view.

When those episodes are too easy to tell candidates apart, or have fewer ways than the
target tasks, :func:`class_subset_views` gives harder ones: each view lets a seeded draw
of ``way`` base classes play the novel classes and the remaining base classes (at least
:data:`MIN_STATISTICS_CLASSES`) the base classes, so that episodes can have as many
ways as the base classes allow (:func:`hardest_episode_shape`), and successive draws
cover more combinations of classes than one fixed half. :func:`base_as_novel` is the
last resort when too few classes would be left for the statistics.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from probfsl.data.featureset import FeatureSet

__all__ = [
    "MIN_STATISTICS_CLASSES",
    "base_as_novel",
    "base_classes_only",
    "base_episode_shape",
    "base_episode_split",
    "class_sizes",
    "class_subset_views",
    "hardest_episode_shape",
    "open_base_episode_shape",
]

#: base classes kept for the statistics (centring, scatter, negatives) in
#: :func:`class_subset_views`: the other base classes may play novel classes
MIN_STATISTICS_CLASSES = 2


def base_episode_split(fs: FeatureSet, seed: int = 0) -> FeatureSet:
    """A view of ``fs`` in which half of the base classes act as novel classes.

    The other half stays base; every original novel row is marked ``"held_out"``
    (never sampled, never used for statistics). ``ValueError`` with fewer than 4 base
    classes.
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


def base_classes_only(fs: FeatureSet) -> FeatureSet:
    """``fs`` with every non-base row unlabelled (-1): zero-shot tasks then draw only
    base classes; class embeddings of all classes stay (they are names, not labels).
    ``ValueError`` with fewer than 2 base classes."""
    if fs.classes_in("base").size < 2:
        raise ValueError(f"{fs.name}: zero-shot tuning needs at least 2 base classes")
    return fs.labelled_only("base")


def class_sizes(fs: FeatureSet, split: str) -> np.ndarray:
    """Number of labelled rows of each class of ``split``, in label order."""
    rows = fs.rows(split)
    return np.unique(fs.labels[rows], return_counts=True)[1]


def base_episode_shape(
    fs: FeatureSet,
    way: int,
    shot: int,
    n_query: int,
    balance: str = "balanced",
    seed: int = 0,
) -> tuple[int, int, int] | None:
    """The (way, shot, queries) of the base episodes that ``fs`` can give.

    The target shape when the base classes allow it. Otherwise (half of the base
    classes play the novel classes, :func:`base_episode_split`) the largest smaller
    shape: way = min(way, base classes // 2), shot = min(shot, smallest class - 1),
    queries per class capped by the samples left (balanced) or the total capped by the
    smallest classes (Dirichlet). ``None`` when not even 2-way 1-shot base episodes
    fit (fewer than 4 base classes, or classes of one sample).
    """
    if fs.classes_in("base").size < 4:
        return None
    sizes = class_sizes(base_episode_split(fs, seed), "novel")
    w = min(way, sizes.size)
    s = min(shot, int(sizes.min()) - 1)
    if w < 2 or s < 1:
        return None
    if balance == "balanced":
        per_class = min(max(n_query // way, 1), int(sizes.min()) - s)
        q = w * per_class
    else:
        room = int(np.sort(sizes)[:w].sum()) - w * s
        q = min(max(round(n_query * w / way), 1), room)
    return w, s, q


def open_base_episode_shape(
    view: FeatureSet,
    shape: tuple[int, int, int],
    n_open: int,
    balance: str = "balanced",
    alpha: float = 2.0,
    seed: int = 0,
) -> tuple[tuple[int, int, int], int] | None:
    """``((way, shot, queries), open queries)`` of open-set base episodes that the
    pseudo-novel classes of ``view`` (:func:`base_episode_split`) can hold, for ``shape``
    with ``n_open`` open queries asked.

    ``shape`` and ``n_open`` where they fit. Otherwise open queries need classes beside
    the known ones, so the way drops to leave two open classes (``min(way, classes - 2)``,
    at least 2; one open class with 3 classes), the closed and open queries scaled by the
    same ratio; at either way the queries are then halved, three times at most, until
    the classes hold them. ``None`` when nothing fits (fewer than 3 pseudo-novel
    classes, or classes too small): the search then runs on closed episodes.
    """
    from probfsl.data.tasks import sample_task_indices

    way, shot, n_query = shape
    n_classes = class_sizes(view, "novel").size
    ways = [way]
    fewer = max(2, min(way, n_classes - 2)) if n_classes >= 4 else n_classes - 1
    if 2 <= fewer < way:
        ways.append(fewer)
    for w in ways:
        per_class = max(1, n_query // way)
        o = max(1, round(n_open * w / way))
        for _ in range(4):
            try:
                sample_task_indices(view, 1, w, shot, w * per_class, balance, alpha, seed, n_open=o)
            except ValueError:
                per_class, o = max(1, per_class // 2), max(1, o // 2)
                continue
            return (w, shot, w * per_class), o
    return None


def _view(fs: FeatureSet, novel: np.ndarray, name: str) -> FeatureSet:
    """``fs`` with the base classes ``novel`` marked novel, the other base rows base and
    every original non-base row ``"held_out"``."""
    split = np.where(fs.split == "base", "base", "held_out")
    split[np.isin(fs.labels, novel) & (fs.split == "base")] = "novel"
    return FeatureSet(
        features=fs.features,
        labels=fs.labels,
        class_names=fs.class_names,
        split=split,
        class_features=fs.class_features,
        name=name,
    )


def class_subset_views(
    fs: FeatureSet,
    way: int,
    n_views: int = 10,
    seed: int = 0,
    min_base: int = MIN_STATISTICS_CLASSES,
) -> list[FeatureSet]:
    """Views of ``fs`` in each of which ``way`` base classes play the novel classes.

    The rest of the base classes stay base (their statistics are what the method fits);
    the original novel rows are ``"held_out"``. Every combination of classes when there
    are at most ``n_views`` of them, else ``n_views`` seeded draws. An empty list when
    fewer than ``min_base`` base classes would be left for the statistics, or ``way``
    is below 2.
    """
    classes = fs.classes_in("base")
    if way < 2 or classes.size - way < min_base:
        return []
    if math.comb(classes.size, way) <= n_views:
        draws = [np.array(c) for c in itertools.combinations(classes, way)]
    else:
        rng = np.random.default_rng([seed, 104729])
        draws = [rng.choice(classes, way, replace=False) for _ in range(n_views)]
    return [_view(fs, d, f"{fs.name}[base draw {i}]") for i, d in enumerate(draws)]


def base_as_novel(fs: FeatureSet) -> FeatureSet:
    """Every base row twice: once as a base row, once as a novel one.

    Episodes of it may use every base class; the base statistics then come from the
    episode's own classes, which suits methods that only centre on them but flatters
    those that learn a projection from them (BAVARDAGE) and handicaps those that use
    them as negatives (SLEM): a last resort when :func:`class_subset_views` has none.
    """
    base = fs.rows("base")
    return FeatureSet(
        features=np.concatenate([fs.features[base], fs.features[base]]),
        labels=np.concatenate([fs.labels[base], fs.labels[base]]),
        class_names=fs.class_names,
        split=np.array(["base"] * base.size + ["novel"] * base.size),
        name=f"{fs.name}[base classes as novel]",
    )


def hardest_episode_shape(
    fs: FeatureSet,
    shot: int,
    max_query_per_class: int = 15,
    min_base: int = MIN_STATISTICS_CLASSES,
    max_way: int | None = None,
) -> tuple[int, int, int] | None:
    """The hardest (way, shot, queries) of the episodes of :func:`class_subset_views`.

    As many ways as leave ``min_base`` base classes for the statistics (at most
    ``max_way``), the target ``shot`` (capped by the smallest base class), and as many
    queries per class as the smallest class leaves (at most ``max_query_per_class``).
    ``None`` when not even 2-way 1-shot episodes fit.
    """
    sizes = class_sizes(fs, "base")
    way = sizes.size - min_base
    if max_way is not None:
        way = min(way, max_way)
    if way < 2 or sizes.min() < 2:
        return None
    s = min(shot, int(sizes.min()) - 1)
    per_class = min(int(sizes.min()) - s, max_query_per_class)
    return way, s, way * per_class
