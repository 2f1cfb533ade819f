"""The Normal family: a location and a precision (1 / scale²) per entry."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.inference import expfam
from probfsl.inference.vmp import normal as gaussian
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import normal_data
from probfsl.inference.vmp.starts import gaussian_draw


@register
class Normal(Family):
    """u(x) = (x, x²); conjugate parents: a Normal (or MultivariateNormal, or an affine map
    of them) location and a Gamma precision (docs/design/vmp.md §2)."""

    name = "Normal"
    pyro_class = dist.Normal
    roles = {
        "loc": ("Normal", "MultivariateNormal", "Categorical"),
        "precision": ("Gamma", "Categorical"),
    }
    conjugate = {"loc": "Normal", "precision": "Gamma"}
    model_names = {"precision": "scale"}
    hints = {
        "loc": "a Normal or MultivariateNormal site (a copy, an affine map with observed "
        "coefficients, or a product of two), optionally selected by a Categorical site",
        "precision": "c times a Gamma site or a product of Gamma sites, written as "
        "scale = (c * tau) ** -0.5",
    }
    elementwise = True
    gaussian = True
    product_parameter = "precision"
    affine_parameter = "loc"
    selectable_constant = True
    block = expfam.Normal
    fields = ("loc", "precision")
    point_constraint = constraints.real
    forms = (
        "Normal(loc <- Normal site, an affine map of Normal/MultivariateNormal sites with "
        "observed coefficients or a product of two of them, scale = (c * tau)^-1/2 <- Gamma "
        "site or a product of Gamma sites), each optionally indexed by a Categorical site or "
        "a fixed index",
        "latent Normal sites each the mean of the next form one Gaussian Markov chain factor",
    )

    def read_params(self, base, site):
        return {"loc": base.loc, "precision": base.scale.pow(-2)}, False

    def observe(self, site, value, dtype):
        # (x, x²) as one stacked buffer, ``value`` a view of it
        data = normal_data(value)
        site.value, site.stats, site.powers = data["value"], data["stats"], data["powers"]

    def checked_stats(self, site):
        return (site.powers,)  # x and x² are views of the stack: one pass over it

    def draw(self, shape, n_cat, generator):
        return torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu")

    def extreme(self, shape, n_cat, pattern):
        return torch.full(shape, 3.0 if pattern == "high" else -3.0, dtype=torch.float64)

    def placeholder(self, value):
        return dist.Normal(torch.zeros_like(value), torch.ones_like(value))

    def point_stats(self, value):
        return value, value.square()

    def point_mode(self, eta, site):
        if site.joint:
            return torch.linalg.solve(-2 * eta[1], eta[0])
        return -eta[0] / (2 * eta[1])

    def posterior(self, params):
        return dist.Normal(params[0], params[1].rsqrt())

    def start_at_mean(self, site, factor, value):
        return (value, factor[1])

    def start_drawn(self, site, factor, generator):
        return gaussian_draw(factor, site.joint, generator)

    # the algebra: :mod:`probfsl.inference.vmp.normal`
    def natural(self, plan, q, site, kids):
        return None if gaussian.fixed_prior(site) else (gaussian.natural(plan, q, site), kids)

    def message(self, plan, q, site, role, to):
        return gaussian.message(plan, q, site, role, to)

    def loglik(self, plan, q, site, out):
        # a fixed prior's term from ⟨(x − m)²⟩, not from η·⟨u⟩ − A(η), which cancels under
        # a tight prior with a mean away from 0
        if gaussian.fixed_prior(site):
            return gaussian.fixed_prior_loglik(plan, q, site)
        return gaussian.site_loglik(plan, q, site, out)
