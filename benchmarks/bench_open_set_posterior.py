"""Open-set posteriors of every method on built-in Omniglot (few-shot open-set recognition).

Tasks: 5 known novel classes (``shot`` support + 15 queries each) and 75 open queries
(15 from each of 5 other novel classes, labelled K), drawn with ``default_rng([seed, t])``.
For each method: the closed-set accuracy (argmax of the first K columns of
``predict_proba_open`` on the closed queries), the accuracy of ``predict_proba`` on the
same tasks without the open queries, and the AUROC of the last column (open against
closed queries, per task, averaged), with 95% confidence intervals over tasks.

    .venv/bin/python benchmarks/bench_open_set_posterior.py --tasks 300 --shots 1 5
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from probfsl.data import load_dataset
from probfsl.data.tasks import Episodes
from probfsl.methods import METHODS, build_estimator

WAY, PER_CLASS, N_OPEN_CLASSES = 5, 15, 5


def open_tasks(fs, n_tasks: int, shot: int, seed: int = 0) -> tuple[Episodes, Episodes]:
    """(tasks with open queries, the same tasks without them); open queries last."""
    novel = fs.rows("novel")
    labels = fs.labels[novel]
    classes = np.unique(labels)
    by_class = {c: novel[labels == c] for c in classes}
    sup, sup_lab, qry, qry_lab, cls = [], [], [], [], []
    for t in range(n_tasks):
        rng = np.random.default_rng([seed, t])
        chosen = rng.choice(classes, WAY + N_OPEN_CLASSES, replace=False)
        s_rows, q_rows, q_lab = [], [], []
        for k, c in enumerate(chosen[:WAY]):
            rows = rng.choice(by_class[c], shot + PER_CLASS, replace=False)
            s_rows.append(rows[:shot])
            q_rows.append(rows[shot:])
            q_lab += [k] * PER_CLASS
        for c in chosen[WAY:]:
            q_rows.append(rng.choice(by_class[c], PER_CLASS, replace=False))
            q_lab += [WAY] * PER_CLASS
        s = np.stack(s_rows, 1).reshape(-1)  # shot-major
        sup.append(s)
        sup_lab.append(np.tile(np.arange(WAY), shot))
        qry.append(np.concatenate(q_rows))
        qry_lab.append(np.array(q_lab))
        cls.append(chosen[:WAY])
    feats = torch.as_tensor(fs.features, dtype=torch.float32)
    sup, qry = np.stack(sup), np.stack(qry)

    def make(query_rows, query_labels):
        return Episodes(
            feats[torch.as_tensor(sup)],
            torch.as_tensor(np.stack(sup_lab)),
            feats[torch.as_tensor(query_rows)],
            torch.as_tensor(query_labels),
            torch.as_tensor(np.stack(cls)),
            torch.as_tensor(sup),
            torch.as_tensor(query_rows),
        )

    n_closed = WAY * PER_CLASS
    return make(qry, np.stack(qry_lab)), make(qry[:, :n_closed], np.stack(qry_lab)[:, :n_closed])


def ci(values: np.ndarray) -> str:
    return f"{100 * values.mean():.1f} ± {196 * values.std(ddof=1) / np.sqrt(len(values)):.1f}"


def evaluate(name: str, fs, with_open: Episodes, closed: Episodes, batch: int) -> dict:
    est = build_estimator(name).fit_featureset(fs)
    n_closed = closed.n_query
    acc_open, acc_closed, auroc = [], [], []
    for a in range(0, len(closed), batch):
        p_open = est.predict_proba_open(with_open[a : a + batch])
        p_closed = est.predict_proba(closed[a : a + batch])
        labels = with_open.query_labels[a : a + batch]
        pred = p_open[:, :n_closed, :WAY].argmax(-1)
        acc_open.append((pred == labels[:, :n_closed]).double().mean(1))
        acc_closed.append((p_closed.argmax(-1) == labels[:, :n_closed]).double().mean(1))
        score = p_open[..., -1].double().numpy()
        is_open = (labels == WAY).numpy()
        auroc += [roc_auc_score(is_open[t], score[t]) for t in range(len(score))]
    return {
        "closed acc (open queries)": np.concatenate(acc_open),
        "closed acc (no open queries)": np.concatenate(acc_closed),
        "AUROC": np.array(auroc),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(2)
    fs = load_dataset("omniglot")
    print("| method | shot | closed acc, open queries | closed acc, no open queries | AUROC |")
    print("|---|---|---|---|---|")
    for shot in args.shots:
        with_open, closed = open_tasks(fs, args.tasks, shot)
        for name in args.methods:
            start = time.perf_counter()
            batch = min(args.batch, METHODS[name].cpu_batch)
            r = evaluate(name, fs, with_open, closed, batch)
            took = time.perf_counter() - start
            cells = " | ".join(ci(v) for v in r.values())
            print(f"| {name} | {shot} | {cells} |  ({took:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
