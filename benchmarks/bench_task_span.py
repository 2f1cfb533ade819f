"""BAVARDAGE ``task_span`` whitening: the eigendecomposition-free routes against the old one.

The old implementation (a reduced QR of each task's D x N matrix and an eigendecomposition
of U_t^T S_w^{-1} U_t, [T, N, N] with N = 80 to 100) is kept here, and only here, as the
"before". On CUDA both decompositions run one matrix at a time above 32 x 32; the new
:func:`probfsl.inference.plda.task_span_whitening` uses Cholesky factorisations, triangular
solves and (route ``"sign"``, the default off the CPU) a Newton matrix-sign iteration.

In one process, on the same tasks, for the default estimator ``Bavardage()``:

* label agreement of the new routes (``"eigh"``, the CPU default, and ``"sign"``) with
  the old function, float64 and float32, on the built-in data sets and on the shared
  Omniglot 1280-d features (1-shot and 5-shot, Dirichlet tasks); in float32 also every
  route's agreement with the old function's float64 labels;
* CPU time of ``predict_proba`` for 5-way 1-shot tasks at 1280-d (15 queries per class),
  old and new alternating, best of ``--rounds``; and of the whitening alone, also against
  the reference code's whitening operations (thin SVD, inverses, eigh;
  docs/design/bavardage.md §3.1).

    python benchmarks/bench_task_span.py [--data-dir DIR] [--tasks 500] [--time-tasks 1000]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import probfsl.models.bavardage as bavardage_module
from probfsl.data.builtin import load_dataset
from probfsl.data.loaders import load_npz
from probfsl.data.tasks import sample_episodes
from probfsl.inference.eigh import stable_eigh
from probfsl.inference.plda import task_span_whitening
from probfsl.models.bavardage import Bavardage

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = (HERE.parent.parent / "shared" / "data").resolve()


def task_span_whitening_qr_eigh(
    x: torch.Tensor, precision: torch.Tensor, s_max: float | None = None
) -> torch.Tensor:
    """The old implementation (the "before"): U_t from a reduced QR of x^T, then
    eigh(U_t^T S_w^{-1} U_t) per task; y = (x U_t) V diag(min(a^{1/2}, s_max))."""
    d = x.shape[-1]
    precision = precision.to(x)
    if x.shape[1] >= d:
        a, v = stable_eigh(precision)
        v = v.expand(x.shape[0], d, d)
        a = a.expand(x.shape[0], d)
        coords = x
    else:
        span, r_factor = torch.linalg.qr(x.transpose(1, 2))
        coords = r_factor.transpose(1, 2)
        a, v = stable_eigh(span.transpose(1, 2) @ precision @ span)
    s = a.clamp_min(0).sqrt()
    if s_max is not None and not math.isinf(s_max):
        s = s.clamp_max(s_max)
    return (coords @ v) * s.unsqueeze(1)


def reference_code_whitening(x: torch.Tensor, scatter: torch.Tensor) -> torch.Tensor:
    """The whitening operations of the reference code as design §3.1 describes them (steps S
    and V; for timing only): thin SVD of x^T, X U_t, S_w^{-1} (once), M_t = (U_t^T S_w^{-1}
    U_t)^{-1}, eigh(M_t) with the eigenvalues sorted in descending order, X U_t V_e."""
    u, _, _ = torch.linalg.svd(x.transpose(1, 2), full_matrices=False)
    data = x @ u
    m_t = torch.linalg.inv(u.transpose(1, 2) @ torch.linalg.inv(scatter) @ u)
    e, v = torch.linalg.eigh(m_t)
    e, idx = e.sort(dim=1, descending=True)
    v = v.gather(2, idx.unsqueeze(1).expand(-1, v.shape[1], -1))
    return data @ v * e.clamp_min(1e-12).rsqrt().clamp_max(5.0).unsqueeze(1)


def _route(name: str):
    """The whitening function the estimator calls, for one route."""
    if name == "old":
        return task_span_whitening_qr_eigh
    return lambda x, p, s_max: task_span_whitening(x, p, s_max, method=name)


def predict(est: Bavardage, episodes, route: str) -> torch.Tensor:
    with mock.patch.object(bavardage_module, "task_span_whitening", _route(route)):
        return est.predict_proba(episodes)


def agreement(sets: dict, n_tasks: int) -> list[dict]:
    rows, reference = [], {}
    for name, fs in sets.items():
        for dtype in (torch.float64, torch.float32):
            est = Bavardage().fit_base(*fs.base(dtype))
            for shot in (1, 5):
                episodes = sample_episodes(
                    fs, n_tasks, 5, shot, 75, balance="dirichlet", seed=0, dtype=dtype
                )
                probs = {r: predict(est, episodes, r) for r in ("old", "eigh", "sign")}
                labels = {r: p.argmax(-1) for r, p in probs.items()}
                row = dict(data=name, shot=shot, dtype=str(dtype)[6:], tasks=n_tasks)
                for r in ("eigh", "sign"):
                    row[f"{r}_agree"] = float((labels[r] == labels["old"]).double().mean())
                    row[f"{r}_max_prob_diff"] = float((probs[r] - probs["old"]).abs().max())
                if dtype == torch.float64:
                    reference[name, shot] = labels["old"]
                else:  # float32 against the old float64 labels, for every route
                    for r, lab in labels.items():
                        row[f"{r}_agree_with_old_float64"] = float(
                            (lab == reference[name, shot]).double().mean()
                        )
                correct = labels["old"] == episodes.query_labels
                row["accuracy_old"] = float(correct.double().mean())
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def timing(fs, n_tasks: int, rounds: int) -> dict:
    """CPU seconds of predict_proba (float32, 5-way 1-shot, 15 queries per class)."""
    est = Bavardage().fit_base(*fs.base(torch.float32))
    episodes = sample_episodes(fs, n_tasks, 5, 1, 75, balance="balanced", seed=0)
    best = {r: math.inf for r in ("old", "eigh", "sign")}
    for _ in range(rounds):
        for route in best:
            tic = time.perf_counter()
            predict(est, episodes, route)
            best[route] = min(best[route], time.perf_counter() - tic)
    out = dict(tasks=n_tasks, threads=torch.get_num_threads(), rounds=rounds)
    out.update({f"seconds_{r}": s for r, s in best.items()})
    # the whitening alone, against the reference code's operations (design §3.1)
    x = episodes.points() - est.base_mean_.to(episodes.support)
    x = x / x.norm(dim=-1, keepdim=True)
    precision, scatter = est.precision_.to(x), est.scatter_.to(x)
    calls = {
        "old": lambda: task_span_whitening_qr_eigh(x, precision, est.s_max_),
        "eigh": lambda: task_span_whitening(x, precision, est.s_max_, method="eigh"),
        "sign": lambda: task_span_whitening(x, precision, est.s_max_, method="sign"),
        "reference_code_ops": lambda: reference_code_whitening(x, scatter),
    }
    alone = {r: math.inf for r in calls}
    for _ in range(rounds):
        for route, call in calls.items():
            tic = time.perf_counter()
            call()
            alone[route] = min(alone[route], time.perf_counter() - tic)
    out.update({f"whitening_seconds_{r}": s for r, s in alone.items()})
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tasks", type=int, default=500, help="tasks per agreement setting")
    parser.add_argument("--time-tasks", type=int, default=1000, help="tasks for the timing")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "task_span.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    omniglot = load_npz(
        args.data_dir / "omniglot_small" / "omniglot_small_effnetlite0.npz", name="omniglot-1280"
    )
    result = {}
    if not args.skip_agreement:
        sets = {
            "omniglot (built-in, 64-d)": load_dataset("omniglot"),
            "wordnet (built-in, 384-d)": load_dataset("wordnet"),
            "omniglot-1280": omniglot,
        }
        result["agreement"] = agreement(sets, args.tasks)
    result["timing"] = timing(omniglot, args.time_tasks, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
