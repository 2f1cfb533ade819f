"""Result tables: printed, markdown, JSON and CSV."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

COLUMNS = ("method", "dataset", "way", "shot", "balance", "accuracy", "ci95", "tasks_per_second")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1e4 else f"{value:.3g}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """A GitHub markdown table of ``rows`` (dicts), one column per key in ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def text_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """A plain aligned table for the terminal."""
    cells = [list(columns)] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_results(rows: Sequence[dict], path: str | Path) -> None:
    """Write ``rows`` as JSON (``.json``: one object if one row, else a list) or CSV (``.csv``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        payload = rows[0] if len(rows) == 1 else list(rows)
        path.write_text(json.dumps(payload, indent=2) + "\n")
    else:
        raise ValueError(f"--out must end in .json or .csv, got {path}")
