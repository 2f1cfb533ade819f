"""Benchmark ``preset="auto"`` against the published presets and the baselines.

For every shared feature set and few-shot setting (5-way 1-/5-shot, 75 queries,
balanced and Dirichlet alpha* = 2): accuracy ± 95% CI on novel-class tasks of

* nearest centroid and soft k-means,
* BAVARDAGE with every published preset, in the code's units and re-expressed with
  ``scale="relative"`` (``*-relative``), whitening ``global`` throughout (the fast path;
  identical to the code's per-task whitening when s_max does not clamp),
* BAVARDAGE ``auto``: the search of :func:`probfsl.tuning.tune` on base-class episodes
  of the same setting, chosen by accuracy and, for comparison, by the mean ELBO,
  with the tuning time and the rank agreement (Spearman) of the two criteria.

Zero-shot (WordNet): tasks of 3-10 *novel* classes (the base classes are used to tune),
argmax of the zero-shot probabilities, EM-Dirichlet soft and hard with their defaults,
and ``auto`` (:func:`probfsl.tuning.tune_zero_shot` on base-class zero-shot tasks).

GP-Tree (few-shot on Omniglot PCA-64, fewer tasks: every task fits GP nodes): default
against ``auto``.

    python benchmarks/bench_auto.py [--data-dir DIR] [--tasks 1000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from bench_bavardage import load_sets, machine  # a sibling script
from scipy.stats import spearmanr
from tqdm.auto import tqdm

from probfsl import make_estimator
from probfsl.data import sample_zero_shot_tasks
from probfsl.data.tasks import sample_episodes
from probfsl.evaluation.protocol import accuracy_ci, evaluate
from probfsl.models.bavardage import PRESETS
from probfsl.tuning import tune, tune_zero_shot

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()


def _row(**fields) -> dict:
    return {k: (float(v) if isinstance(v, np.floating) else v) for k, v in fields.items()}


def bavardage_rows(fs, name, shot, balance, n_tasks, n_episodes, seed) -> list[dict]:
    episodes = sample_episodes(fs, n_tasks, 5, shot, 75, balance=balance, seed=seed)
    setting = dict(dataset=name, shot=shot, balance=balance)
    rows = []

    def run(method, label, estimator, **extra):
        res = evaluate(estimator.fit_featureset(fs), episodes)
        rows.append(_row(**setting, method=method, setting_name=label, **res.summary(), **extra))

    run("nearest-centroid", "default", make_estimator("nearest-centroid"))
    run("soft-kmeans", "default", make_estimator("soft-kmeans"))
    for preset in PRESETS:
        run("bavardage", preset, make_estimator("bavardage", preset, whitening="global"))
    result = tune(
        "bavardage",
        fs,
        shot=shot,
        balance=balance,
        n_episodes=n_episodes,
        seed=seed,
    )
    by_objective = max(result.trace, key=lambda r: r["objective"])["params"]
    rho = spearmanr([r["accuracy"] for r in result.trace], [r["objective"] for r in result.trace])
    best = {k: v for k, v in result.best.items() if k != "whitening"}
    run(
        "bavardage",
        "auto",
        make_estimator("bavardage", **result.best),
        tuning_seconds=result.seconds,
        candidates=len(result.trace),
        chosen=best,
        criterion_spearman=float(rho.statistic),
    )
    run(
        "bavardage",
        "auto (ELBO criterion)",
        make_estimator("bavardage", **by_objective),
        chosen=by_objective,
    )
    return rows


def zero_shot_rows(fs, n_tasks, n_candidate_tasks, seed) -> list[dict]:
    from probfsl.data.simplex import zero_shot_probabilities
    from probfsl.evaluation.zero_shot import evaluate_zero_shot
    from probfsl.models.em_dirichlet import EMDirichlet

    novel = fs.labelled_only("novel")
    tasks = sample_zero_shot_tasks(novel, n_tasks, 3, 10, 75, seed)
    setting = dict(dataset=fs.name, shot=0, balance="zero-shot (novel classes)")
    rows = []

    def run(label, estimator, **extra):
        probs = zero_shot_probabilities(novel, tasks, estimator.temperature)
        res = evaluate_zero_shot(estimator, probs, tasks.query_labels)
        rows.append(
            _row(**setting, method="em-dirichlet", setting_name=label, **res.summary(), **extra)
        )

    probs = zero_shot_probabilities(novel, tasks, 30.0)
    hits = (probs.argmax(-1) == tasks.query_labels).double().mean(-1).numpy()
    acc, ci = accuracy_ci(hits)
    rows.append(
        _row(
            **setting, method="argmax", setting_name="T=30", accuracy=acc, ci95=ci, n_tasks=n_tasks
        )
    )
    run("default", EMDirichlet())
    run("hard, default", EMDirichlet(hard=True))
    for hard in (False, True):
        result = tune_zero_shot(
            "em-dirichlet",
            fs,
            n_tasks=n_candidate_tasks,
            seed=seed,
            fixed={"hard": hard},
        )
        run(
            "auto, hard" if hard else "auto",
            EMDirichlet(**result.best),
            tuning_seconds=result.seconds,
            candidates=len(result.trace),
            chosen=result.best,
        )
    return rows


def gptree_rows(fs, name, shot, n_tasks, n_episodes, seed) -> list[dict]:
    episodes = sample_episodes(fs, n_tasks, 5, shot, 75, balance="balanced", seed=seed)
    setting = dict(dataset=name, shot=shot, balance="balanced")
    rows = []
    for method in ("nearest-centroid", "gp-tree"):
        res = evaluate(make_estimator(method).fit_featureset(fs), episodes)
        rows.append(_row(**setting, method=method, setting_name="default", **res.summary()))
    result = tune("gp-tree", fs, shot=shot, n_episodes=n_episodes, seed=seed)
    res = evaluate(make_estimator("gp-tree", **result.best).fit_featureset(fs), episodes)
    rows.append(
        _row(
            **setting,
            method="gp-tree",
            setting_name="auto",
            **res.summary(),
            tuning_seconds=result.seconds,
            candidates=len(result.trace),
            chosen=result.best,
        )
    )
    return rows


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        '# `preset="auto"` against the published presets and the baselines',
        "",
        f"Novel-class tasks, seed {results['seed']}; accuracy ± 95% CI (%). BAVARDAGE: "
        f"{results['tasks']} tasks per setting, whitening global, auto = "
        f"{results['episodes']} base episodes per candidate. Machine: {m['cpus']} CPUs, "
        f"{m['threads']} torch thread(s), load average {m['loadavg_before'][0]:.1f} → "
        f"{m['loadavg_after'][0]:.1f} (shared; timings pessimistic); {results['date']}.",
        "",
    ]
    groups: dict = {}
    for r in results["rows"]:
        key = (r.get("section", "bavardage"), r["dataset"], r["shot"], r["balance"])
        groups.setdefault(key, []).append(r)
    lines += [
        "| method | data | shot | balance | nearest centroid / argmax | soft k-means | "
        "best preset | "
        "auto | auto (ELBO) | tuning (s) | auto's choice |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def short(chosen):
        if not isinstance(chosen, dict):
            return chosen or ""
        return ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in chosen.items()
        )

    def fmt(r):
        return "–" if r is None else f"{r['accuracy']:.2f} ± {r['ci95']:.2f}"

    for (section, data, shot, balance), rows in groups.items():
        get = {(r["method"], r["setting_name"]): r for r in rows}
        presets = [
            r
            for r in rows
            if r["method"] in ("bavardage", "em-dirichlet", "gp-tree")
            and not r["setting_name"].startswith("auto")
        ]
        best = max(presets, key=lambda r: r["accuracy"]) if presets else None
        autos = [
            r
            for r in rows
            if r["setting_name"].startswith("auto") and "ELBO" not in r["setting_name"]
        ]
        auto = max(autos, key=lambda r: r["accuracy"]) if autos else None
        base = get.get(("nearest-centroid", "default")) or get.get(("argmax", "T=30"))
        lines.append(
            f"| {section} | {data} | {shot} | {balance} | {fmt(base)} | "
            f"{fmt(get.get(('soft-kmeans', 'default')))} | "
            f"{fmt(best)} ({best['setting_name'] if best else ''}) | {fmt(auto)} | "
            f"{fmt(get.get(('bavardage', 'auto (ELBO criterion)')))} | "
            f"{auto.get('tuning_seconds', float('nan')) if auto else float('nan'):.1f} | "
            f"{short(auto.get('chosen')) if auto else ''} |"
        )
    lines += [
        "",
        "## Every row",
        "",
        "| data | shot | balance | method | setting | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['dataset']} | {r['shot']} | {r['balance']} | {r['method']} | "
            f"{r['setting_name']} | {fmt(r)} |"
        )
    spear = [r["criterion_spearman"] for r in results["rows"] if "criterion_spearman" in r]
    if spear:
        lines += [
            "",
            f"Criterion agreement: Spearman correlation between base-episode accuracy and mean "
            f"ELBO over the BAVARDAGE candidates, per setting: "
            f"{', '.join(f'{s:.2f}' for s in spear)}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", type=int, default=1000, help="novel tasks per setting")
    parser.add_argument("--episodes", type=int, default=300, help="base episodes per candidate")
    parser.add_argument("--gptree-tasks", type=int, default=100)
    parser.add_argument("--gptree-episodes", type=int, default=50)
    parser.add_argument(
        "--datasets", nargs="+", default=["omniglot-1280", "omniglot-pca64", "wordnet"]
    )
    parser.add_argument("--sections", nargs="+", default=["bavardage", "zero-shot", "gp-tree"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run (few tasks)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.episodes, args.gptree_tasks, args.gptree_episodes = 50, 30, 5, 5
    torch.set_num_threads(args.threads)
    sets = load_sets(args.data_dir, args.datasets)
    load_before = os.getloadavg()
    jobs = []
    if "bavardage" in args.sections:
        jobs += [
            (
                "bavardage",
                f"BAVARDAGE {n} {s}-shot {b}",
                bavardage_rows,
                (fs, n, s, b, args.tasks, args.episodes, args.seed),
            )
            for n, fs in sets.items()
            for s in (1, 5)
            for b in ("balanced", "dirichlet")
        ]
    if "zero-shot" in args.sections and "wordnet" in sets:
        jobs.append(
            (
                "zero-shot",
                "zero-shot WordNet",
                zero_shot_rows,
                (sets["wordnet"], args.tasks, args.episodes, args.seed),
            )
        )
    if "gp-tree" in args.sections and "omniglot-pca64" in sets:
        jobs += [
            (
                "gp-tree",
                f"GP-Tree {s}-shot",
                gptree_rows,
                (
                    sets["omniglot-pca64"],
                    "omniglot-pca64",
                    s,
                    args.gptree_tasks,
                    args.gptree_episodes,
                    args.seed,
                ),
            )
            for s in (1, 5)
        ]
    rows = []
    for section, label, fn, fn_args in tqdm(jobs, unit="setting"):
        tqdm.write(label)
        rows += [{**r, "section": section} for r in fn(*fn_args)]
    # sections not rerun keep their rows from an earlier run
    previous = args.out / "auto.json"
    if previous.exists():
        kept = json.loads(previous.read_text())["rows"]
        rows = [r for r in kept if r.get("section", "bavardage") not in args.sections] + rows
    results = dict(
        tasks=args.tasks,
        episodes=args.episodes,
        seed=args.seed,
        date=time.strftime("%Y-%m-%d"),
        rows=rows,
        machine=machine(load_before),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "auto.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
