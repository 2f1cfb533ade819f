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
  ``1 / gpus`` workers per device, each bound to its device. A worker is a fresh
  interpreter that does not run the starting process's main script (no
  ``if __name__ == "__main__":`` guard is needed). It makes a shared object once and keeps
  it for the calls that follow (one at a time), and ends when the process that started it
  is gone. A worker that dies loses only its own call: a new worker takes its place and
  the call runs again, up to :data:`RETRIES` times.
* :class:`RayExecutor`: one Ray task per call with ``num_cpus`` / ``num_gpus``; each shared
  object is put in Ray's object store once, so that a node receives it once and its
  workers read its arrays without copies. ``address``: ``None`` starts a local cluster,
  ``"auto"`` joins the cluster of this machine, ``"ray://host:port"`` a remote one
  (``RAY_ADDRESS`` is read when ``address`` is ``None``).

An ``error`` of :meth:`stream` is the executor's: the call returned no result (its
worker process died, it was killed or cancelled, or ``fn`` raised). A sweep's ``fn``
catches the errors of its cell itself, so such an error is never a cell's result: the
sweep does not store it and runs the cell again next time.

Used by :mod:`probfsl.sweeps.runner` (one call per cell) and by ``probfsl extract``
(one call per shard of images).
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: how to install Ray from a clone of probfsl (probfsl is not on the package index)
INSTALL_RAY = 'pip install -c constraints.txt -e ".[distributed]" (from a clone of probfsl)'

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

#: how many times a call whose worker process died is run again (on a new worker) before
#: it is given up as lost: a worker killed once by a neighbour's memory use gets another
#: chance, a call that kills every worker it runs on does not stop the others
RETRIES = 1

#: what a local worker process runs: a fresh interpreter that reads its set-up (the
#: parent's ``sys.path``, its device, its threads) and then its calls from stdin; it never
#: imports the parent's main script, so a script needs no ``if __name__ == "__main__":``
_BOOT = (
    "import pickle, sys\n"
    "boot = pickle.loads(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))\n"
    "sys.path[:] = boot['path']\n"
    "from probfsl.sweeps.executors import _worker_main\n"
    "_worker_main(boot)\n"
)
_HEADER = struct.Struct("<qQ")  # a message's call index and its length in bytes


def _send(stream, index: int, payload: bytes) -> None:
    stream.write(_HEADER.pack(index, len(payload)))
    stream.write(payload)
    stream.flush()


def _receive(stream) -> tuple[int, bytes] | None:
    """The next ``(index, payload)`` of ``stream``; ``None`` at its end (or a cut one)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    index, size = _HEADER.unpack(header)
    payload = stream.read(size)
    return (index, payload) if len(payload) == size else None


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _worker_main(boot: dict) -> None:
    """A local worker process: bound to ``boot["device"]`` with ``boot["threads"]`` torch
    threads, it runs the calls it reads from stdin one at a time and writes each one's
    ``(result, error)`` back; it ends at the end of stdin or when its parent is gone.
    What the calls print goes to stderr (stdout carries the replies)."""
    global _BOUND
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdin = open(os.devnull)  # noqa: SIM115 (this process's stdin from now on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its workers itself
    threading.Thread(target=_exit_with_parent, args=(boot["parent"],), daemon=True).start()
    _BOUND = boot["device"]
    import torch

    torch.set_num_threads(boot["threads"])
    cache: dict = {}
    while (message := _receive(requests)) is not None:
        index, payload = message
        try:
            fn, item, shared = pickle.loads(payload)
            reply = (fn(item, _shared_value(shared, cache)), "")
        except Exception as err:
            reply = (None, _error_text(err))
        try:
            answer = pickle.dumps(reply)
        except Exception as err:  # a result that cannot be sent back
            answer = pickle.dumps((None, f"cannot return its result: {_error_text(err)}"))
        _send(replies, index, answer)


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """End this process once its parent ``parent`` has exited (its parent id changes)."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


class _Worker:
    """One local worker process, and the thread that puts its replies on ``replies`` as
    ``(worker, message)``, ``message`` ``None`` once the process has ended."""

    def __init__(self, device: str, threads: int, replies: queue.Queue) -> None:
        self.device = device
        self.call: int | None = None  # the index of the call it runs
        path = [entry or os.getcwd() for entry in sys.path]
        boot = pickle.dumps(
            {"path": path, "device": device, "threads": threads, "parent": os.getpid()}
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.process.stdin.write(b"%d\n" % len(boot) + boot)
        self.process.stdin.flush()
        threading.Thread(target=self._read, args=(replies,), daemon=True).start()

    def _read(self, replies: queue.Queue) -> None:
        while (message := _receive(self.process.stdout)) is not None:
            replies.put((self, message))
        self.process.stdout.close()
        replies.put((self, None))

    def run(self, index: int, payload: bytes) -> None:
        """Hand call ``index`` (its pickled ``(fn, item, shared)``) to this worker; a
        worker that has died meanwhile reports it through ``replies``."""
        self.call = index
        try:
            _send(self.process.stdin, index, payload)
        except OSError:
            pass

    def close(self) -> None:
        """Tell the process to end once its call is done (the end of its stdin)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def stop(self) -> int:
        """End the process (at once when it is running a call) and return its exit
        status."""
        self.close()
        if self.call is not None and self.process.poll() is None:
            self.process.kill()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _death(status: int, tries: int) -> str:
    how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    times = "once" if tries == 1 else f"on each of {tries} tries"
    return f"WorkerLost: its worker process died ({how}; {times})"


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
    :func:`local_devices`).

    Each worker is a fresh Python interpreter (as the ``spawn`` start method makes: no
    CUDA state or torch threads inherited) that imports what its calls need and nothing
    else: it does not run the main script of the process that started it, so a script
    that calls :func:`probfsl.sweep` at its top level, without an
    ``if __name__ == "__main__":`` guard, works as written. ``fn`` and the items must
    therefore be picklable by reference to a module (not defined in the main script).

    A worker that dies (killed, out of memory, ``os._exit``) loses only the call it was
    running: a new worker takes its place, and the call runs again up to ``retries``
    times before it is reported lost (:data:`RETRIES`)."""

    name = "local"

    def __init__(
        self, resources: Resources, workers: int | None = None, retries: int = RETRIES
    ) -> None:
        self.resources = resources
        self.retries = retries
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
        call that raised, or whose worker died on each of its ``1 + retries`` tries
        (``"WorkerLost: ..."``)."""
        if getattr(fn, "__module__", None) == "__main__":
            raise ValueError(
                f"{getattr(fn, '__qualname__', fn)!r} is defined in the main script: the "
                "local executor's workers do not run it; define the function in a module"
            )
        if not items:
            return
        replies: queue.Queue = queue.Queue()
        todo = deque(range(len(items)))
        tries: Counter = Counter()
        workers: set[_Worker] = set()
        idle: list[_Worker] = []  # told to end: waited for at the end
        unsent: deque[tuple[int, Any, str]] = deque()  # calls that could not be pickled

        def start(device: str) -> None:
            worker = _Worker(device, self.resources.cpus, replies)
            workers.add(worker)
            give(worker)

        def give(worker: _Worker) -> None:
            """The next call to ``worker``, or its end when there is none."""
            while todo:
                index = todo.popleft()
                item = items[index]
                try:
                    payload = pickle.dumps((fn, item, share(item) if share else None))
                except Exception as err:
                    unsent.append((index, None, f"cannot send the call: {_error_text(err)}"))
                    continue
                tries[index] += 1
                worker.run(index, payload)
                return
            worker.call = None
            workers.discard(worker)
            worker.close()
            idle.append(worker)

        try:
            for device in self.devices[: len(items)]:
                start(device)
            while unsent or workers:
                if unsent:
                    yield unsent.popleft()
                    continue
                worker, message = replies.get()
                if worker not in workers:  # a stopped worker's end
                    continue
                index = worker.call
                if message is None:  # the worker died while running call ``index``
                    workers.discard(worker)
                    status = worker.stop()
                    if index is not None:
                        if tries[index] > self.retries:
                            yield index, None, _death(status, tries[index])
                        else:
                            todo.append(index)
                    if todo:
                        start(worker.device)
                    continue
                try:
                    result, error = pickle.loads(message[1])
                except Exception as err:  # a result this process cannot load
                    result, error = None, f"cannot load its result: {_error_text(err)}"
                give(worker)
                yield index, result, error
        finally:  # at the end, or interrupted: every worker is stopped
            for worker in [*workers, *idle]:
                worker.stop()

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
