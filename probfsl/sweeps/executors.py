"""Where a sweep's cells run: worker processes on this machine, or a Ray cluster.

Both take a list of jobs (a cell and its key) and yield ``(key, row, log)`` as cells
end, in any order; the caller stores each row as it comes. A cell holds
``resources.cpus`` cores (its torch threads) and ``resources.gpus`` of a GPU.

* :class:`LocalExecutor` (the default, no server): a pool of worker processes, as many as
  the cores hold cells, or, when cells ask for a GPU and CUDA devices are present,
  ``1 / gpus`` workers per device, each bound to its device. Each worker loads a feature
  file once and keeps it for the cells that follow.
* :class:`RayExecutor`: one Ray task per cell with ``num_cpus`` / ``num_gpus``; each
  source's features are put in Ray's object store once, so that a node receives a file
  once and its workers read it without copies. ``address``: ``None`` starts a local
  cluster, ``"auto"`` joins the cluster of this machine, ``"ray://host:port"`` a remote
  one (``RAY_ADDRESS`` is read when ``address`` is ``None``).
"""

from __future__ import annotations

import io
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from probfsl.sweeps.cell import Cell, run_cell
from probfsl.sweeps.config import Resources

INSTALL_RAY = "pip install 'probfsl[distributed]'"


@dataclass(frozen=True)
class Job:
    """A cell to run and its key in the results store."""

    key: str
    cell: Cell


def _run_captured(cell: Cell, device: str, threads: int, fs=None) -> tuple[dict, str]:
    """``run_cell`` with its output captured: ``(row, log text)``."""
    buffer = io.StringIO()
    row = run_cell(cell, device, threads, buffer, fs)
    return row, buffer.getvalue()


# -- worker processes on this machine ----------------------------------------------------

_WORKER_DEVICE = "cpu"


def _init_worker(devices) -> None:
    """Bind this worker process to the next device of the queue ``devices``, and end it
    when the sweep's process is gone (killed outright, it cannot stop its workers)."""
    global _WORKER_DEVICE
    _WORKER_DEVICE = devices.get()
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """End this process once its parent ``parent`` has exited (its parent id changes)."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


def _load_source(dataset: str | None, features: str | None, allow_pickle: bool):
    """A source's :class:`~probfsl.data.FeatureSet`, loaded once per worker process."""
    from probfsl.data import load_dataset, load_features

    key = (dataset, features, allow_pickle)
    if key not in _SOURCES:
        _SOURCES.clear()  # one source held at a time: memory stays that of one file
        _SOURCES[key] = (
            load_dataset(dataset) if dataset else load_features(features, allow_pickle=allow_pickle)
        )
    return _SOURCES[key]


_SOURCES: dict = {}


def _local_job(cell: Cell, threads: int) -> tuple[dict, str]:
    device = _WORKER_DEVICE if cell.device == "auto" else cell.device
    try:
        fs = _load_source(cell.dataset, cell.features, cell.allow_pickle)
    except Exception:  # the cell's run loads it again and records the error
        fs = None
    return _run_captured(cell, device, threads, fs)


def local_devices(resources: Resources, cpu_count: int | None = None) -> list[str]:
    """The device of each local worker: with ``resources.gpus > 0`` and CUDA devices
    present, ``floor(1 / gpus)`` workers per device (at most what the cores hold); else
    one CPU worker per ``resources.cpus`` cores."""
    cores = cpu_count or os.cpu_count() or 1
    by_cores = max(1, cores // resources.cpus)
    gpus = 0
    if resources.gpus > 0:
        import torch

        gpus = torch.cuda.device_count()
    if gpus == 0:
        return ["cpu"] * by_cores
    per_gpu = max(1, math.floor(1 / resources.gpus)) if resources.gpus < 1 else 1
    devices = [f"cuda:{g}" for _ in range(per_gpu) for g in range(gpus)]
    return devices[:by_cores]


class LocalExecutor:
    """Worker processes on this machine (``workers`` of them, default
    :func:`local_devices`)."""

    name = "local"

    def __init__(self, resources: Resources, workers: int | None = None) -> None:
        self.resources = resources
        self.devices = local_devices(resources)
        if workers is not None:
            if workers < 1:
                raise ValueError(f"workers must be positive, got {workers}")
            self.devices = [self.devices[i % len(self.devices)] for i in range(workers)]

    def describe(self) -> str:
        kinds = sorted(set(self.devices))
        return f"{len(self.devices)} local worker process(es) on {', '.join(kinds)}"

    def run(self, jobs: Sequence[Job]) -> Iterator[tuple[str, dict, str]]:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool

        if not jobs:
            return
        context = mp.get_context("spawn")  # CUDA and torch's threads need fresh processes
        devices = context.Queue()
        for device in self.devices:
            devices.put(device)
        threads = self.resources.cpus
        pool = ProcessPoolExecutor(
            len(self.devices), context, initializer=_init_worker, initargs=(devices,)
        )
        try:
            futures = {pool.submit(_local_job, job.cell, threads): job for job in jobs}
            for future in as_completed(futures):
                job = futures[future]
                try:
                    row, log = future.result()
                except BrokenProcessPool:
                    row, log = _lost("its worker process died (out of memory?)"), ""
                yield job.key, row, log
        finally:  # interrupted: the cells not started are dropped, not waited for
            pool.shutdown(wait=False, cancel_futures=True)

    def map(self, fn, items: Sequence) -> list:
        """``[fn(item) for item in items]`` on the workers, in order (``fn`` importable at
        module level, its arguments picklable)."""
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        workers = min(len(self.devices), max(1, len(items)))
        with ProcessPoolExecutor(workers, mp.get_context("spawn")) as pool:
            return list(pool.map(fn, items))


def _lost(why: str) -> dict:
    """The row of a cell whose worker ended without a result."""
    return {"status": "failed", "error": f"WorkerLost: {why}"}


# -- Ray ---------------------------------------------------------------------------------


def import_ray():
    """The ``ray`` module, or a ``ValueError`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"--executor ray needs Ray, an optional extra: {INSTALL_RAY}") from None
    return ray


def _ray_job(cell: Cell, fs, threads: int) -> tuple[dict, str]:
    """A cell in a Ray worker: on its GPU when Ray gave it one."""
    import ray

    device = cell.device
    if device == "auto":
        device = "cuda" if ray.get_gpu_ids() else "cpu"
    return _run_captured(cell, device, threads, fs)


class RayExecutor:
    """One Ray task per cell, on a local or remote Ray cluster."""

    name = "ray"

    def __init__(
        self, resources: Resources, address: str | None = None, num_cpus: int | None = None
    ) -> None:
        self.ray = import_ray()
        self.resources = resources
        self.address = address or os.environ.get("RAY_ADDRESS")
        self.num_cpus = num_cpus

    def describe(self) -> str:
        return f"Ray at {self.address or 'a local cluster'}"

    def _start(self) -> bool:
        """Connect to (or start) the cluster; ``True`` when this call started it."""
        ray = self.ray
        if ray.is_initialized():
            return False
        options = {"address": self.address, "log_to_driver": False}
        if self.address is None:  # a local cluster of this process
            options.update(num_cpus=self.num_cpus, include_dashboard=False)
        ray.init(**options)
        return True

    def run(self, jobs: Sequence[Job]) -> Iterator[tuple[str, dict, str]]:
        if not jobs:
            return
        ray = self.ray
        started = self._start()
        pending = {}
        try:
            remote = ray.remote(_ray_job).options(
                num_cpus=self.resources.cpus, num_gpus=self.resources.gpus, max_retries=0
            )
            sources = {}
            for job in jobs:  # each source to the object store once
                cell = job.cell
                key = (cell.dataset, cell.features, cell.allow_pickle)
                if key not in sources:
                    try:
                        fs = _load_source(*key)
                        sources[key] = ray.put(fs)
                    except Exception:  # the cell's run loads it and records the error
                        sources[key] = None
            _SOURCES.clear()
            for job in jobs:
                cell = job.cell
                ref = sources[(cell.dataset, cell.features, cell.allow_pickle)]
                pending[remote.remote(cell, ref, self.resources.cpus)] = job
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                job = pending.pop(done[0])
                try:
                    row, log = ray.get(done[0])
                except ray.exceptions.RayError as err:
                    row, log = _lost(" ".join(str(err).split())[:500]), ""
                yield job.key, row, log
        finally:
            for ref in pending:  # interrupted: the cells not finished are cancelled
                ray.cancel(ref)
            if started:
                ray.shutdown()

    def map(self, fn, items: Sequence, window: int | None = None) -> list:
        """``[fn(item) for item in items]`` as Ray tasks, in order; at most ``window``
        items in flight (default: four per CPU of the cluster), so that the object store
        holds a few of them at a time."""
        if not items:
            return []
        ray = self.ray
        started = self._start()
        try:
            remote = ray.remote(fn).options(
                num_cpus=self.resources.cpus, num_gpus=self.resources.gpus, max_retries=0
            )
            window = window or max(1, 4 * int(ray.cluster_resources().get("CPU", 1)))
            refs, out = [], []
            for item in items:
                refs.append(remote.remote(item))
                if len(refs) >= window:
                    out.append(ray.get(refs.pop(0)))
            return out + ray.get(refs)
        finally:
            if started:
                ray.shutdown()


def make_executor(
    name: str, resources: Resources, address: str | None = None, workers: int | None = None
):
    """The executor called ``name`` (``"local"`` or ``"ray"``)."""
    if name == "local":
        if address is not None:
            raise ValueError("--address is for --executor ray")
        return LocalExecutor(resources, workers)
    if name == "ray":
        return RayExecutor(resources, address, num_cpus=workers)
    raise ValueError(f"executor must be 'local' or 'ray', got {name!r}")
