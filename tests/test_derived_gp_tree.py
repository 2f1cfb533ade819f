"""GP-Tree's VI nodes with ``engine="derived"``: q(f̄) and the Pólya-Gamma factors derived
by VMP from the node's declaration (:mod:`probfsl.derived.gp_tree`) equal the hand-written
:class:`~probfsl.inference.gp_tree_nodes.VINodes` (Achituve et al., ICML 2021, §3.3; design:
docs/design/gp-tree.md §3.3), and the estimator's labels are unchanged."""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.derived import gp_tree
from probfsl.derived.gp_tree import DerivedVINodes
from probfsl.inference import VMP
from probfsl.inference import gp_tree_nodes as gpn
from probfsl.inference.base import run
from probfsl.inference.vmp import at_prior
from probfsl.models.gp_tree import GPTree, GPTreeFewShot, gp_tree_model
from probfsl.testing import ConformanceCase, assert_monotone, assert_no_host_syncs

warnings.filterwarnings("ignore", message=".*torch.jit.*")

D64 = torch.float64


def _nodes(V=3, n=9, M=4, D=3, seed=0, dtype=D64):
    """A batch of V nodes, one padded in its points and one in its inducing points."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, n, D, generator=g, dtype=dtype)
    y = (x[..., 0] + 0.3 * torch.randn(V, n, generator=g, dtype=dtype) > 0).to(dtype)
    mask = torch.ones(V, n, dtype=torch.bool)
    mask[1, 6:] = False
    z = torch.randn(V, M, D, generator=g, dtype=dtype)
    zmask = torch.ones(V, M, dtype=torch.bool)
    zmask[2, 2:] = False
    s = torch.tensor([4.0, 16.0, 128.0], dtype=dtype)[:V]
    ls = torch.full((V,), 1.0, dtype=dtype)
    return x, y, mask, z, zmask, s, ls


def _fit(engine: gpn.VINodes, data: tuple, n_steps: int = 6) -> gpn.VIState:
    return run(engine, engine.init(*data), n_steps)[0]


def _gap(a: gpn.VIState, b: gpn.VIState) -> float:
    """The largest difference of the two states' q(f̄) means and covariances and of their
    Pólya-Gamma tilts on real points."""
    (mu_a, s_a, _), (mu_b, s_b, _) = a.moments, b.moments
    dc = (a.c - b.c) * a.terms.mask
    return max(
        float((mu_a - mu_b).abs().max()), float((s_a - s_b).abs().max()), float(dc.abs().max())
    )


@pytest.mark.parametrize("natural_lr", [1.0, 0.4])
def test_derived_nodes_equal_the_hand_written_ones(natural_lr):
    """μ̃, Σ̃ and c after every step equal VINodes' to 1e-8 (float64), padding included;
    the derived bound is the paper's at the new q(f̄) with c re-optimised (§3.3)."""
    data = _nodes()
    hand, derived = gpn.VINodes(natural_lr=natural_lr), DerivedVINodes(natural_lr=natural_lr)
    a, b = hand.init(*data), derived.init(*data)
    for _ in range(5):
        a, b = hand.step(a)[0], derived.step(b)[0]
        assert _gap(a, b) < 1e-8
        mu, sigma, _ = b.moments
        best = gpn.vi_elbo(b.terms, mu, sigma, hand.update_c(b.terms, mu, sigma))
        torch.testing.assert_close(b.objective, best, rtol=1e-10, atol=1e-10)
        assert bool((b.objective >= a.objective - 1e-10).all())  # c re-optimised: tighter


def test_a_sweep_raises_the_bound_without_host_synchronisation():
    """The engine contract: a monotone bound; a step on compiled kernel terms (one VMP
    sweep) makes no host synchronisation."""
    case = ConformanceCase(
        make_engine=DerivedVINodes, model=gp_tree_model, data=_nodes(), n_steps=6, step_syncs=0
    )
    assert_monotone(case)
    assert_no_host_syncs(case)


def test_estimator_labels_and_posteriors_are_unchanged():
    """GPTree(inference="vi"): the same base-node posteriors (kernel and X̄ gradient steps
    included), the same probabilities and labels with either engine."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 5)) * 2.5
    X = np.concatenate([c + rng.normal(size=(6, 5)) for c in centres])
    y = np.repeat(np.arange(4), 6)
    Xt = np.concatenate([c + rng.normal(size=(3, 5)) for c in centres])
    kw = dict(inference="vi", vi_iter=2, n_inducing=2, kmeans_n_init=2)
    hand = GPTree(**kw).fit(X, y)
    derived = GPTree(engine="derived", **kw).fit(X, y)
    for ga, gb in zip(hand.base_groups_, derived.base_groups_, strict=True):
        assert isinstance(gb.engine, DerivedVINodes) and ga.node_ids == gb.node_ids
        assert _gap(ga.state, gb.state) < 1e-8
    torch.testing.assert_close(derived.inducing_, hand.inducing_, rtol=0, atol=1e-8)
    Xt = torch.as_tensor(Xt, dtype=D64)
    torch.testing.assert_close(derived.predict_proba(Xt), hand.predict_proba(Xt), rtol=0, atol=1e-8)
    assert torch.equal(derived.predict(Xt), hand.predict(Xt))


def test_float32_agrees_with_float64():
    """The derived nodes in float32 follow the float64 ones (and the float32 hand-written)."""
    data = _nodes()
    d32 = tuple(t.float() if t.is_floating_point() else t for t in data)
    s64, s32 = _fit(DerivedVINodes(), data), _fit(DerivedVINodes(), d32)
    h32 = _fit(gpn.VINodes(), d32)
    assert s32.eta.dtype == torch.float32 and s32.objective.dtype == torch.float32
    for a, b in zip(s32.moments[:2], s64.moments[:2], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s32.objective.double(), s64.objective, rtol=1e-5, atol=1e-5)
    assert _gap(s32, h32) < 1e-5


def test_dropping_the_conditional_variance_is_caught(monkeypatch):
    """Broken declarations: without K̃ in the Pólya-Gamma tilt, or with a mean-field factor
    per ε_i instead of q(f | u) = p(f | u), the posteriors leave VINodes' by far more
    than the 1e-8 the exact derivation meets."""
    data = _nodes()
    exact = _fit(gpn.VINodes(), data)
    node_data = gp_tree.node_data

    def no_ktilde(data, t):
        y, mask, A, ktilde, tril = node_data(data, t)
        return y, mask, A, torch.full_like(ktilde, 1e-12), tril

    with monkeypatch.context() as m:
        m.setattr(gp_tree, "node_data", no_ktilde)
        assert _gap(_fit(DerivedVINodes(), data), exact) > 1e-3
    with monkeypatch.context() as m:
        m.setattr(at_prior, "marked", lambda node: False)  # ε updated from its child
        assert _gap(_fit(DerivedVINodes(), data), exact) > 1e-3


def test_engine_choices_are_checked():
    X = np.random.default_rng(0).normal(size=(12, 3))
    y = np.repeat(np.arange(3), 4)
    with pytest.raises(ValueError, match="engine='derived' needs inference='vi'"):
        GPTree(inference="gibbs", engine="derived").fit(X, y)
    with pytest.raises(ValueError, match="engine must be one of"):
        GPTree(engine="vmp").fit(X, y)
    GPTreeFewShot(engine="derived", center=False)._check_params()
    with pytest.raises(ValueError, match="engine must be one of"):
        GPTreeFewShot(engine="vmp")._check_params()
    GPTreeFewShot(center=False)._check_params()


def _prior_on_an_observed_site(x):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        m = pyro.sample("m", dist.Normal(x.new_zeros(()), 1.0))
        pyro.sample("x", dist.Normal(m, 1.0), obs=x, infer={"q": "prior"})


def _prior_with_a_latent_parent(x):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        m = pyro.sample("m", dist.Normal(x.new_zeros(()), 1.0))
        e = pyro.sample("e", dist.Normal(m, 1.0), infer={"q": "prior"})
        pyro.sample("x", dist.Normal(e, 1.0), obs=x)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (_prior_on_an_observed_site, "only a latent site"),
        (_prior_with_a_latent_parent, "needs fixed parameters"),
    ],
)
def test_a_site_kept_at_its_prior_is_refused_outside_its_vocabulary(model, why):
    with pytest.raises(ValueError, match=why):
        VMP(model).init(torch.randn(3, dtype=D64))


def _jaakkola_jordan(k: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, sweeps: int = 300):
    """Mean-field Pólya-Gamma (Jaakkola–Jordan) GP classification written out, one node
    at a time: c² = S_ii + m_i², S = (K⁻¹ + Θ)⁻¹, m = S κ, Θ = diag(tanh(c/2)/(2c))."""
    out = []
    for kv, yv, mv in zip(k, y, mask, strict=True):
        kappa = (yv - 0.5) * mv
        c = torch.ones_like(yv)
        kinv = torch.linalg.inv(kv)
        for _ in range(sweeps):
            theta = torch.tanh(c / 2) / (2 * c) * mv
            cov = torch.linalg.inv(kinv + torch.diag(theta))
            m = cov @ kappa
            c = (cov.diagonal() + m**2).sqrt()
        out.append((m, cov))
    return out


def test_few_shot_nodes_are_the_jaakkola_jordan_posterior():
    """engine="derived" of the few-shot estimator: each node's q(f) is the mean-field
    Pólya-Gamma posterior of the exact-kernel node (design §3.2), here against the
    fixed point written out node by node."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 5, generator=g, dtype=D64)
    y = (torch.rand(4, 6, generator=g) > 0.5).to(D64)
    mask = torch.rand(4, 6, generator=g) > 0.2
    xs = gpn.normalize(x)
    s, ls = x.new_full((4,), 8.0), x.new_full((4,), 1.0)
    k = gpn.masked_gram(gpn.rbf_kernel(xs, xs, s, ls), mask, 1e-3)
    state, _ = VMP(gp_tree.gp_tree_exact_node, max_iter=300, tol=0).fit(y, mask, k)
    loc, prec = state.q["f"]
    for v, (m, cov) in enumerate(_jaakkola_jordan(k, y, mask.to(D64))):
        torch.testing.assert_close(loc[v].reshape(-1), m, rtol=0, atol=1e-8)
        torch.testing.assert_close(torch.linalg.inv(prec[v].reshape(6, 6)), cov, atol=1e-8, rtol=0)


def test_few_shot_derived_engine_labels():
    """The few-shot estimator's derived engine runs end to end and mostly agrees with the
    Gibbs nodes (a variational posterior against samples: not the same numbers)."""
    from probfsl.data import load_dataset, sample_episodes

    fs = load_dataset("omniglot")
    tasks = sample_episodes(fs, 4, way=3, shot=5, n_query=15, seed=0).to(dtype=D64)
    probs = {}
    for engine in ("handwritten", "derived"):
        est = GPTreeFewShot(engine=engine, n_chains=10).fit_featureset(fs, D64)
        probs[engine] = est.predict_proba(tasks)
    torch.testing.assert_close(probs["derived"].sum(-1), torch.ones(4, 15, dtype=D64))
    agree = (probs["derived"].argmax(-1) == probs["handwritten"].argmax(-1)).double().mean()
    assert agree >= 0.9
