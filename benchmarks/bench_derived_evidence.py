"""Derived (VMP) against hand-written evidence LS-SVM on few-shot episodes.

Same lambda (interior tasks), log evidence (summed over a task's classes; the tasks
where it differs by more than 1e-6 relative, split by which engine is higher), labels
and limit decisions, and the time ratio derived / hand-written on the CPU (one
thread), 5-way 1- and 5-shot. ``--data`` takes built-in names (``omniglot``,
``wordnet``) and ``.npz`` feature files with a base split.

    python benchmarks/bench_derived_evidence.py [--tasks 1000] [--data omniglot ...]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from probfsl.data import load_dataset, load_features, sample_episodes
from probfsl.models.evidence import EvidenceLSSVM


def compare(fs, n_tasks: int, shot: int, mode: str) -> str:
    episodes = sample_episodes(fs, n_tasks, 5, shot, 15, seed=0)
    out, times = {}, {}
    for engine in ("handwritten", "derived"):
        est = EvidenceLSSVM(lambda_mode=mode, engine=engine).fit_base(*fs.base())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            est.predict_proba(sample_episodes(fs, 4, 5, shot, 15, seed=1))  # warm-up
            start = time.process_time()
            proba = est.predict_proba(episodes)
        times[engine] = time.process_time() - start
        out[engine] = (est, proba)
    (h, ph), (d, pd) = out["handwritten"], out["derived"]
    inner = ~h.last_at_boundary_
    lam = ((d.last_lambda_ - h.last_lambda_) / h.last_lambda_).abs()[inner]
    fh, fd = h.last_log_evidence_.sum(-1), d.last_log_evidence_.sum(-1)
    signed = (fd - fh) / fh.abs()
    ev = signed.abs()
    lower, higher = int((signed < -1e-6).sum()), int((signed > 1e-6).sum())
    return (
        f"| {fs.name} | {shot} | {mode} | {int(inner.sum())}/{inner.numel()} | "
        f"{float(lam.max()) if lam.numel() else 0:.1e} | {int((lam > 1e-6).sum())} | "
        f"{float(ev.max()):.1e} | {lower} / {higher} | "
        f"{float((pd.argmax(-1) == ph.argmax(-1)).float().mean()):.5f} | "
        f"{float((d.last_at_limit_ == h.last_at_limit_).float().mean()):.3f} | "
        f"{times['handwritten']:.2f} | {times['derived']:.2f} | "
        f"{times['derived'] / times['handwritten']:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--data", nargs="+", default=["omniglot"])
    parser.add_argument("--modes", nargs="+", default=["shared", "per_class"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| data | shot | lambda | interior targets | max rel lambda | >1e-6 | "
        "max rel evidence | >1e-6 (derived lower / higher) | labels agree | limit agree | "
        "hand CPU s | derived CPU s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.data:
        fs = load_features(name) if name.endswith(".npz") else load_dataset(name)
        for mode in args.modes:
            for shot in (1, 5):
                print(compare(fs, args.tasks, shot, mode), flush=True)


if __name__ == "__main__":
    main()
