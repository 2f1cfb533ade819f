"""GPU timing targets (BAVARDAGE task_span, EM-Dirichlet; 10,000 tasks) on one device.

* **task_span**: the default BAVARDAGE estimator (``whitening="task_span"``),
  ``predict_proba`` on ``--tasks`` 5-way 1-shot tasks (75 queries) of the 1280-d Omniglot
  features (``--data-dir``: the shared data), float32, the episodes already on the device.
  Against, in the same estimator and process: the reference code's whitening operations
  (thin SVD, two inverses, eigh; :func:`bench_task_span.reference_code_whitening`) and the
  old reduced-QR + eigh route, both on ``--slow-tasks`` tasks (they run one matrix at a
  time on CUDA) and compared as tasks/s.
* **EM-Dirichlet**: ``predict_proba`` on ``--tasks`` WordNet 5-way 5-shot tasks
  (built-in data) and ``predict_zero_shot`` on ``--tasks`` zero-shot tasks (3-10 of all 41
  classes, 75 queries), float32 on the device, library defaults (on CUDA the inner loop
  compiled and replayed from CUDA graphs) and, on CUDA, the eager inner loop
  (``compiled=False``); the first call (compilation, capture) is reported apart.

Each timing is the median of ``--repeats`` runs after one warm-up run on the same
inputs, with the device synchronised around it. Labels: agreement with float64 on the CPU
on the first ``--check-tasks`` tasks (tasks are independent, so a prefix is a fair check).

    python benchmarks/bench_gpu_targets.py --data-dir ../shared/data [--device cuda]

Writes ``results/device_targets.md`` and ``.json`` (``--out DIR``) and prints one line
per measurement. Not part of ``run_all.py``'s default list: on a CPU the 10,000-task
runs take tens of minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_task_span import reference_code_whitening, task_span_whitening_qr_eigh  # noqa: E402

import probfsl.models.bavardage as bavardage_module  # noqa: E402
from probfsl.data import load_dataset, sample_episodes, sample_zero_shot_tasks  # noqa: E402
from probfsl.data.loaders import load_npz  # noqa: E402
from probfsl.data.simplex import zero_shot_probabilities  # noqa: E402
from probfsl.models.bavardage import Bavardage  # noqa: E402
from probfsl.models.em_dirichlet import EMDirichlet  # noqa: E402

HERE = Path(__file__).resolve().parent
CPU = torch.device("cpu")


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warm_up: bool = True):
    """(last output, median seconds of ``repeats`` runs after one warm-up run)."""
    out = fn() if warm_up else None
    times = []
    for _ in range(repeats):
        synced(device)
        tic = time.perf_counter()
        out = fn()
        synced(device)
        times.append(time.perf_counter() - tic)
    return out, statistics.median(times)


def agreement(labels: torch.Tensor, reference: torch.Tensor) -> float:
    n = reference.shape[0]
    return 100.0 * float((labels[:n].cpu() == reference).double().mean())


def report(rows: list, **row) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def task_span(args, device: torch.device, rows: list) -> None:
    fs = load_npz(
        args.data_dir / "omniglot_small" / "omniglot_small_effnetlite0.npz", name="omniglot-1280"
    )
    episodes = sample_episodes(fs, args.tasks, 5, 1, 75, balance="balanced", seed=0)
    est64 = Bavardage().fit_base(*fs.base(torch.float64))
    reference = est64.predict_proba(episodes[: args.check_tasks].to(dtype=torch.float64))
    reference = reference.argmax(-1)
    x, y = fs.base(torch.float32)
    est = Bavardage().fit_base(x.to(device), y.to(device))
    on_device = episodes.to(device)
    synced(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probs, seconds = median_seconds(lambda: est.predict_proba(on_device), device, args.repeats)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    report(
        rows,
        what="bavardage task_span (probfsl default)",
        tasks=args.tasks,
        seconds=seconds,
        tasks_per_second=args.tasks / seconds,
        agreement_with_cpu_float64=agreement(probs.argmax(-1), reference),
        peak_mib=peak,
    )
    del probs
    few = on_device[: args.slow_tasks]
    slow_routes = {
        "reference code's whitening operations": lambda x, p, s: reference_code_whitening(
            x, torch.linalg.inv(p)
        ),
        "old reduced QR + eigh": task_span_whitening_qr_eigh,
    }
    for name, route in slow_routes.items():
        with mock.patch.object(bavardage_module, "task_span_whitening", route):
            probs, s = median_seconds(lambda: est.predict_proba(few), device, 1)
        report(
            rows,
            what=f"bavardage task_span, {name}",
            tasks=args.slow_tasks,
            seconds=s,
            tasks_per_second=args.slow_tasks / s,
            speedup_of_probfsl=(args.tasks / seconds) / (args.slow_tasks / s),
            agreement_with_cpu_float64=agreement(probs.argmax(-1), reference),
        )


def em_dirichlet(args, device: torch.device, rows: list) -> None:
    """Library defaults; on CUDA also ``compiled=False`` (the eager inner loop) on the same
    tasks. The first call of each variant, which compiles and captures, is timed apart."""
    fs = load_dataset("wordnet")
    n_check = args.check_tasks
    episodes = sample_episodes(fs, args.tasks, 5, 5, 75, seed=0)
    zs = sample_zero_shot_tasks(fs, args.tasks, 3, 10, 75, 0)
    probs64 = zero_shot_probabilities(fs, zs, EMDirichlet().temperature, torch.float64)
    probs32 = probs64.to(device=device, dtype=torch.float32)
    x, y = fs.base(torch.float32)
    on_device = episodes.to(device)
    variants = [None, False] if device.type == "cuda" else [None]
    cases = {
        "few-shot (wordnet 5-way 5-shot, soft)": (
            EMDirichlet()
            .fit_base(*fs.base(torch.float64))
            .predict_proba(episodes[:n_check].to(dtype=torch.float64))
            .argmax(-1),
            lambda c: EMDirichlet(compiled=c).fit_base(x.to(device), y.to(device)),
            lambda est: est.predict_proba(on_device).argmax(-1),
        ),
    }
    for hard in (False, True):
        name = f"zero-shot (wordnet, {'hard' if hard else 'soft'})"
        cases[name] = (
            EMDirichlet(hard=hard).predict_zero_shot(probs64[:n_check]),
            lambda c, h=hard: EMDirichlet(hard=h, compiled=c),
            lambda est: est.predict_zero_shot(probs32),
        )
    for name, (reference, make, predict) in cases.items():
        labels = {}
        for compiled in variants:
            est = make(compiled)
            synced(device)
            tic = time.perf_counter()
            predict(est)
            synced(device)
            first = time.perf_counter() - tic
            labels[compiled], seconds = median_seconds(
                lambda p=predict, e=est: p(e), device, args.repeats, warm_up=False
            )
            row = dict(
                what=f"em-dirichlet {name}, "
                + ("eager inner loop" if compiled is False else "defaults"),
                tasks=args.tasks,
                seconds=seconds,
                first_call_seconds=first,
                tasks_per_second=args.tasks / seconds,
                agreement_with_cpu_float64=agreement(labels[compiled], reference),
            )
            if compiled is False:
                row["agreement_with_defaults"] = agreement(labels[False], labels[None].cpu())
            report(rows, **row)


def markdown(result: dict) -> str:
    lines = [
        "## GPU targets (10,000 tasks, float32, device-resident)",
        "",
        f"Device: {result['device']}; torch {result['torch']}. Median of "
        f"{result['repeats']} runs after a warm-up; the first call (compilation, graph "
        "capture) apart. Agreement: labels against float64 on the CPU on the first "
        f"{result['check_tasks']} tasks. `python benchmarks/bench_gpu_targets.py`.",
        "",
        "| what | tasks | seconds | tasks/s | first call (s) | = CPU float64 (%) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        first = f"{r['first_call_seconds']:.2f}" if "first_call_seconds" in r else "–"
        what = r["what"]
        if "speedup_of_probfsl" in r:
            what += f" (probfsl {r['speedup_of_probfsl']:.0f}x faster per task)"
        lines.append(
            f"| {what} | {r['tasks']} | {r['seconds']:.3f} | {r['tasks_per_second']:.0f} | "
            f"{first} | {r['agreement_with_cpu_float64']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=(HERE.parent.parent / "shared" / "data"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--slow-tasks", type=int, default=1_000)
    parser.add_argument("--check-tasks", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("task_span", "em_dirichlet"), default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows: list = []
    if args.only in (None, "task_span"):
        task_span(args, device, rows)
    if args.only in (None, "em_dirichlet"):
        em_dirichlet(args, device, rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {
        "device": name,
        "torch": torch.__version__,
        "repeats": args.repeats,
        "check_tasks": args.check_tasks,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_targets.json").write_text(json.dumps(result, indent=1))
    (args.out / "device_targets.md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
