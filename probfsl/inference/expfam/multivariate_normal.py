"""The MultivariateNormal block over the last dimension."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import LOG_2PI, Block, logdet, spd_inverse, sum_last


@dataclass
class MultivariateNormal(Block):
    """Normal(m, P⁻¹) over R^D; u = (x, x xᵀ), η = (P m, −P/2) (PRML eq. 2.43, 2.114)."""

    loc: torch.Tensor
    precision: torch.Tensor
    event_dim: int = 0
    _stat_dims = (1, 2)

    @classmethod
    def from_natural(
        cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0
    ) -> MultivariateNormal:
        precision = -2 * eta2
        loc = torch.cholesky_solve(eta1.unsqueeze(-1), torch.linalg.cholesky(precision))
        return cls(loc.squeeze(-1), precision, event_dim)

    def natural(self):
        return (self.precision @ self.loc.unsqueeze(-1)).squeeze(-1), -0.5 * self.precision

    def expected_stats(self):
        m = self.loc
        return m, spd_inverse(self.precision) + m.unsqueeze(-1) * m.unsqueeze(-2)

    def _log_normalizer(self):
        m, p = self.loc, self.precision
        quad = (m * (p @ m.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return 0.5 * (quad - logdet(p) + m.shape[-1] * LOG_2PI)

    def entropy(self) -> torch.Tensor:
        """½ D (1 + ln 2π) − ½ ln|P|, in closed form (A − η·⟨u⟩ cancels mᵀPm against
        itself, which float32 cannot afford for large, precise means)."""
        d = self.loc.shape[-1]
        return sum_last(0.5 * d * (1 + LOG_2PI) - 0.5 * logdet(self.precision), self.event_dim)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.MultivariateNormal(self.loc, precision_matrix=self.precision)
