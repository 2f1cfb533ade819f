"""Every method on the CPU and, when present, on CUDA.

For each registered method on one built-in data set (5-way 1-shot, 75 queries, seed 0):

* tasks/s of ``predict_proba`` on the CPU in float32 (and on CUDA when available, with
  the peak GPU memory);
* host synchronisations and torch calls per ``predict_proba`` call, on 100 and on 1,000
  tasks (``--tasks``) (:class:`probfsl.host_syncs.HostSyncCounter`; a count that
  grows with the batch means a loop over tasks or points on the host);
* label agreement of float32 (CPU, and CUDA) with float64 on the CPU.

Two more rows: EM-Dirichlet's zero-shot path (``probfsl run --zero-shot``, WordNet, all
its classes) and GP-Tree's class-incremental estimator with VI (the default), timed as
base fit plus one novel stage plus prediction, agreement of its labels across devices.

    python benchmarks/bench_device.py [--dataset omniglot] [--tasks 1000] [--quick]

Writes ``results/device.md`` and ``.json``. A method that fails on a device is
recorded with its error instead of stopping the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes, sample_zero_shot_tasks
from probfsl.data.simplex import zero_shot_probabilities
from probfsl.host_syncs import HostSyncCounter
from probfsl.methods import METHODS
from probfsl.models.em_dirichlet import EMDirichlet
from probfsl.models.gp_tree import GPTree

HERE = Path(__file__).resolve().parent
#: methods that fit per-task samplers or long MM loops run on fewer tasks
SLOW = {"gp-tree": 20, "em-dirichlet": 20}


def fitted(method: str, fs, dtype: torch.dtype, device: torch.device):
    features, labels = fs.base(dtype)
    return make_estimator(method).fit_base(features.to(device), labels.to(device))


def timed_labels(model, episodes, device: torch.device) -> tuple[torch.Tensor, float]:
    episodes = episodes.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tic = time.perf_counter()
    labels = model.predict_proba(episodes).argmax(-1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return labels.cpu(), time.perf_counter() - tic


def syncs_per_call(model, fs, n_tasks: int) -> dict:
    """Host syncs and torch calls of one ``predict_proba`` call on ``n_tasks / 10`` and on
    ``n_tasks`` tasks (100 and 1,000 by default)."""
    out = {}
    for n in (max(1, n_tasks // 10), n_tasks):
        episodes = sample_episodes(fs, n, seed=0)
        with HostSyncCounter() as counter:
            model.predict_proba(episodes)
        out[n] = {"host_syncs": counter.total, "torch_calls": counter.torch_calls}
    return out


def row_for(method: str, fs, n_tasks: int) -> dict:
    n = max(10, n_tasks // SLOW.get(method, 1))
    episodes = sample_episodes(fs, n, seed=0)
    cpu = torch.device("cpu")
    row = {"method": method, "tasks": n}
    ref, _ = timed_labels(
        fitted(method, fs, torch.float64, cpu), episodes.to(dtype=torch.float64), cpu
    )
    model32 = fitted(method, fs, torch.float32, cpu)
    labels, seconds = timed_labels(model32, episodes, cpu)
    row["cpu_tasks_per_second"] = n / seconds
    row["cpu_float32_agreement"] = 100 * (labels == ref).double().mean().item()
    row["syncs"] = syncs_per_call(model32, fs, n_tasks)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        try:
            model = fitted(method, fs, torch.float32, cuda)
            timed_labels(model, episodes, cuda)  # warm-up (kernels, allocator, compilation)
            torch.cuda.reset_peak_memory_stats(cuda)
            labels, seconds = timed_labels(model, episodes, cuda)
            row["cuda_tasks_per_second"] = n / seconds
            row["cuda_peak_mib"] = torch.cuda.max_memory_allocated(cuda) / 2**20
            row["cuda_float32_agreement"] = 100 * (labels == ref).double().mean().item()
        except Exception as err:  # recorded, so that one method cannot stop the table
            row["cuda_error"] = f"{type(err).__name__}: {err}"[:200]
    return row


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tic = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - tic


def _on_devices(row: dict, run, n: int) -> dict:
    """``run(dtype, device) -> labels`` on the CPU (float64 reference, float32 timed), then
    CUDA when present; fills ``row`` like :func:`row_for`."""
    cpu = torch.device("cpu")
    ref, _ = _timed(lambda: run(torch.float64, cpu), cpu)
    labels, seconds = _timed(lambda: run(torch.float32, cpu), cpu)
    row["cpu_tasks_per_second"] = n / seconds
    row["cpu_float32_agreement"] = 100 * (labels.cpu() == ref.cpu()).double().mean().item()
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        try:
            run(torch.float32, cuda)  # warm-up
            torch.cuda.reset_peak_memory_stats(cuda)
            labels, seconds = _timed(lambda: run(torch.float32, cuda), cuda)
            row["cuda_tasks_per_second"] = n / seconds
            row["cuda_peak_mib"] = torch.cuda.max_memory_allocated(cuda) / 2**20
            row["cuda_float32_agreement"] = 100 * (labels.cpu() == ref.cpu()).double().mean().item()
        except Exception as err:  # recorded, so that one path cannot stop the table
            row["cuda_error"] = f"{type(err).__name__}: {err}"[:200]
    return row


def zero_shot_row(n_tasks: int) -> dict:
    """EM-Dirichlet zero-shot (WordNet, 3-10 classes per task, 75 queries, all classes)."""
    fs = load_dataset("wordnet")
    n = max(10, n_tasks // SLOW["em-dirichlet"])
    zs = sample_zero_shot_tasks(fs, n, 3, 10, 75, 0)
    model = EMDirichlet()
    probs = zero_shot_probabilities(fs, zs, model.temperature, torch.float32)

    def run(dtype, device):
        return model.predict_zero_shot(probs.to(device=device, dtype=dtype))

    row = {"method": "em-dirichlet zero-shot (wordnet)", "tasks": n, "syncs": {}}
    sizes = (max(1, n_tasks // 10), n_tasks)
    all_probs = zero_shot_probabilities(
        fs, sample_zero_shot_tasks(fs, n_tasks, 3, 10, 75, 0), model.temperature
    )
    for m in sizes:
        with HostSyncCounter() as counter:
            model.predict_zero_shot(all_probs[:m])
        row["syncs"][m] = {"host_syncs": counter.total, "torch_calls": counter.torch_calls}
    return _on_devices(row, run, n)


def class_incremental_row(fs) -> dict:
    """GP-Tree class-incremental with VI: base fit on the base classes, one novel stage of
    5 classes x 5 shots, prediction on every novel-class row; "tasks" is one stage."""
    x_base, y_base = fs.base(torch.float64)
    novel = fs.rows("novel")
    novel = novel[fs.labels[novel] >= 0]
    x_all = torch.as_tensor(fs.features[novel], dtype=torch.float64)
    y_all = torch.as_tensor(fs.labels[novel])
    classes = y_all.unique()[:5]
    rows = torch.cat([torch.nonzero(y_all == c).squeeze(-1) for c in classes])
    shots = torch.cat([torch.nonzero(y_all == c).squeeze(-1)[:5] for c in classes])

    def run(dtype, device):
        model = GPTree(dtype=dtype)
        model.fit(x_base.to(device, dtype), y_base.to(device))
        model.partial_fit(x_all[shots].to(device, dtype), y_all[shots].to(device))
        return model.predict(x_all[rows].to(device, dtype))

    row = {"method": "gp-tree class-incremental (VI)", "tasks": 1, "syncs": {}}
    return _on_devices(row, run, 1)


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| method | tasks | CPU tasks/s | float32 = float64 (CPU, %) | host syncs / torch calls "
        "(small → large batch) | CUDA tasks/s | CUDA peak MiB | CUDA float32 = CPU float64 (%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["syncs"]:
            (n1, a), (n2, b) = sorted(r["syncs"].items())
            syncs = (
                f"{a['host_syncs']} / {a['torch_calls']} ({n1} tasks) → "
                f"{b['host_syncs']} / {b['torch_calls']} ({n2} tasks)"
            )
        else:
            syncs = "–"
        cuda = r.get("cuda_error") or (
            f"{r['cuda_tasks_per_second']:.0f}" if "cuda_tasks_per_second" in r else "–"
        )
        peak = f"{r['cuda_peak_mib']:.0f}" if "cuda_peak_mib" in r else "–"
        agree = f"{r['cuda_float32_agreement']:.2f}" if "cuda_float32_agreement" in r else "–"
        lines.append(
            f"| {r['method']} | {r['tasks']} | {r['cpu_tasks_per_second']:.0f} | "
            f"{r['cpu_float32_agreement']:.2f} | {syncs} | {cuda} | {peak} | {agree} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="omniglot")
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None, help="unused (built-in data)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.tasks = 100
    fs = load_dataset(args.dataset)
    rows = []
    for method in args.methods:
        rows.append(row_for(method, fs, args.tasks))
        print(markdown(rows[-1:], "").splitlines()[-1], flush=True)
    if "em-dirichlet" in args.methods:
        rows.append(zero_shot_row(args.tasks))
        print(markdown(rows[-1:], "").splitlines()[-1], flush=True)
    if "gp-tree" in args.methods:
        rows.append(class_incremental_row(fs))
        print(markdown(rows[-1:], "").splitlines()[-1], flush=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    header = (
        f"## Methods on the CPU and on CUDA ({args.dataset}, 5-way 1-shot, 75 queries)\n\n"
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), {gpu}; torch "
        f"{torch.__version__}, {args.threads} CPU thread(s). Tasks/s of predict_proba in "
        "float32 after fitting the base statistics; host syncs counted by "
        "probfsl.host_syncs.HostSyncCounter (item, tolist, bool, float, int, cpu, numpy); "
        f"fewer tasks for {', '.join(SLOW)}."
    )
    out = args.out or HERE / ("results-quick" if args.quick else "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "device.md").write_text(markdown(rows, header))
    (out / "device.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out / 'device.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
