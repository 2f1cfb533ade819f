"""Numerics that the hand-written and the derived engines share: one implementation each.

* :func:`aitken`: Aitken's delta-squared extrapolation of three iterates of a map, with
  the fallback of the evidence's Algorithm 1 (Kim et al., CVPR 2016) to the last iterate
  wherever the extrapolation is not usable. The evidence engines (hand-written and
  derived) and SLEM's derived MAP call it.
* :func:`clean_eigenvalues`, :func:`gram_eigh`: the eigendecomposition of a batch of
  Gram matrices ``X X^T`` with the eigenvalues below a relative threshold (and negative
  round-off) set to exactly zero: the single decomposition of the evidence's design §7,
  used by the hand-written :func:`~probfsl.inference.evidence.spectrum` and by the
  derived engine's :func:`~probfsl.derived.evidence.rotate`.

The safeguarded Newton polish of the profile evidence has one implementation already,
:func:`probfsl.inference.evidence.newton_polish`, which both evidence engines call; the
eigendecomposition itself is :func:`probfsl.inference.eigh.stable_eigh`.

No function here synchronises with the host: every guard is a ``torch.where``.
"""

from __future__ import annotations

import torch

from probfsl.inference.eigh import stable_eigh

__all__ = ["aitken", "clean_eigenvalues", "gram_eigh"]


def aitken(
    a0: torch.Tensor,
    a1: torch.Tensor,
    a2: torch.Tensor,
    *,
    positive: bool = False,
    rtol: float = 0.0,
) -> torch.Tensor:
    """Aitken's delta-squared step ``a0 - (a1 - a0)^2 / ((a2 - a1) - (a1 - a0))`` from three
    successive iterates of a map, elementwise; ``a2`` wherever the step is not usable.

    Not usable: the second difference is zero, or at most ``rtol * max(|a2|, 1)`` (the
    iterates no longer curve beyond rounding, where the quotient is noise); the result is
    not finite; or, with ``positive`` (the iterates are of a positive quantity, such as
    lambda or 1/beta of the evidence), the result is negative. For a quantity that may
    have either sign (log lambda, an intercept) leave ``positive`` off.

    For a map that is affine in the iterate the step is its fixed point, exactly up to
    rounding; for a linearly converging map it removes the leading error term.
    """
    d1 = a1 - a0
    denom = (a2 - a1) - d1
    flat = denom.abs() <= rtol * a2.abs().clamp_min(1.0)
    cand = a0 - d1.square() / torch.where(flat, torch.ones_like(denom), denom)
    bad = flat | ~torch.isfinite(cand)
    if positive:
        bad = bad | (cand < 0)
    return torch.where(bad, a2, cand)


def clean_eigenvalues(s: torch.Tensor, rel_tol: float) -> torch.Tensor:
    """Eigenvalues ``s [..., n]`` below ``rel_tol * max(s)`` (and negative round-off) set
    to exactly zero."""
    top = s.amax(-1, keepdim=True)
    return torch.where(s > rel_tol * top, s, torch.zeros_like(s))


def gram_eigh(x: torch.Tensor, rel_tol: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """The eigendecomposition ``X X^T = U diag(s) U^T`` of the rows ``x [..., N, D]``:
    ``s [..., N]`` (cleaned by :func:`clean_eigenvalues`) and ``U [..., N, N]``, by
    :func:`~probfsl.inference.eigh.stable_eigh`."""
    s, u = stable_eigh(x @ x.mT)
    return clean_eigenvalues(s, rel_tol), u
