"""VMP's usability: any update order, starting values and continued fits, convergence
reported (trace, sweeps, a warning at max_iter), and refusals that lead with the reason."""

import itertools
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference import VMP
from probfsl.inference.vmp import ConvergenceWarning
from probfsl.inference.vmp.checks import DOCS
from probfsl.inference.vmp.supported import SUPPORTED
from tests.synthetic import bayesian_pca

# these models couple latent Gaussian sites that VMP fits mean-field on purpose
pytestmark = pytest.mark.filterwarnings("ignore::probfsl.inference.vmp.MeanFieldWarning")

F64 = torch.float64
SITES = ["alpha", "tau", "W", "x"]


def pca_data(t=2, n=20, d=4, k=2, noise=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(t, d, k, generator=g, dtype=F64)
    x = torch.randn(t, n, k, generator=g, dtype=F64)
    return x @ w.transpose(-1, -2) + noise * torch.randn(t, n, d, generator=g, dtype=F64)


def normal_mean(y):
    t, n = y.shape
    with pyro.plate("tasks", t, dim=-2):
        mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 10.0))
        tau = pyro.sample("tau", dist.Gamma(y.new_tensor(1.0), 1.0))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal(mu, tau.rsqrt()), obs=y)


# --- the update order -----------------------------------------------------------------


def test_a_site_before_its_gamma_parent_starts_as_the_default_order():
    """``init`` follows the model's declaration order whatever ``order`` is: a site placed
    before its Gamma parent starts from the same factors as the default order."""
    y = pca_data(t=1, n=8, d=3)
    ref = VMP(bayesian_pca).init(y)
    state = VMP(bayesian_pca, order=["x", "W", "alpha", "tau"]).init(y)
    assert torch.equal(state.objective, ref.objective)


@pytest.mark.slow
def test_every_order_of_bayesian_pca_starts_and_converges_alike():
    """Every one of the 24 orders starts from the same factors and converges to the default
    order's bound (from a start that leaves the W = x = 0 saddle)."""
    y = pca_data(t=1, n=12, d=3)
    w0 = torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    ref_start = VMP(bayesian_pca).init(y, init={"W": w0})
    ref, _ = VMP(bayesian_pca, tol=1e-10, max_iter=2000).fit(state=ref_start)
    for order in itertools.permutations(SITES):
        vmp = VMP(bayesian_pca, order=list(order), tol=1e-10, max_iter=2000)
        start = vmp.init(y, init={"W": w0})
        assert torch.equal(start.objective, ref_start.objective), order
        state, info = vmp.fit(state=start)
        assert bool(info.converged.all()), order
        torch.testing.assert_close(state.objective, ref.objective, rtol=1e-6, atol=0)


def test_an_order_that_is_not_a_permutation_is_refused():
    with pytest.raises(ValueError, match="order must list the latent sites"):
        VMP(bayesian_pca, order=["x", "W", "alpha"]).init(pca_data(t=1, n=5))


# --- convergence reported -------------------------------------------------------------


def test_fit_reports_trace_sweeps_and_convergence():
    y = 1.0 + torch.randn(3, 10, generator=torch.Generator().manual_seed(0), dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        state, info = VMP(normal_mean, tol=1e-10, max_iter=500).fit(y)
    assert bool(info.converged.all())
    assert info.trace.shape == (int(info.n_steps.max()) + 1, 3)
    assert info.trace.dtype == F64
    torch.testing.assert_close(info.trace[-1], state.objective)
    # each task stopped at the first sweep whose relative change met tol
    for t in range(3):
        n = int(info.n_steps[t])
        step = (info.trace[n, t] - info.trace[n - 1, t]).abs()
        assert step <= 1e-10 * max(1.0, abs(float(info.trace[n - 1, t])))


def test_a_fit_stopped_at_max_iter_warns_naming_how_many_tasks():
    y = 1.0 + torch.randn(3, 10, generator=torch.Generator().manual_seed(0), dtype=F64)
    with pytest.warns(ConvergenceWarning, match=r"stopped 3 of 3 task\(s\) at max_iter = 2"):
        _, info = VMP(normal_mean, tol=1e-12, max_iter=2).fit(y)
    assert not bool(info.converged.any()) and info.n_steps.tolist() == [2, 2, 2]
    with pytest.warns(ConvergenceWarning, match="rounding of the bound"):
        VMP(normal_mean, tol=1e-16, max_iter=3).fit(y)
    with warnings.catch_warnings():  # tol = 0 asks for every sweep: nothing to warn about
        warnings.simplefilter("error", ConvergenceWarning)
        VMP(normal_mean, tol=0, max_iter=2).fit(y)
    with warnings.catch_warnings():  # a fixed budget by design: converged still says so
        warnings.simplefilter("error", ConvergenceWarning)
        _, quiet = VMP(normal_mean, tol=1e-12, max_iter=2, warn=False).fit(y)
    assert not bool(quiet.converged.any())
    with pytest.raises(TypeError, match="warn must be True or False"):
        VMP(normal_mean, warn="no")


def test_estimators_with_a_sweep_budget_do_not_warn():
    from probfsl.data import load_dataset, sample_episodes
    from probfsl.models.vmp_gmm import VMPGaussianMixture

    fs = load_dataset("omniglot")
    episodes = sample_episodes(fs, 4, way=5, shot=1, n_query=25, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        VMPGaussianMixture(max_iter=2).fit_featureset(fs).predict_proba(episodes)


def test_a_fit_continues_from_a_state():
    """Fitting 3 sweeps, then 4 more from that state, equals 7 sweeps at once."""
    y = 1.0 + torch.randn(2, 10, generator=torch.Generator().manual_seed(0), dtype=F64)
    whole, _ = VMP(normal_mean, tol=0, max_iter=7).fit(y)
    part, _ = VMP(normal_mean, tol=0, max_iter=3).fit(y)
    rest, info = VMP(normal_mean, tol=0, max_iter=4).fit(state=part)
    assert info.trace.shape == (5, 2)
    torch.testing.assert_close(rest.objective, whole.objective, rtol=1e-12, atol=0)
    for name in whole.q:
        for a, b in zip(rest.q[name], whole.q[name], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="continues that state's fit"):
        VMP(normal_mean).fit(y, state=part)


# --- starting values ------------------------------------------------------------------


def test_a_value_start_sets_the_factor_mean_and_is_kept_through_init():
    y = pca_data(t=2, n=6, d=3)
    w0 = torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(3), dtype=F64)
    vmp = VMP(bayesian_pca)
    state = vmp.init(y, init={"W": w0, "tau": torch.full((2, 1, 1), 4.0, dtype=F64)})
    post = vmp.posterior(state)
    torch.testing.assert_close(post["W"].mean, w0.unsqueeze(1))
    torch.testing.assert_close(post["tau"].mean, torch.full((2, 1, 1), 4.0, dtype=F64))
    # x was updated from the given W, so the saddle is left
    assert bool((post["x"].mean.abs().sum((1, 2, 3)) > 0).all())
    zero = vmp.init(y)
    assert float(vmp.posterior(zero)["W"].mean.abs().max()) == 0.0  # the W = x = 0 saddle


def test_a_prior_start_is_seeded_per_site_and_shared_by_the_tasks():
    y = pca_data(t=2, n=6, d=3)
    a = VMP(bayesian_pca, seed=5).init(y, init="prior")
    b = VMP(bayesian_pca, seed=5, init="prior").init(y)
    c = VMP(bayesian_pca, seed=6).init(y, init="prior")
    only_w = VMP(bayesian_pca, seed=5).init(y, init={"W": "prior"})
    assert torch.equal(a.q["W"][0], b.q["W"][0]) and torch.equal(a.q["x"][0], b.q["x"][0])
    assert not torch.equal(a.q["W"][0], c.q["W"][0])
    assert torch.equal(only_w.q["W"][0], a.q["W"][0])  # W's draws do not depend on x's
    assert torch.equal(a.q["W"][0][0], a.q["W"][0][1])  # the tasks share the draws
    assert bool(a.q["W"][0].abs().gt(0).all())


def test_a_state_starts_new_data_of_the_same_shapes():
    y = pca_data(t=2, n=6, d=3)
    first, _ = VMP(bayesian_pca, tol=0, max_iter=5, init="prior").fit(y)
    again = VMP(bayesian_pca).init(y, init=first)
    torch.testing.assert_close(again.objective, first.objective, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="factor of 'x' is for shape"):
        VMP(bayesian_pca).init(pca_data(t=2, n=7, d=3), init=first)


def test_bad_starts_are_refused_in_one_sentence():
    y = pca_data(t=1, n=6, d=3)
    with pytest.raises(ValueError, match="'nope', which is not a latent site"):
        VMP(bayesian_pca).init(y, init={"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"init\['W'\] must have the site's shape"):
        VMP(bayesian_pca).init(y, init={"W": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match='may be "prior" only for a latent Normal'):
        VMP(bayesian_pca).init(y, init={"tau": "prior"})
    with pytest.raises(ValueError, match="must be positive"):
        VMP(bayesian_pca).init(y, init={"tau": -torch.ones(1, 1, 1)})


@pytest.mark.slow
def test_a_random_start_leaves_the_bayesian_pca_saddle():
    """From the zero start W = x = 0 stays exactly (a saddle, which the fit reports); from W
    drawn from its prior the bound is clearly better on every task."""
    y = pca_data(t=2, n=30, d=5)
    with pytest.warns(ConvergenceWarning, match="saddle point"):
        zero, _ = VMP(bayesian_pca, tol=1e-8, max_iter=300).fit(y)
    vmp = VMP(bayesian_pca, tol=1e-8, max_iter=3000, init={"W": "prior"}, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        drawn, _ = vmp.fit(y)
    assert float(VMP(bayesian_pca).posterior(zero)["W"].mean.abs().max()) == 0.0
    assert bool((drawn.objective > zero.objective + 50).all())


def test_a_fit_stopped_at_the_bayesian_pca_saddle_says_so():
    """The default start of Bayesian PCA stops at W = x = 0 (means exactly 0): the fit warns,
    names both sites and the start that leaves it; a drawn start does not warn so."""
    y = pca_data(t=2, n=8, d=3)
    with pytest.warns(ConvergenceWarning, match=r"means of 'W' and 'x' .* in 2 of 2 task"):
        VMP(bayesian_pca, tol=1e-8, max_iter=300).fit(y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        VMP(bayesian_pca, tol=0, max_iter=5, init={"W": "prior"}).fit(y)
    assert not [w for w in caught if "saddle" in str(w.message)]


def _two_clusters_mixture(y):
    """A two-component 1-d Gaussian mixture, the components in a plate."""
    with pyro.plate("tasks", y.shape[0], dim=-2):
        w = pyro.sample("w", dist.Dirichlet(y.new_ones(2)))
        with pyro.plate("comp", 2, dim=-1):
            mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 5.0))
            tau = pyro.sample("tau", dist.Gamma(y.new_tensor(2.0), 2.0))
        with pyro.plate("n", y.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(w))
            loc, prec = Vindex(mu.unsqueeze(-2))[..., z], Vindex(tau.unsqueeze(-2))[..., z]
            pyro.sample("y", dist.Normal(loc, prec.rsqrt()), obs=y)


def test_the_default_start_of_a_mixture_leaves_its_symmetric_point():
    """Two clusters at ±2: the default start (responsibilities drawn from Dirichlet(1))
    reaches the bound of a long fit on every task at the default tol; the near-uniform
    start 1 + 0.1 U(0, 1) stopped at the saddle where both means coincide (2 of 3 tasks,
    8.6 to 9.6 nats below)."""
    g = torch.Generator().manual_seed(14)
    z = torch.randint(0, 2, (3, 40), generator=g)
    y = torch.tensor([-2.0, 2.0], dtype=F64)[z] + torch.randn(3, 40, generator=g, dtype=F64)
    state, _ = VMP(_two_clusters_mixture).fit(y)
    best, _ = VMP(_two_clusters_mixture, tol=1e-12, max_iter=3000).fit(y)
    torch.testing.assert_close(state.objective, best.objective, rtol=1e-4, atol=0)
    means = VMP(_two_clusters_mixture).posterior(state)["mu"].mean.reshape(3, 2)
    assert bool(((means[:, 0] - means[:, 1]).abs() > 2).all())
    noise = torch.rand(40, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    old = (1 + 0.1 * noise).expand(3, 40, 2)
    stuck, _ = VMP(_two_clusters_mixture).fit(y, init_resp={"z": old})
    assert bool((stuck.objective < best.objective - 1).any())


# --- refusals -------------------------------------------------------------------------


def undeclared_axis(y):
    t, n = y.shape
    with pyro.plate("tasks", t, dim=-2):
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(1, n), 1.0))
        pyro.sample("y", dist.Normal(mu, 1.0).to_event(1), obs=y.unsqueeze(-2))


def logistic_scale(y):
    t, n = y.shape
    with pyro.plate("tasks", t, dim=-2):
        s = pyro.sample("s", dist.Normal(y.new_tensor(0.0), 1.0))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal(0.0, s.exp()), obs=y)


def test_refusals_lead_with_the_reason_and_point_to_the_docs():
    y = torch.randn(2, 4, dtype=F64)
    with pytest.raises(ValueError) as err:
        VMP(logistic_scale).init(y)
    text = str(err.value)
    assert text.startswith("VMP cannot use site 'y' (Normal)")
    assert text.endswith(f"The supported forms are listed in {DOCS}.")
    assert SUPPORTED not in text and len(text) < 600


def test_an_undeclared_batch_axis_is_named_by_its_dim_and_size():
    with pytest.raises(
        ValueError,
        match=r"site 'mu' \(Normal\): its batch axis at dim -1 "
        r"\(size 4, batch shape \(2, 4\)\) is not declared by a plate",
    ):
        VMP(undeclared_axis).init(torch.randn(2, 4, dtype=F64))


# ------------------------------------------------------------------ Pyro's plate habits
def _normal_means(t, *, dims=(-2, -1), tasks_size=None):
    """y[t, n] ~ N(mu_t, 1), mu_t ~ N(0, 2²); the tasks plate's size given (a constant of
    the model) or read off the data, its plates at ``dims``."""

    def model(y):
        tasks_axis = 1 if dims[0] == -1 else 0
        size = tasks_size or y.shape[tasks_axis]
        with pyro.plate("tasks", size, dim=dims[0]):
            mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), y.new_tensor(2.0)))
            with pyro.plate("n", y.shape[1 - tasks_axis], dim=dims[1]):
                pyro.sample("y", dist.Normal(mu, y.new_tensor(1.0)), obs=y)

    return model


def _exact_normal_means(y):
    """ln p(y_t) = ln N(y_t | 0, 2² 11ᵀ + I), per task (rows of y)."""
    n = y.shape[1]
    cov = 4.0 * torch.ones(n, n, dtype=F64) + torch.eye(n, dtype=F64)
    return dist.MultivariateNormal(torch.zeros(n, dtype=F64), cov).log_prob(y)


def test_a_tasks_plate_of_a_fixed_size_is_fitted_exactly():
    """``pyro.plate("tasks", T)`` with T a constant of the model (equal to the data's
    leading axis): the structure check cannot run the model on one task, and checks on
    every task instead."""
    y = torch.randn(3, 10, dtype=F64, generator=torch.Generator().manual_seed(0))
    state, _ = VMP(_normal_means(3, tasks_size=3), tol=1e-13).fit(y)
    assert torch.allclose(state.objective, _exact_normal_means(y), rtol=1e-12, atol=0)


def test_pyros_default_plate_dims_with_the_tasks_last_are_fitted_exactly():
    """Plates without ``dim=``: tasks at dim -1 and the points at dim -2, the data [N, T]
    (Pyro's own default layout), give the bound of the data's transpose."""
    y = torch.randn(3, 10, dtype=F64, generator=torch.Generator().manual_seed(1))
    state, _ = VMP(_normal_means(3, dims=(-1, -2)), tol=1e-13).fit(y.T.contiguous())
    assert torch.allclose(state.objective, _exact_normal_means(y), rtol=1e-12, atol=0)


def test_two_plates_at_one_dim_are_named_in_the_refusal():
    """A parent in plate 'dims' and its child in another plate 'dims_' of the same dim and
    size: Pyro pairs their entries, VMP reads plates by name; the refusal names both."""

    def factor_analysis(y):
        t, n, d = y.shape
        with pyro.plate("tasks", t, dim=-3):
            with pyro.plate("dims", d, dim=-1):
                w = pyro.sample("W", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
            with pyro.plate("points", n, dim=-2):
                x = pyro.sample("x", dist.Normal(y.new_zeros(2), 1.0).to_event(1))
                with pyro.plate("dims_", d, dim=-1):
                    pyro.sample("y", dist.Normal((w * x).sum(-1), 1.0), obs=y)

    with pytest.raises(ValueError, match="plate 'dims' and the site's plate 'dims_' are two"):
        VMP(factor_analysis).fit(torch.randn(2, 10, 3, dtype=F64))


def test_vector_emissions_of_an_hmm_are_refused_naming_the_event_shape():
    def hmm(x):
        t, n = x.shape[:2]
        with pyro.plate("tasks", t, dim=-1):
            pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(2)))
            a = pyro.sample("A", dist.Dirichlet(x.new_ones(2, 2)).to_event(1))
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(2, 3), 3.0).to_event(2))
            emission = dist.Normal(mu.unsqueeze(-3), 1.0).to_event(1)
            law = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), emission, duration=n)
            pyro.sample("x", law, obs=x)

    with pytest.raises(ValueError, match=r"event shape \(3,\): vector emissions"):
        VMP(hmm).fit(torch.randn(2, 12, 3, dtype=F64))
