"""The Dirichlet family: probabilities' conjugate parent."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.inference import expfam
from probfsl.inference.vmp import dirichlet_points
from probfsl.inference.vmp.checks import first_offender, position, refuse, simplex_tolerance
from probfsl.inference.vmp.family import Family, floored, register


@register
class Dirichlet(Family):
    """u(π) = ln π; an observed one's concentration may be a point estimate
    (:mod:`~probfsl.inference.vmp.dirichlet_points`)."""

    name = "Dirichlet"
    pyro_class = dist.Dirichlet
    parameters = ("concentration",)
    roles = {"concentration": ("Gamma", "Categorical")}  # a point estimate only
    conjugate = {"concentration": "Gamma"}
    hints = {"concentration": "fixed, or a positive pyro.param of an observed Dirichlet"}
    block = expfam.Dirichlet
    fields = ("concentration",)
    event_rank = 1
    point_constraint = constraints.simplex
    forms = (
        "observed Dirichlet(concentration <- a positive pyro.param (a point estimate in place "
        "of a Gamma site), optionally indexed by a Categorical site)",
    )

    def data_stats(self, value):
        return (value.log(),)

    def stat_dims(self, site):
        return (site.dims,)

    def support(self, value):
        tol = simplex_tolerance(value.dtype, value.shape[-1])
        low, high = torch.aminmax(value.sum(-1))
        return (value.amin() > 0) & (low >= 1 - tol) & (high <= 1 + tol)

    def refusal(self, site, fn, value, dims):
        tol = simplex_tolerance(value.dtype, value.shape[-1])
        sums = value.sum(-1)
        bad = (value <= 0).any(-1) | ((sums - 1).abs() > tol)
        at = first_offender(bad)
        if at is None:
            return None
        row = value[at]
        return refuse(
            site,
            fn,
            "-",
            f"its data must be probability vectors (entries > 0, each row summing to 1 "
            f"within {tol:.3g}); the row at {position(dims, at)} sums to "
            f"{float(sums[at]):.6g} with smallest entry {float(row.min()):.6g}",
        )

    def draw(self, shape, n_cat, generator):
        v = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu") + 0.05
        return v / v.sum(-1, keepdim=True)

    def extreme(self, shape, n_cat, pattern):
        v = torch.full(shape, 0.01, dtype=torch.float64)
        v[..., -1 if pattern == "high" else 0] = 1.0
        return v / v.sum(-1, keepdim=True)

    def placeholder(self, value):
        return dist.Dirichlet(torch.ones_like(value))

    def point_stats(self, value):
        return (floored(value.log()),)

    def point_mode(self, eta, site):
        return eta[0] / eta[0].sum(-1, keepdim=True)

    def posterior(self, params):
        return dist.Dirichlet(params[0])

    def start_at_mean(self, site, factor, value):
        """Concentrations with the mean ``value`` (normalised), their sum the prior's."""
        if not bool((value > 0).all()):
            raise ValueError(f"init[{site.name!r}] must be positive (a Dirichlet site's mean)")
        value = value / value.sum(-1, keepdim=True)
        return (value * factor[0].sum(-1, keepdim=True),)

    # an observed one whose concentration is a point estimate: its messages and bound term
    # are :mod:`probfsl.inference.vmp.dirichlet_points`'; otherwise it has no parent
    def message(self, plan, q, site, role, to):
        if not dirichlet_points.is_child(site):
            return None
        return dirichlet_points.message(plan, q, site, role, to)

    def loglik(self, plan, q, site, out):
        if not dirichlet_points.is_child(site):
            return None
        return dirichlet_points.loglik(plan, q, site, out, with_weights=True)
