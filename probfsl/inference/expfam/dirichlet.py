"""The Dirichlet block over the last dimension."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import Block, sum_axis


@dataclass
class Dirichlet(Block):
    """Dirichlet(α) over the last dimension; u = ln π, η = α − 1 (PRML B.16-B.19)."""

    concentration: torch.Tensor
    event_dim: int = 0
    _stat_dims = (1,)

    @classmethod
    def from_natural(cls, eta: torch.Tensor, event_dim: int = 0) -> Dirichlet:
        return cls(eta + 1.0, event_dim)

    def natural(self):
        return (self.concentration - 1.0,)

    def expected_stats(self):
        a = self.concentration
        return (torch.special.digamma(a) - torch.special.digamma(sum_axis(a, keepdim=True)),)

    def _log_normalizer(self):
        a = self.concentration
        return sum_axis(torch.lgamma(a)) - torch.lgamma(sum_axis(a))

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Dirichlet(self.concentration)
