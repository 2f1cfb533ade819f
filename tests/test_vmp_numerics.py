"""VMP's bound in finite precision: the expected log-density of a Normal site is formed
from the difference of the means, c⟨τ⟩((⟨x⟩ − ⟨m⟩)² + Var x + Var m), not as
c⟨τ⟩(⟨x²⟩ − 2⟨x⟩⟨m⟩ + ⟨m²⟩), whose terms cancel where Var(x − m) ≪ ⟨m⟩²; and a site's
parameters are cast to the data's dtype before anything is derived from them (a Normal's
precision scale⁻²).

Conjugate models with an exact posterior are checked against their log evidence in closed
form (y ~ N(m₀ 1, s² 11ᵀ + σ² I) for y_n ~ N(μ, σ²), μ ~ N(m₀, s²)); the others, whose
bound has a mean-field gap, in float32 against the same fit in float64."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference import VMP

F64 = torch.float64


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _fit(model, *data, tol=None, init_resp=None):
    tol = tol if tol is not None else (1e-7 if data[0].dtype == torch.float32 else 1e-13)
    state, _ = VMP(model, tol=tol, max_iter=2000).fit(*data, init_resp=init_resp)
    return state


def _rel(a, b):
    return ((a.double() - b.double()).abs() / b.double().abs()).max().item()


def _data(n_tasks=3, n=10, offset=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_tasks, n, generator=g, dtype=F64) + offset


def normal_mean(m0, sd, noise=1.0):
    """y_n ~ N(μ, noise²), μ ~ N(m0, sd²), its parameters tensors in the data's dtype."""

    def model(y):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            mu = pyro.sample("mu", dist.Normal(y.new_tensor(m0), y.new_tensor(sd)))
            with pyro.plate("n", y.shape[1], dim=-1):
                pyro.sample("y", dist.Normal(mu, y.new_tensor(noise)), obs=y)

    return model


def exact_normal_mean(y, m0, sd, noise=1.0):
    """ln p(y) = ln N(y | m0 1, sd² 11ᵀ + noise² I), in float64."""
    y = y.double()
    n = y.shape[-1]
    cov = sd**2 * torch.ones(n, n, dtype=F64) + noise**2 * torch.eye(n, dtype=F64)
    return dist.MultivariateNormal(torch.full((n,), m0, dtype=F64), cov).log_prob(y)


# ------------------------------------------------------- a tight prior away from zero
@pytest.mark.parametrize("sd", [1e-1, 1e-2, 1e-3, 1e-4])
def test_tight_prior_float32_bound_is_the_evidence(sd):
    """A prior N(3, sd²) whose variance is far below its squared mean: the float32 bound is
    the exact log evidence to float32 rounding, for every prior width (the expanded form
    lost 1e-4 nats at sd = 0.1 and a whole nat at sd = 0.001)."""
    y = _data()
    exact = exact_normal_mean(y, 3.0, sd)
    bound = _fit(normal_mean(3.0, sd), y.float()).objective
    assert bound.dtype == torch.float32
    assert _rel(bound, exact) < 1e-6


@pytest.mark.parametrize("sd", [1e-1, 1e-3])
def test_tight_prior_float64_bound_is_the_evidence(sd):
    y = _data()
    bound = _fit(normal_mean(3.0, sd), y).objective
    assert _rel(bound, exact_normal_mean(y, 3.0, sd)) < 1e-13


def test_tight_prior_batched_as_one_task():
    """Each task's float32 bound is the same fitted alone or with the others."""
    y = _data(n_tasks=4).float()
    model = normal_mean(3.0, 1e-3)
    batched = _fit(model, y).objective
    alone = torch.cat([_fit(model, y[i : i + 1]).objective for i in range(y.shape[0])])
    torch.testing.assert_close(batched, alone, rtol=2e-7, atol=0.0)


def test_far_data_float32_bound_is_the_evidence():
    """Data far from 0 with a small noise, y_n ≈ 1000 ± 0.1: the observed site's term
    Σ_n ⟨(y_n − μ)²⟩ is formed from the differences (y² alone is 10⁶ times larger)."""
    y = (_data(offset=0.0) * 0.1 + 1000.0).float()  # the exact evidence of these very data
    exact = exact_normal_mean(y, 1000.0, 1.0, noise=0.1)
    bound = _fit(normal_mean(1000.0, 1.0, noise=0.1), y).objective
    assert _rel(bound, exact) < 1e-5


@pytest.mark.parametrize("n", [1, 50, 500])
def test_far_data_float64_bound_is_the_evidence(n):
    """y_n ≈ 1000 ± 0.01 in float64: the data are shifted by their mean in float64 too
    (the expanded Σ y² − 2μ Σ y + n⟨μ²⟩ left 6e-4 nats at n = 500 and put the bound above
    the evidence at n = 50). The reference is the closed form from the centred data."""
    g = torch.Generator().manual_seed(0)
    y = 1000.0 + torch.randn(2, 1, generator=g, dtype=F64)
    y = y + 0.01 * torch.randn(2, n, generator=g, dtype=F64)
    mean, s2 = y.mean(-1), 0.01**2
    ss = (y - mean[:, None]).square().sum(-1)
    exact = (
        -0.5 * n * torch.log(torch.tensor(2 * torch.pi * s2, dtype=F64))
        - 0.5 * ss / s2
        - 0.5 * torch.log(torch.tensor(1 + n / s2, dtype=F64))
        - 0.5 * n * (mean - 1000.0).square() / (s2 + n)
    )
    bound = _fit(normal_mean(1000.0, 1.0, noise=0.01), y).objective
    torch.testing.assert_close(bound, exact, rtol=0.0, atol=1e-9)


def normal_hmm(level):
    """A three-state DiscreteHMM with Normal emissions whose means' priors sit at ``level``."""

    def model(x):
        t, n, k = x.shape[0], x.shape[1], 3
        off = torch.tensor([-2.0, 0.0, 2.0], dtype=x.dtype)
        with pyro.plate("tasks", t, dim=-1):
            pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(k)))
            sticky = x.new_ones(k, k) + 4 * torch.eye(k, dtype=x.dtype)
            a = pyro.sample("A", dist.Dirichlet(sticky).to_event(1))
            mu = pyro.sample("mu", dist.Normal(level + off, x.new_tensor(3.0)).to_event(1))
            tau = pyro.sample(
                "tau", dist.Gamma(x.new_full((k,), 2.0), x.new_tensor(0.5)).to_event(1)
            )
            obs = dist.Normal(mu.unsqueeze(-2), tau.rsqrt().unsqueeze(-2))
            chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), obs, duration=n)
            pyro.sample("x", chain, obs=x)

    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hmm_emissions_far_from_zero_keep_the_bound(dtype):
    """A DiscreteHMM's Normal emission term is c⟨τ⟩((x − ⟨μ⟩)² + Var μ), the residual
    first: shifting the data and the means' priors by 1,000 leaves the fit (the expanded
    x² − 2x⟨μ⟩ + ⟨μ²⟩ made the float64 bound fall between sweeps and the float32 one NaN)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randint(0, 3, (2, 60), generator=g)
    x = torch.tensor([-2.0, 0.0, 2.0], dtype=F64)[z] + 0.3 * torch.randn(
        2, 60, generator=g, dtype=F64
    )
    tol = 1e-12 if dtype == F64 else 1e-6
    near, _ = VMP(normal_hmm(0.0), tol=tol, max_iter=3000).fit(x.to(dtype))
    far, info = VMP(normal_hmm(1000.0), tol=tol, max_iter=3000).fit((x + 1000.0).to(dtype))
    assert bool(info.converged.all())
    fall = (info.trace[:-1] - info.trace[1:]).max().item()
    assert fall <= (1e-12 if dtype == F64 else 1e-6) * info.trace.abs().max().item()
    atol = 1e-9 if dtype == F64 else 2e-3
    torch.testing.assert_close(far.objective.double(), near.objective.double(), rtol=0.0, atol=atol)


# ----------------------------------------------------------------- mean-field models
def hierarchy(y):
    """μ ~ N(3, 0.001²), θ_j ~ N(μ, 0.01²), y_jn ~ N(θ_j, 1): a latent mean with a
    Normal parent, both tight around 3 (μ tighter, so that the mean-field sweeps between
    μ and θ converge in a few steps)."""
    with pyro.plate("tasks", y.shape[0], dim=-3):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(3.0), y.new_tensor(1e-3)))
        with pyro.plate("groups", y.shape[1], dim=-2):
            theta = pyro.sample("theta", dist.Normal(mu, y.new_tensor(0.01)))
            with pyro.plate("n", y.shape[2], dim=-1):
                pyro.sample("y", dist.Normal(theta, y.new_tensor(1.0)), obs=y)


def gamma_precision(y):
    """μ ~ N(100, 0.01²), τ ~ Gamma(2, 2), y_n ~ N(μ, 1/τ) with y ≈ 100 ± 1: the message
    to τ is ½ Σ_n ⟨(y_n − μ)²⟩, about 10⁴ times smaller than Σ_n y_n²."""
    with pyro.plate("tasks", y.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(100.0), y.new_tensor(0.01)))
        tau = pyro.sample("tau", dist.Gamma(y.new_tensor(2.0), y.new_tensor(2.0)))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(mu, tau.rsqrt()), obs=y)


def test_hierarchy_float32_matches_float64():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 4, 6, generator=g, dtype=F64) + 3.0
    s64 = _fit(hierarchy, y)
    s32 = _fit(hierarchy, y.float())
    assert _rel(s32.objective, s64.objective) < 1e-5


def test_gamma_precision_float32_matches_float64():
    y = _data(n=50, offset=100.0)
    s64 = _fit(gamma_precision, y)
    s32 = _fit(gamma_precision, y.float())
    assert _rel(s32.objective, s64.objective) < 1e-5
    rate64, rate32 = s64.q["tau"][1], s32.q["tau"][1]
    assert _rel(rate32, rate64) < 1e-5


def mixture(y, offset):
    """A mixture of 3 Normals with Gamma precisions, μ_k ~ N(offset, 10²): the
    per-component E ln N of the labels and the messages to τ read the data shifted by
    their mean."""
    with pyro.plate("tasks", y.shape[0], dim=-2):
        with pyro.plate("k", 3, dim=-1):
            mu = pyro.sample("mu", dist.Normal(y.new_tensor(offset), y.new_tensor(10.0)))
            tau = pyro.sample("tau", dist.Gamma(y.new_tensor(2.0), y.new_tensor(0.5)))
        with pyro.plate("n", y.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(y.new_ones(3) / 3))
            loc = Vindex(mu.unsqueeze(-2))[..., z]
            pyro.sample("y", dist.Normal(loc, Vindex(tau.unsqueeze(-2))[..., z].rsqrt()), obs=y)


@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_mixture_far_from_zero_float32_matches_float64(offset):
    """Clusters at offset − 5, offset, offset + 5 with unit spread: the float32 bound is
    the float64 one to float32 rounding, also 1000 spreads away from 0 (where the
    expanded form was 2e-2 off)."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (4, 60), generator=g)
    centres = torch.tensor([-5.0, 0.0, 5.0], dtype=F64)
    y = (centres[labels] + torch.randn(4, 60, generator=g, dtype=F64) + offset).float()
    start = torch.nn.functional.one_hot(labels, 3).double() * 0.9 + 0.1 / 3

    def model(y):
        mixture(y, offset)

    s64 = _fit(model, y.double(), init_resp={"z": start})
    s32 = _fit(model, y, init_resp={"z": start.float()})
    assert _rel(s32.objective, s64.objective) < 1e-5


def regression(y, x, w0, sd, noise):
    """w ~ N(w0, sd² I) (a joint factor over the coefficients), y_n ~ N(x_n · w, noise²)."""
    with pyro.plate("tasks", y.shape[0], dim=-2):
        w = pyro.sample("w", dist.Normal(w0.to(y.dtype), y.new_tensor(sd)).to_event(1))
        with pyro.plate("n", y.shape[1], dim=-1):
            mean = (x * w).sum(-1)
            pyro.sample("y", dist.Normal(mean, y.new_tensor(noise)), obs=y)


def test_tight_prior_on_joint_weights_float32():
    """The prior term of a joint factor reads Var w from the diagonal of its covariance:
    the float32 bound is the exact evidence, y ~ N(X w0, sd² X Xᵀ + noise² I)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, 3, generator=g, dtype=F64)
    w0 = torch.tensor([3.0, -2.0, 1.5], dtype=F64)
    sd, noise = 1e-3, 1.0
    y = x @ w0 + noise * torch.randn(2, 12, generator=g, dtype=F64)
    cov = sd**2 * x @ x.transpose(-1, -2) + noise**2 * torch.eye(12, dtype=F64)
    exact = dist.MultivariateNormal(x @ w0, cov).log_prob(y)

    def model(y, x):
        regression(y, x, w0, sd, noise)

    # (the reference's own covariance has a condition number near 1e7)
    assert _rel(_fit(model, y, x).objective, exact) < 1e-9
    f32 = _fit(model, y.float(), x.float()).objective.double()
    assert (f32 - exact).abs().max() < 0.1


# ------------------------------------------------------------- parameters' dtype
def python_float_prior(y, scale=10.0):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(0.0, scale))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_python_float_scale_read_in_the_data_dtype():
    """Normal(0.0, 10.0) holds float32 tensors; its precision is computed from the scale
    cast to float64 (10.0 is exact in float32), 0.01, not 1/100 in float32 (0.0099999998):
    the float64 bound is the exact evidence."""
    y = _data(n_tasks=2, n=8, offset=2.0)
    bound = _fit(python_float_prior, y, tol=1e-14).objective
    assert _rel(bound, exact_normal_mean(y, 0.0, 10.0)) < 1e-14 * 20


def test_python_floats_as_float64_tensors():
    """Hyperparameters exact in float32, written as Python numbers or as float64 tensors:
    the same bound."""
    y = _data(n_tasks=2, n=8, offset=2.0)

    def as_tensors(y):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), y.new_tensor(10.0)))
            with pyro.plate("n", y.shape[1], dim=-1):
                pyro.sample("y", dist.Normal(mu, y.new_tensor(1.0)), obs=y)

    a = _fit(python_float_prior, y, tol=1e-14).objective
    b = _fit(as_tensors, y, tol=1e-14).objective
    torch.testing.assert_close(a, b, rtol=1e-15, atol=0.0)


# ------------------------------------------------------------------ affine means
def _regression(alpha, beta):
    """y = X w + ε, w ~ N(0, α⁻¹ I) (one joint factor), ε ~ N(0, β⁻¹): exact under VMP."""

    def model(y, x):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            w = pyro.sample(
                "w", dist.Normal(x.new_zeros(x.shape[-1]), x.new_tensor(alpha**-0.5)).to_event(1)
            )
            with pyro.plate("n", y.shape[1], dim=-1):
                scale = x.new_tensor(beta**-0.5)
                pyro.sample("y", dist.Normal((x * w).sum(-1), scale), obs=y)

    return model


def test_affine_mean_float32_bound_is_the_evidence():
    """Weights far from 0 with little noise: the expanded ⟨y²⟩ − 2y⟨m⟩ + ⟨m²⟩ put the
    float32 bound up to 0.6 nats off the exact evidence ln N(y | 0, X Xᵀ / α + I / β) (y ~
    100, residuals ~ 0.1); (y − ⟨m⟩)² + the map's variance leaves the error of float32
    residuals themselves (y's own rounding, 8e-6 at 100: a few hundredths of a nat)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 25, 3, generator=g, dtype=F64)
    w = torch.tensor([30.0, -20.0, 15.0], dtype=F64)
    y = x @ w + 0.1 * torch.randn(3, 25, generator=g, dtype=F64)
    alpha, beta = 1e-3, 100.0
    cov = x @ x.transpose(-1, -2) / alpha + torch.eye(25, dtype=F64) / beta
    exact = torch.distributions.MultivariateNormal(torch.zeros(25, dtype=F64), cov).log_prob(y)
    model = _regression(alpha, beta)
    # (the reference's own covariance has a condition number near 1e7)
    assert _rel(_fit(model, y, x).objective, exact) < 1e-9
    f32 = _fit(model, y.float(), x.float()).objective.double()
    assert (f32 - exact).abs().max() < 0.1


# ------------------------------------------------------------ MultivariateNormal sites
def gp_fixed_noise(m0, noise):
    """f ~ N(m0 1, K), y ~ N(f, noise² I): ``Normal(f, s).to_event(1)`` reads f's entries
    through an identity map; q(f) is exact, so the bound is ln N(y | m0 1, K + noise² I)."""

    def model(y, k):
        with pyro.plate("tasks", y.shape[0]):
            loc = y.new_full((y.shape[-1],), m0)
            f = pyro.sample("f", dist.MultivariateNormal(loc, covariance_matrix=k))
            pyro.sample("y", dist.Normal(f, y.new_tensor(noise)).to_event(1), obs=y)

    return model


def _gp_data(m0, scale, n_tasks=3, n=12):
    """A squared-exponential kernel of variance scale² per task, y = m0 + a draw + noise."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(n_tasks, n, 1, generator=g, dtype=F64) * 4
    k = scale**2 * (torch.exp(-0.5 * torch.cdist(x, x).square()) + 1e-3 * torch.eye(n, dtype=F64))
    f = torch.linalg.cholesky(k) @ torch.randn(n_tasks, n, 1, generator=g, dtype=F64)
    return m0 + f[..., 0] + 0.01 * torch.randn(n_tasks, n, generator=g, dtype=F64), k


def _gp_exact(y, k, m0, noise):
    y, k = y.double(), k.double()
    cov = k + noise**2 * torch.eye(y.shape[-1], dtype=F64)
    return dist.MultivariateNormal(torch.full_like(y, m0), cov).log_prob(y)


def test_identity_map_of_a_multivariate_normal_is_read_as_its_entries():
    y, k = _gp_data(0.0, 1.0)
    plan = VMP(gp_fixed_noise(0.0, 0.1)).compile(y, k)
    (term,) = plan.sites["y"].params["loc"].terms
    assert term.identity is not None
    bound = _fit(gp_fixed_noise(0.0, 0.1), y, k).objective
    assert _rel(bound, _gp_exact(y, k, 0.0, 0.1)) < 1e-12


def test_multivariate_normal_far_from_zero_float32_bound_is_the_evidence():
    """A GP prior around 1000 with a kernel of scale 0.1 and noise 0.01: its term is
    formed from Cov f and (⟨f⟩ − m)(⟨f⟩ − m)ᵀ, the observed site's from the residuals.
    (⟨f fᵀ⟩ − 2⟨f⟩mᵀ + m mᵀ put the float64 bound 9e-7 relative off, the float32 one
    19,000 nats.) What float32 keeps: the rounding of data near 1000 and of the Cholesky
    factors, a hundredth of a nat."""
    y, k = _gp_data(1000.0, 0.1)
    model = gp_fixed_noise(1000.0, 0.01)
    assert _rel(_fit(model, y, k).objective, _gp_exact(y, k, 1000.0, 0.01)) < 1e-12
    exact = _gp_exact(y.float(), k.float(), 1000.0, 0.01)  # the evidence of these very data
    f32 = _fit(model, y.float(), k.float()).objective
    assert f32.dtype == torch.float32
    assert (f32.double() - exact).abs().max() < 0.05


def test_bilinear_mean_float32_matches_float64():
    """Bayesian PCA, y = W x + noise with W near 20 and noise 0.05, started at the true W:
    the observed site's term is (y − ⟨W⟩⟨x⟩)² + Var(W x) (the expanded y² − 2y⟨Wx⟩ +
    ⟨(Wx)²⟩ put the float32 bound 6.9 nats off the float64 one; the residual form leaves
    the rounding of float32 data near 30, a tenth of a nat)."""
    from functools import partial

    from tests.synthetic import bayesian_pca

    g = torch.Generator().manual_seed(4)
    t, n, d, k = 4, 30, 6, 2
    w = 20 * torch.randn(t, d, k, generator=g, dtype=F64)
    x = torch.randn(t, n, k, generator=g, dtype=F64)
    y = x @ w.transpose(-1, -2) + 0.05 * torch.randn(t, n, d, generator=g, dtype=F64)
    model = partial(bayesian_pca, k=k)
    f64 = VMP(model, tol=1e-12, max_iter=3000).fit(y, init={"W": w})[0].objective
    f32 = VMP(model, tol=1e-7, max_iter=3000).fit(y.float(), init={"W": w.float()})[0].objective
    assert f32.dtype == torch.float32
    assert (f32.double() - f64).abs().max() < 0.2


# ------------------------------------------------------------------ Gaussian chains
def level_walk(level, step, noise, tau=False):
    """s_0 ~ N(level, 1), s_t ~ N(s_{t−1}, step²) (or a Gamma innovation precision),
    x_t ~ N(s_t, noise²): one joint factor, exact with fixed precisions."""

    def model(x):
        t, n = x.shape
        with pyro.plate("tasks", t):
            precision = (
                pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), x.new_tensor(2.0 * step**2)))
                if tau
                else x.new_tensor(step**-2)
            )
            s = pyro.sample("s0", dist.Normal(x.new_tensor(level), x.new_tensor(1.0)))
            pyro.sample("x0", dist.Normal(s, x.new_tensor(noise)), obs=x[:, 0])
            for i in range(1, n):
                s = pyro.sample(f"s{i}", dist.Normal(s, precision.rsqrt()))
                pyro.sample(f"x{i}", dist.Normal(s, x.new_tensor(noise)), obs=x[:, i])

    return model


def _walk(level, step, noise, n_tasks=3, n=12):
    g = torch.Generator().manual_seed(0)
    walk = (step * torch.randn(n_tasks, n, generator=g, dtype=F64)).cumsum(1)
    return level + walk + noise * torch.randn(n_tasks, n, generator=g, dtype=F64)


def _walk_evidence(x, level, step, noise):
    """ln N(x | level 1, 1 + step² min(i, j) + noise² I), in float64."""
    i = torch.arange(x.shape[1], dtype=F64)
    cov = 1 + step**2 * torch.minimum(i[:, None], i[None, :])
    cov = cov + noise**2 * torch.eye(x.shape[1], dtype=F64)
    return dist.MultivariateNormal(torch.full_like(i, level), cov).log_prob(x.double())


def test_chain_far_from_zero_float32_bound_is_the_evidence():
    """A walk at a level of 1,000 with steps and noise of 0.1: each step's term is formed
    from (⟨s_t⟩ − ⟨s_{t−1}⟩)² + Var(s_t − s_{t−1}) off the joint factor, the data's from
    their residuals (the expanded forms put the float32 bound 45 nats off)."""
    x = _walk(1000.0, 0.1, 0.1)
    model = level_walk(1000.0, 0.1, 0.1)
    f32 = _fit(model, x.float()).objective
    assert f32.dtype == torch.float32
    assert (f32.double() - _walk_evidence(x.float(), 1000.0, 0.1, 0.1)).abs().max() < 1e-3


def test_chain_with_a_latent_precision_float32_matches_float64():
    x = _walk(1000.0, 0.1, 0.1)
    model = level_walk(1000.0, 0.1, 0.1, tau=True)
    f64 = VMP(model, tol=1e-10, max_iter=300).fit(x)[0].objective
    f32 = VMP(model, tol=1e-6, max_iter=300).fit(x.float())[0].objective
    assert (f32.double() - f64).abs().max() < 1e-2


def level_state_space(level, a, c, step, noise):
    """x_0 ~ N(level 1, I), x_t ~ N(A x_{t−1}, step² I), y_t ~ N(C x_t, noise² I): one
    vector chain, exact with everything else fixed."""

    def model(y):
        a_, c_ = a.to(y.dtype), c.to(y.dtype)
        with pyro.plate("tasks", y.shape[0]):
            x = pyro.sample("x0", dist.Normal(y.new_full((a.shape[0],), level), 1.0).to_event(1))
            pyro.sample("y0", dist.Normal(x @ c_.T, y.new_tensor(noise)).to_event(1), obs=y[:, 0])
            for t in range(1, y.shape[1]):
                x = pyro.sample(f"x{t}", dist.Normal(x @ a_.T, y.new_tensor(step)).to_event(1))
                pyro.sample(
                    f"y{t}", dist.Normal(x @ c_.T, y.new_tensor(noise)).to_event(1), obs=y[:, t]
                )

    return model


def _rotation(angle=0.3, scale=0.999):
    cos, sin = torch.cos(torch.tensor(angle, dtype=F64)), torch.sin(torch.tensor(angle, dtype=F64))
    return scale * torch.stack([torch.stack([cos, -sin]), torch.stack([sin, cos])])


def _state_space_data(level, a, c, step, noise, n_tasks=3, n=30):
    g = torch.Generator().manual_seed(0)
    x = level + torch.randn(n_tasks, a.shape[0], generator=g, dtype=F64)
    ys = []
    for t in range(n):
        if t:
            x = x @ a.T + step * torch.randn(x.shape, generator=g, dtype=F64)
        ys.append(x @ c.T + noise * torch.randn(n_tasks, c.shape[0], generator=g, dtype=F64))
    return torch.stack(ys, 1)


def _state_space_evidence(y, level, a, c, step, noise):
    """ln N(vec y | H μ, H Σ Hᵀ + noise² I) of the dense joint of the states, in float64:
    E x_t = Aᵗ level 1, Cov(x_t, x_s) = A^(t−s) Cov(x_s) for t ≥ s."""
    n, d = y.shape[1], a.shape[0]
    means, covs = [torch.full((d,), level, dtype=F64)], {(0, 0): torch.eye(d, dtype=F64)}
    for t in range(1, n):
        means.append(a @ means[-1])
        for s in range(t):
            covs[t, s] = a @ covs[t - 1, s]
            covs[s, t] = covs[t, s].T
        covs[t, t] = a @ covs[t - 1, t - 1] @ a.T + step**2 * torch.eye(d, dtype=F64)
    sigma = torch.cat([torch.cat([covs[t, s] for s in range(n)], 1) for t in range(n)], 0)
    h = torch.block_diag(*[c] * n)
    cov = h @ sigma @ h.T + noise**2 * torch.eye(h.shape[0], dtype=F64)
    flat = y.double().reshape(y.shape[0], -1)
    return dist.MultivariateNormal(h @ torch.cat(means), cov).log_prob(flat)


def test_state_space_far_from_zero_float32_bound_is_the_evidence():
    """A rotating two-dimensional state at a level of 1,000 with steps and noise of 0.1:
    each step's term is formed from (⟨x_t⟩ − A⟨x_{t−1}⟩)² + Cov(x_t − A x_{t−1}) off the
    chain's joint factor (the expanded form put the float32 bound 68 to 137 nats off)."""
    a, c = _rotation(), torch.tensor([[1.0, 0.5], [-0.3, 0.8]], dtype=F64)
    y = _state_space_data(1000.0, a, c, 0.1, 0.1)
    model = level_state_space(1000.0, a, c, 0.1, 0.1)
    f64 = _fit(model, y).objective
    assert _rel(f64, _state_space_evidence(y, 1000.0, a, c, 0.1, 0.1)) < 1e-9
    f32 = _fit(model, y.float()).objective
    assert f32.dtype == torch.float32
    exact = _state_space_evidence(y.float(), 1000.0, a, c, 0.1, 0.1)
    assert (f32.double() - exact).abs().max() < 0.5


@pytest.mark.parametrize("case", ["gp", "walk", "state space"])
def test_the_centred_terms_follow_the_data_device_without_host_syncs(case):
    """The covariance and chain-step forms create nothing on the default device and
    synchronise with the host nowhere inside a sweep (CPU checks: the ``meta`` device and
    a count of synchronisations)."""
    from probfsl.testing import ConformanceCase, assert_device_follows, assert_no_host_syncs

    if case == "gp":
        model, data = gp_fixed_noise(3.0, 0.1), _gp_data(3.0, 1.0)
    elif case == "state space":
        a, c = _rotation(), torch.tensor([[1.0, 0.5], [-0.3, 0.8]], dtype=F64)
        model = level_state_space(10.0, a, c, 0.1, 0.1)
        data = (_state_space_data(10.0, a, c, 0.1, 0.1, n=5),)
    else:
        model, data = level_walk(10.0, 0.1, 0.1, tau=True), (_walk(10.0, 0.1, 0.1),)
    conformance = ConformanceCase(
        make_engine=lambda: VMP(model, tol=0), model=model, data=data, n_steps=4
    )
    assert_device_follows(conformance)
    assert_no_host_syncs(conformance)
