"""The updates and the bound of VMP: messages, natural parameters and ELBO terms.

Winn & Bishop (2005) §3-4, docs/design/vmp.md §1-2. For a latent site, η* = E[η(pa)] plus
the messages of its children (:func:`natural`); a child's message to a parent is the
coefficient of the parent's sufficient statistics in E ln p(child | pa) (:func:`message`);
the bound is Σ_sites E ln p(x | pa) + Σ_latent H[q] (:func:`elbo`). Every function takes
the :class:`~probfsl.inference.vmp.layout.Plan` and the current factors ``q`` (site name
-> the factor's parameters in the canonical layout) and contracts named axes with
:func:`~probfsl.inference.vmp.einsum.ein`.

Each site's prior term, messages and bound term are its family record's
(:meth:`~probfsl.inference.vmp.family.Family.natural`,
:meth:`~probfsl.inference.vmp.family.Family.message`,
:meth:`~probfsl.inference.vmp.family.Family.loglik`); where a record has none, they are a
linear child's (:mod:`~probfsl.inference.vmp.conjugate_children`) or a fixed prior's
(:func:`prior`), here.
"""

from __future__ import annotations

import torch

from probfsl.inference import expfam
from probfsl.inference.expfam.block import max_axis, sum_axis, sum_last, sum_terms
from probfsl.inference.vmp import (
    conjugate_children,
    dirichlet_points,
    gaussian_chain,
    grouped_plates,
)
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import TASKS, Plan, Site, constant, stat_dims
from probfsl.inference.vmp.moments import (
    block_of,
    broadcast_add,
    broadcast_shape,
    compact,
    compact_block,
    expected_stats,
    factor_block,
    keep_cholesky,
    point_mode,
)


def site_elbo(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """E_q[ln p(x_site | pa)], one value per task: the family's own term
    (:meth:`~probfsl.inference.vmp.family.Family.loglik`), a linear child's, or a fixed
    prior's."""
    s, out = plan.sites[name], (TASKS,)
    own = lookup(s.family).loglik(plan, q, s, out)
    if own is not None:
        return own
    if conjugate_children.linear_key(s) is not None:
        return conjugate_children.loglik(plan, q, s, out, with_weights=True)
    # E ln p = Σ_i η_i·⟨u_i⟩ − A(η) with η and Σ A fixed (computed once per plan)
    block, eta, a_total = prior(plan, s)
    lp = sum_terms(
        sum_last(t * u, n)
        for t, u, n in zip(eta, expected_stats(plan, q, name), block._stat_dims, strict=True)
    )
    return sum_tasks(sum_last(lp, block.event_dim)) - a_total


def prior(plan: Plan, s: Site) -> tuple:
    """The fixed prior block of a Gamma, Dirichlet, Wishart or Normal site (full layout),
    its natural parameters and its log-normaliser summed per task, cached in the plan (a
    plan of fewer tasks, :meth:`~probfsl.inference.vmp.layout.Plan.take`, computes them
    anew)."""
    hit = plan.cache.get(("prior", s.name))
    if hit is None:
        block = prior_block(plan, s)
        record = lookup(s.family)
        if record.elementwise:
            # elementwise families: on the distinct values, broadcast back (stride 0)
            small = compact_block(s, tuple(getattr(block, f) for f in record.fields))
            shape = broadcast_shape(tuple(getattr(block, f) for f in record.fields))
            natural = tuple(t.expand(shape) for t in small.natural())
            per_variable = small._log_normalizer().expand(shape)
            a_total = sum_tasks(sum_last(per_variable, block.event_dim))
        else:
            natural = block.natural()
            a_total = sum_tasks(block.log_normalizer())
        hit = (block, natural, a_total)
        plan.cache[("prior", s.name)] = hit
    return hit


def prior_block(plan: Plan, s: Site):
    """The fixed prior of a Gamma, Dirichlet or Normal site, in its full layout."""
    fields = lookup(s.family).fields
    keys = fields if set(fields) <= set(s.params) else list(s.params)  # in the block's order
    params = [s.params[k] for k in keys]
    full = [ein(p.dims, [(p.const, p.const_dims)], (), plan.sizes, p.const) for p in params]
    return block_of(s, tuple(full))


def _scalar_gaussian(s: Site) -> bool:
    """A site of the elementwise Gaussian family (messages of :mod:`.normal`)."""
    record = lookup(s.family)
    return record.gaussian and record.elementwise


def sum_tasks(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).sum(-1) if t.dim() > 1 else t


def elbo(plan: Plan, q: dict) -> torch.Tensor:
    """Σ_sites E ln p(x | pa) + Σ_latent H[q] per task (Winn & Bishop §3.3); with point
    estimates θ, the bound of p(data | θ) (variational EM)."""
    terms, no_site, no_entropy = [], set(), set()
    for name in plan.latent:  # Categorical factors just updated (see _lse_applies)
        hit = plan.cache.get(("lse", name))
        if hit is not None and hit[0] is q[name]:  # the very factor (tuple) it came from
            if all(q[n] is v for n, v in hit[2]):
                terms.append(hit[1])
                no_site.update([name] + [c for c, _ in plan.children[name]])
                no_entropy.add(name)
    for name, s in plan.sites.items():
        if s.point:  # a point estimate has neither a prior term nor an entropy
            continue
        if name not in no_site:
            terms.append(site_elbo(plan, q, name))
        if not s.observed and name not in no_entropy:
            terms.append(sum_tasks(entropy(plan, q, name)))
    return sum_terms(terms)


def lse_applies(plan: Plan, s: Site) -> bool:
    """Whether the ELBO terms of a Categorical factor q(z) = softmax(η) may be read off its
    update: when η is its prior's E ln π plus the per-component E ln N of its children,
    E ln p(z | π) + Σ_children E ln p(x | z, ·) + H[q(z)] = Σ_n ln Σ_k exp η_nk (the
    normaliser; PRML eq. 10.46-10.49), valid while no other factor has changed since.
    Needs no mask, no observed entries, and children that it selects and that depend on
    it through that selection alone: Normal sites, or linear children (an observed
    Categorical under a selected Dirichlet table, ...), whose message to it is their
    E ln p per component."""
    kids = plan.children[s.name]
    return (
        s.mask is None
        and s.fixed_mask is None
        and bool(kids)
        and all(role == "select" and _selected_only(plan.sites[c], s) for c, role in kids)
    )


def _selected_only(c: Site, s: Site) -> bool:
    """Whether child ``c`` of the label ``s`` is a Normal site or a linear child, with one
    parameter selected, by ``s``."""
    if not (_scalar_gaussian(c) or conjugate_children.linear_key(c) is not None):
        return False
    return {p.selector for p in c.params.values() if p.comp is not None} == {s.name}


def normal_selected(plan: Plan, name: str) -> bool:
    """Whether the child ``name`` of a label is a Normal site (its E ln N per component
    formed with the label's natural parameter: :meth:`Categorical.natural`)."""
    return _scalar_gaussian(plan.sites[name])


def entropy(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """H[q]: in closed form for Categorical (0 ln 0 = 0), Gaussian and Gamma factors, A − η·⟨u⟩
    with the cached ⟨u⟩ for the others; a Gaussian chain's joint entropy."""
    s = plan.sites[name]
    if s.chain:
        return gaussian_chain.entropy(plan, q, s)
    record = lookup(s.family)
    if record.compact_factor:
        # a − ln b + ln Γ(a) + (1 − a) ψ(a) = ln Γ(a) + a − a ψ(a) + ⟨ln τ⟩ (⟨ln τ⟩ cached),
        # the terms in a once per distinct shape (:func:`compact`)
        a = compact(q[name][0])
        h = torch.lgamma(a) + a - a * torch.special.digamma(a)
        return (h + expected_stats(plan, q, name)[1]).expand(broadcast_shape(q[name]))
    block = factor_block(plan, q, name)
    absent = absent_entries(plan, s) if record.labels else None
    if absent is not None:
        # entries that the model masks out with everything they explain are no part of it:
        # no prior term, no term of a child, no entropy
        return block.entropy().masked_fill(absent, 0)
    if record.labels or record.gaussian:  # in closed form
        return block.entropy()
    return -block.expected_log_prob(expected_stats(plan, q, name))


def absent_entries(plan: Plan, s: Site) -> torch.Tensor | None:
    """True (over the site's axes) for each entry of a latent Categorical that
    ``poutine.mask`` removes from the model together with every child's term that reads it
    (padding); None where there is none. An entry whose children are kept is still
    inferred from them and keeps its entropy, whatever its prior's mask (a masked prior
    with observed children is a likelihood, EM's objective with its entropy). Read once
    per plan (no host synchronisation)."""
    if s.mask is None:
        return None
    children = [plan.sites[name] for name, _ in plan.children[s.name]]
    if any(c.mask is None for c in children):
        return None
    return constant(plan, ("absent", s.name), lambda: _absent(plan, s, children), s.dims)


def _absent(plan: Plan, s: Site, children: list) -> torch.Tensor:
    sizes, ref = plan.sizes, plan.ref
    kept = ein(s.dims, [((s.mask != 0).to(ref.dtype), s.mask_dims)], s.dims, sizes, ref)
    for c in children:
        over = tuple(d for d in c.mask_dims if d not in s.dims)
        kept = kept + ein(s.dims, [((c.mask != 0).to(ref.dtype), c.mask_dims)], over, sizes, ref)
    return kept == 0


def natural(plan: Plan, q: dict, name: str, children: bool = True) -> tuple:
    """η* of a latent site: its prior's expected natural parameter (the family's
    :meth:`~probfsl.inference.vmp.family.Family.natural`, or its fixed prior's) plus
    (``children``) its children's messages (design §1)."""
    s, sizes = plan.sites[name], plan.sizes
    record = lookup(s.family)
    kids = plan.children[name] if children and not s.at_prior else []
    own = None if s.point else record.natural(plan, q, s, kids)
    if s.point:  # no prior term: the children's messages alone
        eta = [plan.ref.new_zeros([sizes[d] for d in dims]) for dims in stat_dims(s)]
    elif own is not None:
        eta, kids = own
    else:
        fixed = prior(plan, s)[1]
        eta = [
            t.expand([sizes[d] for d in dims]) for t, dims in zip(fixed, stat_dims(s), strict=True)
        ]
    if s.joint:  # a diagonal prior, a full second natural parameter (matrix messages)
        eta = [grouped_plates.to_factor(plan, s, i, t) for i, t in enumerate(eta)]
    for child, role in kids:
        for i, m in enumerate(message(plan, q, child, role, s)):
            if s.joint:  # over the factor's (merged) axis; an elementwise η₂ as a diagonal
                m = grouped_plates.to_factor(plan, s, i, m)
            eta[i] = broadcast_add(eta[i], m) if record.compact_factor else eta[i] + m
    return tuple(eta)


def message(plan, q, child: str, role: str, to: Site) -> list:
    """m_{child → to}: the coefficients of u(to) in E ln p(child | pa) (design §2 table),
    the child's family's (:meth:`~probfsl.inference.vmp.family.Family.message`) or a
    linear child's."""
    c = plan.sites[child]
    own = lookup(c.family).message(plan, q, c, role, to)
    return own if own is not None else conjugate_children.message(plan, q, c, role, to)


def update(plan: Plan, q: dict, name: str, children: bool = True) -> tuple:
    """The new factor of site ``name`` from its natural parameters (:func:`natural`): a
    softmax, a point's maximiser, or the family's block from η."""
    s = plan.sites[name]
    record = lookup(s.family)
    if record.labels and children and not s.at_prior and plan.children[name]:
        own = record.labels_update(plan, q, s)
        if own is not None:  # the family's own softmax (a table read off at labels)
            return labels_factor(plan, q, s, *own)
    eta = natural(plan, q, name, children)
    if s.point and any(role == "concentration" for _, role in plan.children[name]):
        return (dirichlet_points.m_step(q[name][0], *eta),)
    if s.point:
        return (point_mode(s, eta),)
    if record.labels:
        # in place where η is a new tensor (a child's message was added to the prior term:
        # :func:`natural`)
        owned = children and not s.at_prior and plan.children[name] and 0 not in eta[0].stride()
        r, m, z = softmax(eta[0], owned)
        if s.fixed_mask is not None:
            r = torch.where(s.fixed_mask.unsqueeze(-1), s.fixed, r)
        elif children and lse_applies(plan, s):
            return labels_factor(plan, q, s, r, sum_tasks((m + z.log()).squeeze(-1)))
        return (r,)
    if s.joint:
        return keep_cholesky(plan, name, expfam.MultivariateNormal.from_natural(*eta))
    if record.compact_factor:  # elementwise: on the distinct values, broadcast back
        b = record.block.from_natural(*(compact(t) for t in eta))
        shape, rate = record.fields  # from η = (−b, a − 1)
        return getattr(b, shape).expand(eta[1].shape), getattr(b, rate).expand(eta[0].shape)
    b = record.block.from_natural(*eta)
    if isinstance(b, expfam.MultivariateNormal):
        return keep_cholesky(plan, name, b)
    return tuple(getattr(b, f) for f in record.fields)


def softmax(eta: torch.Tensor, owned: bool) -> tuple:
    """The softmax of ``eta`` over its last axis, in fewer passes than torch's (in place
    where ``owned``), with its maximum and normaliser (the axis kept at size 1)."""
    m = max_axis(eta, keepdim=True)
    r = (eta.sub_(m) if owned else eta - m).exp_()
    z = sum_axis(r, keepdim=True)
    return r.div_(z), m, z


def labels_factor(plan: Plan, q: dict, s: Site, r: torch.Tensor, lse: torch.Tensor | None):
    """The factor ``(r,)`` of the label ``s``; with ``lse`` (Σ_n ln Σ_k exp η_nk per task,
    where :func:`lse_applies`), its ELBO terms kept for :func:`elbo` while no other factor
    changes."""
    factor = (r,)
    if lse is not None:
        others = [(n, q[n]) for n in plan.latent if n != s.name]
        plan.cache[("lse", s.name)] = (factor, lse, others)
    return factor
