"""Few-shot and zero-shot task sampling (protocol in the README, after Veilleux et al. 2021).

Task ``t`` of a run with seed ``s`` is drawn from ``numpy.random.default_rng([s, t])``,
so the first tasks of a run do not depend on how many tasks are asked for.

Every entry point checks its arguments through :mod:`probfsl.validation` before
sampling or gathering anything: ``TypeError`` for a wrong type, ``ValueError`` naming
the argument for an impossible value.

The batch of tasks, :class:`~probfsl.data.episodes.Episodes`, and the checks and
gathering of task indices live in :mod:`probfsl.data.episodes` (the layer below this
module and :mod:`probfsl.data.task_files`); they can be imported from here as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probfsl.data.episodes import (
    OPEN_FIELD,
    TASK_FIELDS,
    Episodes,
    check_dense_size,
    check_task_indices,
    gather_episodes,
)
from probfsl.data.featureset import FeatureSet
from probfsl.data.open_set import add_open_queries, check_open_rows, check_open_setting
from probfsl.data.query_counts import dirichlet_query_counts
from probfsl.data.task_files import TaskFile
from probfsl.fileio import atomic_path
from probfsl.validation import (
    as_device,
    check_choice,
    check_count,
    check_float_dtype,
    check_hyperparameter,
)

BALANCES = ("balanced", "dirichlet")


def _check_sampling_args(
    n_tasks: Any, way: Any, shot: Any, n_query: Any, balance: Any, alpha: Any, seed: Any, start: Any
) -> tuple[int, int, int, int, int, int]:
    """The integer arguments of the few-shot samplers, checked before any sampling."""
    check_choice("balance", balance, BALANCES)
    check_hyperparameter("alpha", alpha, positive=True)
    return (
        check_count("n_tasks", n_tasks),
        check_count("way", way, low=2),
        check_count("shot", shot),
        check_count("n_query", n_query),
        check_count("seed", seed, low=0),
        check_count("start", start, low=0),
    )


def _check_task_size(
    fs: FeatureSet, classes: np.ndarray, way: int, shot: int, n_query: int, balance: str
) -> np.ndarray:
    if classes.size < way:
        raise ValueError(
            f"{fs.name}: asked for {way}-way tasks but there are only {classes.size} novel classes"
        )
    sizes = np.array([(fs.labels[fs.rows("novel")] == c).sum() for c in classes])
    if balance == "balanced":
        if n_query % way:
            raise ValueError(f"balanced tasks need query divisible by way, got {n_query}/{way}")
        need = shot + n_query // way
        if sizes.min() < need:
            raise ValueError(
                f"{fs.name}: balanced {way}-way {shot}-shot tasks need {need} samples per class "
                f"({shot} support + {n_query // way} queries) but the smallest novel class has "
                f"{sizes.min()}; use classes with at least {need} samples or fewer shots/queries"
            )
    else:
        if sizes.min() <= shot:
            raise ValueError(
                f"{fs.name}: {shot}-shot tasks need more than {shot} samples per class, "
                f"the smallest novel class has {sizes.min()}"
            )
        if np.sort(sizes)[:way].sum() - way * shot < n_query:
            raise ValueError(
                f"{fs.name}: {n_query} queries cannot be drawn from {way} classes after "
                f"{shot} shots each (smallest classes hold {np.sort(sizes)[:way].tolist()})"
            )
    return sizes


def sample_task_indices(
    fs: FeatureSet,
    n_tasks: int,
    way: int = 5,
    shot: int = 1,
    n_query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    seed: int = 0,
    start: int = 0,
    n_open: int = 0,
    open_way: int | None = None,
) -> dict[str, np.ndarray]:
    """Row indices of tasks ``start .. start+n_tasks-1`` drawn from the novel classes.

    Returns ``support``, ``support_labels``, ``query``, ``query_labels`` and
    ``classes`` arrays in the layout of the protocol's task files. ``ValueError``
    (``TypeError`` for a wrong type) before any sampling for counts that are not
    integers (n_tasks, shot, n_query >= 1, way >= 2, seed, start >= 0), an unknown
    ``balance``, an ``alpha`` that is not finite and positive, or tasks the novel
    classes cannot hold.

    ``n_open > 0`` adds that many open queries to each task, from ``open_way`` other
    novel classes (default ``min(way, n_open, classes left)``), labelled ``way`` and
    shuffled among the ``n_query`` closed ones, and an ``open_classes`` array ``[T,
    open_way]``: the open-set protocol of :mod:`probfsl.data.open_set`.
    """
    _check_featureset(fs)
    n_tasks, way, shot, n_query, seed, start = _check_sampling_args(
        n_tasks, way, shot, n_query, balance, alpha, seed, start
    )
    novel_rows = fs.rows("novel")
    classes = fs.classes_in("novel")
    sizes = _check_task_size(fs, classes, way, shot, n_query, balance)
    n_open, open_way = check_open_setting(sizes, way, n_open, open_way, balance, fs.name)
    rows_of = {c: novel_rows[fs.labels[novel_rows] == c] for c in classes}
    size_of = dict(zip(classes.tolist(), sizes.tolist(), strict=True))
    out = {
        "support": np.empty((n_tasks, way * shot), np.int64),
        "support_labels": np.tile(np.arange(way), shot)[None].repeat(n_tasks, 0),
        "query": np.empty((n_tasks, n_query), np.int64),
        "query_labels": np.empty((n_tasks, n_query), np.int64),
        "classes": np.empty((n_tasks, way), np.int64),
    }
    for i in range(n_tasks):
        rng = np.random.default_rng([seed, start + i])
        if balance == "balanced":
            chosen = rng.choice(classes, way, replace=False)
            counts = np.full(way, n_query // way)
        else:
            # redraw the classes until the task fits (only matters for tiny classes)
            while True:
                chosen = rng.choice(classes, way, replace=False)
                room = np.array([size_of[c] for c in chosen.tolist()]) - shot
                if room.sum() >= n_query:
                    break
            counts = dirichlet_query_counts(rng, way, n_query, alpha, room)
        support = np.empty((shot, way), np.int64)
        query, query_labels = [], []
        for k, c in enumerate(chosen.tolist()):
            perm = rng.permutation(rows_of[c])
            support[:, k] = perm[:shot]
            query.append(perm[shot : shot + counts[k]])
            query_labels.append(np.full(counts[k], k))
        order = rng.permutation(n_query)
        out["support"][i] = support.reshape(-1)
        out["query"][i] = np.concatenate(query)[order]
        out["query_labels"][i] = np.concatenate(query_labels)[order]
        out["classes"][i] = chosen
    if n_open:
        out = add_open_queries(out, rows_of, n_open, open_way, balance, alpha, seed, start)
    return out


def _check_featureset(fs: Any) -> None:
    if not isinstance(fs, FeatureSet):
        raise TypeError(f"fs must be a FeatureSet, got {type(fs).__name__}")


def episodes_from_indices(
    fs: FeatureSet,
    indices: dict[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    max_bytes: int | None = None,
) -> Episodes:
    """Gather the features of task indices (sampled, or read from a task file) into
    tensors of ``dtype`` on ``device`` (default the CPU).

    ``indices`` is checked by :func:`check_task_indices` (the open queries of open-set
    tasks by :func:`~probfsl.data.open_set.check_open_rows`). Without ``classes``, the
    data-set class of task-local class k is the label of its first support row.

    Every task is made at once, so a large task set is refused before anything is
    allocated (:func:`check_dense_size`): when its tensors would exceed ``max_bytes``
    (default half the physical memory,
    :func:`~probfsl.data.episodes.dense_memory_limit`), ``ValueError`` says
    how much they need; :func:`iter_episodes` makes the same tasks a batch at a time.
    """
    _check_featureset(fs)
    check_float_dtype("dtype", dtype)
    device = as_device(device)
    if isinstance(indices, dict) and all(k in indices for k in ("support", "query")):
        shapes = np.shape(indices["support"]), np.shape(indices["query"])
        if all(len(shape) == 2 for shape in shapes):
            source = torch.as_tensor(fs.features[:0]).dtype
            rows = shapes[0][1] + shapes[1][1]
            check_dense_size(shapes[0][0], rows, fs.dim, dtype, source, max_bytes)
    indices = _checked_for(fs, indices)
    return gather_episodes(fs, indices, dtype, device)


def _checked_for(fs: FeatureSet, indices: Any) -> dict[str, np.ndarray]:
    """Task indices checked against ``fs``: rows in range, and the open queries of
    open-set tasks of their open classes (:func:`check_open_rows`)."""
    checked = check_task_indices(indices, len(fs.labels))
    if OPEN_FIELD in checked:
        check_open_rows("task indices", fs.labels, checked)
    return checked


def iter_episodes(
    fs: FeatureSet,
    tasks: dict[str, np.ndarray] | str | os.PathLike | Any,
    batch_size: int = 1000,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> Iterator[Episodes]:
    """The tasks of ``tasks`` as :class:`Episodes`, ``batch_size`` tasks at a time.

    ``tasks`` is a dict of task indices (:func:`check_task_indices`), the path of a task
    file, or an opened :class:`probfsl.data.task_files.TaskFile`. Everything is checked
    before the first batch is made (a task file in one pass over its values, shown by
    ``progress``); then only one batch of features is in memory at a time, so memory
    does not grow with the number of tasks. The batches, concatenated, are the tasks of
    :func:`episodes_from_indices`. To score them, hand
    ``lambda start, stop: ...`` batches to :func:`probfsl.evaluation.protocol.evaluate_stream`,
    or use :meth:`TaskFile.episodes <probfsl.data.task_files.TaskFile.episodes>`.
    """
    _check_featureset(fs)
    batch_size = check_count("batch_size", batch_size)
    check_float_dtype("dtype", dtype)
    device = as_device(device)
    if isinstance(tasks, (str, os.PathLike)):
        tasks = TaskFile(tasks)
    if isinstance(tasks, TaskFile):
        tasks.check(len(fs.labels), progress=progress)
        return _task_file_batches(fs, tasks, batch_size, dtype, device)
    return _index_batches(fs, _checked_for(fs, tasks), batch_size, dtype, device)


def _index_batches(
    fs: FeatureSet, checked: dict, batch_size: int, dtype: torch.dtype, device: torch.device
) -> Iterator[Episodes]:
    n_tasks = checked["support"].shape[0]
    for start in range(0, n_tasks, batch_size):
        rows = {k: v[start : start + batch_size] for k, v in checked.items() if k in TASK_FIELDS}
        yield gather_episodes(fs, rows, dtype, device)


def _task_file_batches(
    fs: FeatureSet, task_file: Any, batch_size: int, dtype: torch.dtype, device: torch.device
) -> Iterator[Episodes]:
    for start in range(0, len(task_file), batch_size):
        yield task_file.episodes(fs, start, start + batch_size, dtype, device)


def sample_episodes(
    fs: FeatureSet,
    n_tasks: int,
    way: int = 5,
    shot: int = 1,
    n_query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    seed: int = 0,
    start: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    max_bytes: int | None = None,
    n_open: int = 0,
    open_way: int | None = None,
) -> Episodes:
    """Sample N-way, L-shot, Q-query tasks from the novel classes as batched tensors of
    ``dtype`` on ``device`` (default the CPU).

    ``balance="balanced"`` gives Q/N queries per class; ``"dirichlet"`` draws the
    per-class counts from a symmetric Dirichlet(alpha) with Q fixed
    (:func:`dirichlet_query_counts`). Tasks whose tensors would exceed ``max_bytes``
    (default half the physical memory) are refused before any sampling
    (:func:`check_dense_size`); ``start`` lets a loop make them a batch at a time.
    ``n_open`` open queries per task (labelled ``way``, :attr:`Episodes.open_mask`)
    from ``open_way`` other novel classes make open-set tasks
    (:mod:`probfsl.data.open_set`); the query tensors are then ``[T, Q + n_open]``.
    """
    check_float_dtype("dtype", dtype)
    device = as_device(device)
    _check_featureset(fs)
    n_tasks, way, shot, n_query, *_ = _check_sampling_args(
        n_tasks, way, shot, n_query, balance, alpha, seed, start
    )
    n_open = check_count("n_open", n_open, low=0)
    source = torch.as_tensor(fs.features[:0]).dtype
    check_dense_size(
        n_tasks, way * shot + n_query + n_open, fs.dim, dtype, source, max_bytes, "sample_episodes"
    )
    indices = sample_task_indices(
        fs, n_tasks, way, shot, n_query, balance, alpha, seed, start, n_open, open_way
    )
    return gather_episodes(fs, indices, dtype, device)


@dataclass
class ZeroShotTasks:
    """A batch of zero-shot tasks (EM-Dirichlet protocol).

    Attributes:
        query_index: ``[T, Q]`` rows of the source FeatureSet.
        query_labels: ``[T, Q]`` data-set labels of the queries.
        classes: ``[T, k_max]`` data-set labels present in each task, padded with -1.
        n_classes: ``[T]`` number of classes in each task.
    """

    query_index: torch.Tensor
    query_labels: torch.Tensor
    classes: torch.Tensor
    n_classes: torch.Tensor

    def __len__(self) -> int:
        return self.query_index.shape[0]


def sample_zero_shot_tasks(
    fs: FeatureSet,
    n_tasks: int,
    min_classes: int = 3,
    max_classes: int = 10,
    n_query: int = 75,
    seed: int = 0,
    start: int = 0,
) -> ZeroShotTasks:
    """Zero-shot tasks: k ~ U{min..max} classes from all labelled classes, Q queries
    drawn uniformly without replacement from their pooled samples.

    ``ValueError`` (``TypeError`` for a wrong type) before any sampling for counts that
    are not integers (n_tasks, n_query >= 1, seed, start >= 0) or a class range outside
    ``2 <= min_classes <= max_classes <= classes available``."""
    _check_featureset(fs)
    n_tasks, n_query = check_count("n_tasks", n_tasks), check_count("n_query", n_query)
    seed, start = check_count("seed", seed, low=0), check_count("start", start, low=0)
    min_classes = check_count("min_classes", min_classes, low=2)
    max_classes = check_count("max_classes", max_classes, low=2)
    labelled = np.flatnonzero(fs.labels >= 0)
    classes = np.unique(fs.labels[labelled])
    if not 2 <= min_classes <= max_classes <= classes.size:
        raise ValueError(
            f"{fs.name}: need 2 <= min_classes <= max_classes <= {classes.size} classes, "
            f"got {min_classes}..{max_classes}"
        )
    q_idx = np.empty((n_tasks, n_query), np.int64)
    present = np.full((n_tasks, max_classes), -1, np.int64)
    n_present = np.empty(n_tasks, np.int64)
    for i in range(n_tasks):
        rng = np.random.default_rng([seed, start + i])
        k = int(rng.integers(min_classes, max_classes + 1))
        chosen = rng.choice(classes, k, replace=False)
        pool = labelled[np.isin(fs.labels[labelled], chosen)]
        if pool.size < n_query:
            raise ValueError(
                f"{fs.name}: {n_query} queries asked from {k} classes holding {pool.size} samples"
            )
        q_idx[i] = rng.choice(pool, n_query, replace=False)
        present[i, :k] = np.sort(chosen)
        n_present[i] = k
    return ZeroShotTasks(
        query_index=torch.as_tensor(q_idx),
        query_labels=torch.as_tensor(fs.labels[q_idx]),
        classes=torch.as_tensor(present),
        n_classes=torch.as_tensor(n_present),
    )


def save_task_file(path: str | os.PathLike, indices: dict[str, np.ndarray]) -> Path:
    """Write task indices as the protocol's explicit task file (``.npz``); returns its path.

    As :func:`numpy.savez`, ``.npz`` is appended to a path without it. The indices are
    checked first (:func:`check_task_indices`, rows not bounded) and written atomically
    (:func:`probfsl.fileio.atomic_path`): a failure leaves an existing file as it was.
    Open-set tasks (``sample_task_indices(..., n_open=N)``) keep their ``open_classes``,
    which marks them as such when the file is read.
    """
    if not isinstance(indices, dict):
        raise TypeError(f"indices must be a dict of arrays, got {type(indices).__name__}")
    checked = check_task_indices(indices, np.iinfo(np.int64).max)
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    arrays = {k: np.asarray(v) for k, v in indices.items()}
    arrays.update({k: checked[k] for k in TASK_FIELDS if k in checked})
    with atomic_path(path) as tmp:
        np.savez(tmp, **arrays)
    return path


def task_file_shape(indices: dict[str, np.ndarray]) -> tuple[int, int, int]:
    """(way, shot, queries) of the tasks of a task file (:func:`load_task_file`), or of
    an opened :class:`probfsl.data.task_files.TaskFile` (its :attr:`shape`)."""
    if hasattr(indices, "shape") and not isinstance(indices, dict):
        return indices.shape
    if len(indices["support"]) == 0:
        raise ValueError("task indices: hold no tasks (the arrays have 0 rows)")
    way = int(indices["support_labels"].max()) + 1
    return way, indices["support"].shape[1] // way, indices["query"].shape[1]


def load_task_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read an explicit task file written by :func:`save_task_file` or another harness.

    Index and label fields come back as int64 whatever width the file stores (int16 and
    int32 files are common), with any other arrays of the file as they are. The file is
    checked as :class:`probfsl.data.task_files.TaskFile` checks it: ``ValueError``
    naming the file for a missing or unreadable file, a missing field, no tasks,
    mismatched shapes, negative rows or labels, or a task without a support sample of
    each class (non-integer fields raise an error that is both a ``ValueError`` and a
    ``TypeError``). Row ranges are checked against the features by
    :func:`episodes_from_indices`. The whole file is read into memory: a large one is
    better opened as a :class:`~probfsl.data.task_files.TaskFile` and made into tasks a
    batch at a time (:func:`iter_episodes`).
    """
    task_file = TaskFile(path)
    task_file.check()
    return {**task_file.extra_fields(), **task_file.indices()}
