"""The MultivariateNormal family: a location vector and a precision matrix."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.vmp import mvn
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import canon
from probfsl.inference.vmp.monomials import same_form
from probfsl.inference.vmp.starts import gaussian_draw


@register
class MultivariateNormal(Family):
    """u(x) = (x, x xᵀ); conjugate parents: a MultivariateNormal location and a Wishart
    precision matrix (docs/design/vmp.md §2)."""

    name = "MultivariateNormal"
    pyro_class = dist.MultivariateNormal
    roles = {
        "loc": ("MultivariateNormal", "Categorical"),
        "precision": ("Wishart", "Categorical"),
    }
    conjugate = {"loc": "MultivariateNormal", "precision": "Wishart"}
    model_names = {"precision": "covariance"}
    hints = {
        "loc": "a MultivariateNormal site, optionally selected",
        "precision": "c times a Wishart site",
    }
    gaussian = True
    matrix = True
    outer_axis = True
    block = expfam.MultivariateNormal
    fields = ("loc", "precision")
    event_rank = 1
    forms = (
        "MultivariateNormal(loc <- MultivariateNormal site, precision_matrix = c * Lambda <- "
        "Wishart site), optionally indexed by a Categorical site or a fixed index",
    )

    def read_params(self, base, site):
        full = site.batch_shape + site.event_shape
        d = site.event_shape[-1]
        loc = canon(site, base.loc.expand(full))
        prec = canon(site, base.precision_matrix.expand(full + (d,)))
        # symmetrised: an inverse computed by the user (torch.linalg.inv of a kernel) is
        # asymmetric in its last digits, and the sweeps assume symmetry
        sym = same_form(0.5 * (prec + prec.transpose(-1, -2)), prec)
        return {"loc": loc, "precision": sym}, True

    def declare(self, site, base, sizes):
        sizes[site.dims[-1] + "b"] = site.event_shape[-1]  # the second axis of x xᵀ
        return None

    def param_dims(self, site, key):
        return site.dims + (site.dims[-1] + "b",) if key == "precision" else site.dims

    def stat_dims(self, site):
        d = site.dims
        return (d, d + (d[-1] + "b",))

    def data_stats(self, value):
        return (value, None)  # x xᵀ enters as x ⊗ x

    def checked_stats(self, site):
        return (site.value, *site.stats, site.value.square())  # x xᵀ's terms

    def draw(self, shape, n_cat, generator):
        return torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu")

    def extreme(self, shape, n_cat, pattern):
        return torch.full(shape, 3.0 if pattern == "high" else -3.0, dtype=torch.float64)

    def posterior(self, params):
        return dist.MultivariateNormal(params[0], precision_matrix=params[1])

    def start_at_mean(self, site, factor, value):
        return (value, factor[1])

    def start_drawn(self, site, factor, generator):
        return gaussian_draw(factor, True, generator)

    # the algebra: :mod:`probfsl.inference.vmp.mvn`
    def natural(self, plan, q, site, kids):
        return mvn.natural(plan, q, site), kids

    def message(self, plan, q, site, role, to):
        return mvn.message(plan, q, site, role, to)

    def loglik(self, plan, q, site, out):
        return mvn.site_loglik(plan, q, site, out)
