"""One evaluation run, typed: :class:`RunSpec`, and the choices its options take.

A :class:`RunSpec` holds every setting of one ``probfsl run``: the method, the data
(a built-in data set, a feature file or a :class:`~probfsl.data.FeatureSet` in memory),
the task setting, the seed, the preset and hyperparameters, calibration, dtype and
device. It checks its values when it is made (a ``ValueError`` that says what is wrong)
and :func:`probfsl.running.run` executes it. ``probfsl run`` builds one from its
arguments, ``probfsl sweep`` one per cell, and Python code builds one directly::

    from probfsl.run_spec import RunSpec
    from probfsl.running import run

    row = run(RunSpec("soft-kmeans", dataset="omniglot", shot=5, tasks=500))

This module imports neither torch nor any method, so that the command line's parser
(:mod:`probfsl.cli`) and a sweep file's schema (:mod:`probfsl.sweeps.config`) read
their choices from it: :func:`run_choices` is the one list of what each option accepts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

from probfsl.data.builtin import DATASETS
from probfsl.methods import (
    DEFAULTS,
    METHODS,
    check_param_keys,
    check_preset_name,
    method_info,
    methods_with_engines,
)

if TYPE_CHECKING:  # a FeatureSet holds tensors: only for the annotations
    from probfsl.data import FeatureSet

#: how the queries of a task spread over its classes: equal counts, or drawn from a
#: Dirichlet of concentration ``alpha``
BALANCES = ("balanced", "dirichlet")
#: the floating-point types a run computes in
DTYPES = ("float32", "float64")
#: the two engines of the methods that have two: the papers' hand-written updates and
#: the updates derived by variational message passing
ENGINES = ("handwritten", "derived")
#: what a run does to the query probabilities: nothing, or one temperature fitted on
#: base-class episodes
CALIBRATIONS = ("none", "temperature")


def run_choices() -> dict[str, list[str]]:
    """The choices of each option of a run that has a fixed set of them: ``{"method":
    [...], "dataset": [...], "balance": [...], "dtype": [...], "engine": [...],
    "calibrate": [...]}``. ``probfsl run``'s parser, a sweep file's schema and
    :class:`RunSpec` all read them from here."""
    return {
        "method": list(METHODS),
        "dataset": list(DATASETS),
        "balance": list(BALANCES),
        "dtype": list(DTYPES),
        "engine": list(ENGINES),
        "calibrate": list(CALIBRATIONS),
    }


def engine_param(method: str, engine: str, params: Mapping[str, Any]) -> str:
    """The ``engine`` hyperparameter that ``--engine ENGINE`` gives ``method``;
    ``ValueError`` for a method with one engine, or for ``params`` whose own ``engine``
    says otherwise."""
    with_engines = methods_with_engines()
    if method not in with_engines:
        raise ValueError(f"--engine: {method} has one engine; methods with two: {with_engines}")
    if params.get("engine", engine) != engine:
        raise ValueError(f"--engine {engine} and --param engine={params['engine']} disagree")
    return engine


@dataclass(frozen=True)
class RunSpec:
    """Every setting of one evaluation run (``probfsl run``), checked when it is made.

    Give the data as exactly one of ``dataset`` (a built-in data set's name,
    ``probfsl datasets``) and ``features`` (a feature file's path, or a
    :class:`~probfsl.data.FeatureSet` already in memory). Each field is the ``probfsl
    run`` option of the same name (``open_queries`` is ``--open-queries``), with the
    same default; ``params`` holds the ``--param KEY=VALUE`` pairs as a mapping of
    values. :func:`probfsl.running.run` executes the run and returns its result row.

    A value of the wrong type or out of range, an unknown method, data set, choice,
    hyperparameter name or preset, and options that do not go together (``engine`` on a
    method with one engine, a named preset, temperature calibration, open queries or a
    task file with ``zero_shot``, open queries with a task file or with temperature
    calibration) are each a ``ValueError``; the messages of the checks ``probfsl run``
    shares name its options.
    What needs the data, torch or the machine (the hyperparameters' values, whether the
    device exists, whether the data hold the tasks asked for, the task file's content)
    is checked when the run starts, before any work.
    """

    #: the method's name (``probfsl run --help`` lists them)
    method: str
    #: a built-in data set's name
    dataset: str | None = None
    #: a feature file (``.npz``, ``.pt``, or ``.pkl`` with ``allow_pickle``) or a FeatureSet
    features: str | os.PathLike | FeatureSet | None = None
    #: load a ``.pkl`` feature file (unpickling runs code from the file: trusted only)
    allow_pickle: bool = False
    #: classes per task
    way: int = 5
    #: support samples per class
    shot: int = 1
    #: queries per task in all (balanced tasks: a multiple of ``way``)
    query: int = 75
    #: ``"balanced"`` or ``"dirichlet"``: equal query counts per class, or drawn from a
    #: Dirichlet of concentration ``alpha``
    balance: str = "balanced"
    #: the Dirichlet's concentration (``balance="dirichlet"``)
    alpha: float = 2.0
    #: tasks to evaluate
    tasks: int = 1000
    #: open queries per task from other novel classes (open-set tasks); 0: closed tasks
    open_queries: int = 0
    #: the seed of the tasks (task ``i`` is drawn from ``(seed, i)``)
    seed: int = 0
    #: ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (a ``torch.device`` is taken as its name)
    device: str = "cpu"
    #: ``"float32"`` or ``"float64"`` (a ``torch.dtype`` is taken as its name)
    dtype: str = "float32"
    #: tasks made and scored at once; ``None``: 1000, less on the CPU for the slow methods
    batch_size: int | None = None
    #: a task file (``.npz`` of row indices) instead of sampled tasks; it sets way, shot
    #: and queries
    task_file: str | os.PathLike | None = None
    #: a published setting of the method, ``"defaults"`` (the constructor's defaults) or
    #: ``"auto"`` (tuned on base-class episodes); ``None``: ``"auto"`` for a tunable
    #: method on data with base classes and no ``params``, else the defaults
    preset: str | None = None
    #: base-class episodes (zero-shot: tasks) per candidate of the ``"auto"`` search;
    #: ``None``: 300 (gp-tree 100)
    episodes: int | None = None
    #: the method's hyperparameters
    params: Mapping[str, Any] = field(default_factory=dict)
    #: ``"handwritten"`` or ``"derived"`` for the methods with two engines; ``None``:
    #: the method's default
    engine: str | None = None
    #: ``"none"`` or ``"temperature"``; ``None``: temperature where ``"auto"`` is used
    #: on closed tasks, else none
    calibrate: str | None = None
    #: zero-shot tasks (em-dirichlet): probabilities over all classes from their embeddings
    zero_shot: bool = False
    #: zero-shot tasks' fewest classes
    min_classes: int = 3
    #: zero-shot tasks' most classes
    max_classes: int = 10

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("device", "dtype"):  # a torch.device / torch.dtype as its name
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                set_(self, name, str(value).removeprefix("torch."))
        for name in ("features", "task_file"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                set_(self, name, os.fspath(value))
        if self.params is None:
            set_(self, "params", {})
        if not isinstance(self.params, Mapping):
            raise ValueError(f"params: expected a mapping of hyperparameters, got {self.params!r}")
        set_(self, "params", dict(self.params))  # a copy: the caller's dict may change
        self._check_values()
        self._check_combinations()

    def _check_values(self) -> None:
        """Each field on its own: types, ranges and choices."""
        set_ = object.__setattr__
        if not isinstance(self.method, str):
            raise ValueError(f"method: expected a method's name, got {self.method!r}")
        method_info(self.method)  # an unknown method: the registry's message
        if (self.dataset is None) == (self.features is None):
            raise ValueError("give exactly one of dataset and features")
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ValueError(
                f"unknown dataset {self.dataset!r}; built-in datasets: {', '.join(DATASETS)}"
            )
        if self.features is not None and not isinstance(self.features, str):
            from probfsl.data import FeatureSet

            if not isinstance(self.features, FeatureSet):
                raise ValueError(
                    "features: expected a feature file's path or a FeatureSet, "
                    f"got {type(self.features).__name__}"
                )
        for name in ("way", "shot", "query", "tasks", "min_classes", "max_classes"):
            set_(self, name, _count(name, getattr(self, name), low=1))
        for name in ("batch_size", "episodes"):
            if getattr(self, name) is not None:
                set_(self, name, _count(name, getattr(self, name), low=1))
        set_(self, "open_queries", _count("open_queries", self.open_queries, low=0))
        set_(self, "seed", _count("seed", self.seed, low=None))
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, Real) or not math.isfinite(alpha):
            raise ValueError(f"alpha: must be a finite positive number, got {alpha!r}")
        if alpha <= 0:
            raise ValueError(f"alpha: must be a finite positive number, got {alpha!r}")
        set_(self, "alpha", float(alpha))
        for name in ("allow_pickle", "zero_shot"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        choices = run_choices()
        for name in ("balance", "dtype", "engine", "calibrate"):
            value = getattr(self, name)
            if value is None and name in ("engine", "calibrate"):
                continue
            if value not in choices[name]:
                listed = ", ".join(choices[name])
                raise ValueError(f"{name}: invalid choice: {value!r} (choose from {listed})")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device: expected cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.preset is not None and not isinstance(self.preset, str):
            raise ValueError(f"preset: expected a preset's name, got {self.preset!r}")
        if self.task_file is not None and not isinstance(self.task_file, str):
            raise ValueError(f"task_file: expected a path, got {self.task_file!r}")
        for key in self.params:
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(f"params: {key!r} is not a hyperparameter's name")
        check_param_keys(self.method, self.params)

    def _check_combinations(self) -> None:
        """The options that do not go together (the messages ``probfsl run`` gives)."""
        if self.engine is not None:
            engine_param(self.method, self.engine, self.params)
        if self.zero_shot and self.task_file is not None:
            raise ValueError("--task-file applies to few-shot runs, not --zero-shot")
        if self.zero_shot:
            if self.preset not in (None, DEFAULTS, "auto"):
                raise ValueError("--zero-shot takes no named --preset (only auto)")
        else:
            check_preset_name(self.method, self.preset)
        if self.zero_shot and self.calibrate == "temperature":
            raise ValueError("--calibrate temperature applies to few-shot runs, not --zero-shot")
        if self.open_queries and self.zero_shot:
            raise ValueError("--open-queries applies to few-shot runs, not --zero-shot")
        if self.open_queries and self.task_file is not None:
            raise ValueError(OPEN_QUERIES_WITH_FILE)


#: why ``--open-queries`` and ``--task-file`` do not go together
OPEN_QUERIES_WITH_FILE = (
    "--open-queries draws open-set tasks; it does not apply to --task-file: a task file "
    "fixes its tasks, and open-set ones carry their open queries (labelled `way`) and their "
    "open classes (an 'open_classes' field)"
)


def _count(name: str, value: Any, low: int | None) -> int:
    """``value`` as an ``int`` (a NumPy integer too, not a bool), at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return int(value)
