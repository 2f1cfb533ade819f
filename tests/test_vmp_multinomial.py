"""VMP's Multinomial family (docs/design/vmp.md §7.4): observed count vectors under a
Dirichlet, alone or with the Dirichlet row chosen by a latent Categorical (a mixture of
multinomials: documents in clusters), declared in plain Pyro.

E ln Mult(x | n, θ) = Σ_k x_k ⟨ln θ_k⟩ + ln n! − Σ_k ln x_k! is linear in u(θ) = ln θ, so
q(θ) = Dirichlet(α + Σ_d x_d) is exact and the bound at the optimum is the log evidence of
the Dirichlet-multinomial, checked in float64 and float32 on a batch of tasks. The
mixture recovers the clusters and reaches BayesPy's bound (``Mixture(z, Multinomial, n,
theta)``) from the same responsibilities. Counts that are not whole numbers, or rows
that do not sum to ``total_count``, are refused naming the site."""

from __future__ import annotations

import itertools

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex
from torch.special import gammaln

from probfsl.inference import VMP
from probfsl.testing import ConformanceCase, check_engine

F64 = torch.float64
TRIALS = 12  # total_count of the Dirichlet-multinomial tasks
ALPHA = (0.7, 1.5, 0.4, 2.0, 1.0)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _log_beta(a):
    """ln B(a) = Σ_k ln Γ(a_k) − ln Γ(Σ_k a_k) over the last axis."""
    return gammaln(a).sum(-1) - gammaln(a.sum(-1))


# ------------------------------------------------------------------------------ models
def dirichlet_multinomial(x, n=TRIALS):
    """Documents x [T, D, V] of n words each, one word distribution θ ~ Dirichlet(α) per
    task."""
    t, d, v = x.shape
    alpha = torch.tensor(ALPHA, dtype=x.dtype)
    with pyro.plate("tasks", t, dim=-2):
        theta = pyro.sample("theta", dist.Dirichlet(alpha.expand(1, v)))
        with pyro.plate("docs", d, dim=-1):
            pyro.sample("x", dist.Multinomial(n, theta), obs=x)


def document_clusters(x, n=30, clusters=3):
    """A mixture of multinomials: each document's word counts x_d ~ Mult(n, θ_{z_d}) with
    z_d ~ Categorical(π) its cluster, π and each θ_k Dirichlet."""
    t, d, v = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_ones(1, clusters)))
        with pyro.plate("clusters", clusters, dim=-1):
            theta = pyro.sample("theta", dist.Dirichlet(x.new_ones(v)))
        with pyro.plate("docs", d, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi))
            probs = Vindex(theta.unsqueeze(-3))[..., z, :]
            pyro.sample("x", dist.Multinomial(n, probs), obs=x)


# -------------------------------------------------------------------------------- data
def _documents(dtype=F64, tasks=16, docs=6):
    """Counts of TRIALS words per document, one word distribution per task."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theta = dist.Dirichlet(torch.ones(tasks, 1, len(ALPHA), dtype=F64)).sample()
        x = dist.Multinomial(TRIALS, theta.expand(tasks, docs, len(ALPHA))).sample()
    return x.to(dtype)


def _clustered(tasks=16, docs=40, words=12, n=30, clusters=3, seed=1):
    """Documents from sparse cluster word distributions (Dirichlet(0.3)), and the clusters."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        theta = dist.Dirichlet(torch.full((tasks, clusters, words), 0.3, dtype=F64)).sample()
        z = torch.randint(0, clusters, (tasks, docs))
        x = dist.Multinomial(n, theta[torch.arange(tasks)[:, None], z]).sample()
    return x, z


def _exact(x):
    """The posterior concentrations α + Σ_d x_d and the log evidence
    Σ_d [ln n! − Σ_k ln x_dk!] + ln B(α + Σ_d x_d) − ln B(α), per task (float64)."""
    x = x.double()
    alpha = torch.tensor(ALPHA, dtype=F64)
    post = alpha + x.sum(1)
    coefficient = (gammaln(x.sum(-1) + 1) - gammaln(x + 1).sum(-1)).sum(-1)
    return post, coefficient + _log_beta(post) - _log_beta(alpha)


# ------------------------------------------------------------------ exact posteriors
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dirichlet_multinomial_is_exact(dtype):
    """The Dirichlet posterior is α + Σ counts and the bound the exact log evidence, on 16
    tasks at once."""
    x = _documents(dtype)
    state, _ = VMP(dirichlet_multinomial).fit(x)
    post, evidence = _exact(x)
    assert state.q["theta"][0].dtype == dtype and state.objective.dtype == dtype
    tol = 1e-12 if dtype == F64 else 2e-5
    concentration = state.q["theta"][0].reshape(post.shape).double()
    torch.testing.assert_close(concentration, post, rtol=tol, atol=0)
    torch.testing.assert_close(state.objective.double(), evidence, rtol=tol, atol=tol)


def test_dirichlet_multinomial_batch_equals_its_tasks_alone():
    x = _documents(tasks=4)
    batch, _ = VMP(dirichlet_multinomial).fit(x)
    for t in range(x.shape[0]):
        alone, _ = VMP(dirichlet_multinomial).fit(x[t : t + 1])
        torch.testing.assert_close(alone.objective, batch.objective[t : t + 1], rtol=1e-13, atol=0)


def test_dirichlet_multinomial_passes_conformance():
    """Monotone bound, batch invariance, float32 against float64, device, no host sync,
    Pyro's ``Trace_ELBO`` on the derived guide, and the exact log evidence."""
    x = _documents(tasks=3, docs=4)
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(dirichlet_multinomial),
            model=dirichlet_multinomial,
            data=(x,),
            n_steps=2,
            exact_log_evidence=_exact(x)[1],
        )
    )


# ------------------------------------------------------------------------ mixtures
def _recovery(resp, z):
    """Accuracy of argmax q(z) under the best matching of the clusters, per task."""
    pred, k = resp.argmax(-1), resp.shape[-1]
    best = torch.zeros(len(z), dtype=F64)
    for perm in itertools.permutations(range(k)):
        best = torch.maximum(best, (torch.tensor(perm)[pred] == z).double().mean(-1))
    return best


def test_mixture_of_multinomials_recovers_the_clusters():
    """Unsupervised, from symmetric priors: from the default start most tasks find their
    clusters; a mixture's bound has local optima (two clusters merged), and the best bound
    of four random starts per task finds the clusters of every task."""
    x, z = _clustered()
    engine = VMP(document_clusters, tol=1e-10, max_iter=500)
    state, info = engine.fit(x)
    assert bool((info.trace[1:] >= info.trace[:-1] - 1e-9).all())
    assert float(_recovery(state.q["z"][0], z).mean()) > 0.9
    best, resp = state.objective, state.q["z"][0]
    for seed in range(4):
        start = torch.softmax(torch.randn(resp.shape, generator=_g(seed), dtype=F64), -1)
        other, _ = engine.fit(x, init_resp={"z": start})
        better = other.objective > best
        best = torch.where(better, other.objective, best)
        resp = torch.where(better[:, None, None], other.q["z"][0], resp)
    assert float(_recovery(resp, z).min()) >= 0.95


def test_mixture_of_multinomials_passes_conformance():
    x, _ = _clustered(tasks=3, docs=15, words=6, n=30)
    check_engine(
        ConformanceCase(
            make_engine=lambda: VMP(document_clusters, tol=0),
            model=document_clusters,
            data=(x,),
            n_steps=10,
            particles=200,
        )
    )


def test_mixture_of_multinomials_matches_bayespy():
    """BayesPy's ``Mixture(z, Multinomial, n, theta)``, one task at a time, from the same
    responsibilities and in the same schedule (π and θ, then z, repeated): the same bound
    and the same q(θ) on every task.

    Both run exact coordinate ascent to a relative change of 1e-14 from one start, so they
    stop at the same fixed point; what is left is the rounding of float64 sums of a few
    thousand terms of size up to ~10² (about 1e-12 absolute on bounds of ~-600). rtol 1e-9
    leaves a margin of three orders over that and is far below any term of the bound that
    could be missing or doubled (ln n! of one document alone is ~74)."""
    bn = pytest.importorskip("bayespy.nodes")
    from bayespy.inference import VB

    tasks, docs, words, n, k = 4, 40, 12, 30, 3
    x, _ = _clustered(tasks=tasks, docs=docs, words=words, n=n, clusters=k)
    resp = torch.softmax(torch.randn(tasks, docs, k, generator=_g(6), dtype=F64), -1)
    engine = VMP(document_clusters, tol=1e-14, max_iter=3000, order=["pi", "theta", "z"])
    state, _ = engine.fit(x, init_resp={"z": resp})
    for t in range(tasks):
        pi = bn.Dirichlet(np.ones(k))
        z = bn.Categorical(pi, plates=(docs,))
        theta = bn.Dirichlet(np.ones(words), plates=(k,))
        counts = bn.Mixture(z, bn.Multinomial, n, theta)
        counts.observe(x[t].numpy().astype(int))
        z.initialize_from_parameters(resp[t].numpy())
        q = VB(counts, pi, theta, z)
        q.update(pi, theta, repeat=1, verbose=False)
        q.update(pi, theta, z, repeat=3000, tol=1e-14, verbose=False)
        np.testing.assert_allclose(state.objective[t].item(), q.compute_lowerbound(), rtol=1e-9)
        log_theta = torch.distributions.Dirichlet(state.q["theta"][0][t])
        ours = torch.digamma(log_theta.concentration) - torch.digamma(
            log_theta.concentration.sum(-1, keepdim=True)
        )
        np.testing.assert_allclose(ours.numpy(), theta.get_moments()[0], rtol=1e-7, atol=1e-9)


# ------------------------------------------------------------------------ refusals
def _set(x, value):
    x = x.clone()
    x[1, 2, 0] = value
    return x


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: _set(x, x[1, 2, 0] + 0.5), "its data must be whole numbers >= 0"),
        (lambda x: _set(x, -1.0), "its data must be whole numbers >= 0"),
        (
            lambda x: _set(x, x[1, 2, 0] + 1),
            f"each row of its counts must sum to its total_count {TRIALS}; the row at "
            "task 1, docs 2 sums to 13",
        ),
        (
            lambda x: _set(x, x[1, 2, 0] + TRIALS + 1),
            f"its counts exceed their total_count {TRIALS}",
        ),
        (
            lambda x: torch.where(torch.arange(x.shape[0])[:, None, None] == 3, 0.0, x),
            f"each row of its counts must sum to its total_count {TRIALS}; the row at "
            "task 3, docs 0 sums to 0",
        ),
    ],
    ids=["fraction", "negative", "row-over", "entry-over", "row-under"],
)
def test_counts_that_are_not_multinomial_data_are_refused_naming_the_site(change, message):
    with pytest.raises(ValueError, match=r"site 'x' \(Multinomial\)") as err:
        VMP(dirichlet_multinomial).fit(change(_documents(tasks=4, docs=3)))
    assert message in str(err.value)


def test_a_multinomial_with_fixed_probabilities_is_refused():
    def fixed(x):
        t, d, v = x.shape
        with pyro.plate("tasks", t, dim=-2):
            pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
            with pyro.plate("docs", d, dim=-1):
                pyro.sample("x", dist.Multinomial(TRIALS, x.new_ones(v) / v), obs=x)

    with pytest.raises(ValueError, match=r"site 'x' \(Multinomial\).*probs is fixed"):
        VMP(fixed).fit(_documents(tasks=2, docs=3))
