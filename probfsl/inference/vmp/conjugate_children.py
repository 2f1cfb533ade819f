"""Children whose log-density is linear in one parent's sufficient statistics (design:
docs/design/vmp.md §7.4): Poisson and Exponential under a Gamma rate, Bernoulli and
Binomial under a Beta, a Gamma under a Gamma rate, Categorical observations under a
selected Dirichlet table. Each family gives its coefficients
(:meth:`~probfsl.inference.vmp.family.Family.linear_terms`); the sums are here.

E ln p(x | θ) = Σ_i coef_i(x)·⟨u_i(θ)⟩ + const(x), so the message to θ is the coefficients
summed over the child's axes (weighted by the selection of a mixture), the message to the
selector is E ln p per component, and the bound term is the same sum with the weights.
"""

from __future__ import annotations

import torch

from probfsl.inference.expfam.block import sum_terms
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import Plan, Site, stat_dims
from probfsl.inference.vmp.moments import parent_ops, weights


def linear_key(s: Site) -> str | None:
    """The parameter through which ``s`` is a linear child of a parent (``None`` if it is
    not one): the family's :attr:`~probfsl.inference.vmp.family.Family.linear_parameter`
    where it has a parent (a Categorical's only where its probabilities are selected)."""
    return lookup(s.family).linear_child(s)


def linear_terms(plan: Plan, q: dict, s: Site) -> tuple[list, list]:
    """E ln p(x | parent) of a linear child as ``(coefs, const)``: ``coefs[i]`` multiplies
    the parent's i-th expected statistic, each a list of (sign, operands); ``const`` is a
    list of (sign, operands) without the parent, from the child's family
    (:meth:`~probfsl.inference.vmp.family.Family.linear_terms`; design §7.4)."""
    return lookup(s.family).linear_terms(plan, q, s)


def _data_dims(s: Site) -> tuple:
    """The axes of the child's first statistic (a Categorical's one-hot adds its own)."""
    return lookup(s.family).stat_dims(s)[0]


def _linear_sum(plan: Plan, out: tuple, terms: list, extra: list, over: tuple) -> torch.Tensor:
    """Σ over ``over`` of Σ_j sign_j Π operands_j, each times the operands ``extra``."""
    return sum_terms(
        _signed(sign, ein(out, extra + ops, over, plan.sizes, plan.ref, expand=False))
        for sign, ops in terms
    )


def _signed(sign: int, t: torch.Tensor) -> torch.Tensor:
    """``sign · t`` (``t`` itself for a sign of 1)."""
    return t if sign == 1 else sign * t


def loglik(plan: Plan, q: dict, s: Site, out: tuple, with_weights: bool) -> torch.Tensor:
    """E ln p(x | parent) of a linear child summed into ``out`` (selection weights applied
    when ``with_weights``; without them, per component of the selected axis)."""
    key = linear_key(s)
    coefs, const = linear_terms(plan, q, s)
    u = parent_ops(plan, q, s, key)
    W, comp = weights(plan, q, s)
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    extra = M + (W if with_weights else [])
    over = _data_dims(s) + ((comp,) if comp else ())
    parts = [(const, extra)] if const else []
    parts += [(terms, extra + [stat]) for terms, stat in zip(coefs, u, strict=True)]
    total = sum_terms(_linear_sum(plan, out, terms, ops, over) for terms, ops in parts)
    return total.expand([plan.sizes[x] for x in out])


def message(plan: Plan, q: dict, s: Site, role: str, to: Site) -> list:
    """m_{s → to}: to the parent, the coefficients of its statistics summed over the
    child's axes (weighted by the selection); to the selector, E ln p per component."""
    W, comp = weights(plan, q, s)
    if role == "select":
        return [loglik(plan, q, s, to.dims + (comp,), with_weights=False)]
    p = s.params[role]
    coefs, _ = linear_terms(plan, q, s)
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    over = _data_dims(s) + ((comp,) if comp else ())
    out = []
    for terms, dims in zip(coefs, stat_dims(to), strict=True):
        o = tuple(p.rename[x] for x in dims)
        m = _linear_sum(plan, o, terms, M + W, over) if terms else 0
        out.append(
            torch.as_tensor(m, dtype=plan.ref.dtype, device=plan.ref.device).expand(
                [plan.sizes[x] for x in o]
            )
        )
    return out
