"""Children whose log-density is linear in one parent's sufficient statistics (design:
docs/design/vmp.md §7.4): Poisson under a Gamma rate, Bernoulli and Binomial under a Beta, a Gamma
under a Gamma rate, Categorical observations under a selected Dirichlet table.

E ln p(x | θ) = Σ_i coef_i(x)·⟨u_i(θ)⟩ + const(x), so the message to θ is the coefficients
summed over the child's axes (weighted by the selection of a mixture), the message to the
selector is E ln p per component, and the bound term is the same sum with the weights.
"""

from __future__ import annotations

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import Plan, Site, derived, stat_dims
from probfsl.inference.vmp.moments import expected_stats, parent_ops, weights

#: (child family, parameter) pairs whose E ln p(child | parent) is linear in the parent's
#: expected sufficient statistics (design §7.4): Σ_i coef_i(x) ⟨u_i(parent)⟩ + const(x)
LINEAR_CHILDREN = {
    ("Poisson", "rate"),
    ("Bernoulli", "probs"),
    ("Binomial", "probs"),
    ("Gamma", "rate"),
    ("Categorical", "probs"),
}


def linear_key(s: Site) -> str | None:
    """The parameter through which ``s`` is a linear child of a parent (``None`` if it is
    not one). A Categorical is handled here only when its probabilities are selected."""
    for key, p in s.params.items():
        if p.parent is None or (s.family, key) not in LINEAR_CHILDREN:
            continue
        if s.family == "Categorical" and p.comp is None:
            return None
        return key
    return None


def _cached(plan: Plan, key: tuple, make):
    hit = plan.cache.get(key)
    if hit is None:
        hit = plan.cache[key] = make()
    return hit


def linear_terms(plan: Plan, q: dict, s: Site) -> tuple[list, list]:
    """E ln p(x | parent) of a linear child as ``(coefs, const)``: ``coefs[i]`` multiplies
    the parent's i-th expected statistic, each a list of (sign, operands); ``const`` is a
    list of (sign, operands) without the parent (design §7.4):

    * Poisson(k | c λ), u(λ) = (λ, ln λ): coefficients (−c, k), const k ln c − ln k!;
    * Bernoulli(y | p), u(p) = (ln p, ln(1 − p)): (y, 1 − y);
    * Binomial(y | n, p): (y, n − y), const ln C(n, y);
    * Gamma(τ | a, c b), u(b) = (b, ln b): (−c⟨τ⟩, a), const a ln c + (a − 1)⟨ln τ⟩ − ln Γ(a);
    * Categorical(x | θ_z), u(θ) = ln θ: (one-hot x,).
    """
    key = linear_key(s)
    p, d = s.params[key], s.dims
    if s.family == "Categorical":
        return [[(1, [(s.stats[0], d + (f"{s.name}#cat",))])]], []
    if s.family in ("Bernoulli", "Binomial"):
        y = [(s.stats[0], d)]
        if s.family == "Bernoulli":
            return [[(1, y)], [(1, []), (-1, y)]], []
        n = s.params["total_count"]
        n_ops = [(n.const, n.const_dims)]

        def log_binom():
            nn = ein(d, n_ops, d, plan.sizes, s.stats[0])
            v = s.stats[0]
            return torch.lgamma(nn + 1) - torch.lgamma(v + 1) - torch.lgamma(nn - v + 1)

        lb = _cached(plan, ("log_binom", s.name), log_binom)
        return [[(1, y)], [(1, n_ops), (-1, y)]], [(1, [(lb, d)])]
    c, lnc = [(p.coef, p.coef_dims)], [(derived(p, "log_coef"), p.coef_dims)]
    if s.family == "Poisson":
        k = [(s.stats[0], d)]
        lgk = _cached(plan, ("log_factorial", s.name), lambda: torch.lgamma(s.stats[0] + 1))
        if not set(p.coef_dims) <= set(d):
            return [[(-1, c)], [(1, k)]], [(1, k + lnc), (-1, [(lgk, d)])]

        def k_log_c():  # 0 where k = 0, also for an exposure c = 0 (0 ln 0 = 0)
            return torch.xlogy(s.stats[0], ein(d, c, d, plan.sizes, s.stats[0]))

        klc = _cached(plan, ("k_log_coef", s.name), k_log_c)
        return [[(-1, c)], [(1, k)]], [(1, [(klc, d)]), (-1, [(lgk, d)])]
    # Gamma(τ | a, c b)
    a = s.params["concentration"]
    a_ops = [(a.const, a.const_dims)]
    am1, lga = _cached(plan, ("gamma_shape", s.name), lambda: (a.const - 1, torch.lgamma(a.const)))
    tau, log_tau = expected_stats(plan, q, s.name) if s.observed or s.name in q else (None, None)
    const = [(1, a_ops + lnc), (-1, [(lga, a.const_dims)])]
    if log_tau is not None:
        const.append((1, [(am1, a.const_dims), (log_tau, d)]))
    coef1 = [(-1, c + [(tau, d)])] if tau is not None else []
    return [coef1, [(1, a_ops)]], const


def _linear_sum(plan: Plan, out: tuple, terms: list, extra: list, over: tuple) -> torch.Tensor:
    """Σ over ``over`` of Σ_j sign_j Π operands_j, each times the operands ``extra``."""
    total = 0
    for sign, ops in terms:
        total = total + sign * ein(out, extra + ops, over, plan.sizes, plan.ref, expand=False)
    return total


def loglik(plan: Plan, q: dict, s: Site, out: tuple, with_weights: bool) -> torch.Tensor:
    """E ln p(x | parent) of a linear child summed into ``out`` (selection weights applied
    when ``with_weights``; without them, per component of the selected axis)."""
    key = linear_key(s)
    coefs, const = linear_terms(plan, q, s)
    u = parent_ops(plan, q, s, key)
    W, comp = weights(plan, q, s)
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    extra = M + (W if with_weights else [])
    over = s.dims + ((f"{s.name}#cat",) if s.family == "Categorical" else ())
    over = over + ((comp,) if comp else ())
    total = _linear_sum(plan, out, const, extra, over)
    for terms, stat in zip(coefs, u, strict=True):
        total = total + _linear_sum(plan, out, terms, extra + [stat], over)
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
    over = s.dims + ((f"{s.name}#cat",) if s.family == "Categorical" else ())
    over = over + ((comp,) if comp else ())
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


def gamma_rate_natural(plan: Plan, q: dict, s: Site) -> list:
    """η of a Gamma factor whose rate is c · b with b a Gamma site: (−c⟨b⟩, a − 1) (the
    expected natural parameter of its prior, design §1), b selected where it is indexed."""
    p, a = s.params["rate"], s.params["concentration"]
    W, comp = weights(plan, q, s)
    over = s.dims + ((comp,) if comp else ())
    b = parent_ops(plan, q, s, "rate")[0]
    eta1 = -ein(s.dims, W + [(p.coef, p.coef_dims), b], over, plan.sizes, plan.ref)
    eta2 = ein(s.dims, [(a.const - 1, a.const_dims)], s.dims, plan.sizes, plan.ref)
    return [eta1, eta2]
