"""``bavardage-gamma``: BAVARDAGE's PLDA-projected mixture with per-class Gamma precisions,
derived by VMP (conformance of the derived engine and of the estimator; CPU, a few
seconds)."""

from __future__ import annotations

import pytest
import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes
from probfsl.derived.bavardage import run_blocks
from probfsl.inference.vmp import VMP
from probfsl.testing import ConformanceCase, check_engine


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


@pytest.fixture(scope="module")
def tasks(omniglot):
    return sample_episodes(omniglot, 6, way=5, shot=1, n_query=30, seed=3, dtype=torch.float64)


def _fitted(fs, dtype=torch.float64, **params):
    return make_estimator("bavardage-gamma", **params).fit_featureset(fs, dtype)


def _one_block(est, tasks):
    """The model, VMP engine and data of the first block: the rows projected by the map
    of the soft k-means responsibilities (what ``run_blocks`` hands VMP first)."""
    engine, (support, labels, query, resp) = est.vb_problem(tasks)
    n_s = support.shape[1]
    u = engine.rows(torch.cat([support, query], 1), resp)
    model = est.declared_model(engine)
    return model, (u[:, :n_s], labels, u[:, n_s:]), {"z": resp[:, n_s:]}


@pytest.mark.slow
def test_elbo_is_monotone_within_a_block(omniglot, tasks):
    """Coordinate ascent on a fixed projection: no update lowers the ELBO; across blocks
    the projection changes the data, so only the last block's E step is compared."""
    est = _fitted(omniglot)
    model, data, init = _one_block(est, tasks)
    vmp = VMP(model)
    state = vmp.init(*data, init_resp=init)
    elbos = [state.objective]
    for names in (["z"], ["pi"], ["tau"], ["mu"], ["z"]) * 4:
        state = vmp.update(state, names)
        elbos.append(state.objective)
    steps = torch.diff(torch.stack(elbos), dim=0)
    assert bool((steps >= -1e-9 * (1 + torch.stack(elbos)[1:].abs())).all()), steps.min()
    est.predict_proba(tasks)
    trace = est.elbo_trace_
    assert trace.shape == (est.n_vb + 1, len(tasks))
    assert bool((trace[-1] >= trace[-2] - 1e-9 * trace[-2].abs()).all())


@pytest.mark.slow
def test_derived_block_passes_conformance(omniglot, tasks):
    """The engine of one block passes probfsl's engine contract (monotone ELBO, batch =
    one task at a time, float32 ~ float64, device, no host synchronisation, Pyro's
    Trace_ELBO of model and derived guide = the analytic ELBO)."""
    est = _fitted(omniglot)
    model, data, _ = _one_block(est, tasks[:3])
    case = ConformanceCase(
        make_engine=lambda: VMP(model, tol=0),
        model=model,
        data=data,
        n_steps=8,
        particles=200,
        repeats=5,
    )
    check_engine(case)


@pytest.mark.slow
def test_batch_equals_one_task_at_a_time(omniglot, tasks):
    est = _fitted(omniglot)
    batch = est.predict_proba(tasks)
    single = torch.cat([est.predict_proba(tasks[i : i + 1]) for i in range(len(tasks))])
    torch.testing.assert_close(batch, single, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_float32_follows_float64(omniglot, tasks):
    p64 = _fitted(omniglot).predict_proba(tasks)
    p32 = _fitted(omniglot, torch.float32).predict_proba(tasks.to(dtype=torch.float32))
    assert p32.dtype == torch.float32 and p32.device.type == "cpu"
    torch.testing.assert_close(p32.double(), p64, rtol=0, atol=2e-3)
    assert (p32.argmax(-1) == p64.argmax(-1)).double().mean() > 0.99


def test_stays_on_the_cpu_in_the_data_dtype(omniglot, tasks):
    est = _fitted(omniglot, torch.float32)
    probs = est.predict_proba(tasks.to(dtype=torch.float32))
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]))
    for factor in est.state_.q.values():
        for t in factor:
            assert t.device.type == "cpu"
            assert not t.is_floating_point() or t.dtype == torch.float32


@pytest.mark.slow
def test_a_sharp_prior_gives_bavardage_back(omniglot, tasks):
    """a0 -> infinity pins every precision at T_vb: the method is then BAVARDAGE (the
    hand-written engine), which locates the declaration's one change."""
    sharp = _fitted(omniglot, a0=1e9).predict_proba(tasks)
    bavardage = make_estimator("bavardage").fit_featureset(omniglot, torch.float64)
    torch.testing.assert_close(sharp, bavardage.predict_proba(tasks), rtol=0, atol=1e-6)
    loose = _fitted(omniglot, a0=1.0).predict_proba(tasks)
    assert (loose - sharp).abs().max() > 1e-3


def test_learns_precisions_and_exports_them(omniglot, tasks):
    est = _fitted(omniglot)
    est.predict_proba(tasks)
    q_tau = est.posterior()["tau"]
    assert q_tau.mean.shape == (len(tasks), 5, 4)  # [T, K, d = K - 1]
    assert bool((q_tau.mean > 0).all()) and q_tau.mean.std() > 0.1  # not the prior's T_vb
    tree = est.to_datatree(n_draws=20, tasks=slice(0, 2))
    assert set(tree.posterior.data_vars) == {"pi", "tau", "mu", "z"}
    assert tree.posterior["tau"].shape == (1, 20, 2, 5, 4)
    again = est.posterior_draws(n_draws=20, tasks=slice(0, 2))
    assert torch.equal(again["tau"], torch.as_tensor(tree.posterior["tau"].values))


def test_refuses_bad_hyperparameters():
    with pytest.raises(ValueError, match="a0"):
        make_estimator("bavardage-gamma", a0=0.0)
    with pytest.raises(ValueError, match="whitening"):
        make_estimator("bavardage-gamma", whitening="none")


def test_global_whitening_and_balanced_run(omniglot, tasks):
    est = _fitted(omniglot, whitening="global", balanced=True)
    probs = est.predict_proba(tasks)
    assert "pi" not in est.state_.q
    assert (probs.argmax(-1) == tasks.query_labels).double().mean() > 0.5


def test_run_blocks_refuses_no_block(omniglot, tasks):
    est = _fitted(omniglot)
    engine, data = est.vb_problem(tasks)
    with pytest.raises(ValueError, match="n_iter"):
        run_blocks(est.declared_model(engine), engine, *data, n_iter=0)
