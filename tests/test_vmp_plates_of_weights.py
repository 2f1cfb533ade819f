"""Plates of independent Normal weights that a linear map sums over (docs/design/vmp.md
§7.1): ``with pyro.plate("coefs", D): w = pyro.sample("w", Normal(0, 1 / alpha.sqrt()))``
is the density of the ``.to_event(1)`` Normal, and the compiler fits it with the same joint
Gaussian factor over the plate axis. Each model is held to its ``.to_event(1)`` twin (the
same bound at every sweep, the same posterior means and covariances), to the exact log
evidence of Bayesian linear regression with known precisions (y ~ N(0, X Xᵀ/α + I/β),
Bishop PRML §3.5), to Pyro's ``Trace_ELBO`` of the derived guide, and to the conformance
checks (batched equals one task at a time, float32 close to float64)."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.diagnostics import vmp_datatree
from probfsl.inference import VMP
from probfsl.inference.vmp import MeanFieldWarning
from probfsl.inference.vmp.grouped_plates import JointOverPlate
from probfsl.testing import ConformanceCase, assert_elbo_matches_pyro, check_engine
from tests.test_vmp_logistic import logistic as event_logistic

F64 = torch.float64


# ---------------------------------------------------------------- the models


def plate_regression(y, x, ard=False):
    """Bayesian linear regression, the weights declared by a plate; ``ard``: one
    precision per coefficient, declared in the same plate (automatic relevance
    determination)."""
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        if not ard:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
        with pyro.plate("coefs", p, dim=-1):
            if ard:
                alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1 / alpha.sqrt()))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w.unsqueeze(-2)).sum(-1), beta.rsqrt()), obs=y)


def event_regression(y, x, ard=False):
    """The ``.to_event(1)`` twin of :func:`plate_regression`."""
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        if ard:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_ones(p), 1.0).to_event(1))
            scale = 1 / alpha.sqrt()
        else:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            scale = (1 / alpha.sqrt()).unsqueeze(-1)
        w = pyro.sample("w", dist.Normal(x.new_zeros(p), scale).to_event(1))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w).sum(-1), beta.rsqrt()), obs=y)


def plate_known(y, x, alpha=2.0, beta=4.0):
    """Known precisions: the posterior is Gaussian and the bound the log evidence."""
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        with pyro.plate("coefs", p, dim=-1):
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), alpha**-0.5))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w.unsqueeze(-2)).sum(-1), beta**-0.5), obs=y)


def plate_regression_tasks_right(y, x):
    """The plates in Pyro's default dims (``tasks`` at -1, ``coefs`` at -2: w is [D, T])
    and the observations an event of each task: ``X @ w`` per task."""
    t, n, p = x.shape
    with pyro.plate("tasks", t):
        beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
        with pyro.plate("coefs", p):
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1 / alpha.sqrt()))
        mean = (x @ w.movedim(-2, -1).unsqueeze(-1)).squeeze(-1)
        pyro.sample("y", dist.Normal(mean, beta.rsqrt().unsqueeze(-1)).to_event(1), obs=y)


def event_regression_tasks_right(y, x):
    """The ``.to_event(1)`` twin of :func:`plate_regression_tasks_right`."""
    t, n, p = x.shape
    with pyro.plate("tasks", t):
        beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
        w = pyro.sample(
            "w", dist.Normal(x.new_zeros(p), (1 / alpha.sqrt()).unsqueeze(-1)).to_event(1)
        )
        mean = (x @ w.unsqueeze(-1)).squeeze(-1)
        pyro.sample("y", dist.Normal(mean, beta.rsqrt().unsqueeze(-1)).to_event(1), obs=y)


def plate_logistic(y, x, prior_var=2.0):
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        with pyro.plate("coefs", p, dim=-1):
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), prior_var**0.5))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Bernoulli(logits=(x * w.unsqueeze(-2)).sum(-1)), obs=y)


def plate_regression_also_observed(y, z, x):
    """The weights also the mean of observations of their own, entry by entry (an
    elementwise child besides the map): the joint factor still holds."""
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        with pyro.plate("coefs", p, dim=-1):
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
            pyro.sample("z", dist.Normal(w, 0.5), obs=z)
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w.unsqueeze(-2)).sum(-1), 0.5), obs=y)


def event_regression_also_observed(y, z, x):
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-2):
        w = pyro.sample("w", dist.Normal(x.new_zeros(p), 1.0).to_event(1))
        pyro.sample("z", dist.Normal(w, 0.5).to_event(1), obs=z.unsqueeze(-2))
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((x * w).sum(-1), 0.5), obs=y)


# ---------------------------------------------------------------- data and helpers


def _regression_data(t=4, n=12, p=3, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, p, generator=g, dtype=F64)
    w = torch.randn(t, 1, p, generator=g, dtype=F64)
    y = (x * w).sum(-1) + 0.5 * torch.randn(t, n, generator=g, dtype=F64)
    return y.to(dtype), x.to(dtype)


def _logistic_data(t=4, n=30, p=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, p, generator=g, dtype=F64)
    w = 1.5 * torch.randn(t, 1, p, generator=g, dtype=F64)
    return torch.bernoulli(torch.sigmoid((x * w).sum(-1)), generator=g), x


def _sweeps(model, data, n, **kwargs):
    """The bound after the start and after each of ``n`` sweeps [n + 1, T], and the last
    state."""
    engine = VMP(model, **kwargs)
    state = engine.init(*data)
    trace = [state.objective]
    for _ in range(n):
        state, _ = engine.step(state)
        trace.append(state.objective)
    return torch.stack(trace), state, engine


def _same_fit(plate_model, event_model, data, n=30, kwargs=None):
    """The plate model and its twin: the same bound at every sweep (1e-10 relative) and
    the same posterior mean and covariance of w."""
    kwargs = kwargs or {}
    got, s_plate, e_plate = _sweeps(lambda *a: plate_model(*a, **kwargs), data, n)
    want, s_event, e_event = _sweeps(lambda *a: event_model(*a, **kwargs), data, n)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    q_plate = e_plate.posterior(s_plate)["w"]
    q_event = e_event.posterior(s_event)["w"]
    assert isinstance(q_plate, JointOverPlate)
    torch.testing.assert_close(q_plate.joint.mean, q_event.mean.reshape(q_plate.joint.mean.shape))
    cov_event = q_event.covariance_matrix
    cov = q_plate.joint.covariance_matrix
    torch.testing.assert_close(cov, cov_event.reshape(cov.shape), rtol=1e-10, atol=1e-12)
    return s_plate, e_plate


# ---------------------------------------------------------------- linear regression


@pytest.mark.parametrize("ard", [False, True], ids=["shared-alpha", "ard"])
def test_plate_regression_equals_its_event_twin_at_every_sweep(ard):
    _same_fit(plate_regression, event_regression, _regression_data(), kwargs={"ard": ard})


def test_plate_regression_in_default_dims_equals_its_event_twin():
    """``tasks`` at dim -1 and ``coefs`` at -2 (w is [D, T] in Pyro's shape)."""
    data = _regression_data()
    state, engine = _same_fit(plate_regression_tasks_right, event_regression_tasks_right, data)
    q = engine.posterior(state)["w"]
    assert q.batch_shape == (3, 4) and q.mean.shape == (3, 4)
    torch.testing.assert_close(q.mean.T, state.q["w"][0])


def test_an_elementwise_child_of_the_grouped_weights_equals_its_twin():
    y, x = _regression_data()
    z = torch.randn(4, 3, generator=torch.Generator().manual_seed(5), dtype=F64)
    _same_fit(plate_regression_also_observed, event_regression_also_observed, (y, z, x))


def _log_evidence(y, x, alpha, beta):
    """ln N(y | 0, X Xᵀ/α + I/β) per task (PRML eq. 3.86)."""
    n = x.shape[1]
    cov = x @ x.transpose(-1, -2) / alpha + torch.eye(n, dtype=x.dtype) / beta
    return dist.MultivariateNormal(torch.zeros_like(y), covariance_matrix=cov).log_prob(y)


def test_known_precisions_give_the_exact_log_evidence_and_pass_conformance():
    """One sweep reaches the exact posterior; the bound is the log evidence, Pyro's
    ``Trace_ELBO`` of the guide (which draws w jointly) estimates it, batched equals one
    task at a time and float32 is close to float64."""
    y, x = _regression_data()
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(plate_known),
            model=plate_known,
            data=(y, x),
            n_steps=2,
            exact_log_evidence=_log_evidence(y, x, 2.0, 4.0),
            name="plate-known-precisions",
        )
    )


@pytest.mark.parametrize("ard", [False, True], ids=["shared-alpha", "ard"])
def test_plate_regression_passes_conformance(ard):
    y, x = _regression_data()
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(lambda *a: plate_regression(*a, ard=ard)),
            model=lambda *a: plate_regression(*a, ard=ard),
            data=(y, x),
            n_steps=10,
            name="plate-regression",
        )
    )


def test_the_guide_of_default_dims_gives_pyros_elbo():
    """The guide draws w [D, T] jointly over the plate; Pyro's ELBO (one particle at a
    time: this model's shapes do not broadcast over a particle plate) is the bound."""
    y, x = _regression_data()
    assert_elbo_matches_pyro(
        ConformanceCase(
            make_engine=lambda: VMP(plate_regression_tasks_right),
            model=plate_regression_tasks_right,
            data=(y, x),
            n_steps=10,
            particles=200,
            repeats=5,
            vectorize_particles=False,
        )
    )


def test_a_batch_equals_each_task_alone_and_float32_is_close():
    y, x = _regression_data(t=5)
    batched, state, _ = _sweeps(plate_regression, (y, x), 15)
    for t in range(5):
        alone, s1, _ = _sweeps(plate_regression, (y[t : t + 1], x[t : t + 1]), 15)
        torch.testing.assert_close(alone[:, 0], batched[:, t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s1.q["w"][1][0], state.q["w"][1][t])
    single, state32, _ = _sweeps(plate_regression, (y.float(), x.float()), 15)
    assert state32.q["w"][0].dtype == torch.float32
    torch.testing.assert_close(single.double(), batched, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state32.q["w"][0].double(), state.q["w"][0], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- logistic regression


def test_plate_logistic_regression_equals_its_event_twin():
    """Bernoulli logits summed over the plate, by Pólya-Gamma augmentation (Polson, Scott
    & Windle 2013): the same Jaakkola–Jordan bound at every sweep and the same q(w)."""
    _same_fit(plate_logistic, event_logistic, _logistic_data(), n=40)


# ---------------------------------------------------------------- the plan, draws, refusals


def test_describe_shows_the_factor_joint_over_the_plate_and_no_mean_field():
    y, x = _regression_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        plan = VMP(lambda *a: plate_regression(*a, ard=True)).compile(y, x)
    text = plan.describe()
    line = next(r for r in text.splitlines() if r.strip().startswith("w "))
    assert "[tasks=4, coefs=3]" in line and line.endswith("joint over axis coefs")
    alpha = next(r for r in text.splitlines() if r.strip().startswith("alpha "))
    assert alpha.endswith("elementwise") and "coefs=3" in alpha
    assert "mean-field" not in text


def test_posterior_draws_keep_the_plate_dimension_and_its_covariance():
    """ArviZ's draws of w are named by the plate (``coefs``); their covariance over the
    plate is the factor's (a joint draw, not a product of marginals)."""
    y, x = _regression_data()
    engine = VMP(plate_known)
    state = engine.init(y, x)
    tree = vmp_datatree(engine, state, num_samples=4000, seed=3)
    draws = tree["posterior"]["w"]
    assert draws.dims == ("chain", "draw", "tasks", "coefs")
    sample = torch.as_tensor(draws.values[0], dtype=F64)  # [draws, tasks, coefs]
    centred = sample - sample.mean(0)
    empirical = torch.einsum("std,ste->tde", centred, centred) / (len(sample) - 1)
    cov = engine.posterior(state)["w"].joint.covariance_matrix
    assert (empirical - cov).abs().max() < 6 * cov.diagonal(dim1=-2, dim2=-1).max() / 4000**0.5


def test_a_map_over_a_plate_that_is_not_the_rightmost_is_refused():
    """Grouping keeps the joint axis last in the factor's layout: a map summing over a
    plate left of another plate of the site is refused with a message naming the axis."""

    def model(y, x):
        t, n, p = x.shape
        pair = pyro.plate("pair", 2, dim=-1)
        with pyro.plate("tasks", t, dim=-3):
            with pyro.plate("coefs", p, dim=-2), pair:
                w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("n", n, dim=-2), pair:
                mean = (x.unsqueeze(-1) * w.unsqueeze(-3)).sum(-2)
                pyro.sample("y", dist.Normal(mean, 1.0), obs=y)

    y, x = _regression_data()
    with pytest.raises(ValueError, match=r"plate axes \['coefs'\], which cannot be grouped"):
        VMP(model).compile(y.unsqueeze(-1).expand(4, 12, 2), x)
