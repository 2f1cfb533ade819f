"""The declared form of an estimator: its hyperparameters and its fitted attributes.

Every estimator class that can be saved declares both once, as its class attribute
``schema`` (an :class:`EstimatorSchema`):

* ``params``: every hyperparameter (every argument of ``__init__``) with its type and
  range: :class:`Real`, :class:`Int`, :class:`Flag`, :class:`Choice` and
  :class:`FloatDType`, each optionally ``None``. ``check_params``
  (:meth:`~probfsl.models.base.Hyperparameters.check_params`, before every fit and
  prediction) and loading (:mod:`probfsl.estimator_io`) both check against it, so the
  two cannot drift apart.
* ``fitted``: the fitted attributes, in groups (:class:`Group`), one per fitting call (the
  attributes ``fit_base`` sets together, those of ``fit``, ...). A saved state is a union
  of whole groups (no group at all: an estimator saved before it was fitted); an
  attribute a group lists as optional may be absent. Each attribute has a form:

  - :class:`Tensor`: dtype kind (``"float"``: float32 or float64, one dtype for the
    whole group, or the group's fixed dtype; ``"int"``: int64; ``"bool"``), rank and
    shape in named dimensions shared by every attribute (``D``, the width of the base
    features, is the same in ``base_mean_ [D]`` and ``coef_ [K, D]``), finite values,
    and where meaningful a sign and a bound on the magnitude (:data:`FEATURE_BOUND`
    for statistics of the features);
  - :class:`Array`: the same for a NumPy array;
  - :class:`Record`: a dataclass of probfsl, field by field, with variants chosen by
    one field (e.g. a factorisation whose ``mode`` says which matrices it holds);
  - :class:`Items`: a tuple of forms; :class:`ListOf`: a list of any length of one
    form; :class:`Maybe`: ``None`` or a form; :class:`Nested`: a saved estimator inside
    another's state (checked against its own class's declaration); :class:`ParamDict`:
    a dict of hyperparameter values (also a hyperparameter form, e.g. the ``fixed``
    hyperparameters of a tuned estimator);
    :class:`Dim`: an integer equal to a named dimension; a hyperparameter form
    (:class:`Real`, :class:`Int`, ...) for a plain number, flag or string.

:meth:`EstimatorSchema.check_state` checks a state in the encoded form that
:mod:`probfsl.estimator_io` writes (tensors, tagged dicts for NumPy arrays and
dataclasses, tuples, plain values), before anything is decoded or computed, and raises a
``ValueError`` that names the file, the attribute and the form it should have, e.g.
``'model.pt': base_mean_ should be a float32 tensor of shape [D] (D = 64), got float32
of shape [2, 64]``. :func:`saveable_class` names the classes a saved file may hold (the
estimators of :mod:`probfsl.models`, read off the class, not the registry) and
:func:`check_saved_estimator` checks an estimator's saved hyperparameters and state
against its class's declaration: the loader (:mod:`probfsl.estimator_io`) and
:class:`Nested` use both, so this module imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from importlib import import_module
from typing import Any, NoReturn

import torch

from probfsl.validation import (
    FLOAT_DTYPES,
    check_choice,
    check_flag,
    check_float_dtype,
    check_hyperparameter,
)

__all__ = [
    "ESTIMATOR_SURFACE",
    "FEATURE_BOUND",
    "OTHER_ESTIMATORS",
    "TAG",
    "Array",
    "Choice",
    "Dim",
    "EstimatorSchema",
    "Flag",
    "FloatDType",
    "Group",
    "Int",
    "Items",
    "ListOf",
    "Maybe",
    "Nested",
    "Param",
    "ParamDict",
    "Real",
    "Record",
    "Tensor",
    "Text",
    "check_nested",
    "check_saved_estimator",
    "declared_schema",
    "saveable_class",
]

#: the key that marks an encoded NumPy array, dtype or dataclass in a saved file
TAG = "__probfsl__"

#: the largest magnitude accepted in a statistic of the features (a mean, a variance, a
#: scatter matrix, stored features): far beyond any real feature, and far below where
#: float32 arithmetic on the features (squares, norms) overflows
FEATURE_BOUND = 1e15


# ------------------------------------------------------------------------- hyperparameters
class Param(ABC):
    """The declared type and range of one hyperparameter (or plain fitted value)."""

    @abstractmethod
    def check(self, name: str, value: Any) -> None:
        """``TypeError`` (wrong type) or ``ValueError`` (out of range) naming ``name``."""

    @abstractmethod
    def describe(self) -> str:
        """The accepted values in words (for messages)."""


@dataclasses.dataclass(frozen=True)
class Real(Param):
    """A finite real number (not a bool), with optional bounds.

    ``positive``: > 0; ``nonnegative``: >= 0; ``low``/``high``: inclusive bounds;
    ``above``: an exclusive lower bound; ``infinite``: ``float("inf")`` is accepted too;
    ``optional``: ``None`` is accepted."""

    positive: bool = False
    nonnegative: bool = False
    low: float | None = None
    high: float | None = None
    above: float | None = None
    infinite: bool = False
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if self.infinite and isinstance(value, float) and value == math.inf:
            return
        check_hyperparameter(
            name,
            value,
            positive=self.positive,
            nonnegative=self.nonnegative,
            low=self.low,
            high=self.high,
            optional=self.optional,
        )
        if value is not None and self.above is not None and value <= self.above:
            raise ValueError(f"{name} must exceed {self.above:g}, got {value!r}")

    def describe(self) -> str:
        parts = ["a finite real number"]
        if self.positive:
            parts.append("> 0")
        if self.nonnegative:
            parts.append(">= 0")
        if self.above is not None:
            parts.append(f"> {self.above:g}")
        if self.low is not None:
            parts.append(f">= {self.low:g}")
        if self.high is not None:
            parts.append(f"<= {self.high:g}")
        text = " ".join(parts)
        if self.infinite:
            text += " or inf"
        return text + (" or None" if self.optional else "")


@dataclasses.dataclass(frozen=True)
class Int(Param):
    """A whole number (``5`` or ``5.0``; not a bool), at least ``low`` when given,
    non-negative with ``nonnegative``; ``None`` with ``optional``."""

    low: int | None = None
    nonnegative: bool = False
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        check_hyperparameter(
            name,
            value,
            integer=True,
            low=self.low,
            nonnegative=self.nonnegative,
            optional=self.optional,
        )

    def describe(self) -> str:
        text = "an integer"
        if self.low is not None:
            text += f" >= {self.low}"
        elif self.nonnegative:
            text += " >= 0"
        return text + (" or None" if self.optional else "")


@dataclasses.dataclass(frozen=True)
class Flag(Param):
    """``True`` or ``False`` (or ``None`` with ``optional``)."""

    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if self.optional and not isinstance(value, bool):
            raise TypeError(f"{name} must be None, True or False, got {value!r}")
        check_flag(name, value)

    def describe(self) -> str:
        return "None, True or False" if self.optional else "True or False"


@dataclasses.dataclass(frozen=True)
class Choice(Param):
    """One of ``choices`` (or ``None`` with ``optional``)."""

    choices: tuple
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, str) and all(isinstance(c, str) for c in self.choices):
            # a container or tensor is no name (and `in` would compare it elementwise)
            raise ValueError(f"{name} must be one of {list(self.choices)}, got {value!r}")
        check_choice(name, value, self.choices)

    def describe(self) -> str:
        return f"one of {list(self.choices)}" + (" or None" if self.optional else "")


@dataclasses.dataclass(frozen=True)
class FloatDType(Param):
    """``torch.float32`` or ``torch.float64`` (or ``None`` with ``optional``)."""

    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        check_float_dtype(name, value)

    def describe(self) -> str:
        return "torch.float32 or torch.float64" + (" or None" if self.optional else "")


@dataclasses.dataclass(frozen=True)
class Text(Param):
    """Any string (or ``None`` with ``optional``)."""

    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {type(value).__name__}")

    def describe(self) -> str:
        return "a string" + (" or None" if self.optional else "")


# ------------------------------------------------------------------------- fitted values
class _Context:
    """What a check of one state has learnt so far: the sizes of the named dimensions
    and the float dtype of each group, and where the state comes from (for messages)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.dims: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.group = ""
        self.fixed: torch.dtype | None = None

    def fail(self, path: str, form: str, got: str) -> NoReturn:
        raise ValueError(f"{self.where}: {path} should be {form}, got {got}")

    def float_dtype(self) -> torch.dtype | None:
        return self.fixed or self.dtypes.get(self.group)


def _got(value: Any) -> str:
    """A value's form in words, for messages (never its whole content)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} of shape {list(value.shape)}"
    if isinstance(value, dict) and value.get(TAG) == "dataclass":
        return f"a {str(value.get('class')).rpartition(':')[2]}"
    if isinstance(value, dict) and value.get(TAG) == "ndarray":
        inner = value.get("value")
        return f"a NumPy array of {_got(inner)}" if isinstance(inner, torch.Tensor) else "a dict"
    if value is None:
        return "None"
    if isinstance(value, (bool, int, float, str)):
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        return f"{text} ({type(value).__name__})"
    return f"a {type(value).__name__}"


class Value(ABC):
    """The declared form of a fitted attribute (or of a field of one)."""

    @abstractmethod
    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        """``ValueError`` through ``ctx`` unless ``value`` (encoded) has this form."""

    @abstractmethod
    def form(self, ctx: _Context) -> str:
        """The form in words, with the sizes of the dimensions known so far."""


_KINDS = {"float": None, "int": (torch.int64,), "bool": (torch.bool,)}


class Tensor(Value):
    """A dense tensor of rank ``len(shape)``; ``shape`` holds dimension names (shared by
    every attribute of a state) or fixed sizes.

    ``kind``: ``"float"`` (float32 or float64: the group's one float dtype), ``"int"``
    (int64) or ``"bool"``. Float values must be finite, within ``bound`` in magnitude
    when given, and > 0 (``positive``) or >= 0 (``nonnegative``) when asked."""

    def __init__(
        self,
        *shape: str | int,
        kind: str = "float",
        bound: float | None = None,
        positive: bool = False,
        nonnegative: bool = False,
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {list(_KINDS)}, got {kind!r}")
        self.shape, self.kind, self.bound = shape, kind, bound
        self.positive, self.nonnegative = positive, nonnegative

    noun = "tensor"

    def dtypes(self, ctx: _Context) -> tuple[torch.dtype, ...]:
        if self.kind != "float":
            return _KINDS[self.kind]
        known = ctx.float_dtype()
        return (known,) if known is not None else FLOAT_DTYPES

    def form(self, ctx: _Context) -> str:
        dtypes = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes(ctx))
        if not self.shape:
            return f"a {dtypes} scalar {self.noun}"
        known = [f"{d} = {ctx.dims[d]}" for d in dict.fromkeys(self.shape) if d in ctx.dims]
        sizes = f" ({', '.join(known)})" if known else ""
        return f"a {dtypes} {self.noun} of shape [{', '.join(map(str, self.shape))}]{sizes}"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not isinstance(value, torch.Tensor):
            ctx.fail(path, self.form(ctx), _got(value))
        self._validate_tensor(value, path, ctx, _got(value))

    def _validate_tensor(self, value: torch.Tensor, path: str, ctx: _Context, got: str) -> None:
        """The checks of a tensor (``got``: how the value is described in messages)."""
        if (
            value.layout != torch.strided
            or value.dtype not in self.dtypes(ctx)
            or value.ndim != len(self.shape)
        ):
            ctx.fail(path, self.form(ctx), got)
        bound: dict[str, int] = {}
        for dim, size in zip(self.shape, value.shape, strict=True):
            expected = dim if isinstance(dim, int) else ctx.dims.get(dim, bound.get(dim))
            if expected is not None and size != expected:
                ctx.fail(path, self.form(ctx), got)
            if isinstance(dim, str):
                bound[dim] = size
        if self.kind == "float":
            self._check_values(value, path, ctx)
            ctx.dtypes.setdefault(ctx.group, value.dtype)
        ctx.dims.update(bound)

    def _check_values(self, value: torch.Tensor, path: str, ctx: _Context) -> None:
        if value.numel() == 0:
            return
        if not bool(torch.isfinite(value).all()):
            ctx.fail(path, self.form(ctx) + " with finite values", "NaN or infinite values")
        if self.bound is not None:
            top = float(value.abs().max())
            if top > self.bound:
                ctx.fail(
                    path,
                    f"{self.form(ctx)} with values at most {self.bound:.0e} in magnitude",
                    f"a value of magnitude {top:.3g}",
                )
        if self.positive and not bool((value > 0).all()):
            ctx.fail(path, self.form(ctx) + " with positive values", f"{float(value.min()):.3g}")
        if self.nonnegative and not bool((value >= 0).all()):
            ctx.fail(path, self.form(ctx) + " with values >= 0", f"{float(value.min()):.3g}")


class Array(Tensor):
    """A NumPy array (encoded as a tagged dict holding a tensor) of this form."""

    noun = "NumPy array"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not (
            isinstance(value, dict)
            and value.get(TAG) == "ndarray"
            and set(value) == {TAG, "value"}
            and isinstance(value["value"], torch.Tensor)
        ):
            ctx.fail(path, self.form(ctx), _got(value))
        self._validate_tensor(value["value"], path, ctx, _got(value))


class Dim(Value):
    """A plain ``int`` equal to the named dimension ``name`` (binding it if still free)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def form(self, ctx: _Context) -> str:
        known = f" ({self.name} = {ctx.dims[self.name]})" if self.name in ctx.dims else ""
        return f"an int equal to {self.name}{known}"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            ctx.fail(path, self.form(ctx), _got(value))
        if ctx.dims.setdefault(self.name, value) != value:
            ctx.fail(path, self.form(ctx), _got(value))


class Maybe(Value):
    """``None`` or ``inner`` (``Maybe()``: ``None`` only)."""

    def __init__(self, inner: Value | Param | None = None) -> None:
        self.inner = inner

    def form(self, ctx: _Context) -> str:
        return "None" if self.inner is None else f"None or {_form(self.inner, ctx)}"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if value is None:
            return
        if self.inner is None:
            ctx.fail(path, "None", _got(value))
        _validate(self.inner, value, path, ctx)


class Items(Value):
    """A tuple whose items have the forms ``items`` (e.g. an eigendecomposition)."""

    def __init__(self, *items: Value | Param) -> None:
        self.items = items

    def form(self, ctx: _Context) -> str:
        return f"a tuple of {len(self.items)} ({', '.join(_form(i, ctx) for i in self.items)})"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not isinstance(value, tuple) or len(value) != len(self.items):
            ctx.fail(path, self.form(ctx), _got(value))
        for i, (item, spec) in enumerate(zip(value, self.items, strict=True)):
            _validate(spec, item, f"{path}[{i}]", ctx)


class ListOf(Value):
    """A list (or tuple) of any length whose every item has the form ``item``."""

    def __init__(self, item: Value | Param) -> None:
        self.item = item

    def form(self, ctx: _Context) -> str:
        return f"a list of {_form(self.item, ctx)}"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not isinstance(value, (list, tuple)):
            ctx.fail(path, self.form(ctx), _got(value))
        for i, item in enumerate(value):
            _validate(self.item, item, f"{path}[{i}]", ctx)


#: the plain values a :class:`ParamDict` holds (and ``torch.dtype``)
_PLAIN = (type(None), bool, int, float, str)


class ParamDict(Value, Param):
    """A dict of hyperparameter values: string keys; ``None``, bools, numbers, strings or
    ``torch.dtype`` values (stored as the tagged dtype of a saved file). A form both of a
    hyperparameter (checked on the estimator, and on loading) and of a fitted value."""

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise TypeError(f"{name} must be a dict of hyperparameters, got {type(value).__name__}")
        for key, item in value.items():
            if not isinstance(key, str) or key == TAG:
                raise TypeError(f"{name} must have string keys, got {key!r}")
            if not isinstance(item, (*_PLAIN, torch.dtype)):
                raise TypeError(
                    f"{name}[{key!r}] must be None, a bool, a number, a string or a "
                    f"torch.dtype, got {type(item).__name__}"
                )

    def describe(self) -> str:
        return "a dict of hyperparameter values (string keys; None, bool, number, string, dtype)"

    def form(self, ctx: _Context) -> str:
        return self.describe()

    def decoded(self, value: Any) -> Any:
        """A stored dict with its tagged dtypes decoded (anything else left for
        :meth:`check` to refuse)."""
        if not isinstance(value, dict):
            return value
        return {k: _decode_param(v) for k, v in value.items()}

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not isinstance(value, dict) or TAG in value:
            ctx.fail(path, self.form(ctx), _got(value))
        try:
            self.check(path, self.decoded(value))
        except TypeError:
            ctx.fail(path, self.form(ctx), "a dict holding other values")


class Nested(Value):
    """A whole estimator saved inside another's state (a tagged dict with its class,
    hyperparameters and fitted state), checked against the declaration of its own class,
    which must be a saveable probfsl estimator (:mod:`probfsl.estimator_io`)."""

    def form(self, ctx: _Context) -> str:
        return "a saved probfsl estimator"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not (isinstance(value, dict) and value.get(TAG) == "estimator"):
            ctx.fail(path, self.form(ctx), _got(value))
        check_nested(value, f"{ctx.where}: {path}")


class Record(Value):
    """An instance of the dataclass ``cls`` (encoded as a tagged dict), its fields of the
    forms ``fields``; with ``by``, the field ``by`` (a :class:`Choice`, checked first)
    selects further fields from ``variants[value]``. A field with a default in ``cls``
    may be absent (a file written before the field was added): it takes the default."""

    def __init__(
        self,
        cls: type,
        fields: Mapping[str, Value | Param],
        by: str | None = None,
        variants: Mapping[Any, Mapping[str, Value | Param]] | None = None,
    ) -> None:
        self.cls, self.fields, self.by, self.variants = cls, dict(fields), by, variants or {}
        self.target = f"{cls.__module__}:{cls.__qualname__}"

    def field_names(self) -> set[str]:
        """Every field this declaration knows (common and of every variant)."""
        names = set(self.fields)
        for extra in self.variants.values():
            names |= set(extra)
        return names

    def form(self, ctx: _Context) -> str:
        return f"a {self.cls.__name__}"

    def validate(self, value: Any, path: str, ctx: _Context) -> None:
        if not (isinstance(value, dict) and value.get(TAG) == "dataclass"):
            ctx.fail(path, self.form(ctx), _got(value))
        if value.get("class") != self.target:
            ctx.fail(path, self.form(ctx), _got(value))
        given = {k: v for k, v in value.items() if k not in (TAG, "class")}
        fields = dict(self.fields)
        if self.by is not None:
            _validate(self.fields[self.by], given.get(self.by), f"{path}.{self.by}", ctx)
            fields.update(self.variants.get(given[self.by], {}))
        for name in fields:
            if name not in given and name not in _defaulted(self.cls):
                raise ValueError(
                    f"{ctx.where}: {path}.{name} is missing ({path} is a "
                    f"{self.cls.__name__} with fields {', '.join(fields)})"
                )
        for name in given:
            if name not in fields:
                raise ValueError(
                    f"{ctx.where}: {path}.{name} is not a field of {self.cls.__name__} "
                    f"(its fields: {', '.join(fields)})"
                )
        for name, spec in fields.items():
            if name != self.by and name in given:
                _validate(spec, given[name], f"{path}.{name}", ctx)


def _defaulted(cls: type) -> set[str]:
    """The fields of the dataclass ``cls`` that have a default: a file written before
    such a field was added lacks it, and the dataclass fills it in when rebuilt."""
    return {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }


def _form(spec: Value | Param, ctx: _Context) -> str:
    return spec.form(ctx) if isinstance(spec, Value) else spec.describe()


def _validate(spec: Value | Param, value: Any, path: str, ctx: _Context) -> None:
    if isinstance(spec, Value):
        spec.validate(value, path, ctx)
        return
    if isinstance(value, (dict, list, tuple, torch.Tensor)):
        ctx.fail(path, spec.describe(), _got(value))
    try:
        spec.check(path, value)
    except (TypeError, ValueError):
        ctx.fail(path, spec.describe(), _got(value))


# ------------------------------------------------------------------------- the schema
@dataclasses.dataclass(frozen=True)
class Group:
    """Fitted attributes that one call sets together (``call``: e.g. ``"fit_base"``).

    ``attributes`` maps each name to its form, in the order they are checked (the first
    attribute with a named dimension sets its size); ``optional`` names those that may be
    absent when the group is present; float tensors of the group share one dtype,
    ``dtype`` when given."""

    call: str
    attributes: Mapping[str, Value | Param]
    optional: frozenset[str] = frozenset()
    dtype: torch.dtype | None = None

    def required(self) -> list[str]:
        return [a for a in self.attributes if a not in self.optional]


def _decode_param(value: Any) -> Any:
    """A hyperparameter as stored: plain values as they are, an encoded ``torch.dtype``
    as the dtype (looked up by name, never built); anything else stays as it is, for
    the declaration to refuse."""
    if isinstance(value, dict) and value.get(TAG) == "dtype" and set(value) == {TAG, "value"}:
        dtype = getattr(torch, str(value["value"]), None)
        return dtype if isinstance(dtype, torch.dtype) else value
    return value


@dataclasses.dataclass(frozen=True)
class EstimatorSchema:
    """The hyperparameters and fitted attributes of an estimator class (module docstring)."""

    params: Mapping[str, Param]
    fitted: Sequence[Group] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for group in self.fitted:
            clash = seen & set(group.attributes)
            if clash:
                raise ValueError(f"fitted attributes {sorted(clash)} are in two groups")
            seen |= set(group.attributes)

    def attributes(self) -> list[str]:
        """Every declared fitted attribute."""
        return [a for g in self.fitted for a in g.attributes]

    def derive(
        self, params: Mapping[str, Param] | None = None, drop: Sequence[str] = ()
    ) -> EstimatorSchema:
        """This schema with hyperparameters ``drop`` removed and ``params`` added or
        replaced (for a subclass that fixes or adds some); the same fitted attributes."""
        kept = {k: v for k, v in self.params.items() if k not in drop}
        return dataclasses.replace(self, params={**kept, **(params or {})})

    # -------------------------------------------------------------- hyperparameters
    def check_params(self, estimator: Any) -> None:
        """Each declared hyperparameter of ``estimator`` (its attribute of that name), in
        declaration order: ``TypeError``/``ValueError`` naming the first bad one."""
        for name, spec in self.params.items():
            spec.check(name, getattr(estimator, name))

    def check_saved_params(self, params: Mapping[str, Any], where: str, owner: str) -> dict:
        """The hyperparameters of a file, checked: every declared one present and valid
        (``ValueError`` naming ``where`` and the hyperparameter), encoded dtypes decoded.
        Names that are not declared are left for the caller to refuse."""
        missing = [k for k in self.params if k not in params]
        if missing:
            raise ValueError(
                f"{where}: hyperparameter {missing[0]} of {owner} is missing "
                f"(it should be {self.params[missing[0]].describe()})"
            )
        decoded = {k: _decode_param(v) for k, v in params.items()}
        for name, spec in self.params.items():
            if isinstance(spec, ParamDict):
                decoded[name] = value = spec.decoded(decoded[name])
            else:
                value = decoded[name]
            if isinstance(value, (list, tuple, torch.Tensor)) or (
                isinstance(value, dict) and not isinstance(spec, ParamDict)
            ):
                raise ValueError(
                    f"{where}: hyperparameter {name} should be {spec.describe()}, got {_got(value)}"
                )
            try:
                spec.check(name, value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"{where}: hyperparameter {name} should be {spec.describe()}, got {_got(value)}"
                ) from None
        return decoded

    # -------------------------------------------------------------- fitted state
    def check_state(self, state: Mapping[str, Any], where: str, owner: str) -> None:
        """``ValueError`` naming ``where`` and the attribute unless the (encoded) fitted
        ``state`` is a union of whole declared groups whose every attribute has its
        declared form, the named dimensions agreeing across attributes."""
        declared = self.attributes()
        for name in state:
            if name not in declared:
                listed = ", ".join(declared) if declared else "none"
                raise ValueError(
                    f"{where}: {name} is not a fitted attribute of {owner} "
                    f"(its fitted attributes: {listed})"
                )
        for group in self.fitted:
            present = [a for a in group.attributes if a in state]
            missing = [a for a in group.required() if a not in state]
            if present and missing:
                optional = sorted(group.optional)
                extra = f" (and optionally {', '.join(optional)})" if optional else ""
                raise ValueError(
                    f"{where}: {missing[0]} is missing: {owner}.{group.call} sets "
                    f"{', '.join(group.required())} together{extra}"
                )
        ctx = _Context(where)
        for group in self.fitted:
            ctx.group, ctx.fixed = group.call, group.dtype
            for name, spec in group.attributes.items():
                if name in state:
                    _validate(spec, state[name], name, ctx)


# ------------------------------------------------------------------ saveable estimators
#: what makes a class an estimator (the surface of probfsl.models.base.FewShotClassifier)
ESTIMATOR_SURFACE = ("get_params", "fitted_state", "fit_base", "predict_proba")
#: the saveable estimators outside probfsl.models ("module:Class")
OTHER_ESTIMATORS = frozenset({"probfsl.tuning:AutoPreset"})


#: modules renamed since files were saved under their old names (old prefix -> new)
RENAMED_MODULES = {"probfsl.models.gptree": "probfsl.models.gp_tree"}


def current_module(module: str) -> str:
    """``module`` under its current name (:data:`RENAMED_MODULES`), so that files saved
    before a rename still load."""
    for old, new in RENAMED_MODULES.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return module


def saveable_class(target: str) -> type:
    """The estimator class named ``"module:Class"``, if it is one of :mod:`probfsl.models`
    (or :data:`OTHER_ESTIMATORS`); ``ValueError`` otherwise. The check reads the class
    (its module and its estimator surface), not the registry, so that a saved file cannot
    make the loader import or build anything else."""
    module, _, name = target.partition(":")
    module = current_module(module)
    target = f"{module}:{name}"
    if (
        not (module.startswith("probfsl.models.") or target in OTHER_ESTIMATORS)
        or not name.isidentifier()
    ):
        raise ValueError(f"{target!r} is not an estimator of probfsl.models")
    cls = getattr(import_module(module), name, None)
    if (
        not isinstance(cls, type)
        or inspect.isabstract(cls)
        or not all(callable(getattr(cls, a, None)) for a in ESTIMATOR_SURFACE)
    ):
        raise ValueError(f"{target!r} is not an estimator of probfsl.models")
    return cls


def declared_schema(cls: type) -> EstimatorSchema | None:
    """The declaration of ``cls`` (its class attribute ``schema``), if it has one."""
    schema = getattr(cls, "schema", None)
    return schema if isinstance(schema, EstimatorSchema) else None


def check_saved_estimator(cls: type, params: Any, state: Any, where: str) -> dict:
    """The (encoded) hyperparameters and fitted state of an estimator of class ``cls``,
    checked against its declaration before anything is decoded or computed; returns the
    hyperparameters with their dtypes decoded. ``ValueError`` naming ``where``."""
    schema = declared_schema(cls)
    if schema is None:
        raise ValueError(f"{where}: {cls.__name__} declares no schema and cannot be loaded")
    if not isinstance(params, dict) or not isinstance(state, dict):
        raise ValueError(f"{where}: 'params' and 'state' must be dicts")
    accepted = set(schema.params)
    for key in params:
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ValueError(f"{where}: {key!r} is not a hyperparameter name")
        if callable(getattr(cls, key, None)) or key not in accepted:
            raise ValueError(f"{where}: {key!r} is not a hyperparameter of {cls.__name__}")
    for key in state:
        if not (isinstance(key, str) and key.isidentifier() and key.endswith("_")):
            raise ValueError(f"{where}: {key!r} is not a fitted attribute name")
        if key.startswith("_") or callable(getattr(cls, key, None)):
            raise ValueError(f"{where}: fitted attribute {key!r} would hide a method")
    # the declared form, on the encoded content: nothing is built or computed before
    decoded = schema.check_saved_params(params, where, cls.__name__)
    schema.check_state(state, where, cls.__name__)
    return decoded


def check_nested(value: Any, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``value`` is an encoded estimator (as
    :func:`probfsl.estimator_io.encode` writes one) of a saveable class whose
    hyperparameters and fitted state have the form its declaration gives (used by
    :class:`Nested`)."""
    keys = {TAG, "class", "params", "state"}
    if not isinstance(value, dict) or set(value) != keys:
        raise ValueError(f"{where}: not a saved estimator (keys {sorted(keys - {TAG})})")
    if not isinstance(value["class"], str):
        raise ValueError(f"{where}: the estimator's class should be a string")
    try:
        cls = saveable_class(value["class"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    check_saved_estimator(cls, value["params"], value["state"], where)
