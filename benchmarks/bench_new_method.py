"""``bavardage-gamma`` (a method none of the papers ran) against the five methods and
nearest centroid, every method at its own defaults.

``bavardage-gamma`` (:mod:`probfsl.models.bavardage_gamma`) is BAVARDAGE's PLDA-projected
VB mixture (Hu, Pateux & Gripon, AISTATS 2023) with a per-class diagonal Gamma precision
instead of the fixed T_vb, its updates derived by variational message passing (Winn &
Bishop, JMLR 2005). Each cell is one ``probfsl run --method M --preset defaults`` in this
process (:func:`probfsl.cli.main`): 5-way, 75 queries, balanced queries unless
``--balance dirichlet``, seed 0, the same tasks for every method of a setting (the first
n tasks of a run do not depend on the run's length, so a method run on fewer tasks sees
the first tasks of the others). Accuracy ± 95% CI in %.

Data: the built-in Omniglot (PCA-64) and WordNet (MiniLM embeddings of the shared
``wordnet_supersenses`` set, with the library's base/novel split) and, when ``--data-dir``
holds it, the shared 1280-d Omniglot EfficientNet-Lite0 features. Writes
``results/new_method.md`` and keeps the rows in ``results/new_method.json`` (a cell
measured again replaces the stored one)::

    OMP_NUM_THREADS=1 python benchmarks/bench_new_method.py              # everything
    python benchmarks/bench_new_method.py --tasks 200 --slow-tasks 100   # quicker
    python benchmarks/bench_new_method.py --methods bavardage-gamma --merge
    python benchmarks/bench_new_method.py --methods --merge   # the paired rows alone
    python benchmarks/bench_new_method.py --tables-only                  # redo the table

``--slow-tasks`` caps the tasks of gp-tree and em-dirichlet (Gibbs chains and an
iterative Dirichlet fit per task).
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

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()
METHODS = [
    "nearest-centroid",
    "bavardage",
    "bavardage-gamma",
    "em-dirichlet",
    "evidence-lssvm",
    "slem",
    "gp-tree",
]
SLOW = ("gp-tree", "em-dirichlet")
#: the rows of the paired comparison (:func:`paired`)
PAIRED = "paired: bavardage-gamma - bavardage"


def sources(data_dir: Path) -> dict[str, list[str]]:
    """Table name -> the ``probfsl run`` arguments that load the data set."""
    out = {
        "omniglot (built-in, 64-d)": ["--dataset", "omniglot"],
        "wordnet (built-in, 384-d)": ["--dataset", "wordnet"],
    }
    omniglot = data_dir / "omniglot_small" / "omniglot_small_effnetlite0.npz"
    if omniglot.is_file():
        out["omniglot-1280 (shared)"] = ["--features", str(omniglot)]
    return out


def paired(source: list[str], shot: int, n_tasks: int, balance: str) -> dict:
    """``bavardage-gamma`` minus ``bavardage`` on the same tasks (float32, defaults, the
    tasks of ``probfsl run``: seed 0, 75 queries): the mean per-task accuracy difference
    ± its 95% interval, in points, and each method's mean share of the queries given to
    its most predicted class (balanced queries: 20%), a sign of one class absorbing others."""
    from probfsl import make_estimator
    from probfsl.data import load_dataset, load_features, sample_episodes
    from probfsl.evaluation import accuracy_ci

    flag, name = source
    fs = load_dataset(name) if flag == "--dataset" else load_features(name)
    tasks = sample_episodes(fs, n_tasks, way=5, shot=shot, n_query=75, balance=balance, seed=0)
    correct, share = {}, {}
    for method in ("bavardage", "bavardage-gamma"):
        est = make_estimator(method).fit_featureset(fs)
        probs = torch.cat([est.predict_proba(tasks[i : i + 250]) for i in range(0, n_tasks, 250)])
        correct[method] = (probs.argmax(-1) == tasks.query_labels).double().mean(1)
        counts = torch.nn.functional.one_hot(probs.argmax(-1), tasks.way).sum(1)
        share[method] = float(100 * (counts.amax(-1) / counts.sum(-1)).double().mean())
    mean, half = accuracy_ci((correct["bavardage-gamma"] - correct["bavardage"]).numpy())
    return {"difference": mean, "ci95": half, "tasks": n_tasks, "largest_share": share}


def run_cell(source: list[str], method: str, extra: list[str]) -> dict:
    """One ``probfsl run --preset defaults`` in this process; its result row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        tic = time.perf_counter()
        args = ["run", "--method", method, "--preset", "defaults", *source, *extra]
        code = probfsl([*args, "--out", str(out)])
        if code != 0:
            raise ValueError(f"probfsl {' '.join(args)}: exit status {code}")
        row = json.loads(out.read_text())
    row["wall_seconds"] = time.perf_counter() - tic
    return row


def table(rows: list[dict]) -> str:
    """The results page: one row per (data, shot), one column per method."""
    cells = {(r["data"], r["shot"], r["method"]): r for r in rows}
    settings = sorted({(r["data"], r["shot"]) for r in rows}, key=lambda k: (k[0], k[1]))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    lines = [
        "# A method none of the papers ran: BAVARDAGE with per-class Gamma precisions",
        "",
        "`bavardage-gamma` (`probfsl/models/bavardage_gamma.py`) is BAVARDAGE's PLDA-projected",
        "variational Gaussian mixture (Hu, Pateux & Gripon, AISTATS 2023) with a diagonal",
        "precision per class, τ_k ~ Π_d Gamma(a0 = 10, a0 / T_vb), learnt instead of the fixed",
        "T_vb; its updates are derived by variational message passing (Winn & Bishop, 2005)",
        "from its Pyro declaration. Every method runs at its own defaults",
        "(`probfsl run --method M --preset defaults`), 5-way, 75 balanced queries, seed 0,",
        "float32 on the CPU; accuracy ± 95% CI (%) over the number of tasks in brackets",
        "(the first n tasks of the same run for every method). Written by",
        "`benchmarks/bench_new_method.py`.",
        "",
    ]

    def table(cell) -> list[str]:
        """One row per setting, one column per method, ``cell(result)`` in each."""
        out = ["| data | shot | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
        for data, shot in settings:
            row = [data, str(shot)]
            for m in methods:
                r = cells.get((data, shot, m))
                row.append("" if r is None else cell(r))
            out.append("| " + " | ".join(row) + " |")
        return out

    lines += table(lambda r: f"{r['accuracy']:.2f} ± {r['ci95']:.2f} ({r['tasks']})")
    diffs = sorted((k, r) for k, r in cells.items() if k[2] == PAIRED)
    if diffs:
        lines += [
            "",
            "Paired: bavardage-gamma minus bavardage on the same tasks (mean per-task accuracy",
            "difference in points ± 95% CI; float32, both at their defaults), and the mean",
            "share of a task's queries given to its most predicted class (the queries are",
            "balanced: 20% is right; more means a class absorbs others):",
            "",
            "| data | shot | difference | tasks | largest class, bavardage | "
            "largest class, bavardage-gamma |",
            "|---|---|---|---|---|---|",
        ]
        for (data, shot, _), r in diffs:
            diff = f"{r['difference']:+.2f} ± {r['ci95']:.2f}"
            share = r.get("largest_share", {})
            cols = [
                f"{share[m]:.1f}%" if m in share else "" for m in ("bavardage", "bavardage-gamma")
            ]
            lines.append(f"| {data} | {shot} | {diff} | {r['tasks']} | {' | '.join(cols)} |")
        lines += [
            "",
            "A class whose learnt precision is lower than its neighbours' claims the queries",
            "between them, which one shared fixed T_vb prevents; a0 -> infinity gives BAVARDAGE",
            "back (tests/test_bavardage_gamma.py).",
        ]
    lines += [
        "",
        "Seconds per cell (wall clock, including fit_base; 2 shared CPU cores):",
        "",
    ]
    lines += table(lambda r: f"{r['wall_seconds']:.0f}")
    return "\n".join(lines) + "\n"


def save(rows: list[dict], stored: Path) -> list[dict]:
    """The rows, a cell measured again replacing the stored one, written to ``stored``."""
    rows = list({(r["data"], r["shot"], r["method"]): r for r in rows}.values())
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--slow-tasks", type=int, default=300, help="gp-tree, em-dirichlet")
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--balance", choices=["balanced", "dirichlet"], default="balanced")
    parser.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS)
    parser.add_argument("--data", nargs="+", help="only these data sets (their table names)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--merge", action="store_true", help="keep the stored rows")
    parser.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also bavardage-gamma minus bavardage on the same tasks (Python API)",
    )
    parser.add_argument("--tables-only", action="store_true", help="rewrite the table only")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("PROBFSL_BENCH_THREADS", "1")))
    stored = args.out / "new_method.json"
    keep = args.merge or args.tables_only
    rows = json.loads(stored.read_text()) if keep and stored.is_file() else []
    if not args.tables_only:
        chosen = {
            k: v for k, v in sources(args.data_dir).items() if not args.data or k in args.data
        }
        for data, source in chosen.items():
            for shot in args.shots:
                for method in args.methods:
                    tasks = args.slow_tasks if method in SLOW else args.tasks
                    extra = ["--shot", str(shot), "--balance", args.balance]
                    row = run_cell(source, method, [*extra, "--tasks", str(tasks)])
                    row.update(data=data, method=method, shot=shot)
                    rows.append(row)
                    print(f"{data} {shot}-shot {method}: {row['accuracy']:.2f} ± {row['ci95']:.2f}")
                    rows = save(rows, stored)
                if args.paired:
                    tic = time.perf_counter()
                    row = paired(source, shot, args.tasks, args.balance)
                    row.update(data=data, method=PAIRED, shot=shot)
                    row["wall_seconds"] = time.perf_counter() - tic
                    print(
                        f"{data} {shot}-shot {PAIRED}: {row['difference']:+.2f} ± {row['ci95']:.2f}"
                    )
                    rows = save(rows + [row], stored)
    (args.out / "new_method.md").write_text(table(rows))


if __name__ == "__main__":
    main()
