"""Parameters that change with the latent values where the model's operations do not show it.

The compiler reads how each parameter depends on the latent sites from a few runs of the
model (:mod:`~probfsl.inference.vmp.compiler`). A Python branch on a latent value that
changes only a parameter, e.g. ``sd = 1.0 if float(mu.sum()) > 0 else 2.0``, leaves the
sites and their shapes as they were, and where every one of those runs falls on the same
side of the branch the parameter is read as fixed. The structure check's runs, on the
first task, include latent values at both ends of each site's support (every Normal value
+3, then -3; every Gamma value 20, then 0.05; ...: :func:`extreme`), which such a
branch on a sign or a magnitude crosses. :func:`check` predicts every parameter of every
site on those runs from the plan (a constant, c · parent, a selected copy, an affine or
bilinear map) and refuses the model where the run disagrees.

Changes are compared against the first task's base run (the prediction's change between
the two runs against the run's), so that a fixed parameter the model computes from every
task's data (a prior mean read off all the tasks) is not mistaken for one that moves.

A branch that none of these runs crosses (a threshold beyond the probe values, a
condition on a combination of entries they do not produce) is not seen; nor are branches
in the parameters of a ``DiscreteHMM``, which is not predicted here.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.grouped_plates import contracted
from probfsl.inference.vmp.layout import TASKS, Param, Plan, Site, _take_param, canon
from probfsl.inference.vmp.monomials import plain
from probfsl.inference.vmp.selection import select

#: the two probe patterns of :func:`extreme`
PATTERNS = ("high", "low")


def extreme(family: str, shape: list, n_cat: int, pattern: str) -> torch.Tensor | None:
    """A value of a latent site of ``family`` and ``shape`` at one end of its support
    (float64 or int64, on the CPU): every entry +3 (``"high"``) or -3 (``"low"``) for a
    Gaussian, 20 or 0.05 for a Gamma (20 I or 0.05 I for a Wishart), 0.95 or 0.05 for a
    Beta, nearly all mass on the last or the first category for a Dirichlet, the last or
    the first label for a Categorical (:meth:`~probfsl.inference.vmp.family.Family.extreme`);
    ``None`` for another family."""
    return lookup(family).extreme(shape, n_cat, pattern)


def _gathered(plan: Plan, sizes: dict, p: Param, values: dict, ref: torch.Tensor):
    """The parent's value of a parameter c · parent (· Π factors), selected and broadcast
    into the parameter's layout, times c."""
    sites, dims = plan.sites, p.dims
    parent = sites[p.parent]
    pdims = tuple(p.rename[d] for d in parent.dims)
    pv = values[parent.name]
    if p.comp is not None and p.selector is not None:
        z = sites[p.selector]
        eff = _effective(z, values[z.name], sizes)
        out = select(pv, pdims, p.comp, eff, z.dims, dims, sizes)
    elif p.comp is not None:
        ops = [(pv, pdims), (p.index, p.index_dims)]
        out = ein(dims, ops, dims + (p.comp,), sizes, ref)
    else:
        out = ein(dims, [(pv, pdims)], dims, sizes, ref)
    for name, rename in p.factors:
        fdims = tuple(rename[d] for d in sites[name].dims)
        out = out * ein(dims, [(values[name], fdims)], dims, sizes, ref)
    if p.coef is not None:
        out = out * ein(dims, [(p.coef, p.coef_dims)], dims, sizes, ref)
    return out


def _effective(z: Site, value: torch.Tensor, sizes: dict) -> torch.Tensor:
    """A selector's labels with its observed entries (``obs_mask``) in place."""
    if z.fixed_mask is None:
        return value
    n = sizes[TASKS]
    return torch.where(z.fixed_mask[:n], z.fixed[:n].argmax(-1), value)


def predict(plan: Plan, sizes: dict, s: Site, key: str, p: Param, values: dict, ref):
    """Parameter ``key`` of ``s`` as the plan has it at the latent ``values`` (canonical
    layout), with a bound on its rounding; ``None`` where the plan's form is not one
    predicted here."""
    if not lookup(s.family).predictable:
        return None
    dims = p.dims
    size = 0
    if p.parent is not None:
        if p.terms or p.bilinear is not None:
            return None
        out = _gathered(plan, sizes, p, values, ref)
        return out, out.abs()
    out = torch.zeros((), dtype=ref.dtype, device=ref.device)
    if p.const is not None:
        if p.comp is not None and p.selector is not None:  # a selected fixed table
            z = plan.sites[p.selector]
            eff = _effective(z, values[z.name], sizes)
            one_hot = torch.nn.functional.one_hot(eff, z.n_cat).to(ref.dtype)
            ops = [(p.const, p.const_dims), (one_hot, z.dims + (p.comp,))]
            out = ein(dims, ops, dims + (p.comp,), sizes, ref)
        elif p.comp is not None:
            return None
        else:
            out = ein(dims, [(p.const, p.const_dims)], dims, sizes, ref)
        size = out.abs()
    n = 1
    for t in p.terms:
        w = plan.sites[t.parent]
        over = dims + contracted(t.axis)
        ops = [(t.jac, t.jac_dims), (values[t.parent], w.dims)]
        out = out + ein(dims, ops, over, sizes, ref)
        ops = [(t.jac.abs(), t.jac_dims), (values[t.parent].abs(), w.dims)]
        size = size + ein(dims, ops, over, sizes, ref)
        n += math.prod(sizes[a] for a in contracted(t.axis))
    b = p.bilinear
    if b is not None:
        u, v = plan.sites[b.u], plan.sites[b.v]
        over = dims + tuple(a for a in (b.axis_u, b.axis_v) if a)
        ops = [(b.h, b.h_dims), (values[b.u], u.dims), (values[b.v], v.dims)]
        out = out + ein(dims, ops, over, sizes, ref)
        ops = [(b.h.abs(), b.h_dims), (values[b.u].abs(), u.dims), (values[b.v].abs(), v.dims)]
        size = size + ein(dims, ops, over, sizes, ref)
        n += sizes[b.axis_u] if b.axis_u else 1
        n += sizes[b.axis_v] if b.axis_v else 1
    return out.expand([sizes[d] for d in dims]), n * size


def check(plan: Plan, runs: list, one_task: bool, read_params, dtype: torch.dtype) -> None:
    """``ValueError`` naming the site and the parameter where a parameter of ``runs[i]``
    (traces of the model, ``runs[0]`` the base) changes from the base run by other than
    what the plan predicts from the latent values of the two runs. ``one_task``: the runs
    hold the first task alone (the plan's tensors are sliced to it). ``read_params(site,
    node)`` is the compiler's canonical reading of a site's parameters."""
    if len(runs) < 2:
        return
    # On the first task alone, an argument of the tasks' length that is not per task is
    # sliced too, and the runs compute another model than the plan's (a scale per point
    # read as one per task). So each parameter is held to what holds whatever the data:
    # a fixed one to its value in the base run, c · parent to the parent's ratio between
    # the runs, and a map to the plan's prediction where the base run agrees with it.
    n = 1 if one_task else plan.sizes[TASKS]
    sizes = dict(plan.sizes)
    sizes[TASKS] = n
    ref = plan.ref
    first = torch.zeros(1, dtype=torch.long, device=ref.device)
    sites = {name: _resized(s, n) for name, s in plan.sites.items()} if one_task else plan.sites
    view = Plan(sites, plan.latent, sizes, plan.children, ref) if one_task else plan

    def read(tr) -> tuple[dict, dict]:
        values = {}
        for name in needed:
            s = sites[name]
            if s.point:  # its initial value in every run (of every task: sliced)
                values[name] = s.init[:n]
                continue
            v = plain(tr.nodes[s.pyro_name]["value"])
            v = canon(s, v.expand(*s.batch_shape, *s.event_shape))
            values[name] = v.to(ref.dtype) if v.is_floating_point() else v.to(ref.device)
        params = {}
        for name, s in sites.items():
            if not lookup(s.family).predictable:
                continue
            try:
                got = read_params(s, tr.nodes[s.pyro_name])
            except RuntimeError:  # on one task, a parameter of every task's point estimate
                continue
            params[name] = {k: plain(v) for k, v in got.items()}
        return values, params

    needed = [n for n in plan.latent if plan.children[n]]  # the parents' values
    base_values, base_params = read(runs[0])
    eps = torch.finfo(dtype if dtype is not None else ref.dtype).eps

    def near(got, expect, size):
        bound = 1e-5 * expect.abs() + 1e-6 * got.abs().amax() + 16 * eps * size
        return ((got - expect).abs() <= bound).all()

    checks = []  # (site, key, the parameter sliced to the runs' tasks, kind, base prediction)
    for name, s in sites.items():
        for key, p in s.params.items():
            if name not in base_params or key not in base_params[name]:
                continue
            p = _take_param(p, first) if one_task else p
            if p.parent is None and not p.terms and p.bilinear is None and p.comp is None:
                checks.append((name, key, p, "fixed", None))
                continue
            base = predict(view, sizes, s, key, p, base_values, ref)
            if base is None:
                continue
            if p.parent is not None:
                checks.append((name, key, p, "scaled", base))
            else:  # a map: checked where the base run is the plan's prediction
                faithful = near(base_params[name][key], *base)
                checks.append((name, key, p, "map", (*base, faithful)))
    agree = []  # one 0-d bool per (run, parameter), read with one host synchronisation
    for tr in runs[1:]:
        values, params = read(tr)
        for name, key, p, kind, base in checks:
            if name not in params:
                agree.append(torch.ones((), dtype=torch.bool, device=ref.device))
                continue
            got_b, got = base_params[name][key], params[name][key]
            if kind == "fixed":  # the same in every run
                agree.append(near(got, got_b, got_b.abs()))
                continue
            pred, size = predict(view, sizes, sites[name], key, p, values, ref)
            if kind == "scaled":  # c · parent: the change as a ratio, whatever c
                left, right = got * base[0], got_b * pred
                agree.append(near(left, right, left.abs() + right.abs()))
            else:
                agree.append(near(got, pred, size).logical_or(base[2].logical_not()))
    if not agree or bool(torch.stack(agree).all()):
        return
    name, key, _, _, _ = checks[int(torch.stack(agree).logical_not().nonzero()[0]) % len(checks)]
    s = sites[name]
    # the name a refusal gives the parameter (the canonical layout reads a precision)
    label = lookup(s.family).model_names.get(key, key)
    raise ValueError(
        f"VMP cannot follow site {name!r} ({s.fn_name}): its {label} changes with the "
        "latent values in a way the model's operations do not show (a Python branch on a "
        "latent value?); message passing needs each parameter to be the same function of "
        "the latent sites at every value"
    )


def _resized(s: Site, n: int) -> Site:
    """``s`` with ``n`` tasks in its Pyro batch shape (for reading a run of fewer tasks)."""
    at = s.keep[s.perm[0]]
    shape = list(s.batch_shape)
    shape[at] = n
    return replace(s, batch_shape=tuple(shape))
