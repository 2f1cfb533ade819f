"""Derived against hand-written engines: label agreement and time, per method.

    python benchmarks/bench_derived.py [--tasks 1000] [--methods bavardage slem ...]
        [--features PATH ...] [--threads 1]

For every method with two engines (``engine="handwritten"`` and ``engine="derived"``,
:mod:`probfsl.derived`) and every data set (the built-in ``omniglot`` and ``wordnet``, and
any ``--features`` file with base classes), both engines of the same estimator, at its
default hyperparameters, fitted on the same base classes, classify the same 5-way 1- and
5-shot tasks (75 queries, float64). Reported: the share of query labels (argmax) on which
the two agree, the largest difference of a query probability, and the CPU (process) time
of each engine's ``predict_proba`` (best of ``--rounds``, the engines alternating; the
derived time includes deriving its plan from the model). SLEM's derived engine forms the
second moment of every negative's score under every exemplar's q(ω), n d² per class of a
task, so it runs on ``--slem-tasks`` tasks (default 20) and only on features of at most
``--slem-max-dim`` dimensions (default 512). GP-Tree's derived engine is that of
its VI nodes in the class-incremental estimator: ``--gp-tree-classes`` novel Omniglot classes
(10 training images each) fitted by both engines, the other images labelled (``max prob.
diff`` is not reported there). The few-shot ``gp-tree`` compares block-Gibbs samples of its
nodes (hand-written) with the mean-field posterior VMP derives for the same node model, so
its rows measure two inferences of one model, not one inference twice.

Results go to ``benchmarks/results/derived.md`` and ``derived.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _threads_from_argv() -> str:
    argv = sys.argv[1:]
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
    return "1"


for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = _threads_from_argv()

import torch  # noqa: E402

from probfsl import make_estimator  # noqa: E402
from probfsl.data import load_dataset, sample_episodes  # noqa: E402
from probfsl.data.loaders import load_features  # noqa: E402

RESULTS = Path(__file__).parent / "results"
METHODS = ("bavardage", "em-dirichlet", "evidence-lssvm", "slem", "gp-tree")


def compare(method: str, fs, tasks, rounds: int) -> dict:
    """Both engines of ``method`` on ``tasks``: agreement, largest difference, CPU times."""
    probs, best = {}, {}
    estimators = {
        e: make_estimator(method, engine=e).fit_featureset(fs, torch.float64)
        for e in ("handwritten", "derived")
    }
    for _ in range(rounds):
        for engine, est in estimators.items():
            tic = time.process_time()
            probs[engine] = est.predict_proba(tasks)
            best[engine] = min(best.get(engine, float("inf")), time.process_time() - tic)
    hand, ours = probs["handwritten"], probs["derived"]
    return dict(
        agree=(hand.argmax(-1) == ours.argmax(-1)).double().mean().item(),
        max_diff=(hand - ours).abs().max().item(),
        hand_s=best["handwritten"],
        derived_s=best["derived"],
        accuracy_derived=(ours.argmax(-1) == tasks.query_labels).double().mean().item(),
    )


def compare_gp_tree(fs, n_classes: int, per_class: int, rounds: int) -> dict:
    """GP-Tree's VI nodes (the class-incremental :class:`~probfsl.models.gp_tree.GPTree`,
    ``inference="vi"``): both engines fit the same ``n_classes`` novel classes of ``fs``
    (``per_class`` training images each, the rest as test points) and label the rest."""
    from probfsl.models.gp_tree import GPTree

    x, y = fs.novel(torch.float64)
    keep = y < y.unique()[n_classes] if n_classes < len(y.unique()) else y >= 0
    x, y = x[keep], y[keep]
    first = torch.zeros_like(y, dtype=torch.bool)
    for c in y.unique():
        first[(y == c).nonzero()[:per_class, 0]] = True
    labels, best = {}, {}
    for _ in range(rounds):
        for engine in ("handwritten", "derived"):
            tic = time.process_time()
            est = GPTree(engine=engine).fit(x[first], y[first])
            labels[engine] = est.predict(x[~first])
            best[engine] = min(best.get(engine, float("inf")), time.process_time() - tic)
    hand, ours = labels["handwritten"], labels["derived"]
    return dict(
        agree=(hand == ours).double().mean().item(),
        max_diff=float("nan"),
        hand_s=best["handwritten"],
        derived_s=best["derived"],
        accuracy_derived=(ours == y[~first]).double().mean().item(),
    )


def _key(row: dict) -> tuple:
    return row["method"], row["data"], row["shot"]


def write(rows: list[dict], threads: str, rounds: int) -> None:
    """The table so far into ``derived.md`` and ``derived.json``."""
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        "# Derived against hand-written engines",
        "",
        "Generated by `benchmarks/bench_derived.py`: both engines of each estimator at its",
        "default hyperparameters on the same 5-way tasks (75 queries, float64, seed 0),",
        f"{threads} thread(s), CPU (process) time of `predict_proba`, best of",
        f"{rounds} round(s); the derived time includes deriving the plan. Shared",
        f"machine, {os.cpu_count()} cores, load average after the run {load}.",
        "",
        "| method | data | shot | tasks | labels agree | max prob. diff | hand-written s | "
        "derived s | derived / hand-written |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['data']} ({r['dim']}-d) | {r['shot']} | {r['tasks']} | "
            f"{100 * r['agree']:.2f}% | {r['max_diff']:.1e} | {r['hand_s']:.2f} | "
            f"{r['derived_s']:.2f} | {r['derived_s'] / r['hand_s']:.2f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "derived.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "derived.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--slem-tasks", type=int, default=20)
    parser.add_argument("--slem-max-dim", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--datasets", nargs="+", default=["omniglot", "wordnet"])
    parser.add_argument("--features", nargs="*", default=[], help=".npz files with base classes")
    parser.add_argument(
        "--gp-tree-classes", type=int, default=30, help="novel classes for GP-Tree (0: skip)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--merge", action="store_true", help="keep the stored rows of others")
    parser.add_argument("--threads", default="1")
    args = parser.parse_args()
    torch.set_num_threads(int(args.threads))
    sets = [(name, load_dataset(name)) for name in args.datasets]
    sets += [(Path(p).stem, load_features(p)) for p in args.features]
    stored = RESULTS / "derived.json"
    rows = json.loads(stored.read_text()) if args.merge and stored.is_file() else []
    for name, fs in sets:
        for shot in (1, 5):
            for method in args.methods:
                if method == "slem" and fs.dim > args.slem_max_dim:
                    continue  # q(ω) is d x d per class of a task
                n = args.slem_tasks if method == "slem" else args.tasks
                tasks = sample_episodes(fs, n, way=5, shot=shot, n_query=75, seed=0)
                row = compare(method, fs, tasks.to(dtype=torch.float64), args.rounds)
                row.update(method=method, data=name, dim=fs.dim, shot=shot, tasks=n)
                print(row, flush=True)
                rows = [r for r in rows if _key(r) != _key(row)] + [row]
                write(rows, args.threads, args.rounds)
    if args.gp_tree_classes:
        fs = load_dataset("omniglot")
        row = compare_gp_tree(fs, args.gp_tree_classes, 10, max(2, args.rounds))
        row.update(method="gp-tree (VI nodes)", data="omniglot", dim=fs.dim, shot=10)
        row.update(tasks=f"{args.gp_tree_classes} classes")
        print(row, flush=True)
        rows = [r for r in rows if _key(r) != _key(row)] + [row]
        write(rows, args.threads, args.rounds)


if __name__ == "__main__":
    main()
