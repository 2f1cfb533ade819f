"""The Beta block of a probability."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import Block


@dataclass
class Beta(Block):
    """Beta(a, b) of a probability p; u = (ln p, ln(1 − p)), η = (a − 1, b − 1), A = ln B(a, b)
    (PRML B.6-B.8; the two-category Dirichlet)."""

    concentration1: torch.Tensor
    concentration0: torch.Tensor
    event_dim: int = 0
    _stat_dims = (0, 0)

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Beta:
        return cls(eta1 + 1, eta2 + 1, event_dim)

    def natural(self):
        return self.concentration1 - 1, self.concentration0 - 1

    def expected_stats(self):
        a, b = self.concentration1, self.concentration0
        total = torch.special.digamma(a + b)
        return torch.special.digamma(a) - total, torch.special.digamma(b) - total

    def _log_normalizer(self):
        a, b = self.concentration1, self.concentration0
        return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Beta(self.concentration1, self.concentration0)
