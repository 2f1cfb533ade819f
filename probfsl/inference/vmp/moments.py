"""Expected statistics of the factors of VMP, in the canonical layout.

⟨u(x)⟩ of every site (observed values, or the moments of its factor q), cached per factor
in the plan and shared by every message and bound term that reads them (Winn & Bishop
(2005) §3: a node's messages to its children are its expected statistics).
"""

from __future__ import annotations

import torch

from probfsl.inference import expfam
from probfsl.inference.vmp.layout import Plan, Site, stat_dims

FIELDS = {
    "MultivariateNormal": ("loc", "precision"),
    "Wishart": ("df", "scale"),
    "Normal": ("loc", "precision"),
    "Gamma": ("shape", "rate"),
    "Dirichlet": ("concentration",),
    "Categorical": ("probs",),
    "Beta": ("concentration1", "concentration0"),
}


BLOCKS = {
    "MultivariateNormal": expfam.MultivariateNormal,
    "Wishart": expfam.Wishart,
    "Normal": expfam.Normal,
    "Gamma": expfam.Gamma,
    "Dirichlet": expfam.Dirichlet,
    "Categorical": expfam.Categorical,
    "Beta": expfam.Beta,
}


def expected_stats(plan: Plan, q: dict, name: str) -> tuple:
    """⟨u⟩ of a site in its canonical layout: observed values or the factor's moments.
    A joint Normal site (:attr:`~probfsl.inference.vmp.layout.Site.joint`) reports the
    elementwise (⟨x⟩, ⟨x²⟩) that its Normal prior and copy-children use; its full second
    moment is :func:`second_moment`."""
    s = plan.sites[name]
    if s.observed:
        return s.stats
    hit = plan.cache.get(name)
    if hit is not None and hit[0] is q[name]:
        return hit[1]
    stats = point_stats(s, q[name][0]) if s.point else block_of(s, q[name]).expected_stats()
    if s.joint and not s.point:
        stats = (stats[0], stats[1].diagonal(dim1=-2, dim2=-1))
    plan.cache[name] = (q[name], stats)
    return stats


def second_moment(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """⟨x xᵀ⟩ over the last event axis of a joint Normal or MultivariateNormal factor."""
    hit = plan.cache.get(("second", name))
    if hit is not None and hit[0] is q[name]:
        return hit[1]
    s = plan.sites[name]
    if s.point:
        value = q[name][0]
        second = value.unsqueeze(-1) * value.unsqueeze(-2)
    else:
        second = block_of(s, q[name]).expected_stats()[1]
    plan.cache[("second", name)] = (q[name], second)
    return second


def block_of(s: Site, params: tuple):
    """The factor of site ``s`` with parameters ``params`` as an exponential-family block
    (a joint Normal site's factor is a MultivariateNormal over its last event axis)."""
    return (expfam.MultivariateNormal if s.joint else BLOCKS[s.family])(*params)


def parent_ops(plan, q, s, key):
    """Operands of the parameter ``key`` of site ``s``: a list per statistic."""
    p = s.params[key]
    if p.parent is None:
        return None
    stats = expected_stats(plan, q, p.parent)
    sd = stat_dims(plan.sites[p.parent])
    return [(t, tuple(p.rename[d] for d in dims)) for t, dims in zip(stats, sd, strict=True)]


def weights(plan, q, s):
    """The selection weights of a mixture site: (tensor, axes) or None, and comp."""
    for p in s.params.values():
        if p.comp is None:
            continue
        if p.selector is None:
            return [(p.index, p.index_dims)], p.comp
        z = plan.sites[p.selector]
        r = q[p.selector][0]
        return [(r, z.dims + (p.comp,))], p.comp
    return [], None


def point_stats(s: Site, value: torch.Tensor) -> tuple:
    """u(θ) of a point estimate θ, in the statistics of its family."""
    if s.family == "Gamma":
        return value, value.log()
    if s.family == "Normal":
        return value, value.square()
    if s.family == "Beta":
        return value.log(), (-value).log1p()
    # Dirichlet: a probability of exactly 0 (a component no entry takes) has ln π clamped
    # at ln(tiny) as fixed probabilities are, so that its terms 0 · ln π stay 0
    return (value.clamp_min(torch.finfo(value.dtype).tiny).log(),)


def point_mode(s: Site, eta: tuple) -> torch.Tensor:
    """argmax_θ η·u(θ): the point that maximises its children's terms (spec §7.2), e.g.
    a precision θ = −η₂/η₁ = Σ ½ / Σ ½⟨(x − m)²⟩ (an EM step of type-II maximum likelihood)."""
    if s.family == "Gamma":
        return -eta[1] / eta[0]
    if s.family == "Normal" and s.joint:
        return torch.linalg.solve(-2 * eta[1], eta[0])
    if s.family == "Normal":
        return -eta[0] / (2 * eta[1])
    if s.family == "Beta":
        return eta[0] / (eta[0] + eta[1])
    return eta[0] / eta[0].sum(-1, keepdim=True)  # Dirichlet


def precision_factors(plan: Plan, q: dict, s: Site) -> list:
    """(name, [⟨τ⟩ operand, ⟨ln τ⟩ operand]) of each Gamma factor of the precision of the
    Normal site ``s`` (none when it is fixed)."""
    p = s.params["precision"]
    if p.parent is None:
        return []
    out = [(p.parent, parent_ops(plan, q, s, "precision"))]
    for name, rename in p.factors:
        stats = expected_stats(plan, q, name)
        dims = tuple(rename[d] for d in plan.sites[name].dims)
        out.append((name, [(stats[0], dims), (stats[1], dims)]))
    return out
