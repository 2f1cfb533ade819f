"""The results store of sweeps: one folder, one row per cell, one tidy table.

Layout of a store folder::

    cells/<key>.json    one cell's row: its options, its result (or error), versions,
                        machine; written atomically when the cell ends
    logs/<key>.log      what the cell's run printed and logged (its traceback if it failed)
    results.parquet     every row as one table (pandas / pyarrow)
    results.csv         the same table as CSV
    order.json          the keys of the last sweep run into the folder, in its order

The rows in ``cells/`` are the store; the tables are made from them (:meth:`write_tables`),
so a sweep killed at any point loses at most the cells that were running, and a killed
table write leaves the previous table in place. A cell is identified by its key
(:meth:`probfsl.sweeps.cell.Cell.key`: its options, its data's content and the code
version): a stored key is a cell that need not run again.

Every row records the ``code_version`` of the code that computed it. A row file that
cannot be read as a row (empty, not UTF-8, not JSON, not a JSON object, a required field
missing or of the wrong type, a ``cell_key`` other than its file's name) is *damaged*:
it is named (:class:`Damaged`), left out of every table, and its cell runs again in the
next sweep that has it, the new row replacing the file. :meth:`ResultsStore.prune`
removes the rows of other code versions, and the damaged files, on request.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from probfsl.fileio import atomic_path, atomic_write_text

log = logging.getLogger("probfsl.sweep")

#: the columns that differ between two runs of the same cell (timing, where it ran):
#: everything else of a row is reproducible
VOLATILE = (
    "seconds",
    "tasks_per_second",
    "tuning_seconds",
    "wall_seconds",
    "finished",
    "machine",
    "gpu",
)
#: the first columns of the tables, in this order (the rest follow as the rows have them)
FIRST = (
    "data", "label", "method", "zero_shot", "way", "shot", "query", "balance", "alpha",
    "seed", "preset", "params", "engine", "tasks", "status", "accuracy", "ci95",
    "baseline", "baseline_accuracy", "baseline_ci95", "error", "code_version",
)  # fmt: skip
#: the order of rows in the tables
SORT = ("data", "label", "zero_shot", "way", "shot", "balance", "alpha", "query", "seed")
#: the statuses a stored row may have
STATUSES = ("ok", "failed")

# the fields every stored row has, and their JSON types ("number": int or float, not bool)
_REQUIRED = {
    "cell_key": "text",
    "status": "text",
    "code_version": "text",
    "data": "text",
    "label": "text",
    "method": "text",
    "zero_shot": "boolean",
    "way": "integer",
    "shot": "integer",
    "query": "integer",
    "balance": "text",
    "seed": "integer",
}
# and those of a row whose cell ran (``status`` "ok")
_REQUIRED_OK = {
    "tasks": "integer",
    "accuracy": "number",
    "ci95": "number",
    "baseline_accuracy": "number",
    "baseline_ci95": "number",
}
_TYPES = {
    "text": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}


def _json_kind(value: object) -> str:
    """The JSON name of a parsed value's type."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    names = {dict: "object", list: "list", str: "string", type(None): "null"}
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Damaged:
    """A file of ``cells/`` that is not a results row: its ``path`` and why not."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: not a results row ({self.reason})"


def _a(kind: str) -> str:
    """``"an integer"``, ``"a string"``, ``"null"``."""
    return kind if kind == "null" else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def row_problem(data: object, key: str | None = None) -> str | None:
    """Why the parsed JSON ``data`` is not a stored row (``None`` when it is one): not an
    object, a required field missing or of the wrong type, an unknown status, or (with
    ``key``, the file's name) another ``cell_key``."""
    if not isinstance(data, dict):
        return f"a JSON {_json_kind(data)}, not an object"
    required = dict(_REQUIRED)
    if data.get("status") == "ok":
        required.update(_REQUIRED_OK)
    missing = [name for name in required if name not in data]
    if missing:
        return f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    for name, kind in required.items():
        value = data[name]
        if not _TYPES[kind](value):
            return f"field {name} is {_a(_json_kind(value))}, expected {_a(kind)}"
    if data["status"] not in STATUSES:
        return f"status {data['status']!r} is not one of {', '.join(STATUSES)}"
    if key is not None and data["cell_key"] != key:
        return f"its cell_key {data['cell_key']!r} is not its file's name"
    return None


def _read_row(path: Path) -> tuple[dict | None, str | None]:
    """``(row, None)`` for a good row file, ``(None, reason)`` for a damaged one."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        return None, f"unreadable: {err.strerror or err}"
    if not raw.strip():
        return None, "empty file"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "binary file, not UTF-8 text"
    if any(ord(c) < 32 and c not in "\t\n\r" for c in text):
        return None, "binary file, not JSON text"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"not JSON: {err}"
    problem = row_problem(data, path.stem)
    return (None, problem) if problem else (data, None)


class ResultsStore:
    """A results folder (:mod:`probfsl.sweeps.store`); created on the first write."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"results store {self.root} is a file; give a folder")

    @property
    def parquet(self) -> Path:
        return self.root / "results.parquet"

    @property
    def csv(self) -> Path:
        return self.root / "results.csv"

    def _cell_path(self, key: str) -> Path:
        return self.root / "cells" / f"{key}.json"

    def scan(self) -> tuple[dict[str, dict], list[Damaged]]:
        """Every row file of ``cells/``: ``({key: row}`` of the good rows, in the order of
        their names, ``[damaged files]``). Hidden files are writes in progress, or left by
        a writer killed before its rename (:func:`~probfsl.fileio.atomic_path`), and are
        no rows."""
        rows: dict[str, dict] = {}
        damaged: list[Damaged] = []
        for path in sorted((self.root / "cells").glob("*.json")):
            if path.name.startswith("."):
                continue
            row, reason = _read_row(path)
            if row is None:
                damaged.append(Damaged(path, reason or "unknown"))
            else:
                rows[path.stem] = row
        return rows, damaged

    def damaged(self) -> list[Damaged]:
        """The files of ``cells/`` that are not results rows (:class:`Damaged`)."""
        return self.scan()[1]

    def stored(self) -> dict[str, str]:
        """``{key: status}`` of every stored row (damaged files left out)."""
        return {key: row["status"] for key, row in self.scan()[0].items()}

    def versions(self) -> Counter:
        """How many stored rows each code version has."""
        return Counter(row["code_version"] for row in self.scan()[0].values())

    def record(self, key: str, row: dict, log: str = "") -> None:
        """Store one cell's ``row`` (and its ``log``), each file atomically; a damaged
        file of the same key is replaced."""
        if log:
            atomic_write_text(self.root / "logs" / f"{key}.log", log)
        text = json.dumps({"cell_key": key, **row}, default=_json_default, allow_nan=True)
        atomic_write_text(self._cell_path(key), text + "\n")

    def rows(self, keys: Iterable[str] | None = None) -> list[dict]:
        """The stored rows (of ``keys`` only, in their order, when given); damaged files
        and keys not stored are left out."""
        if keys is None:
            return list(self.scan()[0].values())
        out = []
        for key in keys:
            path = self._cell_path(key)
            if path.is_file():
                row, _ = _read_row(path)
                if row is not None:
                    out.append(row)
        return out

    def table(self, keys: Iterable[str] | None = None, extra: dict[str, dict] | None = None):
        """The rows as a pandas ``DataFrame``: those of ``keys`` in their order, or every
        stored row sorted by data, method and setting. ``extra``: rows of ``keys`` that
        are not stored (``{key: row}``), shown where the stored one is missing."""
        import pandas as pd

        if keys is not None and extra:
            keys = list(keys)
            stored = {row["cell_key"]: row for row in self.rows(keys)}
            extra = {k: {"cell_key": k, **row} for k, row in extra.items()}
            rows = [stored.get(k, extra.get(k)) for k in keys]
            frame = pd.DataFrame([r for r in rows if r is not None])
        else:
            frame = pd.DataFrame(self.rows(keys))
        if frame.empty:
            return frame
        first = [c for c in FIRST if c in frame.columns]
        frame = frame[first + [c for c in frame.columns if c not in first]]
        if keys is not None:
            return frame
        order = [c for c in SORT if c in frame.columns]
        frame = frame.sort_values(order, kind="stable", na_position="first")
        rank = {key: i for i, key in enumerate(self.order())}
        frame = frame.sort_values(
            "cell_key", key=lambda k: k.map(lambda v: rank.get(v, len(rank))), kind="stable"
        )
        return frame.reset_index(drop=True)

    def order(self) -> list[str]:
        """The keys of the last sweep run into this store, in its order (its cells come
        first in :meth:`table`, as the sweep file lists them); ``[]`` when there is none
        or ``order.json`` is damaged (then the rows keep their sorted order)."""
        path = self.root / "order.json"
        if not path.is_file():
            return []
        try:
            keys = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            keys = None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            log.warning("%s: not a list of cell keys; rows are listed in sorted order", path)
            return []
        return keys

    def set_order(self, keys: list[str]) -> None:
        atomic_write_text(self.root / "order.json", json.dumps(keys) + "\n")

    def write_tables(self) -> None:
        """``results.parquet`` and ``results.csv`` from every stored row (atomically)."""
        frame = self.table()
        if frame.empty:
            return
        with atomic_path(self.parquet) as tmp:
            frame.to_parquet(tmp, index=False)
        with atomic_path(self.csv) as tmp:
            frame.to_csv(tmp, index=False)

    def prune(self, keep: str) -> tuple[Counter, list[Damaged]]:
        """Remove the rows whose code version is not ``keep`` (and their logs) and the
        damaged files of ``cells/``; rewrite the tables. Returns ``(rows removed per code
        version, damaged files removed)``."""
        rows, damaged = self.scan()
        removed: Counter = Counter()
        for key, row in rows.items():
            if row["code_version"] != keep:
                self._cell_path(key).unlink(missing_ok=True)
                (self.root / "logs" / f"{key}.log").unlink(missing_ok=True)
                removed[row["code_version"]] += 1
        for bad in damaged:
            bad.path.unlink(missing_ok=True)
        if removed or damaged:
            self.write_tables()
        return removed, damaged


def _json_default(value):
    """What ``json`` cannot write itself: numpy scalars as numbers, the rest as text."""
    return value.item() if hasattr(value, "item") else str(value)


def read_results(path: str | Path) -> tuple:
    """``(table, problems)`` from a store folder, a ``.parquet`` or a ``.csv`` file:
    the results table (a pandas ``DataFrame``) and one line per problem met on the way
    (a damaged row file, named; a table file that could not be read and was rebuilt from
    the rows of ``cells/``). A problem that leaves nothing to read is a ``ValueError``
    naming the file."""
    path = Path(path)
    if path.is_dir():
        store = ResultsStore(path)
        rows, damaged = store.scan()
        problems = [f"{bad}; left out" for bad in damaged]
        if not rows:
            why = f" ({len(damaged)} damaged row files)" if damaged else ""
            raise ValueError(f"{path}: no stored cells{why} (is it a sweep's results folder?)")
        return store.table(), problems
    if path.suffix not in (".parquet", ".csv") or not path.is_file():
        raise ValueError(f"{path}: not a results folder, .parquet or .csv file")
    try:
        frame = _read_file(path)
    except Exception as err:  # any reader error: the file is not a table
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        store = ResultsStore(path.parent)
        if path.name in (store.parquet.name, store.csv.name) and store.scan()[0]:
            store.write_tables()
            note = f"{path}: not a readable table ({reason}); rebuilt from {store.root / 'cells'}"
            table, problems = read_results(store.root)
            return table, [note, *problems]
        raise ValueError(f"{path}: not a readable results table ({reason})") from None
    if frame.empty or "status" not in frame.columns:
        raise ValueError(f"{path}: not a results table (no rows with a status column)")
    return frame, []


def _read_file(path: Path):
    import pandas as pd

    if path.suffix == ".parquet":
        return pd.read_parquet(path)
    return pd.read_csv(path)


def read_table(path: str | Path):
    """A results table from a store folder, a ``.parquet`` or a ``.csv`` file
    (:func:`read_results`; its problems are logged as warnings)."""
    table, problems = read_results(path)
    for problem in problems:
        log.warning("%s", problem)
    return table


def stable_columns(frame) -> list[str]:
    """The columns of ``frame`` that a rerun of the same cells reproduces
    (all but :data:`VOLATILE`): what two runs of one sweep are compared on."""
    return [c for c in frame.columns if c not in VOLATILE]
