"""The contraction layer of VMP: sums of products over named axes.

Every message and bound term of :mod:`probfsl.inference.vmp` is a sum over some axes of a
product of expectations, each laid out with one named axis per plate and event dimension
(:mod:`probfsl.inference.vmp.layout`). :func:`ein` turns the names into an ``einsum``
specification; a product that sums over no axis is a broadcast product of aligned views,
and :func:`contract` evaluates the others along opt_einsum's contraction order
(``opt_einsum.contract_expression``, compiled once per specification and shapes). Every
cache is keyed by value (axis names, shapes), never by object identity.
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
    dims = tuple(tuple(d) for _, d in ops)
    spec, extra, kept, identity, has = _spec(tuple(out), dims, tuple(over))
    if identity:
        res = ops[0][0]
    elif ops:
        res = _evaluate(spec, dims, kept, [t for t, _ in ops])
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


def _shapes(tensors: list) -> tuple:
    return tuple(tuple(t.shape) for t in tensors)


def _evaluate(spec: str, dims: tuple, kept: tuple, tensors: list) -> torch.Tensor:
    """The contraction ``spec`` of ``tensors`` (axes ``dims``) into the axes ``kept``: an
    elementwise product where nothing is summed (:func:`_product_route`), else
    :func:`contract`."""
    route = _product_route(dims, kept, _shapes(tensors))
    return contract(spec, tensors) if route is None else _product(tensors, *route)


@lru_cache(maxsize=4096)
def _product_route(dims: tuple, kept: tuple, shapes: tuple) -> tuple | None:
    """How to evaluate a contraction that sums over no axis as a broadcast product: each
    operand's axis permutation and view into the order of the largest operand (``None``:
    already aligned), and the permutation of the result into ``kept``. ``None`` where an
    axis is summed (those keep ``einsum``'s evaluation, and its rounding) or an operand
    repeats one. On small operands this costs a third of an ``einsum`` call, whose
    equation parsing dominates there (a quarter of a mixture's sweep on a few tasks)."""
    if any(len(set(d)) < len(d) for d in dims):
        return None
    axes = {d for names in dims for d in names}
    if axes != set(kept):
        return None
    big = max(range(len(dims)), key=lambda i: math.prod(shapes[i]))
    order = tuple(dict.fromkeys(dims[big] + kept))
    plans = []
    for names, shape in zip(dims, shapes, strict=True):
        perm = tuple(sorted(range(len(names)), key=lambda i: order.index(names[i])))
        own = dict(zip(names, shape, strict=True))
        view = tuple(own.get(d, 1) for d in order)
        # a scalar broadcasts as it is; so does an operand already in the order and shape
        aligned = not shape or (perm == tuple(range(len(perm))) and view == tuple(shape))
        plans.append(None if aligned else (perm, view))
    out_perm = tuple(order.index(d) for d in kept)
    return tuple(plans), None if out_perm == tuple(range(len(kept))) else out_perm


def _product(tensors: list, plans: tuple, out_perm: tuple | None) -> torch.Tensor:
    """The product of ``tensors`` aligned by ``plans`` (:func:`_product_route`), its axes
    permuted by ``out_perm``."""
    res = None
    for t, plan in zip(tensors, plans, strict=True):
        if plan is not None:
            t = t.permute(plan[0]).reshape(plan[1])
        res = t if res is None else res * t
    return res if out_perm is None else res.permute(out_perm)


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
