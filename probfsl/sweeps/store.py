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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from probfsl.fileio import atomic_path, atomic_write_text

#: the columns that differ between two runs of the same cell (timing, where it ran):
#: everything else of a row is reproducible
VOLATILE = (
    "seconds",
    "tasks_per_second",
    "wall_seconds",
    "finished",
    "machine",
    "gpu",
)
#: the first columns of the tables, in this order (the rest follow as the rows have them)
FIRST = (
    "data", "label", "method", "zero_shot", "way", "shot", "query", "balance", "alpha",
    "seed", "preset", "params", "engine", "tasks", "status", "accuracy", "ci95",
    "baseline", "baseline_accuracy", "baseline_ci95", "error",
)  # fmt: skip
#: the order of rows in the tables
SORT = ("data", "label", "zero_shot", "way", "shot", "balance", "alpha", "query", "seed")


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

    def stored(self) -> dict[str, str]:
        """``{key: status}`` of every stored cell."""
        out = {}
        for path in sorted((self.root / "cells").glob("*.json")):
            out[path.stem] = json.loads(path.read_text()).get("status", "ok")
        return out

    def record(self, key: str, row: dict, log: str = "") -> None:
        """Store one cell's ``row`` (and its ``log``), each file atomically."""
        if log:
            atomic_write_text(self.root / "logs" / f"{key}.log", log)
        text = json.dumps({"cell_key": key, **row}, default=_json_default, allow_nan=True)
        atomic_write_text(self._cell_path(key), text + "\n")

    def rows(self, keys: Iterable[str] | None = None) -> list[dict]:
        """The stored rows (of ``keys`` only, when given)."""
        paths = (
            sorted((self.root / "cells").glob("*.json"))
            if keys is None
            else [self._cell_path(k) for k in keys]
        )
        return [json.loads(p.read_text()) for p in paths if p.is_file()]

    def table(self, keys: Iterable[str] | None = None):
        """The rows as a pandas ``DataFrame``: those of ``keys`` in their order, or every
        stored row sorted by data, method and setting."""
        import pandas as pd

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
        first in :meth:`table`, as the sweep file lists them)."""
        path = self.root / "order.json"
        return json.loads(path.read_text()) if path.is_file() else []

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


def _json_default(value):
    """What ``json`` cannot write itself: numpy scalars as numbers, the rest as text."""
    return value.item() if hasattr(value, "item") else str(value)


def read_table(path: str | Path):
    """A results table from a store folder, a ``.parquet`` or a ``.csv`` file."""
    import pandas as pd

    path = Path(path)
    if path.is_dir():
        frame = ResultsStore(path).table()
        if frame.empty:
            raise ValueError(f"{path}: no stored cells (is it a sweep's results folder?)")
        return frame
    if path.suffix == ".parquet" and path.is_file():
        return pd.read_parquet(path)
    if path.suffix == ".csv" and path.is_file():
        return pd.read_csv(path)
    raise ValueError(f"{path}: not a results folder, .parquet or .csv file")


def stable_columns(frame) -> list[str]:
    """The columns of ``frame`` that a rerun of the same cells reproduces
    (all but :data:`VOLATILE`): what two runs of one sweep are compared on."""
    return [c for c in frame.columns if c not in VOLATILE]
