"""VMP's count and discrete families (docs/design/vmp.md §7.4): Beta–Bernoulli, Beta–Binomial,
Gamma–Poisson, a Gamma rate with a Gamma parent, and Categorical or Bernoulli observations
inside mixtures (latent class models), each declared in plain Pyro.

Single-parent conjugate models have an exact posterior, and the ELBO at the optimum equals
the log evidence: both are checked against closed forms on 64 tasks. The hierarchies and
mixtures pass every conformance check (monotone bound, batch invariance, float32 against
float64, device, no host synchronisation, Pyro's ``Trace_ELBO`` on the derived guide)."""

from __future__ import annotations

import itertools
from functools import partial

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex
from torch.special import gammaln

from probfsl.inference import VMP
from probfsl.testing import ConformanceCase, assert_exact_evidence, check_engine

F64 = torch.float64


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _log_beta(a, b):
    return gammaln(a) + gammaln(b) - gammaln(a + b)


# ------------------------------------------------------------------------------ models
def beta_bernoulli(y, a=2.0, b=3.0):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        p = pyro.sample("p", dist.Beta(y.new_tensor(a), y.new_tensor(b)))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Bernoulli(p), obs=y)


def beta_binomial(y, n, a=1.5, b=1.5):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        p = pyro.sample("p", dist.Beta(y.new_tensor(a), y.new_tensor(b)))
        with pyro.plate("n", y.shape[1], dim=-1):
            pyro.sample("y", dist.Binomial(n, p), obs=y)


def gamma_poisson(k, exposure, a=2.0, b=1.0):
    with pyro.plate("tasks", k.shape[0], dim=-2):
        lam = pyro.sample("lam", dist.Gamma(k.new_tensor(a), k.new_tensor(b)))
        with pyro.plate("n", k.shape[1], dim=-1):
            pyro.sample("k", dist.Poisson(lam * exposure), obs=k)


def gamma_gamma_observed(tau, a=3.0, a0=2.0, b0=1.0):
    with pyro.plate("tasks", tau.shape[0], dim=-2):
        b = pyro.sample("b", dist.Gamma(tau.new_tensor(a0), tau.new_tensor(b0)))
        with pyro.plate("n", tau.shape[1], dim=-1):
            pyro.sample("tau", dist.Gamma(tau.new_tensor(a), b), obs=tau)


def gamma_gamma_hierarchy(x):
    """A shared rate b, a precision per group with rate b, Normal data per group."""
    with pyro.plate("tasks", x.shape[0], dim=-3):
        b = pyro.sample("b", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
        with pyro.plate("groups", x.shape[1], dim=-2):
            tau = pyro.sample("tau", dist.Gamma(x.new_tensor(3.0), b))
            with pyro.plate("n", x.shape[2], dim=-1):
                pyro.sample("x", dist.Normal(x.new_tensor(0.0), tau.rsqrt()), obs=x)


def latent_class(x, classes=3, categories=4):
    """Latent class analysis: answers x [T, N, J] to J items of ``categories`` values, each
    person in one of ``classes`` latent classes with its own answer probabilities."""
    t, n, j = x.shape
    ones = torch.ones(j, categories, dtype=F64)
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(1, classes, dtype=F64)))
        with pyro.plate("classes", classes, dim=-1):
            theta = pyro.sample("theta", dist.Dirichlet(ones).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
            probs = Vindex(theta.unsqueeze(-4))[..., z, :, :]
            pyro.sample("x", dist.Categorical(probs).to_event(1), obs=x)


def bernoulli_mixture(x, classes=2):
    """Binary answers x [T, N, J]: a mixture of products of Bernoullis with Beta priors."""
    t, n, j = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(1, classes, dtype=x.dtype)))
        with pyro.plate("classes", classes, dim=-1):
            p = pyro.sample("p", dist.Beta(x.new_ones(j), x.new_ones(j)).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
            pyro.sample("x", dist.Bernoulli(Vindex(p.unsqueeze(-3))[..., z, :]).to_event(1), obs=x)


# -------------------------------------------------------------------------------- data
def _binary(t=64, n=30, seed=0):
    return (torch.rand(t, n, generator=_g(seed), dtype=F64) < 0.3).to(F64)


def _counts(t=64, n=20, seed=1):
    g = _g(seed)
    exposure = 0.5 + torch.rand(t, n, generator=g, dtype=F64)
    return torch.poisson(3 * exposure, generator=g), exposure


def _binomial(t=64, n=12, seed=2):
    g = _g(seed)
    trials = torch.randint(1, 10, (t, n), generator=g).to(F64)
    return torch.binomial(trials, torch.full_like(trials, 0.4), generator=g), trials


def _precisions(t=64, n=10, seed=3):
    return 0.2 + torch.rand(t, n, generator=_g(seed), dtype=F64) * 3


def _classes(t=64, n=40, items=5, categories=4, classes=3, seed=5, alpha=0.3):
    """Answers of a latent class model with sparse answer probabilities, and the classes."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        theta = dist.Dirichlet(torch.full((t, classes, items, categories), alpha)).sample()
        z = torch.randint(0, classes, (t, n))
        x = dist.Categorical(theta[torch.arange(t)[:, None], z]).sample()
    return x, z


def _binary_classes(t=64, n=40, items=8, classes=2, seed=6):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        p = dist.Beta(0.4, 0.4).sample((t, classes, items)).double()
        z = torch.randint(0, classes, (t, n))
        x = dist.Bernoulli(p[torch.arange(t)[:, None], z]).sample()
    return x, z


def _recovery(resp, z):
    """Accuracy of the labels argmax q(z) under the best matching of the classes, per task."""
    pred, k = resp.argmax(-1), resp.shape[-1]
    best = torch.zeros(len(z), dtype=F64)
    for perm in itertools.permutations(range(k)):
        best = torch.maximum(best, (torch.tensor(perm)[pred] == z).double().mean(-1))
    return best


# ------------------------------------------------------------------ exact posteriors
def test_beta_bernoulli_is_exact():
    y = _binary()
    state, _ = VMP(beta_bernoulli).fit(y)
    s, n = y.sum(1), y.shape[1]
    a, b = torch.tensor(2.0, dtype=F64), torch.tensor(3.0, dtype=F64)
    torch.testing.assert_close(state.q["p"][0].squeeze(-1), a + s, rtol=1e-12, atol=0)
    torch.testing.assert_close(state.q["p"][1].squeeze(-1), b + n - s, rtol=1e-12, atol=0)
    evidence = _log_beta(a + s, b + n - s) - _log_beta(a, b)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-12)


def test_beta_binomial_is_exact():
    y, trials = _binomial()
    state, _ = VMP(beta_binomial).fit(y, trials)
    a = b = torch.tensor(1.5, dtype=F64)
    s, f = y.sum(1), (trials - y).sum(1)
    log_choose = (gammaln(trials + 1) - gammaln(y + 1) - gammaln(trials - y + 1)).sum(1)
    evidence = _log_beta(a + s, b + f) - _log_beta(a, b) + log_choose
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.q["p"][0].squeeze(-1), a + s, rtol=1e-12, atol=0)


def test_gamma_poisson_with_exposures_is_exact():
    k, exposure = _counts()
    state, _ = VMP(gamma_poisson).fit(k, exposure)
    shape, rate = 2 + k.sum(1), 1 + exposure.sum(1)
    torch.testing.assert_close(state.q["lam"][0].squeeze(-1), shape, rtol=1e-12, atol=0)
    torch.testing.assert_close(state.q["lam"][1].squeeze(-1), rate, rtol=1e-12, atol=0)
    a = torch.tensor(2.0, dtype=F64)
    evidence = (
        -gammaln(a)
        + gammaln(shape)
        - shape * rate.log()
        + (k * exposure.log() - gammaln(k + 1)).sum(1)
    )
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-12)


def test_zero_exposure_with_zero_count_adds_nothing():
    """Poisson(0 · λ) at k = 0 has probability one (0 ln 0 = 0): the bound is the exact
    evidence of the other points, not NaN."""
    k, exposure = _counts(t=6, n=8)
    exposure[:, 0], k[:, 0] = 0.0, 0.0
    state, info = VMP(gamma_poisson).fit(k, exposure)
    assert bool(info.converged.all())
    kk, ee = k[:, 1:], exposure[:, 1:]
    shape, rate = 2 + kk.sum(1), 1 + ee.sum(1)
    a = torch.tensor(2.0, dtype=F64)
    evidence = -gammaln(a) + gammaln(shape) - shape * rate.log()
    evidence = evidence + (kk * ee.log() - gammaln(kk + 1)).sum(1)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-12)


def test_priors_written_with_python_numbers_take_the_data_dtype():
    """Beta(0.5, 0.5) and Dirichlet(torch.ones(2)) hold float32 tensors (Pyro's default);
    with float64 data the engine still works in float64: the exact Beta-Bernoulli
    evidence to 1e-13, and a mixture equal to the one written with float64 tensors."""
    y = _binary(t=8)

    def coin(y):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            p = pyro.sample("p", dist.Beta(0.5, 0.5))
            with pyro.plate("n", y.shape[1], dim=-1):
                pyro.sample("y", dist.Bernoulli(p), obs=y)

    state, _ = VMP(coin).fit(y)
    assert state.objective.dtype == state.q["p"][0].dtype == F64
    half = torch.tensor(0.5, dtype=F64)
    n1 = y.sum(1)
    evidence = _log_beta(half + n1, half + y.shape[1] - n1) - _log_beta(half, half)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-13, atol=1e-13)

    def mixture(x, ones):
        with pyro.plate("tasks", x.shape[0], dim=-2):
            pi = pyro.sample("pi", dist.Dirichlet(ones))
            with pyro.plate("k", 2, dim=-1):
                mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 3.0))
            with pyro.plate("n", x.shape[1], dim=-1):
                z = pyro.sample("z", dist.Categorical(pi))
                pyro.sample("x", dist.Normal(mu.gather(-1, z), 0.7), obs=x)

    g = _g(4)
    x = torch.cat(
        [
            torch.randn(6, 10, generator=g, dtype=F64) - 3,
            torch.randn(6, 10, generator=g, dtype=F64) + 3,
        ],
        1,
    )
    ours, _ = VMP(mixture, tol=1e-12).fit(x, torch.ones(2))
    ref, _ = VMP(mixture, tol=1e-12).fit(x, torch.ones(2, dtype=F64))
    assert ours.objective.dtype == F64
    torch.testing.assert_close(ours.objective, ref.objective, rtol=1e-14, atol=1e-12)


def test_gamma_rate_with_a_gamma_parent_is_exact():
    tau = _precisions()
    state, _ = VMP(gamma_gamma_observed).fit(tau)
    n = tau.shape[1]
    shape, rate = 2.0 + 3.0 * n, 1.0 + tau.sum(1)
    torch.testing.assert_close(state.q["b"][1].squeeze(-1), rate, rtol=1e-12, atol=0)
    three = torch.tensor(3.0, dtype=F64)
    evidence = (
        -gammaln(torch.tensor(2.0, dtype=F64))
        + gammaln(torch.tensor(shape, dtype=F64))
        - shape * rate.log()
        + (2 * tau.log()).sum(1)
        - n * gammaln(three)
    )
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-12)


def _known_channel():
    """Labels z_n ~ Categorical(π) seen through a known noisy channel: the observed
    c_n ~ Categorical(table[z_n]) (a fixed emission table chosen by a latent label)."""
    g = _g(11)
    table = torch.softmax(2 * torch.randn(3, 4, generator=g, dtype=F64), -1)
    prior = torch.softmax(torch.randn(3, generator=g, dtype=F64), -1)
    seen = torch.randint(0, 4, (3, 15), generator=g)

    def channel(c):
        with pyro.plate("tasks", c.shape[0], dim=-2), pyro.plate("n", c.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(prior.to(c.device)))
            pyro.sample("c", dist.Categorical(Vindex(table.to(c.device))[z]), obs=c)

    joint = (prior.unsqueeze(-1) * table)[:, seen]  # [K, T, N]: p(z = k, c_n)
    return channel, seen, joint


def test_categorical_table_chosen_by_a_label_is_exact():
    """Integer data only (the float64 of the tables is kept); q(z_n) is the exact
    posterior and the bound the exact log evidence Σ_n ln Σ_k π_k table[k, c_n]."""
    channel, seen, joint = _known_channel()
    state, _ = VMP(channel, tol=1e-14).fit(seen)
    assert state.objective.dtype == F64
    evidence = joint.sum(0).log().sum(-1)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-13, atol=1e-12)
    posterior = (joint / joint.sum(0)).permute(1, 2, 0)
    torch.testing.assert_close(state.q["z"][0], posterior, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------- conformance
def _cases():
    y = _binary(t=3, n=12)
    k, exposure = _counts(t=3, n=9)
    x = torch.randn(3, 4, 6, generator=_g(7), dtype=F64) * 0.7
    classes, _ = _classes(t=3, n=20)
    binary, _ = _binary_classes(t=3, n=20)
    channel, seen, joint = _known_channel()
    b_evidence = _log_beta(2.0 + y.sum(1), 3.0 + 12 - y.sum(1)) - _log_beta(
        torch.tensor(2.0, dtype=F64), torch.tensor(3.0, dtype=F64)
    )
    return {
        "beta-bernoulli": ConformanceCase(
            make_engine=lambda: VMP(beta_bernoulli),
            model=beta_bernoulli,
            data=(y,),
            n_steps=2,
            exact_log_evidence=b_evidence,
        ),
        "gamma-poisson": ConformanceCase(
            make_engine=lambda: VMP(gamma_poisson), model=gamma_poisson, data=(k, exposure)
        ),
        "gamma-gamma": ConformanceCase(
            make_engine=lambda: VMP(gamma_gamma_hierarchy, tol=0),
            model=gamma_gamma_hierarchy,
            data=(x,),
            n_steps=10,
            max_plate_nesting=3,
        ),
        "latent-class": ConformanceCase(
            make_engine=lambda: VMP(latent_class, tol=0),
            model=latent_class,
            data=(classes,),
            n_steps=10,
            particles=200,
        ),
        "known-channel": ConformanceCase(
            make_engine=lambda: VMP(channel),
            model=channel,
            data=(seen,),
            n_steps=2,
            exact_log_evidence=joint.sum(0).log().sum(-1),
        ),
        "bernoulli-mixture": ConformanceCase(
            make_engine=lambda: VMP(bernoulli_mixture, tol=0),
            model=bernoulli_mixture,
            data=(binary,),
            n_steps=10,
            particles=200,
        ),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_new_families_pass_conformance(name):
    check_engine(_cases()[name])


def test_conformance_catches_a_broken_count_message(monkeypatch):
    """A Bernoulli child's message to its Beta parent drops 10% of the successes: the
    exact-evidence check fails."""
    from probfsl.inference.vmp import conjugate_children

    exact = conjugate_children.linear_terms

    def broken(plan, q, s):
        coefs, const = exact(plan, q, s)
        if s.family == "Bernoulli":
            coefs = [[(0.9 * sign, ops) for sign, ops in coefs[0]], coefs[1]]
        return coefs, const

    monkeypatch.setattr(conjugate_children, "linear_terms", broken)
    with pytest.raises(AssertionError):
        assert_exact_evidence(_cases()["beta-bernoulli"])


# ------------------------------------------------------------------------ behaviour
def test_latent_classes_are_recovered():
    """Unsupervised, from symmetric priors: the classes of a sparse latent class model are
    found far above chance (1/3 to 1/2 under the best matching)."""
    x, z = _classes()
    state, info = VMP(latent_class, tol=1e-10, max_iter=200).fit(x)
    assert bool((info.trace[1:] >= info.trace[:-1] - 1e-9).all())
    assert _recovery(state.q["z"][0], z).mean() > 0.75
    xb, zb = _binary_classes()
    state, _ = VMP(bernoulli_mixture, tol=1e-10, max_iter=200).fit(xb)
    assert _recovery(state.q["z"][0], zb).mean() > 0.9


def test_float32_counts_agree_with_float64():
    k, exposure = _counts(t=8)
    s64, _ = VMP(gamma_poisson).fit(k, exposure)
    s32, _ = VMP(gamma_poisson).fit(k.float(), exposure.float())
    assert s32.objective.dtype == torch.float32
    torch.testing.assert_close(s32.objective.double(), s64.objective, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (torch.tensor([[0.0, 2.0, 1.0]], dtype=F64), "0 or 1"),
        (torch.tensor([[0.0, 0.5, 1.0]], dtype=F64), "whole numbers"),
        (torch.tensor([[0.0, float("nan"), 1.0]], dtype=F64), "NaN"),
    ],
)
def test_bad_binary_data_are_refused(data, message):
    with pytest.raises(ValueError, match=f"'y' \\(Bernoulli\\).*{message}"):
        VMP(beta_bernoulli).fit(data)


def test_bool_or_integer_binary_data_are_refused_naming_the_argument():
    y = torch.tensor([[True, False, True]])
    for data in (y, y.long()):
        with pytest.raises(ValueError, match=r"argument\(s\) \[0\] are integer or bool"):
            VMP(beta_bernoulli).fit(data)


def test_obs_mask_on_continuous_data_is_refused():
    def model(x, m):
        with pyro.plate("tasks", x.shape[0], dim=-2):
            mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 1.0))
            with pyro.plate("n", x.shape[1], dim=-1):
                pyro.sample("x", dist.Normal(mu, 1.0), obs=x, obs_mask=m)

    x = torch.randn(4, 6, generator=_g(0), dtype=F64)
    with pytest.raises(ValueError, match="'x' \\(Normal\\).*obs_mask.*poutine.mask"):
        VMP(model).fit(x, x > 0)


def test_counts_above_their_total_are_refused():
    y, n = _binomial(t=4)
    y[0, 0] = n[0, 0] + 1
    with pytest.raises(ValueError, match="'y' \\(Binomial\\).*exceed their total_count"):
        VMP(beta_binomial).fit(y, n)


@pytest.mark.parametrize(
    ("label", "message"),
    [(3, "labels 0 to 2"), (-1, "whole numbers"), (1.5, "whole numbers"), (float("nan"), "NaN")],
)
def test_bad_labels_are_refused(label, message):
    """An observed Categorical's data are labels 0..K-1 (Pyro's own density raises on
    some of these and silently truncates 1.5)."""

    def model(y):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            p = pyro.sample("p", dist.Dirichlet(torch.ones(3, dtype=F64)))
            with pyro.plate("n", y.shape[1], dim=-1):
                pyro.sample("y", dist.Categorical(p), obs=y)

    y = torch.randint(0, 3, (4, 6), generator=_g(3)).double()
    y[0, 0] = label
    for data in (y, y.long()) if float(label).is_integer() else (y,):
        with pytest.raises(ValueError, match=f"'y' \\(Categorical\\).*{message}"):
            VMP(model).fit(data)


def test_latent_count_site_is_refused():
    def model(x):
        with pyro.plate("tasks", x.shape[0]):
            pyro.sample("n", dist.Poisson(x.new_tensor(3.0)))
            pyro.sample("x", dist.Normal(0.0, 1.0), obs=x)

    with pytest.raises(ValueError, match="latent Poisson site.*Categorical"):
        VMP(model).fit(torch.randn(4, dtype=F64))


def test_posterior_and_guide_of_a_beta_site():
    y = _binary(t=4)
    vmp = VMP(beta_bernoulli)
    state, _ = vmp.fit(y)
    post = vmp.posterior(state)["p"]
    assert isinstance(post, dist.Beta) and post.batch_shape == (4, 1)
    trace = pyro.poutine.trace(vmp.guide(state)).get_trace(y)
    assert trace.nodes["p"]["value"].shape == (4, 1)


def student_t(x, nu=4.0):
    """A Student-t location model as a Gamma scale mixture: x_n ~ N(μ, (λ u_n)⁻¹) with
    u_n ~ Gamma(ν/2, ν/2); the precision is the product of two Gamma sites."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        lam = pyro.sample("lam", dist.Gamma(x.new_tensor(2.0), x.new_tensor(1.0)))
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(0.0), 10.0))
        with pyro.plate("n", x.shape[1], dim=-1):
            u = pyro.sample("u", dist.Gamma(x.new_tensor(nu / 2), x.new_tensor(nu / 2)))
            pyro.sample("x", dist.Normal(mu, (lam * u).rsqrt()), obs=x)


def test_student_t_scale_mixture():
    """Conformance, and robustness: an outlier moves the Student-t location far less than
    the sample mean, and its own scale weight ⟨u⟩ is the smallest."""
    g = _g(9)
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(student_t, tol=0),
            model=student_t,
            data=(torch.randn(3, 10, generator=g, dtype=F64),),
            n_steps=10,
        )
    )
    x = torch.randn(8, 30, generator=g, dtype=F64)
    x[:, 0] = 25.0
    state, _ = VMP(student_t, tol=1e-12, max_iter=2000).fit(x)
    location = state.q["mu"][0].flatten()
    assert bool(
        ((location - x[:, 1:].mean(1)).abs() < 0.25 * (x.mean(1) - x[:, 1:].mean(1)).abs()).all()
    )
    weight = state.q["u"][0] / state.q["u"][1]
    assert bool((weight.argmin(-1) == 0).all())


def hmm_model(x, states=3):
    """A hidden Markov chain with Dirichlet initial and transition probabilities and a
    Normal observation law per state, as Pyro's DiscreteHMM."""
    t, n = x.shape
    with pyro.plate("tasks", t, dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(torch.ones(states, dtype=x.dtype)))
        ones = torch.ones(states, states, dtype=x.dtype)
        a = pyro.sample("A", dist.Dirichlet(ones).to_event(1))
        means = torch.linspace(-2, 2, states, dtype=x.dtype)
        mu = pyro.sample("mu", dist.Normal(means, 1.0).to_event(1))
        tau = pyro.sample(
            "tau", dist.Gamma(2.0 * torch.ones(states, dtype=x.dtype), 1.0).to_event(1)
        )
        obs = dist.Normal(mu.unsqueeze(-2), tau.rsqrt().unsqueeze(-2))
        chain = dist.DiscreteHMM(pi.log(), a.log().unsqueeze(-3), obs, duration=n)
        pyro.sample("x", chain, obs=x)


def hmm_data(t=4, n=50, states=3, seed=0):
    """Sticky chains (stay with probability 0.9) observed in unit-spaced Gaussian noise."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        z = torch.zeros(t, n, dtype=torch.long)
        for i in range(1, n):
            stay = torch.rand(t) < 0.9
            z[:, i] = torch.where(stay, z[:, i - 1], torch.randint(0, states, (t,)))
        x = torch.linspace(-2, 2, states)[z] + 0.4 * torch.randn(t, n)
    return x.double(), z


@pytest.mark.parametrize("spread", [1.0, 400.0])
def test_forward_backward_matches_enumeration(spread):
    """γ, Σξ and ln Z of the chain against a sum over all K^N paths (K = 2, N = 5), with
    initial and emission log-potentials of unit spread and of spread 400 (states e^-1000
    apart, as an outlier far from every state's mean: the scaled recursions must shift
    them before exponentiating)."""
    from probfsl.inference.vmp.hmm import forward_backward

    g = _g(10)
    k, n = 2, 5
    log_init = spread * torch.randn(3, k, generator=g, dtype=F64)
    log_trans = torch.randn(3, k, k, generator=g, dtype=F64)
    log_emit = spread * torch.randn(3, n, k, generator=g, dtype=F64)
    gamma, pairs, log_z = forward_backward(log_init, log_trans, log_emit)
    paths = torch.tensor(list(itertools.product(range(k), repeat=n)))  # [P, N]
    score = log_init[:, paths[:, 0]] + log_emit[:, torch.arange(n), paths].sum(-1)
    score = score + log_trans[:, paths[:, :-1], paths[:, 1:]].sum(-1)  # [3, P]
    torch.testing.assert_close(log_z, torch.logsumexp(score, -1), rtol=1e-13, atol=1e-12)
    weight = torch.softmax(score, -1)
    want_gamma = torch.einsum("bp,pnk->bnk", weight, torch.nn.functional.one_hot(paths, k).double())
    torch.testing.assert_close(gamma, want_gamma, rtol=1e-12, atol=1e-12)
    one = torch.nn.functional.one_hot(paths, k).double()
    want_pairs = torch.einsum("bp,pnj,pnk->bjk", weight, one[:, :-1], one[:, 1:])
    torch.testing.assert_close(pairs, want_pairs, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_hidden_markov_chain_conformance():
    """The chain's bound: monotone, batch-invariant, float32 against float64, on the data's
    device, no host synchronisation, and below Pyro's exact E_q ln p(x | θ) (Pyro sums out
    the chain; the bound also holds q(z))."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_vmp_bayespy import hmm_data, hmm_model  # noqa: E402

    from probfsl.testing import (
        assert_batch_invariant,
        assert_device_follows,
        assert_dtype_agreement,
        assert_monotone,
        assert_no_host_syncs,
        pyro_elbo_estimate,
    )

    x, z = hmm_data(t=3, n=30)
    case = ConformanceCase(
        make_engine=lambda: VMP(hmm_model, tol=0), model=hmm_model, data=(x,), n_steps=8
    )
    for check in (assert_monotone, assert_batch_invariant, assert_dtype_agreement):
        check(case)
    assert_device_follows(case)
    assert_no_host_syncs(case)
    vmp = VMP(hmm_model, tol=1e-12, max_iter=500)
    state, _ = vmp.fit(x)
    mean, se = pyro_elbo_estimate(hmm_model, vmp.guide(state), (x,), 200, 5, max_plate_nesting=1)
    assert state.objective.sum().item() <= mean + 5 * se


def random_walk(x, step=0.5, noise=1.0, tau=None):
    """A Gaussian random walk observed in noise, written as a loop of Normal sites (with
    ``tau`` a latent Gamma innovation precision when it is ``"gamma"``)."""
    t, n = x.shape
    with pyro.plate("tasks", t):
        precision = step**-2
        if tau == "gamma":
            precision = pyro.sample("tau", dist.Gamma(x.new_tensor(2.0), x.new_tensor(0.5)))
        s = pyro.sample("s0", dist.Normal(x.new_tensor(0.0), 2.0))
        pyro.sample("x0", dist.Normal(s, noise), obs=x[:, 0])
        for i in range(1, n):
            s = pyro.sample(f"s{i}", dist.Normal(s, precision**-0.5))
            pyro.sample(f"x{i}", dist.Normal(s, noise), obs=x[:, i])


def walk_data(t=16, n=12, seed=11):
    g = _g(seed)
    walk = (0.5 * torch.randn(t, n, generator=g, dtype=F64)).cumsum(1)
    return walk + torch.randn(t, n, generator=g, dtype=F64)


def test_gaussian_markov_chain_is_one_exact_factor():
    """The walk's steps form one joint factor: with fixed precisions the bound is the log
    evidence (s ~ N(0, 4 + 0.25 min(i, j)), x = s + noise) after one sweep."""
    x = walk_data()
    vmp = VMP(random_walk, tol=1e-13)
    assert list(vmp.compile(x).chains.values())[0] == [f"s{i}" for i in range(12)]
    state, info = vmp.fit(x)
    i = torch.arange(12, dtype=F64)
    cov = 4.0 + 0.25 * torch.minimum(i[:, None], i[None, :]) + torch.eye(12, dtype=F64)
    evidence = dist.MultivariateNormal(torch.zeros(12, dtype=F64), cov).log_prob(x)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-11)
    assert int(info.n_steps.max()) <= 2


def affine_walk(x, a=0.8, d=0.3):
    """A state-space model s_i ~ N(a s_{i-1} + d, 0.5²), x_i ~ N(s_i, 1): a scaled step with
    a drift (BayesPy's GaussianMarkovChain with a 1 × 1 dynamics matrix)."""
    with pyro.plate("tasks", x.shape[0]):
        s = pyro.sample("s0", dist.Normal(x.new_tensor(0.0), 2.0))
        pyro.sample("x0", dist.Normal(s, 1.0), obs=x[:, 0])
        for i in range(1, x.shape[1]):
            s = pyro.sample(f"s{i}", dist.Normal(a * s + d, 0.5))
            pyro.sample(f"x{i}", dist.Normal(s, 1.0), obs=x[:, i])


@pytest.mark.parametrize(("a", "d"), [(1.0, 0.3), (0.8, 0.0), (-0.6, 0.5)])
def test_a_chain_with_drift_and_scaled_steps_is_one_exact_factor(a, d):
    """Steps a s + d keep the chain one joint factor: the bound is the exact log evidence
    (a Gaussian with the recursions' mean and covariance) after one sweep, and Pyro's ELBO
    of the guide equals it."""
    from probfsl.testing import pyro_elbo_estimate

    x = walk_data(t=4)
    n = x.shape[1]
    model = partial(affine_walk, a=a, d=d)
    vmp = VMP(model, tol=1e-13)
    assert list(vmp.compile(x).chains.values())[0] == [f"s{i}" for i in range(n)]
    state, info = vmp.fit(x)
    mean, cov = torch.zeros(n, dtype=F64), torch.zeros(n, n, dtype=F64)
    cov[0, 0] = 4.0
    for i in range(1, n):
        mean[i] = a * mean[i - 1] + d
        cov[i, :i] = a * cov[i - 1, :i]
        cov[:i, i] = cov[i, :i]
        cov[i, i] = a * a * cov[i - 1, i - 1] + 0.25
    evidence = dist.MultivariateNormal(mean, cov + torch.eye(n, dtype=F64)).log_prob(x)
    torch.testing.assert_close(state.objective, evidence, rtol=1e-12, atol=1e-11)
    assert int(info.n_steps.max()) <= 2
    pyro.set_rng_seed(0)
    elbo, se = pyro_elbo_estimate(model, vmp.guide(state), (x,), 50, 3, 1)
    assert abs(elbo - evidence.sum().item()) <= 1e-5 * abs(elbo) and se <= 1e-5 * abs(elbo)


def test_the_guide_samples_the_chain_jointly():
    """The guide draws each step given the one before from the joint factor: with fixed
    precisions q is the exact posterior, so every draw of ln p(x, s) − ln q(s) is the log
    evidence and Pyro's Monte Carlo ELBO equals the bound without spread (drawn from the
    steps' marginals alone it fell about 19 nats, 76 standard errors, below)."""
    from probfsl.testing import pyro_elbo_estimate

    x = walk_data(t=4)
    vmp = VMP(random_walk, tol=1e-13)
    state, _ = vmp.fit(x)
    pyro.set_rng_seed(0)
    mean, se = pyro_elbo_estimate(random_walk, vmp.guide(state), (x,), 50, 3, 1)
    analytic = state.objective.sum().item()
    assert abs(mean - analytic) <= 1e-5 * abs(analytic) and se <= 1e-5 * abs(analytic)


@pytest.mark.slow
def test_gaussian_markov_chain_conformance():
    from probfsl.testing import (
        assert_batch_invariant,
        assert_device_follows,
        assert_dtype_agreement,
        assert_elbo_matches_pyro,
        assert_monotone,
        assert_no_host_syncs,
    )

    def model(x):
        return random_walk(x, tau="gamma")

    case = ConformanceCase(
        make_engine=lambda: VMP(model, tol=0), model=model, data=(walk_data(t=3),), n_steps=10
    )
    for check in (assert_monotone, assert_batch_invariant, assert_dtype_agreement):
        check(case)
    assert_device_follows(case)
    assert_no_host_syncs(case)
    assert_elbo_matches_pyro(case)


def test_a_bad_beta_prior_is_refused_naming_the_site():
    def model(y):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            q = pyro.sample("q", dist.Beta(y.new_tensor(-1.0), y.new_tensor(2.0)))
            with pyro.plate("n", y.shape[1], dim=-1):
                pyro.sample("y", dist.Bernoulli(q), obs=y)

    with pytest.raises(ValueError, match="site 'q' \\(Beta\\).*concentration1 is outside"):
        VMP(model).fit(torch.ones(2, 3, dtype=F64))


# ------------------------------------------------------------ Gamma–Exponential
def gamma_exponential(x, exposure, a=2.0, b=1.5):
    """Waiting times x_n ~ Exponential(c_n λ) with a Gamma rate λ per task."""
    with pyro.plate("tasks", x.shape[0], dim=-2):
        lam = pyro.sample("lam", dist.Gamma(x.new_tensor(a), x.new_tensor(b)))
        with pyro.plate("n", x.shape[1], dim=-1):
            pyro.sample("x", dist.Exponential(lam * exposure), obs=x)


def _waiting_times(dtype, tasks=16, n=12):
    g = _g(7)
    rate = 0.5 + 2 * torch.rand(tasks, 1, generator=g, dtype=F64)
    exposure = 0.5 + torch.rand(tasks, n, generator=g, dtype=F64)
    x = torch.distributions.Exponential(rate * exposure).sample()
    return x.to(dtype), exposure.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gamma_exponential_is_exact(dtype):
    """The Gamma posterior (a + N, b + Σ c x) and the log evidence
    a ln b − ln Γ(a) + Σ ln c + ln Γ(a + N) − (a + N) ln(b + Σ c x), per task."""
    torch.manual_seed(0)
    x, exposure = _waiting_times(dtype)
    state, _ = VMP(gamma_exponential).fit(x, exposure)
    a, b = torch.tensor(2.0, dtype=F64), torch.tensor(1.5, dtype=F64)
    x64, c64 = x.double(), exposure.double()
    shape, rate = a + x.shape[1], b + (c64 * x64).sum(1)
    evidence = a * b.log() - gammaln(a) + c64.log().sum(1) + gammaln(shape) - shape * rate.log()
    tol = 1e-12 if dtype == F64 else 2e-5
    assert state.q["lam"][0].dtype == dtype and state.objective.dtype == dtype
    q_shape, q_rate = (t.squeeze(-1).double() for t in state.q["lam"])
    torch.testing.assert_close(q_shape, shape.expand_as(q_shape), rtol=tol, atol=0)
    torch.testing.assert_close(q_rate, rate, rtol=tol, atol=0)
    torch.testing.assert_close(state.objective.double(), evidence, rtol=tol, atol=tol)


def test_gamma_exponential_batch_equals_its_tasks_alone():
    x, exposure = _waiting_times(F64, tasks=4)
    batch, _ = VMP(gamma_exponential).fit(x, exposure)
    for t in range(x.shape[0]):
        alone, _ = VMP(gamma_exponential).fit(x[t : t + 1], exposure[t : t + 1])
        torch.testing.assert_close(alone.objective, batch.objective[t : t + 1], rtol=1e-13, atol=0)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_exponential_data_outside_the_support_are_refused(bad):
    x, exposure = _waiting_times(F64, tasks=2, n=3)
    x[1, 2] = bad
    with pytest.raises(ValueError, match="must be > 0"):
        VMP(gamma_exponential).fit(x, exposure)


def test_exponential_with_a_fixed_rate_is_refused():
    def fixed(x):
        with pyro.plate("tasks", x.shape[0], dim=-2):
            pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
            with pyro.plate("n", x.shape[1], dim=-1):
                pyro.sample("x", dist.Exponential(x.new_tensor(2.0)), obs=x)

    with pytest.raises(ValueError, match="depends on no latent site"):
        VMP(fixed).fit(torch.rand(2, 3, dtype=F64) + 0.1)


def test_gamma_exponential_passes_conformance():
    """Monotone bound, batch invariance, float32 against float64, device, no host sync,
    Pyro's ``Trace_ELBO`` on the derived guide, and the exact log evidence."""
    x, exposure = _waiting_times(F64, tasks=6, n=5)
    a, b = torch.tensor(2.0, dtype=F64), torch.tensor(1.5, dtype=F64)
    shape, rate = a + x.shape[1], b + (exposure * x).sum(1)
    evidence = a * b.log() - gammaln(a) + exposure.log().sum(1) + gammaln(shape)
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(gamma_exponential),
            model=gamma_exponential,
            data=(x, exposure),
            n_steps=2,
            exact_log_evidence=evidence - shape * rate.log(),
        )
    )


def test_a_family_refuses_the_roles_it_does_not_have():
    """The family record's defaults refuse with a ValueError naming the family: a Wishart
    cannot be a point estimate, an observed-only family has no posterior factor."""
    from probfsl.inference.vmp.family import REGISTRY

    assert {n for n, f in REGISTRY.items() if f.can_be_point()} == {
        "Beta",
        "Dirichlet",
        "Gamma",
        "Normal",
    }
    with pytest.raises(ValueError, match="cannot hold a Wishart parameter as a point estimate"):
        REGISTRY["Wishart"].point_stats(torch.eye(2))
    with pytest.raises(ValueError, match="no posterior factor for Poisson"):
        REGISTRY["Poisson"].posterior([])


def _masked_labels_model(y, mask):
    with pyro.plate("tasks", y.shape[0], dim=-2):
        with pyro.plate("n", y.shape[1], dim=-1), pyro.poutine.mask(mask=mask):
            z = pyro.sample("z", dist.Categorical(y.new_tensor([0.2, 0.3, 0.5])))
            loc = Vindex(y.new_tensor([-2.0, 0.0, 2.0]))[..., z]
            pyro.sample("y", dist.Normal(loc, 1.0), obs=y)


def test_entries_of_a_latent_categorical_masked_out_leave_the_bound():
    """poutine.mask around a latent Categorical and its child (padding): the masked entries
    are no part of the model, so their factors' entropies are not in the bound either
    (they were: ln K each, above the exact evidence), and the guide masks them, so
    Pyro's ELBO of the guide is still the bound."""
    from probfsl.testing import pyro_elbo_estimate

    y = torch.randn(2, 10, generator=_g(3), dtype=F64) * 2
    mask = torch.arange(10).expand(2, 10) < 6
    vmp = VMP(_masked_labels_model, tol=1e-14)
    state, _ = vmp.fit(y, mask)
    means, prior = y.new_tensor([-2.0, 0.0, 2.0]), y.new_tensor([0.2, 0.3, 0.5])
    joint = prior.log() + dist.Normal(means, 1.0).log_prob(y[:, :6].unsqueeze(-1))
    torch.testing.assert_close(state.objective, joint.logsumexp(-1).sum(-1), rtol=1e-13, atol=1e-12)
    pyro.set_rng_seed(0)
    mean, se = pyro_elbo_estimate(_masked_labels_model, vmp.guide(state), (y, mask), 200, 3, 2)
    assert abs(mean - state.objective.sum().item()) < 1e-5 + 5 * se  # Pyro sums in float32


def test_probabilities_selected_by_labels_given_as_data_are_refused_naming_obs_mask():
    """A Dirichlet row per group picked by group labels that are data (or an observed
    Categorical site) is refused with the form VMP reads: the labels observed through
    obs_mask, which is exact."""

    def groups(y, g, mask=None):
        with pyro.plate("tasks", y.shape[0], dim=-2):
            th = pyro.sample("th", dist.Dirichlet(y.new_ones(3, 4).double()).to_event(1))
            with pyro.plate("n", y.shape[1], dim=-1):
                g = pyro.sample(
                    "g", dist.Categorical(torch.ones(3, dtype=F64)), obs=g, obs_mask=mask
                )
                pyro.sample("y", dist.Categorical(Vindex(th)[..., g, :]), obs=y)

    y = torch.randint(0, 4, (2, 6), generator=_g(1))
    g = torch.randint(0, 3, (2, 6), generator=_g(2))
    with pytest.raises(ValueError, match="'y' \\(Categorical\\).*labels given as data.*obs_mask"):
        VMP(groups).fit(y, g)
    state, _ = VMP(groups, tol=1e-14).fit(y, g, torch.ones(2, 6, dtype=torch.bool))
    ones = torch.ones(4, dtype=F64)
    evidence = torch.zeros(2, dtype=F64)
    for t in range(2):
        for k in range(3):
            c = torch.bincount(y[t][g[t] == k], minlength=4).to(F64)
            evidence[t] += _log_beta_vec(ones + c) - _log_beta_vec(ones)
    evidence = evidence + 6 * torch.tensor(1 / 3, dtype=F64).log()
    torch.testing.assert_close(state.objective, evidence, rtol=1e-13, atol=1e-12)


def _log_beta_vec(a: torch.Tensor) -> torch.Tensor:
    return gammaln(a).sum(-1) - gammaln(a.sum(-1))
