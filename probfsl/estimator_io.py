"""Saving and loading fitted estimators in a safe format (no pickle of arbitrary objects).

A file holds ``{"class": "module:Class", "params": ..., "state": ...}`` written by
``torch.save`` (atomically, :func:`probfsl.fileio.atomic_path`) and read back by
``torch.load(path, weights_only=True)``, which only rebuilds tensors, numbers, strings
and containers. Values are encoded into that vocabulary:

* tensors, ``None``, ``bool``, ``int``, ``float``, ``str``, lists, tuples and dicts with
  string keys as themselves (tuple subclasses such as ``torch.linalg.eigh``'s result
  become plain tuples);
* NumPy arrays, ``torch.dtype`` and dataclass instances of a ``probfsl`` module as
  tagged dicts; a dataclass is rebuilt only if its class is a dataclass of ``probfsl``.

Anything else is a ``TypeError`` naming the attribute. Loading refuses a file whose
class is not an estimator defined in :mod:`probfsl.models` (a class with the estimator
surface of :class:`probfsl.models.base.FewShotClassifier`), so a file cannot make the
loader import or build anything else. The check reads the class, not the registry, so
this module imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib import import_module
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probfsl.fileio import atomic_path

_TAG = "__probfsl__"
FORMAT = 1


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
    if tag == "dataclass":
        module, _, qualname = value["class"].partition(":")
        if not module.startswith("probfsl."):
            raise ValueError(f"refusing to rebuild {value['class']!r}: not a probfsl class")
        cls = getattr(import_module(module), qualname, None)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"{value['class']!r} is not a probfsl dataclass")
        fields = {k: decode(v) for k, v in value.items() if k not in (_TAG, "class")}
        return cls(**fields)
    raise ValueError(f"unknown tag {tag!r} in the file")


#: what makes a class an estimator (the surface of probfsl.models.base.FewShotClassifier)
_ESTIMATOR_SURFACE = ("get_params", "fitted_state", "fit_base", "predict_proba")


def _registered(target: str) -> type:
    """The estimator class named ``"module:Class"``, if it is one of :mod:`probfsl.models`."""
    module, _, name = target.partition(":")
    if not module.startswith("probfsl.models.") or not name.isidentifier():
        raise ValueError(f"{target!r} is not an estimator of probfsl.models")
    cls = getattr(import_module(module), name, None)
    if (
        not isinstance(cls, type)
        or inspect.isabstract(cls)
        or not all(callable(getattr(cls, a, None)) for a in _ESTIMATOR_SURFACE)
    ):
        raise ValueError(f"{target!r} is not an estimator of probfsl.models")
    return cls


def save_estimator(estimator: Any, path: str | Path) -> None:
    """Write ``estimator``'s class, hyperparameters and fitted state to ``path``."""
    cls = type(estimator)
    target = f"{cls.__module__}:{cls.__qualname__}"
    try:
        _registered(target)
    except ValueError:
        raise TypeError(
            f"cannot save a {cls.__name__}: only the estimators of probfsl.models can be saved"
        ) from None
    payload = {
        "format": FORMAT,
        "class": target,
        "params": encode(estimator.get_params(), "params"),
        "state": {k: encode(v, k) for k, v in estimator.fitted_state().items()},
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_estimator(path: str | Path, expected: type | None = None) -> Any:
    """The estimator saved at ``path`` (``torch.load(weights_only=True)``); ``ValueError``
    for a file of another format or class, or not an instance of ``expected``."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a probfsl estimator file")
    cls = _registered(payload["class"])
    if expected is not None and not issubclass(cls, expected):
        raise ValueError(f"{str(path)!r} holds a {cls.__name__}, not a {expected.__name__}")
    params = decode(payload["params"])
    accepted = inspect.signature(cls.__init__).parameters
    estimator = cls(**{k: v for k, v in params.items() if k in accepted})
    for k, v in params.items():  # public attributes that are not __init__ arguments
        setattr(estimator, k, v)
    estimator.restore_fitted_state({k: decode(v) for k, v in payload["state"].items()})
    return estimator
