"""The Gamma family: a shape and a rate; a precision's or a rate's conjugate parent."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.inference import expfam
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import constant, derived
from probfsl.inference.vmp.moments import expected_stats, parent_ops, weights


@register
class Gamma(Family):
    """u(τ) = (τ, ln τ); its rate may be c · b with b a Gamma site (docs/design/vmp.md §7.4)."""

    name = "Gamma"
    pyro_class = dist.Gamma
    parameters = ("concentration", "rate")
    roles = {"rate": ("Gamma", "Categorical")}
    conjugate = {"rate": "Gamma"}
    hints = {"rate": "c times a Gamma site", "concentration": "fixed"}
    symbolic = True
    elementwise = True
    compact_factor = True
    block = expfam.Gamma
    fields = ("shape", "rate")
    point_constraint = constraints.positive
    linear_parameter = "rate"
    forms = ("Gamma(rate = c * b <- Gamma site, optionally indexed by a Categorical site)",)

    def data_stats(self, value):
        return (value, value.log())

    def support(self, value):
        return value.amin() > 0

    def outside(self, value):
        return value <= 0, "> 0"

    def draw(self, shape, n_cat, generator):
        return 0.5 + torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu")

    def extreme(self, shape, n_cat, pattern):
        return torch.full(shape, 20.0 if pattern == "high" else 0.05, dtype=torch.float64)

    def placeholder(self, value):
        return dist.Gamma(torch.ones_like(value), torch.ones_like(value))

    def point_stats(self, value):
        return value, value.log()

    def point_mode(self, eta, site):
        return -eta[1] / eta[0]

    def posterior(self, params):
        return dist.Gamma(params[0], params[1])

    def start_at_mean(self, site, factor, value):
        """The rate a / mean, the prior's shape a kept."""
        if not bool((value > 0).all()):
            raise ValueError(f"init[{site.name!r}] must be positive (a Gamma site's mean)")
        return (factor[0], factor[0] / value)

    def natural(self, plan, q, site, kids):
        """A rate c · b with b a Gamma site: E[η] = (−c⟨b⟩, a − 1), b selected where it is
        indexed (design §1); a fixed rate: the fixed prior's."""
        if self.linear_child(site) is None:
            return None
        p, a = site.params["rate"], site.params["concentration"]
        W, comp = weights(plan, q, site)
        over = site.dims + ((comp,) if comp else ())
        b = parent_ops(plan, q, site, "rate")[0]
        eta1 = -ein(site.dims, W + [(p.coef, p.coef_dims), b], over, plan.sizes, plan.ref)
        eta2 = ein(site.dims, [(a.const - 1, a.const_dims)], site.dims, plan.sizes, plan.ref)
        return [eta1, eta2], kids

    def linear_terms(self, plan, q, site):
        """Gamma(τ | a, c b), u(b) = (b, ln b): coefficients (−c⟨τ⟩, a), const
        a ln c + (a − 1)⟨ln τ⟩ − ln Γ(a)."""
        p, d = site.params["rate"], site.dims
        c, lnc = [(p.coef, p.coef_dims)], [(derived(p, "log_coef"), p.coef_dims)]
        a = site.params["concentration"]
        a_ops = [(a.const, a.const_dims)]
        am1, lga = constant(
            plan,
            ("gamma_shape", site.name),
            lambda: (a.const - 1, torch.lgamma(a.const)),
            a.const_dims,
        )
        observed = site.observed or site.name in q
        tau, log_tau = expected_stats(plan, q, site.name) if observed else (None, None)
        const = [(1, a_ops + lnc), (-1, [(lga, a.const_dims)])]
        if log_tau is not None:
            const.append((1, [(am1, a.const_dims), (log_tau, d)]))
        coef1 = [(-1, c + [(tau, d)])] if tau is not None else []
        return [coef1, [(1, a_ops)]], const


class ObservedRateChild(Family):
    """An observed family with one parameter, its rate c · λ with λ a Gamma site
    (optionally selected by a Categorical): what Poisson and Exponential share. Its one
    statistic is the data, and E ln p is linear in u(λ) = (λ, ln λ) (each subclass gives
    the coefficients, :meth:`~probfsl.inference.vmp.family.Family.linear_terms`). Not a
    family itself: it is not registered."""

    parameters = ("rate",)
    roles = {"rate": ("Gamma", "Categorical")}
    conjugate = {"rate": "Gamma"}
    hints = {"rate": "c times a Gamma site"}
    observed_only = True
    needs_latent_parent = True
    linear_parameter = "rate"

    def data_stats(self, value):
        return (value,)

    def stat_dims(self, site):
        return (site.dims,)
