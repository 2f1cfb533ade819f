# ruff: noqa: E501  (markdown table rows)
"""Benchmark: Bayesian evidence LS-SVM (and SLEM) on Omniglot with three backbones.

Backbones: EfficientNet-Lite0 and -Lite1 features extracted from the Omniglot archives
(``benchmarks/extract_omniglot.py``, same images, same recipe) and the built-in PCA-64
of Lite0. Questions:

1. Does the evidence rank the backbones as few-shot accuracy does? Per dataset (novel
   split) and per task (Kendall tau over backbones, support-set evidence vs query
   accuracy).
2. Accuracy of the evidence-chosen lambda against cross-validated ridge and logistic
   regression (linear probe on the novel classes: drawers 1-10 train, 11-20 test).
3. Time against scikit-learn's BayesianRidge fitted class by class and backbone by
   backbone (same evidence values), and against the cross-validated grids.

    python benchmarks/bench_evidence.py [--data-dir ../shared/data] [--tasks 1000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from probfsl.data.builtin import load_dataset
from probfsl.data.featureset import FeatureSet
from probfsl.data.tasks import sample_episodes
from probfsl.evaluation.protocol import evaluate
from probfsl.models.evidence import EvidenceLSSVM, backbone_evidence, greedy_ensemble
from probfsl.models.nearest_centroid import NearestCentroid
from probfsl.models.slem import SLEM

HERE = Path(__file__).resolve().parent
F64 = torch.float64


def FEWSHOT_METHODS():  # noqa: N802
    return [
        ("evidence-lssvm", EvidenceLSSVM()),
        ("evidence-lssvm per-class", EvidenceLSSVM(lambda_mode="per_class")),
        ("nearest-centroid", NearestCentroid()),
        ("slem", SLEM()),
        ("slem rel_lam=1e-3", SLEM(rel_lam=1e-3)),
    ]


def _key(class_name: str, filename: str) -> str:
    return f"{class_name}/{Path(filename).name}"


def load_backbones(data_dir: Path, features_dir: Path) -> dict[str, FeatureSet]:
    """The three backbones as FeatureSets with identical rows (base + novel)."""
    sets = {}
    order = None
    for name in ("efficientnet-lite0", "efficientnet-lite1"):
        path = features_dir / f"omniglot_{name}.npz"
        if not path.exists():
            raise SystemExit(f"{path} missing: run benchmarks/extract_omniglot.py first")
        d = np.load(path)
        names = d["class_names"].astype(str)
        keys = np.array(
            [_key(names[lab], f) for lab, f in zip(d["labels"], d["filename"], strict=True)]
        )
        if order is None:
            order = keys
            labels, split, class_names = d["labels"], d["split"].astype(str), list(names)
        if not np.array_equal(keys, order):
            raise SystemExit(f"{path}: rows differ from the first backbone")
        sets[name] = d["features"].astype(np.float32)
    # built-in PCA-64: align through the shared Lite0 file, which has the same rows
    shared = np.load(data_dir / "omniglot_small" / "omniglot_small_effnetlite0.npz")
    pca = load_dataset("omniglot")
    shared_keys = np.array(
        [
            _key(c, f)
            for c, f in zip(
                shared["class_key"].astype(str), shared["filename"].astype(str), strict=True
            )
        ]
    )
    index = {k: i for i, k in enumerate(shared_keys)}
    rows = np.array([index[k] for k in order])
    sets["pca64 (built-in)"] = pca.features[rows].astype(np.float32)
    check = np.abs(shared["features"][rows].astype(np.float32) - sets["efficientnet-lite0"]).max()
    out = {
        n: FeatureSet(features=f, labels=labels, class_names=class_names, split=split, name=n)
        for n, f in sets.items()
    }
    out["efficientnet-lite0"].metadata["max_abs_diff_vs_shared_file"] = float(check)
    return out


def drawer_split(fs: FeatureSet) -> tuple[np.ndarray, np.ndarray]:
    """Novel rows split by drawer order within each class: first half train, rest test."""
    rows = fs.rows("novel")
    train, test = [], []
    for c in np.unique(fs.labels[rows]):
        r = rows[fs.labels[rows] == c]
        half = len(r) // 2
        train.extend(r[:half])
        test.extend(r[half:])
    return np.array(train), np.array(test)


def bayesian_ridge_timing(
    x: np.ndarray, y: np.ndarray, n_classes: int
) -> tuple[float, np.ndarray, np.ndarray]:
    from sklearn.linear_model import BayesianRidge

    scores, lams = [], []
    tic = time.perf_counter()
    for k in range(n_classes):
        br = BayesianRidge(
            fit_intercept=False,
            alpha_1=0,
            alpha_2=0,
            lambda_1=0,
            lambda_2=0,
            tol=1e-10,
            max_iter=3000,
            compute_score=True,
        ).fit(x, y[:, k])
        scores.append(br.scores_[-1])
        lams.append(br.lambda_ / br.alpha_)
    return time.perf_counter() - tic, np.array(scores), np.array(lams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=HERE.parent.parent / "shared" / "data")
    parser.add_argument("--features-dir", type=Path, default=HERE / "features")
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument(
        "--br-classes", type=int, default=10, help="classes per backbone for BayesianRidge"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: few tasks, small grids")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.br_classes = 50, 3
    torch.manual_seed(0)
    sets = load_backbones(args.data_dir, args.features_dir)
    names = list(sets)
    stages = tqdm(total=5, desc="bench_evidence", unit="stage")
    results: dict = {"tasks": args.tasks, "backbones": names}
    results["lite0_max_abs_diff_vs_shared_features"] = sets[names[0]].metadata[
        "max_abs_diff_vs_shared_file"
    ]

    # 1. per-dataset evidence ranking (paper defaults: L2-normalised, no bias) on the novel split
    fs0 = sets[names[0]]
    novel = fs0.rows("novel")
    labels = fs0.labels[novel]
    feats = {n: torch.from_numpy(sets[n].features[novel]).to(F64) for n in names}
    tic = time.perf_counter()
    _, res, sp = backbone_evidence(feats, labels)
    evidence_seconds = time.perf_counter() - tic
    per_dataset = {
        n: {
            "log_evidence": float(res.log_evidence[m].sum()),
            "per_sample": float(res.log_evidence[m].sum() / sp.n),
            "at_boundary": int(res.at_boundary[m].sum()),
        }
        for m, n in enumerate(names)
    }
    stages.update()

    # 2. few-shot accuracy per backbone, same tasks; per-task evidence vs accuracy
    fewshot: dict = {}
    per_task_tau: dict = {}
    for shot in (1, 5):
        accs, evid = {}, {}
        for n in names:
            eps = sample_episodes(
                sets[n], args.tasks, way=5, shot=shot, n_query=75, seed=1, dtype=F64
            )
            base = sets[n].base(F64)
            for label, est in FEWSHOT_METHODS():
                est.fit_base(*base)
                r = evaluate(est, eps, batch_size=500)
                fewshot[f"{shot}-shot/{n}/{label}"] = r.summary()
                if label == "evidence-lssvm":
                    accs[n] = r.per_task_accuracy
            # support-set evidence of each task: the paper's score (per-class lambda, summed)
            scorer = EvidenceLSSVM(lambda_mode="per_class").fit_base(*base)
            ev = []
            for start in range(0, len(eps), 500):
                scorer.predict_proba(eps[start : start + 500])
                ev.append(scorer.last_log_evidence_.sum(-1).numpy())
            evid[n] = np.concatenate(ev)
        per_task_tau[f"{shot}-shot"] = rank_agreement(accs, evid, names)
    stages.update()

    # 3. linear probe: evidence lambda vs cross-validated ridge / logistic regression
    probe = {}
    train, test = drawer_split(fs0)
    for n in names:
        probe[n] = linear_probe(sets[n], train, test, quick=args.quick)
    ens_feats = {n: sets[n].features[train] for n in names}
    tic = time.perf_counter()
    ens = greedy_ensemble(ens_feats, fs0.labels[train])
    ens_seconds = time.perf_counter() - tic
    concat = np.concatenate(
        [
            torch.nn.functional.normalize(
                torch.from_numpy(sets[n].features[test]).double(), dim=-1
            ).numpy()
            for n in ens.selected
        ],
        1,
    )
    ens_acc = float((ens.model.predict(concat) == fs0.labels[test]).mean() * 100)
    results["ensemble"] = {
        "order": ens.order,
        "accepted": ens.accepted,
        "trace": ens.trace,
        "selected": ens.selected,
        "test_accuracy": ens_acc,
        "seconds": ens_seconds,
    }
    stages.update()

    # 4. time vs BayesianRidge class by class (same evidence values), on the probe's train rows
    ytr = np.eye(fs0.n_classes)[fs0.labels[train]][:, np.unique(fs0.labels[train])]
    k_all = ytr.shape[1]
    xs = {
        n: torch.nn.functional.normalize(torch.from_numpy(sets[n].features[train]).double(), dim=-1)
        for n in names
    }
    tic = time.perf_counter()
    _, res_tr, _ = backbone_evidence(xs, fs0.labels[train], normalize=False)
    ours_seconds = time.perf_counter() - tic
    br_seconds, br_dev, br_lam_dev = 0.0, 0.0, 0.0
    for m, n in enumerate(names):
        secs, scores, lams = bayesian_ridge_timing(xs[n].numpy(), ytr, args.br_classes)
        br_seconds += secs
        br_dev = max(
            br_dev, float(np.abs(scores - res_tr.log_evidence[m, : args.br_classes].numpy()).max())
        )
        br_lam_dev = max(
            br_lam_dev, float(np.abs(lams / res_tr.lam[m, : args.br_classes].numpy() - 1).max())
        )
    ours_tp = len(names) * k_all / ours_seconds
    br_tp = len(names) * args.br_classes / br_seconds
    results["timing"] = {
        "n_train": int(len(train)),
        "classes": int(k_all),
        "ours_seconds_all_classes_all_backbones": ours_seconds,
        "ours_class_fits_per_second": ours_tp,
        "bayesian_ridge_seconds": br_seconds,
        "bayesian_ridge_classes_timed_per_backbone": args.br_classes,
        "bayesian_ridge_class_fits_per_second": br_tp,
        "throughput_ratio": ours_tp / br_tp,
        "max_abs_log_evidence_diff_vs_bayesian_ridge": br_dev,
        "max_rel_lambda_diff_vs_bayesian_ridge": br_lam_dev,
        "per_dataset_evidence_seconds": evidence_seconds,
    }
    stages.update()
    results["per_dataset"] = per_dataset
    results["fewshot"] = fewshot
    results["per_task_rank"] = per_task_tau
    results["linear_probe"] = probe
    stages.update()
    stages.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "evidence.json").write_text(json.dumps(results, indent=2, default=float))
    md = to_markdown(results, names)
    (args.out / "evidence.md").write_text(md)
    print(md)


def rank_agreement(accs: dict, evid: dict, names: list[str]) -> dict:
    """Per task: Kendall tau (over backbones) of support evidence vs query accuracy."""
    from scipy.stats import kendalltau

    acc = np.stack([accs[n] for n in names], 1)  # [T, M]
    ev = np.stack([evid[n] for n in names], 1)
    taus = []
    for a, e in zip(acc, ev, strict=True):
        if np.ptp(a) > 0:
            taus.append(kendalltau(e, a).statistic)
    best_ev = ev.argmax(1)
    hit = acc[np.arange(len(acc)), best_ev] >= acc.max(1)
    mean_acc = acc.mean(0)
    mean_ev = ev.mean(0)
    return {
        "mean_kendall_tau": float(np.nanmean(taus)) if taus else float("nan"),
        "tasks_with_distinct_accuracies": len(taus),
        "evidence_picks_a_best_backbone_%": float(hit.mean() * 100),
        "dataset_tau_mean_evidence_vs_mean_accuracy": float(
            kendalltau(mean_ev, mean_acc).statistic
        ),
        "mean_support_evidence": {n: float(v) for n, v in zip(names, mean_ev, strict=True)},
    }


def linear_probe(fs: FeatureSet, train: np.ndarray, test: np.ndarray, quick: bool) -> dict:
    """Evidence LS-SVM vs 5-fold CV ridge (2^-10..2^10) and CV logistic regression."""
    from sklearn.linear_model import LogisticRegression, RidgeClassifier
    from sklearn.model_selection import GridSearchCV, StratifiedKFold

    x = torch.nn.functional.normalize(torch.from_numpy(fs.features).double(), dim=-1).numpy()
    xtr, xte, ytr, yte = x[train], x[test], fs.labels[train], fs.labels[test]
    out = {}
    tic = time.perf_counter()
    model = EvidenceLSSVM(center=False).fit_probe(xtr, ytr)
    out["evidence"] = {
        "accuracy": float((model.predict(xte) == yte).mean() * 100),
        "seconds": time.perf_counter() - tic,
        "lambda": float(model.lambda_[0]),
    }
    tic = time.perf_counter()
    model = EvidenceLSSVM(center=False, lambda_mode="per_class").fit_probe(xtr, ytr)
    out["evidence_per_class"] = {
        "accuracy": float((model.predict(xte) == yte).mean() * 100),
        "seconds": time.perf_counter() - tic,
        "median_lambda": float(model.lambda_.median()),
        "lambda_range": [float(model.lambda_.min()), float(model.lambda_.max())],
    }
    folds = StratifiedKFold(n_splits=3 if quick else 5, shuffle=True, random_state=0)
    alphas = 2.0 ** np.arange(-10, 11, 4 if quick else 1)
    tic = time.perf_counter()
    ridge = GridSearchCV(RidgeClassifier(fit_intercept=False), {"alpha": alphas}, cv=folds).fit(
        xtr, ytr
    )
    out["ridge_cv"] = {
        "accuracy": float((ridge.predict(xte) == yte).mean() * 100),
        "seconds": time.perf_counter() - tic,
        "alpha": float(ridge.best_params_["alpha"]),
        "grid": len(alphas),
    }
    cs = [0.1, 10.0] if quick else [0.1, 1.0, 10.0, 100.0]
    tic = time.perf_counter()
    logreg = GridSearchCV(LogisticRegression(max_iter=300), {"C": cs}, cv=folds).fit(xtr, ytr)
    out["logreg_cv"] = {
        "accuracy": float((logreg.predict(xte) == yte).mean() * 100),
        "seconds": time.perf_counter() - tic,
        "C": float(logreg.best_params_["C"]),
        "grid": len(cs),
    }
    return out


def to_markdown(r: dict, names: list[str]) -> str:
    lines = ["# Evidence LS-SVM benchmark (Omniglot, 3 backbones)", ""]
    lines.append(
        f"Tasks per setting: {r['tasks']} (5-way, 75 queries, same tasks for every backbone)."
    )
    lines.append(
        f"Lite0 features re-extracted here vs the shared file: max abs diff "
        f"{r['lite0_max_abs_diff_vs_shared_features']:.2e} (float16 storage)."
    )
    lines += [
        "",
        "## Evidence per dataset (novel split, L2-normalised, no bias) vs few-shot accuracy",
        "",
    ]
    fs = r["fewshot"]

    def acc(key):
        return f"{fs[key]['accuracy']:.2f} ± {fs[key]['ci95']:.2f}"

    lines.append("| backbone | log evidence / sample | classes at bound |")
    lines.append("|---|---|---|")
    for n in names:
        e = r["per_dataset"][n]
        lines.append(f"| {n} | {e['per_sample']:.4f} | {e['at_boundary']} |")
    lines += ["", "Few-shot accuracy (%, 5-way, 75 queries) and throughput (tasks/s):", ""]
    lines.append("| method | backbone | 1-shot | 5-shot | tasks/s (5-shot) |")
    lines.append("|---|---|---|---|---|")
    for m, _ in FEWSHOT_METHODS():
        for n in names:
            k5 = f"5-shot/{n}/{m}"
            lines.append(
                f"| {m} | {n} | {acc(f'1-shot/{n}/{m}')} | {acc(k5)} | {fs[k5]['tasks_per_second']:.0f} |"
            )
    lines += ["", "<!-- headline end -->", ""]
    lines += [
        "## Per-task agreement (support evidence vs query accuracy of the evidence LS-SVM)",
        "",
    ]
    lines.append(
        "| setting | mean Kendall tau | tasks used | evidence picks a best backbone | tau of means |"
    )
    lines.append("|---|---|---|---|---|")
    for s, v in r["per_task_rank"].items():
        lines.append(
            f"| {s} | {v['mean_kendall_tau']:.3f} | {v['tasks_with_distinct_accuracies']} | "
            f"{v['evidence_picks_a_best_backbone_%']:.1f} % | {v['dataset_tau_mean_evidence_vs_mean_accuracy']:.2f} |"
        )
    lines += ["", "## Linear probe (106 novel classes, 10 drawers train / 10 test)", ""]
    lines.append(
        "| backbone | evidence (shared lambda) acc | time s | evidence (per-class) acc | time s | ridge 5-fold CV acc | time s | logreg CV acc | time s |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        p = r["linear_probe"][n]
        lines.append(
            f"| {n} | {p['evidence']['accuracy']:.2f} | {p['evidence']['seconds']:.2f} | "
            f"{p['evidence_per_class']['accuracy']:.2f} | {p['evidence_per_class']['seconds']:.2f} | "
            f"{p['ridge_cv']['accuracy']:.2f} | {p['ridge_cv']['seconds']:.2f} | "
            f"{p['logreg_cv']['accuracy']:.2f} | {p['logreg_cv']['seconds']:.2f} |"
        )
    e = r["ensemble"]
    lines += [
        "",
        f"Greedy ensemble (train rows): order {e['order']}, accepted {e['accepted']}, "
        f"L* trace {[round(t, 1) for t in e['trace']]}, selected {e['selected']}, "
        f"test accuracy {e['test_accuracy']:.2f} %, {e['seconds']:.2f} s.",
        "",
        "## Time vs scikit-learn BayesianRidge (class by class, backbone by backbone)",
        "",
    ]
    t = r["timing"]
    lines.append("| | class fits / s | seconds |")
    lines.append("|---|---|---|")
    lines.append(
        f"| probfsl (all {t['classes']} classes x {len(names)} backbones, one call) | "
        f"{t['ours_class_fits_per_second']:.1f} | {t['ours_seconds_all_classes_all_backbones']:.2f} |"
    )
    lines.append(
        f"| BayesianRidge ({t['bayesian_ridge_classes_timed_per_backbone']} classes x {len(names)} backbones) | "
        f"{t['bayesian_ridge_class_fits_per_second']:.2f} | {t['bayesian_ridge_seconds']:.2f} |"
    )
    lines += [
        "",
        f"Throughput ratio: {t['throughput_ratio']:.1f}x; max |log evidence difference| "
        f"{t['max_abs_log_evidence_diff_vs_bayesian_ridge']:.2e}, max relative lambda difference "
        f"{t['max_rel_lambda_diff_vs_bayesian_ridge']:.2e} (N = {t['n_train']}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
