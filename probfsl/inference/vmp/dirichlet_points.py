"""Observed probability vectors under a Dirichlet law whose concentrations are point
estimates (docs/design/vmp.md §7.2; EM-Dirichlet's likelihood, Martin et al. 2024).

For an observed p_n ~ Dirichlet(α_{z_n}) with α a ``pyro.param`` (optionally selected by a
latent Categorical z), E ln p = Σ_k r_nk [ln Γ(Σ_j α_kj) − Σ_j ln Γ(α_kj) + Σ_j (α_kj − 1)
ln p_nj]. Its message to z is that bracket per component; its message to α is the pair
of sufficient statistics S_kj = Σ_n r_nk ln p_nj and R_k = Σ_n r_nk, with which
F(α_k) = R_k [ln Γ(Σ_j α_kj) − Σ_j ln Γ(α_kj)] + Σ_j (α_kj − 1) S_kj is concave. The M step
is Minka's fixed point α_j ← ψ⁻¹(ψ(Σ_i α_i) + S_j / R) (Minka, *Estimating a Dirichlet
distribution*, 2000, eq. 9), each iteration of which raises F, so the bound never falls.

Another solver of the same M step may stand in for Minka's while a fit runs
(:func:`solved_by`): a function ``(alpha, S, R) -> alpha`` that does not lower F, e.g. the
MM-quadratic of EM-Dirichlet's Algorithm 1 with the reference code's stopping rule
(:mod:`probfsl.derived.em_dirichlet`), so that a derived engine follows a hand-written one
step for step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import Plan, Site
from probfsl.inference.vmp.moments import parent_ops, weights

#: fixed-point iterations per sweep (each raises the bound)
INNER = 5

#: an M step: (alpha [..., K], S [..., K], R [..., K] (the weight, expanded)) -> alpha
MStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_SOLVER: ContextVar[MStep | None] = ContextVar("dirichlet_m_step", default=None)


@contextlib.contextmanager
def solved_by(solver: MStep) -> Iterator[None]:
    """Within the block, every point-estimated Dirichlet concentration is updated by
    ``solver(alpha, S, R)`` instead of Minka's fixed point (:func:`m_step`). The solver
    must not lower F (the bound would fall otherwise) and, like every update, must make no
    host synchronisation."""
    token = _SOLVER.set(solver)
    try:
        yield
    finally:
        _SOLVER.reset(token)


def is_child(s: Site) -> bool:
    """Whether ``s`` is an observed Dirichlet with a point-estimated concentration (the one
    family whose concentration may have a parent)."""
    p = s.params.get("concentration")
    return s.observed and p is not None and p.parent is not None


def loglik(plan: Plan, q: dict, s: Site, out: tuple, with_weights: bool) -> torch.Tensor:
    """E ln Dir(p | α) summed into ``out``: weighted by the selection (the bound) or per
    component of the selected axis (the message to the selector)."""
    alpha, dims = parent_ops(plan, q, s, "concentration")[0]
    normaliser = torch.lgamma(alpha.sum(-1)) - torch.lgamma(alpha).sum(-1)
    w, comp = weights(plan, q, s)
    extra = ([] if s.mask is None else [(s.mask, s.mask_dims)]) + (w if with_weights else [])
    over = s.dims + ((comp,) if comp else ())
    per_vector = tuple(d for d in over if d != s.dims[-1])  # one normaliser per vector
    total = ein(out, extra + [(normaliser, dims[:-1])], per_vector, plan.sizes, plan.ref)
    ops = extra + [(alpha - 1, dims), (s.stats[0], s.dims)]
    return total + ein(out, ops, over, plan.sizes, plan.ref)


def message(plan: Plan, q: dict, s: Site, role: str, to: Site) -> list:
    """To the selector: E ln p per component; to the concentration: (S, R) in its axes."""
    w, comp = weights(plan, q, s)
    if role == "select":
        return [loglik(plan, q, s, to.dims + (comp,), with_weights=False)]
    p = s.params["concentration"]
    out = tuple(p.rename[d] for d in to.dims)
    extra = ([] if s.mask is None else [(s.mask, s.mask_dims)]) + w
    over = s.dims + ((comp,) if comp else ())
    stat = ein(out, extra + [(s.stats[0], s.dims)], over, plan.sizes, plan.ref)
    per_vector = tuple(d for d in over if d != s.dims[-1])
    weight = ein(out[:-1], extra, per_vector, plan.sizes, plan.ref).unsqueeze(-1)
    return [stat, weight.expand_as(stat)]


def _inverse_digamma(y: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """ψ⁻¹(y) by Newton's method from Minka's starting point (2000, appendix C)."""
    gamma = -torch.special.digamma(torch.ones((), dtype=y.dtype, device=y.device))
    x = torch.where(y >= -2.22, torch.exp(y) + 0.5, -1 / (y + gamma))
    for _ in range(steps):
        x = x - (torch.special.digamma(x) - y) / torch.special.polygamma(1, x)
    return x


def m_step(alpha: torch.Tensor, stat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Minka's fixed point from ``alpha`` for the statistics (S, R); components without
    weight keep their value. Within :func:`solved_by`, that block's solver instead."""
    solver = _SOLVER.get()
    if solver is not None:
        return solver(alpha, stat, weight)
    has = weight > 0
    mean_log = stat / torch.where(has, weight, torch.ones_like(weight))
    for _ in range(INNER):
        new = _inverse_digamma(torch.special.digamma(alpha.sum(-1, keepdim=True)) + mean_log)
        alpha = torch.where(has, new, alpha)
    return alpha
