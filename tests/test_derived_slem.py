"""SLEM with ``engine="derived"``: the MAP of its Gaussian linear model by the updates VMP
derives (``probfsl.derived.slem``) against the closed forms of ``probfsl.inference.woodbury``."""

from __future__ import annotations

import pytest
import torch

from probfsl.derived import slem as derived
from probfsl.inference.vmp import moments
from probfsl.inference.woodbury import factor_negatives, lda_scores, slem_woodbury
from probfsl.models.slem import SLEM


def _problem(dtype=torch.float64, t=3, k=4, d=12, n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    negatives = (0.3 * torch.randn(n, d, generator=g) + 0.2).to(dtype)
    means = (0.5 * torch.randn(t, k, d, generator=g)).to(dtype)
    query = (0.5 * torch.randn(t, 7, d, generator=g)).to(dtype)
    return negatives, means, query


@pytest.mark.parametrize("lam", [0.02, 0.5])
def test_map_equals_the_woodbury_closed_form(lam):
    """(ω*, ν*) of every exemplar equal SLEM's closed form (docs/design/slem.md §3) to 1e-10."""
    negatives, means, _ = _problem()
    lam_t = torch.tensor(lam, dtype=torch.float64)
    omega, nu = derived.exemplar_weights(means, negatives, lam_t, theta=2.0)
    ref_omega, ref_nu = slem_woodbury(means.reshape(-1, 12), factor_negatives(negatives, lam), 2.0)
    torch.testing.assert_close(omega.reshape(-1, 12), ref_omega, rtol=0, atol=1e-10)
    torch.testing.assert_close(nu.reshape(-1), ref_nu, rtol=0, atol=1e-10)


def test_scores_equal_the_lda_scores():
    negatives, means, query = _problem()
    lam = torch.tensor(0.1, dtype=torch.float64)
    ours = derived.map_lda_scores(query, means, negatives, lam)
    ref = lda_scores(query, means, factor_negatives(negatives, lam))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-8)


def test_estimator_engines_agree(monkeypatch):
    """The few-shot estimator gives the same probabilities with either engine."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(200, 10, generator=g, dtype=torch.float64)
    labels = torch.arange(200) % 8
    support = torch.randn(2, 6, 10, generator=g, dtype=torch.float64)
    support_labels = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    query = torch.randn(2, 9, 10, generator=g, dtype=torch.float64)
    probs = {}
    for engine in ("handwritten", "derived"):
        est = SLEM(rel_lam=0.5, engine=engine).fit_base(base, labels)
        probs[engine] = est.fit_predict(support, support_labels, query)
    torch.testing.assert_close(probs["derived"], probs["handwritten"], rtol=0, atol=1e-9)
    # tasks taken one at a time (a memory budget of one task) give the same answer
    monkeypatch.setattr(derived, "DERIVED_MEMORY", 1)
    est = SLEM(rel_lam=0.5, engine="derived").fit_base(base, labels)
    one_by_one = est.fit_predict(support, support_labels, query)
    torch.testing.assert_close(one_by_one, probs["derived"], rtol=0, atol=1e-12)


def test_float32_follows_float64():
    negatives, means, query = _problem()
    lam = torch.tensor(0.1, dtype=torch.float64)
    s64 = derived.map_lda_scores(query, means, negatives, lam)
    s32 = derived.map_lda_scores(query.float(), means.float(), negatives.float(), lam.float())
    assert s32.dtype == torch.float32
    torch.testing.assert_close(s32.double(), s64, rtol=1e-4, atol=1e-4)


def test_needs_the_negatives():
    base, labels = torch.randn(50, 4, dtype=torch.float64), torch.arange(50) % 5
    est = SLEM().fit_base(base, labels).set_params(engine="derived")
    with pytest.raises(ValueError, match="negatives"):
        est.fit_predict(base[:4][None], torch.tensor([[0, 1, 0, 1]]), base[4:9][None])


def test_a_broken_intercept_update_is_caught(monkeypatch):
    """A wrong point update of ν (off by 5%) moves the derived weights off the closed form."""
    negatives, means, _ = _problem()
    mode = moments.point_mode
    monkeypatch.setattr(moments, "point_mode", lambda s, eta: 1.05 * mode(s, eta))
    import probfsl.inference.vmp.messages as messages

    monkeypatch.setattr(messages, "point_mode", lambda s, eta: 1.05 * mode(s, eta))
    lam = torch.tensor(0.1, dtype=torch.float64)
    omega, _ = derived.exemplar_weights(means, negatives, lam)
    ref, _ = slem_woodbury(means.reshape(-1, 12), factor_negatives(negatives, lam), 1.0)
    assert (omega.reshape(-1, 12) - ref).abs().max() > 1e-4


def test_a_one_line_variation_runs_through_the_language():
    """SLEM's declaration with the ridge λ given a Gamma hyperprior (one line changed)
    runs through VMP as it is; as the hyperprior concentrates on λ the MAP weights come
    back to SLEM's closed form."""
    import math

    import pyro
    import pyro.distributions as dist

    from probfsl.inference import VMP

    def model(means, negatives, lam, theta=1.0, shape=1e8):
        t, k, d = means.shape
        n = negatives.shape[0]
        with pyro.plate("tasks", t, dim=-2), pyro.plate("classes", k, dim=-1):
            nu = pyro.param("nu", means.new_zeros(t, k))
            # the changed line: λ ~ Gamma(shape, shape / λ), mean λ, instead of λ fixed
            prec = pyro.sample("lam", dist.Gamma(means.new_tensor(shape), shape / lam))
            zeros = means.new_zeros(d)
            omega = pyro.sample("omega", dist.Normal(zeros, prec.rsqrt()[..., None]).to_event(1))
            positive = (omega * means).sum(-1) + nu
            pyro.sample("positive", dist.Normal(positive, theta**-0.5), obs=means.new_ones(t, k))
            scores = omega @ negatives.mT + nu.unsqueeze(-1)
            pyro.sample(
                "negatives",
                dist.Normal(scores, math.sqrt(n)).to_event(1),
                obs=-scores.new_ones(()),
            )

    negatives, means, _ = _problem()
    lam = torch.tensor(0.3, dtype=torch.float64)
    vmp = VMP(model, max_iter=500, tol=1e-14)
    state, _ = vmp.fit(means, negatives, lam)
    ref, _ = slem_woodbury(means.reshape(-1, 12), factor_negatives(negatives, lam), 1.0)
    torch.testing.assert_close(state.q["omega"][0].reshape(-1, 12), ref, rtol=0, atol=1e-5)
    loose, _ = VMP(model, max_iter=500, tol=1e-14).fit(means, negatives, lam, shape=2.0)
    assert (loose.q["omega"][0].reshape(-1, 12) - ref).abs().max() > 1e-3
