"""A hidden Markov chain with Categorical emissions (docs/design/vmp.md §7.5): Pyro's
``DiscreteHMM`` observed, with Dirichlet initial and transition probabilities and one
Dirichlet row B_k of emission probabilities per state, declared in plain Pyro.

The chain's factor q(z) is exact given ⟨ln π⟩, ⟨ln A⟩ and the emission terms
E ln p(x_n | z_n = k) = ⟨ln B_{k x_n}⟩; its message to B_k is Σ_n γ_nk onehot(x_n). Checked
against BayesPy (``CategoricalMarkovChain`` with ``Mixture(z, Categorical, B)``) on the
bound and on ⟨ln B⟩, against a sum over all K^N paths on a tiny case (the bound of the
converged factors, the factors' fixed point, and the exact log evidence above the bound),
and, with a single state, against the closed-form Dirichlet-Categorical evidence."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.special import digamma, gammaln

from probfsl.inference import VMP
from probfsl.inference.vmp import ConvergenceWarning

F64 = torch.float64
STATES, SYMBOLS = 2, 3
#: the emission rows' prior: state 0 leans to symbol 0, state 1 to symbol 2 (a symmetric
#: prior would leave the states exchangeable, and the bound at its symmetric fixed point)
EMISSION_PRIOR = ((3.0, 1.0, 0.5), (0.5, 1.0, 3.0))


def categorical_hmm(x):
    """Labels x [T, N] of a chain of STATES states: π ~ Dirichlet(1), each row of A ~
    Dirichlet(1), each row B_k ~ Dirichlet(EMISSION_PRIOR[k]), x_n ~ Categorical(B_{z_n})."""
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(STATES)))
        a = pyro.sample("A", dist.Dirichlet(x.new_ones(STATES, STATES)).to_event(1))
        prior = torch.tensor(EMISSION_PRIOR, dtype=x.dtype)
        b = pyro.sample("B", dist.Dirichlet(prior).to_event(1))
        emission = dist.Categorical(probs=b.unsqueeze(-3))
        chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), emission, duration=n)
        pyro.sample("x", chain, obs=x)


def hmm_labels(t=4, n=40, seed=0):
    """Sticky chains (stay with probability 0.9) emitting symbols 0 or 2 most often."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        z = torch.zeros(t, n, dtype=torch.long)
        for i in range(1, n):
            stay = torch.rand(t) < 0.9
            z[:, i] = torch.where(stay, z[:, i - 1], torch.randint(0, STATES, (t,)))
        emit = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]])
        x = dist.Categorical(emit[z]).sample()
    return x.double(), z


def _expected_log(concentration):
    """⟨ln θ⟩ = ψ(α) − ψ(Σ α) of Dirichlet factors (last axis)."""
    return digamma(concentration) - digamma(concentration.sum(-1, keepdim=True))


def _log_beta(a):
    return gammaln(a).sum(-1) - gammaln(a.sum(-1))


# ---------------------------------------------------------------------------- BayesPy
def test_categorical_markov_chain_matches_bayespy():
    """BayesPy's CategoricalMarkovChain with a Categorical mixture, updated in the same
    schedule (the chain before each parent): the same bound and ⟨ln B⟩ on every task.

    Both run exact coordinate ascent from the priors to a relative change of 1e-14, so
    they stop at the same fixed point; the bounds (~-40) then differ by float64 rounding
    (~1e-13), and rtol 1e-9 leaves a wide margin that no missing term could hide in."""
    bn = pytest.importorskip("bayespy.nodes")
    from bayespy.inference import VB

    x, _ = hmm_labels()
    state, _ = VMP(categorical_hmm, tol=1e-14, max_iter=3000).fit(x)
    n = x.shape[1]
    for t in range(x.shape[0]):
        pi = bn.Dirichlet(np.ones(STATES))
        a = bn.Dirichlet(np.ones(STATES), plates=(STATES,))
        z = bn.CategoricalMarkovChain(pi, a, states=n + 1)  # z_0 unobserved (Pyro's)
        b = bn.Dirichlet(np.array(EMISSION_PRIOR), plates=(STATES,))
        y = bn.Mixture(z, bn.Categorical, b)
        y.observe(np.r_[0, x[t].numpy().astype(int)], mask=np.r_[False, np.ones(n, bool)])
        q = VB(y, z, b, a, pi)
        q.update(z, pi, z, a, z, b, repeat=3000, tol=1e-14, verbose=False)
        np.testing.assert_allclose(state.objective[t].item(), q.compute_lowerbound(), rtol=1e-9)
        ours = _expected_log(state.q["B"][0][t]).numpy()
        np.testing.assert_allclose(ours, b.get_moments()[0], rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------ enumeration
def test_tiny_chain_against_a_sum_over_every_path():
    """K = 2 states, N = 6 steps, 3 tasks; Pyro's DiscreteHMM draws z_0 from π and takes a
    transition before each observation, so a path is z_0..z_N (128 paths). From the
    converged factors, the bound ln Σ_z exp(⟨ln π_z0⟩ + Σ_{n=1}^N ⟨ln A_{z_{n−1} z_n}⟩ +
    Σ_{n=1}^N ⟨ln B_{z_n x_n}⟩) − KL(q(π, A, B) ‖ p) by enumeration equals VMP's; the
    factors are their own update, α + the expected counts under the enumerated q(z); and
    the exact log evidence, the sum over paths of the Dirichlet-multinomial marginals, lies
    above the bound (by the mean-field gap)."""
    x, _ = hmm_labels(t=3, n=6, seed=1)
    state, _ = VMP(categorical_hmm, tol=1e-14, max_iter=3000).fit(x)
    n = x.shape[1]
    paths = torch.tensor(list(itertools.product(range(STATES), repeat=n + 1)))  # [P, N+1]
    every = torch.nn.functional.one_hot(paths, STATES).double()  # [P, N+1, K]
    one_hot = every[:, 1:]  # the states that emit
    kl = torch.distributions.kl_divergence
    ones = torch.ones(STATES, dtype=F64)
    prior_b = torch.tensor(EMISSION_PRIOR, dtype=F64)
    for t in range(x.shape[0]):
        q_pi, q_a, q_b = (state.q[k][0][t] for k in ("pi", "A", "B"))
        labels = x[t].long()
        score = (
            _expected_log(q_pi)[paths[:, 0]]
            + _expected_log(q_a)[paths[:, :-1], paths[:, 1:]].sum(-1)
            + _expected_log(q_b)[paths[:, 1:], labels].sum(-1)
        )
        bound = (
            torch.logsumexp(score, 0)
            - kl(dist.Dirichlet(q_pi), dist.Dirichlet(ones))
            - kl(dist.Dirichlet(q_a), dist.Dirichlet(ones.expand(STATES, STATES))).sum()
            - kl(dist.Dirichlet(q_b), dist.Dirichlet(prior_b)).sum()
        )
        torch.testing.assert_close(state.objective[t], bound, rtol=1e-13, atol=1e-12)

        weight = torch.softmax(score, 0)
        gamma = torch.einsum("p,pnk->nk", weight, one_hot)
        symbols = torch.nn.functional.one_hot(labels, SYMBOLS).double()
        pairs = torch.einsum("p,pnj,pnk->jk", weight, every[:, :-1], every[:, 1:])
        # converged to a relative bound change of 1e-14: the factors to ~1e-7
        torch.testing.assert_close(q_b, prior_b + gamma.T @ symbols, rtol=0, atol=1e-5)
        torch.testing.assert_close(q_a, 1 + pairs, rtol=0, atol=1e-5)
        torch.testing.assert_close(q_pi, 1 + weight @ every[:, 0], rtol=0, atol=1e-5)

        emitted = torch.einsum("pnk,nv->pkv", one_hot, symbols)
        transitions = torch.einsum("pnj,pnk->pjk", every[:, :-1], every[:, 1:])
        joint = (
            _log_beta(1 + every[:, 0])
            - _log_beta(ones)
            + (_log_beta(1 + transitions) - _log_beta(ones.expand(STATES, STATES))).sum(-1)
            + (_log_beta(prior_b + emitted) - _log_beta(prior_b)).sum(-1)
        )
        gap = torch.logsumexp(joint, 0) - state.objective[t]
        assert 0 < float(gap) < 2.0


def one_state(x, alpha=(2.0, 0.5, 1.0, 1.5)):
    """A chain of one state (fixed logits 0): labels i.i.d. Categorical(B), B ~ Dirichlet."""
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        prior = torch.tensor([alpha], dtype=x.dtype)
        b = pyro.sample("B", dist.Dirichlet(prior).to_event(1))
        emission = dist.Categorical(probs=b.unsqueeze(-3))
        chain = dist.DiscreteHMM(x.new_zeros(1), x.new_zeros(1, 1), emission, duration=n)
        pyro.sample("x", chain, obs=x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_one_state_chain_is_the_exact_dirichlet_categorical(dtype):
    """With one state q(z) is a point and mean field is exact: q(B) = Dirichlet(α + counts)
    and the bound is ln B(α + counts) − ln B(α), on 16 tasks."""
    x = torch.randint(0, 4, (16, 25), generator=torch.Generator().manual_seed(3)).to(dtype)
    state, _ = VMP(one_state).fit(x)
    alpha = torch.tensor([2.0, 0.5, 1.0, 1.5], dtype=F64)
    counts = torch.nn.functional.one_hot(x.long(), 4).double().sum(1)
    tol = 1e-12 if dtype == F64 else 2e-5
    assert state.objective.dtype == dtype
    got = state.q["B"][0][:, 0].double()
    torch.testing.assert_close(got, alpha + counts, rtol=tol, atol=0)
    evidence = _log_beta(alpha + counts) - _log_beta(alpha)
    torch.testing.assert_close(state.objective.double(), evidence, rtol=tol, atol=tol)


# ------------------------------------------------------------------------ conformance
@pytest.mark.slow
def test_categorical_hidden_markov_chain_conformance():
    """Monotone, batch-invariant, float32 against float64, on the data's device, no host
    synchronisation, and below Pyro's E_q ln p(x | θ) − KL (Pyro sums out the chain; the
    bound also holds q(z))."""
    from probfsl.testing import (
        ConformanceCase,
        assert_batch_invariant,
        assert_device_follows,
        assert_dtype_agreement,
        assert_monotone,
        assert_no_host_syncs,
        pyro_elbo_estimate,
    )

    x, _ = hmm_labels(t=3, n=30)
    case = ConformanceCase(
        make_engine=lambda: VMP(categorical_hmm, tol=0),
        model=categorical_hmm,
        data=(x,),
        n_steps=8,
    )
    for check in (assert_monotone, assert_batch_invariant, assert_dtype_agreement):
        check(case)
    assert_device_follows(case)
    assert_no_host_syncs(case)
    vmp = VMP(categorical_hmm, tol=1e-12, max_iter=500)
    state, _ = vmp.fit(x)
    guide = vmp.guide(state)
    mean, se = pyro_elbo_estimate(categorical_hmm, guide, (x,), 200, 5, max_plate_nesting=1)
    assert state.objective.sum().item() <= mean + 5 * se


# ------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("bad", [3.0, 0.5, -1.0, float("nan")])
def test_labels_outside_the_categories_are_refused_naming_the_site(bad):
    x, _ = hmm_labels(t=3, n=6)
    x[1, 2] = bad
    want = r"site 'x' \(DiscreteHMM\): its data must be labels 0 to 2"
    with pytest.raises(ValueError, match=want):
        VMP(categorical_hmm).fit(x)


def test_an_emission_law_that_changes_with_time_is_refused():
    def varying(x):
        t, n = x.shape
        with pyro.plate("tasks", t, dim=-1):
            pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(STATES)))
            a = pyro.sample("A", dist.Dirichlet(x.new_ones(STATES, STATES)).to_event(1))
            prior = torch.tensor(EMISSION_PRIOR, dtype=x.dtype)
            b = pyro.sample("B", dist.Dirichlet(prior).to_event(1))
            probs = b.unsqueeze(-3).expand(t, n, STATES, SYMBOLS)
            chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), dist.Categorical(probs))
            pyro.sample("x", chain, obs=x)

    with pytest.raises(ValueError, match="its observation law must not change with time"):
        VMP(varying).fit(hmm_labels(t=3, n=6)[0])


def test_transition_rows_declared_in_a_plate_are_refused_by_name():
    """A as a Dirichlet in a ``states`` plate (not ``.to_event(1)``): a VMP refusal naming
    the site, the parent and the supported form, not Pyro's validation error of the
    compiler's probe values."""
    k = 2

    def hmm(x):
        t, n = x.shape
        with pyro.plate("tasks", t, dim=-2):
            pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(k)))
            with pyro.plate("states", k, dim=-1):
                a = pyro.sample("A", dist.Dirichlet(x.new_ones(k)))
                mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 10.0))
                tau = pyro.sample("tau", dist.Gamma(x.new_tensor(1.0), 1.0))
            obs = dist.Normal(mu[:, None, None, :], tau.rsqrt()[:, None, None, :])
            chain = dist.DiscreteHMM(pi.log(), a.log()[:, None, None], obs, duration=n)
            pyro.sample("x", chain, obs=x.unsqueeze(-2))

    x = torch.randn(2, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"^VMP cannot use site 'x' \(DiscreteHMM\) with parent 'A'.*\.to_event\(1\)",
    ):
        VMP(hmm).compile(x)


def _symmetric_hmm(x):
    """categorical_hmm with the same emission prior for every state."""
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(STATES)))
        a = pyro.sample("A", dist.Dirichlet(x.new_ones(STATES, STATES)).to_event(1))
        b = pyro.sample("B", dist.Dirichlet(x.new_ones(STATES, 3)).to_event(1))
        emission = dist.Categorical(probs=b.unsqueeze(-3))
        chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), emission, duration=n)
        pyro.sample("x", chain, obs=x)


def test_a_symmetric_start_is_reported_and_a_start_apart_leaves_it():
    """With the same prior for every state the states' emissions stay identical (one sweep,
    "converged"): the fit warns and names B; started apart, B's rows differ and the bound
    is higher on every task."""
    x, _ = hmm_labels(t=3)
    with pytest.warns(ConvergenceWarning, match=r"DiscreteHMM 'x' .* 3 of 3 task.*'B'"):
        tied, _ = VMP(_symmetric_hmm, tol=1e-10).fit(x)
    torch.testing.assert_close(tied.q["B"][0][:, 0], tied.q["B"][0][:, 1], rtol=0, atol=0)
    start = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.3, 0.6]], dtype=x.dtype).expand(3, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        apart, _ = VMP(_symmetric_hmm, tol=1e-10, max_iter=500).fit(x, init={"B": start})
    assert bool((apart.objective > tied.objective + 1).all())


def test_the_chain_is_pyros_discrete_hmm():
    """Pyro's DiscreteHMM draws z_0 from the initial probabilities and takes a transition
    before each observation. With priors so tight that π, A, μ and τ are known, the bound
    is DiscreteHMM.log_prob (the first state drawn from π instead, as in a textbook HMM, it
    was up to 1.9 nats above it)."""
    p0 = torch.tensor([0.9, 0.05, 0.05], dtype=F64)
    a = torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.8, 0.1, 0.1]], dtype=F64)
    means, sd = torch.tensor([-3.0, 0.0, 3.0], dtype=F64), 0.5

    def known(x):
        with pyro.plate("tasks", x.shape[0], dim=-1):
            pi = pyro.sample("pi", dist.Dirichlet(1e8 * p0))
            rows = pyro.sample("A", dist.Dirichlet(1e8 * a).to_event(1))
            mu = pyro.sample("mu", dist.Normal(means, 1e-6).to_event(1))
            tau = pyro.sample("tau", dist.Gamma(x.new_full((3,), 1e8 / sd**2), 1e8).to_event(1))
            law = dist.Normal(mu.unsqueeze(-2), tau.rsqrt().unsqueeze(-2))
            chain = dist.DiscreteHMM(pi.log(), rows.log().unsqueeze(-3), law, duration=x.shape[1])
            pyro.sample("x", chain, obs=x)

    x = torch.tensor(
        [[-3.0, 0.1, 2.9, -3.1], [0.0, 3.0, -3.0, 0.0], [3.1, -2.9, 0.0, 3.0]], dtype=F64
    )
    state, _ = VMP(known, tol=1e-13, max_iter=200).fit(x)
    exact = dist.DiscreteHMM(p0.log(), a.log(), dist.Normal(means, sd), duration=4).log_prob(x)
    torch.testing.assert_close(state.objective, exact, rtol=0, atol=1e-4)
