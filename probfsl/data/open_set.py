"""Open queries of few-shot open-set recognition (FSOSR) tasks.

In the FSOSR protocol (Boudiaf, Bennequin, Tami, Toubhans, Piantanida, Hudelot &
Ben Ayed, "Model-Agnostic Few-Shot Open-Set Recognition", 2022) a task has K known
classes with L support samples each and two kinds of queries: *closed* queries of the
known classes and *open* queries of other classes of the same split, which never appear
in the support. The paper's setting is 5-way with 15 closed queries per class and 75
open queries from 5 other classes.

:func:`probfsl.data.tasks.sample_task_indices` and
:func:`~probfsl.data.tasks.sample_episodes` take ``n_open`` (open queries per task, 0 by
default) and ``open_way`` (open classes per task) and hand them to this module:

* **Open classes.** ``open_way`` classes drawn uniformly from the novel classes that are
  not among the task's K known classes; by default ``min(way, n_open, classes left)``:
  as many open classes as known ones where the split holds them (the paper), else every
  class left.
* **Counts.** ``balance="balanced"``: the open queries are spread as evenly as possible
  (``n_open // open_way`` each, the remainder one more each for randomly chosen open
  classes); ``"dirichlet"``: drawn by
  :func:`~probfsl.data.query_counts.dirichlet_query_counts` with the closed queries' ``alpha``.
* **Labels and order.** An open query's task-local label is ``way`` (K, the index of the
  "none of these classes" column of ``predict_proba_open``); the closed and open
  queries are shuffled together. ``classes`` stays ``[T, K]``.
* **Reproducibility.** The open queries of task ``t`` are drawn from their own stream,
  ``numpy.random.default_rng([seed, t, 1])``, after the closed task has been drawn from
  ``[seed, t]``: the support and the closed queries of an open task are those of the
  same task without open queries (only the query order differs).

Every problem with ``n_open`` or ``open_way`` is a ``ValueError`` raised by
:func:`check_open_setting` before any task is drawn.

**Fixed tasks.** Open-set tasks can also be given, as task indices or a task file
(:func:`~probfsl.data.tasks.save_task_file`): what makes them open-set is the
``open_classes`` field ``[T, J]``, the data-set labels of each task's open classes, which
:func:`~probfsl.data.tasks.sample_task_indices` returns with ``n_open``. Their queries
labelled ``way`` are the open ones (a task may hold any number, at least one, beside at
least one closed query); :func:`check_open_rows` checks them against the features' labels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from probfsl.data.query_counts import dirichlet_query_counts
from probfsl.validation import check_count

#: the last entry of the seed sequence of the open queries' random stream
OPEN_STREAM = 1

#: tasks compared at once by :func:`check_open_rows` (its [B, Q, S] comparisons stay small)
_CHECK_ROWS_BLOCK = 2048


def check_open_setting(
    sizes: np.ndarray,
    way: int,
    n_open: Any,
    open_way: Any,
    balance: str,
    name: str = "features",
) -> tuple[int, int]:
    """``(n_open, open_way)`` checked against a split whose classes hold ``sizes``
    samples, for ``way``-way tasks; ``open_way`` ``None`` becomes its default
    ``min(way, n_open, classes left)`` (0 when ``n_open`` is 0).

    ``ValueError`` (``TypeError`` for a non-integer) for a negative ``n_open``, an
    ``open_way`` with no open queries or outside ``1..classes left``, a split without a
    class besides the task's, or open queries the open classes cannot hold in every task
    (the smallest classes of the split are the bound, as for the closed queries).
    """
    n_open = check_count("n_open", n_open, low=0)
    sizes = np.asarray(sizes)
    left = int(sizes.size) - way
    if n_open == 0:
        if open_way is not None:
            check_count("open_way", open_way, low=1)
            raise ValueError(f"open_way={open_way} needs open queries (n_open > 0), got n_open=0")
        return 0, 0
    if left < 1:
        raise ValueError(
            f"{name}: open queries come from novel classes outside the task, but the "
            f"{sizes.size} novel classes are all taken by {way}-way tasks; use a smaller "
            "way or n_open=0"
        )
    if open_way is None:
        open_way = default_open_way(sizes.size, way, n_open)
    else:
        open_way = check_count("open_way", open_way, low=1)
        if open_way > left:
            raise ValueError(
                f"{name}: open_way={open_way} open classes asked, but {way}-way tasks leave "
                f"{left} of the {sizes.size} novel classes"
            )
    smallest = np.sort(sizes)[:open_way]
    classes = "class" if open_way == 1 else "classes"
    more = "" if open_way == left else " or more open classes"
    if balance == "balanced":
        need = -(-n_open // open_way)
        if smallest.min() < need:
            raise ValueError(
                f"{name}: {n_open} open queries from {open_way} open {classes} need up to "
                f"{need} samples per class, but the smallest novel class has "
                f"{smallest.min()}; use at most {open_way * smallest.min()} open "
                f"queries{more}"
            )
    elif smallest.sum() < n_open:
        raise ValueError(
            f"{name}: {n_open} open queries cannot be drawn from {open_way} open {classes} "
            f"(the smallest novel classes hold {smallest.tolist()}); use at most "
            f"{smallest.sum()} open queries{more}"
        )
    return n_open, open_way


def _open_counts(
    rng: np.random.Generator,
    n_open: int,
    room: np.ndarray,
    balance: str,
    alpha: float,
) -> np.ndarray:
    """Open queries per open class: as even as possible, or Dirichlet-drawn."""
    open_way = room.size
    if balance == "balanced":
        counts = np.full(open_way, n_open // open_way, np.int64)
        counts[rng.choice(open_way, n_open % open_way, replace=False)] += 1
        return counts
    return dirichlet_query_counts(rng, open_way, n_open, alpha, room)


def add_open_queries(
    out: dict[str, np.ndarray],
    rows_of: dict[int, np.ndarray],
    n_open: int,
    open_way: int,
    balance: str,
    alpha: float,
    seed: int,
    start: int,
) -> dict[str, np.ndarray]:
    """Closed task indices ``out`` (as :func:`~probfsl.data.tasks.sample_task_indices`
    makes them) with ``n_open`` open queries added to each task (see the module's doc).

    ``rows_of`` maps each novel class to its rows; the arguments are already checked
    (:func:`check_open_setting`). Returns ``out`` with ``query`` and ``query_labels``
    widened to ``[T, Q + n_open]`` and ``open_classes`` ``[T, open_way]`` (the data-set
    labels of each task's open classes) added.
    """
    classes = np.array(sorted(rows_of))
    size_of = {c: rows_of[c].size for c in classes.tolist()}
    n_tasks, n_query = out["query"].shape
    way = out["classes"].shape[1]
    query = np.empty((n_tasks, n_query + n_open), np.int64)
    labels = np.empty((n_tasks, n_query + n_open), np.int64)
    open_classes = np.empty((n_tasks, open_way), np.int64)
    for i in range(n_tasks):
        rng = np.random.default_rng([seed, start + i, OPEN_STREAM])
        others = classes[~np.isin(classes, out["classes"][i])]
        # any draw holds the open queries: check_open_setting bounds them by the
        # smallest classes of the split
        chosen = rng.choice(others, open_way, replace=False)
        room = np.array([size_of[c] for c in chosen.tolist()])
        counts = _open_counts(rng, n_open, room, balance, alpha)
        rows = [
            rng.choice(rows_of[c], k, replace=False)
            for c, k in zip(chosen.tolist(), counts.tolist(), strict=True)
        ]
        order = rng.permutation(n_query + n_open)
        query[i] = np.concatenate([out["query"][i], *rows])[order]
        labels[i] = np.concatenate([out["query_labels"][i], np.full(n_open, way)])[order]
        open_classes[i] = chosen
    return {**out, "query": query, "query_labels": labels, "open_classes": open_classes}


def check_open_rows(name: str, labels: np.ndarray, indices: dict, first: int = 0) -> None:
    """The open queries of open-set task indices (int64 arrays already checked by
    :func:`~probfsl.data.episodes.check_task_values`, ``open_classes`` among them) against
    the features' data-set ``labels``: every open query is a row of one of its task's
    ``open_classes``, and no open class is one of the task's known classes (the labels of
    its support rows). ``ValueError`` prefixed by ``name`` naming the first bad task
    (numbered from ``first``); vectorised over blocks of tasks."""
    way = int(indices["support_labels"][0].max()) + 1
    for lo in range(0, len(indices["support"]), _CHECK_ROWS_BLOCK):
        block = {k: v[lo : lo + _CHECK_ROWS_BLOCK] for k, v in indices.items()}
        known = labels[block["support"]]  # [B, S]
        query = labels[block["query"]]  # [B, Q]
        open_classes = block["open_classes"]  # [B, J]
        is_open = block["query_labels"] == way
        in_task = (query[:, :, None] == known[:, None, :]).any(-1) & is_open
        outside = ~(query[:, :, None] == open_classes[:, None, :]).any(-1) & is_open
        taken = (open_classes[:, :, None] == known[:, None, :]).any(-1)
        for bad, what in (
            (taken, "names an open class that is one of its known classes"),
            (in_task, "has an open query of one of its known classes"),
            (outside, "has an open query of a class not in its 'open_classes'"),
        ):
            if bad.any():
                t = int(np.flatnonzero(bad.any(1))[0])
                j = int(np.flatnonzero(bad[t])[0])
                if bad is taken:
                    detail = f"class {int(open_classes[t, j])}"
                else:
                    row, label = int(block["query"][t, j]), int(query[t, j])
                    detail = f"query {j}: row {row} of class {label}"
                raise ValueError(f"{name}: task {first + lo + t} {what} ({detail})")


def default_open_way(n_classes: int, way: int, n_open: int) -> int:
    """The open classes per task when ``open_way`` is not given: as many as the known
    classes (the paper), at most the ``n_classes - way`` classes left and ``n_open``
    (0 without open queries)."""
    return max(0, min(way, n_open, n_classes - way))
