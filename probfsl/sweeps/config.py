"""A sweep's description: data sets × methods × task settings × seeds, as dataclasses
and as a YAML file, checked before any work.

The YAML file (every key but ``data`` and ``methods`` optional)::

    data:                        # named sources: a built-in data set or a feature file
      omniglot: {dataset: omniglot}
      mine: {features: features/mine.npz}   # relative to the YAML file's folder
      big: {features: /data/big.npz, optional: true}   # left out where absent
    methods:                     # a name, or a mapping with the method's options
      - nearest-centroid
      - {method: bavardage, preset: [defaults, auto]}
      - {method: evidence-lssvm, params: {per_class: true}}
      - {method: em-dirichlet, zero_shot: true}
    grid:                        # every combination; each key a value or a list
      way: 5
      shot: [1, 5]
      query: 75
      balance: [balanced, dirichlet]
      alpha: 2.0
      seed: [0, 1]
      engine: [handwritten, derived]   # methods with one engine run once
    run:                         # the same for every cell
      tasks: 1000
      device: auto               # cpu, cuda, cuda:N, mps or auto (the worker's device)
      dtype: float32
    resources:                   # what one cell holds while it runs
      cpus: 1
      gpus: 0                    # a fraction lets several cells share one GPU

Each cell is exactly one ``probfsl run`` (:meth:`Cell.argv`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from probfsl.sweeps.cell import Cell
from probfsl.sweeps.executors import Resources

log = logging.getLogger("probfsl.sweep")

#: the task-setting axes of ``grid`` and their defaults (those of ``probfsl run``)
GRID_DEFAULTS: dict[str, Any] = {
    "way": 5,
    "shot": 1,
    "query": 75,
    "balance": "balanced",
    "alpha": 2.0,
    "seed": 0,
    "engine": None,
}
#: the keys of a source of ``data``
SOURCE_KEYS = ("dataset", "features", "allow_pickle", "optional")
#: the keys of a method entry
METHOD_KEYS = ("method", "preset", "params", "engine", "calibrate", "zero_shot", "label")


@dataclass(frozen=True)
class Source:
    """A named source of features: a built-in data set or a feature file."""

    name: str
    dataset: str | None = None
    features: str | None = None
    allow_pickle: bool = False
    #: a feature file that may be absent: the sweep then leaves the source out (with a
    #: note) instead of refusing to start
    optional: bool = False


@dataclass(frozen=True)
class MethodEntry:
    """One entry of ``methods``: a method and its options. ``preset`` and ``engine`` may
    be lists (one cell per value); ``label`` names the entry in tables (default: the
    method's name)."""

    method: str
    preset: str | list[str | None] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    engine: str | list[str] | None = None
    calibrate: str | None = None
    zero_shot: bool = False
    label: str | None = None


@dataclass(frozen=True)
class RunOptions:
    """The options of ``probfsl run`` shared by every cell."""

    tasks: int = 1000
    device: str = "auto"
    dtype: str = "float32"
    batch_size: int | None = None
    episodes: int | None = None
    min_classes: int = 3
    max_classes: int = 10


@dataclass(frozen=True)
class SweepConfig:
    """A sweep: every combination of ``data`` × ``methods`` × ``grid``.

    ``grid`` maps a task-setting axis (:data:`GRID_DEFAULTS`) to one value or a list.
    """

    data: Sequence[Source]
    methods: Sequence[MethodEntry]
    grid: Mapping[str, Any] = field(default_factory=dict)
    run: RunOptions = field(default_factory=RunOptions)
    resources: Resources = field(default_factory=Resources)

    def __post_init__(self) -> None:
        present = []
        for source in self.data:  # an optional file that is absent: left out, with a note
            if source.optional and source.features and not Path(source.features).is_file():
                log.info("sweep: data.%s left out: %s is not there", source.name, source.features)
            else:
                present.append(source)
        object.__setattr__(self, "data", present)
        check_config(self)

    def cells(self) -> list[Cell]:
        """Every cell of the sweep, each once, in a stable order (data, method, grid)."""
        axes = {k: _as_list(self.grid.get(k, v)) for k, v in GRID_DEFAULTS.items()}
        cells: dict[Cell, None] = {}
        for source in self.data:
            for entry in self.methods:
                for preset, engine_entry in itertools.product(
                    _as_list(entry.preset), _as_list(entry.engine)
                ):
                    for values in itertools.product(*axes.values()):
                        setting = dict(zip(axes, values, strict=True))
                        engine = engine_entry if engine_entry is not None else setting["engine"]
                        cell = _cell(source, entry, preset, engine, setting, self.run)
                        cells[cell] = None
        return list(cells)


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def _cell(
    source: Source,
    entry: MethodEntry,
    preset: str | None,
    engine: str | None,
    setting: dict,
    run: RunOptions,
) -> Cell:
    """The cell of one combination; the axes a cell does not use (way and shot of a
    zero-shot run, the engine of a method with one engine) take a fixed value, so that
    such combinations are one cell."""
    if not _has_engines(entry.method):
        engine = None
    zero = entry.zero_shot
    return Cell(
        data=source.name,
        dataset=source.dataset,
        features=source.features,
        allow_pickle=source.allow_pickle,
        method=entry.method,
        label=entry.label or entry.method,
        preset=preset,
        params=tuple(sorted(entry.params.items())),
        engine=engine,
        calibrate=entry.calibrate,
        zero_shot=zero,
        way=0 if zero else setting["way"],
        shot=0 if zero else setting["shot"],
        query=setting["query"],
        balance="natural" if zero else setting["balance"],
        alpha=0.0 if zero or setting["balance"] == "balanced" else float(setting["alpha"]),
        seed=setting["seed"],
        tasks=run.tasks,
        device=run.device,
        dtype=run.dtype,
        batch_size=run.batch_size,
        episodes=run.episodes,
        min_classes=run.min_classes if zero else 0,
        max_classes=run.max_classes if zero else 0,
    )


def _has_engines(method: str) -> bool:
    import inspect

    from probfsl.methods import METHODS

    return "engine" in inspect.signature(METHODS[method].load().__init__).parameters


# -- checks -----------------------------------------------------------------------------


def _fail(key: str, message: str) -> None:
    raise ValueError(f"sweep: {key}: {message}")


def check_config(config: SweepConfig) -> None:
    """``ValueError`` naming the key of the first problem of ``config``; then every cell
    is parsed as ``probfsl run`` arguments, so what the command would refuse is refused
    here, before any work."""
    from probfsl.cli import parse_run_args
    from probfsl.data.builtin import DATASETS
    from probfsl.methods import METHODS

    if not config.data:
        _fail("data", "name at least one data set or feature file")
    names = [s.name for s in config.data]
    if len(set(names)) != len(names):
        _fail("data", f"names repeat: {names}")
    for s in config.data:
        if (s.dataset is None) == (s.features is None):
            _fail(f"data.{s.name}", "give exactly one of 'dataset' and 'features'")
        if s.dataset is not None and s.dataset not in DATASETS:
            _fail(f"data.{s.name}.dataset", f"{s.dataset!r} is not one of {list(DATASETS)}")
        if s.features is not None and not Path(s.features).is_file():
            _fail(f"data.{s.name}.features", f"file not found: {s.features}")
    if not config.methods:
        _fail("methods", "name at least one method")
    for i, entry in enumerate(config.methods):
        if entry.method not in METHODS:
            _fail(f"methods[{i}].method", f"{entry.method!r} is not one of {list(METHODS)}")
        if not isinstance(entry.params, Mapping):
            _fail(f"methods[{i}].params", "expected a mapping of hyperparameters")
    for key, value in config.grid.items():
        if key not in GRID_DEFAULTS:
            _fail(f"grid.{key}", f"not an axis; the axes are {list(GRID_DEFAULTS)}")
        if isinstance(value, list | tuple) and not value:
            _fail(f"grid.{key}", "an empty list gives no cells")
    if config.resources.cpus < 1:
        _fail("resources.cpus", f"must be at least 1, got {config.resources.cpus}")
    if not 0 <= config.resources.gpus:
        _fail("resources.gpus", f"must be non-negative, got {config.resources.gpus}")
    checked = set()
    for cell in config.cells():
        estimator = (cell.method, cell.preset, cell.params, cell.engine, cell.zero_shot)
        try:
            parse_run_args(cell.argv())
            if estimator not in checked:
                _check_params(cell)
                checked.add(estimator)
        except ValueError as err:
            _fail(f"methods[{_entry_index(config, cell)}] ({cell.describe()})", str(err))


def _entry_index(config: SweepConfig, cell: Cell) -> int:
    return next(i for i, e in enumerate(config.methods) if (e.label or e.method) == cell.label)


def _check_params(cell: Cell) -> None:
    """The method's own checks of its hyperparameters and preset (no data needed)."""
    from probfsl.methods import DEFAULTS
    from probfsl.tuning import make_estimator

    preset = None if cell.preset in (DEFAULTS, "auto") else cell.preset
    params = dict(cell.params)
    if cell.engine is not None:
        params["engine"] = cell.engine
    make_estimator(cell.method, None if cell.zero_shot else preset, **params)


# -- YAML and dicts ---------------------------------------------------------------------


def load_config(path: str | Path) -> SweepConfig:
    """A :class:`SweepConfig` from a YAML file; feature paths are relative to its folder."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"sweep: {path}: not valid YAML: {err}") from None
    return config_from_dict(raw, base_dir=path.parent)


def config_from_dict(raw: Any, base_dir: str | Path = ".") -> SweepConfig:
    """A :class:`SweepConfig` from the YAML file's structure (nested dicts and lists)."""
    if not isinstance(raw, Mapping):
        _fail("(top level)", "expected a mapping with 'data' and 'methods'")
    known = {"data", "methods", "grid", "run", "resources"}
    for key in raw:
        if key not in known:
            _fail(str(key), f"unknown key; the keys are {sorted(known)}")
    for key in ("data", "methods"):
        if key not in raw:
            _fail(key, "missing")
    return SweepConfig(
        data=_sources(raw["data"], Path(base_dir)),
        methods=[_method_entry(i, e) for i, e in enumerate(_list(raw["methods"], "methods"))],
        grid=_mapping(raw.get("grid") or {}, "grid"),
        run=_options(RunOptions, raw.get("run") or {}, "run"),
        resources=_options(Resources, raw.get("resources") or {}, "resources"),
    )


def _mapping(value: Any, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        _fail(key, f"expected a mapping, got {type(value).__name__}")
    return value


def _list(value: Any, key: str) -> list:
    if not isinstance(value, list):
        _fail(key, f"expected a list, got {type(value).__name__}")
    return value


def _sources(raw: Any, base_dir: Path) -> list[Source]:
    sources = []
    for name, spec in _mapping(raw, "data").items():
        spec = _mapping(spec, f"data.{name}")
        for key in spec:
            if key not in SOURCE_KEYS:
                _fail(f"data.{name}.{key}", f"unknown key; the keys are {list(SOURCE_KEYS)}")
        features = spec.get("features")
        if features is not None:
            features = str((base_dir / str(features)).resolve())
        sources.append(
            Source(
                str(name),
                spec.get("dataset"),
                features,
                bool(spec.get("allow_pickle")),
                bool(spec.get("optional")),
            )
        )
    return sources


def _method_entry(i: int, raw: Any) -> MethodEntry:
    if isinstance(raw, str):
        return MethodEntry(raw)
    raw = _mapping(raw, f"methods[{i}]")
    for key in raw:
        if key not in METHOD_KEYS:
            _fail(f"methods[{i}].{key}", f"unknown key; the keys are {list(METHOD_KEYS)}")
    if "method" not in raw:
        _fail(f"methods[{i}].method", "missing")
    return MethodEntry(**{k: v for k, v in raw.items() if v is not None or k == "preset"})


def _options(cls: type, raw: Any, key: str):
    raw = _mapping(raw, key)
    names = {f.name: f for f in fields(cls)}
    for name, value in raw.items():
        if name not in names:
            _fail(f"{key}.{name}", f"unknown key; the keys are {list(names)}")
        kind = {"int": int, "float": (int, float), "str": str}
        expected = kind.get(str(names[name].type).split(" |")[0])
        if value is not None and expected and not isinstance(value, expected):
            _fail(f"{key}.{name}", f"expected {names[name].type}, got {value!r}")
    return cls(**raw)
