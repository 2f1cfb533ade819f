"""The Wishart family: a precision matrix's conjugate parent."""

from __future__ import annotations

import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import canon


@register
class Wishart(Family):
    """u(Λ) = (Λ, ln |Λ|), with fixed degrees of freedom and scale (latent only)."""

    name = "Wishart"
    pyro_class = dist.Wishart
    symbolic = True
    matrix = True
    latent_only = True
    block = expfam.Wishart
    fields = ("df", "scale")
    event_rank = 2

    def read_params(self, base, site):
        df = canon(site, base.df.expand(site.batch_shape))
        scale = canon(site, base.covariance_matrix.expand(site.batch_shape + site.event_shape))
        return {"df": df, "scale": scale}, True

    def param_dims(self, site, key):
        return site.dims[:-2] if key == "df" else site.dims

    def stat_dims(self, site):
        return (site.dims, site.dims[:-2])

    def unit(self, shape, ref):
        return torch.eye(shape[-1], dtype=ref.dtype, device=ref.device).expand(shape)

    def draw(self, shape, n_cat, generator):
        a = torch.randn(shape, generator=generator, dtype=torch.float64, device="cpu")
        eye = torch.eye(shape[-1], dtype=a.dtype, device="cpu")
        return a @ a.transpose(-1, -2) / shape[-1] + eye

    def extreme(self, shape, n_cat, pattern):
        eye = torch.eye(shape[-1], dtype=torch.float64)
        return (20.0 if pattern == "high" else 0.05) * eye.expand(shape).clone()

    def posterior(self, params):
        return dist.Wishart(params[0], covariance_matrix=params[1])

    def start_at_mean(self, site, factor, value):
        """The scale mean / ν, the prior's degrees of freedom ν kept."""
        if not bool((torch.linalg.cholesky_ex(value).info == 0).all()):
            raise ValueError(f"init[{site.name!r}] must be positive definite (a Wishart's mean)")
        return (factor[0], value / factor[0][..., None, None])
