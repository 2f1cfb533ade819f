"""The report of a sweep: tables and figures made from its results table.

:func:`write_report` writes ``report.md`` and ``report.html`` (the same content) and the
figures into one folder:

- a header: how many cells, how many ran (``ok``) or failed, the code and torch versions
  and the machines present;
- the method table (:func:`method_table`): one row per task setting (data set, way, shot,
  balance; query when it varies), one column per method, each cell the accuracy in percent
  with its 95% half-width, and the baseline of the setting (the nearest-centroid or argmax
  rule on the same tasks). A method whose 95% interval lies entirely under the baseline's
  is marked **below**; the most accurate method of each setting is marked *best*;
- the calibration table (:func:`calibration_table`): ECE, NLL and Brier score of the
  few-shot settings;
- where cells ran open-set tasks (the grid's ``open`` axis), the open-set table
  (:func:`open_set_table`): closed accuracy, AUROC, AUPR, precision at 90% recall and
  ECE-open of each method, with the k-NN distance and maximum softmax baselines;
- the throughput table (:func:`throughput_table`): tasks per second, the median over the
  cells of each method on each device;
- the failed cells and their errors (:func:`failures_table`);
- figures (:func:`write_figures`, with matplotlib): ``accuracy.png``, ``calibration.png``
  and ``throughput.png``.

Pooling over seeds (:func:`pooled`): the cells of one data set, method and setting that
differ only in their seed are pooled. With ``T_i`` tasks, value ``a_i`` and 95% half-width
``c_i`` in seed ``i``, and weights ``w_i = T_i / sum_j T_j``, the pooled value is
``sum_i w_i a_i`` (the mean over all tasks) and its half-width
``sqrt(sum_i (w_i c_i)^2)`` (the seeds' task sets are independent, so the variances of
their means add). The same rule pools the baseline, ECE, NLL and Brier columns (each
over the seeds where it is present). A method (a "variant") is its ``label``, with its
preset, engine, parameters, calibration or dtype added to its name where one label ran
several of them.

One code version at a time (:func:`select_version`): every row records the
``code_version`` that computed it, and the rows of two versions are never pooled into one
number (:func:`pooled` refuses them). :func:`write_report` reports the rows of one
version: the one asked for, else the installed code's version where the table has rows
of it, else the version of the most recently written rows (the latest ``finished``
time; without times, the version of the table's last row). How many rows of other
versions it left out, and which, is said in the report's header and logged.
"""

from __future__ import annotations

import html
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from probfsl.fileio import atomic_path, atomic_write_text

log = logging.getLogger("probfsl.sweep")

#: the columns every results table needs (failed cells have them too)
IDENTITY = ("status", "data", "label", "zero_shot", "way", "shot", "query", "balance", "seed")
#: the columns needed as soon as one cell ran
RESULTS = ("tasks", "accuracy", "ci95", "baseline", "baseline_accuracy", "baseline_ci95")
#: what makes a task setting: the tasks drawn (with the seed) or read from a task file,
#: hence also the baseline
SETTING = (
    "data", "zero_shot", "way", "shot", "query", "balance", "alpha", "open_queries", "task_file",
)  # fmt: skip
SETTING_EXTRA = ("min_classes", "max_classes")
#: what makes a method variant (``label`` first)
VARIANT = ("label", "method", "preset", "params", "engine", "calibrate", "dtype", "episodes")
#: (value, 95% half-width) columns pooled over seeds
METRICS = (
    ("accuracy", "ci95"),
    ("baseline_accuracy", "baseline_ci95"),
    ("ece", "ece_ci95"),
    ("nll", "nll_ci95"),
    ("brier", "brier_ci95"),
    *((m, f"{m}_ci95") for m in ("auroc", "aupr", "prec_at_90_recall", "ece_open")),
    *(
        (f"{b}_{m}", f"{b}_{m}_ci95")
        for b in ("knn", "msp")
        for m in ("auroc", "aupr", "prec_at_90_recall")
    ),
)
#: the open-set columns of :func:`open_set_table`: (heading, value column)
OPEN_COLUMNS = (
    ("accuracy", "accuracy"),
    ("AUROC", "auroc"),
    ("AUPR", "aupr"),
    ("P@90R", "prec_at_90_recall"),
    ("ECE-open", "ece_open"),
)
#: text columns of a pooled row: the distinct values of its cells, joined by "; "
TEXTS = (
    "baseline",
    "ran_preset",
    "method_run",
    "open_note",
    "device",
    "gpu",
    "machine",
    "probfsl_version",
    "code_version",
    "torch_version",
)
FORMATS = ("markdown", "html")
FIGURES_HINT = (
    'Figures need matplotlib: `pip install -c constraints.txt -e ".[plots]"` '
    "(from a clone of probfsl)."
)
DPI = 110

_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:80em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}"
    "th{background:#f2f2f2}td.best{background:#e6f4ea}strong{color:#b00020}"
    "img{max-width:100%;display:block;margin:1em 0}"
)


# --- checks and pooling -------------------------------------------------------------------


def _check(table: pd.DataFrame) -> None:
    if not isinstance(table, pd.DataFrame):
        raise ValueError(f"a results table must be a pandas DataFrame, got {type(table)}")
    if table.empty:
        raise ValueError("the results table is empty: no cells to report")
    missing = [c for c in IDENTITY if c not in table.columns]
    if "status" in table.columns and (table["status"] == "ok").any():
        missing += [c for c in RESULTS if c not in table.columns]
    if missing:
        raise ValueError(f"the results table is missing required columns: {', '.join(missing)}")


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _missing(value) -> bool:
    return value is None or (not isinstance(value, str) and bool(pd.isna(value)))


def _numbers(frame: pd.DataFrame, column: str) -> np.ndarray:
    if column not in frame.columns:
        return np.full(len(frame), np.nan)
    return pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=float)


def _distinct(values) -> str:
    texts = [str(v) for v in values if not _missing(v) and str(v) != ""]
    return "; ".join(dict.fromkeys(texts))


def _pool(values: np.ndarray, halves: np.ndarray, tasks: np.ndarray) -> tuple[float, float]:
    """Task-weighted mean of ``values`` and the half-width of independent means."""
    valid = ~np.isnan(values)
    if not valid.any():
        return math.nan, math.nan
    weights = tasks[valid] / tasks[valid].sum()
    value = float(weights @ values[valid])
    half = float(np.sqrt(np.sum((weights * halves[valid]) ** 2)))
    return value, half


def _ok(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["status"] == "ok"]


#: the name of a row's version where its ``code_version`` is missing
UNKNOWN_VERSION = "unknown"


def _versions(frame: pd.DataFrame) -> pd.Series:
    """Each row's code version as text (:data:`UNKNOWN_VERSION` where missing)."""
    return frame["code_version"].map(lambda v: UNKNOWN_VERSION if _missing(v) else str(v))


def _check_one_version(group: pd.DataFrame, what: str) -> None:
    """Refuse to pool ``group`` when its rows hold more than one code version."""
    if "code_version" not in group.columns:
        return
    versions = list(dict.fromkeys(_versions(group)))
    if len(versions) > 1:
        raise ValueError(
            f"{what}: rows of code versions {', '.join(versions)} would be pooled into one "
            "number; report one version at a time (select_version)"
        )


@dataclass(frozen=True)
class VersionChoice:
    """The code version a report shows (:func:`select_version`): ``version`` (``None``
    where the table has no ``code_version`` column), why that one (``reason``) and the
    rows of other versions left out (``left_out``, rows per version)."""

    version: str | None
    reason: str
    left_out: dict[str, int]

    def note(self) -> str | None:
        """One sentence on the rows left out (``None`` when none was)."""
        if not self.left_out:
            return None
        n = sum(self.left_out.values())
        counts = ", ".join(f"{v}: {_rows(c)}" for v, c in self.left_out.items())
        other = "another code version" if len(self.left_out) == 1 else "other code versions"
        return (
            f"{_rows(n)} of {other} left out ({counts}): this report shows code version "
            f"{self.version} only ({self.reason}), and never pools two versions; "
            "--code-version picks another."
        )


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def select_version(
    table: pd.DataFrame, code_version: str | None = None, installed: str | None = None
) -> tuple[pd.DataFrame, VersionChoice]:
    """The rows of one code version, and which one (a :class:`VersionChoice`).

    ``code_version`` names it; else it is ``installed`` (default: the installed
    probfsl's :func:`~probfsl.sweeps.cell.code_version`) where the table has rows of it,
    else the version of the most recently written rows (the latest ``finished``), else,
    without times, the version of the table's last row. A table without a
    ``code_version`` column is returned whole. A ``code_version`` the table does not
    hold is a ``ValueError`` listing those it holds.
    """
    _check(table)
    if "code_version" not in table.columns:
        return table, VersionChoice(None, "the table records no code version", {})
    versions = _versions(table)
    counts = Counter(versions)
    if code_version is not None:
        if code_version not in counts:
            held = ", ".join(f"{v} ({_rows(c)})" for v, c in counts.items())
            raise ValueError(f"no rows of code version {code_version!r}; the results hold {held}")
        chosen, reason = code_version, "as asked"
    else:
        if installed is None:
            from probfsl.sweeps.cell import code_version as installed_version

            installed = installed_version()
        finished = (
            pd.to_datetime(table["finished"], utc=True, errors="coerce", format="ISO8601")
            if "finished" in table.columns
            else pd.Series(pd.NaT, index=table.index)
        )
        if installed in counts:
            chosen, reason = installed, "the installed code's version"
        elif finished.notna().any():
            chosen = versions.loc[finished.idxmax()]
            reason = "the version of the most recently written rows"
        else:
            chosen, reason = versions.iloc[-1], "the version of the table's last row"
    keep = versions == chosen
    left_out = {v: c for v, c in counts.items() if v != chosen}
    return table[keep], VersionChoice(chosen, reason, left_out)


def pooled(table: pd.DataFrame) -> pd.DataFrame:
    """The ``ok`` cells pooled over seeds (see the module's docstring for the rule).

    One row per data set, setting and method variant (the columns of :data:`SETTING`
    and :data:`VARIANT` present), in order of first appearance, with the pooled metric
    columns, ``seeds`` (distinct seeds), ``cells`` (rows pooled), ``tasks`` (summed),
    ``tasks_per_second`` (mean over the cells), ``seconds`` / ``wall_seconds`` (summed)
    and the distinct values of the :data:`TEXTS` columns. Rows of two code versions in
    one group are a ``ValueError`` (:func:`select_version` picks one version).
    """
    _check(table)
    ok = _ok(table)
    keys = [c for c in SETTING + SETTING_EXTRA + VARIANT if c in table.columns]
    rows = []
    if not ok.empty:
        for _, group in ok.groupby(keys, dropna=False, sort=False):
            first = group.iloc[0]
            _check_one_version(group, f"pooling {first['data']}/{first['label']} seeds")
            row = {key: first[key] for key in keys}
            tasks = _numbers(group, "tasks")
            for value, half in METRICS:
                if value in group.columns:
                    row[value], row[half] = _pool(
                        _numbers(group, value), _numbers(group, half), tasks
                    )
            row["seeds"] = int(group["seed"].nunique())
            row["cells"] = len(group)
            row["tasks"] = int(np.nansum(tasks))
            for column, reduce in (
                ("tasks_per_second", np.nanmean),
                ("seconds", np.nansum),
                ("wall_seconds", np.nansum),
            ):
                numbers = _numbers(group, column)
                if column in group.columns and not np.isnan(numbers).all():
                    row[column] = float(reduce(numbers))
            for column in TEXTS:
                if column in group.columns:
                    row[column] = _distinct(group[column])
            rows.append(row)
    columns = keys + [c for m in METRICS for c in m if m[0] in table.columns]
    columns += ["seeds", "cells", "tasks", "tasks_per_second", "seconds", "wall_seconds"]
    columns += [c for c in TEXTS if c in table.columns]
    return pd.DataFrame(rows, columns=list(dict.fromkeys(columns)))


# --- text pieces --------------------------------------------------------------------------


def _truthy(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return not _missing(value) and bool(value)


def _int(value) -> str:
    return "–" if _missing(value) else str(int(value))


def _pm(value, half, digits: int = 2) -> str:
    """``"86.53 ± 0.87"`` (``"–"`` when the value is missing)."""
    if _missing(value) or math.isnan(float(value)):
        return "–"
    if _missing(half) or math.isnan(float(half)):
        return f"{float(value):.{digits}f}"
    return f"{float(value):.{digits}f} ± {float(half):.{digits}f}"


def _rate(value) -> str:
    if _missing(value) or math.isnan(float(value)):
        return "–"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _way_text(row: pd.Series) -> str:
    if not _truthy(row.get("zero_shot")):
        return _int(row.get("way"))
    low, high = row.get("min_classes"), row.get("max_classes")
    return "–" if _missing(low) or _missing(high) else f"{int(low)}–{int(high)}"


def _shot_text(row: pd.Series) -> str:
    return "zero-shot" if _truthy(row.get("zero_shot")) else _int(row.get("shot"))


def _balance_text(row: pd.Series) -> str:
    balance = "" if _missing(row.get("balance")) else str(row.get("balance"))
    alpha = row.get("alpha")
    if balance == "dirichlet" and not _missing(alpha):
        return f"dirichlet (α={float(alpha):g})"
    return balance


def _classes_text(row: pd.Series) -> str:
    """``" (3–10 classes)"`` for a zero-shot setting whose class range is known."""
    way = _way_text(row)
    return "" if way == "–" else f" ({way} classes)"


def _open_count(row: pd.Series) -> int:
    """A row's open queries per task (0 for closed tasks or rows without the column)."""
    value = row.get("open_queries")
    return 0 if _missing(value) else int(value)


def _setting_text(row: pd.Series) -> str:
    """One line: ``"5-way 1-shot balanced"`` (``", 75 open"`` for open-set tasks) or
    ``"zero-shot (3–10 classes)"``."""
    if _truthy(row.get("zero_shot")):
        return f"zero-shot{_classes_text(row)}"
    text = f"{_way_text(row)}-way {_shot_text(row)}-shot {_balance_text(row)}"
    text += f", {_open_count(row)} open" if _open_count(row) else ""
    return text + (f", tasks {_tasks_text(row)}" if _tasks_text(row) else "")


def _tasks_text(row: pd.Series) -> str:
    """The name of a row's task file (``""`` where its tasks were drawn)."""
    value = row.get("task_file")
    return "" if _missing(value) or value == "" else Path(str(value)).name


def _has_open(frame: pd.DataFrame) -> bool:
    """Whether any row of ``frame`` ran open-set tasks."""
    if "open_queries" not in frame.columns:
        return False
    return bool((pd.to_numeric(frame["open_queries"], errors="coerce").fillna(0) > 0).any())


def _baseline_name(name) -> str:
    return "baseline" if _missing(name) or name == "" else str(name).replace("-", " ")


def _variant_names(frame: pd.DataFrame) -> pd.Series:
    """The name of each row's method variant: its label, plus what varies within it."""
    extra = [c for c in VARIANT[1:] if c in frame.columns]
    if frame.empty or not extra:
        return frame["label"].astype(str)
    varies = frame.groupby("label", dropna=False)[extra].nunique(dropna=False) > 1
    names = []
    for _, row in frame.iterrows():
        flags = varies.loc[row["label"]]
        parts = [f"{c} {'none' if _missing(row[c]) else row[c]}" for c in extra if flags[c]]
        label = str(row["label"])
        names.append(f"{label} ({', '.join(parts)})" if parts else label)
    return pd.Series(names, index=frame.index, dtype=object)


def _settings(frame: pd.DataFrame) -> tuple[list[str], Iterator[tuple[list[str], pd.DataFrame]]]:
    """The setting columns of a table and, per setting in order, its cells and rows:
    data sets in order of first appearance, then few-shot before zero-shot, way, shot,
    balance, alpha, query."""
    show_query = "query" in frame.columns and frame["query"].nunique(dropna=False) > 1
    show_open = _has_open(frame)
    header = ["data", "way", "shot", "balance"] + (["query"] if show_query else [])
    header += ["open"] if show_open else []
    show_tasks = "task_file" in frame.columns and frame["task_file"].notna().any()
    header += ["tasks"] if show_tasks else []
    order = {d: i for i, d in enumerate(dict.fromkeys(frame["data"]))}
    sort = ["_data"] + [c for c in SETTING[1:] if c in frame.columns]
    frame = frame.assign(_data=frame["data"].map(order)).sort_values(sort, kind="stable")
    keys = [c for c in SETTING + SETTING_EXTRA if c in frame.columns]

    def groups() -> Iterator[tuple[list[str], pd.DataFrame]]:
        for _, group in frame.groupby(keys, dropna=False, sort=False):
            first = group.iloc[0]
            cells = [str(first["data"]), _way_text(first), _shot_text(first)]
            cells += [_balance_text(first)] + ([_int(first["query"])] if show_query else [])
            cells += [str(_open_count(first))] if show_open else []
            cells += [_tasks_text(first) or "drawn"] if show_tasks else []
            yield cells, group.drop(columns="_data")

    return header, groups()


def _baseline_row(group: pd.DataFrame) -> pd.Series:
    """The row whose baseline a setting shows: the one pooled over the most tasks."""
    return group.loc[pd.to_numeric(group["tasks"]).idxmax()]


# --- rendering ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Cell:
    text: str
    below: bool = False
    best: bool = False


def _md_escape(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "\\<")


def _render(
    header: Sequence[str], rows: Sequence[Sequence[_Cell | str]], fmt: str, empty: str
) -> str:
    """A markdown or HTML table (``empty`` as a paragraph when there are no rows)."""
    if not rows:
        return f"_{empty}_" if fmt == "markdown" else f"<p><em>{html.escape(empty)}</em></p>"
    rows = [[c if isinstance(c, _Cell) else _Cell(str(c)) for c in row] for row in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(_md_escape(h) for h in header) + " |"]
        lines.append("|" + "---|" * len(header))
        for row in rows:
            texts = []
            for cell in row:
                text = _md_escape(cell.text)
                text += " **below**" if cell.below else ""
                text += " _best_" if cell.best else ""
                texts.append(text)
            lines.append("| " + " | ".join(texts) + " |")
        return "\n".join(lines)
    lines = ['<table class="probfsl">', "<thead><tr>"]
    lines.append("".join(f"<th>{html.escape(h)}</th>" for h in header))
    lines.append("</tr></thead>")
    lines.append("<tbody>")
    for row in rows:
        tds = []
        for cell in row:
            text = html.escape(cell.text)
            text += " <strong>below</strong>" if cell.below else ""
            text += " <em>best</em>" if cell.best else ""
            tds.append(f'<td class="best">{text}</td>' if cell.best else f"<td>{text}</td>")
        lines.append("<tr>" + "".join(tds) + "</tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)


def _seeds_text(group: pd.DataFrame) -> str:
    low, high = int(group["seeds"].min()), int(group["seeds"].max())
    return str(low) if low == high else f"{low}–{high}"


# --- tables -------------------------------------------------------------------------------


def method_table(table: pd.DataFrame, fmt: str = "markdown") -> str:
    """The method × setting table of accuracies (%) with 95% half-widths, pooled over seeds.

    One row per setting, one column per method variant (in order of first appearance),
    the number of seeds pooled and the setting's baseline. A cell where the default search
    ran another method says so (" (ran nearest-centroid)"). A method is marked **below**
    when its interval lies entirely under the baseline's on the same tasks
    (``acc + ci < base_acc - base_ci``), and *best* when it is the most accurate of its
    setting (two methods or more). ``fmt``: ``"markdown"`` or ``"html"``.
    """
    _check_fmt(fmt)
    frame = pooled(table)
    frame["variant"] = _variant_names(frame)
    names = list(dict.fromkeys(frame["variant"]))
    header, groups = _settings(frame)
    rows = []
    for cells, group in groups:
        accuracy = pd.to_numeric(group["accuracy"], errors="coerce")
        best = accuracy.max() if accuracy.notna().sum() >= 2 else math.nan
        by_name = {}
        for _, row in group.iterrows():
            by_name.setdefault(row["variant"], row)
        row_cells: list[_Cell | str] = [*cells, _seeds_text(group)]
        for name in names:
            if name not in by_name:
                row_cells.append("–")
                continue
            row = by_name[name]
            below = (row["accuracy"] + row["ci95"]) < (
                row["baseline_accuracy"] - row["baseline_ci95"]
            )
            text = _pm(row["accuracy"], row["ci95"]) + _fallback_note(row)
            row_cells.append(_Cell(text, bool(below), row["accuracy"] == best))
        base = _baseline_row(group)
        base_text = _pm(base["baseline_accuracy"], base["baseline_ci95"])
        row_cells.append(f"{_baseline_name(base.get('baseline'))} {base_text}")
        rows.append(row_cells)
    return _render([*header, "seeds", *names, "baseline"], rows, fmt, "no cell ran")


def _fallback_note(row: pd.Series) -> str:
    """`` (ran M)`` where the default search on base-class episodes ran another method
    ``M`` instead (``method_run`` beside ``method``, or in older rows ``ran_preset``
    "auto (M)", the choice of ``probfsl run``), else ``""``."""
    method, run = row.get("method"), row.get("method_run")
    other = []
    if not _missing(run):
        other = [m.strip() for m in str(run).split(";") if m.strip() and m.strip() != method]
    ran = row.get("ran_preset")
    if not other and not _missing(ran):
        other = re.findall(r"auto \(([\w-]+)\)", str(ran))
    return f" (ran {', '.join(dict.fromkeys(other))})" if other else ""


def calibration_table(table: pd.DataFrame, fmt: str = "markdown") -> str:
    """ECE, NLL (nats) and Brier score with 95% half-widths per few-shot setting × method,
    pooled over seeds like the accuracies; a method where the default search ran another
    one says so, as in :func:`method_table`. ``fmt``: ``"markdown"`` or ``"html"``."""
    _check_fmt(fmt)
    frame = pooled(table)
    frame["variant"] = _variant_names(frame)
    frame = frame[~frame["zero_shot"].map(_truthy).astype(bool)]
    header, groups = _settings(frame)
    metrics = [("ECE", "ece"), ("NLL", "nll"), ("Brier", "brier")]
    rows = []
    for cells, group in groups:
        for _, row in group.iterrows():
            values = [_pm(row.get(m), row.get(f"{m}_ci95"), digits=3) for _, m in metrics]
            name = row["variant"] + _fallback_note(row)
            rows.append([*cells, name, _int(row["seeds"]), *values])
    names = [name for name, _ in metrics]
    return _render([*header, "method", "seeds", *names], rows, fmt, "no few-shot cell ran")


def open_set_table(table: pd.DataFrame, fmt: str = "markdown") -> str:
    """The open-set settings (cells with open queries) × methods: closed accuracy (%),
    AUROC, AUPR and precision at 90% recall of the outlier score (%), and ECE-open, each
    with its 95% half-width, pooled over seeds; then, per setting, the baselines on the
    same tasks (nearest centroid with the k-NN distance, and with the maximum softmax
    probability, as outlier scores). A method where the default search ran another one
    says so (" (ran nearest-centroid)"), as in :func:`method_table`, and one whose P(open)
    could not be tuned on held-out base classes (the row's ``open_note``) says that. ``fmt``:
    ``"markdown"`` or ``"html"``."""
    _check_fmt(fmt)
    frame = pooled(table)
    frame["variant"] = _variant_names(frame)
    if not _has_open(frame):
        return _render([], [], fmt, "no open-set cell ran")
    frame = frame[pd.to_numeric(frame["open_queries"], errors="coerce").fillna(0) > 0]
    header, groups = _settings(frame)
    rows = []
    for cells, group in groups:
        for _, row in group.iterrows():
            values = [
                _pm(
                    row.get(column),
                    row.get("ci95" if column == "accuracy" else f"{column}_ci95"),
                    digits=3 if column == "ece_open" else 2,
                )
                for _, column in OPEN_COLUMNS
            ]
            name = row["variant"] + _fallback_note(row)
            if not _missing(row.get("open_note")) and str(row.get("open_note")):
                name += " (P(open) not tuned: too few base classes to hold out)"
            rows.append([*cells, name, _int(row["seeds"]), *values])
        base = _baseline_row(group)
        name = _baseline_name(base.get("baseline"))
        for prefix, detector in (("knn", "k-NN distance"), ("msp", "max softmax")):
            values = [_pm(base.get("baseline_accuracy"), base.get("baseline_ci95"))]
            for _, column in OPEN_COLUMNS[1:-1]:
                key = f"{prefix}_{column}"
                values.append(_pm(base.get(key), base.get(f"{key}_ci95")))
            rows.append([*cells, f"{name} + {detector}", _int(base["seeds"]), *values, "–"])
    names = [heading for heading, _ in OPEN_COLUMNS]
    return _render([*header, "method", "seeds", *names], rows, fmt, "no open-set cell ran")


def _device_text(row: pd.Series) -> str:
    device = "" if _missing(row.get("device")) else str(row.get("device"))
    gpu = "" if _missing(row.get("gpu")) else str(row.get("gpu"))
    device = device or "unknown device"
    return f"{device} ({gpu})" if gpu else device


def _throughput(table: pd.DataFrame) -> pd.DataFrame:
    """Median tasks per second per method variant (rows) × device (columns)."""
    ok = _ok(table)
    if ok.empty or "tasks_per_second" not in ok.columns:
        return pd.DataFrame()
    frame = pd.DataFrame(
        {
            "variant": _variant_names(ok),
            "device": [_device_text(row) for _, row in ok.iterrows()],
            "rate": _numbers(ok, "tasks_per_second"),
        }
    )
    if "code_version" in ok.columns:
        frame["version"] = _versions(ok).to_numpy()
        for (variant, device), group in frame.groupby(["variant", "device"], sort=False):
            _check_one_version(
                group.rename(columns={"version": "code_version"}),
                f"the throughput of {variant} on {device}",
            )
    frame = frame[frame["rate"].notna()]
    if frame.empty:
        return pd.DataFrame()
    medians = frame.pivot_table(index="variant", columns="device", values="rate", aggfunc="median")
    rows = list(dict.fromkeys(frame["variant"]))
    columns = list(dict.fromkeys(frame["device"]))
    return medians.reindex(index=rows, columns=columns)


def throughput_table(table: pd.DataFrame, fmt: str = "markdown") -> str:
    """Tasks per second per method × device (device and GPU name): the median over the
    method's cells on that device, all settings together. ``fmt``: ``"markdown"`` or
    ``"html"``."""
    _check_fmt(fmt)
    _check(table)
    medians = _throughput(table)
    rows = [[name, *(_rate(v) for v in medians.loc[name])] for name in medians.index]
    header = ["method", *(f"{d} tasks/s" for d in medians.columns)]
    return _render(header, rows, fmt, "no throughput measured")


def failures_table(table: pd.DataFrame, fmt: str = "markdown") -> str:
    """The failed cells: data set, method, setting, seed, device and error."""
    _check_fmt(fmt)
    _check(table)
    failed = table[table["status"] != "ok"]
    rows = []
    for _, row in failed.iterrows():
        error = row.get("error")
        rows.append(
            [
                str(row["data"]),
                str(row["label"]),
                _setting_text(row),
                _int(row["seed"]),
                "" if _missing(row.get("device")) else str(row.get("device")),
                "" if _missing(error) else str(error),
            ]
        )
    header = ["data", "method", "setting", "seed", "device", "error"]
    return _render(header, rows, fmt, "no cell failed")


# --- figures ------------------------------------------------------------------------------


def _tick(row: pd.Series, show_query: bool) -> str:
    if _truthy(row.get("zero_shot")):
        text = "zero-shot" + _classes_text(row).replace(" (", "\n(")
    else:
        text = f"{_way_text(row)}-way {_shot_text(row)}-shot\n{_balance_text(row)}"
        text += f"\n{_open_count(row)} open" if _open_count(row) else ""
    return text + (f"\nquery {_int(row.get('query'))}" if show_query else "")


def _save(fig, path: Path) -> Path:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return path


def _markers(i: int) -> str:
    return "osD^vPX*<>"[i % 10]


def _dot_figure(
    frame: pd.DataFrame, names: list[str], value: str, half: str, ylabel: str, title: str, baseline
):
    """Per data set (one panel each): per setting, one marker per method with its 95%
    interval, and (``baseline``) the baseline as a dashed line with its band. The i-th
    of ``names`` has the i-th colour and marker in every figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    shown = set(frame["variant"])
    datasets = list(dict.fromkeys(frame["data"]))
    show_query = "query" in frame.columns and frame["query"].nunique(dropna=False) > 1
    panels = []
    for data in datasets:
        _, groups = _settings(frame[frame["data"] == data])
        panels.append((data, list(groups)))
    widest = max(len(groups) for _, groups in panels)
    fig = Figure(
        figsize=(min(4.0 + 1.4 * widest, 22.0), 0.6 + 3.2 * len(panels)),
        dpi=DPI,
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    step = 0.7 / max(len(names), 1)
    for ax, (data, groups) in zip(axes, panels, strict=True):
        for j, (_, group) in enumerate(groups):
            if baseline:
                base = _baseline_row(group)
                mid, spread = float(base["baseline_accuracy"]), float(base["baseline_ci95"])
                ax.fill_between(
                    [j - 0.42, j + 0.42], mid - spread, mid + spread, color="0.5", alpha=0.2, lw=0
                )
                ax.hlines(mid, j - 0.42, j + 0.42, colors="0.3", linestyles="--", lw=1.2)
            for i, name in enumerate(names):
                rows = group[group["variant"] == name]
                if name not in shown:
                    continue
                if rows.empty or _missing(rows.iloc[0][value]):
                    continue
                x = j + (i - (len(names) - 1) / 2) * step
                err = rows.iloc[0][half]
                ax.errorbar(
                    [x],
                    [float(rows.iloc[0][value])],
                    yerr=None if _missing(err) else [float(err)],
                    fmt=_markers(i),
                    color=f"C{i % 10}",
                    ms=5,
                    capsize=3,
                    lw=1.2,
                )
        ax.set_xticks(range(len(groups)), [_tick(g.iloc[0], show_query) for _, g in groups])
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylabel(ylabel)
        ax.set_title(str(data), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles = [
        Line2D([], [], marker=_markers(i), color=f"C{i % 10}", ls="", label=name)
        for i, name in enumerate(names)
        if name in shown
    ]
    if baseline:
        handles.append(Line2D([], [], color="0.3", ls="--", label="baseline (band: 95% CI)"))
    fig.legend(handles=handles, loc="outside right center", fontsize=8, title="method")
    fig.suptitle(title)
    return fig


def _throughput_figure(medians: pd.DataFrame, colours: list[str]):
    """Grouped bars: per device, one bar per method (labelled with its value), log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    names, devices = list(medians.index), list(medians.columns)
    fig = Figure(
        figsize=(min(4.5 + 0.5 * len(names) * len(devices), 22.0), 4.2),
        dpi=DPI,
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        x = np.arange(len(devices)) + (i - (len(names) - 1) / 2) * width
        values = medians.loc[name].to_numpy(float)
        bars = ax.bar(x, values, width, label=name, color=colours[i])
        labels = ["" if math.isnan(v) else _rate(v) for v in values]
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.margins(y=0.15)
    ax.set_xticks(range(len(devices)), devices)
    ax.set_xlabel("device")
    ax.set_ylabel("tasks per second (median over cells)")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.legend(loc="outside right center", fontsize=8, title="method")
    fig.suptitle("Throughput per method and device (log scale)")
    return fig


def write_figures(table: pd.DataFrame, out_dir: str | Path) -> dict[str, Path]:
    """``accuracy.png``, ``calibration.png`` and ``throughput.png`` in ``out_dir``, each
    where there is something to draw; ``{}`` when matplotlib is not installed.

    Drawn on the Agg canvas directly (no pyplot: the backend of a running session is left
    alone); each file is written atomically.
    """
    _check(table)
    try:
        import matplotlib  # noqa: F401  (an ImportError here: no figures)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        return {}
    out_dir = Path(out_dir)
    frame = pooled(table)
    frame["variant"] = _variant_names(frame)
    names = list(dict.fromkeys(frame["variant"]))
    paths = {}
    if "accuracy" in frame.columns and frame["accuracy"].notna().any():
        fig = _dot_figure(
            frame,
            names,
            "accuracy",
            "ci95",
            "accuracy (%)",
            "Accuracy per setting (95% CI, pooled over seeds)",
            baseline=True,
        )
        paths["accuracy"] = _save(fig, out_dir / "accuracy.png")
    fewshot = frame[~frame["zero_shot"].map(_truthy).astype(bool)]
    if "ece" in fewshot.columns and pd.to_numeric(fewshot["ece"], errors="coerce").notna().any():
        fewshot = fewshot[pd.to_numeric(fewshot["ece"], errors="coerce").notna()]
        fig = _dot_figure(
            fewshot,
            names,
            "ece",
            "ece_ci95",
            "ECE (lower is better)",
            "Expected calibration error per setting (95% CI)",
            baseline=False,
        )
        paths["calibration"] = _save(fig, out_dir / "calibration.png")
    medians = _throughput(table)
    if not medians.empty:
        colours = [f"C{names.index(n) % 10}" if n in names else "0.5" for n in medians.index]
        paths["throughput"] = _save(
            _throughput_figure(medians, colours), out_dir / "throughput.png"
        )
    return paths


# --- the report ---------------------------------------------------------------------------


def _summary(table: pd.DataFrame) -> list[str]:
    """The header lines: cells, ok / failed, versions, devices, machines."""
    ok = int((table["status"] == "ok").sum())
    lines = [f"{len(table)} cells: {ok} ok, {len(table) - ok} failed."]
    for column, name in (
        ("code_version", "code"),
        ("torch_version", "torch"),
        ("device", "devices"),
        ("machine", "machines"),
    ):
        if column in table.columns and _distinct(table[column]):
            lines.append(f"{name}: {_distinct(table[column])}")
    return lines


def _inline_html(text: str) -> str:
    """Escape ``text`` and turn its ``**strong**``, ``_em_`` and backquoted code into HTML
    (for the report's own sentences, not for data)."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"(?<!\w)_([^_]+)_(?!\w)", r"<em>\1</em>", text)


_NOTES = {
    "accuracy": (
        "Accuracy (%) with its 95% half-width, pooled over seeds (task-weighted mean; "
        "half-widths combined as independent means). The baseline runs on the same tasks. "
        "**below**: the method's interval lies entirely under the baseline's; "
        "_best_: the most accurate method of the setting."
    ),
    "calibration": (
        "ECE, NLL (nats) and Brier score of the few-shot settings, pooled over seeds "
        "(lower is better)."
    ),
    "throughput": (
        "Tasks per second: the median over the cells of each method on each device "
        "(all settings together)."
    ),
    "open_set": (
        "Open-set tasks (open queries from classes outside the task): accuracy on the "
        "closed queries, AUROC, AUPR and precision at 90% recall of the outlier score "
        "(open queries positive), all in %, and ECE-open, the calibration of P(open), "
        "pooled over seeds. The baselines are nearest centroid with the k-NN distance to "
        "the support or the maximum softmax probability as outlier score (no ECE-open)."
    ),
}
_FIGURES = (
    ("accuracy", "Accuracy per setting with 95% CIs and the baseline"),
    ("calibration", "ECE per setting with 95% CIs"),
    ("throughput", "Tasks per second per method and device"),
)


def _document(
    table: pd.DataFrame,
    title: str,
    figures: dict[str, Path],
    fmt: str,
    notes: Sequence[str] = (),
) -> str:
    md = fmt == "markdown"
    parts: list[str] = []

    def heading(text: str, level: int) -> None:
        parts.append(f"{'#' * level} {text}" if md else f"<h{level}>{html.escape(text)}</h{level}>")

    def note(text: str) -> None:  # the report's own sentences (with markup)
        parts.append(text if md else f"<p>{_inline_html(text)}</p>")

    heading(title, 1)
    summary = [*_summary(table), *notes]
    if md:
        parts.append("\n".join(f"- {_md_escape(line)}" for line in summary))
    else:
        parts.append("<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in summary) + "</ul>")
    heading("Accuracy", 2)
    note(_NOTES["accuracy"])
    parts.append(method_table(table, fmt))
    heading("Calibration", 2)
    note(_NOTES["calibration"])
    parts.append(calibration_table(table, fmt))
    if _has_open(_ok(table)):
        heading("Open-set recognition", 2)
        note(_NOTES["open_set"])
        parts.append(open_set_table(table, fmt))
    heading("Throughput", 2)
    note(_NOTES["throughput"])
    parts.append(throughput_table(table, fmt))
    if (table["status"] != "ok").any():
        heading("Failures", 2)
        parts.append(failures_table(table, fmt))
    heading("Figures", 2)
    if not figures:
        note(FIGURES_HINT)
    for name, alt in _FIGURES:
        if name in figures:
            src = figures[name].name
            parts.append(
                f"![{alt}]({src})" if md else f'<img src="{html.escape(src)}" alt="{alt}">'
            )
    if md:
        return "\n\n".join(parts) + "\n"
    head = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
    )
    return head + "\n".join(parts) + "\n</body>\n</html>\n"


def write_report(
    table: pd.DataFrame,
    out_dir: str | Path,
    title: str = "probfsl sweep report",
    code_version: str | None = None,
    notes: Sequence[str] = (),
) -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and the figures of ``table`` into ``out_dir``.

    The report holds the rows of one code version (:func:`select_version`:
    ``code_version``, by default the installed code's version where present, else the
    most recently written rows'); how many rows of other versions it left out is said in
    its header and logged. ``notes``: more lines for the header (problems met reading
    the results, say).

    Returns the written paths by name: ``"markdown"``, ``"html"`` and those of the
    figures drawn (``"accuracy"``, ``"calibration"``, ``"throughput"``; none without
    matplotlib, which the report then says). Every file is written atomically.
    """
    table, choice = select_version(table, code_version)
    notes = list(notes)
    if choice.note():
        log.info("report: %s", choice.note())
        notes.append(choice.note())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = write_figures(table, out_dir)
    paths: dict[str, Path] = {}
    for fmt, name in (("markdown", "report.md"), ("html", "report.html")):
        atomic_write_text(out_dir / name, _document(table, title, figures, fmt, notes))
        paths[fmt] = out_dir / name
    return {**paths, **figures}
