"""The Poisson family: counts under a Gamma rate c · λ (c an exposure)."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.families.gamma import ObservedRateChild
from probfsl.inference.vmp.family import register
from probfsl.inference.vmp.layout import constant, derived


@register
class Poisson(ObservedRateChild):
    """Observed k: E ln p = k⟨ln λ⟩ + k ln c − c⟨λ⟩ − ln k!."""

    name = "Poisson"
    pyro_class = dist.Poisson
    positive_exposure = True
    whole_numbers = True
    forms = (
        "observed Poisson(rate = c * lambda <- Gamma site), optionally indexed by a "
        "Categorical site",
    )

    def linear_terms(self, plan, q, site):
        """u(λ) = (λ, ln λ): coefficients (−c, k), const k ln c − ln k!."""
        p, d = site.params["rate"], site.dims
        c, lnc = [(p.coef, p.coef_dims)], [(derived(p, "log_coef"), p.coef_dims)]
        k = [(site.stats[0], d)]
        lgk = constant(
            plan, ("log_factorial", site.name), lambda: torch.lgamma(site.stats[0] + 1), d
        )
        if not set(p.coef_dims) <= set(d):
            return [[(-1, c)], [(1, k)]], [(1, k + lnc), (-1, [(lgk, d)])]

        def k_log_c():  # 0 where k = 0, also for an exposure c = 0 (0 ln 0 = 0)
            return torch.xlogy(site.stats[0], ein(d, c, d, plan.sizes, site.stats[0]))

        klc = constant(plan, ("k_log_coef", site.name), k_log_c, d)
        return [[(-1, c)], [(1, k)]], [(1, [(klc, d)]), (-1, [(lgk, d)])]
