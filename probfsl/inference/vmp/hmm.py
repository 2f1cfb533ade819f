"""A Categorical Markov chain as one structured factor: Pyro's ``DiscreteHMM`` observed,
with Dirichlet initial and transition probabilities and per state a Normal or a
Categorical observation law (docs/design/vmp.md §7.5; Beal, *Variational algorithms for
approximate Bayesian inference*, 2003, ch. 3; BayesPy's ``CategoricalMarkovChain`` with a
``Mixture`` of ``GaussianARD`` or ``Categorical`` nodes).

The hidden chain is Pyro's: ``DiscreteHMM.log_prob`` draws a state z_0 from the initial
probabilities π and then takes one transition before each observation, so z_1 ~ A[z_0] and
x_1 | z_1 (BayesPy's ``CategoricalMarkovChain`` with one more state, unobserved, first). It
is not a site: its factor q(z_0..z_N) is the exact chain given the expected log-potentials
⟨ln π⟩, ⟨ln A⟩ and the emission terms E ln p(x_n | z_n = k) (none for z_0), computed by
forward-backward whenever it is read (batched over tasks, a loop over time; the scaled
recursions of :func:`forward_backward`). The emission term is
E ln N(x_n | μ_k, (c τ_k)⁻¹) for a Normal law and Σ_v [x_n = v] ⟨ln B_kv⟩ for a Categorical
one with rows B_k ~ Dirichlet. Its messages are the expected counts: γ_0 to π, Σ_n ξ_n
to A (N transitions), and the state-weighted data to each state's parameters (to B_k:
Σ_n γ_nk onehot(x_n), so q(B_k) = Dirichlet(α_k + Σ_n γ_nk onehot(x_n))). With q(z) at
its optimum the chain's part of the bound, E ln p(x, z | θ) + H[q(z)], is the forward
pass's normaliser ln Z̃, so every update of a parent is followed by an optimal q(z) and the
bound never falls.
"""

from __future__ import annotations

import math

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import Plan, Site, derived
from probfsl.inference.vmp.moments import parent_ops

LOG_2PI = math.log(2 * math.pi)


def _expected(plan: Plan, q: dict, s: Site, key: str, stat: int) -> tuple:
    """(operand, axes) of the expected statistic ``stat`` of a parameter's parent, or of
    the fixed parameter (its value, its square or its logarithm)."""
    p = s.params[key]
    ops = parent_ops(plan, q, s, key)
    if ops is not None:
        return ops[stat]
    kind = {0: None, 1: "square" if key == "loc" else "log"}[stat]
    return (p.const if kind is None else derived(p, kind)), p.const_dims


def _chain(plan: Plan, q: dict, s: Site) -> tuple:
    """(γ [T, N, K] of the observed steps, Σ_n ξ_n [T, K, K] over the N transitions, ln Z̃
    [T], γ_0 [T, K] of the initial state) under the current factors, cached while the
    parents' factors are the same objects. The initial state z_0 has no observation
    (module docstring): its emission term is 0."""
    parents = [p.parent for p in s.params.values() if p.parent is not None]
    hit = plan.cache.get(("hmm", s.name))
    if hit is not None and all(q[n] is f for n, f in zip(parents, hit[0], strict=True)):
        return hit[1]
    sizes, ref = plan.sizes, plan.ref
    state, batch = f"{s.name}#s", s.dims[:-1]
    log_init = ein(
        batch + (state,), [_pot(plan, q, s, "initial_logits")], batch + (state,), sizes, ref
    )
    trans_dims = batch + (state, f"{s.name}#s2")
    log_trans = ein(trans_dims, [_pot(plan, q, s, "transition_logits")], trans_dims, sizes, ref)
    log_emit = emission(plan, q, s)  # [batch, N, K]
    unobserved = log_emit.new_zeros(log_emit.shape[:-2] + (1, log_emit.shape[-1]))
    gamma, pairs, log_z = forward_backward(
        log_init, log_trans, torch.cat([unobserved, log_emit], -2)
    )
    result = (gamma[..., 1:, :], pairs, log_z, gamma[..., 0, :])
    plan.cache[("hmm", s.name)] = ([q[n] for n in parents], result)
    return result


def _pot(plan: Plan, q: dict, s: Site, key: str) -> tuple:
    """⟨ln π⟩ or ⟨ln A⟩ (from a Dirichlet parent) or the fixed logits."""
    p = s.params[key]
    ops = parent_ops(plan, q, s, key)
    return ops[0] if ops is not None else (p.const, p.const_dims)


def _precision(plan: Plan, q: dict, s: Site) -> tuple[list, list]:
    """Operands of ⟨c τ⟩ and the terms of ⟨ln(c τ)⟩ of the observation precision."""
    p = s.params["precision"]
    ops = parent_ops(plan, q, s, "precision")
    if ops is None:
        return [(p.const, p.const_dims)], [[(derived(p, "log"), p.const_dims)]]
    coef = (p.coef, p.coef_dims)
    return [coef, ops[0]], [[(derived(p, "log_coef"), p.coef_dims)], [ops[1]]]


def emission(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """E ln p(x_n | z_n = k) [batch, N, K]: for a Normal law E ln N(x_n | μ_k, (c τ_k)⁻¹) =
    ½⟨ln cτ⟩ − ½ ln 2π − ½⟨cτ⟩(x² − 2x⟨μ⟩ + ⟨μ²⟩); for a Categorical one Σ_v [x_n = v] ⟨ln B_kv⟩."""
    sizes, ref = plan.sizes, plan.ref
    out = s.dims + (f"{s.name}#s",)
    if "probs" in s.params:  # a Categorical law: the observed label's ⟨ln B_k x_n⟩
        onehot = (s.stats[0], s.dims + (f"{s.name}#cat",))
        return ein(out, [onehot, _log_table(plan, q, s)], out + (f"{s.name}#cat",), sizes, ref)
    prec, log_prec = _precision(plan, q, s)
    total = -0.5 * LOG_2PI * torch.ones((), dtype=ref.dtype, device=ref.device)
    for term in log_prec:
        total = total + 0.5 * ein(out, term, out, sizes, ref)
    square = _centred_square(plan, q, s)
    if square is not None:
        return total - 0.5 * ein(out, prec + [square], out, sizes, ref)
    x, x2 = (s.stats[0], s.dims), (s.stats[1], s.dims)
    mu, mu2 = _expected(plan, q, s, "loc", 0), _expected(plan, q, s, "loc", 1)
    quad = (
        ein(out, prec + [x2], out, sizes, ref)
        - 2 * ein(out, prec + [x, mu], out, sizes, ref)
        + ein(out, prec + [mu2], out, sizes, ref)
    )
    return total - 0.5 * quad


def _centred_square(plan: Plan, q: dict, s: Site) -> tuple | None:
    """⟨(x_n − μ_k)²⟩ = (x_n − ⟨μ_k⟩)² + Var μ_k [batch, N, K] of a Normal observation law
    as (operand, axes), the residual formed first and the variance read off the factor; None
    where the mean is not a fixed value or an elementwise Normal site (the expanded form).
    Not x² − 2x⟨μ⟩ + ⟨μ²⟩, whose terms cancel where the data sit far from 0 compared with
    their spread (a float32 chain at a level of 1,000 had a NaN bound; a float64 one a bound
    that fell between sweeps)."""
    from probfsl.inference.vmp.normal import _loc_variance

    loc = s.params["loc"]
    var = _loc_variance(plan, q, loc)
    if var is False:
        return None
    sizes, ref = plan.sizes, plan.ref
    out = s.dims + (f"{s.name}#s",)
    mu = _expected(plan, q, s, "loc", 0)
    x = ein(out, [(s.stats[0], s.dims)], (), sizes, ref, expand=False)
    square = (x - ein(out, [mu], (), sizes, ref, expand=False)).square_()
    if var is not None:
        square = square + ein(out, [var], (), sizes, ref, expand=False)
    return square, out


def _log_table(plan: Plan, q: dict, s: Site) -> tuple:
    """⟨ln B⟩ of a Categorical observation law (its Dirichlet parent's, or the logarithm of
    the fixed table, 0 ln 0 kept finite) as (operand, axes)."""
    p = s.params["probs"]
    ops = parent_ops(plan, q, s, "probs")
    return ops[0] if ops is not None else (derived(p, "log_probs"), p.const_dims)


def forward_backward(
    log_init: torch.Tensor, log_trans: torch.Tensor, log_emit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Posterior marginals γ [B, N, K], summed pairwise marginals Σ_n ξ_n [B, K, K] and the
    log normaliser [B] of a chain with log-potentials, batched over B.

    The scaled recursions of Rabiner (1989, §V.A): each forward message is normalised to
    sum to one, its normaliser c_n kept, so ln Z = Σ_n ln c_n and the backward messages
    reuse the c_n. The potentials are exponentiated once, each shifted by its largest
    value (per step for the emissions, per task for the initial and transition ones) and
    the shifts added back to ln Z; a step is then a small batched product instead of a
    log-sum-exp (three times faster on the CPU, a third of the kernel launches on a GPU).
    Exact unless every state reachable at a step has a relative weight below the dtype's
    smallest normal number (then c_n is held at that number rather than 0). The inputs'
    leading (batch) axes broadcast."""
    n, k = log_emit.shape[-2:]
    batch = torch.broadcast_shapes(log_init.shape[:-1], log_trans.shape[:-2], log_emit.shape[:-2])
    log_init = log_init.expand(batch + (k,)).reshape(-1, k)
    log_trans = log_trans.expand(batch + (k, k)).reshape(-1, k, k)
    log_emit = log_emit.expand(batch + (n, k)).reshape(-1, n, k)
    shift_emit = log_emit.amax(-1, keepdim=True)  # [B, N, 1]
    emit = (log_emit - shift_emit).exp()
    shift_trans = log_trans.amax((-2, -1), keepdim=True)  # [B, 1, 1]
    trans = (log_trans - shift_trans).exp()
    shift_init = log_init.amax(-1, keepdim=True)  # [B, 1]
    tiny = torch.finfo(emit.dtype).tiny
    a = (log_init - shift_init).exp() * emit[..., 0, :]
    alphas, scales = [], []
    for t in range(n):
        if t:
            a = torch.bmm(a.unsqueeze(-2), trans).squeeze(-2) * emit[..., t, :]
        c = a.sum(-1, keepdim=True).clamp_min(tiny)
        a = a / c
        alphas.append(a)
        scales.append(c)
    scale = torch.cat(scales, -1)  # [B, N]
    log_z = scale.log().sum(-1) + shift_emit.sum((-2, -1))
    log_z = log_z + (n - 1) * shift_trans.squeeze((-2, -1)) + shift_init.squeeze(-1)
    weighted = emit / scale.unsqueeze(-1)
    b = torch.ones_like(a)
    betas, ahead = [b], []  # ahead_n = β_n e_n / c_n, the backward message into step n
    for t in range(n - 1, 0, -1):
        ahead.insert(0, b * weighted[..., t, :])
        b = torch.bmm(trans, ahead[0].unsqueeze(-1)).squeeze(-1)
        betas.insert(0, b)
    alpha = torch.stack(alphas, -2)
    if n > 1:  # Σ_n ξ_n[j, k] = Σ_n α_{n-1}[j] A[j, k] ahead_n[k]
        pairs = torch.bmm(alpha[..., :-1, :].transpose(-1, -2), torch.stack(ahead, -2)) * trans
    else:
        pairs = torch.zeros_like(trans)
    gamma = alpha * torch.stack(betas, -2)
    return gamma.reshape(batch + (n, k)), pairs.reshape(batch + (k, k)), log_z.reshape(batch)


def loglik(plan: Plan, q: dict, s: Site, out: tuple) -> torch.Tensor:
    """The chain's part of the bound, ln Z̃, summed into ``out``."""
    log_z = _chain(plan, q, s)[2]
    return ein(out, [(log_z, s.dims[:-1])], s.dims[:-1], plan.sizes, plan.ref)


def message(plan: Plan, q: dict, s: Site, role: str, to: Site) -> list:
    """The expected counts (module docstring) as the natural-parameter message to ``to``."""
    sizes, ref = plan.sizes, plan.ref
    gamma, pairs, _, initial = _chain(plan, q, s)
    state = f"{s.name}#s"
    g = (gamma, s.dims + (state,))
    p = s.params[role]
    out = tuple(p.rename[d] for d in to.dims)
    if role == "initial_logits":
        return [ein(out, [(initial, s.dims[:-1] + (state,))], out, sizes, ref)]
    if role == "transition_logits":
        dims = s.dims[:-1] + (state, f"{s.name}#s2")
        return [ein(out, [(pairs, dims)], out, sizes, ref)]
    over = s.dims + (state,)
    if role == "probs":  # to the Dirichlet rows B_k: Σ_n γ_nk onehot(x_n)
        onehot = (s.stats[0], s.dims + (f"{s.name}#cat",))
        return [ein(out, [g, onehot], over + (f"{s.name}#cat",), sizes, ref)]
    x, x2 = (s.stats[0], s.dims), (s.stats[1], s.dims)
    prec, _ = _precision(plan, q, s)
    if role == "loc":
        return [
            ein(out, [g] + prec + [x], over, sizes, ref),
            -0.5 * ein(out, [g] + prec, over, sizes, ref),
        ]
    coef = [(p.coef, p.coef_dims)]  # role precision, to the Gamma τ of c τ
    square = _centred_square(plan, q, s)
    if square is not None:
        return [
            -0.5 * ein(out, [g] + coef + [square], over, sizes, ref),
            0.5 * ein(out, [g], over, sizes, ref),
        ]
    mu, mu2 = _expected(plan, q, s, "loc", 0), _expected(plan, q, s, "loc", 1)
    quad = (
        ein(out, [g] + coef + [x2], over, sizes, ref)
        - 2 * ein(out, [g] + coef + [x, mu], over, sizes, ref)
        + ein(out, [g] + coef + [mu2], over, sizes, ref)
    )
    return [-0.5 * quad, 0.5 * ein(out, [g], over, sizes, ref)]
