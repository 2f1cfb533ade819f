"""The Gamma block of a precision or rate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import Block


@dataclass
class Gamma(Block):
    """Gamma(shape a, rate b) of a precision; u = (τ, ln τ), η = (−b, a − 1) (PRML B.26-B.31)."""

    shape: torch.Tensor
    rate: torch.Tensor
    event_dim: int = 0
    _stat_dims = (0, 0)

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Gamma:
        return cls(eta2 + 1.0, -eta1, event_dim)

    def natural(self):
        return -self.rate, self.shape - 1.0

    def expected_stats(self):
        return self.shape / self.rate, torch.special.digamma(self.shape) - self.rate.log()

    def _log_normalizer(self):
        return torch.lgamma(self.shape) - self.shape * self.rate.log()

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Gamma(self.shape, self.rate)
