"""The evidence LS-SVM's inference derived from its Pyro declaration by VMP
(:mod:`probfsl.derived.evidence`) against the hand-written engine (Kim et al., CVPR 2016;
docs/design/evidence.md §3-4): the same lambda, log evidence and labels on built-in
Omniglot episodes, shared and per-class lambda, float32 and float64, and a broken
derived update is caught by the same comparison."""

from __future__ import annotations

import warnings

import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.derived.evidence import (
    DerivedEvidenceEngine,
    derived_evidence,
    profile_log_evidence,
    rotate,
    rotated_spectrum,
)
from probfsl.inference.evidence import (
    _slopes,
    maximize_evidence,
    maximize_shared_evidence,
    spectrum,
)
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


@pytest.mark.parametrize("lambda_mode", ["shared", "per_class"])
def test_derived_equals_handwritten_at_five_shots(omniglot, lambda_mode):
    _assert_same(*_both(omniglot, 5, lambda_mode), rtol=1e-6)


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


def _supports(omniglot, n_tasks: int, shot: int, seed: int = 0):
    fs, base = omniglot
    episodes = sample_episodes(fs, n_tasks, 5, shot, 15, seed=seed)
    x = torch.nn.functional.normalize(episodes.support.to(F64) - base[0].to(F64).mean(0), dim=-1)
    return x, torch.nn.functional.one_hot(episodes.support_labels, 5).to(F64)


@pytest.mark.parametrize("lambda_mode", ["shared", "per_class"])
def test_lambda_is_the_stationary_point_of_the_profile_evidence(omniglot, lambda_mode):
    """Off the clamp, the Newton step of the profile evidence (eq. 17) in log lambda at
    the derived lambda is below 1e-7, and the evidence is nowhere below the hand-written
    engine's (whose stopping rule is on changes of the evidence): a task's for a shared
    lambda, each target's for a per-class one."""
    x, y = _supports(omniglot, 32, 5)
    res = derived_evidence(x, y, lambda_mode)
    rot = rotate(x, y)
    s, proj, lam = rot.s.unsqueeze(-2), rot.proj.mT, res.lam[:, 0]
    if lambda_mode == "per_class":
        s, proj, lam = s.repeat_interleave(5, 0), proj.reshape(-1, 1, proj.shape[-1]), res.lam
    lam = lam.reshape(-1)
    sp_rot = rotated_spectrum(s, proj)
    grad, curv = _slopes(sp_rot, lam.unsqueeze(-1).expand_as(sp_rot.yy), shared=True)
    grad, curv = grad[:, 0], curv[:, 0]
    ratio = lam / s.amax(-1).squeeze(-1)
    inner = (ratio > 1e-9) & (ratio < 1e9)
    assert bool(inner.any())
    assert float((grad / curv).abs()[inner].max()) < 1e-7
    sp = spectrum(x, y)
    hand = (
        maximize_shared_evidence(sp)
        if lambda_mode == "shared"
        else maximize_evidence(sp, warn=False)
    )
    # both end at the stationary point (or the clamp); their evidence formulas differ.
    # A shared lambda maximises the sum over a task's targets; a per-class one each
    # target's own, where a target on the clamp (lambda -> 0: beta near 1e10, the evidence
    # flat in it) is compared at a tolerance its conditioning allows
    f_hand, f_derived = hand.log_evidence, res.log_evidence
    rtol = torch.full_like(f_hand, 1e-10)
    if lambda_mode == "shared":
        f_hand, f_derived, rtol = f_hand.sum(-1), f_derived.sum(-1), rtol[:, 0]
    else:
        rtol = torch.where(res.at_boundary, 1e-8, rtol)
        assert bool((~res.at_boundary).any())
    assert bool((f_derived >= f_hand - rtol * f_hand.abs()).all())


def test_lambda_heading_to_zero_lands_on_the_clamp():
    """Targets along the large-eigenvalue directions (``U^T y ~ s^1.5``, N < D): the
    profile evidence rises to a finite limit as lambda -> 0 (exact interpolation, design
    §3); lambda ends on the clamp ``1e-10 x mean(s)``, flagged at the boundary,
    in both engines (the same Newton finish), with the same evidence."""
    gen = torch.Generator().manual_seed(0)
    t, n, d = 4, 8, 20
    u = torch.linalg.qr(torch.randn(t, n, n, dtype=F64, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(t, d, n, dtype=F64, generator=gen))[0]
    s = torch.linspace(0.5, 4.0, n, dtype=F64).expand(t, n)
    x = u @ torch.diag_embed(s.sqrt()) @ v.mT
    y = u @ torch.stack([s, s**1.5], -1)
    res = derived_evidence(x, y)
    sp = spectrum(x, y)
    hand = maximize_shared_evidence(sp)
    torch.testing.assert_close(res.lam, 1e-10 * sp.mean_s[:, None].expand(t, 2), rtol=1e-12, atol=0)
    torch.testing.assert_close(hand.lam, res.lam, rtol=1e-12, atol=0)
    assert bool(res.at_boundary.all()) and bool(hand.at_boundary.all())
    f_hand, f_derived = hand.log_evidence.sum(-1), res.log_evidence.sum(-1)
    # both end at the stationary point (or the clamp); their evidence formulas differ
    assert bool((f_derived >= f_hand - 1e-10 * f_hand.abs()).all())
    # in closed form, no lambda of a log grid down to the clamp does better
    profile = profile_log_evidence(s.unsqueeze(-2), (u.mT @ y).mT, res.lam[:, :1]).squeeze(-1)
    grid = sp.mean_s[:, None] * torch.logspace(-10, 0, 41, dtype=F64)
    best = profile_log_evidence(s.unsqueeze(-2), (u.mT @ y).mT, grid).amax(-1)
    assert bool((profile >= best).all())


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


def test_a_polish_onto_the_clamp_takes_the_limit_in_both_engines(omniglot):
    """2-way 1-shot tasks whose shared evidence is flat to rounding up to the upper clamp:
    the hand-written engine's polish ends on the clamp, which marks the task for the
    nearest-class-mean limit as the derived engine does (it returned probabilities of
    0.5 ± 2e-10 there, its label decided by rounding)."""
    fs, base = omniglot
    tasks = sample_episodes(fs, 40, way=2, shot=1, n_query=16, seed=21, dtype=F64)
    hand = EvidenceLSSVM(dtype=F64).fit_base(*base)
    derived = EvidenceLSSVM(dtype=F64, engine="derived").fit_base(*base)
    p_hand, p_derived = hand.predict_proba(tasks), derived.predict_proba(tasks)
    assert bool(hand.last_at_limit_[15]) and bool(derived.last_at_limit_[15])
    torch.testing.assert_close(p_hand, p_derived, rtol=1e-8, atol=1e-8)
