"""Linear-Gaussian state-space models in VMP (docs/design/vmp.md §6.7, §7.5): latent vector
states x_t ~ N(A x_{t-1} + b, diag(λ)⁻¹) with a known transition matrix A (per task) and
observations y_t ~ N(C x_t, diag(ρ)⁻¹) with a known observation matrix C, written as a loop
of ``Normal(...).to_event(1)`` sites. The states form one Gaussian Markov chain factor,
updated by a Kalman filter and RTS smoother (Kalman 1960; Rauch, Tung & Striebel 1965).

With everything else known the factor is the exact posterior: the bound equals the log
evidence ln N(y; H μ, H Σ Hᵀ + R) of the joint Gaussian of (x_1..x_N, y_1..y_N), built
densely here, and the factor's means and covariances equal the dense Gaussian
conditioning. With a latent Gamma noise precision the chain passes the conformance checks
and reaches BayesPy's ``GaussianMarkovChain`` bound."""

from __future__ import annotations

from functools import partial

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.inference import VMP
from probfsl.testing import (
    ConformanceCase,
    assert_batch_invariant,
    assert_dtype_agreement,
    assert_monotone,
)

F64 = torch.float64
D, E, N, TASKS = 3, 2, 7, 4
PRIOR_SD, STEP_SD, NOISE_SD = 1.5, torch.tensor([0.5, 0.3, 0.7]), torch.tensor([0.8, 0.6])
DRIFT = torch.tensor([0.1, -0.2, 0.05])


def _g(seed):
    return torch.Generator().manual_seed(seed)


def transitions(tasks=TASKS, seed=0):
    """A per task: a rotation-like matrix scaled below 1, plus a perturbation."""
    g = _g(seed)
    a = 0.8 * torch.linalg.qr(torch.randn(tasks, D, D, generator=g, dtype=F64))[0]
    return a + 0.1 * torch.randn(tasks, D, D, generator=g, dtype=F64)


def observation_matrix(seed=1):
    return torch.randn(E, D, generator=_g(seed), dtype=F64)


def _observe(c, x):
    """C x_t, with C [E, D] shared or [T, E, D] per task."""
    return torch.einsum("...ij,...j->...i", c, x)


def ssm(y, a, c, tau=None, head="normal"):
    """x_0 ~ N(0, 1.5² I) (or the same as a MultivariateNormal), x_t ~ N(A x_{t-1} + b,
    diag(STEP_SD²)) (the precision times a latent Gamma τ with ``tau``), y_t ~ N(C x_t,
    diag(NOISE_SD²))."""
    step, noise, drift = (v.to(y.dtype) for v in (STEP_SD, NOISE_SD, DRIFT))
    with pyro.plate("tasks", y.shape[0]):
        scale = 1.0
        if tau == "gamma":
            scale = pyro.sample("tau", dist.Gamma(y.new_tensor(3.0), y.new_tensor(2.0))) ** -0.5
            scale = scale.unsqueeze(-1)
        if head == "mvn":
            prec = torch.eye(D, dtype=y.dtype) / PRIOR_SD**2
            x = pyro.sample("x0", dist.MultivariateNormal(y.new_zeros(D), precision_matrix=prec))
        else:
            x = pyro.sample("x0", dist.Normal(y.new_zeros(D), PRIOR_SD).to_event(1))
        pyro.sample("y0", dist.Normal(_observe(c, x), noise).to_event(1), obs=y[:, 0])
        for t in range(1, y.shape[1]):
            mean = torch.einsum("...ij,...j->...i", a, x) + drift  # draws vectorised
            x = pyro.sample(f"x{t}", dist.Normal(mean, step * scale).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(_observe(c, x), noise).to_event(1), obs=y[:, t])


def simulate(a, c, n=N, seed=2):
    g = _g(seed)
    tasks = a.shape[0]
    x = PRIOR_SD * torch.randn(tasks, D, generator=g, dtype=F64)
    ys = []
    for t in range(n):
        if t:
            x = (
                torch.einsum("tij,tj->ti", a, x)
                + DRIFT
                + STEP_SD * torch.randn(tasks, D, generator=g, dtype=F64)
            )
        ys.append(x @ c.T + NOISE_SD * torch.randn(tasks, E, generator=g, dtype=F64))
    return torch.stack(ys, 1)


def dense_joint(a, c, n):
    """Per task, the prior mean [nD] and covariance [nD, nD] of (x_0..x_{n-1}), and the
    observations' mean H μ and covariance H Σ Hᵀ + R, with H = I_n ⊗ C."""
    tasks = a.shape[0]
    step = torch.diag(STEP_SD.double() ** 2)
    means = [torch.zeros(tasks, D, dtype=F64)]
    covs = {(0, 0): torch.eye(D, dtype=F64).expand(tasks, D, D) * PRIOR_SD**2}
    for t in range(1, n):
        means.append(torch.einsum("tij,tj->ti", a, means[-1]) + DRIFT)
        for s in range(t):  # Cov(x_t, x_s) = A Cov(x_{t-1}, x_s)
            covs[t, s] = a @ covs[t - 1, s]
            covs[s, t] = covs[t, s].transpose(-1, -2)
        covs[t, t] = a @ covs[t - 1, t - 1] @ a.transpose(-1, -2) + step
    mu = torch.cat(means, -1)
    sigma = torch.cat([torch.cat([covs[t, s] for s in range(n)], -1) for t in range(n)], -2)
    h = torch.block_diag(*[c] * n)
    noise = torch.diag(NOISE_SD.double().repeat(n) ** 2)
    return mu, sigma, h, mu @ h.T, h @ sigma @ h.T + noise


def exact(y, a, c):
    """The log evidence [T] and the posterior mean [T, nD] and covariance [T, nD, nD]."""
    n = y.shape[1]
    mu, sigma, h, y_mean, y_cov = dense_joint(a, c, n)
    flat = y.reshape(y.shape[0], -1)
    evidence = dist.MultivariateNormal(y_mean, y_cov).log_prob(flat)
    gain = sigma @ h.T @ torch.linalg.inv(y_cov)  # Σ Hᵀ S⁻¹
    post_mean = mu + (gain @ (flat - y_mean).unsqueeze(-1)).squeeze(-1)
    post_cov = sigma - gain @ h @ sigma
    return evidence, post_mean, post_cov


def _chain_covariances(state, n):
    """The factor's marginal covariances [T, n, D, D] and lag-one covariances."""
    cov = torch.stack([torch.linalg.inv(state.q[f"x{t}"][1]) for t in range(n)], 1)
    return cov, state.q["chain:x0"][0]


@pytest.mark.parametrize("head", ["normal", "mvn"])
def test_state_space_model_is_one_exact_factor(head):
    """One chain of every state; after one sweep the bound is the exact log evidence and
    the means, marginal and lag-one covariances are the dense conditioning's."""
    a, c = transitions(), observation_matrix()
    y = simulate(a, c)
    model = partial(ssm, head=head)
    vmp = VMP(model, tol=1e-13)
    plan = vmp.compile(y, a, c)
    assert list(plan.chains.values()) == [[f"x{t}" for t in range(N)]]
    state, info = vmp.fit(y, a, c)
    evidence, post_mean, post_cov = exact(y, a, c)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-10)
    assert int(info.n_steps.max()) <= 2
    mean = torch.cat([state.q[f"x{t}"][0] for t in range(N)], -1)
    torch.testing.assert_close(mean, post_mean, rtol=1e-10, atol=1e-10)
    cov, lag = _chain_covariances(state, N)
    blocks = post_cov.reshape(TASKS, N, D, N, D)
    for t in range(N):
        torch.testing.assert_close(cov[:, t], blocks[:, t, :, t], rtol=1e-10, atol=1e-10)
        if t:
            torch.testing.assert_close(lag[:, t - 1], blocks[:, t, :, t - 1], rtol=1e-9, atol=1e-10)


def test_state_space_model_float32():
    """float32 data: the same bound to float32's precision, in float32."""
    a, c = transitions(), observation_matrix()
    y = simulate(a, c)
    state, _ = VMP(ssm, tol=1e-6).fit(y.float(), a.float(), c.float())
    evidence, _, _ = exact(y, a, c)
    assert state.objective.dtype == torch.float32
    torch.testing.assert_close(state.objective.double(), evidence, rtol=2e-5, atol=2e-4)


def test_a_batch_of_tasks_equals_each_task_alone():
    a, c = transitions(), observation_matrix()
    y = simulate(a, c)
    batch, _ = VMP(ssm, tol=1e-13).fit(y, a, c)
    for t in range(TASKS):
        alone, _ = VMP(ssm, tol=1e-13).fit(y[t : t + 1], a[t : t + 1], c)
        torch.testing.assert_close(alone.objective, batch.objective[t : t + 1], rtol=1e-12, atol=0)


def _gamma_case():
    a, c = transitions(tasks=3), observation_matrix()
    y = simulate(a, c)
    c = c.expand(3, E, D).contiguous()  # every argument per task (the batch checks slice them)
    model = partial(ssm, tau="gamma")
    return ConformanceCase(
        make_engine=lambda: VMP(model, tol=0), model=model, data=(y, a, c), n_steps=8
    )


def test_a_latent_noise_precision_keeps_the_chain_and_the_bound_monotone():
    """τ ~ Gamma scales every step's precision: the states stay one chain (mean field with
    q(τ) only), and the bound is monotone, batch-invariant and float32 agrees."""
    case = _gamma_case()
    plan = case.make_engine().compile(*case.data)
    assert list(plan.chains.values()) == [[f"x{t}" for t in range(N)]]
    for check in (assert_monotone, assert_batch_invariant, assert_dtype_agreement):
        check(case)


@pytest.mark.slow
def test_a_state_space_model_on_the_data_device_without_host_syncs():
    from probfsl.testing import assert_device_follows, assert_no_host_syncs

    case = _gamma_case()
    assert_device_follows(case)
    assert_no_host_syncs(case)


def test_a_fit_continues_from_its_state():
    """``fit(state=previous)`` continues from the chain's factor, and ``init=previous``
    starts the same data from it: converged, it stays."""
    a, c = transitions(tasks=2), observation_matrix()
    y = simulate(a, c)
    vmp = VMP(partial(ssm, tau="gamma"), tol=1e-12, max_iter=500)
    state, _ = vmp.fit(y, a, c)
    for again, info in (vmp.fit(state=state), vmp.fit(y, a, c, init=state)):
        torch.testing.assert_close(again.objective, state.objective, rtol=1e-10, atol=0)
        assert int(info.n_steps.max()) <= 2


def ard_ssm(y, a, c):
    """:func:`ssm` with a latent Gamma innovation precision per state dimension,
    x_t ~ N(A x_{t-1}, diag(τ)⁻¹), τ_d ~ Gamma(3, 2) (BayesPy's GaussianMarkovChain's)."""
    noise = NOISE_SD.to(y.dtype)
    with pyro.plate("tasks", y.shape[0]):
        gamma = dist.Gamma(y.new_tensor(3.0), y.new_tensor(2.0)).expand([D]).to_event(1)
        tau = pyro.sample("tau", gamma)
        x = pyro.sample("x0", dist.Normal(y.new_zeros(D), PRIOR_SD).to_event(1))
        pyro.sample("y0", dist.Normal(_observe(c, x), noise).to_event(1), obs=y[:, 0])
        for t in range(1, y.shape[1]):
            mean = torch.einsum("tij,tj->ti", a, x)
            x = pyro.sample(f"x{t}", dist.Normal(mean, tau**-0.5).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(_observe(c, x), noise).to_event(1), obs=y[:, t])


def test_a_latent_noise_precision_matches_bayespy():
    """BayesPy's GaussianMarkovChain with A per task and a Gamma innovation precision per
    state dimension, observed through C (its LSSM form, SumMultiply('i,i', C, X)): the
    same converged bound on every task."""
    bn = pytest.importorskip("bayespy.nodes")
    from bayespy.inference import VB

    a, c = transitions(tasks=2), observation_matrix()
    y = simulate(a, c)
    vmp = VMP(ard_ssm, tol=1e-14, max_iter=3000)
    assert list(vmp.compile(y, a, c).chains.values()) == [[f"x{t}" for t in range(N)]]
    state, _ = vmp.fit(y, a, c)
    for t in range(2):
        tau = bn.Gamma(3.0, 2.0, plates=(D,))
        chain = bn.GaussianMarkovChain(np.zeros(D), np.eye(D) / PRIOR_SD**2, a[t].numpy(), tau, n=N)
        mapped = bn.SumMultiply("i,i", c.numpy()[:, None, :], chain)  # plates (E, N)
        obs = bn.GaussianARD(mapped, (NOISE_SD.double() ** -2).numpy()[:, None])
        obs.observe(y[t].numpy().T)
        q = VB(obs, chain, tau)
        q.update(chain, tau, repeat=3000, tol=1e-14, verbose=False)
        np.testing.assert_allclose(
            state.objective[t].item(), q.compute_lowerbound(), rtol=1e-9, atol=1e-9
        )


def test_a_scalar_chain_is_still_elementwise():
    """The scalar chains of the existing models keep their elementwise factor."""
    from tests.test_vmp_families import random_walk, walk_data

    x = walk_data(t=2)
    plan = VMP(random_walk).compile(x)
    assert not plan.sites["s1"].joint
    assert list(plan.chains.values())[0][:2] == ["s0", "s1"]


def test_the_guide_draws_a_vector_chain_from_its_joint_factor():
    """The guide draws x_t | x_{t-1} ~ MVN(a + B x_{t-1}, V) from the joint factor: the
    draws' means, marginal and lag-one covariances are the factor's within Monte Carlo
    error, and every site is drawn once."""
    a, c = transitions(tasks=2), observation_matrix()
    y = simulate(a, c)
    vmp = VMP(ssm, tol=1e-13)
    state, _ = vmp.fit(y, a, c)
    draws = 4000
    pyro.set_rng_seed(0)
    guide = pyro.plate("draws", draws, dim=-2)(vmp.guide(state))
    trace = pyro.poutine.trace(guide).get_trace(y, a, c)
    names = [f"x{t}" for t in range(N)]
    assert [n for n in trace.nodes if n in names] == names
    x = torch.stack([trace.nodes[n]["value"] for n in names], -2)  # [draws, tasks, N, D]
    assert x.shape == (draws, 2, N, D)
    cov, lag = _chain_covariances(state, N)
    mean = torch.stack([state.q[n][0] for n in names], -2)
    centred = x - mean
    sample_cov = torch.einsum("stni,stnj->tnij", centred, centred) / draws
    sample_lag = torch.einsum("stni,stnj->tnij", centred[:, :, 1:], centred[:, :, :-1]) / draws
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()  # [tasks, N, D]
    se = 5 / draws**0.5  # five standard errors of a mean / a correlation
    assert ((x.mean(0) - mean).abs() <= se * sd).all()
    # se of a covariance with the mean known: √((Σ_ii Σ_jj + Σ_ij²) / n) <= √2 sd_i sd_j / √n
    scale = sd.unsqueeze(-1) * sd.unsqueeze(-2)
    assert ((sample_cov - cov).abs() <= 2**0.5 * se * scale).all()
    lag_scale = sd[:, 1:].unsqueeze(-1) * sd[:, :-1].unsqueeze(-2)
    assert ((sample_lag - lag).abs() <= 2**0.5 * se * lag_scale).all()
    post = vmp.posterior(state)
    torch.testing.assert_close(post["x3"].mean, state.q["x3"][0])


@pytest.mark.parametrize("tau", [None, "gamma"])
def test_pyro_elbo_of_the_vector_chain_guide_is_the_analytic_bound(tau):
    """Pyro's ``Trace_ELBO`` with the guide estimates the state's analytic bound: exactly
    (no spread) when the factor is the exact posterior, within Monte Carlo error with a
    latent noise precision."""
    from probfsl.testing import pyro_elbo_estimate

    a, c = transitions(tasks=2), observation_matrix()
    y = simulate(a, c)
    model = partial(ssm, tau=tau)
    vmp = VMP(model, tol=1e-13, max_iter=500)
    state, _ = vmp.fit(y, a, c)
    pyro.set_rng_seed(0)
    mean, se = pyro_elbo_estimate(model, vmp.guide(state), (y, a, c), 500, 5, 1)
    analytic = state.objective.sum().item()
    if tau is None:
        assert abs(mean - analytic) <= 1e-6 * abs(analytic) and se <= 1e-6 * abs(analytic)
    else:
        assert abs(mean - analytic) <= 5 * se + 1e-6 * abs(analytic)


def direct_ssm(y, a):
    """States observed elementwise, y_t ~ N(x_t, 0.7²): the last state's factor keeps its
    marginal variances only (no map contracts its axis)."""
    with pyro.plate("tasks", y.shape[0]):
        x = pyro.sample("x0", dist.Normal(y.new_zeros(D), PRIOR_SD).to_event(1))
        pyro.sample("y0", dist.Normal(x, 0.7).to_event(1), obs=y[:, 0])
        for t in range(1, y.shape[1]):
            mean = torch.einsum("...ij,...j->...i", a, x)
            x = pyro.sample(f"x{t}", dist.Normal(mean, STEP_SD.to(y.dtype)).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(x, 0.7).to_event(1), obs=y[:, t])


def test_the_guide_draws_an_elementwise_last_state_from_the_joint_factor():
    """The last state's conditional covariance is diagonal (its precision block is): the
    guide's draws still give Pyro's ``Trace_ELBO`` the exact bound, without spread."""
    from probfsl.testing import pyro_elbo_estimate

    a = transitions(tasks=2)
    y = torch.randn(2, N, D, generator=_g(3), dtype=F64)
    vmp = VMP(direct_ssm, tol=1e-13)
    state, _ = vmp.fit(y, a)
    assert not state.plan.sites[f"x{N - 1}"].joint and state.plan.sites["x1"].joint
    pyro.set_rng_seed(0)
    mean, se = pyro_elbo_estimate(direct_ssm, vmp.guide(state), (y, a), 200, 3, 1)
    analytic = state.objective.sum().item()
    assert abs(mean - analytic) <= 1e-6 * abs(analytic) and se <= 1e-6 * abs(analytic)


def vector_walk(y, c, every=1):
    """x_0 ~ N(0, 1.5² I), x_t ~ N(x_{t−1}, diag(STEP_SD²)) (the state before as the mean,
    no matrix written), y_t ~ N(C x_t, diag(NOISE_SD²)) at every ``every``-th step."""
    step, noise = STEP_SD.to(y.dtype), NOISE_SD.to(y.dtype)
    with pyro.plate("tasks", y.shape[0]):
        x = pyro.sample("x0", dist.Normal(y.new_zeros(D), PRIOR_SD).to_event(1))
        pyro.sample("y0", dist.Normal(_observe(c, x), noise).to_event(1), obs=y[:, 0])
        for t in range(1, y.shape[1]):
            x = pyro.sample(f"x{t}", dist.Normal(x, step).to_event(1))
            if t % every == 0:
                obs = dist.Normal(_observe(c, x), noise).to_event(1)
                pyro.sample(f"y{t}", obs, obs=y[:, t])


def test_a_vector_random_walk_is_one_exact_chain():
    """States whose mean is the state before (A = I, b = 0), observed through C that mixes
    their entries: one vector chain factor, the bound the exact evidence. (Fitted one
    factor per state, mean-field across time, the bound was about a nat below it.)"""
    a = torch.eye(D, dtype=F64).expand(TASKS, D, D)
    c = observation_matrix()
    y = simulate(a, c)
    _, _, _, _, y_cov = dense_joint(a, c, N)  # (its means hold a drift; the walk's are 0)
    evidence = dist.MultivariateNormal(torch.zeros(N * E, dtype=F64), y_cov).log_prob(
        y.reshape(TASKS, -1)
    )
    vmp = VMP(vector_walk, tol=1e-13)
    plan = vmp.compile(y, c)
    assert list(plan.chains.values()) == [[f"x{t}" for t in range(N)]]
    state, _ = vmp.fit(y, c)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-10, atol=1e-10)


def test_a_vector_random_walk_with_gaps_is_one_exact_chain():
    """Observed at every third step only: the states no observation reaches (not joint
    factors themselves) still join the chain, and the bound is the evidence of the
    observed steps."""
    a = torch.eye(D, dtype=F64).expand(TASKS, D, D)
    c = observation_matrix()
    y = simulate(a, c)
    seen = [t for t in range(N) if t % 3 == 0]
    _, sigma, _, _, _ = dense_joint(a, c, N)
    h = torch.zeros(len(seen) * E, N * D, dtype=F64)
    for i, t in enumerate(seen):
        h[i * E : (i + 1) * E, t * D : (t + 1) * D] = c
    cov = h @ sigma @ h.T + torch.diag(NOISE_SD.double().repeat(len(seen)) ** 2)
    evidence = dist.MultivariateNormal(torch.zeros(len(seen) * E, dtype=F64), cov).log_prob(
        y[:, seen].reshape(TASKS, -1)
    )
    vmp = VMP(partial(vector_walk, every=3), tol=1e-13)
    assert list(vmp.compile(y, c).chains.values()) == [[f"x{t}" for t in range(N)]]
    state, _ = vmp.fit(y, c)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-10, atol=1e-10)


def test_a_vector_random_walk_on_the_data_device_without_host_syncs():
    from probfsl.testing import assert_device_follows, assert_no_host_syncs

    a = torch.eye(D, dtype=F64).expand(2, D, D)
    c = observation_matrix()
    y = simulate(a, c)
    model = partial(vector_walk, every=3)
    case = ConformanceCase(
        make_engine=lambda: VMP(model, tol=0), model=model, data=(y, c), n_steps=3
    )
    assert_device_follows(case)
    assert_no_host_syncs(case)


def _direct_walk(y, first="none"):
    """A vector random walk observed directly (nothing mixes a state's entries), its first
    state at a fixed prior or with a latent mean m (a Normal or MultivariateNormal)."""
    t, n, d = y.shape
    with pyro.plate("tasks", t):
        if first == "none":
            x = pyro.sample("x0", dist.Normal(y.new_zeros(d), 5**0.5).to_event(1))
        else:
            if first == "normal":
                m = pyro.sample("m", dist.Normal(y.new_zeros(d), 2.0).to_event(1))
            else:
                m = pyro.sample(
                    "m", dist.MultivariateNormal(y.new_zeros(d), 4 * torch.eye(d, dtype=y.dtype))
                )
            x = pyro.sample("x0", dist.Normal(m, 1.0).to_event(1))
        pyro.sample("y0", dist.Normal(x, 0.5).to_event(1), obs=y[:, 0])
        for s in range(1, n):
            x = pyro.sample(f"x{s}", dist.Normal(x, 0.3).to_event(1))
            pyro.sample(f"y{s}", dist.Normal(x, 0.5).to_event(1), obs=y[:, s])


@pytest.mark.parametrize("first", ["none", "normal", "mvn"])
def test_a_vector_random_walk_observed_directly_is_one_exact_chain(first):
    """Without an observation matrix (and with a latent mean of the first state) the
    states were one factor each, mean-field across time and silently a nat and a half
    below the evidence; each entry's walk has x0 ~ N(0, 5) either way."""
    n, d = 5, 2
    y = torch.randn(2, n, d, generator=torch.Generator().manual_seed(17), dtype=F64)
    f = torch.zeros(n, n + 1, dtype=F64)
    f[:, 0] = 2.0
    for s in range(n):
        f[s, 1] = 1.0
        f[s, 2 : s + 2] = 0.3
    cov = f @ f.T + 0.25 * torch.eye(n, dtype=F64)
    evidence = (
        dist.MultivariateNormal(torch.zeros(n, dtype=F64), cov).log_prob(y.transpose(1, 2)).sum(-1)
    )
    vmp = VMP(partial(_direct_walk, first=first), tol=1e-13)
    plan = vmp.compile(y)
    assert len(plan.chains) == 1 and plan.mean_field_pairs() == []
    state, _ = vmp.fit(y)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-10, atol=1e-10)


def test_a_latent_mean_of_the_first_state_observed_through_a_matrix_is_exact():
    """m ~ N(0, 4 I), x0 ~ N(m, I), then a walk observed through C: one chain m -> x0 ->
    ..., the exact evidence (was a bare ValueError from the bound's contraction)."""
    n, d, e = 5, 2, 3
    g = torch.Generator().manual_seed(17)
    c = torch.randn(e, d, generator=g, dtype=F64)
    y = torch.randn(2, n, e, generator=g, dtype=F64)

    def model(y):
        with pyro.plate("tasks", y.shape[0]):
            m = pyro.sample("m", dist.Normal(y.new_zeros(d), 2.0).to_event(1))
            x = pyro.sample("x0", dist.Normal(m, 1.0).to_event(1))
            pyro.sample("y0", dist.Normal(x @ c.T, 0.5).to_event(1), obs=y[:, 0])
            for s in range(1, n):
                x = pyro.sample(f"x{s}", dist.Normal(x, 0.3).to_event(1))
                pyro.sample(f"y{s}", dist.Normal(x @ c.T, 0.5).to_event(1), obs=y[:, s])

    f = torch.zeros(n * d, (n + 1) * d, dtype=F64)
    f[:, :d] = torch.eye(d, dtype=F64).repeat(n, 1) * 2.0
    for s in range(n):
        for u in range(s + 1):
            f[s * d : (s + 1) * d, (u + 1) * d : (u + 2) * d] = torch.eye(d, dtype=F64) * (
                1.0 if u == 0 else 0.3
            )
    h = torch.kron(torch.eye(n, dtype=F64), c)
    cov = h @ f @ f.T @ h.T + 0.25 * torch.eye(n * e, dtype=F64)
    evidence = dist.MultivariateNormal(torch.zeros(n * e, dtype=F64), cov).log_prob(
        y.reshape(2, -1)
    )
    vmp = VMP(model, tol=1e-13)
    assert list(vmp.compile(y).chains.values()) == [["m"] + [f"x{s}" for s in range(n)]]
    state, _ = vmp.fit(y)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-10, atol=1e-10)
