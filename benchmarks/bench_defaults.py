"""Every method at the command line's defaults, beside nearest centroid and soft k-means.

What a user gets from ``probfsl run --method M --dataset D --shot S --balance B``
(no ``--preset``, no ``--param``): the cells are the sweeps ``sweeps/defaults.yaml`` and
``sweeps/zero_shot.yaml``, each cell one ``probfsl run``, so the default ``preset="auto"``
search on base-class episodes, its fallback to nearest centroid and the temperature
calibration are all included. All methods of a setting see the same episodes (same
seed). A cell is marked **below** when its 95% interval lies entirely under nearest
centroid's.

Data: the built-in Omniglot (PCA-64) and WordNet (MiniLM) sets, the 1280-d Omniglot
EfficientNet-Lite0 features of the shared data when they are next to the repository,
and scikit-learn's handwritten digits (pixels; five base classes only; this script
writes their feature file). The zero-shot row (WordNet) gives EM-Dirichlet at its
default beside the argmax baselines. The results stores are ``results/sweeps/defaults``
and ``results/sweeps/zero_shot`` (a cell already stored for the same code is not run
again); this script writes ``results/defaults.md`` (a page of the docs' benchmarks
section) and ``results/defaults.json`` from them. The tables hold the rows of one code
version (the installed code's where the stores have it, else the newest rows', or
``--code-version``): rows of two versions of the code are never put in one table.

    python benchmarks/bench_defaults.py [--workers 2] [--executor local|ray]
    python benchmarks/bench_defaults.py --tables-only     # redo the tables from the stores
    python benchmarks/bench_defaults.py --tables-only --code-version V   # another version's
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import probfsl
from probfsl.methods import METHODS
from probfsl.sweeps import read_table
from probfsl.sweeps.report import select_version

HERE = Path(__file__).resolve().parent
SWEEPS = ("defaults", "zero_shot")


def cell(row: dict) -> str:
    return f"{row['accuracy']:.2f} ± {row['ci95']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=None, help="worker processes")
    parser.add_argument("--executor", choices=["local", "ray"], default="local")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--quick", action="store_true", help="100 tasks, built-in data only")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="the shared real data (default: the sweep's)"
    )
    parser.add_argument(
        "--tables-only", action="store_true", help="rewrite defaults.md from the stores"
    )
    parser.add_argument(
        "--code-version",
        default=None,
        help="the code version whose rows make the tables (default: the installed code's "
        "where the stores have it, else the newest rows')",
    )
    args = parser.parse_args()
    stores = {name: args.out / "sweeps" / name for name in SWEEPS}
    if not args.tables_only:
        digits_file(HERE / "features")
        for name, store in stores.items():
            probfsl.sweep(
                sweep_config(name, args.quick, args.data_dir),
                store,
                executor=args.executor,
                workers=args.workers,
                progress=True,
            )
    rows = []
    for row in stored_rows(list(stores.values()), args.code_version):
        # the table shows what ran: the default search's choice
        row["preset"], row["params"] = row["ran_preset"], row["ran_params"]
        rows.append(row)
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        print(f"failed: {r['data']} {r['label']} {r['shot']}-shot {r['balance']}: {r['error']}")
    # the sweep file's order of data sets, the registry's order of methods
    data = [s.name for s in sweep_config("defaults", False, None).data]
    methods = list(METHODS)
    rows = sorted(
        (r for r in rows if r["status"] == "ok"),
        key=lambda r: (
            data.index(r["data"]) if r["data"] in data else -1,
            methods.index(r["method"]),
        ),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "defaults.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    (args.out / "defaults.md").write_text(tables(rows))


def stored_rows(stores: list[Path], code_version: str | None = None) -> list[dict]:
    """The rows of the results ``stores`` of one code version, the same for all of them
    (:func:`probfsl.sweeps.report.select_version` on their rows together:
    ``code_version``, else the installed code's where the stores hold it, else the newest
    rows'); the rows of other versions are left out, with a note on stderr."""
    import pandas as pd

    tables = [read_table(store) for store in stores]
    _, choice = select_version(pd.concat(tables, ignore_index=True), code_version)
    if note := choice.note():
        print(f"bench_defaults: {note}", file=sys.stderr)
    return [
        row
        for table in tables
        for row in table.to_dict("records")
        if choice.version is None or row["code_version"] == choice.version
    ]


def sweep_config(name: str, quick: bool, data_dir: Path | None):
    """The sweep ``sweeps/<name>.yaml``; ``quick``: 100 tasks on the built-in data only;
    ``data_dir``: where the shared data lie, for the sources that read them."""
    from dataclasses import replace

    from probfsl.sweeps import load_config

    config = load_config(HERE / "sweeps" / f"{name}.yaml")
    data = list(config.data)
    if data_dir is not None:
        data = [
            replace(s, features=str(data_dir / rel))
            if s.features and (rel := _under_shared(s.features))
            else s
            for s in data
        ]
    if quick:
        data = [s for s in data if s.dataset is not None]
        return replace(config, data=data, run=replace(config.run, tasks=100))
    return replace(config, data=data)


def _under_shared(path: str) -> str | None:
    """``path`` relative to the shared data folder, or ``None`` when it is not under one."""
    parts = Path(path).parts
    return str(Path(*parts[parts.index("data") + 1 :])) if "data" in parts else None


def digits_file(folder: Path) -> Path:
    """scikit-learn's handwritten digits (8x8 pixels, 64-d, about 180 images a class) as a
    feature file: digits 0-4 base classes, 5-9 novel. Five base classes are too few for
    5-way base episodes, so the default search runs on fewer ways (its fallback path)."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    path = Path(folder) / "digits_sklearn.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        features=digits.data.astype(np.float32),
        labels=digits.target,
        split=np.where(digits.target < 5, "base", "novel"),
        class_names=np.array([str(c) for c in range(10)]),
    )
    return path


#: transductive methods that should beat soft k-means (their initialiser or a richer model)
ABOVE_SOFT_KMEANS = ("bavardage", "vmp-gmm")


def table_row(setting: list[dict], methods: list[str]) -> str:
    by = {r["method"]: r for r in setting}
    first = setting[0]
    low = first["baseline_accuracy"] - first["baseline_ci95"]
    cells = []
    for method in methods:
        r = by.get(method)
        if r is None:
            cells.append("")
            continue
        text = cell(r)
        if r["accuracy"] + r["ci95"] < low:
            text = f"**{text} below**"
        if str(r.get("preset", "")).startswith("auto (nearest-centroid"):
            text += " (NC)"
        skm = by.get("soft-kmeans")
        if method in ABOVE_SOFT_KMEANS and skm and r["accuracy"] < skm["accuracy"]:
            text += " †"
        cells.append(text)
    return f"| {first['data']} | {first['shot']} | {first['balance']} | " + " | ".join(cells) + " |"


def tables(rows: list[dict]) -> str:
    few = [r for r in rows if r.get("shot") != 0]
    zeros = [r for r in rows if r.get("shot") == 0]
    methods = list(dict.fromkeys(r["method"] for r in few))
    data_order = list(dict.fromkeys(r["data"] for r in few))
    settings: dict[tuple, list[dict]] = {}
    for r in sorted(few, key=lambda r: (data_order.index(r["data"]), r["shot"], r["balance"])):
        settings.setdefault((r["data"], r["shot"], r["balance"]), []).append(r)
    tasks = few[0]["tasks"] if few else 0
    head = "| data | shot | queries | " + " | ".join(methods) + " |"
    text = [
        "# Every method at its defaults",
        "",
        f"`probfsl run --method M --dataset D --shot S --balance B --tasks {tasks}` with no "
        "`--preset` and no `--param`: 5-way, 75 queries, seed 0, the same episodes for "
        "every method; accuracy ± 95% CI (%). **below**: the interval lies entirely under "
        "nearest centroid's. (NC): the default search on base-class episodes found the "
        "method below nearest centroid there and ran nearest centroid instead (the run "
        "says so in one line). †: a transductive method that should beat soft k-means "
        "(BAVARDAGE, vmp-gmm) and does not here.",
        "",
        head,
        "|" + "---|" * (3 + len(methods)),
        *(table_row(v, methods) for v in settings.values()),
        "",
        *(zero_line(z) for z in zeros),
        "",
        "<!-- headline end -->",
        "",
        "What each default ran (`auto`: hyperparameters tuned on base-class episodes; the "
        "seconds include the search where it ran, not where the choice came from the cache "
        "or from the entries shipped for the built-in data):",
        "",
        "| data | shot | queries | method | ran | choice | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in few:
        text.append(
            f"| {r['data']} | {r['shot']} | {r['balance']} | {r['method']} | "
            f"{r.get('preset') or 'defaults'} | {r.get('params') or ''} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(text) + "\n"


def zero_line(zero: dict) -> str:
    return (
        f"Zero-shot, {zero['data']} novel classes, 3-10 classes per task, {zero['tasks']} "
        f"tasks: EM-Dirichlet at its default {cell(zero)}; argmax over all classes (the "
        f"inductive baseline, the same information) {zero['baseline_accuracy']:.2f} ± "
        f"{zero['baseline_ci95']:.2f}; argmax over the task's own classes (an oracle that "
        f"knows them) {zero['argmax_in_task_accuracy']:.2f} ± {zero['argmax_in_task_ci95']:.2f}."
    )


if __name__ == "__main__":
    main()
