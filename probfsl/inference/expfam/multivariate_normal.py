"""The MultivariateNormal block over the last dimension."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from probfsl.inference.expfam.block import (
    LOG_2PI,
    Block,
    chol_logdet,
    logdet,
    spd_inverse,
    sum_last,
)


@dataclass
class MultivariateNormal(Block):
    """Normal(m, P⁻¹) over R^D; u = (x, x xᵀ), η = (P m, −P/2) (PRML eq. 2.43, 2.114)."""

    loc: torch.Tensor
    precision: torch.Tensor
    event_dim: int = 0
    #: the Cholesky factor of ``precision`` where known (:meth:`from_natural` computes it),
    #: reused by :meth:`expected_stats` and :meth:`entropy` instead of factorising again
    chol: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: the covariance P⁻¹ where known (:meth:`from_natural` forms it for 2 × 2 matrices,
    #: in closed form instead of a Cholesky factor), reused by :meth:`expected_stats`
    cov: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _stat_dims = (1, 2)

    @classmethod
    def from_natural(
        cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0
    ) -> MultivariateNormal:
        precision = -2.0 * eta2
        if eta2.shape[-1] == 2:  # in closed form (:func:`spd_inverse`), without a factor
            cov = spd_inverse(precision)
            loc = (cov @ eta1.unsqueeze(-1)).squeeze(-1)
            return cls(loc, precision, event_dim, cov=cov)
        chol = torch.linalg.cholesky(precision)
        loc = torch.cholesky_solve(eta1.unsqueeze(-1), chol)
        return cls(loc.squeeze(-1), precision, event_dim, chol)

    def natural(self):
        return (self.precision @ self.loc.unsqueeze(-1)).squeeze(-1), -0.5 * self.precision

    def expected_stats(self):
        m, cov = self.loc, self.cov
        if cov is None:
            cov = (
                spd_inverse(self.precision)
                if self.chol is None
                else torch.cholesky_inverse(self.chol)
            )
        return m, cov + m.unsqueeze(-1) * m.unsqueeze(-2)

    def _log_normalizer(self):
        m, p = self.loc, self.precision
        quad = (m * (p @ m.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return 0.5 * (quad - logdet(p) + m.shape[-1] * LOG_2PI)

    def entropy(self) -> torch.Tensor:
        """½ D (1 + ln 2π) − ½ ln|P|, in closed form (A − η·⟨u⟩ cancels mᵀPm against
        itself, which float32 cannot afford for large, precise means)."""
        d = self.loc.shape[-1]
        ldet = logdet(self.precision) if self.chol is None else chol_logdet(self.chol)
        return sum_last(0.5 * d * (1 + LOG_2PI) - 0.5 * ldet, self.event_dim)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.MultivariateNormal(self.loc, precision_matrix=self.precision)
