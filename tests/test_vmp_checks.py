"""What VMP refuses at plan time, each refusal naming the site: a parameter that a Python
branch on a latent value changes, data outside their family's support (Dirichlet rows off
the simplex, Gamma data <= 0, Beta data outside (0, 1), counts and labels out of range),
and a Poisson rate c · λ of 0 (a zero exposure) where a count above 0 is observed; and
the models next to them that are accepted (a fixed parameter computed from every task's
data, a branch on a region the compiler's probe values never reach)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.inference import VMP
from tests.test_vmp_families import (
    beta_bernoulli,
    beta_binomial,
    gamma_gamma_observed,
    gamma_poisson,
)
from tests.test_vmp_points import _simplex_data, dirichlet_mixture

F64 = torch.float64


def _x(t=4, n=10, seed=0):
    return torch.randn(t, n, dtype=F64, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ branches on latents
def _branch_scale(x):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
        sd = 1.0 if float(mu.sum()) > 0 else 2.0
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, sd), obs=x)


def _branch_offset(x):
    """The location is μ plus an offset that a branch on μ chooses: affine at each value,
    but not the same affine map at every value."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
        offset = 1.0 if float(mu.mean()) > 0 else 0.0
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu + offset, 1.0), obs=x)


def _branch_on_a_rate(k, exposure):
    """c of a rate c · λ chosen by the size of λ."""
    with pyro.plate("tasks", k.shape[0], dim=-2):
        lam = pyro.sample("lam", dist.Gamma(k.new_tensor(2.0), k.new_tensor(1.0)))
        c = 1.0 if float(lam.mean()) < 10 else 2.0
        with pyro.plate("n", k.shape[1], dim=-1):
            pyro.sample("k", dist.Poisson(c * lam * exposure), obs=k)


def _unreached_branch(x):
    """A branch on |μ| > 100: no value the compiler reads the model at gets there."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
        sd = 2.0 if float(mu.abs().max()) > 100 else 1.0
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, sd), obs=x)


def _prior_mean_of_all_tasks(x):
    """A fixed prior mean read off every task's data: on the first task alone (where the
    compiler's extra runs are) the model computes another, fixed, value."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(x.mean(), 1.0))
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def _counts(t=4, n=6):
    k = torch.poisson(torch.full((t, n), 3.0, dtype=F64), torch.Generator().manual_seed(0))
    return k, torch.linspace(0.5, 2.0, n, dtype=F64).expand(t, n).clone()


@pytest.mark.parametrize(
    "model, data, match",
    [
        (_branch_scale, (_x(),), "site 'x' \\(Normal\\): its scale changes with the latent"),
        (_branch_offset, (_x(),), "site 'x' \\(Normal\\): its loc changes with the latent"),
        (_branch_on_a_rate, _counts(), "site 'k' \\(Poisson\\): its rate changes with the latent"),
    ],
)
def test_a_parameter_changed_by_a_branch_on_a_latent_value_is_refused(model, data, match):
    with pytest.raises(ValueError, match=match + ".*Python branch on a latent value"):
        VMP(model).compile(*data)


def test_a_branch_the_probe_values_never_reach_is_accepted():
    """The documented boundary: the compiler reads the model at a few values of the latent
    sites (random ones and each end of their supports); a branch none of them crosses is
    not seen, and the plan is that of the side they fall on."""
    x = _x()
    state, _ = VMP(_unreached_branch).fit(x)
    assert torch.isfinite(state.objective).all()


def test_a_fixed_parameter_computed_from_every_task_is_accepted():
    x = _x()
    x[1:] += 5.0  # the first task's mean is far from that of all tasks
    state, _ = VMP(_prior_mean_of_all_tasks).fit(x)
    n = x.shape[1]
    # exact: μ | x ~ N((m0 + Σx) / (1 + n), 1 / (1 + n)) with m0 the mean of all the data
    post_mean = (x.mean() + x.sum(1)) / (1 + n)
    torch.testing.assert_close(state.q["mu"][0].reshape(-1), post_mean, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ Dirichlet data
def test_dirichlet_rows_off_the_simplex_are_refused():
    p, z, observed = _simplex_data(t=3, n=20, support=6)
    VMP(dirichlet_mixture).compile(p, z, observed)  # the valid data are accepted
    with pytest.raises(
        ValueError,
        match="site 'p' \\(Dirichlet\\).*probability vectors.*task 0, points 0 sums to 2",
    ):
        VMP(dirichlet_mixture).compile(2 * p, z, observed)
    q = p.clone()
    q[1, 3] = torch.tensor([-0.1, 0.5, 0.3, 0.3], dtype=F64)  # sums to 1, one entry < 0
    with pytest.raises(ValueError, match="site 'p'.*task 1, points 3 sums to 1 .*entry -0.1"):
        VMP(dirichlet_mixture).compile(q, z, observed)


def test_float32_probability_rows_within_rounding_are_accepted():
    """Rows of 64 float32 probabilities normalised in float32 (rounding of order 64 ε)."""
    p, z, observed = _simplex_data(t=2, n=10, c=64, support=4)
    p = torch.softmax(torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(1)), -1)
    VMP(dirichlet_mixture).compile(p, z, observed)


# ------------------------------------------------------------------ Poisson rates
@pytest.mark.parametrize("where", ["one entry", "a column", "every entry", "a Python zero"])
def test_a_zero_exposure_is_refused_by_name(where):
    """Where a count above 0 is observed (an exposure of 0 at a count of 0 adds nothing, as
    ``test_zero_exposure_with_zero_count_adds_nothing`` checks), or everywhere."""
    k, exposure = _counts()
    if where == "a column":  # c is read with one value per point, shared by the tasks
        exposure[:, 1], k[:, 1], k[3, 1] = 0.0, 0.0, 1.0
        match = "site 'k' \\(Poisson\\) with parent 'lam'.*is 0 at task 3, n 1 .*count 1"
    elif where == "one entry":
        exposure[2, 3], k[2, 3] = 0.0, 2.0
        match = "site 'k' \\(Poisson\\) with parent 'lam'.*is 0 at task 2, n 3 .*exposure of 0.*2"
    elif where == "every entry":
        exposure = torch.zeros_like(exposure)
        match = "site 'k' \\(Poisson\\): its rate is 0 \\(an exposure of 0\\?\\)"
    else:
        exposure = 0.0
        match = "site 'k' \\(Poisson\\): its rate is 0"
    with pytest.raises(ValueError, match=match):
        VMP(gamma_poisson).compile(k, exposure)


def test_a_negative_exposure_is_refused_by_name():
    k, exposure = _counts()
    exposure[0, 0] = -1.0
    with pytest.raises(ValueError, match="site 'k' \\(Poisson\\).*rate is outside"):
        VMP(gamma_poisson).compile(k, exposure)


def test_a_gamma_rate_of_zero_is_refused_by_name():
    tau = torch.rand(3, 5, dtype=F64, generator=torch.Generator().manual_seed(0)) + 0.5

    def scaled(tau, e):
        with pyro.plate("tasks", tau.shape[0], dim=-2):
            b = pyro.sample("b", dist.Gamma(tau.new_tensor(2.0), tau.new_tensor(1.0)))
            with pyro.plate("n", tau.shape[1], dim=-1):
                pyro.sample("tau", dist.Gamma(tau.new_tensor(3.0), b * e), obs=tau)

    e = torch.ones_like(tau)
    e[1, 2] = 0.0
    with pytest.raises(ValueError, match="site 'tau' \\(Gamma\\).*rate is outside"):
        VMP(scaled).compile(tau, e)
    with pytest.raises(ValueError, match="site 'b' \\(Gamma\\).*rate is outside"):
        VMP(lambda t: gamma_gamma_observed(t, b0=0.0)).compile(tau)


def _with_fixed(law):
    def model(x, y):
        with pyro.plate("tasks", x.shape[0], dim=-2):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
            with pyro.plate("n", x.shape[1], dim=-1):
                pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
                pyro.sample("y", law(x), obs=y)

    return model


@pytest.mark.parametrize(
    "law, match",
    [
        (lambda x: dist.Poisson(x.new_tensor(2.0)), "'y' \\(Poisson\\): its rate is fixed"),
        (lambda x: dist.Bernoulli(x.new_tensor(0.3)), "'y' \\(Bernoulli\\): its probs is fixed"),
        (lambda x: dist.Binomial(3, x.new_tensor(0.3)), "'y' \\(Binomial\\): its probs is fixed"),
    ],
)
def test_an_observed_count_with_a_fixed_law_is_refused_by_name(law, match):
    x = _x()
    with pytest.raises(ValueError, match=match):
        VMP(_with_fixed(law)).compile(x, torch.ones_like(x))


# ------------------------------------------------------------------ data out of range
def _y(t=3, n=8):
    return torch.bernoulli(torch.full((t, n), 0.5, dtype=F64), generator=torch.Generator())


def _labels_model(y):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(1, 3, dtype=F64)))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Categorical(pi), obs=y)


def _observed_beta(x, y):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
            pyro.sample("y", dist.Beta(x.new_tensor(2.0), x.new_tensor(3.0)), obs=y)


def _bad(y, at, value):
    y = y.clone()
    y[at] = value
    return y


@pytest.mark.parametrize(
    "model, data, match",
    [
        (beta_bernoulli, (_bad(_y(), (1, 2), 2.0),), "'y' \\(Bernoulli\\).*must be 0 or 1"),
        (beta_bernoulli, (_bad(_y(), (1, 2), 0.5),), "'y' \\(Bernoulli\\).*whole numbers"),
        (
            beta_binomial,
            (_bad(_y(), (0, 1), 4.0), 3),
            "'y' \\(Binomial\\).*exceed.*; the entry at task 0, n 1 is 4",
        ),
        (beta_binomial, (_bad(_y(), (0, 1), -1.0), 3), "'y' \\(Binomial\\).*whole numbers >= 0"),
        (
            gamma_poisson,
            (_bad(_counts()[0], (0, 0), -2.0), _counts()[1]),
            "'k' \\(Poisson\\).*whole numbers >= 0; the entry at task 0, n 0 is -2",
        ),
        (
            _labels_model,
            (_bad(_y().long(), (2, 0), 3),),
            "'y' \\(Categorical\\).*labels 0 to 2; the entry at task 2, n 0 is 3",
        ),
        (_labels_model, (_bad(_y().long(), (2, 0), -1),), "'y' \\(Categorical\\).*whole numbers"),
        (
            gamma_gamma_observed,
            (_bad(torch.ones(3, 5, dtype=F64), (2, 4), 0.0),),
            "'tau' \\(Gamma\\).*must be > 0; the entry at task 2, n 4 is 0",
        ),
        (
            gamma_gamma_observed,
            (_bad(torch.ones(3, 5, dtype=F64), (1, 1), -3.0),),
            "'tau' \\(Gamma\\).*must be > 0; the entry at task 1, n 1 is -3",
        ),
        (
            _observed_beta,
            (_x(3, 8), _bad(torch.full((3, 8), 0.5, dtype=F64), (0, 5), 1.0)),
            "'y' \\(Beta\\).*strictly between 0 and 1; the entry at task 0, n 5 is 1",
        ),
        (
            _observed_beta,
            (_x(3, 8), _bad(torch.full((3, 8), 0.5, dtype=F64), (2, 7), 1.5)),
            "'y' \\(Beta\\).*strictly between 0 and 1; the entry at task 2, n 7 is 1.5",
        ),
    ],
)
def test_data_outside_their_support_are_refused_by_name(model, data, match):
    with pytest.raises(ValueError, match=match):
        VMP(model).compile(*data)


def test_data_inside_their_support_are_accepted():
    VMP(_observed_beta).compile(_x(3, 8), torch.full((3, 8), 0.5, dtype=F64))
    VMP(gamma_gamma_observed).compile(torch.ones(3, 5, dtype=F64))
    VMP(_labels_model).compile(_y().long())


# ------------------------------------------------------------------ checks made once
def test_a_parameter_checked_before_is_skipped_until_its_values_change():
    """check_parameters skips a parameter whose memory, view and version an earlier check
    passed (the compiler's later runs re-read the user's fixed parameters), and checks it
    again once an in-place change bumps its version."""
    from probfsl.inference.vmp.checks import check_parameters, tensor_key

    rate = torch.tensor([1.0, -2.0], dtype=F64)
    site = [{"name": "tau", "fn": dist.Gamma(torch.ones_like(rate), rate, validate_args=False)}]
    with pytest.raises(ValueError, match="'tau'.*rate"):
        check_parameters(site)
    key = tensor_key(rate)
    passed = check_parameters(site, checked={key})
    assert len(passed) == 1 and passed[0] is site[0]["fn"].concentration  # rate skipped
    rate.mul_(1.0)  # the same values, a new version: checked again
    assert tensor_key(rate) != key
    with pytest.raises(ValueError, match="'tau'.*rate"):
        check_parameters(site, checked={key})


def test_the_simplex_check_is_torchs():
    """The parameter check reads a simplex's rows by a product with ones: the same verdict
    as torch's constraint on rows on it, off it by more than 1e-6, negative or NaN."""
    from torch.distributions import constraints

    from probfsl.inference.vmp.checks import _holds

    g = torch.Generator().manual_seed(0)
    on = torch.softmax(torch.randn(50, 7, 4, generator=g, dtype=torch.float64), -1)
    cases = {"on": on, "off": on * (1 + 1e-5), "negative": on.clone(), "nan": on.clone()}
    cases["negative"][3, 2] = torch.tensor([1.2, -0.2, 0.0, 0.0], dtype=torch.float64)
    cases["nan"][1, 1, 0] = float("nan")
    for name, value in cases.items():
        want = bool(constraints.simplex.check(value).all())
        assert bool(_holds(constraints.simplex, value)) == want, name
        assert want == (name == "on")
