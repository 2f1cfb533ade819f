"""A sweep's description: data sets × methods × task settings × seeds, as dataclasses
and as a YAML file, checked before any work.

The YAML file (every key but ``data`` and ``methods`` optional)::

    data:                        # named sources: a built-in data set or a feature file
      omniglot: {dataset: omniglot}
      mine: {features: features/mine.npz}   # relative to the YAML file's folder
      big: {features: /data/big.npz, optional: true}   # left out where absent
      fixed: {features: features/mine.npz, tasks: [tasks_1shot.npz, tasks_5shot.npz]}
    methods:                     # a name, or a mapping with the method's options
      - nearest-centroid
      - {method: bavardage, preset: [defaults, auto]}
      - {method: evidence-lssvm, params: {lambda_mode: per_class}}
      - {method: em-dirichlet, zero_shot: true}
    grid:                        # every combination; each key a value or a list
      way: 5
      shot: [1, 5]
      query: 75
      balance: [balanced, dirichlet]
      alpha: 2.0
      seed: [0, 1]
      engine: [handwritten, derived]   # methods with one engine run once
      open: [0, 75]              # open queries per task (open-set tasks; 0: closed)
    run:                         # the same for every cell
      tasks: 1000
      device: auto               # cpu, cuda, cuda:N, mps or auto (the worker's device)
      dtype: float32
    resources:                   # what one cell holds while it runs
      cpus: 1
      gpus: 0                    # a fraction lets several cells share one GPU

The file's schema is :class:`SweepFile` (pydantic models, :func:`schema_table` renders
it as the reference table of ``docs/sweeps.md``): unknown keys, repeated keys, values of
the wrong type (the string ``"false"`` for a boolean, ``1e30`` or ``true`` for a count,
``.inf`` for a number) and values ``probfsl run`` refuses are each a ``ValueError`` that
names the key and the value. The data are checked too: every feature file is loaded and
every cell's task setting is drawn once from it, as ``probfsl run`` does before its work.

Each cell is exactly one ``probfsl run``: one :class:`~probfsl.run_spec.RunSpec`
(:meth:`Cell.spec`), executed by :func:`probfsl.running.run`.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import itertools
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from probfsl.sweeps.cell import Cell, load_source
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
    "open": 0,
}


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
    #: task files (``.npz`` of row indices, :func:`probfsl.data.save_task_file`) whose
    #: tasks the source's few-shot cells run instead of drawing tasks from the grid
    tasks: tuple[str, ...] = ()


@dataclass(frozen=True)
class MethodEntry:
    """One entry of ``methods``: a method and its options. ``preset`` and ``engine`` may
    be lists (one cell per value); ``label`` names the entry in tables (default: the
    method's name)."""

    method: str
    preset: str | list[str | None] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    engine: str | list[str | None] | None = None
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
    ``methods`` may name a method by a string. The whole sweep is checked when it is made
    (:func:`check_config`): a problem is a ``ValueError`` naming its key and value.
    """

    data: Sequence[Source]
    methods: Sequence[MethodEntry | str]
    grid: Mapping[str, Any] = field(default_factory=dict)
    run: RunOptions = field(default_factory=RunOptions)
    resources: Resources = field(default_factory=Resources)

    def __post_init__(self) -> None:
        names = [getattr(s, "name", None) for s in self.data]
        repeated = sorted({str(n) for n in names if names.count(n) > 1})
        if repeated:
            _fail("data", f"names repeat: {repeated}")
        spec = _validate(_as_raw(self))
        present = []
        for source in _sources(spec, None):  # an optional file that is absent: left out
            if source.optional and source.features and not Path(source.features).is_file():
                log.info("sweep: data.%s left out: %s is not there", source.name, source.features)
            else:
                present.append(source)
        object.__setattr__(self, "data", present)
        object.__setattr__(self, "methods", _entries(spec))
        object.__setattr__(self, "grid", spec.grid.model_dump())
        object.__setattr__(self, "run", RunOptions(**spec.run.model_dump()))
        object.__setattr__(self, "resources", Resources(**spec.resources.model_dump()))
        check_config(self)

    def cells(self) -> list[Cell]:
        """Every cell of the sweep, each once, in a stable order (data, method, grid)."""
        return list(dict.fromkeys(cell for _, _, cell in self._combinations()))

    def _combinations(self) -> Iterator[tuple[int, Source, Cell]]:
        """``(index of the method entry, source, cell)`` of every combination; a source's
        task files replace the grid's axes but ``engine`` in its few-shot cells."""
        axes = {k: _as_list(self.grid.get(k, v)) for k, v in GRID_DEFAULTS.items()}
        for source in self.data:
            for i, entry in enumerate(self.methods):
                settings = _settings_of(axes, source, entry.zero_shot)
                for preset, engine_entry, setting in itertools.product(
                    _as_list(entry.preset), _as_list(entry.engine), settings
                ):
                    engine = engine_entry
                    if engine is None and _has_engines(entry.method):
                        engine = setting["engine"]  # the grid's axis: one-engine methods
                    yield i, source, _cell(source, entry, preset, engine, setting, self.run)


def _settings_of(axes: Mapping[str, list], source: Source, zero_shot: bool) -> list[dict]:
    """Every task setting of the grid's ``axes`` for one source: with task files (for
    few-shot cells), one setting per file and engine, its way, shot, queries and open
    queries read from the file, its other axes those of ``probfsl run --task-file``."""
    if not source.tasks or zero_shot:
        combinations = itertools.product(*axes.values())
        return [dict(zip(axes, values, strict=True)) for values in combinations]
    settings = []
    for path, engine in itertools.product(source.tasks, axes["engine"]):
        tasks, way, shot, query, n_open = task_file_shape(path)
        setting = {**GRID_DEFAULTS, "way": way, "shot": shot, "query": query, "open": n_open}
        setting.update(balance="file", engine=engine, task_file=path, tasks=tasks)
        settings.append(setting)
    return settings


def task_file_shape(path: str) -> tuple[int, int, int, int, int]:
    """``(tasks, way, shot, closed queries, open queries)`` of a task file (its values
    checked once, :meth:`probfsl.data.TaskFile.check`; open queries as their mean over
    tasks, rounded, as ``probfsl run`` reports them); ``ValueError`` for a file that is
    absent or malformed. Cached while the file is unchanged."""
    stat = Path(path).stat()
    return _task_file_shape(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _task_file_shape(path: str, mtime_ns: int, size: int) -> tuple[int, int, int, int, int]:
    from probfsl.data import TaskFile

    task_file = TaskFile(path).check()
    way, shot, query = task_file.shape
    n_open = round(task_file.n_open)
    return len(task_file), way, shot, query - n_open, n_open


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
    zero-shot run, the grid's engine for a method with one engine) take a fixed value, so
    that such combinations are one cell."""
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
        alpha=0.0 if zero or setting["balance"] != "dirichlet" else float(setting["alpha"]),
        seed=setting["seed"],
        tasks=setting.get("tasks", run.tasks),
        device=run.device,
        dtype=run.dtype,
        batch_size=run.batch_size,
        episodes=run.episodes,
        min_classes=run.min_classes if zero else 0,
        max_classes=run.max_classes if zero else 0,
        open_queries=0 if zero else setting["open"],
        task_file=setting.get("task_file"),
    )


@functools.cache
def _has_engines(method: str) -> bool:
    import inspect

    from probfsl.methods import METHODS

    return "engine" in inspect.signature(METHODS[method].load().__init__).parameters


# -- the schema -------------------------------------------------------------------------


def _custom(message: str) -> PydanticCustomError:
    """A validation error whose text is ``message`` as written."""
    return PydanticCustomError("sweep", "{message}", {"message": message})


@functools.cache
def run_choices() -> dict[str, list[str]]:
    """The choices of a run's options, those ``probfsl run``'s parser takes too
    (:func:`probfsl.run_spec.run_choices`): ``{"balance": [...], "dtype": [...],
    "engine": [...], "calibrate": [...], "dataset": [...], "method": [...]}``."""
    from probfsl.run_spec import run_choices as choices

    return choices()


def _hint(value: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _choice(option: str) -> AfterValidator:
    """A value of ``probfsl run --OPTION``'s choices, refused with argparse's message."""

    def check(value: str) -> str:
        choices = run_choices()[option]
        if value not in choices:
            listed = ", ".join(choices)
            raise _custom(
                f"invalid choice: {value!r} (choose from {listed}){_hint(value, choices)}"
            )
        return value

    return AfterValidator(check)


def _check_method(value: str) -> str:
    choices = run_choices()["method"]
    if value not in choices:
        raise _custom(f"{value!r} is not a method{_hint(value, choices)} (methods: {choices})")
    return value


def _check_device(value: str) -> str:
    """``auto``, or a device ``probfsl run --device`` takes: cpu, cuda, cuda:N or mps
    (whether a worker has it is for the worker to say)."""
    if value == "auto":
        return value
    from probfsl.validation import as_device

    try:
        device = as_device(value)
    except ValueError as err:
        raise _custom(f"{err}, or auto (the worker's own device)") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise _custom(f"device {value!r}: unsupported device type; use cpu, cuda, mps or auto")
    return value


def _check_param(value: Any) -> Any:
    """A hyperparameter's value: one value, as ``--param KEY=VALUE`` gives."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise _custom(
        f"expected one value (true or false, a number, a string or null), got {_show(value)}"
    )


def _check_param_name(value: str) -> str:
    if not value.isidentifier():
        raise _custom(f"{value!r} is not a hyperparameter's name")
    return value


def _path_text(value: Any) -> Any:
    """A path given as a ``pathlib.Path`` (from Python) as its text."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _listed(value: Any) -> Any:
    """One value as a list of one (a value or a list, one cell per value)."""
    return value if isinstance(value, list | tuple) else [value]


def _mapping_or_empty(value: Any) -> Any:
    """An empty section (``grid:`` with nothing under it) as an empty mapping."""
    return {} if value is None else value


def _method_mapping(value: Any) -> Any:
    """A method entry given by its name as ``{method: NAME}``."""
    return {"method": value} if isinstance(value, str) else value


Bool = Annotated[bool, Strict()]
Count = Annotated[int, Strict(), Field(ge=1)]
Seed = Annotated[int, Strict(), Field(ge=0)]
Positive = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
Fraction = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Text = Annotated[str, Strict(), Field(min_length=1)]
Engine = Annotated[Text, _choice("engine")]


_STRICT = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(BaseModel):
    """One named source of ``data``: a built-in data set or a feature file."""

    model_config = _STRICT

    dataset: Annotated[Text, _choice("dataset")] | None = Field(
        None,
        description="a built-in data set's name (`probfsl datasets`); give `dataset` or `features`",
    )
    features: Annotated[Text | None, BeforeValidator(_path_text)] = Field(
        None,
        description="a feature file's path (`.npz`, `.pt`, or `.pkl` with `allow_pickle`), "
        "relative to the sweep file; it must load as `probfsl run` loads it",
    )
    allow_pickle: Bool = Field(
        False,
        description="`true` or `false`: `true` loads a `.pkl` file (unpickling runs code "
        "from the file: trusted files only)",
    )
    optional: Bool = Field(
        False,
        description="`true` or `false`: `true` leaves an absent feature file out, with a note",
    )
    tasks: Annotated[
        list[Annotated[Text, BeforeValidator(_path_text)]], BeforeValidator(_listed)
    ] = Field(
        default_factory=list,
        description="a task file's path (`probfsl run --task-file`), relative to the sweep "
        "file, or a list of them: the source's few-shot cells run each file's tasks (one "
        "cell per file) instead of drawing them; the file fixes the tasks, and the grid's "
        "axes but `engine` (and `run.tasks`) do not apply to them",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SourceSpec:
        if (self.dataset is None) == (self.features is None):
            raise _custom("give exactly one of 'dataset' and 'features'")
        return self


def _listing(kind: Any) -> Any:
    """One value of ``kind`` or a non-empty list of them (one cell per value)."""
    return Annotated[list[kind], BeforeValidator(_listed), Field(min_length=1)]


class MethodSpec(BaseModel):
    """One entry of ``methods`` (a name alone is ``{method: NAME}``)."""

    model_config = _STRICT

    method: Annotated[Text, AfterValidator(_check_method)] = Field(
        description="a method's name (`probfsl run --method`)"
    )
    preset: _listing(Text | None) = Field(
        [None],
        description="a preset's name, `defaults`, `auto`, or a list of them (one cell each); "
        "none: `probfsl run`'s default (`auto` where the data have base classes)",
    )
    params: dict[
        Annotated[Text, AfterValidator(_check_param_name)],
        Annotated[Any, AfterValidator(_check_param)],
    ] = Field(
        default_factory=dict,
        description="a mapping of hyperparameters to one value each (`true`/`false`, a "
        "number, a string or `null`), as `--param KEY=VALUE`",
    )
    engine: _listing(Engine | None) = Field(
        [None],
        description="`handwritten`, `derived`, or a list of them (one cell each); only for "
        "the methods with two engines",
    )
    calibrate: Annotated[Text, _choice("calibrate")] | None = Field(
        None, description="`none` or `temperature` (`probfsl run --calibrate`; few-shot only)"
    )
    zero_shot: Bool = Field(
        False, description="`true` or `false`: zero-shot tasks (the methods with that mode)"
    )
    label: Text | None = Field(
        None, description="a non-empty string: the entry's name in tables (default: `method`)"
    )


class GridSpec(BaseModel):
    """The task-setting axes: every combination is a cell."""

    model_config = _STRICT

    way: _listing(Count) = Field(
        [5], description="integer >= 1: classes per task (at most the data's novel classes)"
    )
    shot: _listing(Count) = Field([1], description="integer >= 1: support samples per class")
    query: _listing(Count) = Field(
        [75], description="integer >= 1: queries per task in all (balanced: a multiple of `way`)"
    )
    balance: _listing(Annotated[Text, _choice("balance")]) = Field(
        ["balanced"],
        description="`balanced` or `dirichlet`: equal query counts, or drawn from a Dirichlet",
    )
    alpha: _listing(Positive) = Field(
        [2.0], description="a finite number > 0: the Dirichlet's concentration (`dirichlet`)"
    )
    seed: _listing(Seed) = Field([0], description="integer >= 0: the seed of the tasks")
    engine: _listing(Engine | None) = Field(
        [None],
        description="`handwritten`, `derived` or `null`: the engine of the methods with two "
        "(the methods with one run once)",
    )
    open: _listing(Seed) = Field(
        [0],
        description="integer >= 0: open queries per task from other novel classes "
        "(`probfsl run --open-queries`; open-set metrics); 0: closed tasks",
    )


class RunSectionSpec(BaseModel):
    """The options of ``probfsl run`` that every cell shares."""

    model_config = _STRICT

    tasks: Count = Field(1000, description="integer >= 1: tasks per cell")
    device: Annotated[Text, AfterValidator(_check_device)] = Field(
        "auto",
        description="`auto` (the worker's device: its GPU if it has one, else cpu), `cpu`, "
        "`cuda`, `cuda:N` or `mps`",
    )
    dtype: Annotated[Text, _choice("dtype")] = Field(
        "float32", description="`float32` or `float64`"
    )
    batch_size: Count | None = Field(
        None,
        description="integer >= 1 or `null`: tasks made and scored at once (memory grows "
        "with it only; `null`: `probfsl run`'s default)",
    )
    episodes: Count | None = Field(
        None,
        description="integer >= 1 or `null`: base-class episodes per candidate of the "
        "default search",
    )
    min_classes: Count = Field(3, description="integer >= 1: zero-shot tasks' fewest classes")
    max_classes: Count = Field(
        10, description="integer >= `min_classes`: zero-shot tasks' most classes"
    )

    @field_validator("max_classes")
    @classmethod
    def _range(cls, value: int, info: Any) -> int:
        low = info.data.get("min_classes")
        if low is not None and value < low:
            raise _custom(f"{value} is below run.min_classes ({low})")
        return value


class ResourcesSpec(BaseModel):
    """What one cell holds while it runs."""

    model_config = _STRICT

    cpus: Count = Field(1, description="integer >= 1: cores, also the cell's torch threads")
    gpus: Fraction = Field(
        0.0, description="a finite number >= 0: a share of a GPU (`0.25`: four cells on one)"
    )


class SweepFile(BaseModel):
    """The sweep file: its sections."""

    model_config = _STRICT

    data: Annotated[dict[Text, SourceSpec], Field(min_length=1)] = Field(
        description="a mapping of names to sources (at least one), each with the keys below"
    )
    methods: Annotated[
        list[Annotated[MethodSpec, BeforeValidator(_method_mapping)]], Field(min_length=1)
    ] = Field(
        description="a list of entries (at least one): a method's name, or a mapping of the "
        "keys below"
    )
    grid: Annotated[GridSpec, BeforeValidator(_mapping_or_empty)] = Field(
        default_factory=GridSpec,
        description="a mapping of the axes below, each one value or a non-empty list: every "
        "combination is a cell",
    )
    run: Annotated[RunSectionSpec, BeforeValidator(_mapping_or_empty)] = Field(
        default_factory=RunSectionSpec,
        description="a mapping of the keys below: `probfsl run`'s options, the same for every cell",
    )
    resources: Annotated[ResourcesSpec, BeforeValidator(_mapping_or_empty)] = Field(
        default_factory=ResourcesSpec,
        description="a mapping of the keys below: what one cell holds while it runs",
    )


#: the model of each section (``data`` and ``methods``: of one of their entries)
_SECTIONS: dict[str, type[BaseModel]] = {
    "data": SourceSpec,
    "methods": MethodSpec,
    "grid": GridSpec,
    "run": RunSectionSpec,
    "resources": ResourcesSpec,
}
#: how a section's keys are written in the reference table
_PREFIX = {"data": "data.NAME.", "methods": "methods[i].", "grid": "grid.", "run": "run."}


def schema_table() -> str:
    """The reference table of the sweep file's keys (in ``docs/sweeps.md``), made from
    :class:`SweepFile`: every key, its default and what it holds."""
    rows = ["| key | default | what it holds |", "|---|---|---|"]
    for name, info in SweepFile.model_fields.items():
        rows.append(f"| `{name}` | {_default(info)} | {info.description} |")
        for key, sub in _SECTIONS[name].model_fields.items():
            prefix = _PREFIX.get(name, f"{name}.")
            rows.append(f"| `{prefix}{key}` | {_default(sub)} | {sub.description} |")
    return "\n".join(rows)


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "`{}`"
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        return "`{}`"
    return f"`{json.dumps(value)}`"


# -- schema errors as one line ----------------------------------------------------------


def _show(value: Any) -> str:
    """A value as the sweep file would write it, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {json.dumps(value)}"
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        return (".inf" if value > 0 else "-.inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Mapping):
        return f"the mapping {json.dumps(value, default=repr)}"
    if isinstance(value, list | tuple):
        return f"the list {json.dumps(list(value), default=repr)}"
    return f"{type(value).__name__} {value!r}"


def _path(loc: Sequence[Any], raw: Any) -> str:
    """``loc`` as the key path of the file: ``methods[1].params.temperature``; the
    index of a value given alone (not as a list) is left out."""
    text, node = "", raw
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(part, int):
            if isinstance(node, list | tuple):
                text += f"[{part}]"
                node = node[part] if part < len(node) else None
            continue
        text += f".{part}" if text else str(part)
        node = node.get(part) if isinstance(node, Mapping) else None
    return text or "(top level)"


def _explain(error: Mapping[str, Any]) -> str:
    """One pydantic error as the sweep file's words."""
    kind, value, loc = error["type"], error.get("input"), error["loc"]
    got = _show(value)
    ctx = error.get("ctx") or {}
    section = loc[0] if loc else None
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        model = _SECTIONS.get(section) if len(loc) > 1 else SweepFile
        keys = list(model.model_fields)
        hint = _hint(str(loc[-1]), keys)
        if section == "grid":
            return f"not an axis; the axes are {keys}{hint}"
        return f"unknown key; the keys are {keys}{hint}"
    if kind == "bool_type":
        return f"expected true or false, got {got}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected integer, got {got}"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {got}"
    if kind == "finite_number":
        return f"expected a finite number, got {got}"
    if kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        return (
            f"must be {'at least' if kind == 'greater_than_equal' else 'above'} {bound}, got {got}"
        )
    if kind == "string_type":
        return f"expected a string, got {got}"
    if kind == "string_too_short":
        return f"must not be empty, got {got}"
    if kind == "too_short":
        if loc == ("data",):
            return "name at least one data set or feature file"
        if loc == ("methods",):
            return "name at least one method"
        return "an empty list gives no cells"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        if len(loc) == 2 and section == "methods":
            return f"expected a method's name or a mapping, got {got}"
        return f"expected a mapping, got {got}"
    if kind == "list_type":
        return f"expected a list, got {got}"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    if kind == "sweep":
        return error["msg"]
    return f"{error['msg']}, got {got}"


def _validate(raw: Any) -> SweepFile:
    """``raw`` (the file's structure) as a :class:`SweepFile`; ``ValueError`` naming every
    problem's key path and value, on one line."""
    if not isinstance(raw, Mapping):
        _fail("(top level)", f"expected a mapping with 'data' and 'methods', got {_show(raw)}")
    try:
        return SweepFile.model_validate(raw)
    except ValidationError as err:
        problems = [f"{_path(e['loc'], raw)}: {_explain(e)}" for e in err.errors(include_url=False)]
        raise ValueError("sweep: " + "; ".join(dict.fromkeys(problems))) from None


def _as_raw(config: SweepConfig) -> dict:
    """A :class:`SweepConfig`'s fields as the file's structure (to check by the schema)."""

    def plain(obj: Any) -> Any:
        if isinstance(obj, os.PathLike):
            return os.fspath(obj)
        if isinstance(obj, Mapping):
            return {k: plain(v) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return [plain(v) for v in obj]
        return obj

    def fields_of(obj: Any, skip: tuple[str, ...] = ()) -> Any:
        if hasattr(obj, "__dataclass_fields__"):
            return {k: plain(v) for k, v in asdict(obj).items() if k not in skip}
        return plain(obj)

    data = {getattr(s, "name", repr(s)): fields_of(s, ("name",)) for s in config.data}
    return {
        "data": data,
        "methods": [fields_of(e) for e in config.methods],
        "grid": plain(config.grid),
        "run": fields_of(config.run),
        "resources": fields_of(config.resources),
    }


def _sources(spec: SweepFile, base_dir: Path | None) -> list[Source]:
    """The sources of ``spec``; a feature file's path relative to ``base_dir`` (where it
    is not ``None``) made absolute."""
    sources = []
    for name, s in spec.data.items():
        features, tasks = s.features, tuple(dict.fromkeys(s.tasks))
        if base_dir is not None:
            if features is not None:
                features = str((base_dir / features).resolve())
            tasks = tuple(str((base_dir / path).resolve()) for path in tasks)
        sources.append(Source(name, s.dataset, features, s.allow_pickle, s.optional, tasks))
    return sources


def _entries(spec: SweepFile) -> list[MethodEntry]:
    def one(values: list) -> Any:
        return values[0] if len(values) == 1 else list(values)

    return [
        MethodEntry(
            m.method,
            one(m.preset),
            dict(m.params),
            one(m.engine),
            m.calibrate,
            m.zero_shot,
            m.label,
        )
        for m in spec.methods
    ]


# -- checks against probfsl run and the data --------------------------------------------


def _fail(key: str, message: str) -> None:
    raise ValueError(f"sweep: {key}: {message}")


def _quiet() -> contextlib.AbstractContextManager:
    """What ``probfsl run``'s checks print (notes on stderr) kept out of the check."""
    return contextlib.redirect_stderr(io.StringIO())


def check_config(config: SweepConfig) -> None:
    """``ValueError`` naming the key and value of the first problem of ``config``, before
    any work, for what ``probfsl run`` would refuse:

    * files: every feature file is there and loads (``probfsl run``'s loader);
    * each method entry: its engine, hyperparameters, presets, calibration and zero-shot
      use, checked by the functions ``probfsl run`` checks them with;
    * each cell: its :class:`~probfsl.run_spec.RunSpec` is valid, and one task of its
      setting is drawn from its data (the check ``probfsl run`` makes before its work),
      so a ``way`` above the data's classes, or queries the novel classes cannot hold,
      is refused here rather than failing as a cell.

    Only what depends on the worker (whether it has the device, its free memory) is left
    to the cell.
    """
    for s in config.data:
        if s.features is not None and not Path(s.features).is_file():
            _fail(f"data.{s.name}.features", f"file not found: {s.features}")
        for path in s.tasks:
            if not Path(path).is_file():
                _fail(f"data.{s.name}.tasks", f"file not found: {path}")
    for i, entry in enumerate(config.methods):
        _check_entry(i, entry, config.grid)
    loaded = {s.name: _load(s) for s in config.data}
    for s in config.data:
        _check_task_files(s, loaded[s.name])
    checked: set = set()
    for i, source, cell in config._combinations():
        try:
            spec = cell.spec()
        except ValueError as err:
            _fail(f"methods[{i}] ({cell.describe()})", str(err))
        _check_cell(i, source, cell, spec, loaded[source.name], checked)


def _check_entry(i: int, entry: MethodEntry, grid: Mapping[str, Any]) -> None:
    """A method entry's options, as ``probfsl run`` checks them before loading data."""
    from probfsl.methods import DEFAULTS
    from probfsl.run_spec import engine_param
    from probfsl.tuning import make_estimator

    where = f"methods[{i}]"
    params = dict(entry.params)
    engines = [e for e in _as_list(entry.engine) if e is not None]
    for engine in engines:
        try:
            engine_param(entry.method, engine, params)
        except ValueError as err:
            _fail(f"{where}.engine = {engine!r}", str(err))
    from_grid = not engines and _has_engines(entry.method)
    if from_grid:
        engines = [e for e in _as_list(grid.get("engine")) if e is not None]
    try:
        make_estimator(entry.method, **params)
    except (ValueError, TypeError) as err:
        _fail(f"{where}.params = {_flow(params)}", str(err))
    if entry.zero_shot:
        if entry.calibrate == "temperature":
            _fail(
                f"{where}.calibrate = 'temperature'",
                "--calibrate temperature applies to few-shot runs, not --zero-shot",
            )
        if not hasattr(make_estimator(entry.method, **params), "predict_zero_shot"):
            _fail(
                f"{where}.zero_shot = true",
                f"--zero-shot is not available for method {entry.method!r}",
            )
    for preset, engine in itertools.product(_as_list(entry.preset), engines or [None]):
        run_params = params if engine is None else {**params, "engine": engine}
        named = None if preset in (DEFAULTS, "auto") else preset
        key = f"{where}.preset = {preset!r}"
        if entry.zero_shot and named is not None:
            _fail(key, "--zero-shot takes no named --preset (only auto)")
        try:
            make_estimator(entry.method, None if entry.zero_shot else named, **run_params)
            if preset == "auto":
                make_estimator(entry.method, "auto", **run_params)
        except (ValueError, TypeError) as err:
            keys = [key] if preset is not None else []
            if engine is not None:
                keys.append(f"{'grid' if from_grid else where}.engine = {engine!r}")
            _fail(" with ".join(keys) or where, str(err))


def _flow(params: Mapping[str, Any]) -> str:
    """Hyperparameters as the sweep file writes them: ``{whitening: 'global', center: true}``."""

    def one(value: Any) -> str:
        if isinstance(value, bool) or value is None:
            return _show(value)
        return repr(value)

    return "{" + ", ".join(f"{k}: {one(v)}" for k, v in params.items()) + "}"


def _load(source: Source) -> Any:
    """A source's features, loaded by ``probfsl run``'s loader; ``ValueError`` naming the
    source for a file it cannot read."""
    try:
        with _quiet():
            return load_source(source.dataset, source.features, source.allow_pickle)
    except Exception as err:  # any failure to read the file is the file's problem
        key = f"data.{source.name}.features" if source.features else f"data.{source.name}"
        message = " ".join(str(err).split()) or type(err).__name__
        _fail(
            key,
            message
            if isinstance(err, ValueError | OSError)
            else f"{type(err).__name__}: {message}",
        )


def _check_task_files(source: Source, fs: Any) -> None:
    """Each task file of ``source`` against its features, as ``probfsl run --task-file``
    checks it: rows within the features, labels and open queries as they must be."""
    from probfsl.data import TaskFile

    for path in source.tasks:
        try:
            task_file_shape(path)
            TaskFile(path).check(len(fs.labels), labels=fs.labels)
        except ValueError as err:
            _fail(f"data.{source.name}.tasks", str(err))


def _check_cell(i: int, source: Source, cell: Cell, spec: Any, fs: Any, checked: set) -> None:
    """What ``probfsl run`` checks on the data before its work, for one cell (its run
    ``spec``): the task setting can be drawn (:func:`probfsl.running.check_tasks_possible`),
    the method has the base classes it needs (:func:`probfsl.running.params_without_base`),
    temperature calibration has base classes to fit on."""
    from probfsl.methods import DEFAULTS
    from probfsl.running import check_tasks_possible, params_without_base

    setting = (source.name, cell.zero_shot, cell.way, cell.shot, cell.query, cell.balance)
    setting += (cell.alpha, cell.seed, cell.min_classes, cell.max_classes, cell.open_queries)
    setting += (cell.task_file,)
    if setting not in checked:
        checked.add(setting)
        try:
            check_tasks_possible(spec, fs)
        except (ValueError, TypeError) as err:
            _fail(f"{_setting_keys(cell)} on data.{source.name} ({cell.describe()})", str(err))
    if cell.zero_shot:
        return
    estimator = (source.name, cell.method, cell.preset, cell.params, cell.engine, cell.calibrate)
    if estimator in checked:
        return
    checked.add(estimator)
    preset = None if cell.preset in (DEFAULTS, "auto") else cell.preset
    params = dict(cell.params)
    if cell.engine is not None:
        params["engine"] = cell.engine
    try:
        with _quiet():
            params_without_base(cell.method, fs, preset, params)
    except ValueError as err:
        _fail(f"methods[{i}] = {cell.method!r} on data.{source.name}", str(err))
    if cell.calibrate == "temperature" and fs.classes_in("base").size == 0:
        _fail(
            f"methods[{i}].calibrate = 'temperature' on data.{source.name}",
            f"--calibrate temperature needs base classes; {fs.name} has none",
        )


def _setting_keys(cell: Cell) -> str:
    """The keys and values that make a cell's task setting, for messages."""
    if cell.task_file is not None:
        return f"data.{cell.data}.tasks = {cell.task_file}"
    if cell.zero_shot:
        keys = [
            f"run.min_classes = {cell.min_classes}",
            f"run.max_classes = {cell.max_classes}",
            f"grid.query = {cell.query}",
        ]
    else:
        keys = [f"grid.way = {cell.way}", f"grid.shot = {cell.shot}", f"grid.query = {cell.query}"]
        keys.append(f"grid.balance = {cell.balance}")
        if cell.balance != "balanced":
            keys.append(f"grid.alpha = {cell.alpha}")
        if cell.open_queries:
            keys.append(f"grid.open = {cell.open_queries}")
    return ", ".join([*keys, f"grid.seed = {cell.seed}"])


# -- YAML and dicts ---------------------------------------------------------------------


def _yaml_loader() -> type:
    """A YAML ``SafeLoader`` that refuses a mapping's repeated key (naming the key, its
    line and where it is in the file) instead of keeping the last value."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            self._refuse_repeats(node, "")
            return self.construct_document(node)

        def _refuse_repeats(self, node: Any, where: str, seen_nodes: set | None = None) -> None:
            seen_nodes = set() if seen_nodes is None else seen_nodes
            if id(node) in seen_nodes:  # an alias of a node already walked
                return
            seen_nodes.add(id(node))
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key, value in node.value:
                    if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                        name = self.construct_object(key, deep=True)
                        line = key.start_mark.line + 1
                        if name in seen:
                            inside = f" in {where}" if where else ""
                            raise ValueError(
                                f"line {line}: key {name!r}{inside} is given twice "
                                f"(first on line {seen[name]})"
                            )
                        seen[name] = line
                        path = f"{where}.{name}" if where else str(name)
                    else:
                        path = where
                    self._refuse_repeats(value, path, seen_nodes)
            elif isinstance(node, yaml.SequenceNode):
                for k, item in enumerate(node.value):
                    self._refuse_repeats(item, f"{where}[{k}]", seen_nodes)

    return StrictLoader


def read_yaml(text: str, name: str = "sweep file") -> Any:
    """The structure of a YAML text, a repeated key refused (``ValueError``)."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"sweep: {name}: not valid YAML: {err}") from None
    except ValueError as err:
        raise ValueError(f"sweep: {name}: {err}") from None


def load_config(path: str | Path | Mapping[str, Any]) -> SweepConfig:
    """A :class:`SweepConfig` from a YAML file (feature paths relative to its folder), or
    from the file's structure as a dict (:func:`config_from_dict`)."""
    if isinstance(path, Mapping):
        return config_from_dict(path)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep file not found: {path}")
    return config_from_dict(read_yaml(path.read_text(), str(path)), base_dir=path.parent)


def config_from_dict(raw: Any, base_dir: str | Path = ".") -> SweepConfig:
    """A :class:`SweepConfig` from the YAML file's structure (nested dicts and lists),
    checked by the schema (:class:`SweepFile`) and then against the data and ``probfsl
    run`` (:func:`check_config`); feature paths are relative to ``base_dir``."""
    spec = _validate(raw)
    return SweepConfig(
        data=_sources(spec, Path(base_dir)),
        methods=_entries(spec),
        grid=spec.grid.model_dump(),
        run=RunOptions(**spec.run.model_dump()),
        resources=Resources(**spec.resources.model_dump()),
    )
