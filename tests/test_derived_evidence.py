"""The evidence LS-SVM's inference derived from its Pyro declaration by VMP
(:mod:`probfsl.derived.evidence`) against the hand-written engine (Kim et al., CVPR 2016;
spec ``evidence.md`` §3-4): the same lambda, log evidence and labels on built-in
Omniglot episodes, shared and per-class lambda, float32 and float64, and a broken
derived update is caught by the same comparison."""

from __future__ import annotations

import warnings

import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.derived.evidence import DerivedEvidenceEngine, derived_evidence, rotate
from probfsl.inference.vmp import messages
from probfsl.models.evidence import EvidenceLSSVM

F64 = torch.float64


@pytest.fixture(scope="module")
def omniglot():
    fs = load_dataset("omniglot")
    return fs, fs.base()


def _both(omniglot, shot: int, lambda_mode: str, n_tasks: int = 8, dtype=F64):
    fs, base = omniglot
    episodes = sample_episodes(fs, n_tasks, 5, shot, 15, seed=3)
    out = []
    for engine in ("handwritten", "derived"):
        est = EvidenceLSSVM(lambda_mode=lambda_mode, engine=engine, dtype=dtype).fit_base(*base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            proba = est.predict_proba(episodes)
        out.append((est, proba))
    return out


def _assert_same(hand, derived, rtol=1e-6):
    (h, ph), (d, pd) = hand, derived
    assert torch.equal(pd.argmax(-1), ph.argmax(-1))
    assert torch.equal(d.last_at_limit_, h.last_at_limit_)
    assert torch.equal(d.last_at_boundary_, h.last_at_boundary_)
    inner = ~h.last_at_boundary_
    torch.testing.assert_close(d.last_lambda_[inner], h.last_lambda_[inner], rtol=rtol, atol=0)
    torch.testing.assert_close(
        d.last_log_evidence_.sum(-1), h.last_log_evidence_.sum(-1), rtol=rtol, atol=0
    )


@pytest.mark.parametrize(
    ("lambda_mode", "rtol"),
    # per class, the slowest targets stop within a few 1e-6 of the hand-written lambda
    [("shared", 1e-6), ("per_class", 1e-5)],
)
def test_derived_equals_handwritten_at_five_shots(omniglot, lambda_mode, rtol):
    _assert_same(*_both(omniglot, 5, lambda_mode), rtol=rtol)


def test_one_shot_tasks_take_the_nearest_class_mean_limit(omniglot):
    hand, derived = _both(omniglot, 1, "shared")
    assert bool(derived[0].last_at_limit_.all())
    _assert_same(hand, derived)


def test_the_bound_is_the_declared_models_evidence(omniglot):
    """VMP's bound at the estimates (q(z) exact) equals the closed-form marginal."""
    fs, base = omniglot
    episodes = sample_episodes(fs, 4, 5, 5, 15, seed=1)
    x = torch.nn.functional.normalize(episodes.support.to(F64) - base[0].to(F64).mean(0), dim=-1)
    y = torch.nn.functional.one_hot(episodes.support_labels, 5).to(F64)
    res = derived_evidence(x, y)
    rot = rotate(x, y)
    engine = DerivedEvidenceEngine()  # VMP's factors at the estimated lambda, beta profiled
    state = engine.init(rot.s.sqrt().unsqueeze(-2), rot.proj.mT, rot.scale, res.lam[:, 0])
    torch.testing.assert_close(state.objective, res.log_evidence.sum(-1), rtol=1e-9, atol=0)
    beta = engine.vmp.point_estimates(state.vmp)["beta"].reshape(res.beta.shape)
    torch.testing.assert_close(beta, res.beta, rtol=1e-9, atol=0)


def test_float32_and_float64_inputs_agree(omniglot):
    fs, base = omniglot
    episodes = sample_episodes(fs, 16, 5, 5, 15, seed=3, dtype=F64)
    probas = []
    for dtype in (torch.float32, F64):
        est = EvidenceLSSVM(engine="derived", dtype=dtype).fit_base(*base)
        probas.append(est.predict_proba(episodes))
        assert probas[-1].dtype == F64 and est.last_lambda_.dtype == dtype
    assert torch.equal(probas[0].argmax(-1), probas[1].argmax(-1))
    # float32 rounds the flat evidence: lambda moves, probabilities by up to 1e-2 (measured)
    torch.testing.assert_close(probas[0], probas[1], rtol=0, atol=2e-2)


def test_a_broken_point_update_is_detected(omniglot, monkeypatch):
    exact = messages.point_mode

    def off_by_two_percent(s, eta):
        return exact(s, eta) * 1.02

    monkeypatch.setattr(messages, "point_mode", off_by_two_percent)
    hand, derived = _both(omniglot, 5, "shared", n_tasks=4)
    with pytest.raises(AssertionError):
        _assert_same(hand, derived)


def test_derived_refuses_what_it_does_not_declare(omniglot):
    fs, base = omniglot
    episodes = sample_episodes(fs, 2, 5, 1, 15, seed=0)
    est = EvidenceLSSVM(engine="derived", fit_intercept=True).fit_base(*base)
    with pytest.raises(ValueError, match="fit_intercept"):
        est.predict_proba(episodes)
