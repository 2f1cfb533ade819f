"""How the VMP compiler reads a precision or rate c · Π τ: from the form the model computes it
in (:mod:`probfsl.inference.vmp.monomials`), so that c is the model's own constant, bit for
bit; off the value (value / parent) only where the model leaves the operations a form
follows."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference import VMP
from probfsl.inference.vmp.monomials import Monomial, coefficient, plain

F64 = torch.float64


def _tau(shape=(4, 5, 3), dtype=F64, name="tau"):
    g = torch.Generator().manual_seed(0)
    return Monomial.of(0.5 + torch.rand(shape, generator=g, dtype=dtype), name)


def _precision(scale: torch.Tensor) -> torch.Tensor:
    """The precision as the compiler reads it: a Normal's scale, broadcast by Pyro, to -2."""
    normal = dist.Normal(torch.zeros(scale.shape, dtype=scale.dtype), scale)
    return normal.expand((2, *scale.shape)).scale.pow(-2)


C = torch.tensor([[1 / 3], [2 / 7], [5.1], [0.3]], dtype=F64)  # per task, not "round"


@pytest.mark.parametrize(
    "scale, want",
    [
        (lambda t: t.rsqrt(), lambda t: 1.0),
        (lambda t: (C.unsqueeze(-1) * t) ** -0.5, lambda t: C.unsqueeze(-1)),
        (lambda t: 1 / torch.sqrt(t * 0.1), lambda t: 0.1),
        (lambda t: t.pow(-0.5) / 3, lambda t: 9.0),
        (lambda t: (t / C.unsqueeze(-1)).reciprocal().sqrt(), lambda t: 1 / C.unsqueeze(-1)),
        (lambda t: torch.exp(-0.5 * torch.log(t)), lambda t: 1.0),
        (lambda t: (torch.log(t) / -2).exp(), lambda t: 1.0),
        (lambda t: torch.exp(-torch.log(C.unsqueeze(-1) * t) / 2), lambda t: C.unsqueeze(-1)),
    ],
    ids=["rsqrt", "c-tensor", "reciprocal-sqrt", "pow-divided", "quotient", "exp-log"]
    + ["log-divided", "exp-neg-log"],
)
def test_forms_give_the_models_constant_exactly(scale, want):
    tau = _tau()
    got = coefficient(_precision(scale(tau)), ["tau"])
    expect = torch.as_tensor(want(tau), dtype=F64).expand(2, *tau.shape)
    assert got is not None and torch.equal(got, expect)


def test_forms_follow_indexing_and_products_of_sites():
    """A mixture's Vindex selection and a scale mixture's product λ·u keep the form; the
    constant is selected with the sites."""
    tau, u = _tau(), _tau(name="u")
    z = torch.randint(0, 5, (4, 7), generator=torch.Generator().manual_seed(1))
    c = C.unsqueeze(-1).expand(4, 5, 3)
    picked = Vindex((c * tau).unsqueeze(-3))[..., z, :].rsqrt()
    assert torch.equal(coefficient(picked.pow(-2), ["tau"]), Vindex(c.unsqueeze(-3))[..., z, :])
    product = (2.0 * tau * u).rsqrt().pow(-2)
    assert torch.equal(coefficient(product, ["tau", "u"]), torch.full(tau.shape, 2.0, dtype=F64))
    assert coefficient(product, ["tau"]) is None  # u's power is 1, not 0


def test_logarithms_of_monomials_keep_their_form():
    """ln(c τ) + ln u is ln(c τ u): its exponential is the monomial c τ u, through views;
    half a logarithm is a square root."""
    tau, u = _tau(), _tau(name="u")
    c = C.unsqueeze(-1).expand(4, 5, 3)
    log = torch.log(c * tau).unsqueeze(0).expand(2, 4, 5, 3) + torch.log(u).unsqueeze(0)
    want = c.expand(2, 4, 5, 3)
    assert torch.equal(coefficient(torch.exp(log), ["tau", "u"]), want)
    assert torch.equal(coefficient(torch.exp(log - torch.log(u)), ["tau"]), want)
    root = torch.exp(0.5 * torch.log(tau))
    assert torch.equal(coefficient(root.pow(2), ["tau"]), torch.ones_like(plain(tau)))


def test_what_is_not_a_monomial_has_no_form():
    tau = _tau()
    log = torch.log(tau)
    assert coefficient(torch.exp(log + 1.0), ["tau"]) is None  # a constant added
    assert coefficient(torch.exp(log * log), ["tau"]) is None
    assert coefficient(torch.exp(log * 0.5 * tau).pow(2), ["tau"]) is None
    assert coefficient(torch.exp(tau), ["tau"]) is None
    assert coefficient(torch.exp(log.log1p()), ["tau"]) is None
    assert coefficient((tau + 1).rsqrt().pow(-2), ["tau"]) is None
    assert coefficient(tau.square(), ["tau"]) is None  # tau², not tau
    changed = tau.clone()
    changed.mul_(2.0)  # in place: the form no longer holds
    assert coefficient(changed, ["tau"]) is None
    written = tau * 2.0
    written[0] = 1.0
    assert coefficient(written, ["tau"]) is None
    assert type(plain(tau)) is torch.Tensor and type(tau > 0) is torch.Tensor


def test_float32_constants_stay_exact():
    tau = _tau(dtype=torch.float32)
    c = torch.tensor(1 / 3, dtype=torch.float32)
    got = coefficient(_precision((c * tau).rsqrt()), ["tau"])
    assert got.dtype == torch.float32 and bool((got == c).all())


# ------------------------------------------------------------------ the compiler's reading
def _scaled_model(x, c, scale_of):
    """x_tn ~ N(0, 1/(c_t τ_t)), τ_t ~ Gamma(2, 1), with the scale written as ``scale_of``."""
    with pyro.plate("tasks", x.shape[0], dim=-1):
        tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
        scale = scale_of(c * tau).unsqueeze(-1)
        pyro.sample("x", dist.Normal(x.new_tensor(0.0), scale).to_event(1), obs=x)


def _data(t=4, n=10):
    g = torch.Generator().manual_seed(2)
    return torch.randn(t, n, generator=g, dtype=F64), C[:, 0].clone()


@pytest.mark.parametrize(
    "scale_of, exact",
    [
        (torch.rsqrt, True),
        (lambda p: torch.exp(-0.5 * torch.log(p)), True),
        (lambda p: torch.exp(-0.5 * torch.log1p(p - 1)), False),
    ],
    ids=["form", "logarithm", "value"],
)
def test_the_plan_holds_the_constant_and_the_posterior_is_exact(scale_of, exact):
    """q(τ) = Gamma(2 + N/2, 1 + c Σx²/2) exactly; c is the model's tensor bit for bit when
    the scale has a form, and within a few ulps when it is read off the value."""
    x, c = _data()

    def model(x):
        _scaled_model(x, c, scale_of)

    vmp = VMP(model, tol=0.0, max_iter=3)
    prec = vmp.compile(x).sites["x"].params["precision"]
    if exact:
        assert torch.equal(prec.coef, c)
    else:
        torch.testing.assert_close(prec.coef, c, rtol=8 * torch.finfo(F64).eps, atol=0)
    state, _ = vmp.fit(x)
    a, b = state.q["tau"]
    torch.testing.assert_close(a, torch.full_like(a, 2 + x.shape[1] / 2), rtol=1e-15, atol=0)
    torch.testing.assert_close(b, 1 + 0.5 * c * x.square().sum(-1), rtol=1e-14, atol=0)


def test_a_constant_that_depends_on_a_latent_site_is_refused():
    """(μ² τ)^-1/2 has the form c τ in the first run, with c = μ² at that run's μ: the
    verifying run (other values of μ and τ) refuses it."""
    x, _ = _data()

    def model(x):
        with pyro.plate("tasks", x.shape[0], dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_tensor(1.0), 1.0))
            tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
            scale = (mu.square() * tau).rsqrt().unsqueeze(-1)
            pyro.sample("x", dist.Normal(x.new_tensor(0.0), scale).to_event(1), obs=x)

    with pytest.raises(ValueError, match="site 'x'"):
        VMP(model).compile(x)


# ------------------------------------------------------------ a fixed index (labels as data)
def _labelled_model(x, y, select, scale_of):
    """Per-class means and precisions; each point's class ``y`` is data, picked by
    ``select`` (Vindex, or a one-hot matrix product) and its scale written as ``scale_of``."""
    k, tasks = 3, pyro.plate("tasks", x.shape[0], dim=-2)
    with tasks, pyro.plate("classes", k, dim=-1):
        tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), (0.5 * tau).rsqrt()))
    with tasks, pyro.plate("points", x.shape[1], dim=-1):
        loc, prec = select(mu, y, k), select(tau, y, k)
        pyro.sample("x", dist.Normal(loc, scale_of(prec)), obs=x)


def _vindex(v, y, k):
    return Vindex(v.unsqueeze(-2))[..., y]


def _one_hot(v, y, k):
    return (torch.nn.functional.one_hot(y, k).to(v.dtype) @ v.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    "select, scale_of",
    [
        (_vindex, torch.rsqrt),
        (_one_hot, torch.rsqrt),
        (_vindex, lambda p: torch.exp(-0.5 * torch.log(p))),  # no form: coded values
    ],
    ids=["vindex", "one-hot", "no-form"],
)
def test_a_fixed_index_is_the_labels_and_every_reading_fits_alike(select, scale_of):
    g = torch.Generator().manual_seed(4)
    y = torch.randint(0, 3, (5, 12), generator=g)
    x = 2.0 * y.to(F64) + torch.randn(5, 12, generator=g, dtype=F64)

    def model(x, y):
        _labelled_model(x, y, select, scale_of)

    def reference(x, y):
        _labelled_model(x, y, _vindex, torch.rsqrt)

    plan = VMP(model).compile(x, y)
    for key in ("loc", "precision"):
        index = plan.sites["x"].params[key].index
        assert torch.equal(index.argmax(-1).expand_as(y), y)
    got, _ = VMP(model, tol=0.0, max_iter=20).fit(x, y)
    want, _ = VMP(reference, tol=0.0, max_iter=20).fit(x, y)
    torch.testing.assert_close(got.objective, want.objective, rtol=1e-13, atol=0)


# ------------------------------------------------------------- the layout of Normal data
def _regression(x, y):
    """Per-point data (a tasks and a points axis) with a linear mean and a Gamma noise."""
    with pyro.plate("tasks", x.shape[0]):
        beta = pyro.sample("beta", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
        w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
        mean = (x @ w.unsqueeze(-1)).squeeze(-1)
        pyro.sample("y", dist.Normal(mean, beta.rsqrt().unsqueeze(-1)).to_event(1), obs=y)


def test_per_point_data_interleave_x_and_x2_for_float32_rounding(monkeypatch):
    """Per-point data are stacked as (x, x²) on the last axis, so each point's x m − x²/2
    is summed at once: in float32 the bound's rounding is below that of the stack before
    the points axis (two partial sums that cancel), measured against float64 on the same
    factors. Under an affine mean the bound reads the residual (x − ⟨m⟩)² instead, whose
    rounding is below both."""
    import probfsl.inference.vmp.layout as layout
    import probfsl.inference.vmp.normal as normal

    g = torch.Generator().manual_seed(7)
    x = torch.randn(200, 30, 4, generator=g, dtype=F64)
    y = (x @ torch.randn(200, 4, 1, generator=g, dtype=F64)).squeeze(-1)
    y = y + 0.5 * torch.randn(200, 30, generator=g, dtype=F64)
    vmp = VMP(_regression, tol=0.0, max_iter=10)
    state, _ = vmp.fit(x, y)
    exact = vmp.elbo(state)
    x32, y32 = x.float(), y.float()
    q32 = {k: tuple(t.float() for t in v) for k, v in state.q.items()}

    def error(stack_axis: int) -> float:
        plan = vmp.compile(x32, y32)
        assert plan.sites["y"].powers.shape[stack_axis] == 2  # (x, x²) on that axis
        got = vmp.elbo(type(state)(plan, q32, None)).double()
        return float((got - exact).abs().median())

    residual = error(-1)
    monkeypatch.setattr(normal, "_affine_residual", lambda plan, o: None)  # expanded form
    interleaved = error(-1)
    assert residual < 0.75 * interleaved
    for module in (layout, normal):  # the stack before the points axis instead
        monkeypatch.setattr(module, "power_axis", lambda ndim: -2 if ndim > 1 else -1)
    assert interleaved < 0.75 * error(-2)
