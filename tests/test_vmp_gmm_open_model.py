"""vmp-gmm's declared open-set model: the background as one more mixture component.

:func:`vmp_gmm_components_model` takes one prior row per component; with K identical
rows it is :func:`vmp_gmm_model`, and with the background row appended
(``open_model="declared"``) the queries' q(z) ranges over K + 1 components, the last one
"none of these classes". VMP (Winn & Bishop 2005) derives every update of both.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.data.tasks import Episodes
from probfsl.inference.vmp import VMP
from probfsl.methods import build_estimator
from probfsl.models.vmp_gmm import vmp_gmm_components_model, vmp_gmm_model

WAY = 5


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


@pytest.fixture(scope="module")
def declared(omniglot):
    return build_estimator("vmp-gmm", open_model="declared").fit_featureset(omniglot)


def open_tasks(fs, n_tasks: int = 3, shot: int = 1, n_open: int = 10) -> Episodes:
    return sample_episodes(fs, n_tasks, WAY, shot, 10, n_open=n_open, seed=1, dtype=torch.float64)


def test_declared_model_compiles_with_one_more_component(declared, omniglot):
    """The plan has the usual four factors, the component axis K + 1 long."""
    episodes = open_tasks(omniglot)
    data, _ = declared.open_data(episodes)
    text = declared.open_engine(WAY).describe(*data)
    assert "q is the product of 4 factors" in text
    assert f"classes={WAY + 1}" in text
    assert f"pi#e0={WAY + 1}" in text


def test_rows_sum_to_one_over_k_plus_one(declared, omniglot):
    episodes = open_tasks(omniglot)
    proba = declared.predict_proba_open(episodes)
    assert proba.shape == (3, episodes.n_query, WAY + 1)
    assert (proba >= 0).all()
    torch.testing.assert_close(proba.sum(-1), torch.ones_like(proba[..., 0]))
    assert declared.episode_objective_.shape == (3,)


def test_identical_rows_are_the_closed_model(omniglot):
    """The estimator's K class rows (:meth:`component_priors`) in the per-component model
    give the posterior and bound of :func:`vmp_gmm_model` to rounding (same start, sweeps)."""
    est = build_estimator("vmp-gmm", max_iter=15).fit_featureset(omniglot)
    episodes = sample_episodes(omniglot, 2, WAY, 1, 10, seed=2, dtype=torch.float64)
    x, labels, observed = est.engine_data(episodes)
    engine = est.engine(WAY, episodes.support.shape[1])
    start = engine.init(x, labels, observed).q["z"][0]
    closed = engine.model  # vmp_gmm_model with the estimator's priors
    assert closed.func is vmp_gmm_model
    rows = est.component_priors(WAY)
    assert all(p.shape[0] == WAY for p in rows)
    runs = []
    for model in (closed, partial(vmp_gmm_components_model, priors=rows)):
        vmp = VMP(model, max_iter=15, tol=0.0, warn=False)
        state, info = vmp.fit(x, labels, observed, init_resp={"z": start})
        runs.append((state.q["z"][0], info.trace))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=1e-10, rtol=0)
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-8, rtol=1e-12)


def test_tiny_background_weight_reproduces_the_closed_model(omniglot):
    """Without open queries, with a background weight near zero (π_K's concentration
    K α_0 p / (1 - p), p = 1e-8) and the closed model's start with no background mass,
    the K known columns are the closed model's predictions (``predict_proba``): E ln π_K
    = ψ(K α_0 p / (1 - p)) - ψ(Σ α) is then about -1e7, so q(z = K) stays at zero."""
    est = build_estimator("vmp-gmm", open_model="declared", open_prior=1e-8)
    est.fit_featureset(omniglot)
    episodes = sample_episodes(omniglot, 3, WAY, 1, 15, seed=3, dtype=torch.float64)
    x, labels, observed = est.engine_data(episodes)
    n_s = episodes.support.shape[1]
    closed_start = est.engine(WAY, n_s).init(x, labels, observed).q["z"][0]
    open_start = torch.cat([closed_start, torch.zeros_like(closed_start[..., :1])], -1)
    state, _ = est.open_engine(WAY).fit(x, labels, observed, init_resp={"z": open_start})
    with_bg = state.q["z"][0][:, n_s:]
    assert with_bg[..., -1].max() < 1e-6
    closed = est.predict_proba(episodes)
    torch.testing.assert_close(with_bg[..., :WAY], closed, atol=1e-6, rtol=0)
    assert torch.equal(with_bg[..., :WAY].argmax(-1), closed.argmax(-1))


def test_batched_equals_one_at_a_time(declared, omniglot):
    episodes = open_tasks(omniglot)
    batched = declared.predict_proba_open(episodes)
    single = torch.cat([declared.predict_proba_open(episodes[t]) for t in range(3)])
    torch.testing.assert_close(batched, single, atol=1e-8, rtol=1e-6)


def test_float32_close_to_float64(declared, omniglot):
    episodes = open_tasks(omniglot, shot=5)
    p64 = declared.predict_proba_open(episodes)
    p32 = declared.predict_proba_open(episodes.to(dtype=torch.float32))
    assert p32.dtype == torch.float32
    assert (p32.double() - p64).abs().mean() < 1e-3
    agree = (p32.argmax(-1) == p64.argmax(-1)).double().mean()
    assert agree > 0.97


def test_bound_is_monotone(declared, omniglot):
    """Coordinate ascent on the declared model never lowers its ELBO (float64)."""
    episodes = open_tasks(omniglot, n_tasks=4, shot=5)
    data, start = declared.open_data(episodes)
    vmp = VMP(
        partial(vmp_gmm_components_model, priors=declared.open_priors(WAY)),
        max_iter=40,
        tol=0.0,
        warn=False,
    )
    _, info = vmp.fit(*data, init_resp=start)
    steps = info.trace.diff(dim=0)
    assert (steps >= -1e-9 * info.trace[1:].abs()).all(), steps.min()


def test_open_queries_score_higher(declared):
    """On Gaussian classes far from the known ones, the background column separates the
    open queries from the closed ones."""
    from tests.test_open_set_posterior import synthetic_open_tasks

    base, base_labels, with_open, closed = synthetic_open_tasks()
    est = build_estimator("vmp-gmm", open_model="declared").fit_base(base, base_labels)
    score = est.predict_proba_open(with_open)[..., -1]
    n_closed = closed.n_query
    assert score[:, n_closed:].mean() > score[:, :n_closed].mean() + 0.3


def test_natural_parameters_give_q_z(declared, omniglot):
    """``VMP.natural`` of the label after a fit: z is updated last in every sweep, so the
    softmax of its natural parameters is the queries' q(z) as the fit left it."""
    episodes = open_tasks(omniglot, shot=5)
    data, start = declared.open_data(episodes)
    engine = declared.open_engine(WAY)
    state, _ = engine.fit(*data, init_resp=start)
    n_s = episodes.support.shape[1]
    eta = engine.natural(state, "z")[0]
    torch.testing.assert_close(eta[:, n_s:].softmax(-1), state.q["z"][0][:, n_s:])
    with pytest.raises(ValueError, match="not a latent site"):
        engine.natural(state, "x")


def test_declared_log_odds_are_exact_beyond_single_precision():
    """The log-odds of P(open) come from q(z)'s natural parameters, not from its
    probabilities: with open classes far from the known ones in 256 dimensions they run
    to hundreds of nats, where a float32 probability stops near ±87, and float32 gives
    float64's; every query keeps its shares among the known classes."""
    from tests.test_open_set_posterior import synthetic_open_tasks

    base, base_labels, with_open, _ = synthetic_open_tasks(n_tasks=4, dim=256, noise=0.3)
    runs = []
    for dtype in (torch.float64, torch.float32):
        est = build_estimator("vmp-gmm", open_model="declared")
        est.fit_base(base.to(dtype), base_labels)
        runs.append(est.inferred_open(with_open.to(dtype=dtype)))
    (known64, odds64), (known32, odds32) = runs
    assert odds64.abs().max() > 200
    torch.testing.assert_close(odds32.double(), odds64, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(known32.sum(-1), torch.ones_like(known32[..., 0]))
    assert torch.equal(known32.argmax(-1), known64.argmax(-1))


def test_full_precision_log_odds_are_the_inductive_readings_beyond_single_precision():
    """``precision="full"`` takes the inductive reading's log-odds as computed, not off its
    probabilities: in float32 most of these far-apart queries lie beyond the ±87 that a
    float32 probability can hold, and in float64 their σ is the reading's P(open)."""
    from probfsl.data.preprocess import center_and_normalize
    from tests.test_open_set_posterior import synthetic_open_tasks

    base, base_labels, with_open, _ = synthetic_open_tasks(n_tasks=4, dim=64, noise=0.3)
    est32 = build_estimator("vmp-gmm", precision="full").fit_base(base.float(), base_labels)
    known, odds = est32.inferred_open(with_open.to(dtype=torch.float32))
    assert (odds.abs() > 100).float().mean() > 0.5
    torch.testing.assert_close(known.sum(-1), torch.ones_like(odds))
    est = build_estimator("vmp-gmm", precision="full").fit_base(base, base_labels)
    _, odds64 = est.inferred_open(with_open)
    support = center_and_normalize(with_open.support, est.base_mean_)
    query = center_and_normalize(with_open.query, est.base_mean_)
    proba = est.inductive_open(with_open, est.predict_proba(with_open), support, query, False)
    torch.testing.assert_close(torch.sigmoid(odds64), proba[..., -1])


def test_declared_needs_base_classes(omniglot):
    est = build_estimator("vmp-gmm", open_model="declared")
    with pytest.raises(ValueError, match="base"):
        est.predict_proba_open(open_tasks(omniglot, 1))


def test_open_model_is_checked():
    with pytest.raises(ValueError, match="open_model"):
        build_estimator("vmp-gmm", open_model="mixture")
    with pytest.raises(ValueError, match="background_weight"):
        build_estimator("vmp-gmm", background_weight=0.0)


def test_declared_engine_passes_conformance(declared, omniglot):
    """The derived engine of the declared model passes the engine checks: Pyro's ELBO of
    the derived guide matches the analytic bound, the bound is monotone, a batch equals
    its tasks alone, float32 agrees with float64, and the sweeps never synchronise with
    the host."""
    from probfsl.testing import ConformanceCase, check_engine

    episodes = open_tasks(omniglot, n_tasks=3, shot=1, n_open=5)
    data, _ = declared.open_data(episodes)
    engine = declared.open_engine(WAY)
    case = ConformanceCase(
        make_engine=lambda: declared.open_engine(WAY),
        model=engine.model,
        data=data,
        n_steps=10,
        particles=200,
        rtol_float32=1e-3,
    )
    check_engine(case)
