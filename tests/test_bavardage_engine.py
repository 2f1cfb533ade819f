"""BAVARDAGE's mean-field engine: conformance with Pyro, exactness, brute force
(docs/design/bavardage.md §7), and the guarantees of the production configuration (adaptive
projection)."""

import itertools
import math
from dataclasses import replace
from functools import partial

import pytest
import torch

from probfsl.data.builtin import load_dataset
from probfsl.data.tasks import sample_episodes
from probfsl.inference.base import run
from probfsl.inference.vb_mixture import BavardageVB, fit_bavardage_vb
from probfsl.models.bavardage import Bavardage, bavardage_model
from probfsl.testing import (
    ConformanceCase,
    assert_batch_invariant,
    assert_device_follows,
    assert_dtype_agreement,
    assert_elbo_matches_pyro,
    assert_monotone,
    assert_no_host_syncs,
    check_engine,
    pyro_elbo_estimate,
)

K = 3


def _mixture_data(t=3, shot=2, n_query=5, d=2, sep=1.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    centres = sep * torch.randn(t, K, d, generator=g, dtype=dtype)
    y_s = torch.arange(K).repeat(shot).expand(t, -1)
    y_q = torch.randint(0, K, (t, n_query), generator=g)
    pick = lambda y: torch.gather(centres, 1, y.unsqueeze(-1).expand(-1, -1, d))  # noqa: E731
    noise = lambda n: 0.5 * torch.randn(t, n, d, generator=g, dtype=dtype)  # noqa: E731
    return pick(y_s) + noise(y_s.shape[1]), y_s, pick(y_q) + noise(n_query), y_q


HYPER = dict(tau=3.0, alpha0=2.0, beta0=1.5)


@pytest.mark.parametrize(
    "variant",
    [dict(), dict(balanced=True), dict(count_support=True)],
    ids=["code", "balanced", "paper-alpha"],
)
def test_engine_conformance(variant):
    """Shared suite: monotone ELBO, batch and dtype invariance, Pyro Trace_ELBO agreement."""
    u_s, y_s, u_q, _ = _mixture_data()
    case = ConformanceCase(
        make_engine=lambda: BavardageVB(K, projection="identity", **HYPER, **variant),
        model=partial(bavardage_model, way=K, **HYPER, **variant),
        data=(u_s, y_s, u_q),
        n_steps=8,
        particles=400,
        repeats=8,
    )
    check_engine(case)


class _WrongMean(BavardageVB):
    """An M step that forgets the prior on the centroids: not coordinate ascent."""

    def m_step(self, state):
        state = super().m_step(state)
        counts = state.resp.sum(1, keepdim=True).transpose(1, 2)
        new = replace(state, mean=state.resp.transpose(1, 2) @ state.u / counts)
        return replace(new, objective=self.elbo(new))


def test_monotone_check_catches_a_broken_m_step():
    u_s, y_s, u_q, _ = _mixture_data(seed=3)
    case = ConformanceCase(
        make_engine=lambda: _WrongMean(K, projection="identity", **HYPER),
        model=None,
        data=(u_s, y_s, u_q),
        n_steps=6,
    )
    with pytest.raises(AssertionError):
        assert_monotone(case)


@pytest.mark.parametrize("balanced", [False, True])
def test_elbo_never_decreases_after_each_update_with_frozen_projection(balanced):
    """Design §7: with the PLDA projection frozen, every M and every E update raises the ELBO."""
    u_s, y_s, u_q, _ = _mixture_data(t=6, shot=1, n_query=20, d=12, sep=0.4, seed=1)
    engine = BavardageVB(K, tau=4.0, projection="frozen", balanced=balanced)
    state = engine.init(u_s, y_s, u_q)
    values = [state.objective]
    for _ in range(25):
        state = engine.e_step(state)
        values.append(state.objective)
        state = engine.m_step(state)
        values.append(state.objective)
    trace = torch.stack(values)
    assert state.u.shape[-1] == K - 1  # d = K - 1
    assert (trace[1:] - trace[:-1]).min() >= -1e-10 * trace.abs().max()


def test_conjugate_updates_with_hard_assignments():
    """Design §7: one-hot o gives the exact posteriors of μ_k and Dir(α_o + query counts)."""
    u_s, y_s, u_q, y_q = _mixture_data(t=2, n_query=7, d=2)
    engine = BavardageVB(K, projection="identity", **HYPER)
    resp = torch.nn.functional.one_hot(torch.cat([y_s, y_q], 1), K).double()
    state = engine.init(u_s, y_s, u_q, resp)
    u = torch.cat([u_s, u_q], 1)
    labels = torch.cat([y_s, y_q], 1)
    for t in range(2):
        for k in range(K):
            members = u[t][labels[t] == k]
            n_k = members.shape[0]
            beta = HYPER["beta0"] + n_k
            torch.testing.assert_close(state.beta[t, k], torch.tensor(beta, dtype=u.dtype))
            torch.testing.assert_close(state.mean[t, k], members.sum(0) / beta)
            n_query_k = (y_q[t] == k).sum()
            assert state.alpha[t, k].item() == pytest.approx(HYPER["alpha0"] + n_query_k.item())


def _log_evidence_brute_force(u_s, y_s, u_q, tau, alpha0, beta0):
    """log p(U) by enumerating every query assignment (d = 1, the code's model)."""
    q = u_q.shape[0]
    terms = []
    for z in itertools.product(range(K), repeat=q):
        z = torch.tensor(z)
        labels, u = torch.cat([y_s, z]), torch.cat([u_s, u_q])[:, 0]
        log_lik = 0.0
        for k in range(K):
            x = u[labels == k]
            n = x.shape[0]
            if n == 0:
                continue
            cov = torch.eye(n, dtype=u.dtype) / tau + torch.ones(n, n, dtype=u.dtype) / (
                beta0 * tau
            )
            mvn = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=u.dtype), cov)
            log_lik = log_lik + mvn.log_prob(x)
        counts = torch.bincount(z, minlength=K).double()
        log_prior = (
            math.lgamma(K * alpha0)
            - math.lgamma(K * alpha0 + q)
            + (torch.lgamma(alpha0 + counts) - math.lgamma(alpha0)).sum()
        )
        terms.append(log_lik + log_prior)
    return torch.logsumexp(torch.stack(terms), 0)


@pytest.mark.slow
def test_elbo_below_brute_force_evidence_and_gap_shrinks_with_separation():
    """Design §7: K=2-style tiny problem (here K=3, 3 queries, d=1) enumerated exactly."""
    gaps = []
    for sep in (0.5, 2.0, 8.0):
        g = torch.Generator().manual_seed(0)
        centres = torch.tensor([-sep, 0.0, sep], dtype=torch.float64)
        y_s = torch.arange(K)
        y_q = torch.tensor([0, 2, 1])
        u_s = (centres[y_s] + 0.3 * torch.randn(K, generator=g, dtype=torch.float64))[:, None]
        u_q = (centres[y_q] + 0.3 * torch.randn(3, generator=g, dtype=torch.float64))[:, None]
        engine = BavardageVB(K, projection="identity", **HYPER)
        state = engine.init(u_s[None], y_s[None], u_q[None])
        state, _ = run(engine, state, 50)
        log_p = _log_evidence_brute_force(u_s, y_s, u_q, **HYPER)
        gap = (log_p - state.objective[0]).item()
        assert gap >= -1e-9
        gaps.append(gap)
    assert gaps[0] > gaps[1] > gaps[2]


def test_e_step_log_rho_matches_monte_carlo_expectation():
    """Design §7: E_q[ln π_k + ln N(u_n | μ_k, Λ^{-1})] by sampling equals ln ρ_nk."""
    u_s, y_s, u_q, _ = _mixture_data(t=1, n_query=4, d=3, seed=2)
    engine = BavardageVB(K, projection="identity", **HYPER)
    state, _ = fit_bavardage_vb(engine, u_s, y_s, u_q, n_iter=3)
    torch.manual_seed(0)
    n = 200_000
    pi = torch.distributions.Dirichlet(state.alpha[0]).sample((n,))  # [n, K]
    sd = (state.beta[0] * HYPER["tau"]).rsqrt()[:, None]
    mu = torch.distributions.Normal(state.mean[0], sd.expand_as(state.mean[0])).sample((n,))
    u = state.u[0]  # [N, d]
    comp = torch.distributions.Normal(mu[:, None], HYPER["tau"] ** -0.5)  # [n, 1, K, d]
    log_lik = comp.log_prob(u[None, :, None]).sum(-1)  # [n, N, K]
    mc = (pi.log()[:, None] + log_lik).mean(0)
    torch.testing.assert_close(mc, engine.log_rho(state)[0], atol=0.02, rtol=0.0)


def test_perturbing_any_factor_never_increases_the_elbo():
    """Design §7: every closed-form factor is a coordinate-wise maximiser."""
    u_s, y_s, u_q, _ = _mixture_data(t=2, n_query=6, d=2, seed=4)
    engine = BavardageVB(K, projection="identity", **HYPER)
    state, _ = run(engine, engine.init(u_s, y_s, u_q), 4)
    # q(π), q(μ) are optimal given o right after the M step
    best = state.objective
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        eps = lambda x: 0.05 * torch.randn(x.shape, generator=g, dtype=x.dtype)  # noqa: E731
        for name in ("alpha", "beta", "mean"):
            value = getattr(state, name)
            changed = replace(state, **{name: (value + eps(value)).clamp_min(1e-3)})
            assert (engine.elbo(changed) <= best + 1e-12).all(), name
    # q(z) is optimal given q(π), q(μ) right after the E step
    state = engine.e_step(state)
    best = state.objective
    for _ in range(5):
        logits = state.query_resp.log() + 0.2 * torch.randn(
            state.query_resp.shape, generator=g, dtype=torch.float64
        )
        resp = torch.cat([state.resp[:, : state.n_support], logits.softmax(-1)], 1)
        assert (engine.elbo(replace(state, resp=resp)) <= best + 1e-12).all()


@pytest.mark.parametrize("count_support", [False, True])
def test_invariants(count_support):
    """Design §7: one-hot support, Σ_k N_k = N, β_k ≥ β_o, Σ_k α_k, rows sum to one."""
    u_s, y_s, u_q, _ = _mixture_data(t=4, shot=2, n_query=9, d=5, seed=5)
    engine = BavardageVB(K, projection="adaptive", count_support=count_support, **HYPER)
    state, _ = fit_bavardage_vb(engine, u_s, y_s, u_q, n_iter=4)
    n_s, n = u_s.shape[1], u_s.shape[1] + u_q.shape[1]
    onehot = torch.nn.functional.one_hot(y_s, K).double()
    torch.testing.assert_close(state.resp[:, :n_s], onehot)
    torch.testing.assert_close(state.resp.sum(-1), torch.ones(4, n, dtype=torch.float64))
    torch.testing.assert_close(
        state.resp.sum((1, 2)), torch.full((4,), float(n), dtype=torch.float64)
    )
    assert (state.beta >= HYPER["beta0"]).all()
    total = K * HYPER["alpha0"] + (n if count_support else u_q.shape[1])
    torch.testing.assert_close(state.alpha.sum(-1), torch.full((4,), total, dtype=torch.float64))
    assert state.u.shape[-1] == K - 1


def test_engine_rejects_bad_input():
    u_s, y_s, u_q, _ = _mixture_data()
    engine = BavardageVB(K, projection="identity")
    with pytest.raises(ValueError, match="support_labels"):
        engine.init(u_s, y_s + K, u_q)
    with pytest.raises(ValueError, match="query"):
        engine.init(u_s, y_s, u_q[..., :1])
    with pytest.raises(ValueError, match="projection"):
        BavardageVB(K, projection="pca")
    with pytest.raises(ValueError, match="tau"):
        BavardageVB(K, tau=0.0)


def test_step_reports_the_elbo_after_its_e_step_and_its_m_step():
    """With u fixed (identity), previous objective <= Info.objective_e <= new objective;
    both equal the explicit ELBO of design §3.9 (the step uses the E step's log-normaliser
    and the collapsed bound after the M step)."""
    u_s, y_s, u_q, _ = _mixture_data(t=4, n_query=9, d=3, seed=6)
    for variant in (dict(), dict(balanced=True), dict(count_support=True)):
        engine = BavardageVB(K, projection="identity", **HYPER, **variant)
        state = engine.init(u_s, y_s, u_q)
        torch.testing.assert_close(state.objective, engine.elbo(state), rtol=1e-12, atol=1e-12)
        for _ in range(4):
            new, info = engine.step(state)
            after_e = engine.e_step(state)
            torch.testing.assert_close(info.objective_e, engine.elbo(after_e), rtol=1e-12, atol=0)
            torch.testing.assert_close(new.objective, engine.elbo(new), rtol=1e-12, atol=0)
            assert (info.objective_e >= state.objective - 1e-10).all()
            assert (new.objective >= info.objective_e - 1e-10).all()
            state = new


def test_fit_is_init_then_run_then_a_final_e_step():
    u_s, y_s, u_q, _ = _mixture_data(t=3, n_query=8, d=4, seed=7)
    engine = BavardageVB(K, projection="adaptive", **HYPER)
    state, info = fit_bavardage_vb(engine, u_s, y_s, u_q, n_iter=4)
    ref, ref_info = run(engine, engine.init(u_s, y_s, u_q), 3)
    assert info.trace.shape == (5, 3)
    torch.testing.assert_close(info.trace[:-1], ref_info.trace, rtol=0, atol=0)
    torch.testing.assert_close(state.resp, engine.e_step(ref).resp, rtol=0, atol=0)
    torch.testing.assert_close(info.trace[-1], state.objective, rtol=0, atol=0)
    with pytest.raises(ValueError, match="n_iter"):
        fit_bavardage_vb(engine, u_s, y_s, u_q, n_iter=0)


# ------------------------------------------------------------ production configuration
#: the estimator as it is shipped (default = the CUB preset, task-span whitening), its
#: global-whitening fast path (adaptive_gram) and a balanced published preset
PRODUCTION = {
    "default": lambda: Bavardage(),
    "global": lambda: Bavardage(whitening="global"),
    "mini-balanced": lambda: Bavardage.from_preset("mini-balanced"),
}


@pytest.fixture(scope="module")
def omniglot():
    fs = load_dataset("omniglot")
    episodes = sample_episodes(
        fs, 3, way=5, shot=1, n_query=15, balance="dirichlet", seed=0, dtype=torch.float64
    )
    return fs.base(torch.float64), episodes


def _production_case(name, omniglot):
    """The estimator's engine and data (``vb_problem``), run for its n_vb - 1 steps."""
    (base, labels), episodes = omniglot
    est = PRODUCTION[name]().fit_base(base, labels)
    engine, data = est.vb_problem(episodes)
    assert engine.projection in ("adaptive", "adaptive_gram")
    case = ConformanceCase(
        make_engine=lambda: engine,
        model=None,
        data=data,
        n_steps=est.n_vb - 1,
        outputs=lambda s: torch.cat([s.objective.unsqueeze(-1), s.query_resp.flatten(1)], -1),
        particles=400,
        repeats=8,
    )
    return est, engine, case


def _model_given_projection(engine, state):
    """bavardage_model on the state's u = x P: the production model of that block (P fixed)."""
    n_s = state.n_support
    u_s, u_q, y_s = state.u[:, :n_s], state.u[:, n_s:], state.support_labels
    hyper = dict(
        way=engine.way,
        tau=engine.tau,
        alpha0=engine.alpha0,
        beta0=engine.beta0,
        balanced=engine.balanced,
        count_support=engine.count_support,
    )
    return lambda *data: bavardage_model(u_s, y_s, u_q, **hyper)


@pytest.mark.parametrize("name", list(PRODUCTION))
@pytest.mark.slow
def test_production_engine_conformance(name, omniglot):
    """The shared checks on the estimator's own engine and data (adaptive projection).

    assert_monotone does not apply: the projection changes the data u at every step
    (monotonicity within each block is the next test)."""
    _, engine, case = _production_case(name, omniglot)
    assert_batch_invariant(case)
    assert_dtype_agreement(case)
    assert_device_follows(case)
    assert_no_host_syncs(case)
    state, _ = run(engine, engine.init(*case.data), case.n_steps)
    assert_elbo_matches_pyro(replace(case, model=_model_given_projection(engine, state)))


@pytest.mark.parametrize("name", list(PRODUCTION))
@pytest.mark.slow
def test_production_final_state_elbo_matches_pyro(name, omniglot):
    """At the state predict_proba returns (after the final E step), Trace_ELBO of the model
    on that block's u equals state.objective."""
    est, engine, case = _production_case(name, omniglot)
    state, _ = fit_bavardage_vb(engine, *case.data, n_iter=est.n_vb)
    torch.testing.assert_close(state.query_resp, est.predict_proba(omniglot[1]), rtol=0, atol=0)
    mean, se = pyro_elbo_estimate(
        _model_given_projection(engine, state), engine.guide(state), case.data, 400, 8
    )
    analytic = state.objective.sum().item()
    assert abs(mean - analytic) <= 5 * se + 1e-6 * abs(analytic), (mean, se, analytic)


@pytest.mark.parametrize("name", list(PRODUCTION))
@pytest.mark.slow
def test_production_elbo_is_monotone_within_each_block(name, omniglot):
    """Within a block (projection fixed) the E step does not lower the ELBO; after a
    projection update the M step does not lower the ELBO of the new u. (Across an
    update nothing is ordered: the two ELBOs bound the evidence of different data.)"""
    est, engine, case = _production_case(name, omniglot)
    state = engine.init(*case.data)
    scale = state.objective.abs().max().item()
    for _ in range(est.n_vb + 3):
        new, info = engine.step(state)
        projected = engine.project(engine.e_step(state))
        assert not torch.equal(projected.u, state.u)  # the projection did move
        assert (info.objective_e >= state.objective - 1e-10 * scale).all()
        assert (new.objective >= engine.elbo(projected) - 1e-10 * scale).all()
        torch.testing.assert_close(new.objective, engine.elbo(new), rtol=1e-10, atol=0)
        state = new
