"""VMP takes integer (and bool) data where a family's data are whole numbers or labels:
counts (Poisson, Binomial, Multinomial), Bernoulli outcomes, a Categorical site's labels
and the labels of a hidden Markov chain with Categorical emissions. They are read in the
model's floating dtype with the same checks as float data, so int64 and int32 data give
bit for bit the posterior and the bound of the same data in float64. A real-valued site
(a Normal, a chain with Normal emissions) still refuses them, and counts outside their
support are refused as before."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference import VMP

F64 = torch.float64
INTEGER_DTYPES = (torch.int64, torch.int32)


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ models
# Every parameter is float64 whatever the data's dtype: the model's floating dtype.
def gamma_poisson(k):
    with pyro.plate("tasks", k.shape[0], dim=-2):
        lam = pyro.sample("lam", dist.Gamma(torch.tensor(2.0, dtype=F64), 1.0))
        with pyro.plate("n", k.shape[1], dim=-1):
            pyro.sample("k", dist.Poisson(lam), obs=k)


def beta_binomial(y, n=6):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        p = pyro.sample("p", dist.Beta(torch.tensor(1.5, dtype=F64), 2.0))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Binomial(n, p), obs=y)


def beta_bernoulli(y):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        p = pyro.sample("p", dist.Beta(torch.tensor(1.5, dtype=F64), 2.0))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Bernoulli(p), obs=y)


def dirichlet_multinomial(x, n=10):
    t, d, v = x.shape
    with pyro.plate("tasks", t, dim=-2):
        theta = pyro.sample("theta", dist.Dirichlet(torch.full((1, v), 0.8, dtype=F64)))
        with pyro.plate("docs", d, dim=-1):
            pyro.sample("x", dist.Multinomial(n, theta), obs=x)


def categorical_hmm(x, states=2):
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(states, dtype=F64)))
        a = pyro.sample("A", dist.Dirichlet(torch.ones(states, states, dtype=F64)).to_event(1))
        prior = torch.tensor([[3.0, 1.0, 0.5], [0.5, 1.0, 3.0]], dtype=F64)
        b = pyro.sample("B", dist.Dirichlet(prior).to_event(1))
        emission = dist.Categorical(probs=b.unsqueeze(-3))
        chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), emission, duration=n)
        pyro.sample("x", chain, obs=x)


def normal_hmm(x, states=2):
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(states, dtype=F64)))
        a = pyro.sample("A", dist.Dirichlet(torch.ones(states, states, dtype=F64)).to_event(1))
        mu = pyro.sample("mu", dist.Normal(torch.zeros(states, dtype=F64), 3.0).to_event(1))
        tau = pyro.sample("tau", dist.Gamma(torch.full((states,), 2.0, dtype=F64), 1.0).to_event(1))
        emission = dist.Normal(mu.unsqueeze(-2), tau.rsqrt().unsqueeze(-2))
        chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), emission, duration=n)
        pyro.sample("x", chain, obs=x)


def labelled_mixture(x, labels, way=3):
    """A Gaussian mixture whose labels are observed (the labels index the means, so the
    model takes them as integers whatever their dtype)."""
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(1, way, dtype=F64)))
        with pyro.plate("classes", way, dim=-1):
            mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 5.0))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels)
            pyro.sample("x", dist.Normal(Vindex(mu.unsqueeze(-2))[..., z.long()], 1.0), obs=x)


def normal_mean(x):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=F64), 3.0))
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


# ------------------------------------------------------------------------------ data
def _counts():
    return torch.randint(0, 7, (3, 12), generator=_g(0))


def _binomial():
    return torch.randint(0, 7, (3, 12), generator=_g(1))


def _outcomes():
    return torch.randint(0, 2, (3, 12), generator=_g(2))


def _documents():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = torch.multinomial(probs.expand(3 * 5, 4), 10, replacement=True, generator=_g(3))
    counts = torch.nn.functional.one_hot(draws, 4).sum(-2)
    return counts.reshape(3, 5, 4)


def _chain_labels():
    return torch.randint(0, 3, (3, 15), generator=_g(4))


def _mixture():
    labels = torch.randint(0, 3, (3, 10), generator=_g(5))
    x = 2.0 * labels.double() + torch.randn(3, 10, generator=_g(6), dtype=F64)
    return x, labels


# ---------------------------------------------------------------------------- checks
def _fit(model, *args):
    state, _ = VMP(model, tol=1e-12, max_iter=500, warn=False).fit(*args)
    return state


def _assert_identical(a, b):
    """The same bound and the same factors, bit for bit."""
    assert torch.equal(a.objective, b.objective)
    assert a.q.keys() == b.q.keys()
    for name in a.q:
        assert len(a.q[name]) == len(b.q[name])
        for u, v in zip(a.q[name], b.q[name], strict=True):
            assert u.dtype == v.dtype
            assert torch.equal(u, v), name


CASES = {
    "poisson": (gamma_poisson, _counts),
    "binomial": (beta_binomial, _binomial),
    "multinomial": (dirichlet_multinomial, _documents),
    "categorical_hmm": (categorical_hmm, _chain_labels),
}


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_integer_counts_and_labels_match_float64(case, dtype):
    model, data = CASES[case]
    x = data()
    want = _fit(model, x.to(F64))
    got = _fit(model, x.to(dtype))
    _assert_identical(got, want)
    assert got.objective.dtype == F64


@pytest.mark.parametrize("dtype", (torch.bool, *INTEGER_DTYPES), ids=str)
def test_bernoulli_bool_and_integer_outcomes_match_float64(dtype):
    y = _outcomes()
    want = _fit(beta_bernoulli, y.to(F64))
    _assert_identical(_fit(beta_bernoulli, y.to(dtype)), want)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_observed_mixture_labels_match_float64(dtype):
    x, labels = _mixture()
    want = _fit(labelled_mixture, x, labels.to(F64))
    _assert_identical(_fit(labelled_mixture, x, labels.to(dtype)), want)


def test_float_data_of_a_real_valued_site_still_required():
    x = torch.randint(-3, 4, (2, 6), generator=_g(7))
    with pytest.raises(ValueError, match=r"its data are torch.int64; give float32 or float64"):
        _fit(normal_mean, x)


def test_a_chain_with_normal_emissions_still_refuses_integers():
    x = torch.randint(-3, 4, (2, 8), generator=_g(8))
    with pytest.raises(ValueError, match=r"its data are torch.int64; give float32 or float64"):
        _fit(normal_hmm, x)


def _refusal(model, x):
    with pytest.raises(ValueError) as err:
        _fit(model, x)
    return str(err.value)


def test_negative_counts_still_refused():
    k = _counts()
    k[1, 3] = -2
    message = _refusal(gamma_poisson, k.to(F64))
    assert "its data must be whole numbers >= 0" in message
    for dtype in INTEGER_DTYPES:
        assert _refusal(gamma_poisson, k.to(dtype)) == message


def test_counts_over_total_count_still_refused():
    y = _binomial()
    y[0, 0] = 9
    message = _refusal(beta_binomial, y.to(F64))
    assert "its data exceed their total_count" in message
    assert _refusal(beta_binomial, y) == message


def test_multinomial_rows_off_their_total_still_refused():
    x = _documents()
    x[1, 2, 0] += 1
    message = _refusal(dirichlet_multinomial, x.to(F64))
    assert "must sum to its total_count 10" in message
    assert _refusal(dirichlet_multinomial, x) == message


@pytest.mark.parametrize("label", (3, -1))
def test_chain_labels_out_of_range_still_refused(label):
    x = _chain_labels()
    x[2, 4] = label
    message = _refusal(categorical_hmm, x.to(F64))
    assert "its data must be labels 0 to 2" in message
    assert f"entry 4 is {label}." in message
    for dtype in INTEGER_DTYPES:
        assert _refusal(categorical_hmm, x.to(dtype)) == message


def test_non_whole_counts_still_refused():
    k = _counts().to(F64)
    k[0, 1] = 1.5
    assert "its data must be whole numbers >= 0" in _refusal(gamma_poisson, k)
