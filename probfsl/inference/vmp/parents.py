"""Parent discovery: which latent sites each parameter of each site depends on, and how
(docs/design/vmp.md §6.5).

Reads the plan with its sites read and the first trace; returns the context the
parameter maps read (:func:`reading_context`: the first run's latent values, parameters
and forms, the probe values) and fills the plan (:func:`find_parents`: every site's
``params`` and the parents' ``children`` lists). Site-level parents come from Pyro's
provenance tracking (``pyro.infer.inspect.get_dependencies``); one run with every latent
site at a random probe value shows which parameters move; the candidates are the parents
whose family fits the parameter's role (the family record's ``roles``), told apart by a
run with each moved alone where two share a family (:func:`moving_parents`). How they
enter is then read by :mod:`~probfsl.inference.vmp.parameter_maps` and
:mod:`~probfsl.inference.vmp.affine_maps`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import pyro
import torch
from pyro.distributions import constraints
from pyro.poutine.trace_struct import Trace

from probfsl.inference.vmp.affine_maps import bilinear_map, linear_map
from probfsl.inference.vmp.checks import check_parameters, data_device, refuse, tensor_key
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import TASKS, Param, Plan, Site, to_pyro
from probfsl.inference.vmp.matrix_maps import is_matrix, matrix_vector_map
from probfsl.inference.vmp.monomials import plain
from probfsl.inference.vmp.parameter_maps import SCALED, described, nearby_hint, param_map
from probfsl.inference.vmp.tracing import (
    DrawLatent,
    every_site_parameters,
    first_task,
    model_failed,
    probe_run,
    probe_values,
    site_parameters,
    trace_at,
)


def reading_context(ctx: CompileContext, plan: Plan, trace: Trace) -> CompileContext:
    """The context with the plan being built, the latent values and every site's
    parameters in the first run (``trace``), the forms c · Π τ of its precisions and
    rates (those that Gamma or Wishart sites enter), and the probe values."""
    sites = plan.sites
    base_values = {
        sites[n].pyro_name: plain(trace.nodes[sites[n].pyro_name]["value"]) for n in plan.latent
    }
    # the first trace took these very values: its parameters are the base ones
    first = {n: site_parameters(ctx, s, trace.nodes[s.pyro_name]) for n, s in sites.items()}
    forms = {(n, k): v for n, ps in first.items() for k, v in ps.items() if k in SCALED}
    base_params = {n: {k: plain(v) for k, v in ps.items()} for n, ps in first.items()}
    return replace(
        ctx,
        plan=plan,
        base_values=base_values,
        base_params=base_params,
        forms=forms,
        probes=probe_values(plan),
        runs={},
    )


def site_dependencies(ctx: CompileContext) -> dict:
    """Pyro's provenance tracking of the model: each site's latent dependencies, by Pyro
    name (on the first task alone where the model runs on it: cheaper)."""
    from pyro.infer.inspect import get_dependencies

    args, kwargs = ctx.args, ctx.kwargs
    deps = None
    model = DrawLatent(0, ctx.dtype)(ctx.model)  # the compiler's values, as every run
    one = first_task(args, kwargs, ctx.plan.sizes[TASKS])
    if one is not None:  # the structure of one task (cheaper); all tasks if that fails
        with contextlib.suppress(Exception), data_device(args, kwargs):
            deps = get_dependencies(model, *one)["prior_dependencies"]
    if deps is None:  # Pyro computes each site's log-density here
        try:
            with data_device(args, kwargs):
                deps = get_dependencies(model, args, kwargs)["prior_dependencies"]
        except (NotImplementedError, RuntimeError) as err:
            raise model_failed(err, args, kwargs) from None
    return deps


def _verifying_run(ctx: CompileContext) -> None:
    """The run with every latent site at its probe value: which parameters move, and the
    values every map is verified on (``ctx.runs["verify"]``); ``ValueError`` where a
    parameter leaves its support there."""
    sites = ctx.plan.sites
    values = dict(ctx.base_values)
    values.update({sites[n].pyro_name: to_pyro(sites[n], v) for n, v in ctx.probes.items()})
    with pyro.validation_enabled(False):
        run = trace_at(ctx, values)
    check_parameters(
        [run.nodes[x.pyro_name] for x in sites.values()],
        " when the latent sites it depends on take other values (a pyro.param used as a "
        "scale, rate or precision needs constraint=constraints.positive)",
        checked={tensor_key(t) for t in ctx.checked},
    )
    ctx.runs["verify"] = every_site_parameters(ctx, run)


def find_parents(ctx: CompileContext) -> None:
    """Every parameter map of every site of ``ctx.plan`` (module docstring), each parent's
    ``children`` list, then the per-site checks of selections."""
    plan = ctx.plan
    sites = plan.sites
    deps = site_dependencies(ctx)
    logical = {sites[n].pyro_name: n for n in plan.latent}
    _verifying_run(ctx)
    for name, site in sites.items():
        candidates = [
            logical[d] for d in deps.get(site.pyro_name, {}) if d in logical and logical[d] != name
        ]
        for key in ctx.base_params[name]:
            if key == "logits":  # read only for Pólya-Gamma logits (below)
                continue
            _read_parameter(ctx, site, key, candidates)
        name_selected_constants(site)
        check_selectors(site)


def _read_parameter(ctx: CompileContext, site: Site, key: str, candidates: list[str]) -> None:
    """Parameter ``key`` of ``site`` read off the model (``candidates``: the site's latent
    parents by provenance), linked into its parents' ``children``."""
    plan = ctx.plan
    sites = plan.sites
    moved = not torch.equal(ctx.runs["verify"][site.name][key], ctx.base_params[site.name][key])
    gaussian = [p for p in candidates if lookup(sites[p].family).gaussian]
    if moved and key == "probs" and lookup(site.family).logistic and gaussian:
        _read_logits(ctx, site, candidates, gaussian)
        return
    parents = []
    if moved:
        parents = _fitting_parents(ctx, site, key, candidates)
        parents = moving_parents(ctx, site, key, parents)
    param = _parameter_map(ctx, site, key, parents)
    site.params[key] = param
    if key == "concentration" and param.parent is not None:  # a Dirichlet's
        check_dirichlet_concentration(site, sites[param.parent])
    _link_children(plan, site.name, key, param)


def _read_logits(
    ctx: CompileContext, site: Site, candidates: list[str], gaussian: list[str]
) -> None:
    """Probabilities that move with Gaussian parents, read as logits affine in them:
    Pólya-Gamma augmentation (docs/design/vmp.md §7.3)."""
    if len(gaussian) < len(candidates):
        others = ", ".join(repr(p) for p in candidates if p not in gaussian)
        raise refuse(
            site.name,
            site.fn_name,
            others,
            "logits affine in Normal sites are supported; these parents also "
            "move its probabilities",
        )
    param = linear_map(ctx, site, "logits", gaussian)
    site.params["logits"] = param
    for term in param.terms:
        ctx.plan.children[term.parent].append((site.name, "logits"))


def _fitting_parents(ctx: CompileContext, site: Site, key: str, candidates: list[str]) -> list[str]:
    """The ``candidates`` whose family fits the role of parameter ``key`` (the family
    record's ``roles``); ``ValueError`` where none does (a parameter that moves with no
    conjugate parent)."""
    sites = ctx.plan.sites
    fits = lookup(site.family).roles.get(key, ())
    parents = [p for p in candidates if sites[p].family in fits]
    if parents:
        return parents
    desc = ", ".join(described(sites[p]) for p in candidates) or "-"
    why = f"its {key} depends on them non-conjugately{nearby_hint(site.family, key)}"
    if key in SCALED and any(
        sites[p].point and lookup(sites[p].family).point_constraint is constraints.real
        for p in candidates
    ):
        why += (
            "; a pyro.param used as a scale, rate or precision needs "
            "constraint=constraints.positive"
        )
    raise refuse(site.name, site.fn_name, desc, why)


def moving_parents(ctx: CompileContext, site: Site, key: str, candidates: list[str]) -> list:
    """The ``candidates`` that move parameter ``key`` of ``site`` (site-level provenance
    names every parent of the site; where two candidates share a family, one run with
    each at its random value alone tells them apart)."""
    sites = ctx.plan.sites
    families = [sites[p].family for p in candidates if not lookup(sites[p].family).labels]
    if len(families) == len(set(families)):
        return candidates
    base = ctx.base_params[site.name][key]
    moving = []
    for p in candidates:
        if lookup(sites[p].family).labels:
            moving.append(p)
            continue
        alone = probe_run(ctx, ("alone", p), _alone(ctx, p))
        if not torch.equal(alone[site.name][key], base):
            moving.append(p)
    return moving


def _alone(ctx: CompileContext, name: str) -> Callable[[], dict[str, torch.Tensor]]:
    """The latent values of a run with site ``name`` alone at its probe value."""
    site = ctx.plan.sites[name]
    return lambda: {name: to_pyro(site, ctx.probes[name])}


def _parameter_map(ctx: CompileContext, site: Site, key: str, parents: list[str]) -> Param:
    """How ``parents`` enter parameter ``key`` of ``site``: a (selected, scaled) copy, a
    product or a selected table (:func:`~probfsl.inference.vmp.parameter_maps.param_map`),
    else, for the family's affine parameter, a latent matrix times a latent vector
    (:mod:`~probfsl.inference.vmp.matrix_maps`), an affine map of Gaussian sites, else a
    bilinear map of two."""
    try:
        return param_map(ctx, site, key, parents)
    except ValueError:
        sites = ctx.plan.sites
        if key != lookup(site.family).affine_parameter or any(
            lookup(sites[p].family).labels for p in parents
        ):
            raise
        if any(is_matrix(sites[p]) for p in parents):  # M x with M a latent matrix
            return matrix_vector_map(ctx, site, key, parents)
        try:
            return linear_map(ctx, site, key, parents)
        except ValueError:
            if len(parents) != 2:
                raise
            return bilinear_map(ctx, site, key, parents)


def _link_children(plan: Plan, name: str, key: str, param: Param) -> None:
    """Record site ``name`` (through parameter ``key``) as a child of every latent site
    ``param`` reads: its parent, the factors of a product, the terms of an affine map, the
    two sites of a bilinear one, and the selecting Categorical (once, as ``"select"``)."""
    if param.parent is not None:
        plan.children[param.parent].append((name, key))
    for factor, _ in param.factors:
        plan.children[factor].append((name, key))
    for term in param.terms:
        plan.children[term.parent].append((name, key))
    if param.bilinear is not None:
        plan.children[param.bilinear.u].append((name, key))
        plan.children[param.bilinear.v].append((name, key))
    if param.selector is not None and (name, "select") not in plan.children[param.selector]:
        plan.children[param.selector].append((name, "select"))


def name_selected_constants(site: Site) -> None:
    """Give a selected constant table the component axis of the site's selected parents."""
    named = {p.selector: p.comp for p in site.params.values() if p.parent and p.comp}
    for p in site.params.values():
        placeholder = f"{p.selector}#cat"
        if p.parent is None and p.comp == placeholder and p.selector in named:
            p.comp = named[p.selector]
            p.const_dims = tuple(p.comp if d == placeholder else d for d in p.const_dims)


def check_selectors(site: Site) -> None:
    """``ValueError`` for a site whose parameters select components by different
    indices (selectors, or fixed indices)."""
    gathered = [p for p in site.params.values() if p.comp is not None]
    if len({(p.comp, p.selector) for p in gathered}) > 1:
        raise refuse(
            site.name,
            site.fn_name,
            "-",
            "its parameters select components by different indices",
        )
    if len({p.comp for p in gathered if p.index is not None}) > 1 or (
        len(gathered) > 1 and gathered[0].index is not None
    ):
        indices = [p.index for p in gathered]
        if any(not torch.equal(indices[0], i) for i in indices[1:]):
            raise refuse(site.name, site.fn_name, "-", "its parameters use different indices")


def check_dirichlet_concentration(site: Site, parent: Site) -> None:
    """A Dirichlet's concentration may depend on a point estimate (an M step by Minka's
    fixed point) of an observed Dirichlet, not on a latent site (no conjugate form)."""
    if not (parent.point and site.observed):
        raise refuse(
            site.name,
            site.fn_name,
            described(parent),
            "the concentration of an observed Dirichlet may be a point estimate "
            "(pyro.param with constraint positive), not a latent site",
        )
