"""Final checks of a read plan: what the parameter maps alone do not refuse
(docs/design/vmp.md §6.8).

Reads the plan once its parents, maps and chains are read (and the names of the
``pyro.param`` sites); returns nothing, and refuses with a ``ValueError`` naming the site
an observed count or probability whose law depends on no latent site, a Poisson rate
that is 0 where a count is observed, and a ``pyro.param`` no site uses or that is a
Dirichlet's concentration and also enters other sites. The checks of sites kept at their
prior (:func:`~probfsl.inference.vmp.at_prior.check`) and of Python branches
(:func:`~probfsl.inference.vmp.branches.check`) live with their features.
"""

from __future__ import annotations

from collections.abc import Iterable

from probfsl.inference.vmp.checks import first_offender, refuse
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import TASKS, Param, Plan, Site


def mark_unit_coefficients(plan: Plan) -> None:
    """Mark each coefficient c of a precision or rate c · τ that is exactly 1 (no factor,
    ln c = 0 in the sweeps)."""
    for p in (p for s in plan.sites.values() for p in s.params.values() if p.coef is not None):
        p.unit_coef = bool((p.coef == 1).all())


def check_counts(plan: Plan) -> None:
    """``ValueError`` naming the site for an observed Poisson, Bernoulli or Binomial
    whose rate or probabilities depend on no latent site (a fixed law, or a rate
    c · λ with every c = 0, which makes it fixed at 0), and for a Poisson rate c · λ
    with c = 0 where a count above 0 is observed (:func:`check_exposures`); one host
    synchronisation per such site."""
    for s in plan.sites.values():
        record = lookup(s.family)
        if not s.observed or not record.needs_latent_parent or "logits" in s.params:
            continue
        key = record.linear_parameter
        p = s.params[key]
        if p.parent is None:
            zero = record.positive_exposure and p.const is not None and not bool(p.const.any())
            why = (
                "its rate is 0 (an exposure of 0?), so it does not depend on its Gamma "
                "parent; a rate c * lambda needs every exposure c > 0"
                if zero
                else f"its {key} is fixed (it depends on no latent site); an observed "
                f"{s.fn_name}'s {key} must be {record.hints[key]}"
            )
            raise refuse(s.name, s.fn_name, "-", why)
        if record.positive_exposure and p.coef is not None:
            check_exposures(plan, s, p)


def check_exposures(plan: Plan, s: Site, p: Param) -> None:
    """``ValueError`` naming the site and the first entry where a Poisson rate c · λ
    has c = 0 (an exposure of 0) but a count above 0 is observed: a rate of 0 gives
    such a count probability 0 (ln 0 in the bound). At a count of 0 the entry has
    probability one and adds nothing (0 ln 0 = 0), and is accepted."""
    zero = p.coef <= 0
    if not bool(zero.any()):
        return
    dims, sizes = s.dims, plan.sizes
    zero = ein(dims, [(zero.to(s.value.dtype), p.coef_dims)], dims, sizes, s.value)
    bad = (zero > 0) & (s.value > 0)
    if s.mask is not None:
        bad = bad & (ein(dims, [(s.mask, s.mask_dims)], dims, sizes, s.value) > 0)
    at = first_offender(bad)
    if at is None:
        return
    where = ", ".join(f"{'task' if d == TASKS else d} {i}" for d, i in zip(dims, at, strict=True))
    raise refuse(
        s.name,
        s.fn_name,
        f"{p.parent!r} (Gamma)",
        f"its rate c * {p.parent} is 0 at {where} (an exposure of 0?) where the count "
        f"{float(s.value[at]):g} is observed, which a rate of 0 gives probability 0; "
        "a rate c * lambda needs an exposure c > 0 wherever a count is above 0",
    )


def check_points_used(plan: Plan, points: Iterable[str]) -> None:
    """``ValueError`` for a ``pyro.param`` site (``points``: their names) that no site uses
    as a parameter, or that is a Dirichlet's concentration and also enters other sites."""
    for name in points:
        roles = {role for _, role in plan.children[name]}
        if not roles:
            raise ValueError(
                f"VMP cannot point-estimate the pyro.param site {name!r}: no site uses it "
                "as a parameter"
            )
        if "concentration" in roles and len(roles) > 1:
            raise ValueError(
                f"VMP cannot point-estimate the pyro.param site {name!r}: it is a "
                "Dirichlet's concentration and also enters other sites"
            )
