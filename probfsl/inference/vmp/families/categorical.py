"""The Categorical family: labels, latent (a mixture's selector) or observed."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import canon


@register
class Categorical(Family):
    """u(z) = onehot(z); conjugate parent of its probabilities: a Dirichlet (selected by
    a Categorical site when observed), or a fixed table selected by a latent one."""

    name = "Categorical"
    pyro_class = dist.Categorical
    roles = {"probs": ("Dirichlet", "Categorical")}
    conjugate = {"probs": "Dirichlet"}
    hints = {
        "probs": "a Dirichlet site (selected by a Categorical site when the Categorical is "
        "observed), or, observed, a fixed table selected by a Categorical site"
    }
    labels = True
    whole_numbers = True
    selectable_constant = True
    block = expfam.Categorical
    fields = ("probs",)
    linear_parameter = "probs"

    def categories(self, base):
        return base.probs.shape[-1]

    def declare(self, site, base, sizes):
        site.n_cat = base.probs.shape[-1]
        sizes[f"{site.name}#cat"] = site.n_cat
        return None

    def read_params(self, base, site):
        full = site.batch_shape + site.event_shape + (site.n_cat,)
        return {"probs": canon(site, base.probs.expand(full))}, True

    def param_dims(self, site, key):
        return site.dims + (f"{site.name}#cat",) if key == "probs" else site.dims

    def stat_dims(self, site):
        return (site.dims + (f"{site.name}#cat",),)

    def data_limit(self, base, site):
        return site.n_cat - 1, f"its data must be labels 0 to {site.n_cat - 1}"

    def observe(self, site, value, dtype):
        site.value = value
        one_hot = torch.nn.functional.one_hot(value.long(), site.n_cat)
        site.stats = (one_hot.to(dtype),)

    def draw(self, shape, n_cat, generator):
        return torch.randint(0, n_cat, shape, generator=generator, device="cpu")

    def extreme(self, shape, n_cat, pattern):
        return torch.full(shape, n_cat - 1 if pattern == "high" else 0, dtype=torch.long)

    def linear_child(self, site):
        # a linear child only where its probabilities are selected (a mixture's table)
        key = super().linear_child(site)
        return key if key is not None and site.params[key].comp is not None else None

    def linear_terms(self, plan, q, site):
        """Categorical(x | θ_z), u(θ) = ln θ: coefficients (one-hot x,)."""
        return [[(1, [(site.stats[0], site.dims + (f"{site.name}#cat",))])]], []

    def posterior(self, params):
        return dist.Categorical(probs=params[0])
