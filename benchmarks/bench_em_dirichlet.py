"""Benchmark EM-Dirichlet (Martin et al., CVPR 2024) on WordNet supersenses (MiniLM).

Zero-shot (the paper's protocol): k ~ U{3..10} classes from all 41, |Q| = 75 queries
pooled from them; probabilities x = softmax(T cos(sentence, class description)) over
all 41 classes (T = 30). Methods, all scored after Hungarian cluster-to-class matching
except the argmax baseline:

* argmax of the probabilities (the inductive baseline),
* hard and soft k-means on the simplex (initialised like EM-Dirichlet from R = X;
  soft: r = softmax(-T_km ||x - mu||^2), T_km = 10; 20 passes),
* EM-Dirichlet soft and hard with the library defaults (lambda/|Q| = floor(K/5) = 8, the
  reference code's value; zero-shot inner loop ``BOUNDED_MM``: at most 20 MM iterations per
  outer iteration),
* the same in the reference code's inner loop (1000 iterations, checked every 50;
  ``REFERENCE_MM``) on the first ``--reference-tasks`` tasks, paired with the default mode
  on exactly those tasks (accuracy difference with a paired 95% CI),
* an ablation over lambda and the temperature T (``--ablation-*``; the results file
  ``em_dirichlet_ablation.md`` comes from ``--ablation-only --tag ablation``),
* ``--speed-threads 1 2``: the zero-shot defaults timed with 1 and 2 torch threads,
* ``--solver-compare N``: the inner solvers on N tasks of the built-in WordNet data
  (few-shot 5-way 5-shot from support prototypes, and zero-shot), soft and hard, float64
  and float32: the reference MM loop (``REFERENCE_MM`` few-shot, ``BOUNDED_MM``
  zero-shot) against the safeguarded Newton loop (``NEWTON``), tasks/s with one thread in
  the same process, label agreement, and whether every differing task had a class row
  that MM left unconverged at its cap (``em_dirichlet_solvers.{json,md}``; nothing else),
* ``--base-selection N``: (T, n_iter) chosen per variant on N zero-shot tasks drawn from
  the 21 base classes only (outputs still over all 41 classes), then scored against the
  defaults and argmax on novel-class-only tasks and on the main tasks.

Few-shot: 5-way 1-shot and 5-shot, 75 balanced queries on the 20 novel classes:
nearest centroid, soft k-means (the lead's baselines), BAVARDAGE if it imports, and
EM-Dirichlet soft/hard on probabilities from support-mean prototypes (centred on the
base mean) and from the class-description embeddings plus the support (few-shot default:
the safeguarded Newton inner loop ``NEWTON``; the bounded MM loop is shown for comparison).

All methods run in the same process on the same tasks, so ratios are meaningful on a
busy machine; absolute timings are pessimistic. ``--threads`` sets torch's intra-op
threads (default 1: on an oversubscribed 2-core machine two OpenMP threads made the
MM loop ~50x slower).

    python benchmarks/bench_em_dirichlet.py [--data-dir DIR] [--tasks 1000] [--quick]
    python benchmarks/bench_em_dirichlet.py --tasks 1000 --few-shot-tasks 500 \
        --ablation-tasks 0 --speed-threads 1 2 --base-selection 300
    python benchmarks/bench_em_dirichlet.py --ablation-only --tasks 1000 \
        --ablation-tasks 1000 --ablation-lambdas 0 1 -1 16 \
        --ablation-temperatures 10 20 50 --ablation-soft --tag ablation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from probfsl.data.builtin import wordnet_base_classes
from probfsl.data.loaders import load_npz
from probfsl.data.simplex import zero_shot_probabilities
from probfsl.data.tasks import sample_episodes, sample_zero_shot_tasks
from probfsl.evaluation.protocol import evaluate
from probfsl.evaluation.zero_shot import evaluate_zero_shot
from probfsl.models.em_dirichlet import BOUNDED_MM, REFERENCE_MM, EMDirichlet, match_clusters
from probfsl.models.nearest_centroid import NearestCentroid
from probfsl.models.soft_kmeans import SoftKMeans

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()

# paper Table 3: seconds per task (ImageNet 4-shot, GPU, tol 1e-13)
PAPER_TABLE3 = {
    "Algorithm 1 alone, MM-quadratic": 0.0762,
    "Algorithm 1 alone, Minka": 0.204,
    "Algorithm 2, EM-Dirichlet": 1.04,
    "Algorithm 2, Minka inner solver": 2.09,
    "Hard EM-Dirichlet (Table 2)": 0.697,
}


class ZeroShotArgmax:
    """The inductive baseline: argmax of the probabilities."""

    def predict_zero_shot(self, probs: torch.Tensor) -> torch.Tensor:
        return probs.argmax(-1)


class SimplexKMeans:
    """Hard or soft k-means on the probability vectors, K clusters, started from R = X."""

    def __init__(self, hard: bool, temperature: float = 10.0, n_iter: int = 20) -> None:
        self.hard, self.temperature, self.n_iter = hard, temperature, n_iter

    def predict_zero_shot(self, probs: torch.Tensor) -> torch.Tensor:
        r = probs
        k = probs.shape[-1]
        centroids = None
        for _ in range(self.n_iter):
            weight = r.sum(1)
            means = r.transpose(1, 2) @ probs / weight.clamp_min(1e-15).unsqueeze(-1)
            if centroids is None:
                centroids = means
            else:  # empty clusters keep their centroid
                centroids = torch.where((weight > 1e-15).unsqueeze(-1), means, centroids)
            dist = torch.cdist(probs, centroids).square()
            if self.hard:
                r = torch.nn.functional.one_hot(dist.argmin(-1), k).to(probs.dtype)
            else:
                r = torch.softmax(-self.temperature * dist, -1)
        return match_clusters(r.argmax(-1), probs)


def cluster_stats(est, probs: torch.Tensor, labels: torch.Tensor) -> dict:
    """Why zero-shot EM-Dirichlet can fall below argmax: over-segmentation and degenerate
    clusters. Uses ``est.state_`` / ``est.trace_`` of the last batch (all tasks when they fit
    in one batch)."""
    state, trace = est.state_, est.trace_
    n = state.r.shape[0]
    clusters = state.query_r.argmax(-1)
    sizes = torch.nn.functional.one_hot(clusters, probs.shape[-1]).sum(1)
    member = sizes.gather(1, clusters)
    correct = match_clusters(clusters, probs[-n:]) == labels[-n:]
    single = member == 1
    last = (trace[-1] - trace[-2]).abs() / trace[-2].abs()
    return {
        "tasks": n,
        "non_empty_clusters_per_task": sizes.gt(0).sum(1).float().mean().item(),
        "singleton_clusters_per_task": sizes.eq(1).sum(1).float().mean().item(),
        "queries_in_singletons": single.float().mean().item(),
        "accuracy_in_singletons": correct[single].float().mean().item(),
        "accuracy_in_clusters_of_5_or_more": correct[member >= 5].float().mean().item(),
        "objective_still_decreasing": (trace[-1] < trace[-2]).float().mean().item(),
        "median_relative_objective_change_last_step": last.median().item(),
        "max_alpha_sum": state.alpha.sum(-1).max().item(),
        "distinct_argmax_classes_per_task": float(
            np.mean([len(torch.unique(t)) for t in probs[-n:].argmax(-1)])
        ),
    }


def base_selection(fs, args, probs, labels, tasks) -> list[dict]:
    """Choose (T, n_iter) per variant on zero-shot tasks drawn from the 21 base classes only
    (outputs still over all 41 classes), then score the choice on novel-only tasks and on
    the main tasks (no novel-class label is used for the choice)."""
    base = wordnet_base_classes()
    out = []
    grid_t, grid_iter = (10.0, 20.0, 30.0, 50.0), (1, 2, 5, 10, 20)
    split_tasks = {}
    for split, keep in (("base", np.isin(fs.labels, base)), ("novel", ~np.isin(fs.labels, base))):
        sub = replace(fs, labels=np.where(keep, fs.labels, -1))
        n = args.base_selection if split == "base" else probs.shape[0]
        split_tasks[split] = sample_zero_shot_tasks(sub, n, seed=args.seed + 1)
    chosen = {}
    bt = split_tasks["base"]
    for temp in grid_t:
        p = zero_shot_probabilities(fs, bt, temp)
        for hard in (True, False):
            for n_iter in grid_iter:
                name = ("Hard " if hard else "") + "EM-Dirichlet"
                est = EMDirichlet(hard=hard, n_iter=n_iter)
                res = evaluate_zero_shot(est, p, bt.query_labels, args.batch_size)
                st = cluster_stats(est, p, bt.query_labels)
                label = (
                    f"{name}, T={temp:g}, n_iter={n_iter} "
                    f"[{st['non_empty_clusters_per_task']:.1f} clusters, "
                    f"{st['singleton_clusters_per_task']:.1f} singletons per task]"
                )
                out.append(row("zero-shot, base-class tasks (selection grid)", label, res))
                tqdm.write(f"base-class selection {label}: {res}")
                if name not in chosen or res.accuracy > chosen[name][0]:
                    chosen[name] = (res.accuracy, temp, n_iter)
    nt = split_tasks["novel"]
    novel_probs = {}
    for split, tk in (("novel-class tasks", nt), ("main tasks", tasks)):
        p30 = zero_shot_probabilities(fs, tk, args.temperature)[: probs.shape[0]]
        lab = tk.query_labels[: probs.shape[0]]
        res = evaluate_zero_shot(ZeroShotArgmax(), p30, lab)
        out.append(row(f"zero-shot, chosen on base classes: {split}", "argmax (inductive)", res))
        for name, (acc, temp, n_iter) in chosen.items():
            key = (split, temp)
            if key not in novel_probs:
                novel_probs[key] = zero_shot_probabilities(fs, tk, temp)[: probs.shape[0]]
            for label, est in (
                (f"{name}, defaults (T={args.temperature:g})", EMDirichlet(hard="Hard" in name)),
                (
                    f"{name}, T={temp:g}, n_iter={n_iter} (base acc {acc:.2f})",
                    EMDirichlet(hard="Hard" in name, n_iter=n_iter),
                ),
            ):
                pp = p30 if "defaults" in label else novel_probs[key]
                res, cpu = timed(evaluate_zero_shot, est, pp, lab)
                out.append(row(f"zero-shot, chosen on base classes: {split}", label, res, cpu=cpu))
                tqdm.write(f"{split} {label}: {res}")
    return out


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg": list(os.getloadavg()),
    }


def timed(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the process CPU seconds it took (load-independent-ish)."""
    tic = time.process_time()
    out = fn(*args, **kwargs)
    return out, time.process_time() - tic


def row(setting: str, method: str, res, note: str = "", cpu: float | None = None) -> dict:
    return {
        "cpu_seconds": cpu,
        "setting": setting,
        "method": method,
        "accuracy": res.accuracy,
        "ci95": res.ci95,
        "tasks_per_second": res.tasks_per_second,
        "seconds": res.seconds,
        "n_tasks": res.n_tasks,
        "note": note,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", type=int, default=1000, help="zero-shot and few-shot tasks")
    parser.add_argument(
        "--em-tasks",
        type=int,
        default=None,
        help="tasks for the zero-shot EM-Dirichlet runs (default: --tasks)",
    )
    parser.add_argument("--ablation-tasks", type=int, default=50)
    parser.add_argument(
        "--reference-tasks",
        type=int,
        default=100,
        help="tasks for the reference inner loop (1000 MM its) vs the default, paired",
    )
    parser.add_argument(
        "--ablation-lambdas",
        nargs="*",
        type=float,
        default=[0.0, 1.0, -1.0],
        help="lambda/|Q| values at T (-1 = the default floor(K/5))",
    )
    parser.add_argument(
        "--ablation-temperatures",
        nargs="*",
        type=float,
        default=[10.0, 50.0],
        help="temperatures tried with the default lambda (hard variant unless --ablation-soft)",
    )
    parser.add_argument("--ablation-soft", action="store_true")
    parser.add_argument(
        "--speed-threads",
        nargs="*",
        type=int,
        default=[],
        help="also time soft and hard EM-Dirichlet on the zero-shot tasks with these torch "
        "thread counts (e.g. 1 2), same process",
    )
    parser.add_argument(
        "--base-selection",
        type=int,
        default=0,
        help="tasks for choosing (T, n_iter) on zero-shot tasks drawn from the 21 base "
        "classes only; the choice is then scored on novel-class-only tasks and on the main "
        "tasks (0 = skip)",
    )
    parser.add_argument(
        "--solver-compare",
        type=int,
        default=0,
        help="compare the MM and Newton inner solvers on this many built-in WordNet tasks "
        "per setting, then stop (0 = skip)",
    )
    parser.add_argument("--ablation-only", action="store_true", help="skip the main tables")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument(
        "--few-shot-tasks", type=int, default=None, help="few-shot tasks (default: --tasks)"
    )
    parser.add_argument("--temperature", type=float, default=30.0)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-few-shot", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run (few tasks)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.ablation_tasks, args.reference_tasks = 20, 0, 5
    em_tasks = min(args.em_tasks or args.tasks, args.tasks)
    fs_tasks = args.few_shot_tasks or args.tasks
    torch.set_num_threads(args.threads)
    import scipy.optimize  # noqa: F401  (imported before any timing)

    load_before = os.getloadavg()
    if args.solver_compare:
        return solver_compare(args.solver_compare, args.out, args.seed)

    fs = load_npz(
        args.data_dir / "wordnet_supersenses" / "wordnet_supersenses_minilm.npz",
        name="wordnet",
        base_classes=wordnet_base_classes(),
    )
    rows: list[dict] = []

    # -- zero-shot ------------------------------------------------------------------------
    tasks = sample_zero_shot_tasks(fs, args.tasks, seed=args.seed)
    probs = zero_shot_probabilities(fs, tasks, args.temperature)
    labels = tasks.query_labels
    methods = [
        ("argmax (inductive)", ZeroShotArgmax(), args.tasks),
        ("hard k-means (simplex)", SimplexKMeans(hard=True), args.tasks),
        ("soft k-means (simplex)", SimplexKMeans(hard=False), args.tasks),
        ("Hard EM-Dirichlet", EMDirichlet(hard=True), em_tasks),
        ("EM-Dirichlet", EMDirichlet(), em_tasks),
    ]
    if em_tasks < args.tasks:  # the baseline on exactly EM-Dirichlet's tasks, for pairing
        methods.insert(1, ("argmax (inductive), EM-Dirichlet's tasks", ZeroShotArgmax(), em_tasks))
    if args.ablation_only:
        methods = []
    diagnostics = {}
    for name, est, n in tqdm(methods, desc="zero-shot"):
        res, cpu = timed(
            evaluate_zero_shot, est, probs[:n], labels[:n], args.batch_size, progress=True
        )
        rows.append(row("zero-shot", name, res, cpu=cpu))
        tqdm.write(f"zero-shot {name}: {res}")
        if isinstance(est, EMDirichlet):
            diagnostics[name] = cluster_stats(est, probs[:n], labels[:n])
    # thread counts (the target: 1,000 zero-shot tasks in < 10 s on 2 CPU cores)
    for threads in args.speed_threads:
        torch.set_num_threads(threads)
        for name, est in (
            ("Hard EM-Dirichlet", EMDirichlet(hard=True)),
            ("EM-Dirichlet", EMDirichlet()),
        ):
            res, cpu = timed(evaluate_zero_shot, est, probs[:em_tasks], labels[:em_tasks])
            rows.append(row(f"zero-shot speed, {threads} thread(s)", name, res, cpu=cpu))
            tqdm.write(f"{threads} thread(s) {name}: {res}")
    torch.set_num_threads(args.threads)
    if args.base_selection:
        rows += base_selection(fs, args, probs[:em_tasks], labels[:em_tasks], tasks)
    # reference inner loop (1000 MM its every outer iteration) vs the default, same tasks
    paired = []
    n_ref = min(args.reference_tasks, args.tasks) if not args.ablation_only else 0
    for hard in (True, False) if n_ref else ():
        name = ("Hard " if hard else "") + "EM-Dirichlet"
        per = {}
        for mode, kwargs in (("reference inner loop 1000/50", REFERENCE_MM), ("default", {})):
            est = EMDirichlet(hard=hard, **kwargs)
            res, cpu = timed(evaluate_zero_shot, est, probs[:n_ref], labels[:n_ref])
            rows.append(row("zero-shot, reference vs default", f"{name}, {mode}", res, cpu=cpu))
            per[mode] = res.per_task_accuracy
            tqdm.write(f"{name} {mode}: {res}")
        diff = 100 * (per["default"] - per["reference inner loop 1000/50"])
        ci = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        paired.append({"method": name, "n_tasks": len(diff), "diff": diff.mean(), "ci95": ci})
    # ablation: lambda / |Q| and temperature, on the first tasks
    if args.ablation_tasks:
        n = min(args.ablation_tasks, args.tasks)
        grid = [("argmax", None, args.temperature)]
        for hard in (True, False):
            for coef in args.ablation_lambdas:
                coef = None if coef < 0 else coef
                grid.append(
                    (("Hard " if hard else "") + "EM-Dirichlet", (hard, coef), args.temperature)
                )
        for temp in args.ablation_temperatures:
            grid.append(("Hard EM-Dirichlet", (True, None), temp))
            if args.ablation_soft:
                grid.append(("EM-Dirichlet", (False, None), temp))
        cache = {args.temperature: probs[:n]}
        for name, cfg, temp in tqdm(grid, desc="ablation"):
            if temp not in cache:
                cache[temp] = zero_shot_probabilities(fs, tasks, temp)[:n]
            if cfg is None:
                est, label = ZeroShotArgmax(), f"argmax, T={temp:g}"
            else:
                est = EMDirichlet(hard=cfg[0], lambda_coef=cfg[1])
                coef = est.make_engine().coef(fs.n_classes)
                label = f"{name}, lambda/|Q|={coef:g}, T={temp:g}"
            res, cpu = timed(evaluate_zero_shot, est, cache[temp], labels[:n], args.batch_size)
            rows.append(row("zero-shot ablation", label, res, cpu=cpu))
            tqdm.write(f"ablation {label}: {res}")

    # -- few-shot -------------------------------------------------------------------------
    if not (args.skip_few_shot or args.ablation_only):
        base = fs.base()
        peers = [
            ("nearest centroid", lambda: NearestCentroid()),
            ("soft k-means", lambda: SoftKMeans()),
            ("EM-Dirichlet (support prototypes)", lambda: EMDirichlet()),
            ("EM-Dirichlet (support prototypes), bounded loop", lambda: EMDirichlet(**BOUNDED_MM)),
            ("Hard EM-Dirichlet (support prototypes)", lambda: EMDirichlet(hard=True)),
            (
                "EM-Dirichlet (class descriptions + support)",
                lambda: EMDirichlet().set_class_features(
                    torch.as_tensor(fs.class_features).float()
                ),
            ),
        ]
        try:
            from probfsl.models.bavardage import Bavardage

            peers.insert(2, ("BAVARDAGE", lambda: Bavardage()))
        except Exception as err:  # BAVARDAGE is another developer's module
            tqdm.write(f"BAVARDAGE unavailable: {err}")
        for shot in (1, 5):
            episodes = sample_episodes(fs, fs_tasks, 5, shot, 75, seed=args.seed)
            for name, make in tqdm(peers, desc=f"{shot}-shot"):
                est = make()
                if est.needs_base:
                    est.fit_base(*base)
                res, cpu = timed(evaluate, est, episodes, args.batch_size, progress=True)
                rows.append(row(f"5-way {shot}-shot", name, res, cpu=cpu))
                tqdm.write(f"{shot}-shot {name}: {res}")

    results = {
        "dataset": "wordnet (MiniLM-L6, 41 classes; class-description embeddings)",
        "temperature": args.temperature,
        "tasks": args.tasks,
        "em_tasks": em_tasks,
        "seed": args.seed,
        "rows": rows,
        "paired_default_minus_reference": paired,
        "zero_shot_cluster_diagnostics": diagnostics,
        "paper_table3_seconds_per_task": PAPER_TABLE3,
        "machine": {**machine(), "loadavg_before": list(load_before)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "em_dirichlet" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))
    return results


def solver_compare(n_tasks: int, out: Path, seed: int = 0) -> dict:
    """MM (the modes' reference loops) against Newton (``NEWTON``) on the built-in WordNet
    data; see the module docstring. Inner iteration counts are recorded per outer step by
    wrapping :func:`probfsl.inference.dirichlet_mm.mm_dirichlet_fit`."""
    import probfsl.inference.dirichlet_mm as dm
    from probfsl.data.builtin import load_dataset
    from probfsl.models.em_dirichlet import NEWTON

    fit, record = dm.mm_dirichlet_fit, []

    def recording_fit(*a, **kw):
        alpha, iters = fit(*a, **kw)
        record.append(iters)
        return alpha, iters

    dm.mm_dirichlet_fit = recording_fit
    fs = load_dataset("wordnet")
    zs = sample_zero_shot_tasks(fs, n_tasks, 3, 10, 75, seed)
    rows = []
    try:
        for dtype in (torch.float64, torch.float32):
            episodes = sample_episodes(fs, n_tasks, 5, 5, 75, seed=seed, dtype=dtype)
            probs = zero_shot_probabilities(fs, zs, 30.0, dtype)
            base = fs.base(dtype=dtype)
            for few, hard in ((True, False), (True, True), (False, False), (False, True)):
                truth = (episodes.query_labels if few else zs.query_labels).numpy()
                res = {}
                for solver in ("mm", "newton"):
                    est = EMDirichlet(hard=hard, solver=solver)
                    record.clear()
                    tic = time.perf_counter()
                    if few:
                        labels = est.fit_base(*base).predict_proba(episodes).argmax(-1)
                    else:
                        labels = est.predict_zero_shot(probs)
                    seconds = time.perf_counter() - tic
                    cap = est.mm_options(not few)["mm_max_iter"]
                    iters = torch.stack(record)
                    res[solver] = (labels.numpy(), seconds, iters, cap)
                (lm, sm, im, cm), (ln, sn, inn, cn) = res["mm"], res["newton"]
                unconverged = (im >= cm).any(-1).any(0).numpy()
                differ = lm != ln
                tasks = differ.any(1)
                paired = (ln == truth).mean(1) - (lm == truth).mean(1)
                rows.append(
                    {
                        "setting": ("5-way 5-shot" if few else "zero-shot")
                        + (" hard" if hard else " soft"),
                        "dtype": str(dtype).removeprefix("torch."),
                        "mm_tasks_per_s": n_tasks / sm,
                        "newton_tasks_per_s": n_tasks / sn,
                        "queries_differing": int(differ.sum()),
                        "queries": int(differ.size),
                        "tasks_differing": int(tasks.sum()),
                        "tasks_differing_with_mm_row_at_cap": int((tasks & unconverged).sum()),
                        "tasks_with_mm_row_at_cap": int(unconverged.sum()),
                        "mm_accuracy": float((lm == truth).mean()),
                        "newton_accuracy": float((ln == truth).mean()),
                        "paired_difference": float(paired.mean()),
                        "paired_ci95": float(1.96 * paired.std() / np.sqrt(n_tasks)),
                        "newton_mean_iterations": float(inn.double().mean()),
                        "newton_rows_at_cap": float((inn >= cn).double().mean()),
                    }
                )
                tqdm.write(json.dumps(rows[-1]))
    finally:
        dm.mm_dirichlet_fit = fit
    results = {"tasks": n_tasks, "newton": NEWTON, "machine": machine(), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "em_dirichlet_solvers.json").write_text(json.dumps(results, indent=2))
    head = (
        "| setting | dtype | MM tasks/s | Newton tasks/s | queries differing | tasks differing"
        " (with an MM row at cap) / tasks with an MM row at cap | accuracy MM -> Newton |"
    )
    lines = [f"# EM-Dirichlet inner solvers, {n_tasks} WordNet tasks, 1 thread", "", head]
    lines.append("|" + "---|" * 7)
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['dtype']} | {r['mm_tasks_per_s']:.1f} | "
            f"{r['newton_tasks_per_s']:.1f} | {r['queries_differing']} / {r['queries']} | "
            f"{r['tasks_differing']} ({r['tasks_differing_with_mm_row_at_cap']}) / "
            f"{r['tasks_with_mm_row_at_cap']} | {r['mm_accuracy']:.4f} -> "
            f"{r['newton_accuracy']:.4f} ({r['paired_difference']:+.4f} ± "
            f"{r['paired_ci95']:.4f}) |"
        )
    (out / "em_dirichlet_solvers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# EM-Dirichlet on WordNet supersenses",
        "",
        f"T = {results['temperature']:g}; seed {results['seed']}; accuracy ± 95% CI (%); "
        f"tasks/s and the ratio to the first method of each setting. Zero-shot: "
        f"{results['tasks']} tasks ({results['em_tasks']} for EM-Dirichlet), "
        "3–10 classes, |Q| = 75, all 41 classes as outputs, Hungarian matching.",
        f"Machine: {m['cpus']} CPUs, {m['threads']} torch thread(s), load average "
        f"{m['loadavg_before'][0]:.1f} → {m['loadavg'][0]:.1f} (shared; timings pessimistic).",
        "",
        "tasks/s is wall clock; CPU tasks/s uses the process CPU time (closer to an idle machine).",
        "",
    ]
    header = [
        "| setting | method | tasks | accuracy (%) | tasks/s | CPU tasks/s | s/task "
        "| speed vs first |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first: dict[str, float] = {}
    for r in results["rows"]:
        first.setdefault(r["setting"], r["tasks_per_second"])

    def row(r: dict) -> str:
        cpu = r.get("cpu_seconds")
        cpu_rate = f"{r['n_tasks'] / max(cpu, 1e-9):.3g}" if cpu is not None else "-"
        return (
            f"| {r['setting']} | {r['method']} | {r['n_tasks']} | {r['accuracy']:.2f} ± "
            f"{r['ci95']:.2f} | {r['tasks_per_second']:.3g} | {cpu_rate} | "
            f"{1 / r['tasks_per_second']:.3g} | {r['tasks_per_second'] / first[r['setting']]:.2g} |"
        )

    # the README shows the headline table; the selection grid and checks follow it
    detail = ("selection grid", "reference vs default", "main tasks")
    lines += header + [
        row(r) for r in results["rows"] if not any(d in r["setting"] for d in detail)
    ]
    lines += ["", "<!-- headline end -->", "", "## Selection grid and checks", "", *header]
    lines += [row(r) for r in results["rows"] if any(d in r["setting"] for d in detail)]
    if results.get("paired_default_minus_reference"):
        lines += ["", "Default minus reference inner loop, same tasks (paired, points):", ""]
        lines += [
            f"- {p['method']}: {p['diff']:+.2f} ± {p['ci95']:.2f} ({p['n_tasks']} tasks)"
            for p in results["paired_default_minus_reference"]
        ]
    if results.get("zero_shot_cluster_diagnostics"):
        lines += ["", "Zero-shot cluster diagnostics (defaults, last batch of the main tasks):", ""]
        for name, st in results["zero_shot_cluster_diagnostics"].items():
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in st.items()))
    lines += ["", "Paper Table 3 (ImageNet 4-shot, GPU), seconds per task:", ""]
    lines += [f"- {k}: {v}" for k, v in results["paper_table3_seconds_per_task"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
