"""Explicit task files, read without loading them whole and checked in one pass.

A task file is an ``.npz`` of integer arrays: ``support`` [T, S] and ``query`` [T, Q]
(rows of the feature file), ``support_labels`` [T, S] and ``query_labels`` [T, Q]
(task-local labels ``0..way-1``) and optionally ``classes`` [T, way] (the data-set
label of each task-local class); :func:`probfsl.data.tasks.save_task_file` writes one.
A file with ``open_classes`` [T, J] (the data-set labels of each task's open classes)
holds open-set tasks, whose queries labelled ``way`` are open
(:mod:`probfsl.data.open_set`).

:class:`TaskFile` opens one by reading only the array headers, so that a file of
millions of tasks costs nothing to open and a malformed one (a missing field, no tasks,
float values, arrays that do not agree) is refused at once. Arrays stored uncompressed
(``numpy.savez``) are memory-mapped; compressed ones (``numpy.savez_compressed``) are
read once, in chunks. :meth:`TaskFile.check` then passes over the values a block of
tasks at a time (vectorised, optionally with a progress display), and
:meth:`TaskFile.episodes` makes any range of tasks into :class:`Episodes`, so that
memory does not grow with the number of tasks::

    task_file = TaskFile("tasks.npz")
    for batch in iter_episodes(fs, task_file, batch_size=1000):
        proba = model.predict_proba(batch)

Every problem is a ``ValueError`` that starts with the file's name (``TaskFile(path,
name=...)`` chooses the name, as ``probfsl run`` does with ``--task-file PATH``).
"""

from __future__ import annotations

import os
import zipfile
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
    check_task_values,
    gather_episodes,
)
from probfsl.data.open_set import check_open_rows
from probfsl.progress import progress as progress_display
from probfsl.validation import as_device, check_count, check_float_dtype

__all__ = ["TaskFile", "TaskFileTypeError", "CHECK_BLOCK"]

#: tasks checked at once by :meth:`TaskFile.check` (a block's arrays are a few tens of MB)
CHECK_BLOCK = 1 << 15

REQUIRED = ("support", "support_labels", "query", "query_labels")

#: bytes read at once from a compressed array
_READ_CHUNK = 1 << 24


class TaskFileTypeError(ValueError, TypeError):
    """A task-file field that does not hold integers (both a ``ValueError``, as every
    problem of a task file, and a ``TypeError``, as for in-memory indices)."""


@dataclass(frozen=True)
class _Member:
    """One ``.npy`` array of the ``.npz``: where it is and what its header says."""

    info: zipfile.ZipInfo
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    header_size: int


class TaskFile:
    """An explicit task file, opened by reading its array headers only.

    ``ValueError`` naming the file (``name``, default the path) for a missing or
    unreadable file, a missing field, fields that are not 2-D or do not agree in their
    number of tasks or shapes, a file of zero tasks or of tasks without support or query
    rows; a field of non-integers raises :class:`TaskFileTypeError`. Values are checked
    by :meth:`check` (also called by :attr:`way`, :attr:`shape` and :meth:`episodes`).

    Attributes:
        path: the file.
        name: how errors name it.
        n_tasks, n_support, n_query: T, S and Q.
    """

    def __init__(self, path: str | os.PathLike, name: str | None = None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        self.name = str(path) if name is None else str(name)
        self._members = self._read_headers()
        self._check_structure()
        self.n_tasks, self.n_support = self._members["support"].shape
        self.n_query = self._members["query"].shape[1]
        self._arrays: dict[str, np.ndarray] = {}
        self._way: int | None = None
        self._max_row: int | None = None
        self._n_open = 0.0
        self._open_rows_checked = False

    # ------------------------------------------------------------------ headers
    def _read_headers(self) -> dict[str, _Member]:
        """Every ``.npy`` member's header (no array data is read)."""
        if not self.path.is_file():
            raise ValueError(f"{self.name}: not a readable task file (no such file)")
        members = {}
        try:
            with zipfile.ZipFile(self.path) as zf:
                for info in zf.infolist():
                    if not info.filename.endswith(".npy"):
                        continue
                    with zf.open(info) as f:
                        version = np.lib.format.read_magic(f)
                        if version == (1, 0):
                            header = np.lib.format.read_array_header_1_0(f)
                        elif version == (2, 0):
                            header = np.lib.format.read_array_header_2_0(f)
                        else:
                            raise ValueError(f"unsupported .npy format version {version}")
                        shape, fortran_order, dtype = header
                        members[info.filename.removesuffix(".npy")] = _Member(
                            info, tuple(shape), np.dtype(dtype), bool(fortran_order), f.tell()
                        )
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise ValueError(f"{self.name}: not a readable task file ({err})") from err
        return members

    def _check_structure(self) -> None:
        """Fields, dtypes and shapes, from the headers alone."""
        found = sorted(self._members)
        for key in REQUIRED:
            if key not in self._members:
                raise ValueError(f"{self.name}: task file has no field {key!r} (found {found})")
        fields = [k for k in TASK_FIELDS if k in self._members]
        for key in fields:
            member = self._members[key]
            if member.dtype.kind not in "iu":
                raise TaskFileTypeError(
                    f"{self.name}: task file field {key!r} must hold integers, got {member.dtype}"
                )
            if len(member.shape) != 2:
                raise ValueError(
                    f"{self.name}: task file field {key!r} must be 2-D [tasks, ...], "
                    f"got shape {member.shape}"
                )
        counts = {key: self._members[key].shape[0] for key in fields}
        if all(count == 0 for count in counts.values()):
            raise ValueError(f"{self.name}: holds no tasks (its arrays have 0 rows)")
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{key!r} {count}" for key, count in counts.items())
            raise ValueError(f"{self.name}: fields hold different numbers of tasks ({listed})")
        for key, ref in (("support_labels", "support"), ("query_labels", "query")):
            shape, ref_shape = self._members[key].shape, self._members[ref].shape
            if shape != ref_shape:
                raise ValueError(
                    f"{self.name}: {key!r} must have the shape of {ref!r} {ref_shape}, got {shape}"
                )
        for key in ("support", "query"):
            if self._members[key].shape[1] == 0:
                raise ValueError(
                    f"{self.name}: tasks have no {key} rows ({key!r} has shape "
                    f"{self._members[key].shape})"
                )
        if self.is_open and self._members[OPEN_FIELD].shape[1] == 0:
            raise ValueError(f"{self.name}: {OPEN_FIELD!r} names no open class (J = 0)")

    @property
    def is_open(self) -> bool:
        """Whether these are open-set tasks (the file has ``open_classes``)."""
        return OPEN_FIELD in self._members

    @property
    def open_way(self) -> int:
        """Open classes per task: J of ``open_classes`` [T, J] (0 for closed tasks)."""
        return self._members[OPEN_FIELD].shape[1] if self.is_open else 0

    # ------------------------------------------------------------------ arrays
    def _array(self, key: str) -> np.ndarray:
        """Field ``key`` as stored: memory-mapped when uncompressed, else read once."""
        if key not in self._arrays:
            member = self._members[key]
            try:
                if member.info.compress_type == zipfile.ZIP_STORED and not member.fortran_order:
                    array = self._memmap(member)
                else:
                    array = self._read(member)
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
                raise ValueError(f"{self.name}: cannot read field {key!r} ({err})") from err
            self._arrays[key] = array
        return self._arrays[key]

    def _memmap(self, member: _Member) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(member.info.header_offset)
            local = f.read(30)  # the local file header; its name and extra field follow
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            raise ValueError("corrupt zip entry")
        name_size = int.from_bytes(local[26:28], "little")
        extra_size = int.from_bytes(local[28:30], "little")
        offset = member.info.header_offset + 30 + name_size + extra_size + member.header_size
        return np.memmap(self.path, member.dtype, "r", offset, member.shape)

    def _read(self, member: _Member) -> np.ndarray:
        """A compressed (or Fortran-ordered) array, read in chunks (no second copy)."""
        out = np.empty(member.shape[::-1] if member.fortran_order else member.shape, member.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        with zipfile.ZipFile(self.path) as zf, zf.open(member.info) as f:
            f.read(member.header_size)
            done = 0
            while done < len(view):
                n = f.readinto(view[done : done + _READ_CHUNK])
                if not n:
                    raise ValueError("the array's data end early")
                done += n
        return out.T if member.fortran_order else out

    def _block(self, start: int, stop: int, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Tasks ``start .. stop-1`` of fields ``keys`` as int64 copies (never a view of the
        read-only map, which tensors must not share)."""
        return {key: np.array(self._array(key)[start:stop], dtype=np.int64) for key in keys}

    # ------------------------------------------------------------------ checks
    def check(
        self, n_rows: int | None = None, progress: bool = False, labels: np.ndarray | None = None
    ) -> TaskFile:
        """Check the values of every task, a block of :data:`CHECK_BLOCK` tasks at a time
        (:func:`probfsl.data.episodes.check_task_values`); returns ``self``.

        Rows must be ``>= 0`` and, when ``n_rows`` is given, below it (the number of rows
        of the features); every task's support holds each class ``0..way-1`` (the same
        way for every task, at least 2) and its queries lie in ``0..way-1``; ``classes``,
        when present, is [T, way]. Open-set tasks (:attr:`is_open`) also have open
        queries, labelled ``way``: at least one per task, beside a closed one; with the
        features' ``labels``, each must be a row of one of its task's ``open_classes``,
        none of which is a known class (:func:`probfsl.data.open_set.check_open_rows`).
        The pass runs once (and once more for ``labels``): later calls only compare
        ``n_rows`` with the largest row seen (and look again only to name a bad task).
        ``progress`` shows the pass (:func:`probfsl.progress.progress`).
        """
        if n_rows is not None:
            n_rows = check_count("n_rows", n_rows)
        if self._way is None:
            way, max_row, n_open = None, -1, 0
            with progress_display(self.n_tasks, "task file", "tasks", progress) as bar:
                for start in range(0, self.n_tasks, CHECK_BLOCK):
                    stop = min(start + CHECK_BLOCK, self.n_tasks)
                    block = self._block(start, stop, REQUIRED)
                    way = check_task_values(
                        self.name, **block, n_rows=n_rows, way=way, first=start,
                        open_set=self.is_open,
                    )  # fmt: skip
                    max_row = max(max_row, int(block["support"].max()), int(block["query"].max()))
                    n_open += int((block["query_labels"] == way).sum()) if self.is_open else 0
                    bar.update(stop - start)
            if "classes" in self._members and self._members["classes"].shape[1] != way:
                raise ValueError(
                    f"{self.name}: 'classes' must be [T, way]={(self.n_tasks, way)}, "
                    f"got {self._members['classes'].shape}"
                )
            self._way, self._max_row, self._n_open = way, max_row, n_open / self.n_tasks
        elif n_rows is not None and self._max_row >= n_rows:
            for start in range(0, self.n_tasks, CHECK_BLOCK):  # find the task to name
                block = self._block(start, start + CHECK_BLOCK, REQUIRED)
                check_task_values(
                    self.name, **block, n_rows=n_rows, way=self._way, first=start,
                    open_set=self.is_open,
                )  # fmt: skip
        if labels is not None and self.is_open and not self._open_rows_checked:
            keys = (*REQUIRED, OPEN_FIELD)
            for start in range(0, self.n_tasks, CHECK_BLOCK):
                block = self._block(start, start + CHECK_BLOCK, keys)
                check_open_rows(self.name, labels, block, first=start)
            self._open_rows_checked = True
        return self

    @property
    def way(self) -> int:
        """Classes per task (checks the values first, :meth:`check`)."""
        return self.check()._way

    @property
    def shape(self) -> tuple[int, int, int]:
        """(way, shot, queries) of the tasks; shot is S // way and the queries are all Q,
        open ones included."""
        way = self.way
        return way, self.n_support // way, self.n_query

    @property
    def n_open(self) -> float:
        """Open queries per task, on average over the tasks (0 for closed tasks); checks
        the values first (:meth:`check`)."""
        return self.check()._n_open

    def __len__(self) -> int:
        return self.n_tasks

    def __repr__(self) -> str:
        return (
            f"TaskFile({self.name!r}: {self.n_tasks:,} tasks of {self.n_support} support "
            f"and {self.n_query} query rows)"
        )

    # ------------------------------------------------------------------ tasks
    def _range(self, start: int, stop: int | None) -> tuple[int, int]:
        start = check_count("start", start, low=0)
        stop = self.n_tasks if stop is None else min(check_count("stop", stop), self.n_tasks)
        if start >= stop:
            raise ValueError(f"{self.name}: no tasks in {start}..{stop - 1} of {self.n_tasks}")
        return start, stop

    def indices(self, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
        """Tasks ``start .. stop-1`` (default all) as int64 arrays, after :meth:`check`."""
        self.check()
        start, stop = self._range(start, stop)
        return self._block(start, stop, tuple(k for k in TASK_FIELDS if k in self._members))

    def extra_fields(self) -> dict[str, np.ndarray]:
        """The file's arrays other than the task fields, as stored."""
        extra = {}
        with np.load(self.path, allow_pickle=False) as npz:
            for key in self._members:
                if key not in TASK_FIELDS:
                    extra[key] = npz[key]
        return extra

    def episodes(
        self,
        fs: Any,
        start: int = 0,
        stop: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        max_bytes: int | None = None,
    ) -> Episodes:
        """Tasks ``start .. stop-1`` (default all) as :class:`Episodes` of the features of
        ``fs``, in ``dtype`` on ``device``; the rows are checked against ``fs`` first.

        Made at once, so refused before anything is allocated when the tensors would
        exceed ``max_bytes`` (:func:`probfsl.data.episodes.check_dense_size`); a loop over
        ranges, or :func:`probfsl.data.tasks.iter_episodes`, keeps memory flat. As
        ``evaluate_stream``'s batches::

            evaluate_stream({"model": model}, lambda a, b: task_file.episodes(fs, a, b),
                            len(task_file))
        """
        from probfsl.data.featureset import FeatureSet

        if not isinstance(fs, FeatureSet):
            raise TypeError(f"fs must be a FeatureSet, got {type(fs).__name__}")
        check_float_dtype("dtype", dtype)
        device = as_device(device)
        self.check(len(fs.labels), labels=fs.labels)
        start, stop = self._range(start, stop)
        source = torch.as_tensor(fs.features[:0]).dtype
        rows = self.n_support + self.n_query
        check_dense_size(stop - start, rows, fs.dim, dtype, source, max_bytes, self.name)
        return gather_episodes(fs, self.indices(start, stop), dtype, device)
