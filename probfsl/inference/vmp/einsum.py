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
    """The contraction ``spec`` of ``tensors`` (axes ``dims``) into the axes ``kept``: a
    broadcast product where that stays small (:func:`_broadcast_route`); else, with more
    than two operands, the product of all but the largest (where that stays small too)
    contracted with the largest in one ``einsum``; else :func:`contract`."""
    shapes = _shapes(tensors)
    route = _broadcast_route(dims, kept, shapes)
    if route is not None:
        return _broadcast(tensors, *route)
    fold = _fold_route(dims, shapes) if len(tensors) > 2 else None
    if fold is None:
        return contract(spec, tensors)
    big, rest_route, rest_axes = fold
    rest = [t for i, t in enumerate(tensors) if i != big]
    # the large operand first: torch.einsum then multiplies it by the other's transpose,
    # the faster orientation of the batched BLAS call for a few output columns (a mixture's
    # E ln N per point and component: 2.5 ms against 3.0 on 1,000 tasks)
    pair_spec = _spec(kept, (dims[big], rest_axes), ())[0]
    return torch.einsum(pair_spec, tensors[big], _broadcast(rest, *rest_route))


@lru_cache(maxsize=4096)
def _fold_route(dims: tuple, shapes: tuple) -> tuple | None:
    """For :func:`_evaluate`: the largest operand's index, the broadcast route of the
    others' product and its axes (all of theirs); ``None`` where that product would
    outgrow its largest factor."""
    big = max(range(len(dims)), key=lambda i: math.prod(shapes[i]))
    rest = [i for i in range(len(dims)) if i != big]
    axes = tuple(dict.fromkeys(d for i in rest for d in dims[i]))
    route = _broadcast_route(tuple(dims[i] for i in rest), axes, tuple(shapes[i] for i in rest))
    if route is None:
        return None
    return big, route, axes


@lru_cache(maxsize=4096)
def _broadcast_route(dims: tuple, kept: tuple, shapes: tuple) -> tuple | None:
    """How to evaluate a contraction as a broadcast product and one sum: each operand's
    axis permutation and view (``None``: already aligned), the summed positions and the
    permutation of what remains into ``kept``. The product runs in the axis order of the
    largest operand (no copy of it), with the others' axes after. ``None`` where the
    product would be larger than the largest operand (a matrix product, for ``einsum``'s
    BLAS call) or an operand repeats an axis. On small operands this costs a third of an
    ``einsum`` call, whose equation parsing and path setup dominate there."""
    if any(len(set(d)) < len(d) for d in dims):
        return None
    size: dict = {}
    for names, shape in zip(dims, shapes, strict=True):
        for d, n in zip(names, shape, strict=True):
            size[d] = max(size.get(d, 1), n)
    if len(dims) > 1 and math.prod(size.values()) > max(math.prod(s) for s in shapes):
        return None
    big = max(range(len(dims)), key=lambda i: math.prod(shapes[i]))
    axes = tuple(dict.fromkeys(dims[big] + tuple(size)))
    plans = []
    for names, shape in zip(dims, shapes, strict=True):
        perm = tuple(sorted(range(len(names)), key=lambda i: axes.index(names[i])))
        own = dict(zip(names, shape, strict=True))
        view = tuple(own.get(d, 1) for d in axes)
        # a scalar broadcasts as it is; so does an operand already in the order and shape
        aligned = not shape or (perm == tuple(range(len(perm))) and view == tuple(shape))
        plans.append(None if aligned else (perm, view))
    summed = tuple(i for i, d in enumerate(axes) if d not in kept)
    left = [d for d in axes if d in kept]
    out_perm = tuple(left.index(d) for d in kept)
    return tuple(plans), summed, None if out_perm == tuple(range(len(kept))) else out_perm


def _broadcast(tensors: list, plans: tuple, summed: tuple, out_perm: tuple | None) -> torch.Tensor:
    """The product of ``tensors`` aligned by ``plans`` (:func:`_broadcast_route`), summed
    over the positions ``summed``, its axes then permuted by ``out_perm``."""
    res = None
    for t, plan in zip(tensors, plans, strict=True):
        if plan is not None:
            t = t.permute(plan[0]).reshape(plan[1])
        res = t if res is None else res * t
    if summed:
        res = res.sum(summed)
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
