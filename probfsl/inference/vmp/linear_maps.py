"""Affine maps of Gaussian sites: y ~ Normal(Σ_k J_k w_k + b, (c β)^-1/2) (spec ``vmp.md`` §7.1).

BayesPy's ``Dot``, ``SumMultiply`` and ``Add``, read off a plain Pyro model: ``X @ w``,
``(X * w).sum(-1)``, ``a + b`` and ``c * mu`` with observed coefficients. The compiler
(:meth:`~probfsl.inference.vmp.compiler.Compiler._linear_map`) finds each Jacobian J_k by
automatic differentiation and proves the map affine structurally (the gradient of the
parameter does not depend on the parent); this module supplies the two quantities the
Normal algebra needs:

* the moments of the parameter, ⟨loc⟩ = b + Σ_k J_k⟨w_k⟩ and
  ⟨loc²⟩ = ⟨loc⟩² + Σ_k (J_k⟨w_k w_kᵀ⟩J_kᵀ − (J_k⟨w_k⟩)²) (factors independent across k);
* the message to each parent w_k, with the residual r = ⟨y⟩ − ⟨loc⟩ + J_k⟨w_k⟩:
  (Σ_n c⟨β⟩ r_n J_nk, −½ Σ_n c⟨β⟩ J_nk J_nkᵀ); a matrix second part when the map contracts
  the parent's last event axis (its factor is then joint over that axis), elementwise
  otherwise.
"""

from __future__ import annotations

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import LinearTerm, Param, Plan
from probfsl.inference.vmp.moments import expected_stats, second_moment


def _paired(term: LinearTerm) -> tuple:
    """J's axes with the contracted axis renamed to its second copy (for J S Jᵀ)."""
    return tuple(d + "b" if d == term.axis else d for d in term.jac_dims)


def term_mean(plan: Plan, q: dict, p: Param, term: LinearTerm) -> torch.Tensor:
    """J⟨w⟩ in the parameter's axes."""
    w = plan.sites[term.parent]
    m = expected_stats(plan, q, term.parent)[0]
    over = p.dims + ((term.axis,) if term.axis else ())
    return ein(p.dims, [(term.jac, term.jac_dims), (m, w.dims)], over, plan.sizes, plan.ref)


def moments(plan: Plan, q: dict, p: Param) -> tuple[torch.Tensor, torch.Tensor]:
    """(⟨loc⟩, ⟨loc²⟩) of an affine parameter, each in the parameter's axes."""
    sizes, ref = plan.sizes, plan.ref
    mean = ein(p.dims, [(p.const, p.const_dims)], p.dims, sizes, ref)
    var = 0
    for term in p.terms:
        w = plan.sites[term.parent]
        j = (term.jac, term.jac_dims)
        part = term_mean(plan, q, p, term)
        mean = mean + part
        if term.axis is None:
            m, m2 = expected_stats(plan, q, term.parent)
            var = var + ein(p.dims, [j, j, (m2 - m.square(), w.dims)], p.dims, sizes, ref)
        else:
            s2 = second_moment(plan, q, term.parent)
            over = p.dims + (term.axis, term.axis + "b")
            ops = [j, (s2, w.dims + (term.axis + "b",)), (term.jac, _paired(term))]
            var = var + ein(p.dims, ops, over, sizes, ref) - part.square()
    return mean, mean.square() + var


def message(
    plan: Plan, q: dict, p: Param, parent: str, precision: list, data: torch.Tensor
) -> list:
    """m_{y → parent} for the affine parameter ``p`` of a Normal child with expected value
    ``data`` (in ``p.dims``) and precision operands ``precision`` (mask, c, ⟨β⟩)."""
    sizes, ref = plan.sizes, plan.ref
    term = next(t for t in p.terms if t.parent == parent)
    w = plan.sites[parent]
    mean, _ = moments(plan, q, p)
    residual = data - mean + term_mean(plan, q, p, term)
    j = (term.jac, term.jac_dims)
    over = p.dims + ((term.axis,) if term.axis else ())
    eta1 = ein(w.dims, precision + [(residual, p.dims), j], over, sizes, ref)
    if term.axis is None:
        return [eta1, -0.5 * ein(w.dims, precision + [j, j], over, sizes, ref)]
    out = w.dims + (term.axis + "b",)
    over = over + (term.axis + "b",)
    eta2 = ein(out, precision + [j, (term.jac, _paired(term))], over, sizes, ref)
    return [eta1, -0.5 * eta2]
