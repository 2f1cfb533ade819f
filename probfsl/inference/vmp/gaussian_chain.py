"""A Gaussian Markov chain as one joint factor (docs/design/vmp.md §7.5; BayesPy's
``GaussianMarkovChain``).

Latent Normal sites s_1, ..., s_N of which each is the mean of the next, or a fixed
elementwise affine map of it, s_t ~ N(a_t s_{t−1} + d_t, (c_t τ_t)⁻¹) (a = 1, d = 0 for a
random walk), written as a loop in Pyro, are updated together: their joint q is Gaussian
with a tridiagonal precision per element,

    Λ_tt = λ_t + a²_{t+1} λ_{t+1} − 2 η₂(t),   Λ_{t,t−1} = −a_t λ_t,
    h_t = η₁(t) + λ_t d_t − a_{t+1} λ_{t+1} d_{t+1},

where λ_t = ⟨c_t τ_t⟩, and η(t) holds the first site's prior and the messages of every
child outside the chain (observations, a precision's children). The factor is solved
exactly (a batched Cholesky, the smoother's answer); the sites keep their marginal
(mean, precision) and the chain its lag-one covariances and log-determinant, from which
the pairwise terms ⟨s_t s_{t−1}⟩ and the joint entropy ½ N ln(2πe) + ½ ln|Σ| follow.
Mean-field over the steps would lose the covariances between neighbours.
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import Plan, Site
from probfsl.inference.vmp.moments import precision_factors


def step_map(plan: Plan, s: Site) -> tuple:
    """(a, d) of a member's mean a s_{t−1} + d in its axes; (None, None) for a copy."""
    p = s.params["loc"]
    if not p.terms:
        return None, None
    sizes, ref = plan.sizes, plan.ref
    term = p.terms[0]
    a = ein(s.dims, [(term.jac, term.jac_dims)], s.dims, plan.sizes, ref)
    return a, ein(s.dims, [(p.const, p.const_dims)], s.dims, sizes, ref)


def cross_moment(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """⟨s_t m_t⟩ of a chain member (t ≥ 1) and its mean m_t = a s_{t−1} + d:
    a (Cov(s_t, s_{t−1}) + ⟨s_t⟩⟨s_{t−1}⟩) + d ⟨s_t⟩ (a = 1, d = 0 for a copy)."""
    name, t = s.chain
    pred = plan.chains[name][t - 1]
    pair = q[name][0][..., t - 1] + q[s.name][0] * q[pred][0]
    a, d = step_map(plan, s)
    return pair if a is None else a * pair + d * q[s.name][0]


def conditionals(plan: Plan, q: dict) -> dict:
    """member -> (predecessor, a, b, v) of every chain member after the first: under the
    joint q, s_t | s_{t−1} ~ N(a + b s_{t−1}, v) with b = C_{t,t−1} / V_{t−1},
    a = ⟨s_t⟩ − b ⟨s_{t−1}⟩ and v = V_t − b C_{t,t−1} (the Gaussian conditional; canonical
    layout). Sampling the members in order from these draws from the joint factor, as a
    guide must for its Monte Carlo ELBO to match the analytic one."""
    out = {}
    for name, members in plan.chains.items():
        lag = q[name][0]
        for t in range(1, len(members)):
            member, pred = members[t], members[t - 1]
            (mean, prec), (mean_pred, prec_pred) = q[member], q[pred]
            cov = lag[..., t - 1]
            b = cov * prec_pred
            out[member] = (pred, mean - b * mean_pred, b, prec.reciprocal() - b * cov)
    return out


def entropy(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """The chain's joint entropy, counted on its first site (zero on the others)."""
    name, t = s.chain
    if t:
        return torch.zeros_like(q[s.name][0])
    n = len(plan.chains[name])
    return 0.5 * n * (1 + math.log(2 * math.pi)) + 0.5 * q[name][1]


def update(plan: Plan, q: dict, name: str, natural, message, children: bool = True) -> dict:
    """The joint factor of chain ``name``: new (mean, precision) of every member and the
    chain's (lag-one covariances [..., N−1], ln|Σ|). ``natural`` and ``message`` are the
    engine's (the first member's prior, the external children's messages)."""
    members = plan.chains[name]
    sites = [plan.sites[m] for m in members]
    h, diag = [], []
    for t, (m, s) in enumerate(zip(members, sites, strict=True)):
        if t == 0:
            eta1, eta2 = natural(plan, q, m, children=False)
        else:
            eta1 = torch.zeros_like(q[m][0]) if m in q else plan.ref.new_zeros(())
            eta2 = torch.zeros_like(eta1)
        for child, role in plan.children[m] if children else ():
            if role == "loc" and plan.sites[child].chain and plan.sites[child].chain[0] == name:
                continue  # the next step: inside the joint factor
            m1, m2 = message(plan, q, child, role, s)
            eta1, eta2 = eta1 + m1, eta2 + m2
        h.append(eta1)
        diag.append(-2 * eta2)
    shape = [plan.sizes[d] for d in sites[0].dims]
    h = torch.stack([x.expand(shape) for x in h], -1)
    lam = [_precision(plan, q, s).expand(shape) for s in sites[1:]]  # λ_2 .. λ_N
    n = len(members)
    prec = torch.diag_embed(torch.stack([x.expand(shape) for x in diag], -1))
    for t in range(1, n):  # −½ λ_t (s_t − a s_{t−1} − d)², a = 1 and d = 0 for a copy
        a, d = step_map(plan, sites[t])
        lt = lam[t - 1]
        al = lt if a is None else a * lt
        prec[..., t, t] += lt
        prec[..., t - 1, t - 1] += lt if a is None else a * al
        prec[..., t, t - 1] -= al
        prec[..., t - 1, t] -= al
        if d is not None:
            h[..., t] += lt * d
            h[..., t - 1] -= al * d
    chol = torch.linalg.cholesky(prec)
    cov = torch.cholesky_inverse(chol)
    mean = torch.cholesky_solve(h.unsqueeze(-1), chol).squeeze(-1)
    var = cov.diagonal(dim1=-2, dim2=-1)
    out = {m: (mean[..., t], var[..., t].reciprocal()) for t, m in enumerate(members)}
    lag = torch.stack([cov[..., t, t - 1] for t in range(1, n)], -1)
    log_det = -2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    out[name] = (lag, log_det)
    return out


def _precision(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """λ_t = ⟨c τ_t⟩ of a member's step, in its axes."""
    p = s.params["precision"]
    factors = precision_factors(plan, q, s)
    if factors:
        ops = [(p.coef, p.coef_dims)] + [stats[0] for _, stats in factors]
    else:
        ops = [(p.const, p.const_dims)]
    return ein(s.dims, ops, s.dims, plan.sizes, plan.ref)
