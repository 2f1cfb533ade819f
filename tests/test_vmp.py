"""The VMP engine derived from Pyro models: exact posteriors, agreement with the
hand-written engines, the conformance checks, a broken update caught, and refusals."""

import math
from dataclasses import replace
from functools import partial

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.derived.bavardage import bavardage_model
from probfsl.inference import VMP
from probfsl.inference.base import run
from probfsl.inference.normal_gamma import NormalGammaVB
from probfsl.inference.vb_mixture import BavardageVB
from probfsl.inference.vmp import VMPState
from probfsl.inference.vmp.compiler import Compiler
from probfsl.models.normal_gamma import normal_gamma_model, normal_mean_model
from probfsl.testing import ConformanceCase, assert_exact_evidence, check_engine

F64 = torch.float64


def _x(t=4, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 1.5 + 0.7 * torch.randn(t, n, generator=g, dtype=F64)


def _mixture_data(t=5, k=3, shot=2, q=12, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = 2.0 * torch.randn(t, k, d, generator=g, dtype=F64)
    ys = torch.arange(k).repeat(shot).expand(t, -1)
    yq = torch.randint(0, k, (t, q), generator=g)

    def draw(y):
        centre = means.gather(1, y.unsqueeze(-1).expand(-1, -1, d))
        return centre + torch.randn(*y.shape, d, generator=g, dtype=F64)

    return draw(ys), ys, draw(yq), yq


def proportions_model(y, n_classes=5, alpha0=2.0):
    """Tutorial 06's model: pi_t ~ Dir(alpha0 1), y_tn ~ Cat(pi_t), all observed."""
    with pyro.plate("tasks", y.shape[0], dim=-1):
        conc = torch.full((n_classes,), alpha0, dtype=F64, device=y.device)
        pi = pyro.sample("pi", dist.Dirichlet(conc))
        pyro.sample("y", dist.Categorical(pi.unsqueeze(-2)).to_event(1), obs=y)


def gamma_mixture_model(x, labels, observed, way, alpha0=2.0, beta0=1.0, a0=2.0, b0=2.0):
    """One mixture over support and queries: labels observed where ``observed`` (obs_mask),
    per-class diagonal Gamma precision, Normal means with precision beta0 * tau."""
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), alpha0)))
        with pyro.plate("classes", way, dim=-1):
            tau = pyro.sample("tau", dist.Gamma(x.new_full((d,), a0), b0).to_event(1))
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(d), (beta0 * tau).rsqrt()).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            loc = Vindex(mu.unsqueeze(-3))[..., z, :]
            scale = Vindex(tau.unsqueeze(-3))[..., z, :].rsqrt()
            pyro.sample("x", dist.Normal(loc, scale).to_event(1), obs=x)


def _gamma_mixture_case_data(t=4, seed=0):
    xs, ys, xq, yq = _mixture_data(t=t, seed=seed)
    x = torch.cat([xs, xq], 1)
    labels = torch.cat([ys, torch.zeros_like(yq)], 1)
    observed = torch.zeros(t, x.shape[1], dtype=torch.bool)
    observed[:, : ys.shape[1]] = True
    return x, labels, observed


def wishart_mixture_model(x, labels, observed, way, nu0=5.0, beta0=1.0):
    """Full precision per class: Normal-Wishart (mu_k | Lambda_k ~ N(0, (beta0 Lambda_k)^-1))."""
    t, n, d = x.shape
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), 2.0)))
        with pyro.plate("classes", way, dim=-1):
            lam = pyro.sample("lam", dist.Wishart(x.new_tensor(nu0), covariance_matrix=eye / nu0))
            mu = pyro.sample(
                "mu", dist.MultivariateNormal(x.new_zeros(d), precision_matrix=beta0 * lam)
            )
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            loc = Vindex(mu.unsqueeze(-3))[..., z, :]
            prec = Vindex(lam.unsqueeze(-4))[..., z, :, :]
            pyro.sample("x", dist.MultivariateNormal(loc, precision_matrix=prec), obs=x)


def mvn_mean_model(x, m0=0.5, p0=2.0):
    """mu ~ N(m0 1, (p0 I)^-1), x_n ~ N(mu, P^-1) with a fixed full precision P."""
    t, n, d = x.shape
    eye = torch.eye(d, dtype=x.dtype, device=x.device)
    prec = eye * 1.5 + 0.3
    with pyro.plate("tasks", t, dim=-1):
        mu = pyro.sample(
            "mu", dist.MultivariateNormal(x.new_full((d,), m0), precision_matrix=p0 * eye)
        )
        with pyro.plate("points", n, dim=-2):
            pyro.sample(
                "x", dist.MultivariateNormal(mu, precision_matrix=prec), obs=x.transpose(0, 1)
            )


# ----------------------------------------------------------------- exact posteriors
def test_multivariate_normal_mean_exact_evidence():
    x = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    state, _ = VMP(mvn_mean_model, tol=0).fit(x)
    n, d = 6, 3
    prec = torch.eye(d, dtype=F64) * 1.5 + 0.3
    cov = torch.kron(torch.eye(n, dtype=F64), torch.linalg.inv(prec).contiguous())
    cov = cov + torch.kron(torch.ones(n, n, dtype=F64), torch.eye(d, dtype=F64) / 2.0)
    mvn = torch.distributions.MultivariateNormal(torch.full((n * d,), 0.5, dtype=F64), cov)
    exact = mvn.log_prob(x.reshape(4, -1))
    torch.testing.assert_close(state.objective, exact, rtol=1e-10, atol=1e-10)
    post = VMP(mvn_mean_model).posterior(state)["mu"]
    p_n = 2.0 * torch.eye(d, dtype=F64) + n * prec
    mean = torch.linalg.solve(p_n, 2.0 * 0.5 + prec @ x.sum(1).T).T
    torch.testing.assert_close(post.mean, mean, rtol=1e-10, atol=1e-10)


def _normal_mean_evidence(x, mu0, lam0, tau):
    n = x.shape[-1]
    cov = torch.eye(n, dtype=F64) / tau + torch.ones(n, n, dtype=F64) / (lam0 * tau)
    return torch.distributions.MultivariateNormal(torch.full((n,), mu0, dtype=F64), cov).log_prob(x)


def test_normal_mean_exact_evidence():
    x, hyper = _x(), dict(mu0=0.5, lam0=2.0, tau=1.7)
    state, _ = VMP(partial(normal_mean_model, **hyper), tol=0).fit(x)
    torch.testing.assert_close(
        state.objective, _normal_mean_evidence(x, **hyper), rtol=1e-10, atol=1e-10
    )
    post = VMP(partial(normal_mean_model, **hyper)).posterior(state)["mu"]
    lam_n = (hyper["lam0"] + x.shape[1]) * hyper["tau"]
    mean = (hyper["lam0"] * hyper["mu0"] + x.sum(-1)) / (hyper["lam0"] + x.shape[1])
    torch.testing.assert_close(post.mean, mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(post.scale, torch.full_like(mean, lam_n).rsqrt())


def _dirichlet_categorical_evidence(y, k, a0):
    counts = torch.nn.functional.one_hot(y, k).sum(1).to(F64)
    n = y.shape[1]
    return (
        math.lgamma(k * a0)
        - math.lgamma(k * a0 + n)
        + (torch.lgamma(a0 + counts) - math.lgamma(a0)).sum(-1)
    )


def test_dirichlet_categorical_exact_evidence():
    y = torch.randint(0, 5, (6, 30), generator=torch.Generator().manual_seed(0))
    state, _ = VMP(proportions_model).fit(y)
    exact = _dirichlet_categorical_evidence(y, 5, 2.0)
    torch.testing.assert_close(state.objective, exact, rtol=1e-10, atol=1e-10)


def _gamma_precision_model(x, a0=2.0, b0=1.5, m=0.3):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        tau = pyro.sample("tau", dist.Gamma(x.new_tensor(a0), x.new_tensor(b0)))
        pyro.sample("x", dist.Normal(m, tau.rsqrt().unsqueeze(-1)).to_event(1), obs=x)


def test_gamma_precision_exact_evidence():
    x, a0, b0, m = _x(), 2.0, 1.5, 0.3
    state, _ = VMP(_gamma_precision_model, tol=0).fit(x)
    n = x.shape[1]
    a_n, b_n = a0 + n / 2, b0 + 0.5 * ((x - m) ** 2).sum(-1)
    exact = (
        a0 * math.log(b0)
        - math.lgamma(a0)
        + math.lgamma(a_n)
        - a_n * b_n.log()
        - 0.5 * n * math.log(2 * math.pi)
    )
    torch.testing.assert_close(state.objective, exact, rtol=1e-10, atol=1e-10)
    post = VMP(_gamma_precision_model).posterior(state)["tau"]
    torch.testing.assert_close(post.rate, b_n, rtol=1e-10, atol=1e-10)


def _wishart_precision_model(x, nu0=5.0):
    t, n, d = x.shape
    scale = (torch.eye(d, dtype=x.dtype, device=x.device) + 0.2) / nu0
    with pyro.plate("tasks", t, dim=-1):
        lam = pyro.sample("lam", dist.Wishart(x.new_tensor(nu0), covariance_matrix=scale))
        with pyro.plate("points", n, dim=-2):
            loc = x.new_zeros(d)
            pyro.sample(
                "x", dist.MultivariateNormal(loc, precision_matrix=lam), obs=x.transpose(0, 1)
            )


@pytest.mark.filterwarnings("ignore:Singular sample")
def test_wishart_precision_exact_evidence():
    x = torch.randn(3, 7, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    state, _ = VMP(_wishart_precision_model, tol=0).fit(x)
    n, d, nu0 = 7, 3, 5.0
    w0 = (torch.eye(d, dtype=F64) + 0.2) / nu0
    w_n = torch.linalg.inv(torch.linalg.inv(w0) + x.transpose(1, 2) @ x)
    nu_n = nu0 + n

    def log_z(nu, w):  # Wishart normaliser 2^{nu D/2} |W|^{nu/2} Gamma_D(nu/2)
        nu_t = torch.as_tensor(nu / 2, dtype=F64)
        return (
            0.5 * nu * d * math.log(2)
            + 0.5 * nu * torch.logdet(w)
            + torch.special.multigammaln(nu_t, d)
        )

    exact = log_z(nu_n, w_n) - log_z(nu0, w0) - 0.5 * n * d * math.log(2 * math.pi)
    torch.testing.assert_close(state.objective, exact, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------- the hand-written engines
def test_normal_gamma_matches_hand_written_engine():
    x, hyper = _x(), dict(mu0=0.5, lam0=2.0, a0=2.0, b0=1.5)
    state, _ = VMP(partial(normal_gamma_model, **hyper), max_iter=200, tol=0).fit(x)
    engine = NormalGammaVB(**hyper)
    ref, _ = run(engine, engine.init(x), 200)
    torch.testing.assert_close(state.objective, ref.objective, rtol=1e-10, atol=1e-10)
    post = VMP(normal_gamma_model).posterior(state)
    torch.testing.assert_close(post["mu"].mean, ref.mu_mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(post["tau"].rate, ref.tau_rate, rtol=1e-9, atol=1e-9)


def test_mixture_matches_bavardage_identity_engine():
    xs, ys, xq, _ = _mixture_data()
    hyper = dict(way=3, tau=1.0, alpha0=2.0, beta0=1.0)
    engine = BavardageVB(projection="identity", **hyper)
    ref, _ = run(engine, engine.init(xs, ys, xq), 300)
    vmp = VMP(partial(bavardage_model, **hyper), max_iter=300, tol=0)
    state, _ = vmp.fit(xs, ys, xq)
    rel = ((state.objective - ref.objective) / ref.objective).abs().max()
    assert rel <= 1e-6
    assert (state.q["z"][0] - ref.query_resp).abs().max() <= 1e-6


# ------------------------------------------------------------------ conformance
def _cases():
    x = _x()
    mean_h = dict(mu0=0.5, lam0=2.0, tau=1.7)
    gamma_h = dict(mu0=0.5, lam0=2.0, a0=2.0, b0=1.5)
    y = torch.randint(0, 5, (4, 20), generator=torch.Generator().manual_seed(3))
    xs, ys, xq, _ = _mixture_data(t=3, q=8)
    mix_h = dict(way=3, tau=1.0, alpha0=2.0, beta0=1.0)
    return {
        "normal-mean": ConformanceCase(
            make_engine=lambda: VMP(partial(normal_mean_model, **mean_h)),
            model=partial(normal_mean_model, **mean_h),
            data=(x,),
            n_steps=3,
            exact_log_evidence=_normal_mean_evidence(x, **mean_h),
        ),
        "normal-gamma": ConformanceCase(
            make_engine=lambda: VMP(partial(normal_gamma_model, **gamma_h), tol=0),
            model=partial(normal_gamma_model, **gamma_h),
            data=(x,),
            n_steps=15,
        ),
        "proportions": ConformanceCase(
            make_engine=lambda: VMP(proportions_model),
            model=proportions_model,
            data=(y,),
            n_steps=2,
            exact_log_evidence=_dirichlet_categorical_evidence(y, 5, 2.0),
        ),
        "bavardage-identity": ConformanceCase(
            make_engine=lambda: VMP(partial(bavardage_model, **mix_h), tol=0),
            model=partial(bavardage_model, **mix_h),
            data=(xs, ys, xq),
            n_steps=10,
            max_plate_nesting=2,
            particles=200,
        ),
        "wishart-mixture": ConformanceCase(
            make_engine=lambda: VMP(partial(wishart_mixture_model, way=3), tol=0),
            model=partial(wishart_mixture_model, way=3),
            data=_gamma_mixture_case_data(t=3),
            n_steps=10,
            particles=200,
        ),
        "gamma-mixture": ConformanceCase(
            make_engine=lambda: VMP(partial(gamma_mixture_model, way=3), tol=0),
            model=partial(gamma_mixture_model, way=3),
            data=_gamma_mixture_case_data(t=3),
            n_steps=10,
            particles=200,
        ),
    }


@pytest.mark.filterwarnings("ignore:Singular sample")
@pytest.mark.parametrize("name", list(_cases()))
def test_vmp_passes_conformance(name):
    check_engine(_cases()[name])


def test_conformance_catches_a_broken_derived_update(monkeypatch):
    """The message to a Normal mean overstates the data term by 10%: both checks fail."""
    from probfsl.inference.vmp import messages

    exact = messages.message

    def broken_message(plan, q, child, role, to):
        out = exact(plan, q, child, role, to)
        return [1.1 * out[0], out[1]] if role == "loc" else out

    case = _cases()["normal-mean"]
    monkeypatch.setattr(messages, "message", broken_message)
    with pytest.raises(AssertionError):
        assert_exact_evidence(case)
    with pytest.raises(AssertionError):
        check_engine(case)


# ------------------------------------------------------------------ behaviour
def test_monotone_over_50_sweeps():
    x, labels, observed = _gamma_mixture_case_data(t=6, seed=1)
    vmp = VMP(partial(gamma_mixture_model, way=3), tol=0)
    _, info = run(vmp, vmp.init(x, labels, observed), 50)
    diff = info.trace[1:] - info.trace[:-1]
    assert diff.min() >= -1e-9 * info.trace.abs().max()
    assert info.trace.shape == (51, 6) and (info.n_steps == 50).all()


class _CountingPuts(VMP):
    """VMP recording how the loop writes compacted tasks back: ``put`` (a new state) or
    ``put_`` (into its own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.puts: list[str] = []

    def put(self, full, index, part):
        self.puts.append("put")
        return super().put(full, index, part)

    def put_(self, full, index, part):
        self.puts.append("put_")
        return super().put_(full, index, part)


def test_fit_masks_converged_tasks_and_equals_each_task_alone():
    """``fit`` freezes a converged task by masking, then drops it from the batch and
    writes it back (``put``, then ``put_`` into the loop's own copy): task t's factors are
    those of t run alone for the sweeps it took, and its ELBO trace is flat after that."""
    x, labels, observed = _gamma_mixture_case_data(t=8, seed=2)
    vmp = _CountingPuts(partial(gamma_mixture_model, way=3), max_iter=200, tol=1e-9, check_every=2)
    fitted, info = vmp.fit(x, labels, observed)
    assert vmp.puts[0] == "put" and vmp.puts.count("put_") >= 2
    assert info.converged.all() and info.n_steps.max() < 200
    assert info.n_steps.min() < info.n_steps.max()  # tasks froze at different sweeps
    assert fitted.q["z"][0].shape[0] == 8 and fitted.objective.shape == (8,)
    for t in range(8):
        k = int(info.n_steps[t])
        one = (x[t : t + 1], labels[t : t + 1], observed[t : t + 1])
        alone, _ = run(vmp, vmp.init(*one), k)
        torch.testing.assert_close(
            fitted.objective[t : t + 1], alone.objective, rtol=1e-12, atol=1e-10
        )
        for name in fitted.q:
            for a, b in zip(fitted.q[name], alone.q[name], strict=True):
                torch.testing.assert_close(a[t : t + 1], b, rtol=1e-10, atol=1e-10)
        assert (info.trace[k:, t] == fitted.objective[t]).all()


def test_put_in_place_equals_put():
    """``put_`` writes the part's tasks into the state it is given and returns it, with
    the values ``put`` gives in a new state (which leaves its ``full`` as it was)."""
    x, labels, observed = _gamma_mixture_case_data(t=4, seed=3)
    vmp = VMP(partial(gamma_mixture_model, way=3), tol=0)
    full = vmp.init(x, labels, observed)
    index = torch.tensor([2, 0])
    part, _ = vmp.step(vmp.take(full, index))
    before = {n: tuple(t.clone() for t in f) for n, f in full.q.items()}
    new = vmp.put(full, index, part)
    own = VMPState(
        full.plan,
        {n: tuple(t.clone() for t in f) for n, f in full.q.items()},
        full.objective.clone(),
    )
    got = vmp.put_(own, index, part)
    assert got is own and torch.equal(got.objective, new.objective)
    assert not torch.equal(got.objective, full.objective)
    for name in full.q:
        for a, b in zip(got.q[name], new.q[name], strict=True):
            assert torch.equal(a, b)
        assert all(torch.equal(a, c) for a, c in zip(full.q[name], before[name], strict=True))


def test_take_keeps_the_broadcast_axes_of_the_factors():
    """``take`` selects the tasks' factors (the values of ``index_select``); an axis a
    factor holds broadcast (a Gamma shape, one value per class along the event axis) stays
    broadcast, so that the next sweep's elementwise functions still run once per value."""

    def model(x, way=3):
        with pyro.plate("tasks", x.shape[0], dim=-2):
            pi = pyro.sample("pi", dist.Dirichlet(x.new_ones((1, way))))
            with pyro.plate("classes", way, dim=-1):
                mu = pyro.sample("mu", dist.Normal(x.new_zeros(x.shape[-1]), 1.0).to_event(1))
                tau = pyro.sample(
                    "tau", dist.Gamma(x.new_full((x.shape[-1],), 2.0), 1.0).to_event(1)
                )
            with pyro.plate("points", x.shape[1], dim=-1):
                z = pyro.sample("z", dist.Categorical(pi))
                loc = Vindex(mu.unsqueeze(-3))[..., z, :]
                scale = Vindex(tau.unsqueeze(-3))[..., z, :].rsqrt()
                pyro.sample("x", dist.Normal(loc, scale).to_event(1), obs=x)

    x = _mixture_data(t=4)[2]
    vmp = VMP(model, tol=0)
    state, _ = vmp.step(vmp.init(x))
    assert state.q["tau"][0].stride()[-1] == 0
    index = torch.tensor([3, 1])
    part = vmp.take(state, index)
    for name in state.q:
        for t, u in zip(state.q[name], part.q[name], strict=True):
            assert torch.equal(u, t.index_select(0, index))
    assert part.q["tau"][0].stride()[-1] == 0


def test_take_carries_the_rows_of_the_data_constants():
    """A compaction takes the rows of the constants of the data (a Poisson site's ln k!,
    computed by the first bound) instead of computing them again, and the bound of the
    tasks it keeps is theirs in the whole batch."""

    def model(k):
        with pyro.plate("tasks", k.shape[0], dim=-2):
            lam = pyro.sample("lam", dist.Gamma(k.new_tensor(2.0), k.new_tensor(1.0)))
            with pyro.plate("n", k.shape[1], dim=-1):
                pyro.sample("k", dist.Poisson(lam), obs=k)

    k = torch.poisson(
        torch.full((5, 7), 3.0, dtype=torch.float64), torch.Generator().manual_seed(0)
    )
    vmp = VMP(model, tol=0)
    state = vmp.init(k)
    (key,) = [key for key in state.plan.constants if key[0] == "log_factorial"]
    index = torch.tensor([4, 0, 2])
    part = vmp.take(state, index)
    value, dims = part.plan.constants[key]
    assert torch.equal(value, state.plan.constants[key][0].index_select(0, index))
    assert torch.equal(value, torch.lgamma(k.index_select(0, index) + 1))
    torch.testing.assert_close(vmp.elbo(part), vmp.elbo(state).index_select(0, index))


def test_keep_restores_frozen_tasks_and_shares_the_plan():
    """``keep`` takes the frozen tasks' factors and ELBO from the old state, the others from
    the new one, and passes the plan (data, fixed parameters) through untouched."""
    x, labels, observed = _gamma_mixture_case_data(t=4, seed=3)
    vmp = VMP(partial(gamma_mixture_model, way=3), tol=0)
    old = vmp.init(x, labels, observed)
    new, info = vmp.step(old)
    assert info.objective is new.objective
    frozen = torch.tensor([True, False, True, False])
    kept = vmp.keep(frozen, old, new)
    assert kept.plan is new.plan
    assert kept.plan.sites["x"].value is old.plan.sites["x"].value
    torch.testing.assert_close(kept.objective[frozen], old.objective[frozen], rtol=0, atol=0)
    torch.testing.assert_close(kept.objective[~frozen], new.objective[~frozen], rtol=0, atol=0)
    assert not torch.equal(old.objective, new.objective)
    for name in new.q:
        for a, b, c in zip(old.q[name], new.q[name], kept.q[name], strict=True):
            assert c.shape == b.shape
            torch.testing.assert_close(c[frozen], a[frozen], rtol=0, atol=0)
            torch.testing.assert_close(c[~frozen], b[~frozen], rtol=0, atol=0)


def test_observed_labels_stay_fixed_and_posterior_shapes():
    x, labels, observed = _gamma_mixture_case_data(t=2)
    vmp = VMP(partial(gamma_mixture_model, way=3))
    state, _ = vmp.fit(x, labels, observed)
    post = vmp.posterior(state)
    z = post["z"].probs
    assert z.shape == (2, x.shape[1], 3)
    n_s = int(observed[0].sum())
    assert torch.equal(z[:, :n_s], torch.nn.functional.one_hot(labels[:, :n_s], 3).to(F64))
    assert (
        post["tau"].batch_shape == (2, 3)
        and post["tau"].event_shape == (3,)
        and post["pi"].event_shape == (3,)
    )


def test_init_from_given_responsibilities():
    xs, ys, xq, yq = _mixture_data()
    hyper = dict(way=3, tau=1.0, alpha0=2.0, beta0=1.0)
    vmp = VMP(partial(bavardage_model, **hyper))
    resp = torch.nn.functional.one_hot(yq, 3).to(F64)
    state = vmp.init(xs, ys, xq, init_resp={"z": resp})
    engine = BavardageVB(projection="identity", **hyper)
    ref = engine.init(xs, ys, xq, torch.cat([torch.zeros(5, 6, 3, dtype=F64), resp], 1))
    torch.testing.assert_close(state.objective, ref.objective, rtol=1e-12, atol=1e-10)
    with pytest.raises(ValueError, match="init_resp"):
        vmp.init(xs, ys, xq, init_resp={"w": resp})
    zero_row, negative = resp.clone(), resp.clone()
    zero_row[1, 3] = 0.0
    negative[0, 2, 0] = -0.3
    for bad, words in (
        (zero_row, "positive sum"),
        (negative, ">= 0"),
        (resp[..., :2], r"of shape \[5, 12, 3\], got \(5, 12, 2\)"),
        (resp.clone().fill_(float("nan")), "finite"),
    ):
        with pytest.raises(ValueError, match=f"init_resp\\['z'\\] must be.*{words}"):
            vmp.init(xs, ys, xq, init_resp={"z": bad})


def test_float32_follows_input():
    x = _x().float()
    state, _ = VMP(normal_gamma_model).fit(x)
    assert state.objective.dtype == torch.float32
    assert state.q["mu"][0].dtype == torch.float32


# ------------------------------------------------------------------ refusals
def _lognormal_scale(x):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        s = pyro.sample("sigma", dist.LogNormal(x.new_tensor(0.0), 1.0))
        pyro.sample("x", dist.Normal(x.new_tensor(0.0), s.unsqueeze(-1)).to_event(1), obs=x)


def _exp_of_gamma(x):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), 1.0))
        scale = tau.exp().rsqrt().unsqueeze(-1)
        pyro.sample("x", dist.Normal(x.new_tensor(0.0), scale).to_event(1), obs=x)


def _nonlinear_mean(x):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
        pyro.sample("x", dist.Normal(mu.tanh().unsqueeze(-1), 1.0).to_event(1), obs=x)


def _latent_gamma_shape(x):
    with pyro.plate("tasks", x.shape[0], dim=-1):
        shape = pyro.sample("shape", dist.Gamma(x.new_tensor(2.0), 1.0))
        pyro.sample("x", dist.Gamma(shape.unsqueeze(-1), 1.0).to_event(1), obs=x.abs() + 0.1)


def _no_tasks_plate(x):
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(x.shape[0]), 1.0).to_event(1))
    pyro.sample("x", dist.Normal(mu.unsqueeze(-1), 1.0).to_event(2), obs=x)


@pytest.mark.parametrize(
    "model, site, words",
    [
        (_lognormal_scale, "sigma", "LogNormal"),
        (_exp_of_gamma, "x", "'tau' (Gamma)"),
        (_nonlinear_mean, "x", "'mu' (Normal)"),
        (_latent_gamma_shape, "x", "'shape' (Gamma)"),
        (_no_tasks_plate, "mu", "tasks"),
    ],
)
def test_non_conjugate_models_are_refused(model, site, words):
    with pytest.raises(ValueError, match=f"site '{site}'") as err:
        VMP(model).init(_x())
    text = str(err.value)
    assert words in text and text.startswith("VMP cannot use site")
    assert text.endswith("The supported forms are listed in docs/modelling.md#supported-forms.")


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        VMP("not a model")
    with pytest.raises(ValueError, match="max_iter"):
        VMP(normal_mean_model, max_iter=0)
    with pytest.raises(ValueError, match="tol"):
        VMP(normal_mean_model, tol=float("nan"))


def _selected_constant_model(
    x_support, support_labels, x_query, way, tau=1.0, alpha0=2.0, beta0=1.0
):
    """BAVARDAGE's mixture written with a per-class precision table picked by Vindex."""
    t, d = x_support.shape[0], x_support.shape[-1]
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x_support.new_full((1, way), alpha0)))
        with pyro.plate("classes", way, dim=-1):
            mu = pyro.sample(
                "mu", dist.Normal(x_support.new_zeros(d), (beta0 * tau) ** -0.5).to_event(1)
            )
        table = x_support.new_full((t, way, d), tau)
        with pyro.plate("support", x_support.shape[1], dim=-1):
            loc = Vindex(mu.unsqueeze(-3))[..., support_labels, :]
            pyro.sample("xs", dist.Normal(loc, tau**-0.5).to_event(1), obs=x_support)
        with pyro.plate("queries", x_query.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
            loc = Vindex(mu.unsqueeze(-3))[..., z, :]
            scale = Vindex(table.unsqueeze(-3))[..., z, :].rsqrt()
            pyro.sample("xq", dist.Normal(loc, scale).to_event(1), obs=x_query)


def test_fixed_table_selected_by_a_latent_label_matches_bavardage():
    xs, ys, xq, _ = _mixture_data()
    hyper = dict(way=3, tau=1.0, alpha0=2.0, beta0=1.0)
    ours, _ = VMP(partial(_selected_constant_model, **hyper), tol=0, max_iter=200).fit(xs, ys, xq)
    ref, _ = VMP(partial(bavardage_model, **hyper), tol=0, max_iter=200).fit(xs, ys, xq)
    torch.testing.assert_close(ours.objective, ref.objective, rtol=1e-10, atol=1e-8)


def test_vmp_gmm_method():
    from probfsl import make_estimator
    from probfsl.data import load_dataset, sample_episodes

    fs = load_dataset("omniglot")
    tasks = sample_episodes(fs, 20, way=5, shot=1, n_query=30, seed=0)
    est = make_estimator("vmp-gmm", max_iter=10).fit_featureset(fs)
    proba = est.predict_proba(tasks)
    assert proba.shape == (20, 30, 5) and proba.dtype == torch.float32
    torch.testing.assert_close(proba.sum(-1), torch.ones(20, 30))
    accuracy = (proba.argmax(-1) == tasks.query_labels).float().mean()
    assert accuracy > 0.5  # chance is 0.2
    with pytest.raises(ValueError, match="a0"):
        make_estimator("vmp-gmm", a0=-1.0)


def _vmp_gmm_setup(n_tasks=3, n_query=10):
    """The vmp-gmm estimator with its default hyperparameters, fitted on the built-in
    Omniglot base classes, and a few 5-way 1-shot tasks."""
    from probfsl import make_estimator
    from probfsl.data import load_dataset, sample_episodes

    fs = load_dataset("omniglot")
    tasks = sample_episodes(fs, n_tasks, way=5, shot=1, n_query=n_query, seed=1)
    return make_estimator("vmp-gmm").fit_featureset(fs), tasks


def test_vmp_gmm_engine_passes_conformance_in_production_configuration():
    """The engine ``vmp-gmm`` runs (its defaults: max_iter=30, tol=1e-6, soft k-means
    initialisation) passes every check, the device audit and the no-host-sync one included."""
    est, tasks = _vmp_gmm_setup()
    x, labels, observed = est.engine_data(tasks)
    n_s = tasks.support.shape[1]
    engine = est.engine(tasks.way, n_s)
    assert (engine.max_iter, engine.tol) == (30, 1e-6)
    case = ConformanceCase(
        make_engine=lambda: est.engine(tasks.way, n_s),
        model=engine.model,
        data=(x.double(), labels, observed),
        n_steps=10,
        particles=200,
        rtol_float32=1e-3,
    )
    check_engine(case)


def test_vmp_gmm_host_syncs_do_not_grow_with_the_tasks():
    """``predict_proba`` synchronises with the host a fixed number of times (plan derivation,
    input checks, and run's convergence checks every ``check_every`` sweeps): at most 50, the
    same for T tasks as for the same tasks three times over (same sweeps to converge)."""
    from probfsl.data.tasks import Episodes
    from probfsl.host_syncs import HostSyncCounter

    est, tasks = _vmp_gmm_setup(n_tasks=4, n_query=30)
    tripled = Episodes(**{k: v.repeat(3, *[1] * (v.dim() - 1)) for k, v in vars(tasks).items()})
    counts = []
    for episodes in (tasks, tripled):
        with HostSyncCounter() as counter:
            proba = est.predict_proba(episodes)
        counts.append(counter.total)
        assert proba.shape == (len(episodes), 30, 5)
    assert counts[0] == counts[1] <= 50, counts


# ------------------------------------------------------------------------- speed-ups
def test_precision_coefficients_are_exact_constants():
    """c of a precision c·τ is read off the form the model computes it in ((λ₀ τ)^-1/2 as a
    scale: λ₀¹ τ¹), not off its value ((τ^-1/2)^-2 / τ = 1 ± ulp): the model's constant
    exactly, a scalar, so the sweeps never carry a [T, N] tensor and c = 1 has no term."""
    plan = VMP(partial(normal_gamma_model, lam0=2.0)).compile(_x(t=6, n=9))
    x, mu = plan.sites["x"].params["precision"], plan.sites["mu"].params["precision"]
    assert x.coef_dims == () and x.coef.item() == 1.0 and x.unit_coef
    assert mu.coef_dims == () and mu.coef.item() == 2.0 and not mu.unit_coef


@pytest.mark.parametrize("t", [2, 50])
def test_contraction_direct_and_pairwise_paths_agree(t):
    """One einsum call (small or no blow-up) and opt_einsum's pairwise path give one sum."""
    from probfsl.inference.vmp.einsum import contract as _contract

    g = torch.Generator().manual_seed(0)
    r = torch.rand(t, 30, 4, generator=g, dtype=F64)
    x = torch.randn(t, 30, 6, generator=g, dtype=F64)
    m = torch.randn(t, 4, 6, generator=g, dtype=F64)
    got = _contract("tnk,tnd,tkd->tkd", [r, x, m])
    want = (r.unsqueeze(-1) * x.unsqueeze(-2)).sum(1) * m
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    a, b = torch.randn(t, 30, generator=g, dtype=F64), torch.randn(t, generator=g, dtype=F64)
    got = _contract("tn,t,tn->t", [a, b, a])
    torch.testing.assert_close(got, (a * a).sum(-1) * b, rtol=1e-12, atol=1e-12)


SPECS = [
    "tnk,tnd->tkd",  # a mixture's weighted statistics
    "tndp,tkdp->tnk",  # its per-component log-density
    "tkd,tndp,tkdp->tnk",
    "tnk->tk",
    "tkd,tkd->tk",
    "tkdp,tkd->tkdp",  # no axis contracted: a broadcast product
    "ab,cd->abcd",
    "abc,bd,ad->c",
    "a,a->",  # a scalar result, then ...
    "a,a,b->b",  # ... contracted with another operand
    "abc,cb->acb",  # the result permuted
    "abcd,bd->ac",  # an axis summed by one operand alone
]


@pytest.mark.parametrize("spec", SPECS)
def test_pairwise_batched_products_equal_torch_einsum(spec):
    """:func:`contract` (pairs of operands as batched products of views, in opt_einsum's
    order) against ``torch.einsum`` on random operands, float64, to rounding."""
    from probfsl.inference.vmp.einsum import contract as _contract
    from probfsl.inference.vmp.einsum import sweeping

    g = torch.Generator().manual_seed(len(spec))
    inputs = spec.split("->")[0]
    sizes = {c: 2 + i for i, c in enumerate(sorted(set(inputs) - {","}))}
    ops = [
        torch.randn([sizes[c] for c in sub], generator=g, dtype=F64) for sub in inputs.split(",")
    ]
    with sweeping():
        got = _contract(spec, ops)
        want = torch.einsum(spec, *ops)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_contraction_broadcasting_an_axis_falls_back_to_einsum():
    """An axis of size 1 in one operand and n in the other (einsum's broadcasting) has no
    batched-product route; the result is still einsum's."""
    from probfsl.inference.vmp.einsum import _pair_route
    from probfsl.inference.vmp.einsum import contract as _contract

    assert _pair_route("ab", "ab", "a", (3, 1), (3, 4)) is None
    a, b = torch.randn(3, 1, dtype=F64), torch.randn(3, 4, dtype=F64)
    torch.testing.assert_close(_contract("ab,ab->a", [a, b]), (a * b).sum(-1))


def test_selection_gather_equals_pyros_vindex():
    """The compiler's row lookup of a component table by a label (the verification of a
    mixture's selected parameters) equals Pyro's ``Vindex`` on the same values."""
    from pyro.ops.indexing import Vindex

    from probfsl.inference.vmp.selection import select as _select

    g = torch.Generator().manual_seed(0)
    table = torch.randn(4, 3, 5, generator=g, dtype=F64)  # tasks, classes, event
    z = torch.randint(0, 3, (4, 7), generator=g)  # tasks, points
    sizes = {"t": 4, "k": 3, "e": 5, "n": 7}
    got = _select(table, ("t", "k", "e"), "k", z, ("t", "n"), ("t", "n", "e"), sizes)
    want = Vindex(table.unsqueeze(-3))[..., z, :]
    assert torch.equal(got, want)
    # the event axis first in the output, the table's component axis last
    got = _select(
        table.transpose(1, 2), ("t", "e", "k"), "k", z, ("t", "n"), ("e", "t", "n"), sizes
    )
    assert torch.equal(got, want.permute(2, 0, 1))


def test_convergence_checks_every_sweep_on_the_cpu_and_at_growing_gaps_elsewhere():
    """The default schedule follows the device (a CPU check waits for nothing); given
    values are kept on every device."""
    vmp = VMP(normal_gamma_model)
    assert vmp.schedule(torch.device("cpu")) == (1, 1.0)
    assert vmp.schedule(torch.device("meta")) == (2, 1.25)
    given = VMP(normal_gamma_model, check_every=3, check_growth=1.5)
    assert given.schedule(torch.device("cpu")) == given.schedule(torch.device("meta")) == (3, 1.5)
    with pytest.raises(ValueError, match="check_growth"):
        VMP(normal_gamma_model, check_growth=0.5)


def test_fit_returns_ordinary_tensors():
    """The sweeps run in inference mode; the fitted factors, bound and run record leave as
    ordinary tensors, which may be updated in place and enter autograd afterwards."""
    state, info = VMP(normal_gamma_model, tol=1e-8).fit(_x(t=3, n=5))
    tensors = [t for f in state.q.values() for t in f] + [state.objective, *info]
    assert not any(t.is_inference() for t in tensors)
    loc = state.q["mu"][0].clone().requires_grad_()
    (loc * state.q["mu"][1]).sum().backward()
    torch.testing.assert_close(loc.grad, state.q["mu"][1])
    state.q["mu"][0].add_(1.0)


def _vector_mixture(x, k=3, classes_as_plate=False):
    """A 1-d Gaussian mixture whose K means and precisions are either one vector site each
    (``to_event(1)``, the component picked from the event axis) or K sites in a plate."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(1, k)))
        if classes_as_plate:
            with pyro.plate("classes", k, dim=-1):
                mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 3.0)).unsqueeze(-2)
                tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), 1.0)).unsqueeze(-2)
        else:
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(1, k), 3.0).to_event(1))
            tau = pyro.sample("tau", dist.Gamma(x.new_full((1, k), 2.0), 1.0).to_event(1))
        with pyro.plate("points", x.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
            pyro.sample("x", dist.Normal(Vindex(mu)[..., z], Vindex(tau)[..., z].rsqrt()), obs=x)


@pytest.mark.parametrize("n", [30, 3])
def test_components_on_an_event_axis_are_the_mixture_of_a_plate(n):
    """``Vindex(mu)[..., z]`` with ``mu`` a vector of K means (its event axis is the
    component axis the label picks from) is the same mixture as K means in a plate: the
    same bounds and responsibilities; also with as many points as components (n = K = 3),
    where the event axis could align with the points."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, n, generator=g, dtype=F64) + 3.0 * torch.randint(0, 3, (6, n), generator=g)
    r0 = torch.softmax(torch.randn(6, n, 3, generator=g, dtype=F64), -1)
    fits = [
        VMP(partial(_vector_mixture, classes_as_plate=p), tol=1e-12, max_iter=500).fit(
            x, init_resp={"z": r0}
        )[0]
        for p in (False, True)
    ]
    torch.testing.assert_close(fits[0].objective, fits[1].objective, rtol=1e-13, atol=0)
    torch.testing.assert_close(fits[0].q["z"][0], fits[1].q["z"][0], rtol=0, atol=1e-12)


def _weighted_model(x, s):
    """x_tn ~ N(mu_t, s_n² / tau_t): ``s`` has one entry per point, not per task."""
    with pyro.plate("tasks", x.shape[0], dim=-1):
        tau = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), tau.rsqrt()))
        scale = s * tau.rsqrt().unsqueeze(-1)
        pyro.sample("x", dist.Normal(mu.unsqueeze(-1), scale).to_event(1), obs=x)


def test_argument_as_long_as_the_tasks_batched_equals_one_at_a_time():
    """The structure is read on one task (arguments with the tasks' length are sliced); an
    argument of that length that is not per task must not change the fit."""
    x, s = _x(t=6, n=6), torch.linspace(0.5, 2.0, 6, dtype=F64)
    vmp = VMP(_weighted_model, tol=0)
    batched, _ = run(vmp, vmp.init(x, s), 10)
    for t in range(6):
        one, _ = run(vmp, vmp.init(x[t : t + 1], s), 10)
        torch.testing.assert_close(one.objective, batched.objective[t : t + 1], rtol=1e-12, atol=0)
        torch.testing.assert_close(
            one.q["mu"][0], batched.q["mu"][0][t : t + 1], rtol=1e-12, atol=0
        )


@pytest.mark.parametrize("order", [["pi", "mu", "z"], ["z", "pi", "mu"]])
def test_elbo_from_the_labels_normaliser_equals_the_full_elbo(order):
    """After q(z) = softmax(η) is updated last, E ln p(z|π) + E ln p(x|z,μ) + H[q(z)] is read
    off as Σ_n logsumexp_k η_nk: the same ELBO as summing the three terms."""
    xs, ys, xq, _ = _mixture_data()
    h = dict(way=3, tau=3.0, alpha0=2.0, beta0=1.0)
    vmp = VMP(partial(bavardage_model, **h), tol=0, order=order)
    state = vmp.init(xs, ys, xq)
    for _ in range(3):
        state, _ = vmp.step(state)
        full = vmp.elbo(replace(state, plan=replace(state.plan, cache={})))
        torch.testing.assert_close(state.objective, full, rtol=1e-12, atol=0)
        factor, _, others = state.plan.cache[("lse", "z")]
        used = factor is state.q["z"] and all(state.q[n] is v for n, v in others)
        assert used == (order[-1] == "z")  # stale once another factor moved after q(z)


# ------------------------------------------------------------------------- bad input


def _normal_mean_model(x, prior_scale=1.0):
    """x [T, N]: a Normal mean per task, Normal observations."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), prior_scale))
        with pyro.plate("points", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def _integer_observations(x, y):
    """x float (unused but floating), y integer counts observed by a Normal site."""
    with pyro.plate("tasks", y.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("points", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _no_sites(x):
    return x.sum()


def _no_tasks_plate(x):
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
    with pyro.plate("points", x.shape[1], dim=-1):
        pyro.sample("x", dist.Normal(mu, 1.0).expand([x.shape[0], x.shape[1]]).to_event(0), obs=x)


def _all_observed(x, mu):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0), obs=mu)
        with pyro.plate("points", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def _with_param(x):
    scale = pyro.param("scale", torch.ones((), dtype=x.dtype))
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), scale))
        with pyro.plate("points", x.shape[1], dim=-1):
            pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def _branching(x):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=x.dtype), 1.0))
        with pyro.plate("points", x.shape[1], dim=-1):
            if bool(mu.sum() > 0):  # control flow on a latent value
                pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
            else:
                pyro.sample("x_neg", dist.Normal(-mu, 1.0), obs=x)


def _branching_on_labels(x):
    with pyro.plate("tasks", x.shape[0], dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(1, 10, dtype=x.dtype)))
        with pyro.plate("points", x.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
        size = int(z.sum()) + 1  # control flow on latent labels: a site's size follows them
        pyro.sample("w", dist.Normal(torch.zeros(size, dtype=x.dtype), 1.0).to_event(1))


@pytest.mark.parametrize(
    "model, data, message",
    [
        (_normal_mean_model, torch.tensor([[0.5, float("nan")]]), "'x'.*NaN or infinite"),
        (_normal_mean_model, torch.tensor([[0.5, float("inf")]]), "'x'.*NaN or infinite"),
        (
            _normal_mean_model,
            torch.tensor([[1.0, 2.0]], dtype=torch.float64) * 1e300,
            "'x'.*sufficient statistics",
        ),
        (_normal_mean_model, torch.tensor([[1, 2]]), r"argument\(s\) \[0\] are integer"),
        (_normal_mean_model, torch.zeros(0, 3), "at least one task"),
        (_normal_mean_model, torch.zeros(2, 0), r"has shape \(2, 0\)"),
        (_no_sites, torch.ones(2, 3), "has none"),
        (_no_tasks_plate, torch.ones(2, 3), "no batched 'tasks' plate"),
        (_with_param, torch.ones(2, 3), "pyro.param site.*scale"),
        (partial(_normal_mean_model, prior_scale=-1.0), torch.ones(2, 3), "'mu'.*scale is outside"),
        (_branching, torch.randn(1, 3), "control flow on a latent value"),
        (_branching_on_labels, torch.randn(1, 6), "control flow on a latent value"),
    ],
)
def test_vmp_refuses_bad_input_naming_the_site(model, data, message):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    with pytest.raises(ValueError, match=message):
        VMP(model).fit(data)


def _vague_logistic(x, y):
    """Logistic regression under an ARD prior with a vague Gamma(1e-3, 1e-3) precision."""
    with pyro.plate("tasks", x.shape[0]):
        a = pyro.sample("a", dist.Gamma(x.new_tensor(1e-3), 1e-3))
        w = pyro.sample(
            "w", dist.Normal(x.new_zeros(x.shape[-1]), a.unsqueeze(-1).rsqrt()).to_event(1)
        )
        pyro.sample("y", dist.Bernoulli(logits=(x * w.unsqueeze(-2)).sum(-1)).to_event(1), obs=y)


def _vague_regression(x, y):
    """Linear regression with vague Gamma(1e-2, 1e-2) weight and noise precisions."""
    with pyro.plate("tasks", x.shape[0]):
        alpha = pyro.sample("alpha", dist.Gamma(x.new_tensor(1e-2), 1e-2))
        beta = pyro.sample("beta", dist.Gamma(x.new_tensor(1e-2), 1e-2))
        w = pyro.sample(
            "w", dist.Normal(x.new_zeros(x.shape[-1]), alpha.unsqueeze(-1).rsqrt()).to_event(1)
        )
        mean = (x * w.unsqueeze(-2)).sum(-1)
        pyro.sample("y", dist.Normal(mean, beta.unsqueeze(-1).rsqrt()).to_event(1), obs=y)


@pytest.mark.parametrize("model", [_vague_regression, _vague_logistic])
def test_vmp_plan_does_not_depend_on_the_random_stream(model):
    """The compiler reads the model at values of its own streams, not at draws from the
    priors: a vague Gamma's draws underflow to 0, which hid the parents of some tasks'
    sites (their bound stuck far below BayesPy's). The fit is the same bit for bit
    whatever the global seed, and a task gets the same result alone as in its batch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 30, 5, dtype=torch.float64, generator=g)
    w = torch.randn(4, 1, 5, dtype=torch.float64, generator=g)
    if model is _vague_regression:
        y = (x * w).sum(-1) + 0.3 * torch.randn(4, 30, dtype=torch.float64, generator=g)
    else:
        p = torch.sigmoid(2 * (x * w).sum(-1))
        y = (torch.rand(4, 30, dtype=torch.float64, generator=g) < p).to(torch.float64)
    engine = VMP(model, max_iter=1000, tol=1e-12)
    fits = []
    for seed in (0, 1, 2, 7):
        torch.manual_seed(seed)
        fits.append(engine.fit(x, y)[0].objective)
    assert all(torch.equal(f, fits[0]) for f in fits)
    for t in range(4):
        torch.manual_seed(t)
        alone = engine.fit(x[t : t + 1], y[t : t + 1])[0].objective
        torch.testing.assert_close(alone[0], fits[0][t], rtol=1e-10, atol=1e-10)


def test_vmp_compiler_checks_agree_with_torch():
    """The compiler's shortcuts (closeness settled by equality or by the quotients first,
    finiteness and the real and positive constraints read off the extremes, the latter two
    also asking for finite values) give torch's answers, NaN, ±inf, zeros, signs and
    broadcasting included."""
    from pyro.distributions import constraints

    from probfsl.inference.vmp.checks import _holds, all_finite, close

    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 7, dtype=torch.float64, generator=g)
    cases = [base, base.abs(), base.abs() + 1, base[:, :1].expand(40, 7)]
    for special in (float("nan"), float("inf"), -float("inf"), 0.0):
        bad = base.abs().clone()
        bad[17, 3] = special
        cases.append(bad)
    for a in cases:
        assert bool(all_finite(a, None)) == bool(torch.isfinite(a).all())
        for c in (
            constraints.real,
            constraints.positive,
            constraints.independent(constraints.positive, 1),
            constraints.simplex,
        ):
            finite = c is constraints.simplex or bool(torch.isfinite(a).all())
            assert bool(_holds(c, a)) == (bool(c.check(a).all()) and finite), (c, a[17, 3])
        for b in cases:
            for rtol, atol in ((1e-5, 1e-8), (0.0, 0.0)):
                expect = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=False)
                assert close(a, b, rtol, atol) == expect
        # relative gaps on either side of rtol, of either sign, and a sign flip
        for gap in (1e-9, -1e-9, 4e-6, -4e-6, 9e-6, 1.1e-5, -1.1e-5, -2.0):
            near = a * (1 + gap)
            for rtol, atol in ((1e-5, 1e-8), (1e-5, 0.0), (0.0, 0.0)):
                expect = torch.allclose(near, a, rtol=rtol, atol=atol)
                assert close(near, a, rtol, atol) == expect, (gap, rtol, atol)
                assert close(-near, -a, rtol, atol) == expect, (gap, rtol, atol)
                assert close(near.float(), a, rtol, atol) == close(near, a.float(), rtol, atol)
        assert close(a[:, :1], a) == torch.allclose(a[:, :1].expand_as(a), a)


def test_vmp_reduce_constant_keeps_exactly_the_varying_axes():
    """Axes along which a parameter is constant (exactly, or within ``ulps`` units in the
    last place of the first slice) are dropped; checked against a slice-by-slice loop."""
    from probfsl.inference.vmp.layout import reduce_constant

    g = torch.Generator().manual_seed(0)
    eps = torch.finfo(torch.float64).eps
    base = torch.randn(4, 1, 3, dtype=torch.float64, generator=g).expand(4, 5, 3).clone()
    nudged = base.clone()
    nudged[:, 2] *= 1 + 2 * eps  # a few ulps along axis 1
    scalar = torch.full((3, 2), 1.5, dtype=torch.float64)
    scalar[1, 1] = 1.5 * (1 + 3 * eps)
    nan = base.clone()
    nan[0, 3, 0] = float("nan")
    for t in (base, nudged, scalar, nan, base[:, :, :1].expand(4, 5, 3)):
        dims = tuple("abc"[: t.dim()])
        for ulps in (0, 8):
            bound = ulps * eps

            def near(x, first, bound=bound):
                return bool(((x - first).abs() <= bound * first.abs()).all())

            value, kept = reduce_constant(t, dims, ulps)
            t0 = t.flatten()[0]
            if ulps and near(t, t0):
                assert kept == () and value.dim() == 0 and value == t0
                continue
            want = [
                d
                for i, d in enumerate(dims)
                if t.shape[i] > 1
                and not all(
                    torch.equal(t.select(i, j), t.select(i, 0))
                    if not ulps
                    else near(t.select(i, j), t.select(i, 0))
                    for j in range(t.shape[i])
                )
            ]
            assert list(kept) == want, (t.shape, ulps)
            index = tuple(slice(None) if d in want else 0 for d in dims)
            assert torch.equal(value, t[index]) or value.isnan().any()


def test_vmp_refuses_a_model_without_latent_sites_and_bad_settings():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="site 'y'.*torch.int64; give float32"):
        VMP(_integer_observations).fit(x, torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one latent site"):
        VMP(_all_observed).fit(x, torch.zeros(2, 1))
    for bad in (dict(max_iter=1.5), dict(max_iter=0), dict(tol=-1.0), dict(tol=float("nan"))):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            VMP(_normal_mean_model, **bad)
    # the good data still run
    state, info = VMP(_normal_mean_model).fit(torch.randn(2, 3))
    assert bool(torch.isfinite(info.trace).all())


def test_vmp_structure_check_leaves_the_random_stream_as_it_was(monkeypatch):
    """The extra traces of the structure check draw from reseeded streams and restore
    the user's: the stream after ``fit`` is the one without the check."""
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    streams = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(Compiler, "_check_structure", lambda self, *a: None)
        torch.manual_seed(5)
        VMP(_normal_mean_model, max_iter=2).fit(x)
        streams.append(torch.rand(3))
    assert torch.equal(*streams)
