"""GP-Tree inference: Pólya-Gamma facts, Gibbs nodes, VI nodes (docs/design/gp-tree.md §6,
items 1–6 and 12)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probfsl.inference import gp_tree_nodes as gpn
from probfsl.inference.base import run
from probfsl.inference.polya_gamma import (
    PolyaGamma,
    pg_kl,
    pg_log_prob,
    pg_mean,
    pg_var,
    sample_pg_exact,
    sample_pg_torch,
)
from probfsl.models.gp_tree.model import gp_tree_exact_model, gp_tree_model
from probfsl.testing import (
    ConformanceCase,
    assert_batch_invariant,
    assert_device_follows,
    assert_no_host_syncs,
    check_engine,
)

D64 = torch.float64


# ------------------------------------------------------------------ Pólya-Gamma (items 1–3)


@pytest.mark.parametrize("sampler", ["torch", "exact"])
@pytest.mark.parametrize("c", [0.0, 0.7, 3.0, 12.0])
def test_pg_moments(sampler, c):
    n = 100_000
    ct = torch.full((n,), c, dtype=D64)
    gen = torch.Generator().manual_seed(1)
    if sampler == "torch":
        w = sample_pg_torch(ct, generator=gen)
    else:
        w = sample_pg_exact(ct, random_state=1)
    mean, var = pg_mean(ct[:1]).item(), pg_var(ct[:1]).item()
    assert w.dtype == D64 and (w > 0).all()
    assert abs(w.mean().item() - mean) < 5 * math.sqrt(var / n)
    # Var of the sample variance ≈ (μ4 − σ⁴)/n; PG tails are light, 10 % is generous.
    assert abs(w.var().item() - var) < 0.04 * var


def test_pg_moment_limits_and_formula():
    for dtype in (torch.float32, D64):
        c = torch.tensor([0.0, 1e-6, 1e-3], dtype=dtype)
        torch.testing.assert_close(pg_mean(c), torch.full_like(c, 0.25), rtol=1e-6, atol=0)
        torch.testing.assert_close(pg_var(c), torch.full_like(c, 1 / 24), rtol=1e-5, atol=0)
    c = torch.tensor([0.05, 0.3, 0.6, 2.0, 7.0, 40.0, 200.0], dtype=D64)
    ref_var = (torch.sinh(c.clamp_max(80)) - c) / (4 * c**3 * torch.cosh(c.clamp_max(80) / 2) ** 2)
    torch.testing.assert_close(pg_var(c)[:-1], ref_var[:-1], rtol=1e-9, atol=0)
    assert torch.isfinite(pg_var(c)).all() and pg_var(c)[-1] > 0
    torch.testing.assert_close(pg_mean(c), torch.tanh(c / 2) / (2 * c), rtol=1e-12, atol=0)
    torch.testing.assert_close(pg_var(c.float()), pg_var(c).float(), rtol=1e-4, atol=0)


def test_pg_torch_sampler_matches_exact_distribution():
    from scipy.stats import ks_2samp

    c = torch.full((20_000,), 1.5, dtype=D64)
    a = sample_pg_torch(c, generator=torch.Generator().manual_seed(3)).numpy()
    b = sample_pg_exact(c, random_state=3).numpy()
    assert ks_2samp(a, b).pvalue > 1e-3


def test_pg_torch_sampler_follows_dtype_and_rejects_bad_input():
    c = torch.linspace(-4, 4, 9)
    assert sample_pg_torch(c).dtype == torch.float32
    assert sample_pg_exact(c).dtype == torch.float32
    with pytest.raises(ValueError, match="NaN"):
        sample_pg_torch(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="b must be positive"):
        sample_pg_torch(c, b=-1.0)


def test_pg_log_prob_matches_polyagamma_pdf():
    from polyagamma import polyagamma_pdf

    x = np.array([0.02, 0.1, 0.16, 0.17, 0.3, 0.8, 2.0])
    for c in (0.0, 1.3, -4.0):
        ref = np.log(polyagamma_pdf(x, 1.0, c))
        np.testing.assert_allclose(pg_log_prob(torch.tensor(x), c).numpy(), ref, atol=1e-5)


def test_pg_identity():
    """σ(ψ)^y(1−σ(ψ))^{1−y} = ½ e^{κψ} E_{PG(1,0)}[e^{−ωψ²/2}] (item 2)."""
    w = sample_pg_exact(torch.zeros(400_000, dtype=D64), random_state=5)
    for psi in (-2.0, 0.4, 1.7):
        for y in (0, 1):
            kappa = y - 0.5
            mc = 0.5 * math.exp(kappa * psi) * torch.exp(-w * psi**2 / 2).mean().item()
            s = 1 / (1 + math.exp(-psi))
            assert abs(mc - (s if y else 1 - s)) < 3e-3


def test_pg_kl():
    """KL(PG(1,c)‖PG(1,0)) = E_q[log cosh(c/2) − c²ω/2] (item 3), and via log_prob."""
    for c in (0.5, 2.0, 6.0):
        ct = torch.full((200_000,), c, dtype=D64)
        w = sample_pg_exact(ct, random_state=2)
        mc = (math.log(math.cosh(c / 2)) - c**2 * w / 2).mean().item()
        kl = pg_kl(torch.tensor(c, dtype=D64)).item()
        assert abs(mc - kl) < 5e-3 * max(1, kl)
        torch.testing.assert_close(
            PolyaGamma(ct[:5]).log_prob(w[:5]) - pg_log_prob(w[:5]),
            math.log(math.cosh(c / 2)) - c**2 * w[:5] / 2,
        )


# ----------------------------------------------------------------------------- Gibbs nodes


def _toy(V=2, n=5, D=3, seed=0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, n, D, generator=g, dtype=dtype)
    y = (torch.rand(V, n, generator=g) > 0.5).to(dtype)
    mask = torch.ones(V, n, dtype=torch.bool)
    return x, y, mask


def _brute_posterior(K, omega, kappa):
    Sigma = torch.linalg.inv(torch.linalg.inv(K) + torch.diag(omega))
    return Sigma @ kappa, Sigma


def test_gibbs_f_conditional_against_brute_force():
    """f | ω ~ N((K⁻¹+Ω)⁻¹κ, (K⁻¹+Ω)⁻¹) (item 4): exact mean, and MC mean/cov of the draws."""
    x, y, mask = _toy(V=1, n=3)
    eng = gpn.GibbsNodes(n_chains=20_000, generator=torch.Generator().manual_seed(0))
    st = eng.init(x, y, mask)
    omega = torch.tensor([0.3, 1.1, 0.05], dtype=D64)
    st.omega = omega.expand(1, 20_000, 3).clone()
    mean_b, Sigma_b = _brute_posterior(st.K[0], omega, st.kappa[0])
    sw = st.omega.sqrt()
    m_f = gpn._posterior_mean_f(st.K, st.kappa, sw, gpn._chol_B(st.K, sw))
    torch.testing.assert_close(m_f[0, 0], mean_b, rtol=1e-10, atol=1e-10)
    f = eng.sample_f(st)[0]
    se = Sigma_b.diagonal().sqrt() / math.sqrt(f.shape[0])
    assert ((f.mean(0) - mean_b).abs() < 5 * se).all()
    torch.testing.assert_close(torch.cov(f.T), Sigma_b, rtol=0.05, atol=0.05 * Sigma_b.abs().max())


def test_gibbs_predictive_formula_and_padding():
    """Fixed-ω predictive equals k*ᵀ(K+Ω⁻¹)⁻¹Ω⁻¹κ, k** − k*ᵀ(K+Ω⁻¹)⁻¹k*; padding is inert."""
    x, y, mask = _toy(V=2, n=4)
    xs = torch.randn(6, 3, dtype=D64)
    eng = gpn.GibbsNodes(n_chains=3, generator=torch.Generator().manual_seed(1))
    st = eng.init(x, y, mask)
    p, mu, var = gpn.gibbs_predict(st, xs, return_moments=True)
    for v in range(2):
        for s in range(3):
            K, w = st.K[v], st.omega[v, s]
            ks = gpn.rbf_kernel(
                gpn.normalize(x[v : v + 1]),
                gpn.normalize(xs)[None],
                st.outputscale[:1],
                st.lengthscale[:1],
            )[0]
            Kn = torch.linalg.inv(K + torch.diag(1 / w))
            torch.testing.assert_close(mu[v, s], ks.T @ Kn @ (st.kappa[v] / w))
            torch.testing.assert_close(var[v, s], 8.0 - (ks * (Kn @ ks)).sum(0))
    # padded batch: node 0 with two extra masked points equals node 0 alone (item 12)
    xp = torch.cat([x, torch.randn(2, 2, 3, dtype=D64)], 1)
    yp = torch.cat([y, torch.ones(2, 2, dtype=D64)], 1)
    mp = torch.cat([mask, torch.zeros(2, 2, dtype=torch.bool)], 1)
    stp = eng.init(xp, yp, mp)
    stp.omega = torch.cat([st.omega, torch.rand(2, 3, 2, dtype=D64)], -1) * mp.unsqueeze(1)
    torch.testing.assert_close(gpn.gibbs_predict(stp, xs), p)
    torch.testing.assert_close(gpn.augmented_log_marginal(stp), gpn.augmented_log_marginal(st))
    # one node at a time equals the batch
    for v in range(2):
        single = gpn.GibbsState(
            *(
                t[v : v + 1]
                for t in (
                    st.x,
                    st.mask,
                    st.kappa,
                    st.K,
                    st.chol_K,
                    st.omega,
                    st.f,
                    st.outputscale,
                    st.lengthscale,
                )
            ),
        )
        torch.testing.assert_close(gpn.gibbs_predict(single, xs)[0], p[v])


@pytest.mark.parametrize("n", [1, 2])
def test_augmented_marginal_likelihood_by_quadrature(n):
    """log p(y | ω) = log ∫ Π ½exp(κ_i f_i − ω_i f_i²/2) N(f | 0, K) df (item 5)."""
    x, y, mask = _toy(V=1, n=n, seed=3)
    st = gpn.GibbsNodes(n_chains=1).init(x, y, mask)
    st.omega = torch.tensor([[[0.4, 0.9][:n]]], dtype=D64)
    grid = torch.linspace(-12, 12, 1201, dtype=D64)
    h = grid[1] - grid[0]
    K = st.K[0]
    if n == 1:
        f = grid[:, None]
    else:
        f = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    prior = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=D64), K).log_prob(f)
    lik = (st.kappa[0] * f - st.omega[0, 0] * f**2 / 2 - math.log(2)).sum(-1)
    ref = torch.logsumexp(prior + lik, 0) + n * torch.log(h)
    torch.testing.assert_close(gpn.augmented_log_marginal(st)[0, 0], ref, rtol=1e-6, atol=1e-6)


def test_gibbs_reproduces_exact_posterior_predictive():
    """Many chains and sweeps on a 2-point 1-D toy match a grid-quadrature posterior (item 4)."""
    x = torch.tensor([[[1.0, 0.2], [0.3, 1.0]]], dtype=D64)
    y = torch.tensor([[1.0, 0.0]], dtype=D64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    xs = torch.tensor([[0.8, 0.6]], dtype=D64)
    eng = gpn.GibbsNodes(n_chains=2000, outputscale=4.0, generator=torch.Generator().manual_seed(2))
    st = eng.fit(x, y, mask, n_sweeps=15)
    p = gpn.gibbs_predict(st, xs)[0, 0].item()
    # reference: p(f | y) on a grid, then E[σ(f*)] under f* | f
    K = st.K[0]
    grid = torch.linspace(-10, 10, 401, dtype=D64)
    f = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    logpost = torch.distributions.MultivariateNormal(torch.zeros(2, dtype=D64), K).log_prob(f)
    logpost = (
        logpost + torch.nn.functional.logsigmoid(f[:, 0]) + torch.nn.functional.logsigmoid(-f[:, 1])
    )
    wts = torch.softmax(logpost, 0)
    xn, xsn = gpn.normalize(x[0]), gpn.normalize(xs)
    one = torch.ones(1, dtype=D64)
    ks = gpn.rbf_kernel(xn[None], xsn[None], 4 * one, one)[0, :, 0]
    a = torch.linalg.solve(K, ks)
    mu = f @ a
    var = 4.0 - ks @ a
    ref = (wts * gpn.gauss_hermite_sigmoid(mu, var.expand_as(mu))).sum().item()
    assert abs(p - ref) < 0.01


def test_gibbs_rejects_bad_input():
    x, y, mask = _toy()
    eng = gpn.GibbsNodes(n_chains=2)
    with pytest.raises(ValueError, match="NaN"):
        eng.init(x * float("nan"), y, mask)
    with pytest.raises(ValueError, match="0/1"):
        eng.init(x, y * 3, mask)
    with pytest.raises(ValueError, match="at least one"):
        eng.init(x, y, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="n_chains"):
        gpn.GibbsNodes(n_chains=0)


def test_gauss_hermite_sigmoid():
    mu = torch.tensor([-1.0, 0.0, 2.0], dtype=D64)
    var = torch.tensor([0.5, 3.0, 1e-12], dtype=D64)
    g = torch.Generator().manual_seed(0)
    f = mu + var.sqrt() * torch.randn(400_000, 3, generator=g, dtype=D64)
    torch.testing.assert_close(
        gpn.gauss_hermite_sigmoid(mu, var), torch.sigmoid(f).mean(0), atol=2e-3, rtol=0
    )
    assert abs(gpn.gauss_hermite_sigmoid(mu, var)[2] - torch.sigmoid(mu[2])) < 1e-10


def test_rbf_matches_gpytorch():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import gpytorch

    k = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])), batch_shape=torch.Size([2])
    )
    k.outputscale = torch.tensor([2.0, 5.0])
    k.base_kernel.lengthscale = torch.tensor([0.7, 1.3]).view(2, 1, 1)
    x1, x2 = torch.randn(2, 4, 3), torch.randn(2, 5, 3)
    ref = k(x1, x2).to_dense()
    ours = gpn.rbf_kernel(x1, x2, torch.tensor([2.0, 5.0]), torch.tensor([0.7, 1.3]))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------- VI nodes


def _vi_data(V=3, n=8, M=3, D=3, seed=0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, n, D, generator=g, dtype=dtype)
    y = (x[..., 0] + 0.3 * torch.randn(V, n, generator=g, dtype=dtype) > 0).to(dtype)
    mask = torch.ones(V, n, dtype=torch.bool)
    z = torch.randn(V, M, D, generator=g, dtype=dtype)
    zmask = torch.ones(V, M, dtype=torch.bool)
    s = torch.full((V,), 4.0, dtype=dtype)
    ls = torch.full((V,), 1.0, dtype=dtype)
    return x, y, mask, z, zmask, s, ls


def test_vi_engine_conformance():
    """Monotone ELBO, batch = single node, float32 ≈ float64, Pyro Trace_ELBO = analytic ELBO,
    device follows the data; one documented host sync per step (safe_cholesky's check)."""
    case = ConformanceCase(
        make_engine=gpn.VINodes,
        model=gp_tree_model,
        step_syncs=1,
        data=_vi_data(),
        n_steps=8,
        particles=1000,
        repeats=4,
        rtol_float32=2e-3,
    )
    check_engine(case)


def test_vi_updates_are_exact_optima():
    """ρ = 1: c and q(f̄) are the exact maximisers given the other (item 6)."""
    data = _vi_data(V=2)
    eng = gpn.VINodes()
    st = eng.step(eng.step(eng.init(*data))[0])[0]
    t = eng.terms(st)
    mu, Sigma = gpn.q_moments(st.eta, st.prec)
    # q given c: the ELBO's gradient in (μ̃, Σ̃) vanishes
    mu_r, S_r = mu.clone().requires_grad_(), Sigma.clone().requires_grad_()
    gpn.vi_elbo(t, mu_r, S_r, st.c).sum().backward()
    assert mu_r.grad.abs().max() < 1e-8 and S_r.grad.abs().max() < 1e-8
    # c given q: the c-update zeroes the gradient in c
    c_new = eng.update_c(t, mu, Sigma).requires_grad_()
    gpn.vi_elbo(t, mu, Sigma, c_new).sum().backward()
    assert c_new.grad.abs().max() < 1e-10
    # and perturbing c lowers the ELBO
    base = gpn.vi_elbo(t, mu, Sigma, c_new.detach())
    assert (gpn.vi_elbo(t, mu, Sigma, c_new.detach() * 1.2) < base).all()


def test_vi_elbo_is_a_lower_bound_and_code_flag_differs():
    """ELBO ≤ log p(y) (importance sampling from the exact GP prior) (item 6)."""
    x, y, mask, z, zmask, s, ls = _vi_data(V=1, n=4, M=2, seed=4)
    eng = gpn.VINodes()
    st = eng.init(x, y, mask, z, zmask, s, ls)
    st, _ = run(eng, st, 20)
    xn = gpn.normalize(x)
    K = gpn.rbf_kernel(xn, xn, s, ls)[0] + 1e-8 * torch.eye(4, dtype=D64)
    f = torch.distributions.MultivariateNormal(torch.zeros(4, dtype=D64), K).sample((400_000,))
    ll = (
        y[0] * torch.nn.functional.logsigmoid(f) + (1 - y[0]) * torch.nn.functional.logsigmoid(-f)
    ).sum(-1)
    log_py = (torch.logsumexp(ll, 0) - math.log(len(ll))).item()
    assert st.objective.item() <= log_py + 1e-3
    assert st.objective.item() > log_py - 2.0  # a reasonable bound, not a trivial one
    code = gpn.VINodes(code_elbo=True)
    t = eng.terms(st)
    mu, Sigma = gpn.q_moments(st.eta, st.prec)
    assert not torch.allclose(gpn.vi_elbo(t, mu, Sigma, st.c, code_elbo=True), st.objective)
    assert code.code_elbo


def test_vi_with_inducing_at_data_reduces_to_exact_predictive():
    """X̄ = X (M = n): the predictive equals the exact-GP formula with Ω = Θ (item 6)."""
    x, y, mask, _, _, s, ls = _vi_data(V=1, n=5, seed=2)
    eng = gpn.VINodes(jitter=1e-9)
    st = eng.init(x, y, mask, x.clone(), mask.clone(), s, ls)
    st, _ = run(eng, st, 30)
    xs = torch.randn(1, 7, 3, dtype=D64)
    _, mean, var = eng.predict(st, xs, return_moments=True)
    theta = pg_mean(st.c[0])
    xn, xsn = gpn.normalize(x), gpn.normalize(xs)
    K = gpn.rbf_kernel(xn, xn, s, ls)[0]
    ks = gpn.rbf_kernel(xn, xsn, s, ls)[0]
    Kn = torch.linalg.inv(K + torch.diag(1 / theta))
    kappa = y[0] - 0.5
    torch.testing.assert_close(mean[0], ks.T @ Kn @ (kappa / theta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(var[0], 4.0 - (ks * (Kn @ ks)).sum(0), rtol=1e-5, atol=1e-5)


def test_vi_padding_is_inert():
    """A node padded with masked points and inducing points equals the unpadded node (item 12)."""
    data = _vi_data(V=2, n=6, M=3)
    x, y, mask, z, zmask, s, ls = data
    eng = gpn.VINodes()
    st = eng.init(*data)
    pad = lambda t, k, val: torch.cat([t, val.expand(*t.shape[:1], k, *t.shape[2:])], 1)  # noqa: E731
    xp = pad(x, 3, torch.randn(1, 1, 3, dtype=D64))
    yp = pad(y, 3, torch.ones(1, 1, dtype=D64))
    mp = pad(mask, 3, torch.zeros(1, 1, dtype=torch.bool))
    zp = pad(z, 2, torch.randn(1, 1, 3, dtype=D64))
    zmp = pad(zmask, 2, torch.zeros(1, 1, dtype=torch.bool))
    stp = eng.init(xp, yp, mp, zp, zmp, s, ls)
    st, stp = run(eng, st, 5)[0], run(eng, stp, 5)[0]
    torch.testing.assert_close(stp.objective, st.objective)
    xs = torch.randn(4, 3, dtype=D64)
    torch.testing.assert_close(eng.predict(stp, xs), eng.predict(st, xs))


def test_gibbs_chain_blocks_equal_direct_solve():
    """B⁻¹r, B = I + Ω^½KΩ^½ per chain: chain blocks (memory bound) = one batch = dense solve."""
    x, y, mask = _toy(V=2, n=6)
    st = gpn.GibbsNodes(n_chains=5, generator=torch.Generator().manual_seed(3)).init(x, y, mask)
    g = torch.Generator().manual_seed(4)
    sw = torch.rand(2, 5, 6, dtype=D64, generator=g) + 0.1
    r = torch.randn(2, 5, 6, dtype=D64, generator=g)
    B = torch.eye(6, dtype=D64) + sw.unsqueeze(-1) * st.K.unsqueeze(1) * sw.unsqueeze(-2)
    ref = torch.linalg.solve(B, r.unsqueeze(-1)).squeeze(-1)
    for max_elems in (2**25, 144, 1):  # one batch, blocks of 2 chains, of 1 chain
        out = gpn._solve_B(st.K, sw, r, max_elems)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_vi_cached_moments_give_the_same_step_and_elbo():
    """log|Σ̃| from chol(Σ̃⁻¹) equals the direct one; a step from cached moments = a fresh one."""
    data = _vi_data(V=2)
    eng = gpn.VINodes(natural_lr=0.5)
    st, _ = eng.step(eng.init(*data))
    t = eng.terms(st)
    mu, Sigma, chol = st.moments
    torch.testing.assert_close(
        gpn.vi_elbo(t, mu, Sigma, st.c, chol_prec=chol), gpn.vi_elbo(t, mu, Sigma, st.c)
    )
    # no cached moments, kernel terms recomputed from the data
    fresh = gpn.VIState(st.data, st.eta, st.prec, st.c, st.objective, eng.terms(st.data))
    (a, info), (b, _) = eng.step(st), eng.step(fresh)
    for u, v in ((a.eta, b.eta), (a.prec, b.prec), (a.c, b.c), (a.objective, b.objective)):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)
    assert torch.equal(info.objective, a.objective)


# ------------------------------------------------------------- Gibbs engine: the contract


def _gibbs_data():
    x, y, mask = _toy(V=3, n=6, seed=5)
    mask[2, 4:] = False  # a padded node
    return x, y, mask, torch.tensor([3, 8, 21])


@pytest.mark.parametrize("track", [False, True])
def test_gibbs_engine_contract(track):
    """GibbsNodes in GPTreeFewShot's configuration (20 chains, keyed streams): a batch equals
    one node at a time, every tensor follows the data's device, a sweep never syncs.

    Not checked: monotonicity (a sampler's augmented log marginal is random, it need not
    increase), Pyro's ELBO (a sampler has no variational density) and float32 = float64
    (float32 uniforms take 24 of the stream's bits, so the chains differ).
    """
    case = ConformanceCase(
        make_engine=lambda: gpn.GibbsNodes(n_chains=20, track_objective=track),
        model=gp_tree_exact_model,
        data=_gibbs_data(),
        n_steps=5,
        outputs=lambda st: torch.cat([st.omega, st.f], -1),
    )
    assert_batch_invariant(case)
    assert_device_follows(case)
    assert_no_host_syncs(case)
    state, info = run(case.make_engine(), case.make_engine().init(*case.data), 3)
    assert info.trace.shape == (4, 3) and torch.equal(info.n_steps, torch.full((3,), 3))
    if track:  # the objective is the augmented log marginal at the current ω
        ref = gpn.augmented_log_marginal(state).mean(-1)
        torch.testing.assert_close(state.objective, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(info.trace[-1], ref, rtol=1e-12, atol=1e-12)
    else:
        assert state.log_marginal is None and not state.objective.any()


def test_gibbs_keep_freezes_chains_and_keeps_the_record():
    """run with a tolerance: an untracked objective (zeros) has converged after one sweep,
    so every node's chains stay at their first sweep; the recorded traces stay lists."""
    x, y, mask, keys = _gibbs_data()
    eng = gpn.GibbsNodes(n_chains=3, record=True)
    one, _ = run(eng, eng.init(x, y, mask, keys), 1)
    frozen, info = run(eng, eng.init(x, y, mask, keys), 10, tol=0.0, check_every=2)
    assert torch.equal(frozen.omega, one.omega) and torch.equal(frozen.f, one.f)
    assert info.converged.all() and (info.n_steps == 1).all()
    assert len(frozen.omega_trace) == 3  # init and two sweeps ran before the host check


def test_gibbs_sweep_without_keys_has_no_host_sync():
    """GPTree's configuration: one torch generator for the batch, 64 as outputscale."""
    x, y, mask, _ = _gibbs_data()
    case = ConformanceCase(
        make_engine=lambda: gpn.GibbsNodes(
            n_chains=30, outputscale=64.0, generator=torch.Generator().manual_seed(0)
        ),
        model=gp_tree_exact_model,
        data=(x, y, mask),
        n_steps=4,
    )
    assert_no_host_syncs(case)


@pytest.mark.parametrize("keyed", [False, True])
def test_gibbs_omega_conditional_is_polya_gamma(keyed):
    """ω | f ~ PG(1, f): E[ω] = tanh(f/2)/(2f) and Var[ω] = (sinh f − f)/(4f³cosh²(f/2)),
    within 5 Monte Carlo standard errors over 40 000 chains."""
    x, y, mask = _toy(V=1, n=4)
    S = 40_000
    eng = gpn.GibbsNodes(n_chains=S, generator=torch.Generator().manual_seed(0))
    st = eng.init(x, y, mask, keys=torch.tensor([7]) if keyed else None)
    f = torch.tensor([0.0, 0.8, -2.5, 6.0], dtype=D64)
    w = eng.sample_omega(st, f.expand(1, S, 4).clone())[0]
    mean, var = pg_mean(f), pg_var(f)
    assert ((w.mean(0) - mean).abs() < 5 * (var / S).sqrt()).all()
    dev2 = (w - w.mean(0)).pow(2)
    assert ((dev2.mean(0) - var).abs() < 5 * (dev2.var(0) / S).sqrt()).all()


def test_gibbs_guide_draws_chain_states():
    """The Gibbs guide's ω is one of the chains' current ω, and the exact-kernel model
    scores the guide's draws."""
    import pyro

    data = _gibbs_data()
    eng = gpn.GibbsNodes(n_chains=5, generator=torch.Generator().manual_seed(1))
    x, y, mask, keys = data
    st = eng.fit(x, y, mask, 2, keys=keys)
    guide = eng.guide(st)
    tr = pyro.poutine.trace(guide).get_trace(*data)
    w, f = tr.nodes["omega"]["value"], tr.nodes["f"]["value"]
    assert f.shape == (3, 1, 6) and w.shape == (3, 6)
    for v in range(3):
        assert (st.omega[v] == w[v]).all(-1).any()
    model_tr = pyro.poutine.trace(pyro.poutine.replay(gp_tree_exact_model, trace=tr)).get_trace(
        *data
    )
    assert torch.isfinite(model_tr.log_prob_sum())
