"""``Plan.describe`` / ``VMP.describe``: every factor with its family, named axes and
structure, and a line for each pair of coupled latent sites fitted mean-field; the
``MeanFieldWarning`` at compile time, and its absence from the methods' estimators."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference.vmp import VMP, MeanFieldWarning
from tests.synthetic import bayesian_pca

F64 = torch.float64


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def mixture(x, k=3):
    """A 1-d Gaussian mixture: Dirichlet weights, a Normal mean and a Gamma precision per
    component, a latent label per point."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(1, k)))
        with pyro.plate("classes", k, dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 3.0)).unsqueeze(-2)
            tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), 1.0)).unsqueeze(-2)
        with pyro.plate("points", x.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
            pyro.sample("x", dist.Normal(Vindex(mu)[..., z], Vindex(tau)[..., z].rsqrt()), obs=x)


def regression(y, x):
    """Bayesian linear regression: one joint Gaussian factor over the weights."""
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        alpha = pyro.sample("alpha", dist.Gamma(1.0, 1.0))
        beta = pyro.sample("beta", dist.Gamma(1.0, 0.1))
        w = pyro.sample("w", dist.Normal(x.new_zeros(p), alpha.rsqrt().unsqueeze(-1)).to_event(1))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w).sum(-1), beta.rsqrt()), obs=y)


def random_walk(x):
    """A Gaussian random walk observed in noise: one Gaussian Markov chain factor."""
    t, n = x.shape
    with pyro.plate("tasks", t):
        s = pyro.sample("s0", dist.Normal(x.new_tensor(0.0), 2.0))
        pyro.sample("x0", dist.Normal(s, 1.0), obs=x[:, 0])
        for i in range(1, n):
            s = pyro.sample(f"s{i}", dist.Normal(s, 0.5))
            pyro.sample(f"x{i}", dist.Normal(s, 1.0), obs=x[:, i])


def hmm(x, states=3):
    """A hidden Markov chain with a Normal observation law per state (Pyro's DiscreteHMM)."""
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(states, dtype=x.dtype)))
        a = pyro.sample("A", dist.Dirichlet(torch.ones(states, states, dtype=x.dtype)).to_event(1))
        mu = pyro.sample(
            "mu", dist.Normal(torch.linspace(-2, 2, states, dtype=x.dtype), 1.0).to_event(1)
        )
        tau = pyro.sample(
            "tau", dist.Gamma(2.0 * torch.ones(states, dtype=x.dtype), 1.0).to_event(1)
        )
        obs = dist.Normal(mu.unsqueeze(-2), tau.rsqrt().unsqueeze(-2))
        chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), obs, duration=n)
        pyro.sample("x", chain, obs=x)


def _describe(model, *data):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        return VMP(model).describe(*data)


def _line(text, start):
    """The line of ``text`` whose first word is ``start``."""
    hits = [ln for ln in text.splitlines() if ln.split() and ln.split()[0] == start]
    assert len(hits) == 1, text
    return hits[0]


def test_describe_a_mixture_lists_each_factor_elementwise_and_no_mean_field_pair():
    x = torch.randn(2, 10, generator=_g(), dtype=F64)
    text = _describe(mixture, x)
    assert text.splitlines()[0] == "VMP plan: q is the product of 4 factors"
    assert "Dirichlet" in _line(text, "pi") and "joint over axis pi#e0" in _line(text, "pi")
    for name, family, shape in (
        ("mu", "Normal", "[tasks=2, classes=3]"),
        ("tau", "Gamma", "[tasks=2, classes=3]"),
        ("z", "Categorical", "[tasks=2, points=10]"),
    ):
        line = _line(text, name)
        assert family in line and shape in line and line.endswith("elementwise"), line
    assert "observed: x (Normal [tasks=2, points=10])" in text
    assert "mean-field" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        VMP(mixture).compile(x)  # no coupled Gaussian sites: no warning


def test_describe_bayesian_linear_regression_is_joint_over_the_weights():
    g = _g(1)
    x = torch.randn(3, 15, 4, generator=g, dtype=F64)
    y = torch.randn(3, 15, generator=g, dtype=F64)
    text = _describe(regression, y, x)
    line = _line(text, "w")
    assert "Normal" in line and "[tasks=3, w#e0=4]" in line
    assert line.endswith("joint over axis w#e0")
    assert _line(text, "alpha").endswith("elementwise")
    assert "mean-field" not in text


def test_bayesian_pca_is_mean_field_between_w_and_x_and_warns_naming_them():
    y = torch.randn(2, 12, 4, generator=_g(2), dtype=F64)
    text = _describe(bayesian_pca, y)
    assert _line(text, "W").endswith("joint over axis W#e0")
    assert "[tasks=2, points=12, x#e0=2]" in _line(text, "x")
    assert "mean-field between W and x (coupled through site y)" in text.splitlines()
    with pytest.warns(MeanFieldWarning, match=r"W and x \(through site y\).*describe") as rec:
        plan = VMP(bayesian_pca).compile(y)
    assert len([w for w in rec if w.category is MeanFieldWarning]) == 1
    assert rec[0].filename == __file__  # it names the user's call
    assert plan.mean_field_pairs() == [("W", "x", "y")]
    assert plan.describe() == text
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        VMP(bayesian_pca, warn_mean_field=False).compile(y)
    with pytest.raises(TypeError, match="warn_mean_field"):
        VMP(bayesian_pca, warn_mean_field=1)


def test_a_product_of_two_latent_gaussians_and_a_sum_are_mean_field_lines():
    def product(y):
        t, n = y.shape
        with pyro.plate("tasks", t, dim=-2):
            c = pyro.sample("c", dist.Normal(y.new_tensor(1.0), 1.0))
            mu = pyro.sample("mu", dist.Normal(y.new_tensor(0.0), 1.0))
            b = pyro.sample("b", dist.Normal(y.new_tensor(0.0), 1.0))
            with pyro.plate("n", n, dim=-1):
                pyro.sample("y", dist.Normal(c * mu, 1.0), obs=y)
                pyro.sample("v", dist.Normal(mu + b, 1.0), obs=y)

    y = torch.randn(2, 5, generator=_g(3), dtype=F64)
    lines = _describe(product, y).splitlines()
    assert "mean-field between c and mu (coupled through site y)" in lines
    assert "mean-field between mu and b (coupled through site v)" in lines
    with pytest.warns(MeanFieldWarning, match=r"c and mu .*; mu and b "):
        VMP(product).compile(y)


def test_a_latent_mean_of_a_plate_of_latent_normals_is_a_mean_field_line():
    """A Normal-Normal hierarchy (m the mean of a plate of w_j) is fitted q(m) q(w), below
    the exact evidence: it is named and warned about like the sum m + w_j it equals."""

    def hierarchy(y):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            m = pyro.sample("m", dist.Normal(y.new_tensor(0.0), 3.0))
            with pyro.plate("groups", y.shape[1], dim=-1):
                w = pyro.sample("w", dist.Normal(m, 1.0))
                pyro.sample("y", dist.Normal(w, 0.5), obs=y)

    y = torch.randn(2, 5, generator=_g(3), dtype=F64) + 2
    assert "mean-field between m and w (coupled through site w)" in _describe(hierarchy, y)
    with pytest.warns(MeanFieldWarning, match=r"m and w \(through site w\)"):
        state, _ = VMP(hierarchy, tol=1e-13, max_iter=3000).fit(y)
    cov = 1.25 * torch.eye(5, dtype=F64) + 9.0
    exact = torch.distributions.MultivariateNormal(y.new_zeros(5), cov).log_prob(y)
    assert bool((state.objective < exact - 1e-3).all())  # mean field: strictly below


def test_describe_a_gaussian_chain_is_one_factor():
    x = torch.randn(2, 5, generator=_g(4), dtype=F64).cumsum(-1)
    text = _describe(random_walk, x)
    assert text.splitlines()[0] == "VMP plan: q is the product of 1 factor"
    line = _line(text, "chain:s0")
    assert "[tasks=2] x 5 steps" in line
    assert line.endswith("Gaussian Markov chain over s0 -> s1 -> s2 -> s3 -> s4")
    assert "mean-field" not in text


def test_describe_an_hmm_lists_its_forward_backward_chain():
    x = torch.randn(2, 20, generator=_g(5), dtype=F64)
    text = _describe(hmm, x)
    assert "joint over axis A#e1" in _line(text, "A")
    line = _line(text, "x")
    assert "(hidden chain)" in line and "Categorical" in line
    assert "x#s=3" in line and "forward-backward chain over axis" in line
    assert "mean-field" not in text


def _no_mean_field_warning(fit):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # other notes of a quick fit
        warnings.simplefilter("error", MeanFieldWarning)
        fit()


def _base_and_episodes():
    """Base features [60, 8] of 4 classes and a batch of two 3-way 2-shot tasks."""
    from probfsl.models.base import episodes_from_arrays

    gen = _g(0)
    labels = torch.arange(60) % 4
    x = torch.randn(60, 8, generator=gen, dtype=F64) + 2 * labels[:, None]
    support = x[:6].reshape(1, 6, 8).repeat(2, 1, 1) + 0.1
    support_labels = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    query = x[6:12].reshape(1, 6, 8).repeat(2, 1, 1) - 0.1
    episodes, _, _ = episodes_from_arrays(support, support_labels, query)
    return (x, labels), episodes


#: the methods' estimators that run VMP, with small settings (a quick fit)
ESTIMATORS = {
    "bavardage": {"engine": "derived"},
    "bavardage-gamma": {},
    "em-dirichlet": {"engine": "derived", "n_iter": 3},
    "evidence-lssvm": {"engine": "derived"},
    "gp-tree": {"engine": "derived"},
    "slem": {"engine": "derived"},
    "vmp-gmm": {},
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_the_methods_estimators_emit_no_mean_field_warning(name):
    from probfsl import make_estimator

    base, episodes = _base_and_episodes()

    def fit():
        est = make_estimator(name, **ESTIMATORS[name]).fit_base(*base)
        if name == "em-dirichlet":
            x, y = base
            est.set_class_features(torch.stack([x[y == c].mean(0) for c in range(4)]))
        est.predict(episodes)

    _no_mean_field_warning(fit)


def test_gp_tree_variational_nodes_emit_no_mean_field_warning():
    """GP-Tree's inducing-point nodes fit q(u) p(eps), the sparse GP's factorisation:
    mean-field by design, and silent."""
    from probfsl.models.gp_tree import GPTree

    (x, y), _ = _base_and_episodes()
    kw = dict(inference="vi", vi_iter=2, n_inducing=2, kmeans_n_init=2)
    _no_mean_field_warning(lambda: GPTree(engine="derived", **kw).fit(x.numpy(), y.numpy()))


def test_describe_a_logistic_site_lists_its_polya_gamma_factors():
    def logistic(y, x):
        t, n, p = x.shape
        with pyro.plate("tasks", t, dim=-2):
            w = pyro.sample("w", dist.Normal(x.new_zeros(p), 1.0).to_event(1))
            with pyro.plate("n", n, dim=-1):
                pyro.sample("y", dist.Bernoulli(logits=(x * w).sum(-1)), obs=y)

    g = _g(6)
    x = torch.randn(2, 8, 3, generator=g, dtype=F64)
    y = (torch.rand(2, 8, generator=g, dtype=F64) < 0.5).to(F64)
    text = _describe(logistic, y, x)
    assert _line(text, "w").endswith("joint over axis w#e0")
    line = _line(text, "y")
    assert "(Pólya-Gamma)" in line and "[tasks=2, n=8]" in line and line.endswith("elementwise")
