"""The contraction layer of VMP: sums of products over named axes.

Every message and bound term of :mod:`probfsl.inference.vmp` is a sum over some axes of a
product of expectations, each laid out with one named axis per plate and event dimension
(:mod:`probfsl.inference.vmp.layout`). :func:`ein` turns the names into an ``einsum``
specification and :func:`contract` evaluates it along opt_einsum's contraction order
(``opt_einsum.contract_expression``, compiled once per specification and shapes). Both
caches are keyed by value (axis names, shapes), never by object identity.
"""

from __future__ import annotations

import math
from functools import lru_cache

import opt_einsum
import torch

#: with at most this many axis combinations (a bound on any intermediate), or at most twice
#: the largest operand, one ``torch.einsum`` call is cheaper than a pairwise order
_SMALL = 1 << 12


@lru_cache(maxsize=4096)
def _spec(out: tuple, dims: tuple, over: tuple) -> tuple:
    """The ``einsum`` string of a named contraction, the summed axes no operand has, the
    output axes some operand has, whether the result is the single operand unchanged, and
    which output axes are present."""
    letters: dict[str, str] = {}

    def sub(names):
        return "".join(letters.setdefault(d, chr(ord("a") + len(letters))) for d in names)

    present = {d for names in dims for d in names}
    extra = tuple(d for d in over if d not in present and d not in out)
    kept = tuple(d for d in out if d in present)
    spec = ",".join(sub(names) for names in dims) + "->" + sub(kept)
    identity = len(dims) == 1 and tuple(dims[0]) == kept
    return spec, extra, kept, identity, tuple(d in present for d in out)


def ein(
    out: tuple, ops: list, over: tuple, sizes: dict, ref: torch.Tensor, expand: bool = True
) -> torch.Tensor:
    """Σ over ``over`` (and every operand axis not in ``out``) of the product of ``ops``.

    ``ops`` are ``(tensor, axis names)`` pairs; an axis of ``over`` that no operand has
    multiplies the sum by its size; an axis of ``out`` that no operand has is broadcast (kept
    at size 1 with ``expand=False``). ``ref`` gives the dtype and device of an empty product.
    """
    spec, extra, kept, identity, has = _spec(
        tuple(out), tuple(tuple(d) for _, d in ops), tuple(over)
    )
    if identity:
        res = ops[0][0]
    elif ops:
        res = contract(spec, [t for t, _ in ops])
    else:
        res = torch.ones((), dtype=ref.dtype, device=ref.device)
    n_extra = math.prod(sizes[d] for d in extra)
    if n_extra != 1:
        res = res * n_extra
    if len(kept) < len(out):
        shape = [sizes[d] if h else 1 for d, h in zip(out, has, strict=True)]
        res = res.reshape(shape)
        if expand:
            res = res.expand([sizes[d] for d in out])
    return res


@lru_cache(maxsize=4096)
def _expression(spec: str, shapes: tuple):
    """``None`` where one ``einsum`` call is cheap (see ``_SMALL``), else opt_einsum's
    compiled contraction for these shapes."""
    subs = spec.split("->")[0].split(",")
    sizes = {}
    for sub, shape in zip(subs, shapes, strict=True):
        sizes.update(zip(sub, shape, strict=True))
    full = math.prod(sizes.values())
    if full <= _SMALL or full <= 2 * max(math.prod(s) for s in shapes):
        return None
    return opt_einsum.contract_expression(spec, *shapes)


def sweeping():
    """The context of a sweep: ``torch.einsum`` contracts in the order given, without
    searching for a path on every call (``torch.backends.opt_einsum``; 80 µs of a 110 µs
    call on three small operands), since :func:`contract` has chosen the order already."""
    return torch.backends.opt_einsum.flags(enabled=False)


def contract(spec: str, tensors: list) -> torch.Tensor:
    """``einsum(spec, *tensors)``: one call for two operands or a small product, otherwise
    pairwise along opt_einsum's optimal order (compiled once per specification and
    shapes). Run it inside :func:`sweeping`."""
    if len(tensors) > 2:
        expr = _expression(spec, tuple(tuple(t.shape) for t in tensors))
        if expr is not None:
            return expr(*tensors, backend="torch")
    return torch.einsum(spec, *tensors)
