"""One cell of a sweep: one ``probfsl run`` (a :class:`~probfsl.run_spec.RunSpec`), its
identity and how it runs in a worker."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import platform
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # imported where a cell runs or is checked
    from probfsl.run_spec import RunSpec


@dataclass(frozen=True)
class Cell:
    """The options of one ``probfsl run`` (``0`` / ``None`` where the run does not use
    one: way and shot of a zero-shot run, the engine of a method with one engine)."""

    data: str  # the source's name in the sweep
    dataset: str | None
    features: str | None
    allow_pickle: bool
    method: str
    label: str  # the method entry's name in tables
    preset: str | None
    params: tuple[tuple[str, Any], ...]
    engine: str | None
    calibrate: str | None
    zero_shot: bool
    way: int
    shot: int
    query: int
    balance: str
    alpha: float
    seed: int
    tasks: int
    device: str
    dtype: str
    batch_size: int | None
    episodes: int | None
    min_classes: int
    max_classes: int
    #: open queries per task (the grid's ``open`` axis; 0: closed tasks)
    open_queries: int = 0
    #: a task file whose tasks the cell runs (``None``: tasks drawn from the setting);
    #: tasks, way, shot, query and open_queries are then the file's, for tables, and
    #: balance ``"file"``, as ``probfsl run``'s row says
    task_file: str | None = None

    def spec(self, device: str | None = None, fs: Any = None) -> RunSpec:
        """The run of this cell (``device`` replaces ``auto``, which is ``cpu`` without
        one); ``fs``, a :class:`~probfsl.data.FeatureSet` the worker already holds,
        replaces the cell's source. The options a cell does not use (way, shot and
        balance of a zero-shot cell, alpha of a balanced one, the zero-shot class range
        of a few-shot one, the balance and open queries of a task file's cell, which
        its file holds) keep the run's defaults, as :meth:`argv` leaves them out."""
        from probfsl.run_spec import RunSpec

        if fs is not None:
            source = {"features": fs}
        elif self.dataset is not None:
            source = {"dataset": self.dataset}
        else:
            source = {"features": str(self.features), "allow_pickle": self.allow_pickle}
        if self.task_file is not None:  # the file holds the tasks and their open queries
            setting = {"task_file": self.task_file, "way": self.way, "shot": self.shot}
        elif self.zero_shot:
            setting = {"zero_shot": True, "min_classes": self.min_classes}
            setting["max_classes"] = self.max_classes
        else:
            setting = {"way": self.way, "shot": self.shot, "balance": self.balance}
            if self.balance != "balanced":
                setting["alpha"] = self.alpha
            setting["open_queries"] = self.open_queries
        return RunSpec(
            method=self.method,
            **source,
            **setting,
            query=self.query,
            seed=self.seed,
            tasks=self.tasks,
            dtype=self.dtype,
            device=device or ("cpu" if self.device == "auto" else self.device),
            preset=self.preset,
            engine=self.engine,
            calibrate=self.calibrate,
            batch_size=self.batch_size,
            episodes=self.episodes,
            params=dict(self.params),
        )

    def argv(self, device: str | None = None) -> list[str]:
        """The arguments of ``probfsl run`` for this cell (``device`` replaces ``auto``):
        the command line that runs :meth:`spec`, as ``probfsl sweep --dry-run`` shows it."""
        args = ["--method", self.method]
        if self.dataset is not None:
            args += ["--dataset", self.dataset]
        else:
            args += ["--features", str(self.features)]
            if self.allow_pickle:
                args.append("--allow-pickle")
        if self.task_file is not None:  # the file sets way, shot, queries and the tasks
            args += ["--task-file", self.task_file]
        else:
            if self.zero_shot:
                args += ["--zero-shot", "--min-classes", str(self.min_classes)]
                args += ["--max-classes", str(self.max_classes)]
            else:
                args += ["--way", str(self.way), "--shot", str(self.shot)]
                args += ["--balance", self.balance]
                if self.balance != "balanced":
                    args += ["--alpha", repr(self.alpha)]
            args += ["--query", str(self.query), "--seed", str(self.seed)]
            if self.open_queries:
                args += ["--open-queries", str(self.open_queries)]
            args += ["--tasks", str(self.tasks)]
        args += ["--dtype", self.dtype]
        args += ["--device", device or ("cpu" if self.device == "auto" else self.device)]
        for flag, value in (
            ("--preset", self.preset),
            ("--engine", self.engine),
            ("--calibrate", self.calibrate),
            ("--batch-size", self.batch_size),
            ("--episodes", self.episodes),
        ):
            if value is not None:
                args += [flag, str(value)]
        for key, value in self.params:
            args += ["--param", f"{key}={value!r}"]
        return args

    def fields(self) -> dict:
        """The cell's options as a flat JSON-friendly dict (``params`` as JSON text)."""
        out = asdict(self)
        out["params"] = json.dumps(dict(self.params), sort_keys=True)
        return out

    def describe(self) -> str:
        """A short name: data, label and setting."""
        setting = "zero-shot" if self.zero_shot else f"{self.way}w{self.shot}s {self.balance}"
        if self.open_queries:
            setting += f" open {self.open_queries}"
        if self.task_file is not None:
            return f"{self.data}/{self.label} {setting} tasks {Path(self.task_file).name}"
        return f"{self.data}/{self.label} {setting} seed {self.seed}"

    def key(self, code: str, data_digest: str, tasks_digest: str | None = None) -> str:
        """The cell's identity in a results store: its options (the device ``auto``
        included as written), the content of its features and of its task file
        (``tasks_digest``, :func:`file_digest`; not where the files lie) and the code
        version."""
        options = {**self.fields(), "features": None, "task_file": None}
        if not self.open_queries:  # closed cells keep the identity they had before the axis
            options.pop("open_queries")
        payload = {"cell": options, "data": data_digest, "code": code}
        if self.task_file is None:  # cells of drawn tasks keep theirs too
            options.pop("task_file")
        else:
            if tasks_digest is None:
                raise ValueError(f"{self.describe()}: the key needs its task file's digest")
            payload["tasks"] = tasks_digest
        text = json.dumps(payload, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.cache
def code_version() -> str:
    """probfsl's version and a digest of the installed package's files (code and
    built-in data): a change to either gives a new version, so that its cells run anew."""
    import probfsl

    root = Path(probfsl.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return f"{probfsl.__version__}+{digest.hexdigest()[:12]}"


def data_digest(dataset: str | None, features: str | None) -> str:
    """The identity of a source's content: a built-in data set's name (its files are part
    of :func:`code_version`) or the SHA-256 of a feature file."""
    if dataset is not None:
        return f"builtin:{dataset}"
    return file_digest(features)


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes (a feature file, a task file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def machine() -> str:
    """Where a cell ran: host, CPU and, when one is used, the GPU's name."""
    return f"{socket.gethostname()} ({platform.machine()}, {_cpu_name()})"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_source(dataset: str | None, features: str | None, allow_pickle: bool):
    """A cell's :class:`~probfsl.data.FeatureSet`: a built-in data set or a feature file."""
    from probfsl.data import load_dataset, load_features

    if dataset is not None:
        return load_dataset(dataset)
    return load_features(features, allow_pickle=allow_pickle)


def source_of(cell: Cell) -> tuple:
    """The shared object a cell needs, as an executor's ``share`` wants it: its source's
    key, :func:`load_source` and its arguments (one load per worker or per Ray cluster)."""
    key = (cell.dataset, cell.features, cell.allow_pickle)
    return key, load_source, key


def cell_job(cell: Cell, fs=None) -> tuple[dict, str]:
    """A cell in an executor's worker, on the device the executor gave it (where the cell
    asks for ``auto``): ``(row, log text)`` (:func:`run_cell`)."""
    from probfsl.sweeps.executors import assigned_device

    buffer = io.StringIO()
    device = assigned_device() if cell.device == "auto" else cell.device
    row = run_cell(cell, device, buffer, fs)
    return row, buffer.getvalue()


def run_cell(cell: Cell, device: str, log: TextIO | None = None, fs=None) -> dict:
    """Run ``cell`` on ``device``: :func:`probfsl.running.run` of :meth:`Cell.spec`, as
    ``probfsl run`` runs it.

    Returns the run's result row (the fields of ``probfsl run --out``) with ``status``
    ``"ok"``, or, when the run raises, a row with ``status`` ``"failed"`` and the error:
    a failing cell never stops the others. What the run prints and logs goes to the
    text stream ``log``. ``fs`` is the :class:`~probfsl.data.FeatureSet` when the worker
    already holds it (else it is loaded from the cell's source).
    """
    import torch

    from probfsl.running import run

    tic = time.perf_counter()
    with _captured(log):
        try:
            row = {"status": "ok", "error": "", **run(cell.spec(device, fs), progress=False)}
        except Exception as err:  # recorded in the store; the sweep goes on
            if log is not None:
                traceback.print_exc(file=log)
            message = " ".join(str(err).split()) or type(err).__name__
            row = {"status": "failed", "error": f"{type(err).__name__}: {message}"}
    row["params"] = json.dumps(row.get("params", dict(cell.params)), sort_keys=True)
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    row.update(wall_seconds=time.perf_counter() - tic, machine=machine(), gpu=gpu)
    row["torch_threads"] = torch.get_num_threads()
    row["code_version"] = code_version()  # the worker's: a cluster's nodes may differ
    return row


@contextlib.contextmanager
def _captured(stream):
    """stdout, stderr and the ``probfsl`` logger into ``stream`` (no-op for ``None``)."""
    if stream is None:
        yield
        return
    logger = logging.getLogger("probfsl")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("probfsl: note: %(message)s"))
    saved = logger.handlers, logger.level, logger.propagate
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            yield
    finally:
        logger.handlers, logger.level, logger.propagate = saved
