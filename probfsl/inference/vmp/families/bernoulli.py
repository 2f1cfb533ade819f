"""The Bernoulli and Binomial families: counts of successes under a Beta probability, or
logits affine in Gaussian sites (Pólya-Gamma, :mod:`~probfsl.inference.vmp.polya_gamma`)."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference.vmp import polya_gamma
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import constant

_PROBS_HINT = "a Beta site, or logits affine in Normal sites (Pólya-Gamma)"


@register
class Bernoulli(Family):
    """Observed y ∈ {0, 1}: E ln p = y⟨ln p⟩ + (1 − y)⟨ln(1 − p)⟩."""

    name = "Bernoulli"
    pyro_class = dist.Bernoulli
    parameters = ("probs", "logits")
    roles = {"probs": ("Beta", "Categorical")}
    conjugate = {"probs": "Beta"}
    hints = {"probs": _PROBS_HINT}
    observed_only = True
    needs_latent_parent = True
    whole_numbers = True
    logistic = True
    linear_parameter = "probs"
    forms = (
        "observed Bernoulli and Binomial(probs <- Beta site, or logits affine in Normal/"
        "MultivariateNormal sites), each optionally indexed by a Categorical site",
    )

    def data_limit(self, base, site):
        return 1, "its data must be 0 or 1"

    def data_stats(self, value):
        return (value,)

    def stat_dims(self, site):
        return (site.dims,)

    def trials(self, plan, site) -> torch.Tensor:
        """b: the number of trials per entry (1)."""
        return site.stats[0].new_ones(())

    def linear_terms(self, plan, q, site):
        """u(p) = (ln p, ln(1 − p)): coefficients (y, 1 − y)."""
        y = [(site.stats[0], site.dims)]
        return [[(1, y)], [(1, []), (-1, y)]], []

    # logits affine in Gaussian sites: :mod:`probfsl.inference.vmp.polya_gamma`; a Beta
    # probability: a linear child's
    def message(self, plan, q, site, role, to):
        return polya_gamma.message(plan, q, site, to) if "logits" in site.params else None

    def loglik(self, plan, q, site, out):
        return polya_gamma.loglik(plan, q, site, out) if "logits" in site.params else None


@register
class Binomial(Bernoulli):
    """Observed y ∈ {0..n}: E ln p = y⟨ln p⟩ + (n − y)⟨ln(1 − p)⟩ + ln C(n, y)."""

    name = "Binomial"
    pyro_class = dist.Binomial
    parameters = ("total_count", "probs", "logits")

    def data_limit(self, base, site):
        return base.total_count, "its data exceed their total_count"

    def trials(self, plan, site) -> torch.Tensor:
        n = site.params["total_count"]
        return ein(site.dims, [(n.const, n.const_dims)], site.dims, plan.sizes, site.stats[0])

    def linear_terms(self, plan, q, site):
        """u(p) = (ln p, ln(1 − p)): coefficients (y, n − y), const ln C(n, y)."""
        d = site.dims
        y = [(site.stats[0], d)]
        n = site.params["total_count"]
        n_ops = [(n.const, n.const_dims)]

        def log_binom():
            nn = ein(d, n_ops, d, plan.sizes, site.stats[0])
            v = site.stats[0]
            return torch.lgamma(nn + 1) - torch.lgamma(v + 1) - torch.lgamma(nn - v + 1)

        lb = constant(plan, ("log_binom", site.name), log_binom, d)
        return [[(1, y)], [(1, n_ops), (-1, y)]], [(1, [(lb, d)])]
