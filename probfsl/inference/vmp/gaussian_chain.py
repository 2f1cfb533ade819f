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

A vector chain, the latent states of a linear-Gaussian state-space model (Kalman 1960),
x_t ~ N(A_t x_{t−1} + b_t, diag(λ_t)⁻¹) with A_t and b_t fixed (known, possibly per task)
and λ_t = ⟨c_t τ_t⟩, has a block-tridiagonal joint precision with D × D blocks

    Λ_tt = −2 H_t + diag(λ_t) + A_{t+1}ᵀ diag(λ_{t+1}) A_{t+1},
    Λ_{t,t−1} = −diag(λ_t) A_t,
    h_t = η₁(t) + λ_t ∘ b_t − A_{t+1}ᵀ (λ_{t+1} ∘ b_{t+1}),

(η₁(t), H_t the first state's prior and the messages of the children outside the chain:
observations y_t ~ N(C x_t, ...), a precision's children). It is solved by the
information-form Kalman filter and the Rauch-Tung-Striebel (1965) smoother, a block
Cholesky factorisation of Λ batched over tasks: forward, the filtered precisions
S_1 = Λ_11, S_t = Λ_tt − Λ_{t,t−1} S_{t−1}⁻¹ Λ_{t−1,t} and g_t = h_t − Λ_{t,t−1} S_{t−1}⁻¹ g_{t−1};
backward, μ_N = S_N⁻¹ g_N, μ_t = S_t⁻¹ (g_t − Λ_{t,t+1} μ_{t+1}), and with
G_t = S_t⁻¹ Λ_{t,t+1}, Σ_t = S_t⁻¹ + G_t Σ_{t+1} G_tᵀ and Cov(x_t, x_{t+1}) = −G_t Σ_{t+1};
ln|Λ| = Σ_t ln|S_t|. Each Cholesky is of a D × D block, so a sweep costs O(N D³) per
task (BayesPy's ``GaussianMarkovChain``; Beal 2003, ch. 5). The factor keeps each
state's marginal (mean, precision) and the chain's lag-one covariances
Cov(x_t, x_{t−1}) [..., N−1, D, D] and ln|Σ|; ⟨x_t (A_t x_{t−1})ᵀ⟩ and the joint entropy
½ N D ln(2πe) + ½ ln|Σ| follow. With everything else fixed the factor is the exact
posterior and the bound the exact log evidence.
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.vmp.chains import copy_step, vector_copies
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import Plan, Site, constant
from probfsl.inference.vmp.matrix_maps import matrix_of
from probfsl.inference.vmp.moments import expected_stats, precision_factors, second_moment


def step_map(plan: Plan, s: Site) -> tuple:
    """(a, d) of a member's mean a s_{t−1} + d in its axes; (None, None) for a copy."""
    p = s.params["loc"]
    if not p.terms:
        return None, None
    sizes, ref = plan.sizes, plan.ref
    term = p.terms[0]
    a = ein(s.dims, [(term.jac, term.jac_dims)], s.dims, plan.sizes, ref)
    return a, ein(s.dims, [(p.const, p.const_dims)], s.dims, sizes, ref)


def vector(plan: Plan, name: str) -> bool:
    """Whether chain ``name`` is a vector chain (each step a matrix map of the last, or
    the state before itself in a group of joint states: :func:`~probfsl.inference.vmp.
    chains.vector_copies`); read once per plan."""
    return constant(plan, ("vector chain", name), lambda: _vector(plan, name), ())


def _vector(plan: Plan, name: str) -> bool:
    step = plan.sites[plan.chains[name][1]]
    second = step.params["loc"]
    if matrix_of(plan.sites, second) is not None or step.name in vector_copies(plan.sites):
        return True
    return bool(second.terms) and second.terms[0].axis is not None


def matrix_map(plan: Plan, q: dict, s: Site) -> tuple:
    """(⟨A⟩ [..., D, D'], b [..., D]) of a vector chain step's mean A x_{t−1} + b, in its
    axes (the state's axis, then the one before's): A itself where it is fixed, the mean
    of its factor where it is a latent matrix (⟨A⟩_il = Σ_kj H_ikjl ⟨M_kj⟩,
    :mod:`~probfsl.inference.vmp.matrix_maps`)."""
    p = s.params["loc"]
    sizes, ref = plan.sizes, plan.ref
    if copy_step(plan.sites, s):  # the state before itself: A = I, b = 0
        size = sizes[s.dims[-1]]
        eye = torch.eye(size, dtype=ref.dtype, device=ref.device)
        return eye, ref.new_zeros([sizes[d] for d in s.dims])
    b = ein(s.dims, [(p.const, p.const_dims)], s.dims, sizes, ref)
    matrix = matrix_of(plan.sites, p)
    if matrix is None:
        term = p.terms[0]
        dims = s.dims + (term.axis,)
        return ein(dims, [(term.jac, term.jac_dims)], dims, sizes, ref), b
    t = p.bilinear
    dims = s.dims + (t.axis_v,)
    mean = expected_stats(plan, q, matrix)[0]
    return ein(dims, [(t.h, t.h_dims), (mean, plan.sites[matrix].dims)], dims, sizes, ref), b


def _quadratic(plan: Plan, q: dict, s: Site, lam: torch.Tensor, a: torch.Tensor):
    """⟨Aᵀ diag(λ) A⟩ [..., D', D'] of a vector chain step: Aᵀ diag(λ) A for a fixed A; for
    a latent matrix, Σ_i λ_i ⟨A_i A_iᵀ⟩ over its rows, with each row's second moment
    ⟨A_i A_iᵀ⟩ = ⟨A_i⟩⟨A_i⟩ᵀ + Cov(A_i) (rows independent under q(A); Beal 2003, §5.3)."""
    p = s.params["loc"]
    matrix = matrix_of(plan.sites, p)
    if matrix is None:
        return a.transpose(-1, -2) @ (lam.unsqueeze(-1) * a)
    t, m = p.bilinear, plan.sites[matrix]
    pair = {t.axis_u: t.axis_u + "b", t.axis_v: t.axis_v + "b"}
    paired = tuple(pair.get(d, d) for d in t.h_dims)
    rows = (second_moment(plan, q, matrix), m.dims + (t.axis_u + "b",))
    out = s.dims[:-1] + (t.axis_v, t.axis_v + "b")
    ops = [(lam, s.dims), (t.h, t.h_dims), (t.h, paired), rows]
    return ein(out, ops, out, plan.sizes, plan.ref)


def matrix_message(plan: Plan, q: dict, s: Site, precision: list) -> list:
    """m_{x_t → M} of a chain step x_t ~ N(H·M x_{t−1} + b, diag(λ)⁻¹) to its latent matrix
    M, with ``precision`` the step's precision operands (λ = ⟨c τ⟩): the coefficients of
    (M, M Mᵀ per row) in E ln N, read off the chain's joint factor,
    (Σ_il λ_i H_ikjl (⟨x_t,i x_{t−1,l}⟩ − b_i⟨x_{t−1,l}⟩),
    −½ Σ_i λ_i H_ikjl H_ikj'l' ⟨x_{t−1,l} x_{t−1,l'}⟩): the expected sufficient statistics
    E[x_t x_{t−1}ᵀ] (with the lag-one covariance) and E[x_{t−1} x_{t−1}ᵀ] of a VB linear
    dynamical system (Beal 2003, §5.3.6; Winn & Bishop 2005)."""
    name, step = s.chain
    p = s.params["loc"]
    t = p.bilinear
    m, pred = plan.sites[t.u], plan.sites[t.v]
    sizes, ref = plan.sizes, plan.ref
    mean, mean_pred = q[s.name][0], q[t.v][0]
    _, b = matrix_map(plan, q, s)
    pair = q[name][0][..., step - 1, :, :] + mean.unsqueeze(-1) * mean_pred.unsqueeze(-2)
    pair = pair - b.unsqueeze(-1) * mean_pred.unsqueeze(-2)  # ⟨(x_t − b) x_{t−1}ᵀ⟩
    h = (t.h, t.h_dims)
    eta1 = ein(m.dims, precision + [(pair, s.dims + (t.axis_v,)), h], (), sizes, ref)
    pair_axes = {t.axis_u: t.axis_u + "b", t.axis_v: t.axis_v + "b"}
    paired = (t.h, tuple(pair_axes.get(d, d) for d in t.h_dims))
    second = (second_moment(plan, q, t.v), pred.dims + (t.axis_v + "b",))
    out = m.dims + (t.axis_u + "b",)
    return [eta1, -0.5 * ein(out, precision + [h, paired, second], (), sizes, ref)]


def cross_moment(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """⟨s_t m_t⟩ of a chain member (t ≥ 1) and its mean m_t = a s_{t−1} + d:
    a (Cov(s_t, s_{t−1}) + ⟨s_t⟩⟨s_{t−1}⟩) + d ⟨s_t⟩ (a = 1, d = 0 for a copy); in a vector
    chain, per state entry i,
    Σ_j A_ij (Cov(x_t, x_{t−1})_ij + ⟨x_t⟩_i ⟨x_{t−1}⟩_j) + b_i ⟨x_t⟩_i."""
    name, t = s.chain
    pred = plan.chains[name][t - 1]
    if vector(plan, name):
        mean, mean_pred = q[s.name][0], q[pred][0]
        pair = q[name][0][..., t - 1, :, :] + mean.unsqueeze(-1) * mean_pred.unsqueeze(-2)
        a, b = matrix_map(plan, q, s)  # ⟨A⟩ of a latent matrix (independent of the chain)
        return (a * pair).sum(-1) + b * mean
    pair = q[name][0][..., t - 1] + q[s.name][0] * q[pred][0]
    a, d = step_map(plan, s)
    return pair if a is None else a * pair + d * q[s.name][0]


def conditionals(plan: Plan, q: dict) -> dict:
    """member -> (predecessor, a, b, v) of every chain member after the first: under the
    joint q, s_t | s_{t−1} ~ N(a + b s_{t−1}, v) with b = C_{t,t−1} / V_{t−1},
    a = ⟨s_t⟩ − b ⟨s_{t−1}⟩ and v = V_t − b C_{t,t−1} (the Gaussian conditional; canonical
    layout). Sampling the members in order from these draws from the joint factor, as a
    guide must for its Monte Carlo ELBO to match the analytic one. In a vector chain,
    x_t | x_{t−1} ~ MVN(a + B x_{t−1}, V) with B = C_{t,t−1} Σ_{t−1}⁻¹ [..., D, D],
    a = ⟨x_t⟩ − B ⟨x_{t−1}⟩ and V = Σ_t − B C_{t,t−1}ᵀ (:func:`_vector_conditionals`)."""
    out = {}
    for name, members in plan.chains.items():
        if vector(plan, name):
            out.update(_vector_conditionals(q, name, members))
            continue
        lag = q[name][0]
        for t in range(1, len(members)):
            member, pred = members[t], members[t - 1]
            (mean, prec), (mean_pred, prec_pred) = q[member], q[pred]
            cov = lag[..., t - 1]
            b = cov * prec_pred
            out[member] = (pred, mean - b * mean_pred, b, prec.reciprocal() - b * cov)
    return out


def _vector_conditionals(q: dict, name: str, members: list) -> dict:
    """:func:`conditionals` of a vector chain, batched over the leading axes. The factor
    keeps Cov(x_t, x_{t−1}) = C_{t,t−1} [..., N−1, D, D] and each state's precision
    Σ_t⁻¹, so B = C_{t,t−1} Σ_{t−1}⁻¹ is a product, and Σ_t a Cholesky inverse of the
    precision. A state whose factor keeps only its marginal variances (no linear map
    contracts its axis: the last, with elementwise children) has a diagonal precision
    block Λ_tt in the joint, and x_t | x_{t−1} = x_t | rest has covariance Λ_tt⁻¹: V is
    diagonal, diag(V) = diag(Σ_t) − diag(B C_{t,t−1}ᵀ)."""
    lag = q[name][0]
    out = {}
    for t in range(1, len(members)):
        member, pred = members[t], members[t - 1]
        (mean, prec), (mean_pred, prec_pred) = q[member], q[pred]
        if prec_pred.dim() == mean_pred.dim():  # marginal variances only (not expected)
            prec_pred = torch.diag_embed(prec_pred)
        cross = lag[..., t - 1, :, :]  # Cov(x_t, x_{t−1})
        b = cross @ prec_pred
        a = mean - (b @ mean_pred.unsqueeze(-1)).squeeze(-1)
        explained = b @ cross.transpose(-1, -2)  # B C_{t,t−1}ᵀ = C Σ_{t−1}⁻¹ Cᵀ
        if prec.dim() == mean.dim():  # an elementwise factor: V diagonal
            v = torch.diag_embed(prec.reciprocal() - explained.diagonal(dim1=-2, dim2=-1))
        else:
            v = torch.cholesky_inverse(torch.linalg.cholesky(prec)) - explained
        v = 0.5 * (v + v.transpose(-1, -2))
        out[member] = (pred, a, b, v)
    return out


def entropy(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """The chain's joint entropy, counted on its first site (zero on the others)."""
    name, t = s.chain
    if vector(plan, name):
        if t:
            return torch.zeros_like(q[name][1])
        n = sum(plan.sizes[plan.sites[m].dims[-1]] for m in plan.chains[name])
        return 0.5 * n * (1 + math.log(2 * math.pi)) + 0.5 * q[name][1]
    if t:
        return torch.zeros_like(q[s.name][0])
    n = len(plan.chains[name])
    return 0.5 * n * (1 + math.log(2 * math.pi)) + 0.5 * q[name][1]


def update(plan: Plan, q: dict, name: str, natural, message, children: bool = True) -> dict:
    """The joint factor of chain ``name``: new (mean, precision) of every member and the
    chain's (lag-one covariances [..., N−1], ln|Σ|). ``natural`` and ``message`` are the
    engine's (the first member's prior, the external children's messages)."""
    if vector(plan, name):
        return _vector_update(plan, q, name, natural, message, children)
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


def _vector_update(plan: Plan, q: dict, name: str, natural, message, children: bool) -> dict:
    """:func:`update` of a vector chain: the block-tridiagonal precision (module
    docstring) from the messages, then the Kalman filter and RTS smoother."""
    members = plan.chains[name]
    sites = [plan.sites[m] for m in members]
    batch = [plan.sizes[d] for d in sites[0].dims[:-1]]
    size = plan.sizes[sites[0].dims[-1]]
    ref = plan.ref
    h, prec = [], []
    for t, (m, s) in enumerate(zip(members, sites, strict=True)):
        if t == 0:
            eta1, eta2 = natural(plan, q, m, children=False)
            eta1 = eta1.expand(*batch, size)
            eta2 = (eta2 if eta2.dim() > eta1.dim() else torch.diag_embed(eta2)).expand(
                *batch, size, size
            )
        else:
            eta1, eta2 = ref.new_zeros(*batch, size), ref.new_zeros(*batch, size, size)
        for child, role in plan.children[m] if children else ():
            if role == "loc" and plan.sites[child].chain and plan.sites[child].chain[0] == name:
                continue  # the next step: inside the joint factor
            m1, m2 = message(plan, q, child, role, s)
            if m2.dim() < eta2.dim():  # an elementwise message: a diagonal block
                m2 = torch.diag_embed(m2.expand(*batch, size))
            eta1, eta2 = eta1 + m1, eta2 + m2
        h.append(eta1)
        prec.append(-2 * eta2)
    lower = [None]  # Λ_{t,t−1}
    for t in range(1, len(members)):  # −½ (x_t − A x_{t−1} − b)ᵀ diag(λ) (x_t − A x_{t−1} − b)
        lam = _precision(plan, q, sites[t]).expand(*batch, size)
        a, b = matrix_map(plan, q, sites[t])  # ⟨A⟩ of a latent matrix
        la = lam.unsqueeze(-1) * a  # diag(λ) ⟨A⟩
        prec[t] = prec[t] + torch.diag_embed(lam)
        quad = _quadratic(plan, q, sites[t], lam, a)  # ⟨Aᵀ diag(λ) A⟩
        prec[t - 1] = prec[t - 1] + quad.expand(*batch, size, size)
        lower.append(-la)
        lb = lam * b
        h[t] = h[t] + lb
        h[t - 1] = h[t - 1] - (a.transpose(-1, -2) @ lb.unsqueeze(-1)).squeeze(-1)
    return _kalman_smoother(members, name, h, prec, lower, [s.joint for s in sites])


def _kalman_smoother(members, name, h, prec, lower, joint) -> dict:
    """Mean, covariances and ln|Σ| of the Gaussian with block-tridiagonal precision
    (diagonal blocks ``prec``, lower blocks ``lower``) and linear term ``h``: the
    information filter forward, the RTS smoother backward (module docstring)."""
    n = len(members)
    chol, g = [], []
    log_det = 0
    for t in range(n):
        s_t, g_t = prec[t], h[t]
        if t:  # S_t = Λ_tt − L S⁻¹ Lᵀ, g_t = h_t − L S⁻¹ g_{t−1}
            k = torch.cholesky_solve(lower[t].transpose(-1, -2), chol[-1])  # S⁻¹ Lᵀ
            s_t = s_t - lower[t] @ k
            s_t = 0.5 * (s_t + s_t.transpose(-1, -2))
            g_t = g_t - (k.transpose(-1, -2) @ g[-1].unsqueeze(-1)).squeeze(-1)
        c = torch.linalg.cholesky(s_t)
        chol.append(c)
        g.append(g_t)
        log_det = log_det - 2 * c.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    mean, cov, lag = [None] * n, [None] * n, [None] * (n - 1)
    mean[-1] = torch.cholesky_solve(g[-1].unsqueeze(-1), chol[-1]).squeeze(-1)
    cov[-1] = torch.cholesky_inverse(chol[-1])
    for t in range(n - 2, -1, -1):  # G_t = S_t⁻¹ Λ_{t,t+1}
        gain = torch.cholesky_solve(lower[t + 1].transpose(-1, -2), chol[t])
        rhs = g[t] - (lower[t + 1].transpose(-1, -2) @ mean[t + 1].unsqueeze(-1)).squeeze(-1)
        mean[t] = torch.cholesky_solve(rhs.unsqueeze(-1), chol[t]).squeeze(-1)
        cross = -gain @ cov[t + 1]  # Cov(x_t, x_{t+1})
        cov[t] = torch.cholesky_inverse(chol[t]) - cross @ gain.transpose(-1, -2)
        cov[t] = 0.5 * (cov[t] + cov[t].transpose(-1, -2))
        lag[t] = cross.transpose(-1, -2)  # Cov(x_{t+1}, x_t)
    out = {}
    for t, m in enumerate(members):
        if joint[t] or t == 0:
            out[m] = (mean[t], torch.cholesky_inverse(torch.linalg.cholesky(cov[t])))
        else:  # an elementwise factor: the marginal variances
            out[m] = (mean[t], cov[t].diagonal(dim1=-2, dim2=-1).reciprocal())
    out[name] = (torch.stack(lag, -3), log_det)
    return out
