"""The exponential-family blocks against torch.distributions: entropy, KL, log-density and
expected sufficient statistics (closed form or Monte Carlo)."""

import pytest
import torch
import torch.distributions as td

from probfsl.inference import expfam
from probfsl.inference.expfam.block import max_axis, sum_axis

G = torch.Generator().manual_seed(0)


def _pos(*shape, dtype=torch.float64):
    return 0.5 + 2 * torch.rand(*shape, generator=G, dtype=dtype)


def _spd(*batch, d=3, dtype=torch.float64):
    a = torch.randn(*batch, d, d, generator=G, dtype=dtype)
    return a @ a.transpose(-1, -2) / d + 0.5 * torch.eye(d, dtype=dtype)


def _pairs(dtype=torch.float64):
    """(block, another block of the same family, u(x) as a function of a sample)."""
    b = (4, 2)
    return {
        "normal": (
            expfam.Normal(torch.randn(*b, generator=G, dtype=dtype), _pos(*b, dtype=dtype)),
            expfam.Normal(torch.randn(*b, generator=G, dtype=dtype), _pos(*b, dtype=dtype)),
            lambda x: (x, x**2),
        ),
        "normal-diag": (
            expfam.Normal(torch.randn(*b, 5, generator=G, dtype=dtype), _pos(*b, 5), 1),
            expfam.Normal(torch.randn(*b, 5, generator=G, dtype=dtype), _pos(*b, 5), 1),
            lambda x: (x, x**2),
        ),
        "gamma": (
            expfam.Gamma(_pos(*b, dtype=dtype), _pos(*b, dtype=dtype)),
            expfam.Gamma(_pos(*b, dtype=dtype), _pos(*b, dtype=dtype)),
            lambda x: (x, x.log()),
        ),
        "beta": (
            expfam.Beta(_pos(*b, dtype=dtype), _pos(*b, dtype=dtype)),
            expfam.Beta(_pos(*b, dtype=dtype), _pos(*b, dtype=dtype)),
            lambda x: (x.log(), (-x).log1p()),
        ),
        "dirichlet": (
            expfam.Dirichlet(_pos(*b, 4, dtype=dtype)),
            expfam.Dirichlet(_pos(*b, 4, dtype=dtype)),
            lambda x: (x.log(),),
        ),
        "categorical": (
            expfam.Categorical(torch.softmax(torch.randn(*b, 4, generator=G, dtype=dtype), -1)),
            expfam.Categorical(torch.softmax(torch.randn(*b, 4, generator=G, dtype=dtype), -1)),
            lambda x: (torch.nn.functional.one_hot(x, 4).to(dtype),),
        ),
        "mvn": (
            expfam.MultivariateNormal(torch.randn(*b, 3, generator=G, dtype=dtype), _spd(*b)),
            expfam.MultivariateNormal(torch.randn(*b, 3, generator=G, dtype=dtype), _spd(*b)),
            lambda x: (x, x.unsqueeze(-1) * x.unsqueeze(-2)),
        ),
        "wishart": (
            expfam.Wishart(5 + _pos(*b, dtype=dtype), _spd(*b)),
            expfam.Wishart(5 + _pos(*b, dtype=dtype), _spd(*b)),
            lambda x: (x, torch.logdet(x)),
        ),
    }


NAMES = list(_pairs())


@pytest.mark.parametrize("name", NAMES)
def test_entropy_and_kl_match_torch(name):
    q, p, _ = _pairs()[name]
    torch.testing.assert_close(q.entropy(), q.distribution().entropy(), rtol=1e-10, atol=1e-10)
    if name != "wishart":  # torch has no Wishart KL; checked by Monte Carlo below
        kl = td.kl_divergence(q.distribution(), p.distribution())
        torch.testing.assert_close(q.kl(p), kl, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:Singular sample")
@pytest.mark.parametrize("name", NAMES)
def test_expected_stats_and_log_prob_by_monte_carlo(name):
    q, p, u = _pairs()[name]
    torch.manual_seed(1)
    x = q.distribution().sample((40000,))
    # log-density: eta . u(x) - A equals torch's log_prob exactly, point by point
    exact = p.expected_log_prob(u(x))
    torch.testing.assert_close(exact, p.distribution().log_prob(x), rtol=1e-9, atol=1e-9)
    # expected sufficient statistics
    for mc, closed in zip(u(x), q.expected_stats(), strict=True):
        err = (mc.mean(0) - closed).abs()
        se = mc.std(0) / len(x) ** 0.5
        assert bool((err <= 6 * se + 1e-12).all()), name
    # KL(q || p) by Monte Carlo
    lr = q.distribution().log_prob(x) - p.distribution().log_prob(x)
    assert bool(((lr.mean(0) - q.kl(p)).abs() <= 6 * lr.std(0) / len(x) ** 0.5 + 1e-9).all())


@pytest.mark.parametrize("name", ["normal", "gamma", "dirichlet", "mvn", "wishart"])
def test_natural_round_trip_and_dtype(name):
    q, _, _ = _pairs()[name]
    back = type(q).from_natural(*q.natural(), event_dim=q.event_dim)
    for a, b in zip(back.natural(), q.natural(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    q32 = type(q).from_natural(*(e.float() for e in q.natural()))
    assert q32.entropy().dtype == torch.float32
    torch.testing.assert_close(q32.entropy().double(), q.entropy(), rtol=1e-4, atol=1e-4)


def test_categorical_one_hot_entropy_is_zero():
    q = expfam.Categorical(torch.eye(3, dtype=torch.float64))
    assert torch.equal(q.entropy(), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("rows", [3, 5000])
def test_sum_axis_is_torch_sum_bit_for_bit(dtype, n, rows):
    """The chain of additions over a short axis gives exactly ``x.sum(-1)``, for values of
    very different sizes (where the order of the additions shows), with and without
    keepdim, on small and large tensors, on contiguous and strided last axes; the chain of
    maxima gives ``amax``."""
    g = torch.Generator().manual_seed(n)
    scale = torch.logspace(-6, 6, n, dtype=dtype)
    x = torch.randn(rows, 2, n, generator=g, dtype=dtype) * scale
    for t in (x, x.transpose(0, 2).contiguous().transpose(0, 2)):
        assert torch.equal(sum_axis(t), t.sum(-1))
        assert torch.equal(sum_axis(t, keepdim=True), t.sum(-1, keepdim=True))
        assert torch.equal(max_axis(t, keepdim=True), t.amax(-1, keepdim=True))
    x[0, 0, -1] = float("nan")  # NaN wins the maximum, as in amax
    assert torch.equal(max_axis(x).isnan(), x.amax(-1).isnan())
