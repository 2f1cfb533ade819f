"""Parameter maps: how a site's parents enter one of its parameters, read off the model
and verified on other values (docs/design/vmp.md §6.6).

Reads the plan being built, the first run's latent values and parameters, the forms of
its precisions and rates, and the probe runs (a
:class:`~probfsl.inference.vmp.context.CompileContext`); returns one
:class:`~probfsl.inference.vmp.layout.Param` per (site, parameter) (:func:`param_map`),
or refuses. A location must equal the parent's value (broadcast over the child's extra
axes, the parent's event axes right-aligned with the child's), a precision or rate must
equal c · (parent) with c fixed (c read off the form the first run computes it in:
:mod:`~probfsl.inference.vmp.monomials`; several Gamma parents make a product,
:func:`product_map`), a Categorical's probabilities must equal the Dirichlet parent. A
parent plate missing from the child is a mixture component axis, selected by a latent
Categorical site or by a fixed index (the component of each entry carried from the
parent by the model's indexing, :func:`traced_index`); a fixed table may be selected by a
Categorical (:func:`selected_constant`). Affine and bilinear maps of Gaussian sites are
:mod:`~probfsl.inference.vmp.affine_maps`.
"""

from __future__ import annotations

import contextlib

import torch

from probfsl.inference.vmp.checks import close, refuse
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import (
    Param,
    Site,
    canon,
    param_dims,
    reduce_constant,
    to_pyro,
    unit,
)
from probfsl.inference.vmp.monomials import Monomial, coefficient, origin, plain
from probfsl.inference.vmp.selection import select
from probfsl.inference.vmp.tracing import probe_run, read_parameters, site_parameters, trace_at

#: parameters that are c · parent (c fixed) rather than a copy of the parent
SCALED = ("precision", "rate")


def nearby_hint(family: str, key: str) -> str:
    """What parameter ``key`` of a ``family`` site may be, for a refusal (or nothing)."""
    hint = lookup(family).hints.get(key)
    return f"; its {key} may be {hint}" if hint else ""


def described(site: Site) -> str:
    """A site as a refusal names it: ``'name' (Distribution)``."""
    return f"{site.name!r} ({site.fn_name})"


def param_map(ctx: CompileContext, child: Site, key: str, parents: list[str]) -> Param:
    """How the ``parents`` enter parameter ``key`` of ``child``. An event axis of a parent
    of a mixture whose size equals the child's axis it would align with is first read
    as that axis, then, if that is refused, as the selector's component axis
    (``Vindex(mu)[..., z]`` with ``mu`` a vector of K means)."""
    try:
        return _conjugate_map(ctx, child, key, parents)
    except ValueError:
        plan = ctx.plan
        sites = plan.sites
        selectors = [p for p in parents if lookup(sites[p].family).labels]
        mains = [sites[p] for p in parents if not lookup(sites[p].family).labels]
        if len(selectors) != 1 or len(mains) != 1 or lookup(mains[0].family).outer_axis:
            raise
        parent, dims, n_cat = mains[0], param_dims(child, key), sites[selectors[0]].n_cat
        events = parent.dims[len(parent.dims) - parent.event_dim :]
        tail = dims[len(dims) - len(events) :] if events else ()
        # an event axis aligned with a child's axis of the same size as the components
        candidates = [
            d for d, c in zip(events, tail, strict=True) if plan.sizes[d] == n_cat == plan.sizes[c]
        ]
        for axis in candidates:
            with contextlib.suppress(ValueError):
                return _conjugate_map(ctx, child, key, parents, component=axis)
        raise


def _conjugate_map(
    ctx: CompileContext, child: Site, key: str, parents: list[str], component: str | None = None
) -> Param:
    """:func:`param_map` with the parent's event axis ``component`` (if any) read as the
    selector's component axis."""
    sites = ctx.plan.sites
    dims = param_dims(child, key)
    value = ctx.base_params[child.name][key]
    if not parents:
        if lookup(child.family).matrix:  # matrices keep every axis
            return Param(dims, const=value, const_dims=dims)
        const, const_dims = reduce_constant(value, dims)
        return Param(dims, const=const, const_dims=const_dims)
    record = lookup(child.family)
    want = record.conjugate.get(key)
    mains = [p for p in parents if not lookup(sites[p].family).labels]
    selectors = [p for p in parents if lookup(sites[p].family).labels]
    parents_desc = ", ".join(described(sites[p]) for p in parents)
    if not mains and len(selectors) == 1 and record.selectable_constant:
        return selected_constant(ctx, child, key, selectors[0])
    if key == record.product_parameter and len(mains) > 1 and not selectors:
        if all(sites[m].family == want for m in mains):
            return product_map(ctx, child, key, mains)
    if (
        want is None
        or len(mains) != 1
        or len(selectors) > 1
        or sites[mains[0]].family != want
        or (selectors and record.labels and not child.observed)
    ):
        why = f"its {key} is not a conjugate function{nearby_hint(child.family, key)}"
        raise refuse(child.name, child.fn_name, parents_desc, why)
    param = _copy_layout(ctx, child, key, parents, component)
    return _read_copy(ctx, child, key, param)


def _copy_layout(
    ctx: CompileContext, child: Site, key: str, parents: list[str], component: str | None
) -> Param:
    """The layout of a (selected, scaled) copy of the one non-selecting parent: its axes
    renamed to the child's (event axes right-aligned), the component axis the child
    selects, and the selecting Categorical (``None`` where the site depends on it through
    another parameter)."""
    plan = ctx.plan
    sites = plan.sites
    dims = param_dims(child, key)
    selectors = [p for p in parents if lookup(sites[p].family).labels]
    parent = sites[next(p for p in parents if not lookup(sites[p].family).labels)]
    selector = selectors[0] if selectors else None
    parent_desc = described(parent)
    # the parent's event axes, right-aligned with the parameter's trailing axes
    n_events = parent.event_dim
    if n_events > len(dims):
        raise refuse(
            child.name, child.fn_name, parent_desc, "the parent has more axes than the child"
        )
    rename = {d: d for d in parent.dims}
    for j in range(n_events):
        rename[parent.dims[len(parent.dims) - n_events + j]] = dims[len(dims) - n_events + j]
    if lookup(parent.family).outer_axis:  # the second axis of its x xᵀ
        rename[parent.dims[-1] + "b"] = rename[parent.dims[-1]] + "b"
    for d in parent.dims:
        if d == component or (rename[d] in dims and plan.sizes[d] != plan.sizes[rename[d]]):
            if selectors and not lookup(parent.family).outer_axis and rename[d] != d:
                # an event axis of component values (Vindex(mu)[..., z] with mu a vector
                # of K means): the selector's category axis, not one of the child's
                rename[d] = f"{selectors[0]}#cat"
                continue
            why = DATA_LABELS if key == "probs" else f"axis {rename[d]} differs in size"
            raise refuse(child.name, child.fn_name, parent_desc, why)
    parent_dims = tuple(rename[d] for d in parent.dims)
    missing = [d for d in parent_dims if d not in dims]
    if len(missing) > 1:
        raise refuse(
            child.name, child.fn_name, parent_desc, "more than one parent axis is selected"
        )
    comp = missing[0] if missing else None
    if selector and comp is None:
        selector = None  # the site depends on it through another parameter
    return Param(dims, parent=parent.name, rename=rename, comp=comp, selector=selector)


def _read_copy(ctx: CompileContext, child: Site, key: str, param: Param) -> Param:
    """``param`` (:func:`_copy_layout`) with its coefficient c (a precision or rate) and its
    fixed component index read, verified on the probe values of every latent site."""
    plan = ctx.plan
    sites = plan.sites
    parent, selector, comp = sites[param.parent], param.selector, param.comp
    parent_desc = described(parent)
    value = ctx.base_params[child.name][key]
    if selector and sites[selector].n_cat != plan.sizes[comp]:
        why = f"{selector!r} has the wrong number of values"
        raise refuse(child.name, child.fn_name, parent_desc, why)
    coef = None
    form = form_coefficient(ctx, child, key, [parent]) if key in SCALED else None
    if form is not None:
        coef = _set_coefficient(ctx, param, form, ulps=0)
    if comp is not None and selector is None:
        coef = _read_fixed_index(ctx, child, key, param, coef)
    elif selector is not None and not set(sites[selector].dims) <= set(param.dims):
        why = f"{selector!r} has axes the child lacks"
        raise refuse(child.name, child.fn_name, parent_desc, why)
    if key in SCALED and coef is None:
        # c read off the base run as value / parent (a parameter computed outside the
        # operations a form follows), checked below
        base = _gathered(
            ctx,
            param,
            canon(parent, ctx.base_values[parent.pyro_name]),
            None
            if selector is None
            else canon(sites[selector], ctx.base_values[sites[selector].pyro_name]),
            value,
        )
        coef = _set_coefficient(ctx, param, value / base)
    # verify the hypothesis on random values of every latent site (one shared run)
    got = _verify_run(ctx)[child.name][key]
    expect = _gathered(ctx, param, ctx.probes[parent.name], ctx.probes.get(selector), value)
    if key in SCALED:
        expect = expect * coef
    if key in lookup(child.family).log_parameters:
        expect = expect.log()
    if not close(got, expect):
        why = f"its {key} is not a (selected) copy of the parent"
        raise refuse(child.name, child.fn_name, parent_desc, why)
    return param


def _verify_run(ctx: CompileContext) -> dict[str, dict[str, torch.Tensor]]:
    """The parameters of every site with every latent site at its probe value."""
    sites = ctx.plan.sites
    return probe_run(
        ctx, "verify", lambda: {n: to_pyro(sites[n], v) for n, v in ctx.probes.items()}
    )


def _gathered(
    ctx: CompileContext,
    param: Param,
    parent_value: torch.Tensor,
    selector_value: torch.Tensor | None,
    like: torch.Tensor,
) -> torch.Tensor:
    """The parent's value selected (by the selector's value, or by the fixed index) and
    broadcast into the parameter's layout (``like``: the dtype and device)."""
    plan = ctx.plan
    sites = plan.sites
    dims, comp = param.dims, param.comp
    parent_dims = tuple(param.rename[d] for d in sites[param.parent].dims)
    if comp is not None and param.selector is not None:
        selector = sites[param.selector]
        labels = selector_value
        if selector.fixed_mask is not None:
            labels = torch.where(selector.fixed_mask, selector.fixed.argmax(-1), selector_value)
        return select(parent_value, parent_dims, comp, labels, selector.dims, dims, plan.sizes)
    ops = [(parent_value, parent_dims)]
    if comp is not None:
        ops.append((param.index, param.index_dims))
    return ein(dims, ops, dims + ((comp,) if comp else ()), plan.sizes, like)


def _set_coefficient(
    ctx: CompileContext, param: Param, coef: torch.Tensor, ulps: int = 8
) -> torch.Tensor:
    """Store c of a precision c * tau in ``param`` (c I for a precision matrix: the scalar
    is kept), constant up to ``ulps`` where it was read off numbers; returns c as it
    multiplies the parent."""
    parent = ctx.plan.sites[param.parent]
    wishart = lookup(parent.family).matrix and lookup(parent.family).symbolic
    if wishart:
        coef = coef[..., 0, 0]
        param.coef, param.coef_dims = reduce_constant(coef, param.dims[:-2], ulps=ulps)
        return coef[..., None, None]
    param.coef, param.coef_dims = reduce_constant(coef, param.dims, ulps=ulps)
    return coef


def _read_fixed_index(
    ctx: CompileContext, child: Site, key: str, param: Param, coef: torch.Tensor | None
) -> torch.Tensor | None:
    """A fixed index: the component of each entry of the parameter, carried to it from
    the parent's value by the model's own indexing (origins of a form), else read off a
    run at values coded by component; stored as a one-hot in ``param``. Returns c (read
    here first where the index comes from a coded run)."""
    plan = ctx.plan
    parent, comp = plan.sites[param.parent], param.comp
    if key == "probs":  # normalised by the model: no coded run reads it
        raise refuse(child.name, child.fn_name, described(parent), DATA_LABELS)
    value = ctx.base_params[child.name][key]
    index = traced_index(ctx, child, key, parent, _component_code(ctx, param, value))
    if index is None:
        index, coef = _coded_index(ctx, child, key, param, coef)
    index, index_dims = reduce_constant(index, param.dims)
    if key == "probs" or not bool(((index >= 0) & (index < plan.sizes[comp])).all()):
        why = "the parent is not selected by an index"
        raise refuse(child.name, child.fn_name, described(parent), why)
    one_hot = torch.nn.functional.one_hot(index.clamp(0, plan.sizes[comp] - 1))
    param.index, param.index_dims = one_hot.to(value.dtype), index_dims + (comp,)
    return coef


#: why probabilities selected by labels that are data are refused, and the form to use
DATA_LABELS = (
    "its probs selects rows of the parent by labels given as data (a tensor, or a "
    "Categorical site observed with obs=), which VMP does not read for probabilities; "
    "declare the labels a Categorical site observed through obs_mask (an all-True mask "
    "observes every label), whose selection VMP reads exactly"
)


def _component_code(ctx: CompileContext, param: Param, like: torch.Tensor) -> torch.Tensor:
    """Each entry of the parent's value (canonical layout) coded by its component 0, 1, ...
    (on the device of ``like``)."""
    plan = ctx.plan
    parent = plan.sites[param.parent]
    parent_dims = tuple(param.rename[d] for d in parent.dims)
    at = parent_dims.index(param.comp)
    code = torch.arange(plan.sizes[param.comp], device=like.device)
    code = code.reshape([-1 if i == at else 1 for i in range(len(parent_dims))])
    return code.expand([plan.sizes[d] for d in parent.dims])


def _coded_index(
    ctx: CompileContext, child: Site, key: str, param: Param, coef: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The component index read off a run with the parent's entries coded by component
    (from 1 where the parameter is positive), c first from a run at unit precision where
    it is still unknown; returns the index and c."""
    plan = ctx.plan
    sites = plan.sites
    parent, comp = sites[param.parent], param.comp
    value = ctx.base_params[child.name][key]
    wishart = lookup(parent.family).matrix and lookup(parent.family).symbolic
    code = _component_code(ctx, param, value)
    if key in SCALED and coef is None:  # c first, from a run at unit precision
        units = probe_run(
            ctx,
            "ones",
            lambda: {
                n: to_pyro(sites[n], unit(plan, sites[n], value))
                for n in plan.latent
                if lookup(sites[n].family).symbolic
            },
        )
        coef = _set_coefficient(ctx, param, units[child.name][key])
    positive = key in SCALED or key == "concentration"  # coded from 1, not 0
    coded = code.to(value.dtype) + 1 if positive else code.to(value.dtype)
    if wishart:
        coded = coded[..., :1] * unit(plan, parent, value)
    try:
        run = probe_run(
            ctx, ("code", parent.name, comp), lambda: {parent.name: to_pyro(parent, coded)}
        )
    except (ValueError, RuntimeError) as err:  # the model rejects the coded values
        first = str(err).split("\n", 1)[0]
        why = (
            f"its {key} is not a copy of entries of {parent.name!r} selected by a fixed "
            f"index (the model fails when {parent.name!r} holds other values: {first})"
            f"{nearby_hint(child.family, key)}"
        )
        raise refuse(child.name, child.fn_name, described(parent), why) from None
    got = run[child.name][key]
    if key in SCALED:
        got = got / coef - 1
    elif positive:
        got = got - 1
    if wishart:
        got = got[..., :1, :1].expand(got.shape)
    return got.round().long(), coef


def traced_index(
    ctx: CompileContext, child: Site, key: str, parent: Site, code: torch.Tensor
) -> torch.Tensor | None:
    """The code (``code``: canonical layout of ``parent``) of the entry of the parent's
    value that each entry of parameter ``key`` of ``child`` copies, read off one run with
    the parent at its first value carrying those codes as origins
    (:func:`~probfsl.inference.vmp.monomials.origin`); ``None`` where the parameter
    is not a (scaled) copy of entries of that value alone."""
    if key == "probs":  # normalised by the model: not a fixed selection VMP supports
        return None
    values = dict(ctx.base_values)
    name = parent.pyro_name
    values[name] = Monomial.of(ctx.base_values[name], name, to_pyro(parent, code))
    run = trace_at(ctx, values)
    got = origin(read_parameters(child, run.nodes[child.pyro_name])[key], name)
    return None if got is None else plain(got)


def form_coefficient(
    ctx: CompileContext, child: Site, key: str, parents: list[Site]
) -> torch.Tensor | None:
    """c of the parameter ``key`` of ``child`` where it is c · Π τ over these ``parents``,
    read off its form in the first run (:mod:`~probfsl.inference.vmp.monomials`): the
    model's own constants, with no rounding. ``None`` where it has no such form."""
    form = ctx.forms.get((child.name, key))
    return coefficient(form, [p.pyro_name for p in parents])


def selected_constant(ctx: CompileContext, child: Site, key: str, selector: str) -> Param:
    """A fixed per-component table chosen by a Categorical site (``Vindex(c)[..., z]``)."""
    plan = ctx.plan
    dims = param_dims(child, key)
    chooser = plan.sites[selector]
    comp = f"{chooser.name}#cat"
    shape = [plan.sizes[d] for d in chooser.dims]

    def run(labels: torch.Tensor) -> torch.Tensor:
        """Parameter ``key`` of ``child`` with the selector at ``labels``."""
        values = dict(ctx.base_values)
        values[chooser.pyro_name] = to_pyro(chooser, labels)
        traced = trace_at(ctx, values)
        return site_parameters(ctx, child, traced.nodes[child.pyro_name])[key]

    if not set(chooser.dims) <= set(dims):
        why = "the selector has axes the child lacks"
        raise refuse(child.name, child.fn_name, repr(selector), why)
    table = torch.stack(
        [
            run(torch.full(shape, k, dtype=torch.long, device=plan.ref.device))
            for k in range(chooser.n_cat)
        ],
        -1,
    )
    generator = torch.Generator().manual_seed(3)
    probe = torch.randint(0, chooser.n_cat, shape, generator=generator, device=generator.device)
    probe = probe.to(plan.ref.device)
    labels = (
        probe
        if chooser.fixed_mask is None
        else torch.where(chooser.fixed_mask, chooser.fixed.argmax(-1), probe)
    )
    one_hot = torch.nn.functional.one_hot(labels, chooser.n_cat).to(table)
    expect = ein(
        dims,
        [(table, dims + (comp,)), (one_hot, chooser.dims + (comp,))],
        dims + (comp,),
        plan.sizes,
        table,
    )
    if not close(run(probe), expect):
        why = f"its {key} is not selected by it"
        raise refuse(child.name, child.fn_name, repr(selector), why)
    const, const_dims = reduce_constant(table, dims + (comp,))
    return Param(dims, const=const, const_dims=const_dims, comp=comp, selector=selector)


def product_map(ctx: CompileContext, child: Site, key: str, mains: list[str]) -> Param:
    """A precision c · Π_k τ_k of several Gamma sites (a scale mixture: a Student-t is a
    Normal whose precision is λ·u with u ~ Gamma(ν/2, ν/2) per point; docs/design/vmp.md
    §7.4). Each factor's axes are the child's (event axes right-aligned); c is read off
    the first run and checked on the random values of every latent site."""
    plan = ctx.plan
    sites, dims = plan.sites, param_dims(child, key)
    value = ctx.base_params[child.name][key]
    desc = ", ".join(f"{m!r} ({sites[m].fn_name})" for m in mains)
    renames = []
    for m in mains:
        parent = sites[m]
        rename = {d: d for d in parent.dims}
        n_events = parent.event_dim
        for j in range(n_events):
            rename[parent.dims[len(parent.dims) - n_events + j]] = dims[len(dims) - n_events + j]
        if any(rename[d] not in dims for d in parent.dims):
            why = "a factor of its precision has axes the child lacks"
            raise refuse(child.name, child.fn_name, desc, why)
        renames.append(rename)

    def product(values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Π_k τ_k at the factors' ``values`` (canonical layout, by site name)."""
        total = 1
        for m, rename in zip(mains, renames, strict=True):
            total = total * ein(
                dims,
                [(values[m], tuple(rename[d] for d in sites[m].dims))],
                dims,
                plan.sizes,
                value,
            )
        return total

    form = form_coefficient(ctx, child, key, [sites[m] for m in mains])
    if form is not None:
        coef, coef_dims = reduce_constant(form, dims)
    else:  # read off the base run (see :func:`param_map`)
        base = {m: canon(sites[m], ctx.base_values[sites[m].pyro_name]) for m in mains}
        coef, coef_dims = reduce_constant(value / product(base), dims, ulps=8)
    got = ctx.runs["verify"][child.name][key]
    expect = ein(dims, [(coef, coef_dims)], dims, plan.sizes, got) * product(ctx.probes)
    if not close(got, expect):
        why = f"its {key} is not c times the product of these sites"
        raise refuse(child.name, child.fn_name, desc, why)
    return Param(
        dims,
        parent=mains[0],
        rename=renames[0],
        coef=coef,
        coef_dims=coef_dims,
        factors=list(zip(mains[1:], renames[1:], strict=True)),
    )
