"""Shortcuts of the VMP sweep against the sums they replace.

* An observed Categorical under a selected Dirichlet table sends its selector ⟨ln φ_k⟩ at
  its label, read at precomputed positions: the same numbers as the linear child's sum
  against the one-hot data, bit for bit, and the same fits.
* Its message to the table, the counts Σ_n q(z_n = k) [x_n = c], is q(z) added at the
  labels (``scatter_add_``), and the update of a label whose one child it is (LDA's topic
  per word) takes its softmax on the table with the prior term added, read off at the
  labels: the same numbers again, bit for bit.
* A label whose children are linear children it selects (an observed Categorical or
  Multinomial under a Dirichlet table) has its bound terms read off the normaliser of
  its update, Σ_n ln Σ_k exp η_nk (PRML eq. 10.46-10.49): equal, to rounding, to
  E ln p(z | π) + Σ_children E ln p(x | z, ·) + H[q(z)] summed term by term.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference import base
from probfsl.inference.vmp import VMP, conjugate_children, messages, moments
from probfsl.inference.vmp.einsum import sweeping
from probfsl.inference.vmp.families.categorical import label_lookup
from tests.test_vmp_families import _classes, latent_class
from tests.test_vmp_multinomial import _clustered, document_clusters

F64 = torch.float64


def assert_same_fit(one: tuple, other: tuple) -> None:
    """Two fits ``(state, info)`` agree bit for bit: sweeps, the bound's trace, every factor."""
    (a, a_info), (b, b_info) = one, other
    assert torch.equal(a_info.n_steps, b_info.n_steps)
    assert torch.equal(a_info.trace, b_info.trace)
    for name, factor in a.q.items():
        for x, y in zip(factor, b.q[name], strict=True):
            assert torch.equal(x, y), name


def assert_close_fit(one: tuple, other: tuple) -> None:
    """Two fits ``(state, info)`` agree to float64 rounding: the same sweeps, the bound's
    trace and every factor within 1e-12 relative (a reordered sum rounds differently on
    another CPU's vector width)."""
    (a, a_info), (b, b_info) = one, other
    assert torch.equal(a_info.n_steps, b_info.n_steps)
    torch.testing.assert_close(a_info.trace, b_info.trace, rtol=1e-12, atol=1e-12, equal_nan=True)
    for name, factor in a.q.items():
        for x, y in zip(factor, b.q[name], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=name)


def lda(w, topics=3, vocabulary=7):
    """Latent Dirichlet allocation (Blei, Ng & Jordan, 2003): φ_k ~ Dirichlet(1), per
    document θ_d ~ Dirichlet(1), per word z_dn ~ Categorical(θ_d), w_dn ~ Categorical(φ_z)."""
    t, docs, n = w.shape
    with pyro.plate("tasks", t, dim=-3):
        with pyro.plate("topics", topics, dim=-1):
            phi = pyro.sample("phi", dist.Dirichlet(torch.ones(vocabulary, dtype=F64)))
        with pyro.plate("docs", docs, dim=-2):
            theta = pyro.sample("theta", dist.Dirichlet(torch.ones(topics, dtype=F64)))
            with pyro.plate("words", n, dim=-1):
                z = pyro.sample("z", dist.Categorical(theta))
                pyro.sample("w", dist.Categorical(Vindex(phi.unsqueeze(-3))[..., z, :]), obs=w)


def _words(t=6, docs=4, n=9, vocabulary=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocabulary, (t, docs, n), generator=g)


def _state(model, *data, sweeps=3, **options):
    """A fit's state after a few sweeps (its factors away from the start)."""
    engine = VMP(model, max_iter=sweeps, tol=0, warn=False, **options)
    state, _ = engine.fit(*data)
    return engine, state


@pytest.mark.parametrize("case", ["lda", "latent_class"])
def test_label_lookup_is_the_linear_childs_message_bit_for_bit(case):
    if case == "lda":
        _, state = _state(lda, _words(), order=["theta", "phi", "z"])
        child = "w"
    else:
        _, state = _state(latent_class, _classes(t=5, n=12)[0], order=["pi", "theta", "z"])
        child = "x"
    plan, q = state.plan, state.q
    c, z = plan.sites[child], plan.sites["z"]
    with torch.inference_mode(), sweeping():
        summed = conjugate_children.message(plan, q, c, "select", z)[0]
        looked = label_lookup(plan, q, c, z)
    if case == "latent_class":  # x has an items axis that z sums over: no lookup
        assert looked is None
        return
    assert torch.equal(looked[0], summed)


def test_sweeps_with_the_label_lookup_equal_sweeps_with_the_sum(monkeypatch):
    """Whole fits, batched: the factors and bounds with the lookup equal, bit for bit,
    those of the linear child's sum (the lookup's layout keeps every later rounding)."""
    from probfsl.inference.vmp.families import categorical

    words = _words(t=5, docs=3, n=11)
    _, fast = _state(lda, words, sweeps=8, order=["theta", "phi", "z"])
    monkeypatch.setattr(categorical, "label_lookup", lambda *args: None)
    _, summed = _state(lda, words, sweeps=8, order=["theta", "phi", "z"])
    assert torch.equal(fast.objective, summed.objective)
    for name, factor in fast.q.items():
        for a, b in zip(factor, summed.q[name], strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("size", ["small", "large"])  # the softmax by torch, by slices
def test_sweeps_with_the_folded_update_and_counts_equal_sweeps_with_the_sums(monkeypatch, size):
    """Whole fits, batched: the softmax on the table and the counts at the labels give
    the sweeps of the plain sums, and their factors and bounds to float64 rounding (the
    counts sum in another order)."""
    from probfsl.inference.vmp.families import categorical

    words = _words(t=5, docs=3, n=11) if size == "small" else _words(t=40, docs=10, n=20)

    def fit():
        engine = VMP(lda, max_iter=60, tol=1e-9, warn=False, order=["theta", "phi", "z"])
        return engine.fit(words)

    fast, fast_info = fit()
    assert fast.plan.cache.get(("folded", "z")) is not None  # the fold was taken
    assert any(key[0] == "counts" for key in fast.plan.cache if isinstance(key, tuple))
    monkeypatch.setattr(categorical.Categorical, "labels_update", lambda *args: None)
    monkeypatch.setattr(categorical, "label_counts", lambda *args: None)
    monkeypatch.setattr(categorical, "label_lookup", lambda *args: None)
    summed, summed_info = fit()
    assert_close_fit((fast, fast_info), (summed, summed_info))


@pytest.mark.parametrize(
    "model, data, order",
    [
        (lda, (_words(),), ["theta", "phi", "z"]),
        (latent_class, (_classes(t=5, n=12)[0],), ["pi", "theta", "z"]),
        (document_clusters, (_clustered(tasks=5, docs=10)[0],), ["pi", "theta", "z"]),
    ],
    ids=["lda", "latent_class", "multinomial"],
)
def test_bound_read_off_the_normaliser_equals_the_terms(model, data, order):
    engine, state = _state(model, *data, order=order)
    with torch.inference_mode():
        state, _ = engine.step(state)  # (fit's result holds copies of the factors)
    plan = state.plan
    assert messages.lse_applies(plan, plan.sites["z"])
    assert plan.cache.get(("lse", "z"))[0] is state.q["z"]  # the update's normaliser
    with torch.inference_mode(), sweeping():
        shortcut = messages.elbo(plan, state.q)
        plan.cache.pop(("lse", "z"))
        terms = messages.elbo(plan, state.q)
    assert torch.allclose(shortcut, terms, rtol=1e-13, atol=0)
    assert torch.equal(shortcut, state.objective)


def test_normaliser_shortcut_not_taken_for_a_fixed_table():
    """A label choosing a fixed table of an observed Categorical: that child is not a
    linear child (no latent parent), so the bound keeps its terms."""
    table = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=F64)

    def fixed_table(x):
        t, n = x.shape
        with pyro.plate("tasks", t, dim=-2):
            pi = pyro.sample("pi", dist.Dirichlet(torch.ones(1, 2, dtype=F64)))
            with pyro.plate("points", n, dim=-1):
                z = pyro.sample("z", dist.Categorical(pi))
                pyro.sample("x", dist.Categorical(table[z]), obs=x)

    _, state = _state(fixed_table, _words(t=4, docs=6, n=1, vocabulary=3)[..., 0])
    plan = state.plan
    assert not messages.lse_applies(plan, plan.sites["z"])
    assert plan.cache.get(("lse", "z")) is None


# ------------------------------------------------------------------ masked steps
def _gp_regression(y, k):
    """f ~ N(0, K), y ~ N(f, τ⁻¹ I), τ ~ Gamma(1, 0.1): one MultivariateNormal factor."""
    with pyro.plate("tasks", y.shape[0]):
        f = pyro.sample("f", dist.MultivariateNormal(y.new_zeros(y.shape[1]), k))
        tau = pyro.sample("tau", dist.Gamma(y.new_tensor(1.0), y.new_tensor(0.1)))
        pyro.sample("y", dist.Normal(f, tau.rsqrt().unsqueeze(-1)).to_event(1), obs=y)


def _gp_data(t=6, n=8):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(t, n, 1, generator=g, dtype=torch.float64) * 6 - 3
    k = torch.exp(-0.5 * torch.cdist(x, x).square()) + 1e-3 * torch.eye(n, dtype=torch.float64)
    y = torch.sin(x[..., 0]) + 0.3 * torch.randn(t, n, generator=g, dtype=torch.float64)
    return y, k


def test_a_masked_step_carries_the_cholesky_factor_and_moments_of_both_factors():
    """keep() merges two MultivariateNormal factors task by task; the Cholesky factor and
    the moments it caches for the merged factor are those of its own precision, bit for
    bit (LAPACK factorises each matrix of a batch alone)."""
    engine = VMP(_gp_regression)
    old = engine.init(*_gp_data())
    new, _ = engine.step(old)
    frozen = torch.tensor([True, False, True, False, False, True])
    merged = engine.keep(frozen, old, new)
    plan, (loc, precision) = merged.plan, merged.q["f"]
    assert torch.equal(loc[frozen], old.q["f"][0][frozen])
    assert torch.equal(loc[~frozen], new.q["f"][0][~frozen])
    chol = moments.factor_block(plan, merged.q, "f").chol
    assert chol is not None  # carried, not refactorised
    assert torch.equal(chol, torch.linalg.cholesky(precision))
    cov = torch.cholesky_inverse(torch.linalg.cholesky(precision))
    first, second = moments.expected_stats(plan, merged.q, "f")
    assert torch.equal(first, loc)
    assert torch.equal(second, cov + loc.unsqueeze(-1) * loc.unsqueeze(-2))


def test_a_compaction_carries_the_cholesky_factor_and_moments_of_the_tasks_kept():
    engine = VMP(_gp_regression)
    state, _ = engine.step(engine.init(*_gp_data()))
    kept = engine.take(state, torch.tensor([4, 1, 3]))
    loc, precision = kept.q["f"]
    chol = moments.factor_block(kept.plan, kept.q, "f").chol
    assert chol is not None and torch.equal(chol, torch.linalg.cholesky(precision))
    cov = torch.cholesky_inverse(torch.linalg.cholesky(precision))
    first, second = moments.expected_stats(kept.plan, kept.q, "f")
    assert torch.equal(first, loc)
    assert torch.equal(second, cov + loc.unsqueeze(-1) * loc.unsqueeze(-2))


def test_fits_with_the_carried_factors_equal_fits_without(monkeypatch):
    """Tasks converging at different sweeps (masked steps and compactions on the CPU): the
    same factors, bounds and sweeps, bit for bit, with and without the carries."""
    data = _gp_data(t=12, n=10)
    monkeypatch.setattr(base, "COMPACT_BELOW", 0)  # masked steps in a batch this small

    def fit():
        state, info = VMP(_gp_regression, max_iter=200, tol=1e-12).fit(*data)
        return state, info

    carried, carry = [], moments.carry_over
    monkeypatch.setattr(moments, "carry_over", lambda *a: carried.append(carry(*a)))
    with_carry, info = fit()
    assert carried  # some steps were masked
    monkeypatch.setattr(moments, "carry_over", lambda *args: None)
    monkeypatch.setattr(moments, "carry_rows", lambda *args: None)
    without, info_without = fit()
    assert_same_fit((with_carry, info), (without, info_without))
