"""Every method at the command line's defaults, beside nearest centroid and soft k-means.

What a user gets from ``probfsl run --method M --dataset D --shot S --balance B``
(no ``--preset``, no ``--param``): each cell runs the command in this process
(:func:`probfsl.cli.main`), so the default ``preset="auto"`` search on base-class
episodes, its fallback to nearest centroid and the temperature calibration are all
included. All methods of a setting see the same episodes (same seed). A cell is marked
**below** when its 95% interval lies entirely under nearest centroid's.

Data: the built-in Omniglot (PCA-64) and WordNet (MiniLM) sets, and the 1280-d
Omniglot EfficientNet-Lite0 features of the shared data when ``--data-dir`` holds them.
The zero-shot row (WordNet) gives EM-Dirichlet at its default beside the argmax
baselines. Writes ``results/defaults.md`` and ``results/defaults.json``; the docs page
``docs/benchmarks/defaults.md`` includes the markdown table.

    python benchmarks/bench_defaults.py [--tasks 1000] [--data-dir DIR] [--quick] [--out DIR]
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
    parser.add_argument("--balances", nargs="+", default=["dirichlet"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--quick", action="store_true", help="100 tasks, built-in data only")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("PROBFSL_BENCH_THREADS", "2")))
    tasks = 100 if args.quick else args.tasks
    sources = {"omniglot (built-in)": ["--dataset", "omniglot"]}
    sources["wordnet (built-in)"] = ["--dataset", "wordnet"]
    for name, rel in SHARED.items():
        if not args.quick and (args.data_dir / rel).is_file():
            sources[name] = ["--features", str(args.data_dir / rel)]
    rows, lines = [], []
    for data, source in sources.items():
        for shot in args.shots:
            for balance in args.balances:
                extra = ["--shot", str(shot), "--balance", balance, "--tasks", str(tasks)]
                setting = []
                for method in args.methods:
                    row = run_cell(source, method, extra)
                    row.update(data=data)
                    setting.append(row)
                    print(f"{data} {shot}-shot {balance} {method}: {cell(row)}", flush=True)
                rows += setting
                lines.append(table_row(data, shot, balance, setting))
    zero = run_cell(
        sources["wordnet (built-in)"], "em-dirichlet", ["--zero-shot", "--tasks", str(tasks)]
    )
    zero.update(data="wordnet (built-in)")
    rows.append(zero)
    write(rows, lines, zero, tasks, args.methods, args.out)


def table_row(data: str, shot: int, balance: str, setting: list[dict]) -> str:
    by = {r["method"]: r for r in setting}
    nc = by.get("nearest-centroid") or setting[0]
    low = nc["baseline_accuracy"] - nc["baseline_ci95"]
    cells = []
    for r in setting:
        text = cell(r)
        if r["accuracy"] + r["ci95"] < low:
            text = f"**{text} below**"
        if str(r.get("preset", "")).startswith("auto (nearest-centroid"):
            text += " (NC)"
        cells.append(text)
    return f"| {data} | {shot} | {balance} | " + " | ".join(cells) + " |"


def write(
    rows: list[dict], lines: list[str], zero: dict, tasks: int, methods: list[str], out: Path
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "defaults.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    head = "| data | shot | queries | " + " | ".join(methods) + " |"
    text = [
        "# Every method at its defaults",
        "",
        f"`probfsl run --method M --dataset D --shot S --balance B --tasks {tasks}` with no "
        "`--preset` and no `--param`: 5-way, 75 queries, seed 0, the same episodes for "
        "every method; accuracy ± 95% CI (%). **below**: the interval lies entirely under "
        "nearest centroid's. (NC): the default search on base-class episodes found the "
        "method below nearest centroid there and ran nearest centroid instead (the run "
        "says so in one line).",
        "",
        head,
        "|" + "---|" * (3 + len(methods)),
        *lines,
        "",
        f"Zero-shot, WordNet novel classes, 3-10 classes per task, {tasks} tasks: "
        f"EM-Dirichlet at its default {cell(zero)}; argmax over all 41 classes (the "
        f"inductive baseline, the same information) {zero['baseline_accuracy']:.2f} ± "
        f"{zero['baseline_ci95']:.2f}; argmax over the task's own classes (an oracle that "
        f"knows them) {zero['argmax_in_task_accuracy']:.2f} ± {zero['argmax_in_task_ci95']:.2f}.",
        "",
        "What each default ran (`auto`: hyperparameters tuned on base-class episodes):",
        "",
        "| data | shot | queries | method | ran | choice | seconds (tuning + run) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("shot") == 0:
            continue
        text.append(
            f"| {r['data']} | {r['shot']} | {r['balance']} | {r['method']} | "
            f"{r.get('preset') or 'defaults'} | {r.get('params') or ''} | {r['wall_seconds']:.0f} |"
        )
    (out / "defaults.md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
