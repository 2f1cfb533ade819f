"""Input validation shared by every public entry point.

One set of checks, called before any computation: a wrong Python type is a
``TypeError``, a wrong shape, dtype, value or size is a ``ValueError``; every message
names the argument and the problem. This module sits below every other layer
(it imports only NumPy and torch), so data loaders, estimators, engines and the
command line all use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

#: floating dtypes the engines compute in (float16/bfloat16 lose the precision the
#: closed forms need: their log-normalisers and Gram matrices overflow or cancel)
FLOAT_DTYPES = (torch.float32, torch.float64)


def as_float_tensor(x: Any, name: str, ndim: int | None = None) -> torch.Tensor:
    """``x`` (a tensor or NumPy array) as a float32/float64 tensor, checked.

    ``TypeError`` for another type or a non-float dtype (integers, float16, complex);
    ``ValueError`` for the wrong number of dimensions, an empty array, NaN or inf.
    NumPy arrays keep their dtype (float64 stays float64); nothing is copied when
    ``x`` is already a valid tensor.
    """
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(
                f"{name} must hold floating-point values (float32 or float64), "
                f"got a NumPy array of {x.dtype}; convert it with .astype('float32')"
            )
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32 or float64, got {x.dtype}; convert it with .float() "
            "(or .double())"
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    check_finite(x, name)
    return x


def as_user_array(x: Any, name: str, features: bool = True) -> Any:
    """User input as the engines' input, converted where no information is lost, as
    scikit-learn's input checks do: a pandas DataFrame or Series becomes its values (a
    DataFrame of one column holding arrays becomes their stack), and a NumPy array of
    float16, bool or integers becomes float32 (float64 for integers beyond 2**24, which
    float32 cannot hold exactly); with ``features=False`` (labels) only the pandas
    conversion applies. Tensors and float32/float64 arrays pass unchanged; the engines'
    own checks (:func:`as_float_tensor`) then apply."""
    if hasattr(x, "to_numpy") and not isinstance(x, (np.ndarray, torch.Tensor)):
        columns = getattr(x, "columns", None)
        if columns is not None and len(columns) == 1 and x.dtypes.iloc[0].kind == "O":
            try:
                x = np.stack([np.asarray(v) for v in x.iloc[:, 0]])
            except ValueError as err:
                raise ValueError(f"{name}: the column's arrays differ in shape ({err})") from None
        else:
            x = x.to_numpy()
    if features and isinstance(x, np.ndarray) and x.dtype.kind in "biuf":
        if x.dtype == np.float16 or x.dtype.kind == "b":
            return x.astype(np.float32)
        if x.dtype.kind in "iu":
            big = x.size and np.abs(x.astype(np.float64)).max() > 2**24
            return x.astype(np.float64 if big else np.float32)
    return x


def as_label_array(y: Any, name: str, n: int | None = None) -> np.ndarray:
    """Integer class labels ``y`` (array, tensor or sequence) as an ``int64`` NumPy array.

    Integers of any width are accepted; floats only when every value is a whole number
    (``1.0`` is class 1, ``0.5`` is a ``ValueError``, never truncated). ``TypeError``
    for strings, booleans, objects or another container type; ``ValueError`` for a
    first dimension other than ``n``.
    """
    if isinstance(y, torch.Tensor):
        y = y.detach().cpu().numpy()
    elif isinstance(y, (list, tuple)):
        y = np.asarray(y)
    if not isinstance(y, np.ndarray):
        raise TypeError(
            f"{name} must be an array or tensor of integer class labels, got {type(y).__name__}"
        )
    if y.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold integer class labels, got values of type {y.dtype}")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all():
            raise ValueError(f"{name} contains NaN or inf")
        if not (y == np.round(y)).all():
            raise ValueError(
                f"{name} must hold whole-number class labels, got fractional values "
                f"such as {y[y != np.round(y)].flat[0]!r}"
            )
    if n is not None and (y.ndim == 0 or y.shape[0] != n):
        raise ValueError(f"{name} must have {n} entries (one per row), got shape {y.shape}")
    return y.astype(np.int64)


def as_label_tensor(
    y: Any, name: str, n: int | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Integer class labels ``y`` as a ``torch.long`` tensor on ``device`` (the tensor's
    own device when ``None``).

    Accepts tensors, NumPy arrays and sequences of integers of any width; float values
    are accepted only when they are whole numbers. ``TypeError`` for strings, booleans
    or other types; ``ValueError`` for fractional values or a length other than ``n``
    (first dimension).
    """
    if not isinstance(y, torch.Tensor):
        return torch.from_numpy(as_label_array(y, name, n)).to(device)
    if y.dtype == torch.bool or y.is_complex():
        raise TypeError(f"{name} must hold integer class labels, got {y.dtype}")
    if y.is_floating_point():
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{name} contains NaN or inf")
        if not bool((y == y.round()).all()):
            raise ValueError(f"{name} must hold whole-number class labels, got fractional values")
    if n is not None and (y.ndim == 0 or y.shape[0] != n):
        raise ValueError(f"{name} must have {n} entries (one per row), got shape {tuple(y.shape)}")
    return y.to(device=device, dtype=torch.long)


def as_index_array(x: Any, name: str, n_rows: int, ndim: int | None = None) -> np.ndarray:
    """Row indices ``x`` into a table of ``n_rows`` rows as an ``int64`` NumPy array.

    Integer arrays of any width (int16 and int32 task files included) are cast to int64;
    ``TypeError`` for float, boolean or string indices or another container type;
    ``ValueError`` for the wrong number of dimensions, no entries, or an index outside
    ``0..n_rows-1``.
    """
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    elif isinstance(x, (list, tuple)):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row indices, got values of type {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name} is empty (shape {x.shape})")
    if x.min() < 0 or x.max() >= n_rows:
        raise ValueError(
            f"{name} must hold row indices in 0..{n_rows - 1}, got values in {x.min()}..{x.max()}"
        )
    return x.astype(np.int64)


def check_float_dtype(name: str, dtype: Any) -> torch.dtype:
    """``dtype`` if it is ``torch.float32`` or ``torch.float64``; ``TypeError`` otherwise."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be torch.float32 or torch.float64, got {dtype!r}")
    return dtype


def check_finite(x: torch.Tensor, name: str) -> None:
    """``ValueError`` when ``x`` holds NaN or inf (one reduction in the common case:
    a finite sum proves every entry finite; only an overflowing sum looks closer)."""
    if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf")


def check_hyperparameter(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    nonnegative: bool = False,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    optional: bool = False,
) -> Any:
    """``value`` of hyperparameter (or count) ``name`` if it is a finite real number in range.

    ``TypeError`` for a non-number (strings such as ``"abc"``, booleans, ``None`` unless
    ``optional``, tensors); ``ValueError`` for NaN/inf, a fractional value where an
    ``integer`` is required, or a value outside the stated range. Returns ``value``
    (as an ``int`` when ``integer``: ``5.0`` is accepted as ``5``, ``2.5`` is not).
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        what = "an integer" if integer else "a real number"
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if integer:
        if value != int(value):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        value = int(value)
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be non-negative, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}, got {value!r}")
    return value


def check_count(name: str, value: Any, low: int = 1) -> int:
    """An integer count such as ``way``, ``shot``, ``n_query`` or ``n_tasks``, at least ``low``."""
    return check_hyperparameter(name, value, integer=True, low=low)


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a ``bool`` if it is one (Python or NumPy); ``TypeError`` otherwise
    (so that ``center="no"`` is not silently true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_temperature(value: Any, name: str = "temperature") -> float:
    """A softmax (inverse) temperature: finite and positive (a negative one would invert
    the ranking silently, NaN would make every probability NaN)."""
    return check_hyperparameter(name, value, positive=True)


def check_choice(name: str, value: Any, choices: Sequence) -> Any:
    """``value`` if it is one of ``choices``; ``ValueError`` listing them otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_task_tensors(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    way: int,
    partial_support: bool = False,
) -> None:
    """``TypeError``/``ValueError`` unless ``support`` [T, n, D], ``support_labels``
    [T, n] (integers in 0..way-1, every class at least once per task) and ``query``
    [T, Q, D] form a consistent batch of at least 2-way tasks on one device and dtype.

    ``partial_support=True`` (transductive models that can also run zero-shot) allows
    an empty support and classes without a support sample."""
    for name, x in (("support", support), ("query", query), ("support_labels", support_labels)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("support", support), ("query", query)):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
        if x.ndim != 3:
            raise ValueError(f"{name} must be [T, n, D], got shape {tuple(x.shape)}")
    if support.dtype != query.dtype:
        raise TypeError(f"support ({support.dtype}) and query ({query.dtype}) differ in dtype")
    if support.device != query.device or support_labels.device != support.device:
        raise ValueError(
            f"support ({support.device}), support_labels ({support_labels.device}) and "
            f"query ({query.device}) must be on one device"
        )
    if support.shape[0] != query.shape[0] or support.shape[2] != query.shape[2]:
        raise ValueError(
            f"support {tuple(support.shape)} and query {tuple(query.shape)} disagree "
            "in tasks or width"
        )
    if query.shape[0] == 0 or query.shape[2] == 0:
        raise ValueError(f"support has no tasks or no features (shape {tuple(support.shape)})")
    if support.shape[1] == 0 and not partial_support:
        raise ValueError("support is empty: every task needs at least one support sample")
    if query.shape[1] == 0:
        raise ValueError("query is empty: every task needs at least one query")
    if support_labels.shape != support.shape[:2]:
        raise ValueError(
            f"support_labels must be [T, n_support]={tuple(support.shape[:2])}, "
            f"got {tuple(support_labels.shape)}"
        )
    if support_labels.is_floating_point() or support_labels.dtype == torch.bool:
        raise TypeError(f"support_labels must be an integer tensor, got {support_labels.dtype}")
    if way < 2:
        raise ValueError(f"tasks must have at least 2 classes (way >= 2), got way={way}")
    if support_labels.numel() and (
        bool(support_labels.min() < 0) or bool(support_labels.max() >= way)
    ):
        raise ValueError(f"support_labels must lie in 0..{way - 1}")
    if partial_support:
        check_finite(query, "query")
        if support.numel():
            check_finite(support, "support")
        return
    counts = torch.zeros(support.shape[0], way, dtype=torch.long, device=support_labels.device)
    counts.scatter_add_(1, support_labels.long(), torch.ones_like(support_labels, dtype=torch.long))
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero()[0].tolist()
        raise ValueError(
            f"every class needs at least one support sample; task {empty[0]} has none "
            f"for class {empty[1]}"
        )
    check_finite(support, "support")
    check_finite(query, "query")


def check_base(
    features: Any, labels: Any, min_classes: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Base ``features`` [N, D] (float32/float64, finite; tensor, NumPy array or pandas
    DataFrame) and integer ``labels`` [N] with at least ``min_classes`` classes, as tensors.

    ``TypeError``/``ValueError`` otherwise. Returns ``(features, labels)``: the features
    as given when already a valid tensor, the labels as ``torch.long`` on their device.
    """
    if features is None:
        raise TypeError("base features must be a tensor or array, got None")
    # pandas in (a DataFrame's values); the dtype contract stays strict here
    features = as_user_array(features, "base features", features=False)
    labels = as_user_array(labels, "base labels", features=False)
    features = as_float_tensor(features, "base features", ndim=2)
    labels = as_label_tensor(labels, "base labels", n=features.shape[0], device=features.device)
    if labels.ndim != 1:
        raise ValueError(f"base labels must be 1-D [N], got shape {tuple(labels.shape)}")
    n_classes = labels.unique().numel()
    if n_classes < min_classes:
        raise ValueError(f"base features need at least {min_classes} classes, got {n_classes}")
    return features, labels


def check_episodes(episodes: Any, dim: int | None = None) -> None:
    """``TypeError``/``ValueError`` unless a batch of episodes is consistent (see
    :func:`check_task_tensors`) and, when ``dim`` is given, as wide as the base
    features a method was fitted on."""
    for field in ("support", "support_labels", "query", "classes"):
        if not hasattr(episodes, field):
            raise TypeError(f"episodes must be an Episodes batch, got {type(episodes).__name__}")
    check_task_tensors(episodes.support, episodes.support_labels, episodes.query, episodes.way)
    if dim is not None and episodes.support.shape[2] != dim:
        raise ValueError(
            f"episodes have feature width {episodes.support.shape[2]} but the base features "
            f"have width {dim}"
        )


def as_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a :class:`torch.device` (``None``: the CPU); ``ValueError`` for a
    string that names no device. Whether this machine has it is for torch to say."""
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"device {device!r} is not a device; use cpu, cuda, cuda:N or mps"
        ) from None
