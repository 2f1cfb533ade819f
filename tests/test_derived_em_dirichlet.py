"""EM-Dirichlet's engine derived by VMP from its declaration (``engine="derived"``)
against the hand-written one (Martin et al., CVPR 2024; docs/design/em-dirichlet.md):
the same labels, objective trace (J, design §3.5) and concentrations, few-shot and
zero-shot; the shared conformance checks (Pyro's ELBO with the tempered class prior,
monotone bound, batch and dtype agreement, devices, no host synchronisation); and a
broken update caught."""

from __future__ import annotations

import functools

import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.derived import em_dirichlet as derived
from probfsl.inference.dirichlet_mm import BOUNDED_MM, EMDirichletEngine
from probfsl.inference.vmp import messages, moments
from probfsl.models.em_dirichlet import EMDirichlet
from probfsl.testing import ConformanceCase, assert_monotone, check_engine

F64 = torch.float64
#: a short inner loop (the reference one runs 1000 iterations): the engines must agree
#: whatever the loop, and the tests stay fast
SHORT = {"mm_max_iter": 60, "mm_tol": 1e-11, "mm_check_every": 10}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these batches are tiny, and on a busy machine OpenMP threads
    waiting for each other cost more than the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mixture(t=5, n_query=24, k=10, present=3, shot=1, seed=0, dtype=F64):
    """Synthetic tasks (design §6.8): K classes, ``present`` of them in each task's queries,
    alpha_kk = 8 and 0.5 elsewhere; ``shot`` support rows per class."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.full((k, k), 0.5, dtype=F64) + 7.5 * torch.eye(k, dtype=F64)
    classes = torch.stack([torch.randperm(k, generator=g)[:present] for _ in range(t)])
    pick = torch.randint(0, present, (t, n_query), generator=g)
    query_labels = classes.gather(1, pick)
    support_labels = torch.arange(k).repeat_interleave(shot).expand(t, -1).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        query = dist.Dirichlet(alpha[query_labels]).sample().clamp_min(1e-12)
        support = dist.Dirichlet(alpha[support_labels]).sample().clamp_min(1e-12)
    query = query / query.sum(-1, keepdim=True)
    support = support / support.sum(-1, keepdim=True)
    return query.to(dtype), support.to(dtype), support_labels, query_labels


def both(zero_shot: bool, dtype=F64, **params):
    """Labels, trace and state of the two engines on the same tasks."""
    query, support, labels, _ = mixture(dtype=dtype)
    out = {}
    for engine in ("handwritten", "derived"):
        est = EMDirichlet(engine=engine, **params)
        if zero_shot:
            labels_ = est.predict_zero_shot(query)
        else:
            labels_ = est.fit_probabilities(query, support, labels).query_r.argmax(-1)
        out[engine] = (labels_, est.trace_, est.state_)
    return out


@pytest.mark.parametrize("zero_shot", [False, True], ids=["few-shot", "zero-shot"])
@pytest.mark.parametrize("lambda_coef", [None, 1.0, 0.0], ids=["default", "em", "no-prior"])
def test_derived_engine_takes_the_hand_written_steps(zero_shot, lambda_coef):
    out = both(zero_shot, lambda_coef=lambda_coef, n_iter=8, **SHORT)
    (lh, th, sh), (ld, td, sd) = out["handwritten"], out["derived"]
    assert torch.equal(lh, ld)
    assert td.shape == th.shape == (9, 5)
    torch.testing.assert_close(td, th, rtol=1e-10, atol=1e-8)
    torch.testing.assert_close(sd.alpha, sh.alpha, rtol=1e-8, atol=0)
    torch.testing.assert_close(sd.pi, sh.pi, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(sd.r, sh.r, rtol=1e-7, atol=1e-10)
    assert torch.equal(sd.mm_iters, sh.mm_iters)
    torch.testing.assert_close(sd.objective, th[-1], rtol=1e-10, atol=1e-8)


def test_the_tolerance_stops_the_same_tasks_at_the_same_step():
    out = both(True, n_iter=12, tol=1e-3, **SHORT)
    (lh, th, sh), (ld, td, sd) = out["handwritten"], out["derived"]
    assert torch.equal(lh, ld)
    frozen = th[-1] == th[-2]
    assert bool(frozen.any()) and not bool(frozen.all())  # some tasks stopped early
    assert torch.equal(td[-1] == td[-2], frozen)
    torch.testing.assert_close(td, th, rtol=1e-10, atol=1e-8)
    assert torch.equal(sd.mm_iters, sh.mm_iters)


@pytest.mark.slow
def test_estimator_defaults_agree_on_builtin_wordnet():
    """The estimator's few-shot path (embeddings -> probabilities) with its default
    inner loop (the reference code's 1000 iterations), on two WordNet episodes."""
    from probfsl.data.builtin import load_dataset
    from probfsl.data.tasks import sample_episodes

    fs = load_dataset("wordnet")
    episodes = sample_episodes(fs, 2, 5, 2, 15, seed=0, dtype=F64)
    out = {}
    for engine in ("handwritten", "derived"):
        est = EMDirichlet(engine=engine, n_iter=2).fit_base(*fs.base(dtype=F64))
        out[engine] = (est.predict_proba(episodes), est.trace_)
    torch.testing.assert_close(out["derived"][0], out["handwritten"][0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(out["derived"][1], out["handwritten"][1], rtol=1e-10, atol=0)


def test_float32_follows_the_input_and_agrees_with_float64():
    out64 = both(False, n_iter=6, **SHORT)["derived"]
    out32 = both(False, dtype=torch.float32, n_iter=6, **SHORT)["derived"]
    assert out32[1].dtype == out32[2].alpha.dtype == out32[2].r.dtype == torch.float32
    assert (out32[0] == out64[0]).double().mean() >= 0.99
    torch.testing.assert_close(out32[1].double(), out64[1], rtol=1e-4, atol=0)


def test_hard_variant_and_bad_inputs_are_refused():
    query, support, labels, _ = mixture(t=2)
    with pytest.raises(ValueError, match="soft EM-Dirichlet only"):
        EMDirichlet(engine="derived", hard=True).fit_probabilities(query)
    with pytest.raises(ValueError, match="together"):
        EMDirichlet(engine="derived").fit_probabilities(query, support)


def _case(data=None, steps=6) -> ConformanceCase:
    query, support, labels, _ = mixture(t=3, n_query=12, k=5) if data is None else data
    return ConformanceCase(
        make_engine=lambda: derived.EMDirichletVMP(
            derived.AlphaStep(EMDirichletEngine(**BOUNDED_MM)), lambda_coef=2.0
        ),
        model=functools.partial(derived.em_dirichlet_model, lambda_coef=2.0),
        data=(query, support, labels),
        n_steps=steps,
        particles=200,
    )


def test_derived_engine_passes_conformance():
    """Pyro's Trace_ELBO of the declaration (with its tempered prior) equals -J; the bound
    rises; batches, dtypes and devices; no host synchronisation in a step."""
    check_engine(_case())


def test_a_broken_alpha_step_is_caught(monkeypatch):
    """An alpha step that overshoots the MM update lowers the bound: caught by the
    monotone check and by the comparison with the hand-written engine."""
    step = derived.AlphaStep.__call__

    def overshoot(self, alpha, *args, **kwargs):
        return alpha + 3.0 * (step(self, alpha, *args, **kwargs) - alpha)

    monkeypatch.setattr(derived.AlphaStep, "__call__", overshoot)
    with pytest.raises(AssertionError, match="wrong way"):
        assert_monotone(_case())
    out = both(False, n_iter=4, **SHORT)
    assert not torch.allclose(out["derived"][1], out["handwritten"][1], rtol=1e-6)


def test_a_broken_proportion_update_is_caught(monkeypatch):
    """Proportions left uniform (not the maximiser mean_Q r): the derived trace parts from
    the hand-written one."""
    mode = moments.point_mode

    def uniform(s, eta):
        value = mode(s, eta)
        return torch.full_like(value, 1.0 / value.shape[-1]) if s.family == "Dirichlet" else value

    monkeypatch.setattr(messages, "point_mode", uniform)
    out = both(False, n_iter=4, **SHORT)
    assert not torch.allclose(out["derived"][1], out["handwritten"][1], rtol=1e-6)


def test_a_scale_outside_a_latent_categorical_is_refused():
    """``poutine.scale`` tempers a latent Categorical's prior only (the class prior here)."""
    from probfsl.inference import VMP

    def scaled_likelihood(query):
        with pyro.poutine.scale(scale=2.0):
            derived.em_dirichlet_model(query)

    query = mixture(t=2, n_query=6)[0]
    with pytest.raises(ValueError, match="site 'alpha'.*poutine.scale is supported only"):
        VMP(scaled_likelihood).fit(query)
