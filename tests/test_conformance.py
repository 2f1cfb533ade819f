"""The shared model/guide conformance checks, proven on textbook conjugate models."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from probfsl.host_syncs import HostSyncCounter
from probfsl.inference.base import Info, run
from probfsl.inference.normal_gamma import NormalGammaVB, NormalMeanPosterior
from probfsl.models.normal_gamma import normal_gamma_model, normal_mean_model
from probfsl.testing import (
    ConformanceCase,
    assert_device_follows,
    assert_elbo_matches_pyro,
    assert_exact_evidence,
    assert_monotone,
    assert_no_host_syncs,
    check_engine,
    checks_of,
    engine_checks,
    parametrize_with_checks,
)


def _data(t=4, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 1.5 + 0.7 * torch.randn(t, n, generator=g, dtype=torch.float64)


def _exact_log_evidence(x, mu0, lam0, tau):
    """Marginal x ~ Normal(mu0 1, tau^-1 I + (lam0 tau)^-1 11^T), evaluated densely."""
    n = x.shape[-1]
    cov = torch.eye(n, dtype=x.dtype) / tau + torch.ones(n, n, dtype=x.dtype) / (lam0 * tau)
    mvn = torch.distributions.MultivariateNormal(torch.full((n,), mu0, dtype=x.dtype), cov)
    return mvn.log_prob(x)


def normal_mean_case():
    x = _data()
    hyper = dict(mu0=0.5, lam0=2.0, tau=1.7)
    return ConformanceCase(
        make_engine=lambda: NormalMeanPosterior(**hyper),
        model=partial(normal_mean_model, **hyper),
        data=(x,),
        n_steps=3,
        exact_log_evidence=_exact_log_evidence(x, **hyper),
    )


def normal_gamma_case():
    hyper = dict(mu0=0.5, lam0=2.0, a0=2.0, b0=1.5)
    return ConformanceCase(
        make_engine=lambda: NormalGammaVB(**hyper),
        model=partial(normal_gamma_model, **hyper),
        data=(_data(),),
        n_steps=15,
    )


@parametrize_with_checks([normal_mean_case(), normal_gamma_case()])
def test_textbook_engines_pass_conformance(case, check):
    """One test id per (engine, check) pair, e.g. NormalGammaVB-assert_monotone."""
    check(case)


def test_parametrize_with_checks_lists_the_engine_checks():
    cases = [normal_mean_case(), replace(normal_gamma_case(), name="gamma")]
    ids = [test_id for test_id, _, _ in checks_of(cases)]
    assert ids[0] == "NormalMeanPosterior-assert_monotone"
    assert "NormalMeanPosterior-assert_exact_evidence" in ids  # it has the exact evidence
    assert "gamma-assert_elbo_matches_pyro" in ids and "gamma-assert_exact_evidence" not in ids
    assert [check for _, _, check in checks_of(cases[1:])] == engine_checks(cases[1])
    with pytest.raises(TypeError, match="estimators and engine cases"):
        from probfsl.models.slem import SLEM

        parametrize_with_checks([cases[0], SLEM()])


def test_normal_gamma_matches_exact_posterior_limit():
    """With many samples the mean-field posterior concentrates on the sample moments."""
    x = 2.0 + 0.5 * torch.randn(1, 20000, generator=torch.Generator().manual_seed(1)).double()
    engine = NormalGammaVB()
    state, _ = run(engine, engine.init(x), 30)
    assert abs(state.mu_mean.item() - x.mean().item()) < 1e-3
    assert abs((state.tau_shape / state.tau_rate).item() - 1 / x.var().item()) < 0.05


class _BrokenMuUpdate(NormalGammaVB):
    """q(mu) update that forgets the prior: no longer coordinate ascent."""

    def _update_mu(self, s):
        n = s.x.shape[-1]
        e_tau = s.tau_shape / s.tau_rate
        new = replace(s, mu_mean=s.x.mean(-1) + 0.3, mu_precision=n * e_tau)
        return replace(new, objective=self.elbo(new))


class _BrokenElbo(NormalGammaVB):
    """Correct updates but an ELBO that drops the entropy of q(tau)."""

    def elbo(self, s):
        a, b = s.tau_shape, s.tau_rate
        h_tau = a - b.log() + torch.lgamma(a) + (1 - a) * torch.special.digamma(a)
        return super().elbo(s) - h_tau


class _BrokenPosterior(NormalMeanPosterior):
    """Posterior mean shifted away from the exact one."""

    def step(self, state):
        state, _ = super().step(state)
        state = replace(state, mean=state.mean + 0.2)
        state = replace(state, objective=self.elbo(state))
        return state, Info(state.objective)


def test_conformance_catches_a_broken_update():
    case = replace(normal_gamma_case(), make_engine=lambda: _BrokenMuUpdate(0.5, 2.0, 2.0, 1.5))
    with pytest.raises(AssertionError):
        assert_monotone(case)


def test_conformance_catches_a_wrong_analytic_elbo():
    case = replace(normal_gamma_case(), make_engine=lambda: _BrokenElbo(0.5, 2.0, 2.0, 1.5))
    with pytest.raises(AssertionError):
        assert_elbo_matches_pyro(case)


def test_conformance_catches_an_inexact_posterior():
    case = replace(normal_mean_case(), make_engine=lambda: _BrokenPosterior(0.5, 2.0, 1.7))
    with pytest.raises(AssertionError):
        assert_exact_evidence(case)
    with pytest.raises(AssertionError):
        check_engine(case)


class _CpuMaker(NormalGammaVB):
    """Creates a tensor without ``device=``: on a GPU this crashes, on the CPU it is hidden."""

    def _update_mu(self, s):
        s = super()._update_mu(s)
        return replace(s, mu_mean=s.mu_mean + torch.zeros(s.mu_mean.shape, dtype=s.x.dtype))


class _Syncing(NormalGammaVB):
    """Checks convergence on the host inside ``step``."""

    def step(self, state):
        new, info = super().step(state)
        if bool((new.objective - state.objective).abs().max() < 1e-12):
            pass
        return new, info


def test_conformance_catches_a_tensor_made_off_the_data_device():
    case = replace(normal_gamma_case(), make_engine=lambda: _CpuMaker(0.5, 2.0, 2.0, 1.5))
    assert_no_host_syncs(case)
    with pytest.raises(AssertionError, match="default device"):
        assert_device_follows(case)


def test_conformance_catches_a_host_sync_in_step():
    case = replace(normal_gamma_case(), make_engine=lambda: _Syncing(0.5, 2.0, 2.0, 1.5))
    assert_device_follows(case)
    with pytest.raises(AssertionError, match="host synchronisations"):
        assert_no_host_syncs(case)


def test_run_freezes_converged_tasks_and_syncs_once_per_check():
    """Tasks stop changing once converged; the loop syncs once every ``check_every`` steps."""
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(3)).double()
    x[3] *= 40.0  # a slower task
    engine = NormalGammaVB(0.5, 2.0, 2.0, 1.5)
    with HostSyncCounter() as counter:
        state, info = run(engine, engine.init(x), 200, tol=1e-10, check_every=4)
    steps = len(info.trace) - 1
    assert counter.total == steps // 4
    assert info.converged.all() and steps < 200
    assert (info.n_steps <= steps).all() and info.n_steps.min() < info.n_steps.max()
    for t in range(6):  # a frozen task's trace is constant after it converged
        k = int(info.n_steps[t])
        assert torch.equal(info.trace[k:, t], info.trace[k, t].expand(steps + 1 - k))
    alone, _ = run(engine, engine.init(x[:1]), 200, tol=1e-10, check_every=4)
    torch.testing.assert_close(alone.mu_mean, state.mu_mean[:1], rtol=0, atol=0)
    free, info_free = run(engine, engine.init(x), 7)
    assert len(info_free.trace) == 8 and not info_free.converged.any()


class _CompactingNormalGamma(NormalGammaVB):
    """The hand-written engine with the contract's default take/put switched on."""

    compacts = True


def test_default_compaction_gives_every_task_its_own_result():
    """Engine.take/put's defaults (every tensor of the state with the batch's leading
    length): compacting at the checks changes no task's state, steps or trace, and the
    syncs stay one per check."""
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(3)).double()
    x[3] *= 40.0
    plain = NormalGammaVB(0.5, 2.0, 2.0, 1.5)
    compacting = _CompactingNormalGamma(0.5, 2.0, 2.0, 1.5)
    state, info = run(plain, plain.init(x), 200, tol=1e-10, check_every=4)
    with HostSyncCounter() as counter:
        packed, packed_info = run(compacting, compacting.init(x), 200, tol=1e-10, check_every=4)
    assert counter.total == (len(packed_info.trace) - 1) // 4
    for name in ("mu_mean", "objective"):
        torch.testing.assert_close(getattr(packed, name), getattr(state, name), rtol=1e-12, atol=0)
    torch.testing.assert_close(packed_info.trace, info.trace, rtol=1e-12, atol=0)
    assert torch.equal(packed_info.n_steps, info.n_steps)
    assert torch.equal(packed_info.converged, info.converged)
    part = compacting.take(state, torch.tensor([3, 1]))
    assert part.objective.shape == (2,) and torch.equal(part.mu_mean, state.mu_mean[[3, 1]])
    back = compacting.put(state, torch.tensor([3, 1]), part)
    torch.testing.assert_close(back.mu_mean, state.mu_mean, rtol=0, atol=0)


class _CountingKeeps(NormalGammaVB):
    """The hand-written engine recording the mask of every ``keep`` the loop asks for."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.masks: list[torch.Tensor] = []

    def keep(self, frozen, old, new):
        self.masks.append(frozen.clone())
        return super().keep(frozen, old, new)


def test_keep_runs_only_where_a_task_may_be_frozen():
    """After a check that found every task moving, the next step's mask would keep nothing
    and is not applied: with a check after every step, each mask applied freezes a task,
    and every task's result is the one of a check every 4 steps."""
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(3)).double()
    x[3] *= 40.0
    engine = _CountingKeeps(0.5, 2.0, 2.0, 1.5)
    state, info = run(engine, engine.init(x), 200, tol=1e-10, check_every=1)
    assert engine.masks and all(bool(m.any()) for m in engine.masks)
    assert len(engine.masks) < len(info.trace) - 1  # the first steps kept nothing
    ref_engine = NormalGammaVB(0.5, 2.0, 2.0, 1.5)
    ref, ref_info = run(ref_engine, ref_engine.init(x), 200, tol=1e-10, check_every=4)
    torch.testing.assert_close(state.objective, ref.objective, rtol=1e-12, atol=0)
    assert torch.equal(info.n_steps, ref_info.n_steps)


def test_growing_check_schedule_changes_when_the_loop_stops_not_the_results():
    """check_growth > 1: checks at 2, 4, 7, 12, 19, ...; one sync per check made; every
    task's result is the one of the fixed schedule (frozen tasks never change)."""
    from probfsl.inference.base import check_steps

    assert check_steps(60, 2, 1.0) == list(range(2, 61, 2))
    assert check_steps(70, 2, 1.5) == [2, 4, 7, 12, 19, 29, 44, 67]
    with pytest.raises(ValueError, match="check_growth"):
        check_steps(10, 2, 0.5)
    x = torch.randn(6, 9, generator=torch.Generator().manual_seed(3)).double()
    x[3] *= 40.0
    engine = NormalGammaVB(0.5, 2.0, 2.0, 1.5)
    fixed, _ = run(engine, engine.init(x), 200, tol=1e-10, check_every=2)
    with HostSyncCounter() as counter:
        grown, info = run(engine, engine.init(x), 200, tol=1e-10, check_every=2, check_growth=1.5)
    steps = len(info.trace) - 1
    assert steps in check_steps(200, 2, 1.5) and info.converged.all()
    assert counter.total == check_steps(200, 2, 1.5).index(steps) + 1
    torch.testing.assert_close(grown.mu_mean, fixed.mu_mean, rtol=0, atol=0)
