"""The contraction layer of VMP: sums of products over named axes.

Every message and bound term of :mod:`probfsl.inference.vmp` is a sum over some axes of a
product of expectations, each laid out with one named axis per plate and event dimension
(:mod:`probfsl.inference.vmp.layout`). :func:`ein` turns the names into an ``einsum``
specification; a product that sums over no axis is a broadcast product of aligned views,
and :func:`contract` evaluates the others one pair of operands at a time along
opt_einsum's contraction order (``opt_einsum.contract_path``), each pair as one batched
matrix product of views (:func:`_pair_route`). Orders and routes are worked out once per
specification and shapes; every cache is keyed by value (axis names, shapes), never by
object identity.
"""

from __future__ import annotations

import contextlib
import math
from functools import lru_cache

import opt_einsum
import torch

#: with at most this many axis combinations (a bound on any intermediate), or at most twice
#: the largest operand, operands are contracted left to right without searching for an order
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
    tensors = [t for t, _ in ops]
    dims = tuple([tuple(d) for _, d in ops])
    shapes = tuple([t.shape for t in tensors])
    extra, kept, has, how, route = _recipe(tuple(out), dims, tuple(over), shapes)
    if how == "identity":
        res = tensors[0]
    elif how == "product":
        res = _product(tensors, *route)
    elif how == "pairs":
        res = _contract(tensors, *route)
    elif how == "einsum":
        res = torch.einsum(route, *tensors)
    else:  # the empty product, 1, times the sizes of the summed axes
        n_extra = math.prod(sizes[d] for d in extra)
        res = torch.full((), n_extra, dtype=ref.dtype, device=ref.device)
        extra = ()
    if extra:
        n_extra = math.prod(sizes[d] for d in extra)
        if n_extra != 1:  # as a float where it can be: an int costs a conversion per call
            res = res * (float(n_extra) if res.is_floating_point() else n_extra)
    if has is not None:
        res = res.reshape([sizes[d] if h else 1 for d, h in zip(out, has, strict=True)])
        if expand:
            res = res.expand([sizes[d] for d in out])
    return res


@lru_cache(maxsize=4096)
def _recipe(out: tuple, dims: tuple, over: tuple, shapes: tuple) -> tuple:
    """How :func:`ein` evaluates a named contraction on operands of these shapes, worked
    out once: the summed axes no operand has, the output axes some operand has, which
    output axes are present (``None``: all are), and the evaluation: ``"identity"`` (the
    single operand unchanged), ``"product"`` (:func:`_product_route`), ``"pairs"``
    (:func:`_order`), ``"einsum"`` (``torch.einsum`` on the specification) or ``"empty"``
    (no operand)."""
    spec, extra, kept, identity, has = _spec(out, dims, over)
    has = None if len(kept) == len(out) else has
    if identity:
        return extra, kept, has, "identity", None
    if not dims:
        return extra, kept, has, "empty", None
    shapes = tuple(tuple(s) for s in shapes)
    route = _product_route(dims, kept, shapes)
    if route is not None:
        return extra, kept, has, "product", route
    steps, last = _order(spec, shapes)
    if last is None:
        return extra, kept, has, "einsum", spec
    return extra, kept, has, "pairs", (steps, last)


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
def _order(spec: str, shapes: tuple) -> tuple:
    """The pairs of :func:`contract` for ``spec`` on operands of these shapes: opt_einsum's
    optimal order where the operands are large (see ``_SMALL``), else left to right; each
    step ``(i, j, route)`` contracts operands ``i < j`` of the current list (removed, the
    result appended) along ``route`` (:func:`_pair_route`), and the last route sums and
    permutes the result into the output (``None``: no route, ``torch.einsum`` instead)."""
    inputs, out = spec.split("->")
    subs = inputs.split(",")
    sizes: dict[str, int] = {}
    for sub, shape in zip(subs, shapes, strict=True):
        sizes.update(zip(sub, shape, strict=True))
    full = math.prod(sizes.values())
    if len(subs) < 3 or full <= _SMALL or full <= 2 * max(math.prod(s) for s in shapes):
        path = [(0, 1)] * (len(subs) - 1)
    else:
        path, _ = opt_einsum.contract_path(spec, *shapes, shapes=True, optimize="optimal")
    subs, shapes, steps = list(subs), list(shapes), []
    for pair in path:
        i, j = sorted(pair)
        a, b = subs[i], subs[j]
        later = set(out).union(*(subs[k] for k in range(len(subs)) if k not in (i, j)))
        res = "".join(dict.fromkeys(c for c in a + b if c in later))
        steps.append((i, j, _pair_route(a, b, res, shapes[i], shapes[j])))
        shape = tuple(sizes[c] for c in res)
        for k in (j, i):
            del subs[k], shapes[k]
        subs.append(res)
        shapes.append(shape)
    last = _pair_route(subs[0], None, out, shapes[0], ())
    if any(route is None for _, _, route in steps):
        last = None  # a pair without a route: ``torch.einsum`` for the whole contraction
    return tuple(steps), last


@lru_cache(maxsize=4096)
def _pair_route(a: str, b: str | None, out: str, shape_a: tuple, shape_b: tuple) -> tuple | None:
    """How to contract operand ``a`` with operand ``b`` (``None``: ``a`` alone) into ``out``
    as one ``torch.bmm``: for each operand the axes it alone sums (summed first), its
    permutation into (batch, own, contracted) axes and the 3-d view of those (without a
    contracted axis, the view of a broadcast product in the result's axes); the result's
    shape and its permutation into ``out``. A step that would change nothing is ``None``.
    The route is ``None`` (``torch.einsum`` then) where an operand repeats an axis or the
    operands' sizes of an axis differ (einsum's broadcasting)."""
    alone = b is None
    b = b or ""
    if len(set(a)) < len(a) or len(set(b)) < len(b):
        return None
    size = dict(zip(a, shape_a, strict=True))
    for c, n in zip(b, shape_b, strict=True):
        if size.setdefault(c, n) != n:
            return None
    batch = [c for c in a if c in b and c in out]
    contracted = [c for c in a if c in b and c not in out]
    product = not alone and not contracted  # nothing summed between them

    def side(sub: str, other: str, res: list | None) -> tuple:
        summed = tuple(i for i, c in enumerate(sub) if c not in other and c not in out)
        kept = [c for c in sub if c in other or c in out]
        own = [c for c in kept if c not in other]
        order = batch + own + contracted
        perm = tuple(kept.index(c) for c in order)
        if product:  # the view of the broadcast product, in the result's axes
            view = tuple(size[c] if c in sub else 1 for c in res)
        else:
            view = tuple(math.prod(size[c] for c in g) for g in (batch, own, contracted))
        return (
            summed or None,
            None if perm == tuple(range(len(perm))) else perm,
            None if view == tuple(size[c] for c in order) else view,
            own,
        )

    left = [c for c in a if c not in b and c in out]
    right = [c for c in b if c not in a and c in out]
    res = batch + left + right
    summed_a, perm_a, view_a, _ = side(a, b, res)
    if alone:  # one operand: sums and a permutation
        return summed_a, perm_a, None, None, None, None, None, _perm(left, out), False
    summed_b, perm_b, view_b, _ = side(b, a, res)
    shape = tuple(size[c] for c in res)
    bmm_shape = tuple(math.prod(size[c] for c in g) for g in (batch, left, right))
    shape = None if product or shape == bmm_shape else shape
    return summed_a, perm_a, view_a, summed_b, perm_b, view_b, shape, _perm(res, out), product


def _perm(names: list, out: str) -> tuple | None:
    perm = tuple(names.index(c) for c in out)
    return None if perm == tuple(range(len(perm))) else perm


def _pair(x: torch.Tensor, y: torch.Tensor | None, route: tuple) -> torch.Tensor:
    """The contraction of ``x`` and ``y`` (or of ``x`` alone) along ``route``
    (:func:`_pair_route`): the operands' own sums, then ``bmm(x', y'ᵀ)`` on views whose
    last axis is the contracted one (the layout MKL's batched products run fastest on),
    or a broadcast product where no axis is contracted."""
    summed_a, perm_a, view_a, summed_b, perm_b, view_b, shape, out_perm, product = route
    # each operand: its own sums, permutation and view (``None``: none), written out here
    # rather than in a helper: a sweep runs tens of pairs, on small batches at ~10 µs each
    if summed_a is not None:
        x = x.sum(summed_a)
    if perm_a is not None:
        x = x.permute(perm_a)
    if view_a is not None:
        x = x.reshape(view_a)
    if y is not None:
        if summed_b is not None:
            y = y.sum(summed_b)
        if perm_b is not None:
            y = y.permute(perm_b)
        if view_b is not None:
            y = y.reshape(view_b)
        x = x * y if product else torch.bmm(x, y.transpose(1, 2))
        if shape is not None:
            x = x.reshape(shape)
    return x if out_perm is None else x.permute(out_perm)


def sweeping():
    """The context of a sweep: ``torch.einsum`` (where :func:`contract` falls back on it)
    contracts in the order given, without searching for a path on every call
    (``torch.backends.opt_einsum``; 80 µs of a 110 µs call on three small operands).
    Inside one already (a fit's loop holds one around all its sweeps), a no-op: setting
    the flag costs 10-20 µs, a hundredth of a sweep of a small batch."""
    if not torch.backends.opt_einsum.enabled:
        return contextlib.nullcontext()
    return torch.backends.opt_einsum.flags(enabled=False)


def contract(spec: str, tensors: list) -> torch.Tensor:
    """``einsum(spec, *tensors)`` one pair of operands at a time (:func:`_order`), each
    pair as one batched matrix product (:func:`_pair`); ``torch.einsum`` where a pair
    has no such route. A ``torch.einsum`` call costs 20 µs on small operands, mostly in
    parsing its equation, against 4 µs for a ``bmm`` of views. Run it inside
    :func:`sweeping`."""
    steps, last = _order(spec, tuple(tuple(t.shape) for t in tensors))
    if last is None:
        return torch.einsum(spec, *tensors)
    return _contract(tensors, steps, last)


def _contract(tensors: list, steps: tuple, last: tuple) -> torch.Tensor:
    """:func:`contract` along the pairs ``steps`` and the final route ``last``
    (:func:`_order`)."""
    tensors = list(tensors)
    for i, j, route in steps:
        y = tensors.pop(j)
        x = tensors.pop(i)
        tensors.append(_pair(x, y, route))
    return _pair(tensors[0], None, last)
