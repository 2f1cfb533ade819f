"""The Multinomial family: observed count vectors under Dirichlet probabilities."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference.vmp.checks import first_offender, position, refuse
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import constant


@register
class Multinomial(Family):
    """Observed counts x = (x_1..x_K), Σ_k x_k = n, under probabilities θ ~ Dirichlet
    (optionally θ_z, a table row chosen by a latent Categorical z: a mixture of
    multinomials): E ln p = Σ_k x_k ⟨ln θ_k⟩ + ln n! − Σ_k ln x_k!, linear in
    u(θ) = ln θ, so the message to θ is the counts Σ x (weighted by q(z) in a mixture)
    and the Dirichlet posterior is α + Σ x."""

    name = "Multinomial"
    pyro_class = dist.Multinomial
    parameters = ("probs",)
    roles = {"probs": ("Dirichlet", "Categorical")}
    conjugate = {"probs": "Dirichlet"}
    hints = {"probs": "a Dirichlet site, optionally indexed by a Categorical site"}
    observed_only = True
    needs_latent_parent = True
    whole_numbers = True
    linear_parameter = "probs"
    forms = (
        "observed Multinomial(total_count fixed, probs <- Dirichlet site, optionally indexed "
        "by a Categorical site: a mixture of multinomials)",
    )

    def declare(self, site, base, sizes):
        # the number of trials, which every row of counts must sum to (:meth:`observe`)
        site.total_count = int(base.total_count)
        return None

    def data_limit(self, base, site):
        return base.total_count, f"its counts exceed their total_count {base.total_count}"

    def observe(self, site, value, dtype):
        sums = value.sum(-1)
        bad = sums != site.total_count
        at = first_offender(bad)
        if at is not None:
            raise refuse(
                site.name,
                site.fn_name,
                "-",
                f"each row of its counts must sum to its total_count {site.total_count}; "
                f"the row at {position(site.dims[:-1], at)} sums to {float(sums[at]):g}",
            )
        site.value = value
        site.stats = (value,)

    def stat_dims(self, site):
        return (site.dims,)

    def linear_terms(self, plan, q, site):
        """u(θ) = ln θ: coefficients (x,), const ln n! − Σ_k ln x_k! (ln n! held by the
        first category's entry, so that summing over the categories counts it once)."""
        x = site.stats[0]

        def log_coefficient():
            log_coef = -torch.lgamma(x + 1)
            log_coef[..., 0] += torch.lgamma(x.sum(-1) + 1)
            return log_coef

        lc = constant(plan, ("log_multinomial_coefficient", site.name), log_coefficient, site.dims)
        return [[(1, [(x, site.dims)])]], [(1, [(lc, site.dims)])]
