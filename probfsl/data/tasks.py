"""Few-shot and zero-shot task sampling (protocol in the README, after Veilleux et al. 2021).

Task ``t`` of a run with seed ``s`` is drawn from ``numpy.random.default_rng([s, t])``,
so the first tasks of a run do not depend on how many tasks are asked for.

Every entry point checks its arguments through :mod:`probfsl.validation` before
sampling or gathering anything: ``TypeError`` for a wrong type, ``ValueError`` naming
the argument for an impossible value.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet
from probfsl.data.open_set import add_open_queries, check_open_setting, refuse_open_tasks
from probfsl.fileio import atomic_path
from probfsl.validation import (
    FLOAT_DTYPES,
    as_device,
    as_index_array,
    as_label_array,
    check_choice,
    check_count,
    check_float_dtype,
    check_hyperparameter,
)

BALANCES = ("balanced", "dirichlet")


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
        buffer (as :func:`episodes_from_indices` and :meth:`to` lay them out), so that a
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


def dirichlet_query_counts(
    rng: np.random.Generator, way: int, n_query: int, alpha: float, room: np.ndarray
) -> np.ndarray:
    """Per-class query counts of the unbalanced protocol (Veilleux et al. 2021).

    p ~ Dirichlet(alpha * 1_K); counts = round(Q p); while the counts do not sum to Q,
    the entry whose fractional part of Q p is closest to 1/2 is floored (sum too large)
    or ceiled (too small). Counts above ``room`` (samples left in the class) are capped
    and the surplus goes, one query at a time, to the class with room that is furthest
    below its target Q p_k.
    """
    target = n_query * rng.dirichlet(np.full(way, float(alpha)))
    counts = np.floor(target + 0.5).astype(np.int64)
    frac = target - np.floor(target)
    while counts.sum() != n_query:
        too_many = counts.sum() > n_query
        # floor only entries that were rounded up, ceil only those rounded down
        movable = counts > np.floor(target) if too_many else counts < np.ceil(target)
        k = np.flatnonzero(movable)[np.argmin(np.abs(frac[movable] - 0.5))]
        counts[k] += -1 if too_many else 1
    over = np.maximum(counts - room, 0)
    counts -= over
    for _ in range(int(over.sum())):
        open_ = np.flatnonzero(counts < room)
        k = open_[np.argmax(target[open_] - counts[open_])]
        counts[k] += 1
    return counts


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
) -> int:
    """Check the values of a block of tasks (int64 arrays ``[B, S]``, ``[B, S]``,
    ``[B, Q]``, ``[B, Q]``) whose first task is number ``first``; returns the way.

    Rows must lie in ``0..n_rows-1`` (only ``>= 0`` when ``n_rows`` is ``None``); every
    task's support labels must be exactly the classes ``0..way-1`` (each with at least one
    support sample), with ``way >= 2`` and the same for every task (``way`` of earlier
    blocks, or taken from this block's first task when ``None``); query labels must lie
    in ``0..way-1``. ``ValueError`` prefixed by ``name`` that names the first bad task.
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
    if query_labels.min() < 0 or query_labels.max() >= way:
        t = _first((query_labels < 0) | (query_labels >= way))
        values = query_labels[t][(query_labels[t] < 0) | (query_labels[t] >= way)]
        raise ValueError(
            f"{name}: 'query_labels' must lie in 0..{way - 1} (the tasks are {way}-way); "
            f"task {first + t} holds {int(values[0])}"
        )
    return way


def check_task_indices(indices: Any, n_rows: int) -> dict[str, np.ndarray]:
    """Task indices (sampled, or read from a task file) as int64 arrays, checked.

    ``support`` [T, S] and ``query`` [T, Q] are rows in ``0..n_rows-1`` (integers of any
    width: int16/int32 task files are cast to int64); ``support_labels`` [T, S] and
    ``query_labels`` [T, Q] are task-local labels: every task's support holds each class
    ``0..way-1`` (``way`` >= 2, the same for every task) and its queries lie in
    ``0..way-1``; the optional ``classes`` is [T, way]. ``TypeError`` for float or
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
    way = check_task_values(
        "task indices", support, out["support_labels"], query, out["query_labels"], n_rows
    )
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
    """The default bound on the dense task tensors that :func:`episodes_from_indices` and
    :func:`sample_episodes` make at once: half the physical memory, in bytes (``None``
    where the system does not say)."""
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


def episodes_from_indices(
    fs: FeatureSet,
    indices: dict[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    max_bytes: int | None = None,
) -> Episodes:
    """Gather the features of task indices (sampled, or read from a task file) into
    tensors of ``dtype`` on ``device`` (default the CPU).

    ``indices`` is checked by :func:`check_task_indices`. Without ``classes``, the
    data-set class of task-local class k is the label of its first support row.

    Every task is made at once, so a large task set is refused before anything is
    allocated (:func:`check_dense_size`): when its tensors would exceed ``max_bytes``
    (default half the physical memory, :func:`dense_memory_limit`), ``ValueError`` says
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
    indices = check_task_indices(indices, len(fs.labels))
    return gather_episodes(fs, indices, dtype, device)


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
    from probfsl.data.task_files import TaskFile

    _check_featureset(fs)
    batch_size = check_count("batch_size", batch_size)
    check_float_dtype("dtype", dtype)
    device = as_device(device)
    if isinstance(tasks, (str, os.PathLike)):
        tasks = TaskFile(tasks)
    if isinstance(tasks, TaskFile):
        tasks.check(len(fs.labels), progress=progress)
        return _task_file_batches(fs, tasks, batch_size, dtype, device)
    checked = check_task_indices(tasks, len(fs.labels))
    return _index_batches(fs, checked, batch_size, dtype, device)


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


TASK_FIELDS = ("support", "support_labels", "query", "query_labels", "classes")


def save_task_file(path: str | os.PathLike, indices: dict[str, np.ndarray]) -> Path:
    """Write task indices as the protocol's explicit task file (``.npz``); returns its path.

    As :func:`numpy.savez`, ``.npz`` is appended to a path without it. The indices are
    checked first (:func:`check_task_indices`, rows not bounded) and written atomically
    (:func:`probfsl.fileio.atomic_path`): a failure leaves an existing file as it was.
    """
    if not isinstance(indices, dict):
        raise TypeError(f"indices must be a dict of arrays, got {type(indices).__name__}")
    refuse_open_tasks(indices, "save_task_file")
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
    from probfsl.data.task_files import TaskFile

    task_file = TaskFile(path)
    task_file.check()
    return {**task_file.extra_fields(), **task_file.indices()}
