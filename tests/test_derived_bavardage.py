"""BAVARDAGE with ``engine="derived"``: the VB updates derived by VMP from
``bavardage_model`` against the hand-written engine, in every configuration of the
estimator."""

from __future__ import annotations

import pytest
import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes
from probfsl.derived import bavardage as derived
from probfsl.inference.vmp import normal


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


def _tasks(fs, shot=1, n=6, seed=0):
    return sample_episodes(fs, n, way=5, shot=shot, n_query=30, seed=seed)


def _both(fs, tasks, dtype=torch.float64, **params):
    out = {}
    for engine in ("handwritten", "derived"):
        est = make_estimator("bavardage", engine=engine, trace_elbo=True, **params)
        est.fit_featureset(fs, dtype)
        probs = est.predict_proba(tasks.to(dtype=dtype))
        out[engine] = (probs, est.elbo_trace_, est.state_)
    return out


CONFIGS = [
    {},
    {"whitening": "global"},
    {"mode": "vb"},
    {"balanced": True},
    {"count_support": True, "n_vb": 3},
]


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: ",".join(p) or "default")
def test_derived_equals_handwritten(omniglot, params):
    """Query probabilities, every ELBO of the trace and the factors agree to rounding."""
    out = _both(omniglot, _tasks(omniglot), **params)
    (p_h, trace_h, s_h), (p_d, trace_d, s_d) = out["handwritten"], out["derived"]
    torch.testing.assert_close(p_d, p_h, rtol=0, atol=1e-9)
    assert trace_d.shape == trace_h.shape
    torch.testing.assert_close(trace_d, trace_h, rtol=1e-10, atol=1e-8)
    torch.testing.assert_close(s_d.mean, s_h.mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s_d.beta, s_h.beta)
    torch.testing.assert_close(s_d.u, s_h.u)
    if params.get("balanced"):
        assert s_d.alpha is None and s_h.alpha is None
    else:
        torch.testing.assert_close(s_d.alpha, s_h.alpha)


def test_derived_float32_follows_float64(omniglot):
    tasks = _tasks(omniglot, shot=5)
    p64 = _both(omniglot, tasks)["derived"][0]
    est = make_estimator("bavardage", engine="derived").fit_featureset(omniglot, torch.float32)
    p32 = est.predict_proba(tasks.to(dtype=torch.float32))
    assert p32.dtype == torch.float32
    # float32 rounding through the whitening and the projection: about 3e-4 at most
    torch.testing.assert_close(p32.double(), p64, rtol=0, atol=2e-3)
    assert torch.equal(p32.argmax(-1), p64.argmax(-1))


def test_derived_diagnostics_read_the_same_state(omniglot):
    """ArviZ draws come from the derived factors as they do from the hand-written ones."""
    est = make_estimator("bavardage", engine="derived").fit_featureset(omniglot, torch.float64)
    est.predict_proba(_tasks(omniglot).to(dtype=torch.float64))
    tree = est.to_datatree(n_draws=20, tasks=slice(0, 2))
    assert "mu" in tree.posterior


def test_a_broken_derived_update_is_caught(omniglot, monkeypatch):
    """The comparison is sharp: halving the mixture's messages to the class means (a wrong
    M step) moves the derived answer off the hand-written one."""
    tasks = _tasks(omniglot)
    good = _both(omniglot, tasks)["handwritten"]
    weighted = normal._weighted_message

    def broken(*args, **kwargs):
        return [0.5 * m for m in weighted(*args, **kwargs)]

    monkeypatch.setattr(normal, "_weighted_message", broken)
    est = make_estimator("bavardage", engine="derived", trace_elbo=True)
    est.fit_featureset(omniglot, torch.float64)
    probs = est.predict_proba(tasks.to(dtype=torch.float64))
    assert (probs - good[0]).abs().max() > 1e-3
    assert (est.elbo_trace_ - good[1]).abs().max() > 1e-3


def test_derived_refuses_what_the_loop_refuses(omniglot):
    engine, data = make_estimator("bavardage").fit_featureset(omniglot).vb_problem(_tasks(omniglot))
    with pytest.raises(ValueError, match="n_iter"):
        derived.fit(engine, *data, n_iter=0)
