"""Result tables: printed, markdown, JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from probfsl.fileio import atomic_write_text, check_writable

COLUMNS = (
    "method",
    "dataset",
    "way",
    "shot",
    "balance",
    "accuracy",
    "ci95",
    "baseline_accuracy",
    "baseline_ci95",
    "ece",
    "nll",
    "brier",
    "tasks_per_second",
)


#: columns shown with three decimals (calibration metrics are fractions or nats)
FINE = ("ece", "adaptive_ece", "nll", "brier", "temperature")


def _fmt(value, column: str = "") -> str:
    if isinstance(value, float):
        if column.removesuffix("_ci95") in FINE:
            return f"{value:.3f}"
        return f"{value:.2f}" if abs(value) < 1e4 else f"{value:.3g}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """A GitHub markdown table of ``rows`` (dicts), one column per key in ``columns``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, ""), c) for c in columns) + " |")
    return "\n".join(lines)


def text_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """A plain aligned table for the terminal."""
    cells = [list(columns)] + [[_fmt(r.get(c, ""), c) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_results(rows: Sequence[dict], path: str | Path) -> None:
    """Write ``rows`` as JSON (``.json``: one object if one row, else a list) or CSV (``.csv``).

    The write is atomic (:func:`probfsl.fileio.atomic_path`): a failure leaves an
    existing file unchanged.
    """
    path = check_writable(path, (".json", ".csv"))
    if path.suffix.lower() == ".csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        buffer = io.StringIO(newline="")
        writer = csv.DictWriter(buffer, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
        text = buffer.getvalue()
    else:
        payload = rows[0] if len(rows) == 1 else list(rows)
        text = json.dumps(payload, indent=2) + "\n"
    atomic_write_text(path, text)
