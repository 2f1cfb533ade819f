"""What VMP accepts: the refusals of docs/design/vmp.md §5 (the families it knows are
:mod:`~probfsl.inference.vmp.families`).

Every refusal is a ``ValueError`` raised before any sweep that starts with the reason in
one sentence, naming the site, its distribution and the offending parent, and then points
to the list of supported forms (:data:`DOCS`; :data:`probfsl.inference.vmp.supported.SUPPORTED`
holds the same list in words, formed from the family records).
"""

from __future__ import annotations

import contextlib
from collections.abc import Set

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.inference.vmp.family import lookup, of_distribution

#: where the supported forms are listed (the pointer every refusal ends with)
DOCS = "docs/modelling.md#supported-forms"


def data_device(args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """The data's device (that of the first tensor argument) as the default device while the
    model runs (``init`` only): Pyro's plates and torch's samplers create tensors without
    ``device=``, and they must land with the data. A no-op without tensor arguments, and
    for data on the CPU where no other default device is set (the context intercepts
    every torch call: a third of a small model's derivation on the CPU)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.device.type == "cpu" and not _device_mode_set():
                break
            return torch.device(a.device)
    return contextlib.nullcontext()


def _device_mode_set() -> bool:
    """Whether a default device other than torch's own CPU default is in force (a
    ``torch.device`` context, ``torch.set_default_device``). Read off torch's mode stack:
    ``torch.get_default_device`` creates a tensor on the device it reports. True where
    that stack cannot be read."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:
        return True
    return any(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack())


def data_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of the first floating tensor argument: the model's working dtype, which
    parameters written with Python numbers (float32 tensors in Pyro) are taken in. ``None``
    where the data are all discrete (the parameters' dtype is used)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return None


def close(got: torch.Tensor, expect: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """``torch.allclose(got, expect, rtol, atol)``: |got − expect| ≤ atol + rtol |expect|
    everywhere (equal infinities are close, NaN never is). The compiler's checks run once
    on model-sized tensors, here a block of leading rows at a time with two temporaries
    updated in place: ``torch.allclose`` on the whole took three to five times as long on
    the CPU, most of it in first touches of fresh memory. Finite values equal bit for
    bit (a copy, the common case) are settled by ``torch.equal`` (which calls a tensor
    equal to itself, NaN included, hence the finiteness test), and values within half of
    ``rtol`` of each other relative by their quotients (:func:`_ratios_within`: a
    precision c · τ recomputed from the model's scale), in about a fifth of the time."""
    got, expect = torch.broadcast_tensors(got, expect)
    if torch.equal(got, expect) and bool(all_finite(got)):
        return True
    if got.dim() == 0:
        got, expect = got.reshape(1), expect.reshape(1)
    rows = max(1, (1 << 16) // max(1, got[:1].numel()))
    if rtol > 0 and expect.is_floating_point():
        if bool(_ratios_within(got, expect, rtol / 2, rows)):
            return True
    for i in range(0, got.shape[0], rows):
        g, e = got[i : i + rows], expect[i : i + rows]
        gap = torch.sub(g, e).abs_()
        # an infinite expectation is close to itself alone (the ``g == e`` below)
        bound = e.abs().mul_(rtol).add_(atol).nan_to_num_(nan=-1.0, posinf=-1.0)
        if not bool(gap.le_(bound).logical_or_(g == e).all()):
            return False
    return True


def _ratios_within(got: torch.Tensor, expect: torch.Tensor, rtol: float, rows: int) -> torch.Tensor:
    """A 0-d bool tensor: |got / expect − 1| ≤ ``rtol`` everywhere, so |got − expect| ≤
    rtol |expect| (a sufficient test for :func:`close` at twice ``rtol``, whatever the
    quotient's rounding; a zero, infinite or NaN value fails it, and :func:`close` then
    decides). The quotients of ``rows`` leading rows at a time go to one buffer, whose
    extremes are kept."""
    dtype = torch.result_type(got, expect)
    buffer = torch.empty_like(got[:rows], dtype=dtype, memory_format=torch.contiguous_format)
    ends = []
    for i in range(0, got.shape[0], rows):
        g = got[i : i + rows]
        quotient = torch.div(g, expect[i : i + rows], out=buffer[: len(g)])
        ends.extend(torch.aminmax(quotient))
    low, high = torch.stack(ends).view(-1, 2).unbind(-1)
    return (low >= 1 - rtol).all() & (high <= 1 + rtol).all()


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor (no host sync): every value of the floating ``tensors`` (None
    skipped) is finite. Read off their extremes (``torch.aminmax`` propagates NaN), a
    tenth of the time of ``isfinite`` on model-sized data, which writes a mask."""
    ends = [m for t in tensors if t is not None and t.numel() for m in torch.aminmax(t)]
    return torch.isfinite(torch.stack(ends)).all()


def check_parameters(sites: list[dict], where: str = "", checked: Set = frozenset()) -> list:
    """``ValueError`` naming the site and the parameter when a distribution's parameter
    is outside its constraint (a negative scale, a concentration of 0, ...), ``where``
    added to the reason; one host synchronisation when every parameter is valid.

    Not checked again: a parameter whose key (:func:`tensor_key`) is in ``checked`` (the
    same memory as a parameter an earlier check passed, whose tensor the caller keeps
    alive), and one that its distribution validated when it was built (torch's
    ``validate_args``) under a constraint other than real or positive (those two are
    cheap, and only here must their values also be finite): a positive definite
    covariance of a thousand tasks costs a Cholesky factorisation per check. Returns the
    parameters that passed (to be kept alive while their keys are a later ``checked``)."""
    checks, passed = [], []
    for s in sites:
        base, _ = unwrap(s["fn"])
        for name, constraint in getattr(base, "arg_constraints", {}).items():
            value = base.__dict__.get(name)  # the parameters given, not derived ones
            if value is None and isinstance(base, dist.Beta):  # held by its Dirichlet
                value = getattr(base, name)
            if not torch.is_tensor(value) or tensor_key(value) in checked:
                continue
            passed.append(value)
            if getattr(base, "_validate_args", False) and not _cheap(constraint):
                continue
            checks.append((s["name"], type(base).__name__, name, constraint, value))
    if checks and not bool(torch.stack([_holds(c, v) for *_, c, v in checks]).all()):
        for site, fname, name, constraint, value in checks:
            if not bool(constraint.check(value).all()):
                reason = f"its parameter {name} is outside {constraint}{where}"
                raise refuse(site, fname, "-", reason)
            if _cheap(constraint) and not bool(_holds(constraint, value)):
                raise refuse(site, fname, "-", f"its parameter {name} holds infinite values")
    return passed


def tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's values while it lives: its memory, view and version (a
    view of the same memory, such as a distribution's ``expand`` of the user's tensor, has
    the key of the same values; an in-place change bumps the version). Once the tensor is
    freed, another may reuse its memory: keep it alive while its key is compared."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version


def _cheap(constraint) -> bool:
    """Whether ``constraint`` is real or positive (possibly made independent): the
    constraints :func:`_holds` reads off a parameter's extremes."""
    while isinstance(constraint, constraints.independent):
        constraint = constraint.base_constraint
    return constraint is constraints.real or constraint is constraints.positive


def _holds(constraint, value: torch.Tensor) -> torch.Tensor:
    """``constraint.check(value).all()`` as a 0-d bool tensor, where a real or positive
    parameter must also be finite (read off its extremes, ``torch.aminmax``, without
    writing a mask of the parameter's size; NaN propagates to them). A simplex's rows
    are summed by a product with ones (torch's reduction over a short last axis takes
    ten times as long; the test is the same to the rounding of those sums)."""
    base = constraint
    while isinstance(base, constraints.independent):
        base = base.base_constraint
    if value.is_floating_point() and value.numel():
        if base is constraints.real:
            low, high = torch.aminmax(value)
            return low.isfinite() & high.isfinite()
        if base is constraints.positive:
            low, high = torch.aminmax(value)
            return (low > 0) & high.isfinite()
        if base is constraints.simplex:  # torch's test, its row sums as a product
            sums = value @ value.new_ones(value.shape[-1])
            return (value.amin() >= 0) & ((sums - 1).abs() < 1e-6).all()
    return constraint.check(value).all()


def check_data(args: tuple, kwargs: dict) -> None:
    """``ValueError`` before any tracing: tensor arguments with no task (a leading axis of
    size 0) or no entries."""
    tensors = [(i, a) for i, a in enumerate((*args, *kwargs.values())) if torch.is_tensor(a)]
    for i, a in tensors:
        if a.dim() > 0 and a.shape[0] == 0:
            raise ValueError(f"VMP needs at least one task: argument {i} has 0 rows")
        if a.numel() == 0:
            raise ValueError(f"VMP needs data: argument {i} has shape {tuple(a.shape)}")


def simplex_tolerance(dtype: torch.dtype, n: int) -> float:
    """How far a row of ``n`` probabilities in ``dtype`` may sum from 1: 1e-4, what
    probfsl's estimators accept of probability vectors, or 16 n ε of the dtype where that
    is larger (the rounding of normalising a long float32 row)."""
    return max(1e-4, 16 * n * torch.finfo(dtype).eps)


def support_holds(family: str, value: torch.Tensor) -> torch.Tensor | None:
    """A 0-d bool tensor (no host sync): the observed ``value`` (canonical layout) of a
    ``family`` site lies in its support (:meth:`~probfsl.inference.vmp.family.Family.support`:
    a Gamma's > 0, a Beta's in (0, 1), a Dirichlet's rows positive and summing to 1).
    ``None`` for a family checked elsewhere (counts and labels) or with no bound."""
    if not value.numel():
        return None
    return lookup(family).support(value)


def support_refusal(site: str, fn: str, family: str, value: torch.Tensor, dims: tuple):
    """The refusal of data outside their support (:func:`support_holds` false), naming
    the first offending entry (or row, of a Dirichlet) by its axes ``dims``; ``None``
    where the data are in their support."""
    record = lookup(family)
    own = record.refusal(site, fn, value, dims)
    if own is not None:
        return own
    found = record.outside(value)
    if found is None:
        return None
    bad, need = found
    at = first_offender(bad)
    if at is None:
        return None
    return refuse(
        site,
        fn,
        "-",
        f"its data must be {need}; the entry at {position(dims, at)} is {float(value[at]):.6g}",
    )


def first_offender(bad: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True entry of ``bad`` in row-major order (None if none):
    the entry a refusal of data names."""
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def position(dims: tuple, index: tuple) -> str:
    """An entry's position by the names of its axes (``task 1, points 3``)."""
    parts = []
    for d, i in zip(dims, index, strict=False):
        name = "task" if d == "tasks" else ("entry" if "#e" in d else d)
        parts.append(f"{name} {i}")
    return ", ".join(parts)


def refuse(site: str, fn: str, parent: str, why: str) -> ValueError:
    """The refusal of design §5: one sentence naming the site, its distribution and the
    offending parent with the reason, then a pointer to the supported forms (:data:`DOCS`)."""
    where = f"site {site!r} ({fn})" + ("" if parent == "-" else f" with parent {parent}")
    return ValueError(f"VMP cannot use {where}: {why}. The supported forms are listed in {DOCS}.")


def unwrap(fn):
    """Strip Independent / Masked / Expanded wrappers: (base, mask or None)."""
    mask = None
    while True:
        if isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            m = fn._mask
            mask = m if mask is None else mask & m
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        else:
            return fn, mask


def family_of(fn) -> str | None:
    """The name of the family of a Pyro distribution (``None``: not one VMP knows)."""
    record = of_distribution(fn)
    return None if record is None else record.name
