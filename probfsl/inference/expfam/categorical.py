"""The Categorical block over the last dimension."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probfsl.inference.expfam.block import Block, sum_axis, sum_last


@dataclass
class Categorical(Block):
    """Categorical(p) over the last dimension; u = one-hot(z), η = ln p (PRML eq. 2.26)."""

    probs: torch.Tensor
    event_dim: int = 0
    _stat_dims = (1,)

    @classmethod
    def from_natural(cls, logits: torch.Tensor, event_dim: int = 0) -> Categorical:
        return cls(torch.softmax(logits, -1), event_dim)

    def natural(self):
        return (self.probs.log(),)

    def expected_stats(self):
        return (self.probs,)

    def _log_normalizer(self):
        return torch.logsumexp(self.natural()[0], -1)

    def entropy(self) -> torch.Tensor:
        # xlogy keeps 0·ln 0 = 0 for one-hot factors
        return sum_last(-sum_axis(torch.special.xlogy(self.probs, self.probs)), self.event_dim)

    def expected_log_prob(self, stats):
        log_p = self.probs.log().clamp_min(torch.finfo(self.probs.dtype).min)
        return sum_last(sum_axis(torch.where(stats[0] > 0, stats[0] * log_p, 0)), self.event_dim)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Categorical(probs=self.probs)
