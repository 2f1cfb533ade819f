"""Where independent calls run: worker processes on this machine, or a Ray cluster.

An executor runs ``fn(item, shared)`` for every item of a list, ``fn`` a function that
can be imported by name (its arguments picklable). :meth:`stream` yields
``(index, result, error)`` as calls end, in any order; :meth:`map` returns the results
in order. ``share(item)`` names the large object an item needs (a sweep cell's feature
file) as ``(key, loader, args)``: ``loader(*args)`` is made once per key and handed to
``fn`` as ``shared``. A call holds ``resources.cpus`` cores (its torch threads) and
``resources.gpus`` of a GPU; :func:`assigned_device` is the device it was given.

* :class:`LocalExecutor` (the default, no server): a pool of worker processes, as many as
  the cores hold calls, or, when calls ask for a GPU and CUDA devices are present,
  ``1 / gpus`` workers per device, each bound to its device. A worker makes a shared
  object once and keeps it for the calls that follow (one at a time), and ends when the
  process that started it is gone.
* :class:`RayExecutor`: one Ray task per call with ``num_cpus`` / ``num_gpus``; each shared
  object is put in Ray's object store once, so that a node receives it once and its
  workers read its arrays without copies. ``address``: ``None`` starts a local cluster,
  ``"auto"`` joins the cluster of this machine, ``"ray://host:port"`` a remote one
  (``RAY_ADDRESS`` is read when ``address`` is ``None``).

Used by :mod:`probfsl.sweeps.runner` (one call per cell) and by ``probfsl extract``
(one call per shard of images).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

INSTALL_RAY = "pip install 'probfsl[distributed]'"

#: ``share(item)``: the key of the item's shared object, and how to make it
Share = Callable[[Any], tuple[Hashable, Callable, tuple]]


@dataclass(frozen=True)
class Resources:
    """What one call (a sweep's cell) holds while it runs: CPU cores (also its torch
    threads) and a share of a GPU (``0.25``: four calls on one GPU)."""

    cpus: int = 1
    gpus: float = 0.0


#: the device this process was bound to (a local worker's), ``None`` elsewhere
_BOUND: str | None = None


def assigned_device() -> str:
    """The device of the call running in this process: a local worker's own device, the
    GPU Ray gave the task (``"cuda"``: Ray sets ``CUDA_VISIBLE_DEVICES``), else ``"cpu"``."""
    if _BOUND is not None:
        return _BOUND
    try:
        import ray

        if ray.is_initialized() and ray.get_gpu_ids():
            return "cuda"
    except ImportError:
        pass
    return "cpu"


def _shared_value(shared: tuple | None, cache: dict):
    """``loader(*args)`` of ``shared = (key, loader, args)``, made once per key in
    ``cache`` (which holds one at a time: memory stays that of one object); ``None``
    when it fails (the call then meets the error itself)."""
    if shared is None:
        return None
    key, loader, args = shared
    if key not in cache:
        cache.clear()
        try:
            cache[key] = loader(*args)
        except Exception:
            cache[key] = None
    return cache[key]


# -- worker processes on this machine ----------------------------------------------------

_WORKER_SHARED: dict = {}


def _init_worker(devices, threads: int) -> None:
    """Bind this worker process to the next device of the queue ``devices`` with
    ``threads`` torch threads, and end it when its parent is gone (a parent killed
    outright cannot stop its workers)."""
    global _BOUND
    _BOUND = devices.get()
    import torch

    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """End this process once its parent ``parent`` has exited (its parent id changes)."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


def _local_call(fn: Callable, item: Any, shared: tuple | None):
    return fn(item, _shared_value(shared, _WORKER_SHARED))


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

    def stream(
        self, fn: Callable, items: Sequence, share: Share | None = None
    ) -> Iterator[tuple[int, Any, str]]:
        """``(index, fn(item, shared), "")`` as calls end; ``(index, None, error)`` for a
        call that raised or whose worker died."""
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool

        if not items:
            return
        context = mp.get_context("spawn")  # CUDA and torch's threads need fresh processes
        devices = context.Queue()
        for device in self.devices:
            devices.put(device)
        workers = min(len(self.devices), len(items))
        pool = ProcessPoolExecutor(
            workers,
            context,
            initializer=_init_worker,
            initargs=(devices, self.resources.cpus),
        )
        try:
            futures = {
                pool.submit(_local_call, fn, item, share(item) if share else None): i
                for i, item in enumerate(items)
            }
            for future in as_completed(futures):
                try:
                    yield futures[future], future.result(), ""
                except BrokenProcessPool:
                    yield futures[future], None, "WorkerLost: its worker process died"
                except Exception as err:
                    yield futures[future], None, f"{type(err).__name__}: {err}"
        finally:  # interrupted: the calls not started are dropped, not waited for
            pool.shutdown(wait=False, cancel_futures=True)

    def map(self, fn: Callable, items: Sequence, share: Share | None = None) -> list:
        """``[fn(item, shared) for item in items]`` on the workers, in order; the first
        error raises ``RuntimeError``."""
        return _in_order(self.stream(fn, items, share), len(items))


def _in_order(stream: Iterator[tuple[int, Any, str]], n: int) -> list:
    out = [None] * n
    for index, result, error in stream:
        if error:
            raise RuntimeError(error)
        out[index] = result
    return out


# -- Ray ---------------------------------------------------------------------------------


def import_ray():
    """The ``ray`` module, or a ``ValueError`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"--executor ray needs Ray, an optional extra: {INSTALL_RAY}") from None
    return ray


def _ray_call(fn: Callable, item: Any, shared: Any, threads: int):
    """A call in a Ray worker (``shared`` already resolved from the object store)."""
    import torch

    torch.set_num_threads(threads)
    return fn(item, shared)


class RayExecutor:
    """One Ray task per call, on a local or remote Ray cluster."""

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

    def stream(
        self, fn: Callable, items: Sequence, share: Share | None = None, window: int | None = None
    ) -> Iterator[tuple[int, Any, str]]:
        """``(index, fn(item, shared), "")`` as tasks end; ``(index, None, error)`` for a
        task that failed. At most ``window`` tasks are in flight (default: four per CPU of
        the cluster), so that the object store holds a few items at a time."""
        if not items:
            return
        ray = self.ray
        started = self._start()
        pending: dict = {}
        try:
            remote = ray.remote(_ray_call).options(
                num_cpus=self.resources.cpus, num_gpus=self.resources.gpus, max_retries=0
            )
            window = window or max(1, 4 * int(ray.cluster_resources().get("CPU", 1)))
            refs: dict = {}  # each shared object to the object store once
            cache: dict = {}
            for i, item in enumerate(items):
                shared = share(item) if share else None
                ref = None
                if shared is not None:
                    if shared[0] not in refs:
                        value = _shared_value(shared, cache)
                        refs[shared[0]] = None if value is None else ray.put(value)
                    ref = refs[shared[0]]
                pending[remote.remote(fn, item, ref, self.resources.cpus)] = i
                while len(pending) >= window:
                    yield self._next(pending)
            cache.clear()
            while pending:
                yield self._next(pending)
        finally:
            for ref in pending:  # interrupted: the tasks not finished are cancelled
                ray.cancel(ref)
            if started:
                ray.shutdown()

    def _next(self, pending: dict) -> tuple[int, Any, str]:
        ray = self.ray
        done, _ = ray.wait(list(pending), num_returns=1)
        index = pending.pop(done[0])
        try:
            return index, ray.get(done[0]), ""
        except ray.exceptions.RayError as err:
            return index, None, f"WorkerLost: {' '.join(str(err).split())[:500]}"

    def map(self, fn: Callable, items: Sequence, share: Share | None = None) -> list:
        """``[fn(item, shared) for item in items]`` as Ray tasks, in order; the first error
        raises ``RuntimeError``."""
        return _in_order(self.stream(fn, items, share), len(items))


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
