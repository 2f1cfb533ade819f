"""Affine and bilinear parameter maps of Gaussian sites, read by automatic
differentiation (docs/design/vmp.md §6.6; their messages are
:mod:`~probfsl.inference.vmp.linear_maps`).

Reads the plan being built, the first run's latent values and the verifying probe run (a
:class:`~probfsl.inference.vmp.context.CompileContext`); returns a
:class:`~probfsl.inference.vmp.layout.Param` Σ_k J_k w_k + b (:func:`linear_map`) or
b + B(u, v) (:func:`bilinear_map`), or refuses. One run of the model with each parent's
value a leaf of autograd gives the parameter as a function of the parents; the map is
affine in a parent when the gradient of ⟨parameter, v⟩ does not depend on that parent
(a structural property of the graph: no rounding of numbers). A parent whose last event
axis a map contracts gets a joint factor over that axis (``Site.joint``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from probfsl.inference.vmp.checks import close, refuse
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.grouped_plates import arrange, contracted, plate_groups, refusal
from probfsl.inference.vmp.layout import (
    BilinearTerm,
    LinearTerm,
    Param,
    Plan,
    Site,
    canon,
    param_dims,
    reduce_constant,
    to_pyro,
)
from probfsl.inference.vmp.tracing import site_parameters, trace_at

#: autograd nodes that keep a map affine in its input
AFFINE_NODES = (
    "Add",
    "Sub",
    "Neg",
    "Mul",
    "Div",
    "Sum",
    "Mean",
    "MatMul",
    "Mm",
    "Bmm",
    "Mv",
    "Dot",
    "Expand",
    "View",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Permute",
    "Transpose",
    "T",
    "Index",
    "Select",
    "Slice",
    "Cat",
    "Stack",
    "Clone",
    "ToCopy",
    "Unsafe",
    "AsStrided",
    "Alias",
)


def non_affine_operations(value: torch.Tensor, leaf: torch.Tensor) -> str:
    """The operations on the paths from ``leaf`` to ``value`` that are not affine (``exp``,
    ``pow``, ...), read off the autograd graph, for a refusal to name."""
    reaches: dict = {}

    def visit(node: Any) -> bool:
        if node is None:
            return False
        if node not in reaches:
            reaches[node] = False  # a graph has no cycles; this guards the recursion
            hit = getattr(node, "variable", None) is leaf
            reaches[node] = any([visit(child) for child, _ in node.next_functions]) or hit
        return reaches[node]

    visit(value.grad_fn)
    names = {
        type(node).__name__.removesuffix("Backward0").removesuffix("Backward1")
        for node, hit in reaches.items()
        if hit and type(node).__name__ != "AccumulateGrad"
    }
    found = sorted(n.lower() for n in names if not n.startswith(AFFINE_NODES))
    return ", ".join(found) or "a non-affine function"


def agrees(got: torch.Tensor, expect: torch.Tensor, rounding: torch.Tensor | None = None) -> bool:
    """Whether a parameter's random-value run agrees with the map read off the model
    (relative 1e-5, absolute 1e-6 of its largest entry), up to ``rounding`` per entry
    where given (the error bound of a sum of many terms, n ε Σ|terms|: a float32 map
    contracting hundreds of coefficients rounds by more than 1e-5)."""
    scale = got.abs().amax() if got.numel() else got.new_ones(())
    if rounding is None:
        return close(got, expect, rtol=1e-5, atol=1e-6 * float(scale))
    bound = 1e-5 * expect.abs() + 1e-6 * scale + rounding
    return bool(((got - expect).abs() <= bound).all())


def as_function(
    ctx: CompileContext, child: Site, key: str, parents: list[Site] | tuple[Site, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Parameter ``key`` of ``child`` from one run with each parent's value a leaf of
    autograd (at its base value), and those leaves by name."""
    leaves, values = {}, dict(ctx.base_values)
    with torch.enable_grad():  # the values stay linked to the leaves under no_grad too
        for w in parents:
            leaf = canon(w, ctx.base_values[w.pyro_name]).detach().clone().requires_grad_(True)
            leaves[w.name] = leaf
            values[w.pyro_name] = to_pyro(w, leaf)
    run = trace_at(ctx, values, grad=True)
    with torch.enable_grad():
        return site_parameters(ctx, child, run.nodes[child.pyro_name])[key], leaves


def contracted_axis(child: Site, parent: Site, dims: tuple, desc: str) -> str | tuple | None:
    """The parent's axis that a linear map sums over (or none, for an elementwise map):
    its last event axis, or the plate axis of a plate of independent Normal sites
    (``with pyro.plate("coefs", D): w = pyro.sample("w", Normal(0, s))`` summed by
    ``X @ w``), which is the same density as the ``.to_event(1)`` Normal and is grouped
    the same way: one joint Gaussian factor over that axis
    (:func:`~probfsl.inference.vmp.grouped_plates.plate_groups`); or the tuple of the
    plate axes of a plate of Normals summed over several plates (W [A, B] in two plates,
    ``(X * W).sum((-2, -1))``), whose factor is one Gaussian over their A·B entries.
    Every other parent axis must be one of the child's (``dims``)."""
    if parent.event_dim > 1:
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            "a linear map of a parent with more than one event axis",
        )
    axis = parent.dims[-1] if parent.event_dim == 1 and parent.dims[-1] not in dims else None
    extra = [d for d in parent.dims if d not in dims and d != axis]
    if extra and axis is None and plate_groups(parent, extra):
        return extra[0] if len(extra) == 1 else tuple(extra)
    if extra:
        raise refuse(child.name, child.fn_name, desc, _twin_plates(parent, child, dims, extra))
    return axis


def _twin_plates(parent: Site, child: Site, dims: tuple, extra: list) -> str:
    """Why the map of ``child`` (axes ``dims``) that sums the parent's plate axes ``extra``
    is refused: two differently named plates at one Pyro dim and of one size (Pyro pairs
    their entries, VMP tells plates apart by name), else
    :func:`~probfsl.inference.vmp.grouped_plates.refusal`."""
    at = {f.name: (f.dim, f.size) for f in child.frames}
    for f in parent.frames:
        twin = [name for name, place in at.items() if name != f.name and place == (f.dim, f.size)]
        if f.name in extra and twin:
            return (
                f"the parent's plate {f.name!r} and the site's plate {twin[0]!r} are two "
                f"plates at dim {f.dim} of size {f.size}: Pyro pairs their entries, VMP "
                "tells plates apart by name; declare both sites in the same plate"
            )
    return refusal(parent, dims)


def refuse_unless_affine(
    value: torch.Tensor,
    leaf: torch.Tensor,
    child: Site,
    parent: Site,
    desc: str,
    supported: str = "linear maps of Normal sites are supported",
) -> None:
    """``ValueError`` unless ``value`` depends on ``leaf`` (the parent's value) and is
    affine in it (its gradient does not depend on it); the refusal says what is
    ``supported`` and the operations the parent goes through."""
    with torch.enable_grad():
        ones = torch.ones_like(value)
        (grad,) = torch.autograd.grad(value, leaf, ones, create_graph=True, allow_unused=True)
        if grad is None:
            raise refuse(child.name, child.fn_name, desc, f"it does not depend on {parent.name!r}")
        if grad.requires_grad:
            (second,) = torch.autograd.grad(grad.sum(), leaf, retain_graph=True, allow_unused=True)
            if second is not None:
                raise refuse(
                    child.name,
                    child.fn_name,
                    repr(parent.name) + f" ({parent.fn_name})",
                    f"the parent enters non-linearly ({supported}; this parent enters "
                    f"through {non_affine_operations(value, leaf)})",
                )


def _jacobian(value: torch.Tensor, leaf: torch.Tensor, axis: str | tuple | None) -> torch.Tensor:
    """∂value/∂leaf of a map affine in the leaf, per element of ``value`` and (with
    ``axis``) per entry of the parent's contracted axes (its last event axis, or its last
    plate axes): [*value.shape, *those axes' sizes]."""
    with torch.enable_grad():
        dummy = torch.zeros_like(value, requires_grad=True)
        (transposed,) = torch.autograd.grad(value, leaf, dummy, create_graph=True)
        if axis is None:
            (jac,) = torch.autograd.grad(transposed.sum(), dummy, allow_unused=True)
            return torch.zeros_like(value) if jac is None else jac.detach()
        k = len(contracted(axis))
        return _jacobian_columns(value, leaf, transposed, dummy, k)


def _jacobian_columns(
    value: torch.Tensor,
    leaf: torch.Tensor,
    transposed: torch.Tensor,
    dummy: torch.Tensor,
    k: int = 1,
) -> torch.Tensor:
    """J's columns, one per entry of the leaf's last ``k`` axes, by differentiating
    ``transposed`` = Jᵀu in ``dummy`` = u (all at once where vmap can, else in a loop):
    [*value.shape, *the leaf's last k sizes]."""
    block = leaf.shape[leaf.dim() - k :]
    n_cols = math.prod(block)
    picks = torch.eye(n_cols, dtype=leaf.dtype, device=leaf.device)
    picks = picks.reshape(n_cols, *[1] * (leaf.dim() - k), *block).expand(n_cols, *leaf.shape)
    with contextlib.suppress(RuntimeError):  # every column at once, where vmap can
        (cols,) = torch.autograd.grad(
            transposed, dummy, picks, retain_graph=True, allow_unused=True, is_grads_batched=True
        )
        if cols is None:
            return torch.zeros(*value.shape, *block, dtype=value.dtype, device=value.device)
        return cols.detach().movedim(0, -1).unflatten(-1, block)
    cols = []
    for p in range(n_cols):
        (col,) = torch.autograd.grad(
            (transposed * picks[p]).sum(), dummy, retain_graph=True, allow_unused=True
        )
        cols.append(torch.zeros_like(value) if col is None else col.detach())
    return torch.stack(cols, -1).unflatten(-1, block)


def _mark_joint(plan: Plan, parent: Site, axis: str | tuple | None) -> None:
    """A Normal parent whose last axis a map contracts (an event axis, or the plate axis of
    a plate of Normals, :func:`~.grouped_plates.plate_groups`): its factor is joint over
    that axis (its second copy ``axis + "b"`` sized); over the k last plate axes that a
    map sums together, one Gaussian over their merged entries (``Site.joint_axes``)."""
    axes = contracted(axis)
    if axes and lookup(parent.family).elementwise:
        parent.joint = True
        parent.joint_axes = len(axes)
        for a in axes:
            plan.sizes[a + "b"] = plan.sizes[a]


def linear_map(ctx: CompileContext, child: Site, key: str, parents: list[str]) -> Param:
    """An affine parameter Σ_k J_k w_k + b of Normal or MultivariateNormal parents
    (:mod:`~probfsl.inference.vmp.linear_maps`).

    One run of the model with each parent's value a leaf of autograd gives the
    parameter as a function of the parents. It is affine in a parent when the gradient
    of ⟨parameter, v⟩ does not depend on that parent (a structural property of the
    graph: no rounding of numbers); J's columns come from differentiating the map
    u ↦ Jᵀu once more, b from the base values, and the whole map is then checked on the
    random values of every latent site."""
    plan = ctx.plan
    dims = param_dims(child, key)
    sites = [plan.sites[p] for p in parents]
    desc = ", ".join(f"{w.name!r} ({w.fn_name})" for w in sites)
    for w in sites:  # a summed plate of Normals to the end of the layout (joint factor)
        arrange(ctx, w, dims)
    value, leaves = as_function(ctx, child, key, sites)
    if not value.requires_grad:
        raise refuse(child.name, child.fn_name, desc, f"its {key} does not depend on them")
    terms, offset = [], value.detach()
    for w in sites:
        axis = contracted_axis(child, w, dims, desc)
        refuse_unless_affine(value, leaves[w.name], child, w, desc)
        jac = _jacobian(value, leaves[w.name], axis)
        jac_dims = dims + contracted(axis)
        over = jac_dims
        offset = offset - ein(
            dims, [(jac, jac_dims), (leaves[w.name].detach(), w.dims)], over, plan.sizes, jac
        )
        jac, jac_dims = reduce_constant(jac, jac_dims)
        identity = _identity_axis(jac, jac_dims, axis, w)
        terms.append(LinearTerm(w.name, jac, jac_dims, axis, identity))
        _mark_joint(plan, w, axis)
    const, const_dims = reduce_constant(offset, dims)
    param = Param(dims, const=const, const_dims=const_dims, terms=terms)
    if not _affine_holds(ctx, child, key, param, leaves):
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            f"its {key} is not an affine function of them with fixed coefficients "
            "(linear maps of Normal sites with observed coefficients, and products of "
            "two of them, are supported; a non-linear function is not)",
        )
    return param


def _identity_axis(jac: torch.Tensor, jac_dims: tuple, axis, w: Site) -> str | None:
    """The parameter's axis that the Jacobian ``jac`` maps one to one onto the parent's last
    axis ``axis`` (``jac`` exactly the identity matrix over the two, the same along every
    other axis), else ``None``: the map then reads the parent's entries as they are
    (:mod:`~probfsl.inference.vmp.linear_maps` skips the products with J)."""
    if not isinstance(axis, str) or len(jac_dims) != 2 or jac_dims[1] != axis:
        return None
    if w.dims[-1] != axis or jac.shape[0] != jac.shape[1]:
        return None
    eye = torch.eye(jac.shape[0], dtype=jac.dtype, device=jac.device)
    return jac_dims[0] if torch.equal(jac, eye) else None


def _affine_holds(
    ctx: CompileContext, child: Site, key: str, param: Param, leaves: dict[str, torch.Tensor]
) -> bool:
    """Whether the affine map ``param`` gives the parameter of the verifying run (every
    latent site at its probe value), up to the rounding of its sum (``leaves``: the
    parents' base values, which gave b)."""
    plan = ctx.plan
    dims = param.dims
    got = ctx.runs["verify"][child.name][key]
    expect = ein(dims, [(param.const, param.const_dims)], dims, plan.sizes, got)
    # Σ|terms| of this run and of the base run (which gave b) and their number, for
    # the rounding bound
    size, n = expect.abs() + got.abs(), 1
    for t in param.terms:
        w = plan.sites[t.parent]
        over = dims + contracted(t.axis)
        ops = [(t.jac, t.jac_dims), (ctx.probes[t.parent], w.dims)]
        expect = expect + ein(dims, ops, over, plan.sizes, got)
        both = ctx.probes[t.parent].abs() + leaves[t.parent].detach().abs()
        size = size + ein(dims, [(t.jac.abs(), t.jac_dims), (both, w.dims)], over, plan.sizes, got)
        n += math.prod(plan.sizes[a] for a in contracted(t.axis))
    return agrees(got, expect, n * torch.finfo(got.dtype).eps * size)


def bilinear_map(ctx: CompileContext, child: Site, key: str, parents: list[str]) -> Param:
    """A parameter b + B(u, v) bilinear in two latent Gaussian sites, e.g. ``c * mu`` or
    ``(W * x).sum(-1)`` with both factors latent (mean-field between them). H =
    ∂²B/∂u∂v comes from automatic differentiation (each column of J_u differentiated
    in v), b from the base values, and the map is checked on random values of every
    latent site."""
    plan = ctx.plan
    dims = param_dims(child, key)
    u, v = plan.sites[parents[0]], plan.sites[parents[1]]
    desc = f"{u.name!r} ({u.fn_name}), {v.name!r} ({v.fn_name})"
    for w in (u, v):  # a summed plate of Normals to the end of the layout (joint factor)
        arrange(ctx, w, dims)
    axis_u = contracted_axis(child, u, dims, desc)
    axis_v = contracted_axis(child, v, dims, desc)
    for w, axis in ((u, axis_u), (v, axis_v)):
        if isinstance(axis, tuple):
            raise refuse(
                child.name,
                child.fn_name,
                desc,
                f"a product of two latent sites that sums {w.name!r} over several plates "
                f"{list(axis)} (a linear map with observed coefficients may; here declare "
                f"the weights in one plate of their entries' number and reshape them)",
            )
    value, leaves = as_function(ctx, child, key, (u, v))
    with torch.enable_grad():
        h = _mixed_derivative(value, leaves[u.name], leaves[v.name], axis_u, axis_v)
    h_dims = dims + tuple(a for a in (axis_u, axis_v) if a)
    over = h_dims
    product = ein(
        dims,
        [(h, h_dims), (leaves[u.name].detach(), u.dims), (leaves[v.name].detach(), v.dims)],
        over,
        plan.sizes,
        h,
    )
    const, const_dims = reduce_constant(value.detach() - product, dims)
    h, h_dims_kept = reduce_constant(h, h_dims)
    term = BilinearTerm(u.name, v.name, h, h_dims_kept, axis_u, axis_v)
    probes = ctx.probes
    got = ctx.runs["verify"][child.name][key]
    ops = [(h, h_dims_kept), (probes[u.name], u.dims), (probes[v.name], v.dims)]
    expect = ein(dims, [(const, const_dims)], dims, plan.sizes, got)
    expect = expect + ein(dims, ops, over, plan.sizes, got)
    if not agrees(got, expect):
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            f"its {key} is neither affine in these sites nor a product of two of them "
            "(affine maps and bilinear products of Normal sites are supported)",
        )
    for w, axis in ((u, axis_u), (v, axis_v)):
        _mark_joint(plan, w, axis)
    return Param(dims, const=const, const_dims=const_dims, bilinear=term)


def _mixed_derivative(
    value: torch.Tensor,
    leaf_u: torch.Tensor,
    leaf_v: torch.Tensor,
    axis_u: str | None,
    axis_v: str | None,
) -> torch.Tensor:
    """∂²value/∂u_a∂v_b per element of ``value`` [..., A, B] (A, B present where the
    parent's last axis is contracted), by differentiating u ↦ J_uᵀU, then each
    column of J_u in v the same way."""
    n_u = leaf_u.shape[-1] if axis_u else 1
    n_v = leaf_v.shape[-1] if axis_v else 1
    dummy = torch.zeros_like(value, requires_grad=True)
    (grad_u,) = torch.autograd.grad(value, leaf_u, dummy, create_graph=True)
    rows = []
    for a in range(n_u):
        pick = torch.zeros(n_u, dtype=leaf_u.dtype, device=leaf_u.device)
        pick[a] = 1
        weight = pick if axis_u else 1
        (col,) = torch.autograd.grad((grad_u * weight).sum(), dummy, create_graph=True)
        second = torch.zeros_like(col, requires_grad=True)
        (grad_v,) = torch.autograd.grad(col, leaf_v, second, create_graph=True, allow_unused=True)
        entries = []
        for b in range(n_v):
            pick_v = torch.zeros(n_v, dtype=leaf_v.dtype, device=leaf_v.device)
            pick_v[b] = 1
            if grad_v is None:
                entries.append(torch.zeros_like(value))
                continue
            (h,) = torch.autograd.grad(
                (grad_v * (pick_v if axis_v else 1)).sum(),
                second,
                retain_graph=True,
                allow_unused=True,
            )
            entries.append(torch.zeros_like(value) if h is None else h.detach())
        rows.append(torch.stack(entries, -1) if axis_v else entries[0])
    return torch.stack(rows, -2 if axis_v else -1) if axis_u else rows[0]
