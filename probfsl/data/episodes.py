"""Batched few-shot tasks and the task indices they are made from.

:class:`Episodes` holds a batch of tasks as rectangular tensors. The functions below
check task indices (rows of a feature set and task-local labels, sampled or read from a
task file), bound the memory of the dense tensors made from them and gather the
features. Task sampling (:mod:`probfsl.data.tasks`, which re-exports every public name
here) and task files (:mod:`probfsl.data.task_files`) both build on this module, which
imports neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet
from probfsl.validation import (
    FLOAT_DTYPES,
    as_device,
    as_index_array,
    as_label_array,
    check_count,
    check_float_dtype,
)

#: the fields of a task file that are task indices (:func:`probfsl.data.tasks.save_task_file`)
TASK_FIELDS = ("support", "support_labels", "query", "query_labels", "classes", "open_classes")

#: the field that makes task indices open-set tasks: ``[T, J]``, the data-set labels of each
#: task's J open classes (:mod:`probfsl.data.open_set`); its queries labelled ``way`` are open
OPEN_FIELD = "open_classes"


@dataclass
class Episodes:
    """A batch of T few-shot tasks as rectangular tensors.

    Attributes:
        support: ``[T, K*L, D]`` support features, shot-major (labels 0..K-1 repeated L times).
        support_labels: ``[T, K*L]`` task-local labels.
        query: ``[T, Q, D]`` query features in shuffled order.
        query_labels: ``[T, Q]`` task-local labels (for scoring only); an open query of
            an open-set task (:mod:`probfsl.data.open_set`) has the label ``way``.
        classes: ``[T, K]`` data-set label of each task-local class.
        support_index, query_index: ``[T, K*L]``, ``[T, Q]`` rows of the source FeatureSet.

    Construction checks types (cheap, no pass over the values): NumPy arrays are
    converted to tensors (no copy); ``support`` and ``query`` must be ``[T, n, D]``
    float32 or float64 tensors of one dtype (``TypeError`` otherwise, e.g. float64
    support with float32 queries); label and index fields must be integer tensors (any
    width: int32 labels are converted to ``torch.long``). Agreement of shapes and
    devices, finite values, labels in range and a support sample for every class are
    checked by each method's ``predict_proba``
    (:func:`probfsl.validation.check_episodes`), with a ``ValueError`` naming the field.
    """

    support: torch.Tensor
    support_labels: torch.Tensor
    query: torch.Tensor
    query_labels: torch.Tensor
    classes: torch.Tensor
    support_index: torch.Tensor
    query_index: torch.Tensor

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(np.ascontiguousarray(value))
                setattr(self, f.name, value)
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Episodes.{f.name} must be a torch.Tensor or numpy.ndarray, "
                    f"got {type(value).__name__}"
                )
        s, q = self.support, self.query
        for name, x in (("support", s), ("query", q)):
            if x.dtype not in FLOAT_DTYPES:
                raise TypeError(f"Episodes.{name} must be float32 or float64, got {x.dtype}")
            if x.ndim != 3:
                raise ValueError(f"Episodes.{name} must be [T, n, D], got shape {tuple(x.shape)}")
        if s.dtype != q.dtype:
            raise TypeError(
                f"Episodes.support ({s.dtype}) and Episodes.query ({q.dtype}) must have one "
                "dtype; cast both with episodes.to(dtype=...)"
            )
        for name in ("support_labels", "query_labels", "classes", "support_index", "query_index"):
            x = getattr(self, name)
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"Episodes.{name} must be an integer tensor, got {x.dtype}")
            if x.dtype != torch.long:
                setattr(self, name, x.long())
        if self.classes.ndim != 2:
            raise ValueError(
                f"Episodes.classes must be [T, way], got shape {tuple(self.classes.shape)}"
            )

    @property
    def n_tasks(self) -> int:
        return self.support.shape[0]

    @property
    def way(self) -> int:
        return self.classes.shape[1]

    @property
    def shot(self) -> int:
        return self.support.shape[1] // self.way

    @property
    def n_query(self) -> int:
        return self.query.shape[1]

    @property
    def open_mask(self) -> torch.Tensor:
        """``[T, Q]`` bool: which queries are open queries (label ``way``: a class outside
        the task, :mod:`probfsl.data.open_set`); all false for closed tasks."""
        return self.query_labels == self.classes.shape[1]

    def __len__(self) -> int:
        return self.n_tasks

    def __getitem__(self, index: slice | int) -> Episodes:
        """Tasks ``index`` (an int keeps a batch dimension of one)."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            if not -self.n_tasks <= index < self.n_tasks:
                raise IndexError(f"task {index} out of range for {self.n_tasks} tasks")
            index = int(index) % self.n_tasks
            index = slice(index, index + 1)
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def points(self) -> torch.Tensor:
        """Support then query rows of each task, ``[T, K*L + Q, D]``.

        A view without a copy when ``support`` and ``query`` are adjacent slices of one
        buffer (as :func:`gather_episodes` and :meth:`to` lay them out), so that a
        method can take every Gram matrix in one batched product; otherwise a new tensor.
        """
        s, q = self.support, self.query
        n_s = s.shape[1]
        adjacent = (
            s.dtype == q.dtype
            and s.device == q.device
            and s.stride() == q.stride()
            and s.stride(2) == 1
            and s.stride(0) == (n_s + q.shape[1]) * s.stride(1)
            and q.data_ptr() == s.data_ptr() + n_s * s.stride(1) * s.element_size()
        )
        if adjacent:
            return s.as_strided((s.shape[0], n_s + q.shape[1], s.shape[2]), s.stride())
        return torch.cat([s, q], 1)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        """Move every tensor to ``device``; cast the feature tensors to ``dtype``.

        Support and query stay adjacent slices of one buffer (see :meth:`points`).
        """
        if dtype is not None:
            check_float_dtype("dtype", dtype)
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)}
        points = self.points().to(device, dtype)
        moved["support"], moved["query"] = points.split([self.support.shape[1], self.n_query], 1)
        return replace(self, **moved)


def _first(mask: np.ndarray) -> int:
    """Index of the first task (row of ``mask``) with a true entry."""
    return int(np.flatnonzero(mask.reshape(mask.shape[0], -1).any(1))[0])


def check_task_values(
    name: str,
    support: np.ndarray,
    support_labels: np.ndarray,
    query: np.ndarray,
    query_labels: np.ndarray,
    n_rows: int | None,
    way: int | None = None,
    first: int = 0,
    open_set: bool = False,
) -> int:
    """Check the values of a block of tasks (int64 arrays ``[B, S]``, ``[B, S]``,
    ``[B, Q]``, ``[B, Q]``) whose first task is number ``first``; returns the way.

    Rows must lie in ``0..n_rows-1`` (only ``>= 0`` when ``n_rows`` is ``None``); every
    task's support labels must be exactly the classes ``0..way-1`` (each with at least one
    support sample), with ``way >= 2`` and the same for every task (``way`` of earlier
    blocks, or taken from this block's first task when ``None``); query labels must lie
    in ``0..way-1``. Open-set tasks (``open_set``) also have open queries, labelled
    ``way``: every task needs at least one of them and one closed query.
    ``ValueError`` prefixed by ``name`` that names the first bad task.
    One vectorised pass: a block of many tasks is checked without a loop over tasks.
    """
    for key, rows in (("support", support), ("query", query)):
        too_high = n_rows is not None and rows.max() >= n_rows
        if rows.min() < 0 or too_high:
            bad = (rows < 0) | (rows >= n_rows) if n_rows is not None else rows < 0
            t = _first(bad)
            value = int(rows[t][bad[t]][0])
            span = f"0..{n_rows - 1} (the features have {n_rows} rows)" if n_rows else "0 and up"
            raise ValueError(
                f"{name}: {key!r} must hold row indices in {span}; task {first + t} holds {value}"
            )
    ordered = np.sort(support_labels, 1)
    low, high = ordered[:, 0], ordered[:, -1]
    if low.min() < 0:
        t = _first(low < 0)
        raise ValueError(
            f"{name}: 'support_labels' must hold task-local labels 0..way-1; "
            f"task {first + t} holds {int(low[t])}"
        )
    if way is None:
        way = int(high[0]) + 1
        if way < 2:
            raise ValueError(
                f"{name}: tasks need at least 2 classes, got way={way} "
                f"(the support labels of task {first} are all 0)"
            )
    n_classes = 1 + (np.diff(ordered, axis=1) != 0).sum(1)
    bad = (high != way - 1) | (n_classes != way)
    if bad.any():
        t = _first(bad)
        present = np.unique(support_labels[t]).tolist()
        missing = sorted(set(range(way)) - set(present))
        if missing:
            listed = ", ".join(map(str, missing))
            problem = f"no support sample of class{'es' if len(missing) > 1 else ''} {listed}"
        else:
            problem = f"support labels {present}"
        raise ValueError(
            f"{name}: task {first + t} has {problem} but the tasks are {way}-way (support "
            f"labels of the first task); every task needs a support sample of each class "
            f"0..{way - 1} and no other label"
        )
    top = way if open_set else way - 1
    if query_labels.min() < 0 or query_labels.max() > top:
        bad = (query_labels < 0) | (query_labels > top)
        t = _first(bad)
        value = int(query_labels[t][bad[t]][0])
        meaning = f", {way} an open query" if open_set else ""
        hint = ""
        if value == way and not open_set:
            hint = (
                f"; open-set tasks (label {way}: none of the task's classes) also need the "
                f"data-set labels of their open classes, a field {OPEN_FIELD!r} [T, J]"
            )
        raise ValueError(
            f"{name}: 'query_labels' must lie in 0..{top} (the tasks are {way}-way{meaning}); "
            f"task {first + t} holds {value}{hint}"
        )
    if open_set:
        n_open = (query_labels == way).sum(1)
        for bad, kind in ((n_open == 0, "open"), (n_open == query_labels.shape[1], "closed")):
            if bad.any():
                raise ValueError(
                    f"{name}: task {first + _first(bad)} has no {kind} query; every open-set "
                    f"task needs closed queries (labels 0..{way - 1}) and open ones "
                    f"(label {way})"
                )
    return way


def check_task_indices(indices: Any, n_rows: int) -> dict[str, np.ndarray]:
    """Task indices (sampled, or read from a task file) as int64 arrays, checked.

    ``support`` [T, S] and ``query`` [T, Q] are rows in ``0..n_rows-1`` (integers of any
    width: int16/int32 task files are cast to int64); ``support_labels`` [T, S] and
    ``query_labels`` [T, Q] are task-local labels: every task's support holds each class
    ``0..way-1`` (``way`` >= 2, the same for every task) and its queries lie in
    ``0..way-1``; the optional ``classes`` is [T, way]. With ``open_classes`` [T, J]
    (J >= 1 data-set labels per task, :data:`OPEN_FIELD`) they are open-set tasks: the
    queries labelled ``way`` are open, and each task has open and closed queries (their
    classes are checked against the features' labels by
    :func:`probfsl.data.open_set.check_open_rows`). ``TypeError`` for float or
    string arrays, ``ValueError`` for a missing field, no tasks, a shape that does not
    fit or a value out of range (:func:`check_task_values`, naming the first bad task).
    """
    if not isinstance(indices, (dict, np.lib.npyio.NpzFile)) and not hasattr(indices, "keys"):
        raise TypeError(f"task indices must be a dict of arrays, got {type(indices).__name__}")
    for key in ("support", "support_labels", "query", "query_labels"):
        if key not in indices:
            raise ValueError(f"task indices: missing field {key!r}")
    if np.shape(indices["support"])[:1] == (0,) or np.shape(indices["query"])[:1] == (0,):
        raise ValueError("task indices: hold no tasks (the arrays have 0 rows)")
    out = dict(indices)
    for key in ("support", "query"):
        out[key] = as_index_array(indices[key], f"task indices: {key!r}", n_rows, ndim=2)
    support, query = out["support"], out["query"]
    if support.shape[0] != query.shape[0]:
        raise ValueError(
            f"task indices: 'support' {support.shape} and 'query' {query.shape} hold "
            "different numbers of tasks"
        )
    for key, ref in (("support_labels", support), ("query_labels", query)):
        labels = as_label_array(indices[key], f"task indices: {key!r}")
        if labels.shape != ref.shape:
            raise ValueError(
                f"task indices: {key!r} must have the shape of "
                f"{key.removesuffix('_labels')!r} {ref.shape}, got {labels.shape}"
            )
        out[key] = labels
    open_set = OPEN_FIELD in indices
    way = check_task_values(
        "task indices",
        support,
        out["support_labels"],
        query,
        out["query_labels"],
        n_rows,
        open_set=open_set,
    )
    if open_set:
        open_classes = as_label_array(indices[OPEN_FIELD], f"task indices: {OPEN_FIELD!r}")
        if open_classes.ndim != 2 or open_classes.shape[0] != support.shape[0]:
            raise ValueError(
                f"task indices: {OPEN_FIELD!r} must be [T, J] with T={support.shape[0]}, "
                f"got shape {open_classes.shape}"
            )
        if open_classes.shape[1] == 0:
            raise ValueError(f"task indices: {OPEN_FIELD!r} names no open class (J = 0)")
        out[OPEN_FIELD] = open_classes
    if "classes" in indices:
        classes = as_label_array(indices["classes"], "task indices: 'classes'")
        if classes.shape != (support.shape[0], way):
            raise ValueError(
                f"task indices: 'classes' must be [T, way]={(support.shape[0], way)}, "
                f"got {classes.shape}"
            )
        out["classes"] = classes
    return out


def dense_memory_limit() -> int | None:
    """The default bound on the dense task tensors that
    :func:`~probfsl.data.tasks.episodes_from_indices` and
    :func:`~probfsl.data.tasks.sample_episodes` make at once: half the physical memory,
    in bytes (``None`` where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, ValueError, OSError):
        return None


def check_dense_size(
    n_tasks: int,
    rows: int,
    dim: int,
    dtype: torch.dtype,
    source_dtype: torch.dtype | None = None,
    max_bytes: int | None = None,
    what: str = "episodes_from_indices",
) -> int:
    """Bytes of ``n_tasks`` dense tasks of ``rows`` rows (support and query) and ``dim``
    features in ``dtype`` (plus the gathered copy in ``source_dtype`` when the features
    are cast); ``ValueError`` before anything is allocated when they exceed ``max_bytes``
    (default :func:`dense_memory_limit`), saying how to make the tasks a batch at a time.
    """
    if max_bytes is not None:
        max_bytes = check_count("max_bytes", max_bytes)
    bound = dense_memory_limit() if max_bytes is None else max_bytes
    per_row = dim * torch.finfo(dtype).bits // 8
    if source_dtype is not None and source_dtype != dtype:
        per_row += dim * torch.finfo(source_dtype).bits // 8
    need = n_tasks * rows * per_row
    if bound is not None and need > bound:
        limit = "max_bytes" if max_bytes is not None else "half the physical memory"
        if what == "sample_episodes":
            stream = (
                "sample them a batch at a time, sample_episodes(fs, 1000, ..., start=s) "
                "for s in range(0, n_tasks, 1000) (task t depends only on the seed and t; "
                "`probfsl run` does so)"
            )
        else:
            stream = (
                "make them a batch at a time with probfsl.data.tasks.iter_episodes(fs, "
                "tasks, batch_size=1000) (a task file's path or a dict of indices; "
                "`probfsl run --task-file` streams the same way)"
            )
        raise ValueError(
            f"{what}: {n_tasks:,} tasks of {rows} rows x {dim} features need "
            f"{_size(need)} as {str(dtype).removeprefix('torch.')} tensors, more than "
            f"{_size(bound)} ({limit}); {stream}, or pass a larger max_bytes"
        )
    return need


def _size(n_bytes: int) -> str:
    """``n_bytes`` for people: GiB above one GiB, else MiB."""
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:,.1f} GiB"
    return f"{n_bytes / 2**20:,.1f} MiB"


def gather_episodes(
    fs: FeatureSet,
    indices: dict[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> Episodes:
    """The tensors of task indices already checked by :func:`check_task_indices` (int64
    arrays, rows in range): no check and no bound on the size (the callers make sure)."""
    device = as_device(device)
    support, query = indices["support"], indices["query"]
    support_labels = indices["support_labels"]
    way = int(support_labels[0].max()) + 1
    if "classes" in indices:
        classes = indices["classes"]
    else:
        # first support position of each class (argmax of a boolean finds the first True)
        first = (support_labels[:, None, :] == np.arange(way)[None, :, None]).argmax(-1)
        classes = fs.labels[np.take_along_axis(support, first, 1)]
    feats = torch.as_tensor(fs.features)
    # one [T, S + Q, D] buffer: support and query are adjacent views (Episodes.points)
    points = feats[torch.as_tensor(np.concatenate([support, query], 1))].to(dtype)
    support_rows, query_rows = points.split([support.shape[1], query.shape[1]], 1)
    episodes = Episodes(
        support=support_rows,
        support_labels=torch.as_tensor(support_labels),
        query=query_rows,
        query_labels=torch.as_tensor(indices["query_labels"]),
        classes=torch.as_tensor(classes),
        support_index=torch.as_tensor(support),
        query_index=torch.as_tensor(query),
    )
    return episodes if device.type == "cpu" else episodes.to(device)
