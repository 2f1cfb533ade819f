"""EM-Dirichlet: the engine VMP derives from the declaration against the hand-written one.

Same tasks, same estimator hyperparameters (the library defaults: soft variant, lambda/|Q|
= floor(K/5), 20 outer iterations, the reference inner loop few-shot and the bounded one
zero-shot), ``engine="handwritten"`` then ``engine="derived"``
(:mod:`probfsl.derived.em_dirichlet`), one torch thread, in the same process. Reported per
setting: query labels that differ (few-shot: argmax of R_Q; zero-shot: the final labels
after Hungarian matching), the largest relative difference of the objective trace J
(|J_h - J_d| / max(|J_h|, 1) over every task and step) and of the concentrations, and the
time of each engine (wall clock and process CPU) with the ratio derived / hand-written.

Data: the built-in WordNet and Omniglot sets (``probfsl.data.load_dataset``) and, when
present, the shared files in ``--data-dir``: WordNet MiniLM and Omniglot
EfficientNet-Lite0 PCA-64 (the same arrays as the built-in sets) and the 1280-d Omniglot
features. Zero-shot needs class embeddings (WordNet only).

    python benchmarks/bench_derived_em_dirichlet.py [--tasks 1000] [--dtypes float64 float32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from probfsl.data.builtin import load_dataset, wordnet_base_classes
from probfsl.data.loaders import load_npz
from probfsl.data.simplex import zero_shot_probabilities
from probfsl.data.tasks import sample_episodes, sample_zero_shot_tasks
from probfsl.models.em_dirichlet import EMDirichlet

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()


def feature_sets(data_dir: Path, names: list[str]) -> dict:
    """name -> FeatureSet, for the requested names that exist."""
    out = {}
    if "wordnet" in names:
        out["wordnet"] = load_dataset("wordnet")
    if "omniglot" in names:
        out["omniglot"] = load_dataset("omniglot")
    shared = {
        "shared-wordnet": (
            data_dir / "wordnet_supersenses" / "wordnet_supersenses_minilm.npz",
            wordnet_base_classes(),
        ),
        "shared-omniglot": (
            data_dir / "omniglot_small" / "omniglot_small_effnetlite0_pca64.npz",
            None,
        ),
        "shared-omniglot-1280": (
            data_dir / "omniglot_small" / "omniglot_small_effnetlite0.npz",
            None,
        ),
    }
    for name, (path, base) in shared.items():
        if name in names and path.exists():
            out[name] = load_npz(path, name=name, base_classes=base)
    return out


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def compare(fs, zero_shot: bool, n_tasks: int, dtype: torch.dtype, seed: int, shot: int) -> dict:
    """Both engines on the same tasks; see the module docstring."""
    runs = {}
    if zero_shot:
        tasks = sample_zero_shot_tasks(fs, n_tasks, 3, 10, 75, seed)
        probs = zero_shot_probabilities(fs, tasks, 30.0, dtype)
    else:
        episodes = sample_episodes(fs, n_tasks, 5, shot, 75, seed=seed, dtype=dtype)
    for engine in ("handwritten", "derived"):
        est = EMDirichlet(engine=engine)
        if zero_shot:
            labels, wall, cpu = timed(lambda est=est: est.predict_zero_shot(probs))
        else:
            est.fit_base(*fs.base(dtype=dtype))
            support, query = est.episode_probabilities(episodes)
            labels, wall, cpu = timed(
                lambda est=est, s=support, q=query: est.fit_probabilities(
                    q, s, episodes.support_labels
                ).query_r.argmax(-1)
            )
        runs[engine] = (labels, est.trace_, est.state_, wall, cpu)
    (lh, th, sh, wh, ch), (ld, td, sd, wd, cd) = runs["handwritten"], runs["derived"]
    trace_rel = (th - td).abs() / th.abs().clamp_min(1.0)
    alpha_rel = (sh.alpha - sd.alpha).abs() / sh.alpha
    differ = lh != ld
    return {
        "dataset": fs.name,
        "setting": "zero-shot" if zero_shot else f"5-way {shot}-shot",
        "dtype": str(dtype).removeprefix("torch."),
        "tasks": n_tasks,
        "queries": differ.numel(),
        "queries_differing": int(differ.sum()),
        "tasks_differing": int(differ.any(1).sum()),
        "label_agreement": 1.0 - float(differ.double().mean()),
        "argmax_r_differing": int((sh.query_r.argmax(-1) != sd.query_r.argmax(-1)).sum()),
        "trace_max_rel": float(trace_rel.max()),
        "trace_median_rel": float(trace_rel.median()),
        "final_objective_max_rel": float(trace_rel[-1].max()),
        "alpha_max_rel": float(alpha_rel.max()),
        "alpha_median_rel": float(alpha_rel.median()),
        "handwritten_s": wh,
        "derived_s": wd,
        "handwritten_cpu_s": ch,
        "derived_cpu_s": cd,
        "ratio_wall": wd / wh,
        "ratio_cpu": cd / ch,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "# EM-Dirichlet: derived (VMP) against hand-written engine",
        "",
        "Library defaults (soft), 1 torch thread, same process, same tasks. Labels: "
        "few-shot argmax R_Q, zero-shot after Hungarian matching. Trace: max over tasks and "
        "steps of |J_h - J_d| / max(|J_h|, 1). Time ratio derived / hand-written (wall; CPU).",
        "",
        "| data | setting | dtype | tasks | labels differing | agreement | trace max rel "
        "| alpha max rel | hand-written s | derived s | ratio wall | ratio CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['setting']} | {r['dtype']} | {r['tasks']} | "
            f"{r['queries_differing']} / {r['queries']} ({r['tasks_differing']} tasks) | "
            f"{100 * r['label_agreement']:.3f} % | {r['trace_max_rel']:.1e} | "
            f"{r['alpha_max_rel']:.1e} | {r['handwritten_s']:.1f} | {r['derived_s']:.1f} | "
            f"{r['ratio_wall']:.2f} | {r['ratio_cpu']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32"])
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=["wordnet", "shared-wordnet", "omniglot", "shared-omniglot"],
    )
    parser.add_argument("--settings", nargs="+", default=["zero", "few"])
    parser.add_argument("--shot", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for fs in feature_sets(args.data_dir, args.datasets).values():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for setting in args.settings:
                zero_shot = setting == "zero"
                if zero_shot and fs.class_features is None:
                    continue
                rows.append(compare(fs, zero_shot, args.tasks, dtype, args.seed, args.shot))
                print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
        args.out.with_suffix(".md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
