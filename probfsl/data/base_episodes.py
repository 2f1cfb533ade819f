"""Labelled episodes from the base classes alone (for tuning and calibration).

A method's hyperparameters (:mod:`probfsl.tuning`) and its temperature
(:mod:`probfsl.temperature`) are chosen on episodes whose labels may be read: the base
classes are split in two seeded halves, one plays the base classes (statistics such as
centring means or within-class scatter), the other plays the novel classes (episodes).
Novel classes and their labels are never read. :func:`base_episode_shape` says which
task shape such episodes can have; :func:`base_classes_only` is the zero-shot view.
"""

from __future__ import annotations

import numpy as np

from probfsl.data.featureset import FeatureSet

__all__ = ["base_classes_only", "base_episode_shape", "base_episode_split", "class_sizes"]


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
