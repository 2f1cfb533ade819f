"""Feature preprocessing shared by the methods (SimpleShot: Wang et al. 2019)."""

from __future__ import annotations

import torch


def center_and_normalize(x: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Subtract ``mean`` (when given) and L2-normalise the last dimension.

    This is the "M" and "E" of BAVARDAGE's MESV preprocessing (docs/design/bavardage.md
    §3.1): centring on the mean of all base features, then unit norm per row. Zero rows stay zero.
    """
    if mean is not None:
        x = x - mean.to(x)
    return torch.nn.functional.normalize(x, dim=-1)
