"""Bernoulli and Binomial observations with logits affine in Gaussian sites, by Pólya-Gamma
augmentation (docs/design/vmp.md §7.3; Polson, Scott & Windle 2013).

With κ = y − b/2, p(y | ψ) = C(b, y) 2^-b e^{κψ} ∫ e^{−ωψ²/2} PG(ω | b, 0) dω, so given ω
the logit ψ = Σ_k J_k w_k + c has a Gaussian likelihood: the message to each parent is that
of a Normal child with precision ⟨ω⟩ and value κ/⟨ω⟩
(:func:`~probfsl.inference.vmp.linear_maps.message`). The optimal factor is
q(ω_n) = PG(b_n, c_n) with c_n = sqrt(⟨ψ_n²⟩), ⟨ω_n⟩ = (b_n / 2c_n) tanh(c_n / 2); it is
recomputed from the current q of the parents whenever it is read, so every update of a
parent follows an update of q(ω) and the bound after each update is

    E ln p(y | ψ) ≥ ln C(b, y) + κ⟨ψ⟩ − b ln(2 cosh(c / 2)),

the Jaakkola–Jordan bound at its optimal variational parameter (Bishop, PRML §10.6).
"""

from __future__ import annotations

import torch

from probfsl.inference.vmp import linear_maps
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import Plan, Site


def _trials(plan: Plan, s: Site) -> torch.Tensor:
    """b: 1 for a Bernoulli, the number of trials of a Binomial (in the site's axes)."""
    return lookup(s.family).trials(plan, s)


def _mean_omega(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """⟨ω⟩ of PG(b, c) = b tanh(c/2) / (2c), with its limit b/4 − b c²/48 near c = 0."""
    small = c < 1e-3
    safe = torch.where(small, torch.ones_like(c), c)
    return b * torch.where(small, 0.25 - c.square() / 48, torch.tanh(safe / 2) / (2 * safe))


def augmented(plan: Plan, q: dict, s: Site) -> tuple:
    """(κ, b, ⟨ψ⟩, c, ⟨ω⟩) of the child ``s`` under the current factors."""
    b = _trials(plan, s)
    kappa = s.stats[0] - b / 2
    mean, second = linear_maps.moments(plan, q, s.params["logits"])
    c = second.clamp_min(0).sqrt()
    return kappa, b, mean, c, _mean_omega(b, c)


def loglik(plan: Plan, q: dict, s: Site, out: tuple) -> torch.Tensor:
    """The bound on E ln p(y | ψ) (module docstring) summed into ``out``."""
    kappa, b, mean, c, _ = augmented(plan, q, s)
    log_cosh2 = c / 2 + torch.log1p(torch.exp(-c))  # ln(2 cosh(c/2)), stable
    terms = kappa * mean - b * log_cosh2
    if "total_count" in s.params:  # a Binomial's ln C(b, y)
        y = s.stats[0]
        terms = terms + torch.lgamma(b + 1) - torch.lgamma(y + 1) - torch.lgamma(b - y + 1)
    ops = [(terms, s.dims)] + ([] if s.mask is None else [(s.mask, s.mask_dims)])
    return ein(out, ops, s.dims, plan.sizes, plan.ref)


def message(plan: Plan, q: dict, s: Site, to: Site) -> list:
    """m_{y → to}: (Σ_n (κ_n − ⟨ω_n⟩⟨ψ_n^{−k}⟩) J_n, −½ Σ_n ⟨ω_n⟩ J_n J_nᵀ)."""
    kappa, _, _, _, omega = augmented(plan, q, s)
    p = s.params["logits"]
    precision = [(omega, p.dims)] + ([] if s.mask is None else [(s.mask, s.mask_dims)])
    # a Binomial point of 0 trials has ⟨ω⟩ = κ = 0: no information (its weight ⟨ω⟩ is 0)
    safe = torch.where(omega > 0, omega, torch.ones_like(omega))
    return linear_maps.message(plan, q, p, to.name, precision, kappa / safe)
