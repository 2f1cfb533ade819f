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


# ---------------------------------------------------------------- weights of several outputs
#
# W [D, C] of C outputs declared in two plates, "coefs" (summed by X @ W) and "outputs", in
# either nesting: joint over "coefs" wherever it sits in the batch shape, independent across
# "outputs". The likelihood Π_{n,c} N(y_nc | x_nᵀ W_·c, β⁻¹) does not couple the columns, so
# the fit is that of C separate regressions, each one's weights a ``.to_event(1)`` Normal.

ORDERS = ["coefs-left", "coefs-right"]


def multi_output(y, x, order="coefs-left", ard=False, alpha=None, beta=None):
    """Multi-output Bayesian linear regression with W in the plates ``coefs`` x
    ``outputs``: ``coefs-left`` puts ``coefs`` at dim -2 (W [D, C], y = X W), ``coefs-right``
    at dim -1 (W [C, D], yᵀ = W Xᵀ). ``ard``: one precision per coefficient (shared by the
    outputs); ``alpha``, ``beta`` given: known precisions."""
    t, n, p = x.shape
    c = y.shape[-1]
    left = order == "coefs-left"
    outputs = pyro.plate("outputs", c, dim=-1 if left else -2)
    coefs = pyro.plate("coefs", p, dim=-2 if left else -1)
    points = pyro.plate("n", n, dim=-2 if left else -1)
    with pyro.plate("tasks", t, dim=-3):
        if beta is None:
            beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        if alpha is None and not ard:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
        with coefs:
            if ard:
                alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            with outputs:
                w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), alpha**-0.5))
        with points, outputs:
            if left:  # w [T, D, C]
                pyro.sample("y", dist.Normal(x @ w, beta**-0.5), obs=y)
            else:  # w [T, C, D]
                mean = w @ x.transpose(-1, -2)
                pyro.sample("y", dist.Normal(mean, beta**-0.5), obs=y.transpose(-1, -2))


def separate_outputs(y, x, ard=False, alpha=None, beta=None):
    """The twin of :func:`multi_output`: C separate regressions in a plate of outputs, the
    weights of each a ``.to_event(1)`` Normal (w [T, 1, C, D])."""
    t, n, p = x.shape
    c = y.shape[-1]
    with pyro.plate("tasks", t, dim=-3):
        if beta is None:
            beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        if ard:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_ones(p), 1.0).to_event(1))
            scale = alpha**-0.5
        elif alpha is None:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            scale = (alpha**-0.5).unsqueeze(-1)
        else:
            scale = alpha**-0.5
        with pyro.plate("outputs", c, dim=-1):
            w = pyro.sample("w", dist.Normal(x.new_zeros(p), scale).to_event(1))
            with pyro.plate("n", n, dim=-2):
                mean = (x.unsqueeze(-2) * w).sum(-1)
                pyro.sample("y", dist.Normal(mean, beta**-0.5), obs=y)


def _multi_data(t=4, n=12, p=3, c=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, p, generator=g, dtype=F64)
    w = torch.randn(t, p, c, generator=g, dtype=F64)
    return x @ w + 0.5 * torch.randn(t, n, c, generator=g, dtype=F64), x


def _columns(q, order):
    """The posterior of W as one MultivariateNormal per (task, output) over the
    coefficients, [T, C] x D, from the grouped factor of either nesting."""
    assert isinstance(q, JointOverPlate)
    assert q.dim == (-2 if order == "coefs-left" else -1)
    return q.joint


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ard", [False, True], ids=["shared-alpha", "ard"])
def test_weights_of_several_outputs_equal_separate_regressions_at_every_sweep(order, ard):
    """The bound at every sweep (1e-10 relative), the posterior means and covariances of
    each output's weights: those of the separate ``.to_event(1)`` regressions."""
    data = _multi_data()
    got, s_plate, e_plate = _sweeps(lambda *a: multi_output(*a, order=order, ard=ard), data, 30)
    want, s_event, e_event = _sweeps(lambda *a: separate_outputs(*a, ard=ard), data, 30)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    joint = _columns(e_plate.posterior(s_plate)["w"], order)
    q_event = e_event.posterior(s_event)["w"]  # [T, 1, C] x D
    torch.testing.assert_close(joint.mean, q_event.mean.squeeze(1), rtol=1e-10, atol=1e-12)
    cov = q_event.covariance_matrix.squeeze(1)
    torch.testing.assert_close(joint.covariance_matrix, cov, rtol=1e-10, atol=1e-12)
    w = e_plate.posterior(s_plate)["w"].mean
    expect = q_event.mean.squeeze(1)  # [T, C, D]
    torch.testing.assert_close(w, expect.transpose(-1, -2) if order == "coefs-left" else expect)


def observed_then_mapped(y, z, x):
    """W [D, C] first the mean of observations of its own, entry by entry (read before the
    map that sums over ``coefs``), then summed by X W."""
    t, n, p = x.shape
    outputs = pyro.plate("outputs", y.shape[-1], dim=-1)
    with pyro.plate("tasks", t, dim=-3):
        with pyro.plate("coefs", p, dim=-2), outputs:
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
            pyro.sample("z", dist.Normal(w, 0.5), obs=z)
        with pyro.plate("n", n, dim=-2), outputs:
            pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


def observed_then_mapped_twin(y, z, x):
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-3), pyro.plate("outputs", y.shape[-1], dim=-1):
        w = pyro.sample("w", dist.Normal(x.new_zeros(p), 1.0).to_event(1))
        pyro.sample("z", dist.Normal(w, 0.5).to_event(1), obs=z.transpose(-1, -2).unsqueeze(-3))
        with pyro.plate("n", n, dim=-2):
            pyro.sample("y", dist.Normal((x.unsqueeze(-2) * w).sum(-1), 0.5), obs=y)


def test_an_elementwise_child_read_before_the_map_keeps_its_meaning():
    """The summed plate is moved last in the factor's layout after the elementwise child
    ``z`` was read: ``z``'s map (by axis names) still holds, and the fit is the twin's."""
    y, x = _multi_data()
    z = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(5), dtype=F64)
    got, s_plate, e_plate = _sweeps(observed_then_mapped, (y, z, x), 10)
    want, s_event, e_event = _sweeps(observed_then_mapped_twin, (y, z, x), 10)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    joint = _columns(e_plate.posterior(s_plate)["w"], "coefs-left")
    q_event = e_event.posterior(s_event)["w"]
    torch.testing.assert_close(joint.mean, q_event.mean.squeeze(1), rtol=1e-10, atol=1e-12)


def _multi_log_evidence(y, x, alpha, beta):
    """Σ_c ln N(y_·c | 0, X Xᵀ/α + I/β) per task (PRML eq. 3.86, one term per output)."""
    return sum(_log_evidence(y[..., c], x, alpha, beta) for c in range(y.shape[-1]))


@pytest.mark.parametrize("order", ORDERS)
def test_known_precisions_of_several_outputs_give_the_exact_log_evidence(order):
    """With α, β known the posterior is Gaussian, joint over each output's coefficients:
    one sweep reaches it and the bound is the exact log evidence; the conformance checks
    (Pyro's ``Trace_ELBO`` of the guide, batched equals one task at a time, float32 close
    to float64) hold."""
    y, x = _multi_data()
    exact = _multi_log_evidence(y, x, 2.0, 4.0)
    model = lambda *a: multi_output(*a, order=order, alpha=2.0, beta=4.0)  # noqa: E731
    bound, _, _ = _sweeps(model, (y, x), 2)
    torch.testing.assert_close(bound[1:], exact.expand(2, -1), rtol=1e-12, atol=1e-10)
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(model),
            model=model,
            data=(y, x),
            n_steps=2,
            exact_log_evidence=exact,
            max_plate_nesting=3,
            name=f"several-outputs-{order}",
        )
    )


@pytest.mark.parametrize("order", ORDERS)
def test_several_outputs_batched_equals_each_task_alone(order):
    y, x = _multi_data(t=5)
    model = lambda *a: multi_output(*a, order=order, ard=True)  # noqa: E731
    batched, state, _ = _sweeps(model, (y, x), 10)
    for t in range(5):
        alone, s1, _ = _sweeps(model, (y[t : t + 1], x[t : t + 1]), 10)
        torch.testing.assert_close(alone[:, 0], batched[:, t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s1.q["w"][1][0], state.q["w"][1][t])


def multi_logistic(y, x, order="coefs-left", prior_var=2.0):
    """Logistic regression of C outputs, W in the plates ``coefs`` x ``outputs``."""
    t, n, p = x.shape
    c = y.shape[-1]
    left = order == "coefs-left"
    outputs = pyro.plate("outputs", c, dim=-1 if left else -2)
    with pyro.plate("tasks", t, dim=-3):
        with pyro.plate("coefs", p, dim=-2 if left else -1), outputs:
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), prior_var**0.5))
        with pyro.plate("n", n, dim=-2 if left else -1), outputs:
            if left:
                pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
            else:
                logits = w @ x.transpose(-1, -2)
                pyro.sample("y", dist.Bernoulli(logits=logits), obs=y.transpose(-1, -2))


def separate_logistic(y, x, prior_var=2.0):
    t, n, p = x.shape
    with pyro.plate("tasks", t, dim=-3), pyro.plate("outputs", y.shape[-1], dim=-1):
        w = pyro.sample("w", dist.Normal(x.new_zeros(p), prior_var**0.5).to_event(1))
        with pyro.plate("n", n, dim=-2):
            logits = (x.unsqueeze(-2) * w).sum(-1)
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


@pytest.mark.parametrize("order", ORDERS)
def test_logistic_weights_of_several_outputs_equal_separate_regressions(order):
    """Bernoulli logits X W by Pólya-Gamma augmentation (Polson, Scott & Windle 2013): the
    same Jaakkola–Jordan bound at every sweep and the same q of each output's weights."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 30, 3, generator=g, dtype=F64)
    w = 1.5 * torch.randn(4, 3, 2, generator=g, dtype=F64)
    y = torch.bernoulli(torch.sigmoid(x @ w), generator=g)
    got, s_plate, e_plate = _sweeps(lambda *a: multi_logistic(*a, order=order), (y, x), 40)
    want, s_event, e_event = _sweeps(separate_logistic, (y, x), 40)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    joint = _columns(e_plate.posterior(s_plate)["w"], order)
    q_event = e_event.posterior(s_event)["w"]
    torch.testing.assert_close(joint.mean, q_event.mean.squeeze(1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("order", ORDERS)
def test_describe_of_several_outputs_shows_one_joint_factor_and_no_mean_field(order):
    y, x = _multi_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        plan = VMP(lambda *a: multi_output(*a, order=order, ard=True)).compile(y, x)
    text = plan.describe()
    line = next(r for r in text.splitlines() if r.strip().startswith("w "))
    assert "[tasks=4, outputs=2, coefs=3]" in line and line.endswith("joint over axis coefs")
    assert "mean-field" not in text


@pytest.mark.parametrize("order", ORDERS)
def test_draws_of_several_outputs_keep_the_models_dims_and_each_columns_covariance(order):
    """The guide's draws and ArviZ's are in the model's shape, named in the model's order
    of plates; their covariance over ``coefs`` for each output is the factor's."""
    y, x = _multi_data()
    model = lambda *a: multi_output(*a, order=order, alpha=2.0, beta=4.0)  # noqa: E731
    engine = VMP(model)
    state = engine.init(y, x)
    tree = vmp_datatree(engine, state, num_samples=4000, seed=3)
    draws = tree["posterior"]["w"]
    plates = ("coefs", "outputs") if order == "coefs-left" else ("outputs", "coefs")
    assert draws.dims == ("chain", "draw", "tasks") + plates
    sample = torch.as_tensor(draws.values[0], dtype=F64)  # [draws, tasks, *plates]
    if order == "coefs-left":
        sample = sample.transpose(-1, -2)  # [draws, tasks, outputs, coefs]
    centred = sample - sample.mean(0)
    empirical = torch.einsum("stcd,stce->tcde", centred, centred) / (len(sample) - 1)
    cov = engine.posterior(state)["w"].joint.covariance_matrix  # [tasks, outputs, D, D]
    assert (empirical - cov).abs().max() < 6 * cov.diagonal(dim1=-2, dim2=-1).max() / 4000**0.5
    trace = pyro.poutine.trace(engine.guide(state)).get_trace(y, x)
    shape = (4, 3, 2) if order == "coefs-left" else (4, 2, 3)
    assert trace.nodes["w"]["value"].shape == shape


# ---------------------------------------------------------------- weights summed over two plates
# W [A, B] declared in the plates "rows" x "cols" and summed over both, ⟨X_n, W⟩ = Σ_ab
# X_nab W_ab: the factor is one Gaussian over the A·B entries (the plates merged into one
# axis), exactly the user's own fix of one plate of A·B entries reshaped in the model.

PLATE_ORDERS = ["rows-left", "cols-left"]


def two_plates(y, x, order="rows-left", ard=None, alpha=None, beta=None):
    """Regression on matrix inputs x [T, N, A, B] with weights W in the plates ``rows``
    (size A) and ``cols`` (size B), summed over both by an einsum; ``cols-left`` declares
    ``cols`` left of ``rows`` (W [B, A] in Pyro's shape). ``ard``: ``"entry"``, one
    precision per weight, or ``"row"``, one per row shared by its columns; ``alpha``,
    ``beta`` given: known precisions."""
    t, n, a, b = x.shape
    left = order == "rows-left"
    rows = pyro.plate("rows", a, dim=-2 if left else -1)
    cols = pyro.plate("cols", b, dim=-1 if left else -2)
    with pyro.plate("tasks", t, dim=-3):
        if beta is None:
            beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        if alpha is None and ard is None:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
        with rows:
            if ard == "row":
                alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            with cols:
                if ard == "entry":
                    alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
                w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), alpha**-0.5))
        with pyro.plate("n", n, dim=-1):
            mean = torch.einsum("tnab,...tab->...tn" if left else "tnab,...tba->...tn", x, w)
            pyro.sample("y", dist.Normal(mean.unsqueeze(-2), beta**-0.5), obs=y.unsqueeze(-2))


def reshaped_twin(y, x, order="rows-left", ard=None, alpha=None, beta=None):
    """The user's fix of :func:`two_plates`: one plate of the A·B weights (in the order
    of W's Pyro shape), reshaped in the model; a row's precision repeated over its
    columns."""
    t, n, a, b = x.shape
    left = order == "rows-left"
    with pyro.plate("tasks", t, dim=-2):
        if beta is None:
            beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), 0.5))
        if alpha is None and ard is None:
            alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
        if ard == "row":
            with pyro.plate("rows", a, dim=-1):
                alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            alpha = alpha.repeat_interleave(b, -1) if left else alpha.repeat(1, b)
        with pyro.plate("entries", a * b, dim=-1):
            if ard == "entry":
                alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1.0), 1.0))
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), alpha**-0.5))
        flat = x.flatten(-2) if left else x.transpose(-1, -2).flatten(-2)
        with pyro.plate("n", n, dim=-1):
            pyro.sample("y", dist.Normal((flat * w.unsqueeze(-2)).sum(-1), beta**-0.5), obs=y)


def _matrix_data(t=4, n=14, a=2, b=3, seed=4, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, a, b, generator=g, dtype=F64)
    w = torch.randn(t, 1, a, b, generator=g, dtype=F64)
    y = (x * w).sum((-2, -1)) + 0.5 * torch.randn(t, n, generator=g, dtype=F64)
    return y.to(dtype), x.to(dtype)


@pytest.mark.parametrize("order", PLATE_ORDERS)
@pytest.mark.parametrize("ard", [None, "entry", "row"], ids=["shared-alpha", "ard", "row-ard"])
def test_weights_summed_over_two_plates_equal_their_reshaped_twin_at_every_sweep(order, ard):
    """The bound at every sweep (1e-10 relative), and q(W): its mean in the model's shape
    and its covariance over the A·B entries (merged in the order of W's Pyro shape, as
    the twin's plate)."""
    data = _matrix_data()
    kwargs = {"order": order, "ard": ard}
    got, s_two, e_two = _sweeps(lambda *a: two_plates(*a, **kwargs), data, 30)
    want, s_one, e_one = _sweeps(lambda *a: reshaped_twin(*a, **kwargs), data, 30)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    q, twin = e_two.posterior(s_two)["w"], e_one.posterior(s_one)["w"]
    assert isinstance(q, JointOverPlate) and q.dim == (-2, -1)
    shape = (4, 2, 3) if order == "rows-left" else (4, 3, 2)
    assert q.batch_shape == shape and q.mean.shape == shape
    torch.testing.assert_close(q.mean.flatten(-2), twin.mean, rtol=1e-10, atol=1e-12)
    cov = twin.joint.covariance_matrix
    torch.testing.assert_close(q.joint.covariance_matrix, cov, rtol=1e-10, atol=1e-12)
    if ard is not None:  # the precisions' factors, entry by entry (or row by row)
        alpha, alpha_twin = e_two.posterior(s_two)["alpha"], e_one.posterior(s_one)["alpha"]
        mean = alpha_twin.mean
        torch.testing.assert_close(alpha.mean.reshape(mean.shape), mean, rtol=1e-10, atol=1e-12)


def _matrix_log_evidence(y, x, alpha, beta):
    """ln N(y | 0, X Xᵀ/α + I/β) per task, X [N, A·B] the flattened inputs (PRML eq. 3.86)."""
    return _log_evidence(y, x.flatten(-2), alpha, beta)


@pytest.mark.parametrize("order", PLATE_ORDERS)
def test_known_precisions_over_two_plates_give_the_exact_log_evidence(order):
    """One sweep reaches the exact posterior of the regression on A·B inputs: the bound is
    its log evidence; batched equals one task at a time, float32 is close to float64 and
    Pyro's ``Trace_ELBO`` of the guide (which draws W jointly over both plates) agrees."""
    y, x = _matrix_data()
    model = lambda *a: two_plates(*a, order=order, alpha=2.0, beta=4.0)  # noqa: E731
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(model),
            model=model,
            data=(y, x),
            n_steps=2,
            exact_log_evidence=_matrix_log_evidence(y, x, 2.0, 4.0),
            max_plate_nesting=3,
            name="two-plates-known-precisions",
        )
    )


@pytest.mark.parametrize("ard", ["entry", "row"])
def test_ard_over_two_plates_batched_equals_each_task_alone_and_float32_is_close(ard):
    y, x = _matrix_data(t=3)
    model = lambda *a: two_plates(*a, ard=ard)  # noqa: E731
    batched, state, _ = _sweeps(model, (y, x), 15)
    for t in range(3):
        alone, s1, _ = _sweeps(model, (y[t : t + 1], x[t : t + 1]), 15)
        torch.testing.assert_close(alone[:, 0], batched[:, t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s1.q["w"][1][0], state.q["w"][1][t])
    single, state32, _ = _sweeps(model, (y.float(), x.float()), 15)
    assert state32.q["w"][0].dtype == torch.float32
    torch.testing.assert_close(single.double(), batched, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state32.q["w"][0].double(), state.q["w"][0], rtol=1e-4, atol=1e-4)


def outputs_over_two_plates(y, x):
    """y [T, N, C] = ⟨X_n, W_c⟩ for C outputs: W [A, B, C] in ``rows`` x ``cols`` x
    ``outputs``, summed over ``rows`` and ``cols`` (joint over their A·B entries),
    independent across ``outputs``."""
    t, n, a, b = x.shape
    outputs = pyro.plate("outputs", y.shape[-1], dim=-1)
    with pyro.plate("tasks", t, dim=-4):
        with pyro.plate("rows", a, dim=-3), pyro.plate("cols", b, dim=-2), outputs:
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
        with pyro.plate("n", n, dim=-2), outputs:
            mean = torch.einsum("tnab,tabc->tnc", x, w.squeeze(1))
            pyro.sample("y", dist.Normal(mean.unsqueeze(1), 0.5), obs=y.unsqueeze(1))


def separate_reshaped_outputs(y, x):
    """The twin of :func:`outputs_over_two_plates`: C separate regressions on the A·B
    flattened inputs, each one's weights a ``.to_event(1)`` Normal."""
    t, n, a, b = x.shape
    with pyro.plate("tasks", t, dim=-3), pyro.plate("outputs", y.shape[-1], dim=-1):
        w = pyro.sample("w", dist.Normal(x.new_zeros(a * b), 1.0).to_event(1))
        with pyro.plate("n", n, dim=-2):
            mean = (x.flatten(-2).unsqueeze(-2) * w).sum(-1)
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y)


def test_other_plates_of_the_weights_stay_independent_and_draws_keep_the_models_dims():
    """W [A, B, C]: the same bound as C separate regressions at every sweep, q(W) one
    Gaussian over A·B per output; ArviZ's draws are in the model's shape and plate order,
    and their covariance over the A·B entries is the factor's."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 12, 2, 3, generator=g, dtype=F64)
    y = torch.randn(3, 12, 2, generator=g, dtype=F64)
    got, state, engine = _sweeps(outputs_over_two_plates, (y, x), 3)
    want, s_twin, e_twin = _sweeps(separate_reshaped_outputs, (y, x), 3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    text = engine.compile(y, x).describe()
    line = next(r for r in text.splitlines() if r.strip().startswith("w "))
    assert "[tasks=3, outputs=2, rows=2, cols=3]" in line
    assert line.endswith("joint over axes rows, cols")
    q = engine.posterior(state)["w"]
    assert q.batch_shape == (3, 2, 3, 2) and q.dim == (-3, -2)
    cov = q.joint.covariance_matrix  # [T, C, A·B, A·B]
    twin = e_twin.posterior(s_twin)["w"].covariance_matrix.squeeze(1)
    torch.testing.assert_close(cov, twin, rtol=1e-10, atol=1e-12)
    tree = vmp_datatree(engine, state, num_samples=4000, seed=3)
    draws = tree["posterior"]["w"]
    assert draws.dims == ("chain", "draw", "tasks", "rows", "cols", "outputs")
    sample = torch.as_tensor(draws.values[0], dtype=F64).movedim(-1, 2).flatten(-2)
    centred = sample - sample.mean(0)  # [draws, tasks, outputs, A·B]
    empirical = torch.einsum("stcd,stce->tcde", centred, centred) / (len(sample) - 1)
    assert (empirical - cov).abs().max() < 6 * cov.diagonal(dim1=-2, dim2=-1).max() / 4000**0.5
    assert pyro.poutine.trace(engine.guide(state)).get_trace(y, x).nodes["w"]["value"].shape == (
        3,
        2,
        3,
        2,
    )


def test_describe_of_two_plates_shows_one_factor_joint_over_both_and_no_mean_field():
    y, x = _matrix_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeanFieldWarning)
        plan = VMP(lambda *a: two_plates(*a, ard="row")).compile(y, x)
    text = plan.describe()
    line = next(r for r in text.splitlines() if r.strip().startswith("w "))
    assert "[tasks=4, rows=2, cols=3]" in line and line.endswith("joint over axes rows, cols")
    alpha = next(r for r in text.splitlines() if r.strip().startswith("alpha "))
    assert "[tasks=4, rows=2]" in alpha and alpha.endswith("elementwise")
    assert "mean-field" not in text


def logistic_two_plates(y, x):
    """Bernoulli logits ⟨X_n, W⟩ with W [A, B] in the plates ``rows`` x ``cols``."""
    t, n, a, b = x.shape
    with pyro.plate("tasks", t, dim=-3):
        with pyro.plate("rows", a, dim=-2), pyro.plate("cols", b, dim=-1):
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.5))
        with pyro.plate("n", n, dim=-1):
            logits = torch.einsum("tnab,...tab->...tn", x, w).unsqueeze(-2)
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y.unsqueeze(-2))


def logistic_reshaped_twin(y, x):
    t, n, a, b = x.shape
    with pyro.plate("tasks", t, dim=-2):
        with pyro.plate("entries", a * b, dim=-1):
            w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.5))
        with pyro.plate("n", n, dim=-1):
            logits = (x.flatten(-2) * w.unsqueeze(-2)).sum(-1)
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def test_logistic_weights_over_two_plates_equal_their_reshaped_twin():
    """Pólya-Gamma augmentation (Polson, Scott & Windle 2013) of logits summed over two
    plates: the same Jaakkola–Jordan bound at every sweep and the same q(W)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 30, 2, 3, generator=g, dtype=F64)
    y = torch.bernoulli(torch.sigmoid(x.sum((-2, -1))), generator=g)
    got, s_two, e_two = _sweeps(logistic_two_plates, (y, x), 20)
    want, s_one, e_one = _sweeps(logistic_reshaped_twin, (y, x), 20)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    q, twin = e_two.posterior(s_two)["w"].joint, e_one.posterior(s_one)["w"].joint
    torch.testing.assert_close(q.mean, twin.mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q.covariance_matrix, twin.covariance_matrix, rtol=1e-10, atol=1e-12)


def test_a_product_of_two_latent_sites_summed_over_two_plates_is_refused_with_the_fix():
    def model(y, x):
        t, n, a, b = x.shape
        with pyro.plate("tasks", t, dim=-3):
            with pyro.plate("rows", a, dim=-2), pyro.plate("cols", b, dim=-1):
                w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
                v = pyro.sample("v", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("n", n, dim=-1):
                mean = (v * w).sum((-2, -1), keepdim=True)
                pyro.sample("y", dist.Normal(mean, 0.5), obs=y.unsqueeze(-2))

    y, x = _matrix_data()
    with pytest.raises(ValueError, match=r"several plates \['rows', 'cols'\].*reshape them"):
        VMP(model).compile(y, x)


def test_a_point_estimate_summed_over_two_plates_is_refused_with_the_fix():
    def model(y, x):
        t, n, a, b = x.shape
        with pyro.plate("tasks", t, dim=-3):
            with pyro.plate("rows", a, dim=-2), pyro.plate("cols", b, dim=-1):
                w = pyro.param("w", x.new_zeros(t, a, b))
            with pyro.plate("n", n, dim=-1):
                mean = torch.einsum("tnab,...tab->...tn", x, w).unsqueeze(-2)
                pyro.sample("y", dist.Normal(mean, 0.5), obs=y.unsqueeze(-2))

    y, x = _matrix_data()
    with pytest.raises(ValueError, match=r"point estimate over its plate axes.*reshape it"):
        VMP(model).compile(y, x)


def test_maps_summing_one_site_over_different_sets_of_plates_are_refused():
    """One map sums W over ``rows`` and ``cols``, another over ``cols`` alone: a factor
    joint over the union of their plates would hold both; refused, naming both and the
    union, with the fix."""

    def model(y, z, x, v):  # x [T, N, A, B], v [T, B]
        t, n, a, b = x.shape
        rows, cols = pyro.plate("rows", a, dim=-2), pyro.plate("cols", b, dim=-1)
        with pyro.plate("tasks", t, dim=-3):
            with rows, cols:
                w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("n", n, dim=-1):
                mean = torch.einsum("tnab,tab->tn", x, w).unsqueeze(-2)
                pyro.sample("y", dist.Normal(mean, 0.5), obs=y.unsqueeze(-2))
            with rows:
                mean = (w * v.unsqueeze(-2)).sum(-1, keepdim=True)
                pyro.sample("z", dist.Normal(mean, 0.5), obs=z)

    y, x = _matrix_data()
    z = torch.randn(4, 2, 1, dtype=F64)
    v = torch.randn(4, 3, dtype=F64)
    match = r"plate axis 'cols', and another map sums it over axes \['rows', 'cols'\].*union"
    with pytest.raises(ValueError, match=match):
        VMP(model).compile(y, z, x, v)


def test_two_maps_summing_one_site_over_different_plates_are_refused():
    """W [D, C] summed over ``coefs`` by one child and over ``outputs`` by another: one
    factor joint over one axis cannot hold both; refused, naming both axes."""

    def model(y, z, x, v):  # x [T, N, D], v [T, C]
        t, n, p = x.shape
        c = v.shape[-1]
        outputs = pyro.plate("outputs", c, dim=-1)
        coefs = pyro.plate("coefs", p, dim=-2)
        with pyro.plate("tasks", t, dim=-3):
            with coefs, outputs:
                w = pyro.sample("w", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("n", n, dim=-2), outputs:
                pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)
            with coefs:
                mean = (w * v.unsqueeze(-2)).sum(-1, keepdim=True)
                pyro.sample("z", dist.Normal(mean, 0.5), obs=z)

    y, x = _multi_data()
    z = torch.randn(4, 3, 1, dtype=F64)
    v = torch.randn(4, 2, dtype=F64)
    match = r"axis 'outputs', and another map sums it over axis 'coefs'.*union"
    with pytest.raises(ValueError, match=match):
        VMP(model).compile(y, z, x, v)
