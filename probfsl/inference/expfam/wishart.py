"""The Wishart block of a precision matrix."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import Block, logdet, spd_inverse


@dataclass
class Wishart(Block):
    """Wishart(ν, W) of a D x D precision Λ (E Λ = ν W); u = (Λ, ln|Λ|),
    η = (−W⁻¹/2, (ν − D − 1)/2) (PRML B.78-B.82)."""

    df: torch.Tensor
    scale: torch.Tensor
    event_dim: int = 0
    _stat_dims = (2, 0)

    @property
    def dim(self) -> int:
        return self.scale.shape[-1]

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Wishart:
        scale = spd_inverse(-2 * eta1)
        return cls(2 * eta2 + scale.shape[-1] + 1, scale, event_dim)

    def natural(self):
        return -0.5 * spd_inverse(self.scale), 0.5 * (self.df - self.dim - 1)

    def expected_stats(self):
        d, nu = self.dim, self.df
        i = torch.arange(d, device=nu.device, dtype=nu.dtype)
        e_logdet = torch.special.digamma(0.5 * (nu.unsqueeze(-1) - i)).sum(-1)
        e_logdet = e_logdet + d * math.log(2) + logdet(self.scale)
        return nu[..., None, None] * self.scale, e_logdet

    def _log_normalizer(self):
        d, nu = self.dim, self.df
        return 0.5 * nu * (d * math.log(2) + logdet(self.scale)) + torch.special.multigammaln(
            0.5 * nu, d
        )

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Wishart(self.df, covariance_matrix=self.scale)
