"""Every method at the command line's defaults, beside nearest centroid and soft k-means.

What a user gets from ``probfsl run --method M --dataset D --shot S --balance B``
(no ``--preset``, no ``--param``): each cell runs the command in this process
(:func:`probfsl.cli.main`), so the default ``preset="auto"`` search on base-class
episodes, its fallback to nearest centroid and the temperature calibration are all
included. All methods of a setting see the same episodes (same seed). A cell is marked
**below** when its 95% interval lies entirely under nearest centroid's.

Data: the built-in Omniglot (PCA-64) and WordNet (MiniLM) sets, the 1280-d Omniglot
EfficientNet-Lite0 features of the shared data when ``--data-dir`` holds them, and
scikit-learn's handwritten digits (pixels; five base classes only).
The zero-shot row (WordNet) gives EM-Dirichlet at its default beside the argmax
baselines. Writes ``results/defaults.md`` (a page of the docs' benchmarks section) and
``results/defaults.json``.

    python benchmarks/bench_defaults.py [--tasks 1000] [--data-dir DIR] [--quick] [--out DIR]
    python benchmarks/bench_defaults.py --balances balanced --merge   # add settings
    python benchmarks/bench_defaults.py --tables-only                 # redo the tables
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from probfsl.cli import main as probfsl
from probfsl.methods import METHODS

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()
SHARED = {"omniglot-1280": "omniglot_small/omniglot_small_effnetlite0.npz"}


def run_cell(source: list[str], method: str, extra: list[str]) -> dict:
    """One ``probfsl run`` in this process; its result row (``ValueError`` if it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        tic = time.perf_counter()
        code = probfsl(["run", "--method", method, *source, *extra, "--out", str(out)])
        if code != 0:
            raise ValueError(f"probfsl run --method {method} {' '.join(source + extra)}: {code}")
        row = json.loads(out.read_text())
    row["wall_seconds"] = time.perf_counter() - tic
    return row


def cell(row: dict) -> str:
    return f"{row['accuracy']:.2f} ± {row['ci95']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--balances", nargs="+", default=["dirichlet", "balanced"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--data", nargs="+", help="only these data sets (table names)")
    parser.add_argument("--quick", action="store_true", help="100 tasks, built-in data only")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--merge", action="store_true", help="add to the rows of an existing defaults.json"
    )
    parser.add_argument(
        "--tables-only", action="store_true", help="rewrite defaults.md from defaults.json"
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("PROBFSL_BENCH_THREADS", "2")))
    tasks = 100 if args.quick else args.tasks
    stored = args.out / "defaults.json"
    rows = json.loads(stored.read_text()) if args.merge or args.tables_only else []
    if not args.tables_only:
        rows += run_all(args, tasks)
    # a cell measured again replaces the stored one
    rows = list({(r["data"], r["shot"], r["balance"], r["method"]): r for r in rows}.values())
    args.out.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    (args.out / "defaults.md").write_text(tables(rows))


def run_all(args: argparse.Namespace, tasks: int) -> list[dict]:
    sources = {"omniglot (built-in)": ["--dataset", "omniglot"]}
    sources["wordnet (built-in)"] = ["--dataset", "wordnet"]
    for name, rel in SHARED.items():
        if not args.quick and (args.data_dir / rel).is_file():
            sources[name] = ["--features", str(args.data_dir / rel)]
    if not args.quick:
        sources["digits (scikit-learn)"] = ["--features", str(digits_file(HERE / "features"))]
    sources = {k: v for k, v in sources.items() if not args.data or k in args.data}
    rows = []
    for data, source in sources.items():
        for shot in args.shots:
            for balance in args.balances:
                extra = ["--shot", str(shot), "--balance", balance, "--tasks", str(tasks)]
                for method in args.methods:
                    row = run_cell(source, method, extra)
                    row.update(data=data)
                    rows.append(row)
                    print(f"{data} {shot}-shot {balance} {method}: {cell(row)}", flush=True)
    if "wordnet (built-in)" not in sources:
        return rows
    zero = run_cell(
        sources["wordnet (built-in)"], "em-dirichlet", ["--zero-shot", "--tasks", str(tasks)]
    )
    zero.update(data="wordnet (built-in)")
    return rows + [zero]


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
