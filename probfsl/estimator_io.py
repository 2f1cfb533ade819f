"""Saving and loading fitted estimators in a safe format (no pickle of arbitrary objects).

A file holds ``{"class": "module:Class", "params": ..., "state": ...}`` written by
``torch.save`` (atomically, :func:`probfsl.fileio.atomic_path`) and read back by
``torch.load(path, weights_only=True)``, which only rebuilds tensors, numbers, strings
and containers. Values are encoded into that vocabulary:

* tensors, ``None``, ``bool``, ``int``, ``float``, ``str``, lists, tuples and dicts with
  string keys as themselves (tuple subclasses such as ``torch.linalg.eigh``'s result
  become plain tuples);
* NumPy arrays, ``torch.dtype`` and dataclass instances of a ``probfsl`` module as
  tagged dicts; a dataclass is rebuilt only if its class is a dataclass of ``probfsl``;
* a saveable estimator held by another (the estimator that
  :class:`probfsl.tuning.AutoPreset` chose) as a tagged dict of its class,
  hyperparameters and fitted state, checked and rebuilt as a file's content is.

Anything else is a ``TypeError`` naming the attribute. Loading refuses a file whose
class is not an estimator defined in :mod:`probfsl.models` or
:class:`probfsl.tuning.AutoPreset` (a class with the estimator surface of
:class:`probfsl.models.base.FewShotClassifier`), so a file cannot make the loader import
or build anything else. The check (:func:`probfsl.schema.saveable_class`) reads the
class, not the registry, so this module imports nothing above it.

A file is checked, not trusted. It carries its format version and a SHA-256 checksum of
its content (class, hyperparameters and every tensor's dtype, shape and bytes); the
checksum catches damage, not a deliberate forger, who can recompute it. So the content
is also checked against the declaration of its class (the class attribute ``schema``, a
:class:`probfsl.schema.EstimatorSchema`), before anything is decoded or computed. Loading
refuses with a ``ValueError`` that names the file, and the attribute or hyperparameter
with the form it should have: a file that cannot be read (empty, truncated, not a torch
file, or holding objects ``weights_only`` refuses), an unknown format, missing or extra
keys, a checksum that does not match, a class that is not a saveable estimator (or not
the one asked for), hyperparameters the class does not take, that are missing, or of
the wrong type or range (:meth:`~probfsl.models.base.Hyperparameters.check_params`'s
rules, from the same declaration), fitted attributes the class does not declare or that
are missing from their group, and any fitted tensor of the wrong dtype (int64,
complex64, float16, ...), rank or shape (the named dimensions, e.g. the width D of the
base features, agreeing across attributes), with NaN or infinite values, or out of its
declared range (e.g. a base mean of magnitude above 1e15). Saving checks the state
against the same declaration, so a file that would be refused is never written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import zipfile
from importlib import import_module
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probfsl.fileio import atomic_path
from probfsl.schema import (
    ESTIMATOR_SURFACE,
    check_saved_estimator,
    current_module,
    declared_schema,
    saveable_class,
)
from probfsl.schema import TAG as _TAG

FORMAT = 2
KEYS = frozenset({"format", "class", "params", "state", "checksum"})


def encode(value: Any, name: str) -> Any:
    """``value`` in the vocabulary of ``torch.load(weights_only=True)``; ``TypeError``
    naming ``name`` (the attribute path) for anything that cannot be saved safely."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"cannot save {name}: NumPy array of {value.dtype}")
        return {_TAG: "ndarray", "value": torch.from_numpy(np.ascontiguousarray(value))}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "value": str(value).removeprefix("torch.")}
    if _is_estimator(value):
        return _encode_estimator(value, name)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if not cls.__module__.startswith("probfsl."):
            raise TypeError(f"cannot save {name}: {cls.__module__}.{cls.__qualname__}")
        fields = {
            f.name: encode(getattr(value, f.name), f"{name}.{f.name}")
            for f in dataclasses.fields(value)
        }
        return {_TAG: "dataclass", "class": f"{cls.__module__}:{cls.__qualname__}", **fields}
    if isinstance(value, (list, tuple)):
        items = [encode(v, f"{name}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        if not all(isinstance(k, str) and k != _TAG for k in value):
            raise TypeError(f"cannot save {name}: a dict with non-string keys")
        return {k: encode(v, f"{name}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"cannot save {name}: a {type(value).__module__}.{type(value).__qualname__}")


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in value.items()}
    if tag == "ndarray":
        return value["value"].numpy()
    if tag == "dtype":
        dtype = getattr(torch, value["value"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value['value']!r} in the file")
        return dtype
    if tag == "estimator":
        return _build(saveable_class(value["class"]), value["params"], value["state"], "")
    if tag == "dataclass":
        module, _, qualname = value["class"].partition(":")
        if not module.startswith("probfsl."):
            raise ValueError(f"refusing to rebuild {value['class']!r}: not a probfsl class")
        cls = getattr(import_module(current_module(module)), qualname, None)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"{value['class']!r} is not a probfsl dataclass")
        fields = {k: decode(v) for k, v in value.items() if k not in (_TAG, "class")}
        return cls(**fields)
    raise ValueError(f"unknown tag {tag!r} in the file")


def _is_estimator(value: Any) -> bool:
    """Whether ``value`` is an estimator instance (it has the estimator surface)."""
    return not isinstance(value, type) and all(
        callable(getattr(value, a, None)) for a in ESTIMATOR_SURFACE
    )


def _target(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _encode_estimator(estimator: Any, name: str) -> dict:
    """A saveable estimator held in a state as a tagged dict; ``TypeError`` otherwise."""
    cls = type(estimator)
    try:
        saveable_class(_target(cls))
    except ValueError:
        raise TypeError(
            f"cannot save {name}: a {cls.__name__} is not a saveable estimator"
        ) from None
    if declared_schema(cls) is None:
        raise TypeError(f"cannot save {name}: {cls.__name__} declares no schema")
    return {
        _TAG: "estimator",
        "class": _target(cls),
        "params": encode(estimator.get_params(), f"{name}.params"),
        "state": {k: encode(v, f"{name}.{k}") for k, v in estimator.fitted_state().items()},
    }


def checksum(payload: dict) -> str:
    """SHA-256 of a payload's class, hyperparameters and fitted state (tensors by dtype,
    shape and bytes; containers in key order)."""
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            h.update(b"{")
            for k in sorted(value):
                h.update(repr(k).encode())
                feed(value[k])
            h.update(b"}")
        elif isinstance(value, (list, tuple)):
            h.update(b"[" if isinstance(value, list) else b"(")
            for v in value:
                feed(v)
            h.update(b"]")
        else:
            h.update(f"{type(value).__name__}:{value!r}".encode())

    feed({k: payload[k] for k in ("format", "class", "params", "state")})
    return h.hexdigest()


def save_estimator(estimator: Any, path: str | Path) -> None:
    """Write ``estimator``'s class, hyperparameters and fitted state to ``path``, with the
    format version and a checksum."""
    cls = type(estimator)
    target = f"{cls.__module__}:{cls.__qualname__}"
    try:
        saveable_class(target)
    except ValueError:
        raise TypeError(
            f"cannot save a {cls.__name__}: only the estimators of probfsl.models can be saved"
        ) from None
    schema = declared_schema(cls)
    if schema is None:
        raise TypeError(f"cannot save a {cls.__name__}: it declares no schema")
    payload = {
        "format": FORMAT,
        "class": target,
        "params": encode(estimator.get_params(), "params"),
        "state": {k: encode(v, k) for k, v in estimator.fitted_state().items()},
    }
    schema.check_state(
        payload["state"], f"cannot save {cls.__name__} to {str(path)!r}", cls.__name__
    )
    payload["checksum"] = checksum(payload)
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def _read(path: Path) -> dict:
    """The payload of ``path`` (``torch.load(weights_only=True)``); ``ValueError`` naming
    the file for anything that cannot be read as one."""
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: no such file")
    if path.stat().st_size == 0:
        raise ValueError(f"{str(path)!r}: the file is empty")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        raise ValueError(
            f"{str(path)!r}: not a readable probfsl estimator file (not a torch archive: "
            "truncated or damaged, or another format)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"{str(path)!r}: the file holds objects that are not tensors or plain values; "
            "it was not written by probfsl and is refused"
        ) from None
    except (EOFError, OSError, RuntimeError, zipfile.BadZipFile, ValueError) as err:
        reason = " ".join(str(err).split()[:12]) or type(err).__name__
        raise ValueError(
            f"{str(path)!r}: not a readable probfsl estimator file (truncated or damaged: {reason})"
        ) from None
    if not isinstance(payload, dict):
        raise ValueError(f"{str(path)!r} is not a probfsl estimator file")
    return payload


def _check_payload(payload: dict, path: Path) -> None:
    """Format, keys and checksum of a payload; ``ValueError`` naming ``path``."""
    name = repr(str(path))
    if payload.get("format") != FORMAT:
        raise ValueError(
            f"{name} is not a probfsl estimator file of format {FORMAT} "
            f"(format {payload.get('format')!r}); save the estimator again"
        )
    missing, extra = sorted(KEYS - set(payload)), sorted(set(payload) - KEYS)
    if missing or extra:
        raise ValueError(f"{name}: missing keys {missing}, unexpected keys {extra}")
    if not isinstance(payload["params"], dict) or not isinstance(payload["state"], dict):
        raise ValueError(f"{name}: 'params' and 'state' must be dicts")
    if payload["checksum"] != checksum(payload):
        raise ValueError(f"{name}: the checksum does not match: the file was changed or damaged")


def load_estimator(path: str | Path, expected: type | None = None) -> Any:
    """The estimator saved at ``path``, checked (see the module docstring); ``ValueError``
    naming the file and the problem otherwise, or when it is not an ``expected``."""
    path = Path(path)
    payload = _read(path)
    _check_payload(payload, path)
    where = repr(str(path))
    try:
        cls = saveable_class(payload["class"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if expected is not None and not issubclass(cls, expected):
        raise ValueError(f"{where} holds a {cls.__name__}, not a {expected.__name__}")
    return _build(cls, payload["params"], payload["state"], where)


def _build(cls: type, params: Any, state: Any, where: str) -> Any:
    """An estimator of class ``cls`` from its encoded hyperparameters and fitted state,
    checked first (:func:`~probfsl.schema.check_saved_estimator`; again, cheaply, for an
    estimator nested in a state that was checked as a whole)."""
    params = check_saved_estimator(cls, params, state, where or cls.__name__)
    state = decode(state)
    try:
        estimator = cls(**params)
        estimator.check_params()  # rules that tie hyperparameters together
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where or cls.__name__}: invalid hyperparameters: {err}") from None
    estimator.restore_fitted_state(state)
    return estimator
