"""Benchmark BAVARDAGE against its ablations, simple baselines and scikit-learn.

On the shared real feature sets (Omniglot EfficientNet-Lite0 1280-d and its PCA-64,
WordNet supersense MiniLM 384-d), 5-way 1-shot and 5-shot, 75 queries, balanced and
Dirichlet-unbalanced (alpha* = 2) tasks: accuracy ± 95% CI and tasks per second of

* nearest centroid (inductive), soft k-means (BAVARDAGE's initialiser),
* VB without PLDA (ablation: the mixture in the full preprocessed space), with the
  preset's T_vb and with T_vb = 50 (the published mini-ImageNet value),
* BAVARDAGE with the reference code's per-task whitening (``task_span``) and the paper's
  global whitening (``global``),
* scikit-learn's ``BayesianGaussianMixture`` fitted per task (spherical covariances,
  Dirichlet weights, clusters matched to classes by the support, Hungarian) on a few
  hundred tasks, for the throughput ratio.

All methods run in the same process on the same tasks (the first n tasks of one seeded
run), so ratios are meaningful even on a busy machine; absolute timings are not.

    python benchmarks/bench_bavardage.py [--data-dir DIR] [--tasks 10000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from probfsl.data.builtin import wordnet_base_classes
from probfsl.data.loaders import load_npz
from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes, sample_episodes
from probfsl.evaluation.protocol import EvalResult, accuracy_ci, evaluate
from probfsl.models.bavardage import PRESETS, Bavardage
from probfsl.models.nearest_centroid import NearestCentroid
from probfsl.models.soft_kmeans import SoftKMeans

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()


def load_sets(data_dir: Path, names: list[str]) -> dict:
    files = {
        "omniglot-1280": ("omniglot_small/omniglot_small_effnetlite0.npz", None),
        "omniglot-pca64": ("omniglot_small/omniglot_small_effnetlite0_pca64.npz", None),
        "wordnet": ("wordnet_supersenses/wordnet_supersenses_minilm.npz", wordnet_base_classes()),
    }
    return {n: load_npz(data_dir / files[n][0], name=n, base_classes=files[n][1]) for n in names}


def bgm_predict(episodes: Episodes, base_mean: torch.Tensor, alpha0: float = 2.0) -> np.ndarray:
    """scikit-learn's BayesianGaussianMixture fitted on each task (support + queries).

    Spherical covariances (closest to BAVARDAGE's isotropic components), a Dirichlet
    prior alpha0 on the weights; clusters are matched to the classes by maximising the
    support's summed log-responsibilities (Hungarian).
    """
    from scipy.optimize import linear_sum_assignment
    from sklearn.mixture import BayesianGaussianMixture

    k, n_s = episodes.way, episodes.support.shape[1]
    x = center_and_normalize(torch.cat([episodes.support, episodes.query], 1).double(), base_mean)
    preds = []
    for t in range(episodes.n_tasks):
        xt = x[t].numpy()
        gm = BayesianGaussianMixture(
            n_components=k,
            covariance_type="spherical",
            weight_concentration_prior_type="dirichlet_distribution",
            weight_concentration_prior=alpha0,
            max_iter=100,
            random_state=0,
        ).fit(xt)
        log_resp = np.log(gm.predict_proba(xt) + 1e-300)
        onehot = np.eye(k)[episodes.support_labels[t].numpy()]
        cost = -(onehot.T @ log_resp[:n_s])  # [class, cluster]
        rows, cols = linear_sum_assignment(cost)
        cluster_to_class = np.empty(k, dtype=np.int64)
        cluster_to_class[cols] = rows
        preds.append(cluster_to_class[log_resp[n_s:].argmax(-1)])
    return np.stack(preds)


def evaluate_bgm(episodes: Episodes, base_mean: torch.Tensor) -> EvalResult:
    tic = time.perf_counter()
    pred = bgm_predict(episodes, base_mean)
    seconds = time.perf_counter() - tic
    per_task = (pred == episodes.query_labels.numpy()).mean(-1)
    acc, ci = accuracy_ci(per_task)
    n = len(per_task)
    return EvalResult(acc, ci, seconds, n / seconds, n, per_task)


def machine(load_before: tuple) -> dict:
    """What a timing depends on: platform, torch, threads, CPUs and the load around it."""
    return dict(
        platform=platform.platform(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpus=os.cpu_count(),
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
    )


def paired_throughput(sets: dict, preset: str, n_tasks: int, bgm_tasks: int, rounds: int) -> list:
    """Per-task throughput of BAVARDAGE global against BGM, 5-way 1-shot Dirichlet tasks:
    the two alternate for ``rounds`` rounds on the same tasks and each keeps its fastest
    round, so that a shared machine's load hits both alike. BGM runs with one BLAS
    thread and with torch's thread count, and keeps its faster setting."""
    from threadpoolctl import threadpool_limits

    out = []
    for name, fs in sets.items():
        episodes = sample_episodes(fs, n_tasks, 5, 1, 75, balance="dirichlet", seed=0)
        base = fs.base(torch.float32)
        est = Bavardage(whitening="global", **PRESETS[preset]).fit_base(*base)
        base_mean = base[0].double().mean(0)
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(evaluate(est, episodes).seconds / n_tasks)
            for blas_threads in sorted({1, torch.get_num_threads()}):
                with threadpool_limits(blas_threads):
                    res = evaluate_bgm(episodes[:bgm_tasks], base_mean)
                theirs.append(res.seconds / bgm_tasks)
        out.append(
            dict(
                dataset=name,
                bavardage_tasks_per_second=1 / min(ours),
                bgm_tasks_per_second=1 / min(theirs),
                ratio=min(theirs) / min(ours),
                rounds=rounds,
                tasks=n_tasks,
                bgm_tasks=bgm_tasks,
            )
        )
    return out


def methods(preset: str, extra_presets: list[str]) -> dict:
    """Name -> factory of the compared estimators."""
    p = PRESETS[preset]
    out = {
        "nearest centroid": lambda: NearestCentroid(),
        "soft k-means": lambda: SoftKMeans(temperature=p["temperature_km"]),
        "VB without PLDA": lambda: Bavardage(mode="vb", **p),
        # T_vb = 4 is a PLDA-space value: on unit-norm features VB collapses onto one
        # cluster; 50 is the published mini-ImageNet T_vb (not tuned on these tasks)
        "VB without PLDA [T_vb=50]": lambda: Bavardage(mode="vb", **{**p, "temperature_vb": 50.0}),
        "BAVARDAGE task_span": lambda: Bavardage(whitening="task_span", **p),
        "BAVARDAGE global": lambda: Bavardage(whitening="global", **p),
    }
    for name in extra_presets:
        out[f"BAVARDAGE global [{name}]"] = lambda name=name: Bavardage.from_preset(
            name, whitening="global"
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", type=int, default=10000, help="tasks per setting")
    parser.add_argument(
        "--tasks-1280", type=int, default=None, help="tasks per setting on the 1280-d features"
    )
    parser.add_argument(
        "--span-tasks-1280",
        type=int,
        default=1000,
        help="tasks for the slow 1280-d runs: BAVARDAGE task_span (per-task QR/eigh) and "
        "VB without PLDA (VB in 1280 dimensions)",
    )
    parser.add_argument("--bgm-tasks", type=int, default=200, help="tasks for scikit-learn")
    parser.add_argument(
        "--datasets", nargs="+", default=["omniglot-1280", "omniglot-pca64", "wordnet"]
    )
    parser.add_argument("--shots", nargs="+", type=int, default=[1, 5])
    parser.add_argument("--balances", nargs="+", default=["dirichlet", "balanced"])
    parser.add_argument("--preset", default="cub", choices=sorted(PRESETS))
    parser.add_argument("--extra-presets", nargs="*", default=["mini-unbalanced"])
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--throughput-check",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also measure BAVARDAGE global vs BGM throughput in alternating rounds",
    )
    parser.add_argument(
        "--target-check",
        action="store_true",
        help="also time 10,000 5-way 1-shot tasks on the 1280-d features with whitening=global",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and BLAS threads (1 avoids thread thrashing on a busy shared machine)",
    )
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument("--quick", action="store_true", help="smoke run (few tasks)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.span_tasks_1280, args.bgm_tasks = 100, 50, 10
        args.tasks_1280 = 100
    tasks_1280 = args.tasks_1280 or args.tasks
    if args.threads:
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(args.threads)
        threadpool_limits(args.threads)

    sets = load_sets(args.data_dir, args.datasets)
    factories = methods(args.preset, args.extra_presets)
    rows, fit_seconds, clamped = [], {}, {}
    settings = [(d, s, b) for d in sets for s in args.shots for b in args.balances]
    bar = tqdm(total=len(settings) * (len(factories) + 1), unit="run")
    load_before = os.getloadavg()
    for data_name, fs in sets.items():
        base = fs.base(torch.float32)
        fitted = {}
        for name, make in factories.items():
            tic = time.perf_counter()
            fitted[name] = make().fit_base(*base)
            fit_seconds[f"{data_name} / {name}"] = time.perf_counter() - tic
            if isinstance(fitted[name], Bavardage):
                clamped[f"{data_name} / {name}"] = fitted[name].clamped_fraction_
        base_mean = base[0].double().mean(0)
        n_tasks = tasks_1280 if data_name == "omniglot-1280" else args.tasks
        for shot in args.shots:
            for balance in args.balances:
                episodes = sample_episodes(
                    fs, n_tasks, 5, shot, 75, balance=balance, seed=args.seed
                )
                for name, est in fitted.items():
                    n = n_tasks
                    slow = name == "BAVARDAGE task_span" or name.startswith("VB without")
                    if slow and data_name == "omniglot-1280":
                        n = min(n, args.span_tasks_1280)
                    bar.set_description(f"{data_name} {shot}-shot {balance}: {name}")
                    res = evaluate(est, episodes[:n], batch_size=args.batch_size)
                    rows.append(
                        dict(
                            dataset=data_name,
                            shot=shot,
                            balance=balance,
                            method=name,
                            **res.summary(),
                        )
                    )
                    bar.update()
                bar.set_description(f"{data_name} {shot}-shot {balance}: sklearn BGM")
                res = evaluate_bgm(episodes[: args.bgm_tasks], base_mean)
                rows.append(
                    dict(
                        dataset=data_name,
                        shot=shot,
                        balance=balance,
                        method="sklearn BayesianGaussianMixture",
                        **res.summary(),
                    )
                )
                bar.update()
    bar.close()

    target = None
    paired = None
    if args.throughput_check:
        paired = paired_throughput(
            sets, args.preset, min(2000, args.tasks), args.bgm_tasks, args.throughput_check
        )
    if args.target_check and "omniglot-1280" in sets:
        fs = sets["omniglot-1280"]
        episodes = sample_episodes(fs, 10000, 5, 1, 75, balance="dirichlet", seed=args.seed)
        tic = time.perf_counter()
        est = Bavardage.from_preset(args.preset, whitening="global").fit_base(*fs.base())
        fit = time.perf_counter() - tic
        res = evaluate(est, episodes, batch_size=args.batch_size, progress=True)
        target = dict(fit_base_seconds=fit, **res.summary())

    results = dict(
        preset=args.preset,
        preset_values=PRESETS[args.preset],
        extra_presets={p: PRESETS[p] for p in args.extra_presets},
        tasks=args.tasks,
        tasks_1280=tasks_1280,
        span_tasks_1280=args.span_tasks_1280,
        bgm_tasks=args.bgm_tasks,
        seed=args.seed,
        threads=torch.get_num_threads(),
        rows=rows,
        fit_base_seconds=fit_seconds,
        clamped_fraction=clamped,
        target_10k_1shot_1280_global=target,
        paired_throughput=paired,
        tag=args.tag,
        machine=machine(load_before),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bavardage{args.tag}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"bavardage{args.tag}.md").write_text(markdown(results))
    print(markdown(results))
    return results


def _acc(r: dict | None) -> str:
    return "–" if r is None else f"{r['accuracy']:.2f} ± {r['ci95']:.2f}"


def markdown(results: dict) -> str:
    """A compact table first (one line per data set and setting), then every row."""
    rows = results["rows"]
    m = results["machine"]
    tag = results.get("tag")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["shot"], r["balance"]), []).append(r)
    lines = [
        "# BAVARDAGE benchmark" + (f" ({tag.strip('_')} run)" if tag else ""),
        "",
        f"Preset `{results['preset']}` {results['preset_values']} unless named; 5-way, 75 "
        f"queries, seed {results['seed']}; accuracy ± 95% CI (%). `× BGM` = BAVARDAGE "
        "global's tasks/s over scikit-learn's BayesianGaussianMixture's, same setting and "
        f"run. Machine: {m['cpus']} CPUs, {results['threads']} torch thread(s), load average "
        f"{m['loadavg_before'][0]:.1f} → {m['loadavg_after'][0]:.1f} (shared; timings "
        "pessimistic).",
        "",
        "| data | shot | queries | nearest centroid | soft k-means | VB without PLDA "
        "(T_vb=50) | BAVARDAGE task_span | BAVARDAGE global | tasks/s (global) | "
        "sklearn BGM | × BGM |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (data, shot, balance), group in groups.items():
        by = {r["method"]: r for r in group}
        bav, bgm = by.get("BAVARDAGE global"), by.get("sklearn BayesianGaussianMixture")
        ratio = f"{bav['tasks_per_second'] / bgm['tasks_per_second']:.0f}" if bav and bgm else ""
        lines.append(
            f"| {data} | {shot} | {balance} | {_acc(by.get('nearest centroid'))} | "
            f"{_acc(by.get('soft k-means'))} | {_acc(by.get('VB without PLDA [T_vb=50]'))} | "
            f"{_acc(by.get('BAVARDAGE task_span'))} | {_acc(bav)} | "
            f"{bav['tasks_per_second']:.0f} | {_acc(bgm)} | {ratio} |"
        )
    paired = results.get("paired_throughput")
    if paired:
        lines += [
            "",
            f"Paired throughput (5-way 1-shot Dirichlet; {paired[0]['tasks']} tasks for "
            f"BAVARDAGE global, {paired[0]['bgm_tasks']} for BGM, alternating "
            f"{paired[0]['rounds']} rounds, fastest round of each; BGM also with one BLAS "
            "thread, keeping its faster setting):",
            "",
            "| data | BAVARDAGE global tasks/s | BGM tasks/s | × BGM |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {p['dataset']} | {p['bavardage_tasks_per_second']:.0f} | "
            f"{p['bgm_tasks_per_second']:.1f} | {p['ratio']:.0f} |"
            for p in paired
        ]
    target = results.get("target_10k_1shot_1280_global")
    if target:
        lines += [
            "",
            f"10,000 tasks of 5-way 1-shot Dirichlet on 1280-d Omniglot, whitening=global: "
            f"{target['seconds']:.1f} s for the tasks (+{target['fit_base_seconds']:.1f} s "
            f"fit_base), {target['accuracy']:.2f} ± {target['ci95']:.2f} %.",
        ]
    lines += [
        "",
        "<!-- headline end -->",
        "",
        "## Every row",
        "",
        "tasks/s, tasks; `x BGM` = throughput relative to scikit-learn's "
        "BayesianGaussianMixture, `vs SKM` = accuracy minus soft k-means, same setting and run.",
        "",
        "| data | shot | queries | method | accuracy | tasks/s | tasks | x BGM | vs SKM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (data, shot, balance), group in groups.items():
        by = {r["method"]: r for r in group}
        bgm = by.get("sklearn BayesianGaussianMixture")
        skm = by.get("soft k-means")
        for r in group:
            ratio = f"{r['tasks_per_second'] / bgm['tasks_per_second']:.0f}" if bgm else ""
            gain = f"{r['accuracy'] - skm['accuracy']:+.2f}" if skm else ""
            lines.append(
                f"| {data} | {shot} | {balance} | {r['method']} | {_acc(r)} | "
                f"{r['tasks_per_second']:.1f} | {r['n_tasks']} | {ratio} | {gain} |"
            )
    lines += ["", "Fraction of global whitening scales clamped at s_max:", ""]
    for key, value in results["clamped_fraction"].items():
        if "BAVARDAGE global" in key:
            lines.append(f"- {key}: {100 * value:.1f}%")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
