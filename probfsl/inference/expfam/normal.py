"""The Normal block (per element)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import LOG_2PI, Block, sum_last


@dataclass
class Normal(Block):
    """Normal(loc, precision⁻¹) per element; u = (x, x²), η = (λm, −λ/2) (PRML eq. 2.220)."""

    loc: torch.Tensor
    precision: torch.Tensor
    event_dim: int = 0
    _stat_dims = (0, 0)

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Normal:
        precision = -2 * eta2
        return cls(eta1 / precision, precision, event_dim)

    def natural(self):
        return self.precision * self.loc, -0.5 * self.precision

    def expected_stats(self):
        return self.loc, self.loc.square() + self.precision.reciprocal()

    def _log_normalizer(self):
        return 0.5 * (self.precision * self.loc.square() - self.precision.log() + LOG_2PI)

    def entropy(self) -> torch.Tensor:
        """½(1 + ln 2π − ln λ), in closed form (A − η·⟨u⟩ cancels λm² against itself)."""
        return sum_last(0.5 * (1 + LOG_2PI - self.precision.log()), self.event_dim)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Normal(self.loc, self.precision.rsqrt())
