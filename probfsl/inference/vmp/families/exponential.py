"""The Exponential family: positive data under a Gamma rate c · λ."""

from __future__ import annotations

import pyro.distributions as dist

from probfsl.inference.vmp.families.gamma import ObservedRateChild
from probfsl.inference.vmp.family import register
from probfsl.inference.vmp.layout import derived


@register
class Exponential(ObservedRateChild):
    """Observed x > 0 with rate c · λ, λ ~ Gamma: E ln p = ln c + ⟨ln λ⟩ − c x ⟨λ⟩, linear
    in u(λ) = (λ, ln λ), so the message to λ is (−Σ c x, Σ 1): the Gamma posterior
    (a + N, b + Σ c x)."""

    name = "Exponential"
    pyro_class = dist.Exponential
    forms = (
        "observed Exponential(rate = c * lambda <- Gamma site), optionally indexed by a "
        "Categorical site",
    )

    def support(self, value):
        return value.amin() > 0

    def outside(self, value):
        return value <= 0, "> 0"

    def linear_terms(self, plan, q, site):
        """u(λ) = (λ, ln λ): coefficients (−c x, 1), const ln c."""
        p, x = site.params["rate"], [(site.stats[0], site.dims)]
        c, lnc = [(p.coef, p.coef_dims)], [(derived(p, "log_coef"), p.coef_dims)]
        return [[(-1, c + x)], [(1, [])]], [(1, lnc)]
