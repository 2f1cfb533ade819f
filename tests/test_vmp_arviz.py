"""Any model fitted by VMP as an ArviZ DataTree (probfsl.diagnostics.vmp_datatree): draws
from the factors that match exact posteriors, dimensions named from the plates, the
bound's trace and convergence, point estimates, and ArviZ's summary and plots on it."""

from functools import partial

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions import constraints
from pyro.ops.indexing import Vindex

from probfsl.diagnostics import vmp_datatree
from probfsl.inference import VMP

pytest.importorskip("arviz_base")

F64 = torch.float64
DRAWS = 4000


def normal_mean(x, mu0=0.5, lam0=1.5, tau=2.0):
    """mu_t ~ N(mu0, 1/lam0), x_tn ~ N(mu_t, 1/tau): the posterior of mu_t is Normal."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(mu0), lam0**-0.5))
        with pyro.plate("points", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, tau**-0.5), obs=x)


def gamma_poisson(k, a=2.0, b=0.5):
    """lam_t ~ Gamma(a, b), k_tn ~ Poisson(lam_t): the posterior of lam_t is Gamma."""
    with pyro.plate("tasks", k.shape[0], dim=-2):
        lam = pyro.sample("lam", dist.Gamma(k.new_tensor(a), k.new_tensor(b)))
        with pyro.plate("counts", k.shape[1], dim=-1):
            pyro.sample("k", dist.Poisson(lam), obs=k)


def mixture(x, labels, observed, way=3):
    """A Gaussian mixture, labels observed where ``observed``, Dirichlet weights."""
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), 2.0)))
        with pyro.plate("classes", way, dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(d), 2.0).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            pyro.sample(
                "x", dist.Normal(Vindex(mu.unsqueeze(-3))[..., z, :], 1.0).to_event(1), obs=x
            )


def evidence_regression(y, x):
    """Bayesian linear regression with type-II estimates of its precisions."""
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        ones = torch.ones(t, 1, dtype=x.dtype)
        alpha = pyro.param("alpha", ones, constraint=constraints.positive)
        beta = pyro.param("beta", ones, constraint=constraints.positive)
        w = pyro.sample("w", dist.Normal(x.new_zeros(p), alpha.rsqrt().unsqueeze(-1)).to_event(1))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w).sum(-1), beta.rsqrt()), obs=y)


def random_walk(x, noise=1.0, step=0.5):
    """s_0 ~ N(0, 4), s_i ~ N(s_{i-1}, step²), x_i ~ N(s_i, noise²): one joint factor."""
    with pyro.plate("tasks", x.shape[0]):
        s = pyro.sample("s0", dist.Normal(x.new_tensor(0.0), 2.0))
        pyro.sample("x0", dist.Normal(s, noise), obs=x[:, 0])
        for i in range(1, x.shape[1]):
            s = pyro.sample(f"s{i}", dist.Normal(s, step))
            pyro.sample(f"x{i}", dist.Normal(s, noise), obs=x[:, i])


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _mixture_data(t=3, way=3, n=20, d=2):
    g = _g(1)
    means = 3.0 * torch.randn(t, way, d, generator=g, dtype=F64)
    labels = torch.randint(0, way, (t, n), generator=g)
    labels[:, :way] = torch.arange(way)  # one observed point per class
    x = means.gather(1, labels.unsqueeze(-1).expand(-1, -1, d))
    x = x + torch.randn(t, n, d, generator=g, dtype=F64)
    observed = torch.zeros(t, n, dtype=torch.bool)
    observed[:, :way] = True
    return x, labels, observed


def _assert_moments(draws, mean, var, kurtosis=3.0):
    """The draws' mean and variance (over axis 0) equal ``mean`` and ``var`` within five
    Monte-Carlo standard errors."""
    n = draws.shape[0]
    se_mean = np.sqrt(var / n)
    se_var = var * np.sqrt((kurtosis - 1 + 2 / (n - 1)) / n)
    assert np.all(np.abs(draws.mean(0) - mean) <= 5 * se_mean), (draws.mean(0), mean)
    assert np.all(np.abs(draws.var(0, ddof=1) - var) <= 5 * se_var), (draws.var(0), var)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_normal_mean_draws_match_the_exact_posterior(dtype):
    x = (1.2 + torch.randn(4, 9, generator=_g(), dtype=F64)).to(dtype)
    vmp = VMP(normal_mean, tol=0, max_iter=3)
    state, info = vmp.fit(x)
    tree = vmp_datatree(vmp, state, info, num_samples=DRAWS, seed=3)
    mu = tree.posterior["mu"]
    assert mu.dims == ("chain", "draw", "tasks")
    assert mu.shape == (1, DRAWS, 4) and mu.dtype == np.dtype(str(dtype).split(".")[1])
    lam = 1.5 + 9 * 2.0
    exact_mean = ((1.5 * 0.5 + 2.0 * x.double().sum(1)) / lam).numpy()
    _assert_moments(mu.values[0].astype(np.float64), exact_mean, 1 / lam)
    stats = tree.sample_stats
    assert stats["elbo"].dims == ("tasks",) and stats["elbo"].dtype == mu.dtype
    assert stats["elbo_trace"].shape == (4, 4)  # the start and three sweeps
    assert not stats["converged"].values.any()  # tol = 0: no task meets it
    np.testing.assert_array_equal(stats["n_sweeps"].values, [3, 3, 3, 3])


def test_gamma_poisson_draws_match_the_exact_posterior():
    k = torch.poisson(torch.tensor([[1.0], [4.0], [9.0]], dtype=F64).expand(3, 12), _g())
    vmp = VMP(gamma_poisson, tol=1e-12)
    state, info = vmp.fit(k)
    tree = vmp_datatree(vmp, state, info, num_samples=DRAWS)
    lam = tree.posterior["lam"]
    assert lam.dims == ("chain", "draw", "tasks")
    shape, rate = 2.0 + k.sum(1).numpy(), 0.5 + 12
    _assert_moments(lam.values[0], shape / rate, shape / rate**2, kurtosis=3 + 6 / shape.min())


def test_mixture_dims_are_named_from_the_plates_and_labels_follow_q():
    x, labels, observed = _mixture_data()
    vmp = VMP(mixture, tol=1e-10)
    state, info = vmp.fit(x, labels, observed)
    tree = vmp_datatree(vmp, state, info, num_samples=2000, seed=1)
    post = tree.posterior
    assert post["pi"].dims == ("chain", "draw", "tasks", "pi_dim_0")  # its (T, 1) batch
    assert post["mu"].dims == ("chain", "draw", "tasks", "classes", "mu_dim_0")
    assert post["z"].dims == ("chain", "draw", "tasks", "points")
    assert dict(post.sizes) == {
        "chain": 1,
        "draw": 2000,
        "tasks": 3,
        "pi_dim_0": 3,
        "classes": 3,
        "mu_dim_0": 2,
        "points": 20,
    }
    z = post["z"].values[0]
    assert np.issubdtype(z.dtype, np.integer)
    obs = observed.numpy()
    assert (z[:, obs] == labels.numpy()[obs]).all()  # the observed labels in every draw
    q = vmp.posterior(state)
    freq = (z[..., None] == np.arange(3)).mean(0)
    probs = q["z"].probs.numpy()
    assert np.all(np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / 2000) + 1e-12)
    mean, sd = q["mu"].mean.numpy(), q["mu"].stddev.numpy()
    _assert_moments(post["mu"].values[0], mean, sd**2)


def test_summary_and_plots_run_on_a_users_model():
    arviz_stats = pytest.importorskip("arviz_stats")
    x, labels, observed = _mixture_data(t=2)
    vmp = VMP(mixture)
    state, info = vmp.fit(x, labels, observed)
    tree = vmp_datatree(vmp, state, info, num_samples=200, num_chains=2)
    with np.errstate(all="ignore"):  # the observed labels do not vary: their sd is 0
        table = arviz_stats.summary(tree, var_names=["pi", "mu"])
    assert len(table) == 2 * 3 + 2 * 3 * 2
    np.testing.assert_allclose(
        table.loc["mu[1, 2, 0]", "mean"],
        tree.posterior["mu"].sel(tasks=1, classes=2, mu_dim_0=0).mean(),
        atol=0.01,
    )
    assert np.allclose(table["r_hat"], 1.0, atol=0.05)  # independent draws
    arviz_plots = pytest.importorskip("arviz_plots")
    plt = pytest.importorskip("matplotlib.pyplot")
    try:
        arviz_plots.plot_dist(tree, var_names=["mu"], coords={"tasks": [0]}, backend="matplotlib")
    finally:
        plt.close("all")


def test_bound_trace_and_convergence_come_from_the_run():
    x, labels, observed = _mixture_data(t=4)
    vmp = VMP(mixture, tol=1e-8)
    state, info = vmp.fit(x, labels, observed)
    stats = vmp_datatree(vmp, state, info, num_samples=10).sample_stats
    sweeps = int(info.n_steps.max())
    assert stats["elbo_trace"].dims == ("tasks", "sweep")
    assert stats.sizes["sweep"] == info.trace.shape[0] == sweeps + 1
    np.testing.assert_array_equal(stats["elbo_trace"].values, info.trace.T.numpy())
    np.testing.assert_array_equal(stats["elbo_trace"].values[:, -1], state.objective.numpy())
    np.testing.assert_array_equal(stats["elbo"].values, state.objective.numpy())
    np.testing.assert_array_equal(stats["n_sweeps"].values, info.n_steps.numpy())
    np.testing.assert_array_equal(stats["converged"].values, info.converged.numpy())
    assert stats["converged"].values.all()
    alone = vmp_datatree(vmp, state, num_samples=10).sample_stats  # without the run's info
    assert set(alone.data_vars) == {"elbo"}


def test_point_estimates_are_constant_data():
    g = _g(2)
    x = torch.randn(3, 15, 4, generator=g, dtype=F64)
    y = (x * torch.randn(3, 1, 4, generator=g, dtype=F64)).sum(-1)
    y = y + 0.3 * torch.randn(3, 15, generator=g, dtype=F64)
    vmp = VMP(evidence_regression, tol=1e-10, max_iter=500)
    state, info = vmp.fit(y, x)
    tree = vmp_datatree(vmp, state, info, num_samples=10)
    assert tree.posterior["w"].dims == ("chain", "draw", "tasks", "w_dim_0")
    points = vmp.point_estimates(state)
    for name in ("alpha", "beta"):
        assert tree.constant_data[name].dims == ("tasks",)
        np.testing.assert_array_equal(tree.constant_data[name].values, points[name].flatten())
    assert "constant_data" not in vmp_datatree(VMP(normal_mean), VMP(normal_mean).fit(y)[0])


def test_a_gaussian_markov_chain_is_drawn_jointly():
    """With fixed precisions the chain's factor is the exact posterior: the draws' covariance
    across steps (not only each step's variance) is (C⁻¹ + I)⁻¹."""
    n = 5
    x = (0.5 * torch.randn(2, n, generator=_g(3), dtype=F64)).cumsum(1)
    vmp = VMP(random_walk, tol=1e-12)
    state, info = vmp.fit(x)
    tree = vmp_datatree(vmp, state, info, num_samples=DRAWS, seed=5)
    draws = np.stack([tree.posterior[f"s{i}"].values[0, :, 0] for i in range(n)], -1)
    i = np.arange(n)
    prior = 4.0 + 0.25 * np.minimum(i[:, None], i[None, :])
    cov = np.linalg.inv(np.linalg.inv(prior) + np.eye(n))
    se = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / DRAWS)
    assert np.all(np.abs(np.cov(draws.T) - cov) <= 5 * se)
    assert cov[0, 1] > 10 * se[0, 1]  # a correlation the marginals alone would miss


def test_draws_are_seeded_and_leave_the_global_stream_alone():
    x = torch.randn(2, 5, generator=_g(), dtype=F64)
    vmp = VMP(normal_mean)
    state, info = vmp.fit(x)
    torch.manual_seed(123)
    a = vmp_datatree(vmp, state, info, num_samples=50, seed=7).posterior["mu"].values
    after = torch.rand(3)
    torch.manual_seed(123)
    b = vmp_datatree(vmp, state, info, num_samples=50, seed=7).posterior["mu"].values
    np.testing.assert_array_equal(a, b)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)
    c = vmp_datatree(vmp, state, info, num_samples=50, seed=8).posterior["mu"].values
    assert not np.array_equal(a, c)


def _plate_named_draw(x):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        with pyro.plate("draw", x.shape[1], dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def test_a_plate_named_like_an_arviz_dimension_is_renamed():
    x = torch.randn(2, 3, generator=_g(), dtype=F64)
    vmp = VMP(_plate_named_draw)
    tree = vmp_datatree(vmp, vmp.fit(x)[0], num_samples=5)
    assert tree.posterior["mu"].dims == ("chain", "draw", "tasks", "draw_plate")


def test_bad_arguments_are_refused():
    x = torch.randn(2, 5, generator=_g(), dtype=F64)
    vmp = VMP(normal_mean)
    state, info = vmp.fit(x)
    with pytest.raises(TypeError, match="VMP"):
        vmp_datatree(object(), state)
    with pytest.raises(TypeError, match="VMPState"):
        vmp_datatree(vmp, info)
    with pytest.raises(ValueError, match="num_samples"):
        vmp_datatree(vmp, state, num_samples=0)
    with pytest.raises(ValueError, match="info.trace"):
        vmp_datatree(vmp, state, info._replace(trace=info.trace[:, :1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_on_the_gpu_gives_the_same_tree_layout():
    x, labels, observed = _mixture_data(t=2)
    cuda = torch.device("cuda")
    vmp = VMP(partial(mixture, way=3))
    state, info = vmp.fit(x.to(cuda), labels.to(cuda), observed.to(cuda))
    tree = vmp_datatree(vmp, state, info, num_samples=1000, seed=0)
    again = vmp_datatree(vmp, state, info, num_samples=1000, seed=0)
    assert tree.posterior["mu"].dims == ("chain", "draw", "tasks", "classes", "mu_dim_0")
    np.testing.assert_array_equal(tree.posterior["mu"].values, again.posterior["mu"].values)
    q = vmp.posterior(state)["mu"]
    mean, sd = q.mean.cpu().numpy(), q.stddev.cpu().numpy()
    _assert_moments(tree.posterior["mu"].values[0], mean, sd**2)
