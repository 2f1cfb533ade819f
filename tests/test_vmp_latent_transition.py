"""A latent Gaussian transition matrix (and observation matrix) in a linear-Gaussian
state-space model (docs/design/vmp.md §6.6, §7.5; Beal 2003, ch. 5):
x_t ~ N(A x_{t-1} + b, diag(λ)⁻¹), y_t ~ N(C x_t, diag(ρ)⁻¹) with A (or C) a Normal site of
two event axes. The states stay one Gaussian Markov chain factor, filtered and smoothed
with ⟨A⟩ and ⟨Aᵀ diag(λ) A⟩; q(A) is Gaussian per row, updated from the chain's
Σ_t E[x_t x_{t-1}ᵀ] and Σ_t E[x_{t-1} x_{t-1}ᵀ]; q(A) q(x) is mean-field between A and
the chain.

BayesPy's ``GaussianMarkovChain`` with a ``GaussianARD`` A node (and ``SumMultiply`` with a
``GaussianARD`` C node) is the reference: the same bound after every update from the same
start, and the same converged bound and posterior means. A prior on A so tight that A is
known gives back the exact Kalman evidence of the known-A model (the dense Gaussian of
tests/test_vmp_state_space.py)."""

from __future__ import annotations

import warnings
from functools import partial

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.inference import VMP
from probfsl.inference.vmp import MeanFieldWarning
from probfsl.testing import (
    ConformanceCase,
    assert_batch_invariant,
    assert_dtype_agreement,
    assert_monotone,
    pyro_elbo_estimate,
)
from tests.test_vmp_state_space import (
    DRIFT,
    NOISE_SD,
    PRIOR_SD,
    STEP_SD,
    D,
    E,
    N,
    exact,
    observation_matrix,
    simulate,
    transitions,
)

MEAN0 = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)  # x_0's prior mean (BayesPy's mu)


def _mv(m, x):
    """M x with M [..., I, J] (per task or shared) and x [..., J]."""
    return torch.einsum("...ij,...j->...i", m, x)


def latent_ssm(y, a, c, prior="plain", latent="A", drift=False, head_mean=True):
    """x_0 ~ N(MEAN0, 1.5² I); x_t ~ N(A x_{t-1} (+ DRIFT), diag(STEP_SD²)); y_t ~ N(C x_t,
    diag(NOISE_SD²)). ``latent`` names the latent matrices ("A", "C" or "AC"), each
    ~ N(0, 1) per entry; with ``prior`` "ard" A's columns have Gamma(2, 1) precisions α_j
    (BayesPy's ARD: GaussianARD(0, α, shape=(D,), plates=(D,))), with "gamma" the innovation
    precisions are latent, τ_d ~ Gamma(3, 2) (BayesPy's ``nu`` node)."""
    step, noise = STEP_SD.to(y.dtype), NOISE_SD.to(y.dtype)
    with pyro.plate("tasks", y.shape[0]):
        if "A" in latent:
            scale = 1.0
            if prior == "ard":
                gamma = dist.Gamma(y.new_tensor(2.0), y.new_tensor(1.0)).expand([D]).to_event(1)
                scale = pyro.sample("alpha", gamma).rsqrt().unsqueeze(-2)
            a = pyro.sample("A", dist.Normal(y.new_zeros(D, D), scale).to_event(2))
        if prior == "gamma":
            gamma = dist.Gamma(y.new_tensor(3.0), y.new_tensor(2.0)).expand([D]).to_event(1)
            step = pyro.sample("tau", gamma).rsqrt()
        if "C" in latent:
            c = pyro.sample("C", dist.Normal(y.new_zeros(E, D), 1.0).to_event(2))
        mean0 = MEAN0.to(y.dtype) if head_mean else y.new_zeros(D)
        x = pyro.sample("x0", dist.Normal(mean0, PRIOR_SD).to_event(1))
        pyro.sample("y0", dist.Normal(_mv(c, x), noise).to_event(1), obs=y[:, 0])
        for t in range(1, y.shape[1]):
            mean = _mv(a, x) + (DRIFT.to(y.dtype) if drift else 0)
            x = pyro.sample(f"x{t}", dist.Normal(mean, step).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(_mv(c, x), noise).to_event(1), obs=y[:, t])


def _data(tasks=2, seed=0):
    a, c = transitions(tasks=tasks, seed=seed), observation_matrix()
    return simulate(a, c), a, c


def _bayespy_twin(y, a, c, prior="plain", latent="A"):
    """The BayesPy model of :func:`latent_ssm` for one task, its nodes in the model's
    declaration order (the order VMP updates them), and the chain and matrix nodes."""
    bn = pytest.importorskip("bayespy.nodes")
    from bayespy.inference import VB

    nodes, matrix, obs_map = {}, a.numpy(), c.numpy()[:, None, :]
    nu = (STEP_SD.double() ** -2).numpy()
    if "A" in latent:
        alpha = 1.0
        if prior == "ard":
            alpha = nodes["alpha"] = bn.Gamma(2.0, 1.0, plates=(D,))
        matrix = nodes["A"] = bn.GaussianARD(0, alpha, shape=(D,), plates=(D,))
    if prior == "gamma":
        nu = nodes["tau"] = bn.Gamma(3.0, 2.0, plates=(D,))
    if "C" in latent:
        obs_map = nodes["C"] = bn.GaussianARD(0, 1.0, shape=(D,), plates=(E, 1))
    chain = nodes["x"] = bn.GaussianMarkovChain(
        MEAN0.numpy(), np.eye(D) / PRIOR_SD**2, matrix, nu, n=y.shape[0]
    )
    obs = bn.GaussianARD(
        bn.SumMultiply("i,i", obs_map, chain), (NOISE_SD.double() ** -2).numpy()[:, None]
    )
    obs.observe(y.numpy().T)
    return VB(obs, *nodes.values()), list(nodes.values()), nodes


CASES = [("plain", "A"), ("gamma", "A"), ("ard", "A"), ("plain", "C"), ("plain", "AC")]


@pytest.mark.parametrize(("prior", "latent"), CASES)
def test_latent_matrix_matches_bayespy(prior, latent):
    """The same start and schedule as BayesPy's GaussianMarkovChain with a Gaussian A node
    (or C node): the bound after each of the first sweeps agrees to 1e-10 relative, and the
    converged bound (1e-8 relative) and posterior means of the matrix and the states agree.
    With a Gamma ``nu`` node BayesPy starts its chain elsewhere (its initial second moments
    of x_1 are (⟨ν⟩ + ⟨ν⟩)⁻¹ I, not the (⟨ν⟩ + Σ_i ⟨ν_i⟩⟨A_i A_iᵀ⟩)⁻¹ of the prior chain under
    q(A) q(ν), which it uses for a fixed ν): there the converged fits are compared."""
    y, a, c = _data()
    model = partial(latent_ssm, prior=prior, latent=latent)
    sweeps = 4
    _, early = VMP(model, tol=0, max_iter=sweeps, warn_mean_field=False).fit(y, a, c)
    vmp = VMP(model, tol=1e-14, max_iter=5000, warn_mean_field=False)
    state, _ = vmp.fit(y, a, c)
    for t in range(y.shape[0]):
        q, order, nodes = _bayespy_twin(y[t], a[t], c, prior, latent)
        bounds = []  # VMP's start updates every factor once after its prior: one BayesPy sweep
        for _ in range(sweeps + 1):
            q.update(*order, verbose=False)
            bounds.append(q.compute_lowerbound())
        if prior != "gamma":
            np.testing.assert_allclose(early.trace[:, t].numpy(), bounds, rtol=1e-10, atol=0)
        q.update(*order, repeat=5000, tol=1e-14, verbose=False)
        bound = q.compute_lowerbound()
        np.testing.assert_allclose(state.objective[t].item(), bound, rtol=1e-8, atol=0)
        for matrix in latent:
            ours = state.q[matrix][0][t].numpy()
            theirs = nodes[matrix].get_moments()[0].reshape(ours.shape)
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
        states = torch.stack([state.q[f"x{i}"][0][t] for i in range(y.shape[1])]).numpy()
        np.testing.assert_allclose(states, nodes["x"].get_moments()[0], rtol=0, atol=1e-5)


def test_the_plan_names_the_chain_and_its_mean_field_with_the_matrix():
    """One chain of every state and a joint-per-row factor of A; describe() and the
    MeanFieldWarning name the mean field between A and the chain."""
    y, a, c = _data()
    vmp = VMP(latent_ssm)
    with pytest.warns(MeanFieldWarning, match=r"A and the chain x0\.\.x6 \(through site x1\)"):
        plan = vmp.compile(y, a, c)
    assert list(plan.chains.values()) == [[f"x{t}" for t in range(N)]]
    lines = vmp.describe(y, a, c).splitlines()
    assert any(
        ln.split()[:2] == ["A", "Normal"] and ln.endswith("joint over axis A#e1") for ln in lines
    )
    assert any(
        ln.startswith("  chain:x0") and "Gaussian Markov chain over x0 ->" in ln for ln in lines
    )
    assert "mean-field between A and the chain x0..x6 (coupled through site x1)" in lines
    assert plan.mean_field_pairs() == [("A", "the chain x0..x6", "x1")]


def tight_ssm(y, a, c, sd):
    """The model of tests/test_vmp_state_space.py (drift, known C) with A ~ N(a, sd²) per
    entry around the known per-task matrix a."""
    step, noise = STEP_SD.to(y.dtype), NOISE_SD.to(y.dtype)
    with pyro.plate("tasks", y.shape[0]):
        matrix = pyro.sample("A", dist.Normal(a, sd).to_event(2))
        x = pyro.sample("x0", dist.Normal(y.new_zeros(D), PRIOR_SD).to_event(1))
        pyro.sample("y0", dist.Normal(_mv(c, x), noise).to_event(1), obs=y[:, 0])
        for t in range(1, y.shape[1]):
            x = pyro.sample(f"x{t}", dist.Normal(_mv(matrix, x) + DRIFT, step).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(_mv(c, x), noise).to_event(1), obs=y[:, t])


def test_a_tight_prior_gives_back_the_known_matrix_evidence():
    """As A's prior sd s shrinks, q(A) stays at the prior and the bound approaches the exact
    log evidence of the known-A model (the dense Gaussian), its gap shrinking with s²."""
    a, c = transitions(tasks=3), observation_matrix()
    y = simulate(a, c)
    evidence, post_mean, _ = exact(y, a, c)
    gaps = []
    for sd in (1e-2, 1e-3, 1e-4):
        model = partial(tight_ssm, sd=sd)
        state, _ = VMP(model, tol=1e-14, max_iter=500, warn_mean_field=False).fit(y, a, c)
        gaps.append((evidence - state.objective).abs().max().item())
        torch.testing.assert_close(state.q["A"][0], a, rtol=0, atol=10 * sd)
    assert gaps[1] < gaps[0] / 30 and gaps[2] < gaps[1] / 30  # O(s²)
    assert gaps[2] <= 1e-6 * evidence.abs().max().item()
    mean = torch.cat([state.q[f"x{t}"][0] for t in range(N)], -1)
    torch.testing.assert_close(mean, post_mean, rtol=0, atol=1e-5)


def test_the_known_matrix_model_is_unchanged():
    """With A known the plan has no matrix factor and no mean field; the bound is the
    exact evidence (tests/test_vmp_state_space.py checks the rest)."""
    from tests.test_vmp_state_space import ssm

    a, c = transitions(tasks=2), observation_matrix()
    y = simulate(a, c)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        vmp = VMP(ssm, tol=1e-13)
        assert vmp.compile(y, a, c).mean_field_pairs() == []
        state, _ = vmp.fit(y, a, c)
    torch.testing.assert_close(state.objective, exact(y, a, c)[0], rtol=1e-12, atol=1e-10)


def _case():
    y, a, c = _data(tasks=3)
    c = c.expand(3, E, D).contiguous()  # every argument per task (the batch checks slice them)
    model = partial(latent_ssm, prior="gamma", drift=True)
    return ConformanceCase(
        make_engine=lambda: VMP(model, tol=0, warn_mean_field=False),
        model=model,
        data=(y, a, c),
        n_steps=10,
    )


def test_the_bound_is_monotone_batch_invariant_and_float32_agrees():
    """A latent A, Gamma innovation precisions and a drift: the bound never decreases over
    sweeps, a batch equals its tasks one at a time, and float32 agrees with float64."""
    case = _case()
    for check in (assert_monotone, assert_batch_invariant, assert_dtype_agreement):
        check(case)


@pytest.mark.slow
def test_a_latent_transition_on_the_data_device_without_host_syncs():
    from probfsl.testing import assert_device_follows, assert_no_host_syncs

    case = _case()
    assert_device_follows(case)
    assert_no_host_syncs(case)


@pytest.mark.parametrize("latent", ["A", "C", "AC"])
def test_pyro_elbo_of_the_guide_is_the_bound(latent):
    """Pyro's ``Trace_ELBO`` of (model, ``VMP.guide``): the guide draws A from q(A) and the
    states jointly from the chain's factor, and its Monte Carlo ELBO estimates the
    analytic bound."""
    y, a, c = _data()
    model = partial(latent_ssm, latent=latent, drift=True)
    vmp = VMP(model, tol=0, max_iter=60, warn_mean_field=False)  # any state: its own bound
    state, _ = vmp.fit(y, a, c)
    pyro.set_rng_seed(0)
    mean, se = pyro_elbo_estimate(model, vmp.guide(state), (y, a, c), 500, 5, 1)
    analytic = state.objective.sum().item()
    assert abs(mean - analytic) <= 5 * se + 1e-6 * abs(analytic)
    post = vmp.posterior(state)
    for name in {"A": ["A"], "C": ["C"], "AC": ["A", "C"]}[latent]:
        assert post[name].event_shape == ((D, D) if name == "A" else (E, D))


def transposed_ssm(y, c):
    """x_t ~ N(Aᵀ x_{t-1}, ...): each entry reads a column of A, not a row."""
    with pyro.plate("tasks", y.shape[0]):
        a = pyro.sample("A", dist.Normal(y.new_zeros(D, D), 1.0).to_event(2))
        x = pyro.sample("x0", dist.Normal(y.new_zeros(D), 1.0).to_event(1))
        for t in range(1, y.shape[1]):
            x = pyro.sample(f"x{t}", dist.Normal((x.unsqueeze(-1) * a).sum(-2), 1.0).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(_mv(c, x), 1.0).to_event(1), obs=y[:, t])


def late_ssm(y, c):
    """A declared after the chain's first state."""
    with pyro.plate("tasks", y.shape[0]):
        x = pyro.sample("x0", dist.Normal(y.new_zeros(D), 1.0).to_event(1))
        a = pyro.sample("A", dist.Normal(y.new_zeros(D, D), 1.0).to_event(2))
        for t in range(1, y.shape[1]):
            x = pyro.sample(f"x{t}", dist.Normal(_mv(a, x), 1.0).to_event(1))
            pyro.sample(f"y{t}", dist.Normal(_mv(c, x), 1.0).to_event(1), obs=y[:, t])


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (transposed_ssm, r"site 'x1' \(Normal\) with parent 'A' \(Normal\).*one row of 'A'"),
        (late_ssm, r"site 'x1' \(Normal\) with parent 'A' \(Normal\).*declared before"),
    ],
)
def test_unsupported_matrix_forms_are_refused_naming_the_site(model, match):
    y, _, c = _data()
    with pytest.raises(ValueError, match=match):
        VMP(model).compile(y, c)
