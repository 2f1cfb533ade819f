"""The Beta family: a probability's conjugate parent."""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.inference import expfam
from probfsl.inference.vmp.family import Family, floored, register


@register
class Beta(Family):
    """u(p) = (ln p, ln(1 − p)), with fixed concentrations."""

    name = "Beta"
    pyro_class = dist.Beta
    parameters = ("concentration1", "concentration0")
    hints = {"concentration1": "fixed", "concentration0": "fixed"}
    block = expfam.Beta
    fields = ("concentration1", "concentration0")
    point_constraint = constraints.unit_interval

    def reference(self, base):
        return base.concentration1  # its parameters are held by a Dirichlet

    def data_stats(self, value):
        return (value.log(), (-value).log1p())

    def support(self, value):
        low, high = torch.aminmax(value)
        return (low > 0) & (high < 1)

    def outside(self, value):
        return (value <= 0) | (value >= 1), "strictly between 0 and 1"

    def draw(self, shape, n_cat, generator):
        u = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu")
        return 0.05 + 0.9 * u

    def extreme(self, shape, n_cat, pattern):
        return torch.full(shape, 0.95 if pattern == "high" else 0.05, dtype=torch.float64)

    def placeholder(self, value):
        return dist.Beta(torch.ones_like(value), torch.ones_like(value))

    def point_stats(self, value):
        return floored(value.log()), floored((-value).log1p())

    def point_mode(self, eta, site):
        return eta[0] / (eta[0] + eta[1])

    def posterior(self, params):
        return dist.Beta(params[0], params[1])

    def start_at_mean(self, site, factor, value):
        """Concentrations with the mean ``value``, their sum the prior's."""
        if not bool(((value > 0) & (value < 1)).all()):
            raise ValueError(f"init[{site.name!r}] must be in (0, 1) (a Beta site's mean)")
        total = factor[0] + factor[1]
        return (value * total, (1 - value) * total)
