"""EM-Dirichlet: the checklist of docs/design/em-dirichlet.md §6 and conformance."""

import itertools
import math
from dataclasses import replace
from functools import partial

import numpy as np
import pyro
import pytest
import torch

from probfsl.host_syncs import HostSyncCounter
from probfsl.inference.base import run
from probfsl.inference.dirichlet_mm import (
    BOUNDED_MM,
    NEWTON,
    REFERENCE_MM,
    EMDirichletEngine,
    checked_iteration,
    compiled_iteration,
    curvature,
    dirichlet_nll,
    is_check_iteration,
    masked_iteration,
    mm_dirichlet_fit,
    mm_dirichlet_step,
    newton_dirichlet_step,
    series_coefficients,
)
from probfsl.models.em_dirichlet import EMDirichlet, em_dirichlet_model, match_clusters
from probfsl.testing import ConformanceCase, check_engine

F64 = torch.float64


def dirichlet_mixture(n_tasks, k, n_query, present, n_shot=0, diag=8.0, off=0.5, seed=0):
    """Synthetic tasks (design §6.8): class c ~ Dir(alpha_c), alpha_cc = diag, others off."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.full((k, k), off, dtype=F64)
    alpha.fill_diagonal_(diag)
    torch.manual_seed(seed)
    query, labels, support, support_labels = [], [], [], []
    for _ in range(n_tasks):
        classes = torch.randperm(k, generator=g)[:present]
        y = classes[torch.randint(present, (n_query,), generator=g)]
        query.append(torch.distributions.Dirichlet(alpha[y]).sample())
        labels.append(y)
        if n_shot:
            ys = torch.arange(k).repeat(n_shot)
            support.append(torch.distributions.Dirichlet(alpha[ys]).sample())
            support_labels.append(ys)
    out = torch.stack(query), torch.stack(labels)
    if n_shot:
        out += (torch.stack(support), torch.stack(support_labels))
    return out


def minka_fit(log_x_mean, n_iter=5000):
    """Independent Dirichlet MLE: Minka (2000) fixed point alpha <- invdigamma(psi(sum) + s)."""
    s = log_x_mean.double()
    alpha = torch.ones_like(s)
    for _ in range(n_iter):
        y = torch.special.digamma(alpha.sum(-1, keepdim=True)) + s
        # invdigamma by Newton from Minka's initialisation
        a = torch.where(
            y >= -2.22, torch.exp(y) + 0.5, -1 / (y - torch.special.digamma(torch.ones(())))
        )
        for _ in range(8):
            a = a - (torch.special.digamma(a) - y) / torch.special.polygamma(1, a)
        if torch.allclose(a, alpha, rtol=1e-15, atol=0):
            return a
        alpha = a
    return alpha


# -- Algorithm 1 -------------------------------------------------------------------------


def test_curvature_limit_and_series_branch():
    """c(0) = pi^2/6, continuity at 0, and the series agrees with the direct formula at 0.1."""
    t = torch.tensor([0.0, 1e-12, 1e-6], dtype=F64)
    torch.testing.assert_close(curvature(t), torch.full_like(t, math.pi**2 / 6), rtol=1e-5, atol=0)
    u = torch.linspace(0.02, 0.05, 8, dtype=F64)
    direct = 2 * (u * torch.special.digamma(u + 1) - torch.lgamma(u + 1)) / u.square()
    torch.testing.assert_close(curvature(u), direct, rtol=5e-12, atol=0)
    assert (curvature(torch.logspace(-8, 3, 50, dtype=F64)) > 0).all()


def test_mm_root_solves_quadratic():
    """alpha_new is the positive root of c a^2 + b a = 1 (design §6.3), with b of either sign."""
    g = torch.Generator().manual_seed(0)
    beta = torch.rand(50, 6, generator=g, dtype=F64) * 20 + 1e-3
    stat = torch.log(torch.distributions.Dirichlet(torch.ones(6, dtype=F64)).sample((50,)))
    stat[:25] -= 30  # b > 0 branch (tiny roots)
    new = mm_dirichlet_step(beta, stat)
    c = curvature(beta)
    b = torch.special.digamma(beta + 1) - torch.special.digamma(beta.sum(-1, keepdim=True))
    b = b - c * beta - stat
    assert (new > 0).all() and (b > 0).any() and (b < 0).any()
    torch.testing.assert_close(c * new**2 + b * new, torch.ones_like(new), rtol=1e-12, atol=1e-12)


def reference_mm_step(beta, stat):
    """Algorithm 1 written directly from design §3.1 (curvature via the series-safe helper)."""
    c = curvature(beta)
    b = torch.special.digamma(beta + 1) - torch.special.digamma(beta.sum(-1, keepdim=True))
    b = b - c * beta - stat
    return (-b + torch.sqrt(b.square() + 4 * c)) / (2 * c)


@pytest.mark.parametrize("dtype,rtol", [(F64, 1e-12), (torch.float32, 2e-5)])
def test_mm_step_in_place_path_matches_the_spec_formula(dtype, rtol):
    """The in-place formula (coordinates above 0.05: c beta from digamma and ln Gamma
    directly) and the series (below 0.05) give the design's update, for b of both signs."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    beta = torch.rand(40, 7, generator=g, dtype=F64) * 30 + 0.05
    stat = torch.log(torch.distributions.Dirichlet(torch.ones(7, dtype=F64)).sample((40,)))
    stat[:20] -= 5.0
    expected = reference_mm_step(beta, stat)
    fast = mm_dirichlet_step(beta.to(dtype), stat.to(dtype))
    assert fast.dtype == dtype
    torch.testing.assert_close(fast.double(), expected, rtol=rtol, atol=0)
    # the series is chosen per coordinate: a row below the threshold leaves the other
    # rows bit-for-bit unchanged (rows are independent)
    mixed = torch.cat([beta, torch.full((1, 7), 1e-3, dtype=F64)])
    mixed_stat = torch.cat([stat, stat[:1]])
    series = mm_dirichlet_step(mixed.to(dtype), mixed_stat.to(dtype))
    torch.testing.assert_close(series[:-1], fast, rtol=0, atol=0)
    # the series row: the two evaluations of the curvature series (Horner in place vs
    # curvature()) differ by rounding, amplified in the root; the series itself is good
    # to 3e-12 (relative)
    torch.testing.assert_close(
        series[-1:].double(),
        reference_mm_step(mixed[-1:], mixed_stat[-1:]),
        rtol=max(rtol, 5e-12),
        atol=0,
    )


def test_step_equals_the_two_block_updates():
    """engine.step (which skips the objective between blocks) = update_alpha then
    update_assignments, objective included."""
    query, _ = dirichlet_mixture(3, 6, 20, present=3)
    engine = EMDirichletEngine(lambda_coef=1.0, **BOUNDED_MM)
    state = engine.init(query)
    one, info = engine.step(state)
    two = engine.update_assignments(engine.update_alpha(state))
    for name in ("r", "alpha", "pi", "objective", "mm_iters"):
        torch.testing.assert_close(getattr(one, name), getattr(two, name), rtol=1e-12, atol=0)
    assert torch.equal(info.objective, one.objective) and torch.equal(info.mm_iters, one.mm_iters)


@pytest.mark.parametrize("k,conc", [(5, 10.0), (10, 2.0), (30, 0.5)])
def test_mm_step_never_increases_the_weighted_nll(k, conc):
    """Design §6.1: F_k never increases over the MM-quadratic iterations (float64)."""
    g = torch.Generator().manual_seed(k)
    true = torch.rand(k, generator=g, dtype=F64) * conc + 0.2
    torch.manual_seed(k)
    x = torch.distributions.Dirichlet(true).sample((300,))
    w = torch.rand(300, generator=g, dtype=F64)
    stat = (w[:, None] * x.log()).sum(0, keepdim=True) / w.sum()
    alpha = torch.ones(1, k, dtype=F64)
    values = [dirichlet_nll(alpha, stat).item()]
    for _ in range(300):
        alpha = mm_dirichlet_step(alpha, stat)
        values.append(dirichlet_nll(alpha, stat).item())
    diffs = np.diff(values)
    assert diffs.max() <= 1e-12 * max(1.0, abs(values[0])), diffs.max()
    assert values[-1] < values[0] - 1e-3


@pytest.mark.parametrize("k,scale,iters", [(5, 10.0, 4000), (10, 3.0, 1500), (50, 0.55, 400)])
def test_mm_fit_is_the_dirichlet_mle(k, scale, iters):
    """Design §6.2: MM from alpha = 1 matches an independent Minka fit to 1e-10 (n = 2000)."""
    g = torch.Generator().manual_seed(k)
    true = torch.rand(k, generator=g, dtype=F64) * scale + 0.1
    torch.manual_seed(k)
    x = torch.distributions.Dirichlet(true).sample((2000,))
    stat = x.log().mean(0, keepdim=True)
    alpha, n_iter = mm_dirichlet_fit(torch.ones(1, k, dtype=F64), stat, max_iter=iters, tol=1e-26)
    reference = minka_fit(stat)
    torch.testing.assert_close(alpha, reference, rtol=1e-10, atol=0)
    assert ((alpha - true).abs() / true).max() < 0.15  # and the MLE is near the truth
    assert n_iter.item() <= iters


def test_mm_fit_converges_per_row():
    """Rows stop independently: a fast row does not run as long as a slow one."""
    torch.manual_seed(0)
    slow = torch.distributions.Dirichlet(torch.full((5,), 9.0, dtype=F64)).sample((500,))
    fast = torch.distributions.Dirichlet(torch.full((5,), 0.3, dtype=F64)).sample((500,))
    stat = torch.stack([slow.log().mean(0), fast.clamp_min(1e-300).log().mean(0)])
    both, iters = mm_dirichlet_fit(torch.ones(2, 5, dtype=F64), stat, max_iter=1000)
    alone, _ = mm_dirichlet_fit(torch.ones(1, 5, dtype=F64), stat[1:], max_iter=1000)
    assert iters[1] < iters[0]
    torch.testing.assert_close(both[1:], alone, rtol=0, atol=0)


def _mixed_rows():
    """Rows that converge at different checks, one that never does (a single sample, no
    MLE) and one with a coordinate below the series threshold."""
    torch.manual_seed(3)
    rows = [
        torch.distributions.Dirichlet(torch.full((5,), c, dtype=F64))
        .sample((300,))
        .clamp_min(1e-300)
        .log()
        .mean(0)
        for c in (9.0, 2.0, 0.3)
    ]
    single = torch.distributions.Dirichlet(torch.ones(5, dtype=F64)).sample().log()
    stat = torch.stack([*rows, single])
    alpha = torch.ones(4, 5, dtype=F64)
    alpha[2, 0] = 0.01
    return alpha, stat


def test_mm_fit_checks_on_the_reference_schedule_and_never_syncs():
    """Rows stop only right after a check (iterations 51, 101, ...), a stopped row keeps the
    value of the step at which it converged, and the loop makes no host synchronisation."""
    alpha, stat = _mixed_rows()
    assert [i for i in range(1, 160) if is_check_iteration(i, 50)] == [51, 101, 151]
    assert [i for i in range(1, 6) if is_check_iteration(i, 1)] == [2, 3, 4, 5]
    with HostSyncCounter() as counter:
        fit, iters = mm_dirichlet_fit(alpha, stat, max_iter=400, tol=1e-11, check_every=50)
    assert counter.total == 0
    stopped = iters < 400
    assert stopped.sum() >= 2 and not stopped.all()
    assert ((iters[stopped] - 1) % 50 == 0).all() and (iters[stopped] > 50).all()
    for row in range(4):  # = the row's own iterations, run one step at a time
        a = alpha[row : row + 1]
        for _ in range(int(iters[row])):
            a = mm_dirichlet_step(a, stat[row : row + 1])
        torch.testing.assert_close(fit[row : row + 1], a, rtol=0, atol=0)


@pytest.mark.parametrize("check_every", [1, 7, 50])
def test_mm_fit_early_exit_changes_nothing_but_the_synchronisations(check_every):
    """early_exit stops the loop once no row moves (one host sync per check): same alpha and
    iteration counts as the full masked loop, which makes no sync at all."""
    alpha, stat = _mixed_rows()
    alpha, stat = alpha[:3], stat[:3]  # rows with an MLE: they all converge
    frozen = torch.tensor([False, True, False])
    full, full_iters = mm_dirichlet_fit(alpha, stat, 3000, 1e-11, check_every, frozen)
    with HostSyncCounter() as counter:
        early, iters = mm_dirichlet_fit(alpha, stat, 3000, 1e-11, check_every, frozen, True)
    torch.testing.assert_close(early, full, rtol=0, atol=0)
    assert torch.equal(iters, full_iters) and iters[1] == 0 and torch.equal(early[1], alpha[1])
    checks = sum(is_check_iteration(i, check_every) for i in range(1, int(iters.max()) + 1))
    assert counter.total == checks and iters.max() < 3000


# -- safeguarded Newton inner solver (Minka 2000, §1) ------------------------------------


def _newton_rows(n_rows=12, k=6, seed=0):
    """[n_rows, K] statistics of Dirichlet samples whose true alpha spans tiny (< 0.05)
    to large (~ 200) coordinates, and the alpha = 1 start (float64)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    stats = []
    for r in range(n_rows):
        true = torch.exp(torch.empty(k, dtype=F64).uniform_(-3.5, 5.3, generator=g))
        if r % 3 == 0:
            true[0] = 0.02  # below the curvature series threshold
        x = torch.distributions.Dirichlet(true).sample((400,)).clamp_min(1e-300)
        stats.append(x.log().mean(0))
    return torch.ones(n_rows, k, dtype=F64), torch.stack(stats)


def test_newton_step_decreases_the_nll_at_least_as_much_as_mm():
    """Every safeguarded Newton iteration gives F <= F(MM step) <= F(alpha) per row."""
    alpha, stat = _newton_rows()
    alpha[::2] = torch.rand(alpha[::2].shape, dtype=F64) * 50 + 0.01  # also far starts
    for _ in range(25):
        new, mm = newton_dirichlet_step(alpha, stat), mm_dirichlet_step(alpha, stat)
        f, f_new, f_mm = (dirichlet_nll(a, stat) for a in (alpha, new, mm))
        scale = 1e-12 * f.abs().clamp_min(1.0)
        assert (new > 0).all() and (f_new <= f_mm + scale).all() and (f_mm <= f + scale).all()
        alpha = new


@pytest.mark.slow
def test_newton_fit_reaches_the_mm_fixed_point_in_few_iterations():
    """Float64, rows with alpha from 0.02 to ~200: 30 Newton iterations reach the Dirichlet
    MLE that MM reaches after 20,000 to 1e-9 (gradient 0 to 1e-10; Minka's fixed point)."""
    alpha, stat = _newton_rows()
    newton, iters = mm_dirichlet_fit(alpha, stat, 30, 0.0, 1, solver="newton")
    mm, _ = mm_dirichlet_fit(alpha, stat, 20000, 0.0, 1)
    assert newton.min() < 0.05 and newton.max() > 100
    torch.testing.assert_close(newton, mm, rtol=1e-9, atol=0)
    grad = torch.special.digamma(newton) - torch.special.digamma(newton.sum(-1, keepdim=True))
    torch.testing.assert_close(grad, stat, rtol=0, atol=1e-10)  # g = 0: the MLE
    # Minka's linearly convergent fixed point (5000 iterations at most) is less exact
    torch.testing.assert_close(newton, minka_fit(stat), rtol=1e-7, atol=0)
    # with the default stopping rule every row stops well before the cap
    _, stopped = mm_dirichlet_fit(alpha, stat, 30, 1e-11, 1, solver="newton")
    assert stopped.max() < 20


def test_newton_fit_batched_equals_per_row_and_never_syncs():
    """Masked per-row convergence: a row's result is the one it gets alone, and the loop
    makes no host synchronisation (frozen rows keep their alpha)."""
    alpha, stat = _newton_rows(6)
    frozen = torch.tensor([False, False, True, False, False, False])
    with HostSyncCounter() as counter:
        both, iters = mm_dirichlet_fit(alpha, stat, 20, 1e-11, 1, frozen, solver="newton")
    assert counter.total == 0 and iters[2] == 0 and torch.equal(both[2], alpha[2])
    for row in (0, 1, 3, 4, 5):
        alone, it = mm_dirichlet_fit(
            alpha[row : row + 1], stat[row : row + 1], 20, 1e-11, 1, solver="newton"
        )
        torch.testing.assert_close(both[row : row + 1], alone, rtol=1e-13, atol=0)
        assert it.item() == iters[row].item()


def test_unknown_solver_is_rejected():
    alpha, stat = _newton_rows(2)
    with pytest.raises(ValueError, match="solver"):
        mm_dirichlet_fit(alpha, stat, solver="lbfgs")
    with pytest.raises(ValueError, match="solver"):
        EMDirichletEngine(solver="lbfgs")
    with pytest.raises(ValueError, match="solver"):
        EMDirichlet(solver="lbfgs").fit_probabilities(torch.full((1, 3, 3), 1 / 3))


# -- Algorithm 2: block steps ------------------------------------------------------------


def _assert_blocks_never_increase(engine, state, n_rounds: int) -> list:
    """Alternate the alpha and assignment blocks; J must not increase after any of them.
    Returns the states after each alpha step."""
    values, after_alpha = [state.objective], []
    for _ in range(n_rounds):
        state = engine.update_alpha(state)
        after_alpha.append(state)
        values.append(state.objective)
        state = engine.update_assignments(state)
        values.append(state.objective)
    trace = torch.stack(values)
    worst = (trace[1:] - trace[:-1]).max().item()
    assert worst <= 1e-9 * trace.abs().max().item(), worst
    assert (trace[-1] < trace[0]).all()
    return after_alpha


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("coef", [0.0, 1.0, None])
def test_objective_never_increases_after_any_block(hard, coef):
    """Design §6.4: J non-increasing after each alpha step and each R step (float64)."""
    query, _ = dirichlet_mixture(3, 10, 40, present=3, seed=1)
    engine = EMDirichletEngine(lambda_coef=coef, hard=hard, mm_max_iter=300)
    _assert_blocks_never_increase(engine, engine.init(query), 6)


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("cap", [1, 3])
def test_bounded_inner_loop_still_never_increases_the_objective(hard, cap):
    """Default mode: a few MM iterations per alpha step is an inexact block step, J monotone."""
    query, _, support, labels = dirichlet_mixture(3, 8, 40, present=3, n_shot=1, seed=9)
    engine = EMDirichletEngine(hard=hard, mm_max_iter=cap)
    for state in _assert_blocks_never_increase(engine, engine.init(query, support, labels), 8):
        assert (state.mm_iters <= cap).all()


def test_capped_fit_is_repeated_mm_steps_and_resumes_from_its_warm_start():
    """max_iter = m is m MM steps; two capped calls equal one call with twice the cap."""
    g = torch.Generator().manual_seed(10)
    stat = torch.log(torch.distributions.Dirichlet(torch.full((6,), 4.0, dtype=F64)).sample((3,)))
    stat = stat + 0.05 * torch.randn(3, 6, generator=g, dtype=F64).abs().neg()
    alpha = torch.ones(3, 6, dtype=F64)
    steps = alpha
    for _ in range(7):
        steps = mm_dirichlet_step(steps, stat)
    fit, iters = mm_dirichlet_fit(alpha, stat, max_iter=7, tol=0.0, check_every=1)
    torch.testing.assert_close(fit, steps, rtol=0, atol=0)
    assert (iters == 7).all()
    twice, _ = mm_dirichlet_fit(fit, stat, max_iter=7, tol=0.0, check_every=1)
    once, _ = mm_dirichlet_fit(alpha, stat, max_iter=14, tol=0.0, check_every=1)
    torch.testing.assert_close(twice, once, rtol=0, atol=0)


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.slow
def test_default_bounded_mode_agrees_with_the_reference_loop(hard):
    """Zero-shot default (BOUNDED_MM: 20 inner its, check every one) and reference agree.

    Hard: identical predictions; soft: the fixed points reached differ slightly, so at
    least 95 % of the predictions agree and both recover the mixture.
    """
    query, labels = dirichlet_mixture(4, 10, 60, present=3, seed=11)
    fast = EMDirichlet(hard=hard, n_iter=10)
    reference = EMDirichlet(hard=hard, n_iter=10, **REFERENCE_MM)
    predicted, expected = fast.predict_zero_shot(query), reference.predict_zero_shot(query)
    agreement = (predicted == expected).double().mean()
    assert agreement == 1.0 if hard else agreement >= 0.95
    assert (predicted == labels).double().mean() >= 0.9
    assert (expected == labels).double().mean() >= 0.9
    assert fast.state_.mm_iters.max() <= 20 and reference.state_.mm_iters.max() > 20


def test_estimator_inner_loop_defaults_per_mode():
    """Bounded MM loop by default in zero-shot, the reference MM loop in few-shot;
    ``solver`` alone picks that solver's preset for the mode; every setting is overridable."""
    query, _, support, labels = dirichlet_mixture(2, 5, 20, present=3, n_shot=2, seed=12)
    est = EMDirichlet(n_iter=2)
    assert est.mm_options(zero_shot=True) == BOUNDED_MM
    assert est.mm_options(zero_shot=False) == REFERENCE_MM
    assert EMDirichlet(solver="newton").mm_options(zero_shot=False) == NEWTON
    assert EMDirichlet(**REFERENCE_MM).mm_options(zero_shot=True) == REFERENCE_MM
    assert EMDirichlet(solver="mm").mm_options(zero_shot=False) == REFERENCE_MM
    assert EMDirichlet(solver="mm").mm_options(zero_shot=True) == BOUNDED_MM
    assert EMDirichlet(solver="newton").mm_options(zero_shot=True) == NEWTON
    seven = {**REFERENCE_MM, "mm_max_iter": 7}
    assert EMDirichlet(mm_max_iter=7).mm_options(zero_shot=False) == seven
    est.fit_probabilities(query)
    assert est.state_.mm_iters.max() <= BOUNDED_MM["mm_max_iter"]
    for kwargs, preset in (({}, REFERENCE_MM), ({"solver": "newton"}, NEWTON)):
        few = EMDirichlet(n_iter=2, **kwargs).fit_probabilities(query, support, labels)
        engine = EMDirichletEngine(**preset)
        free, _ = run(engine, engine.init(query, support, labels), 2)
        torch.testing.assert_close(few.alpha, free.alpha, rtol=0, atol=0)


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.slow
def test_newton_solver_agrees_with_the_reference_loop_where_it_converges(hard):
    """Few-shot: the Newton solver and the reference MM loop (the default) give the same
    predictions and nearly the same alpha on tasks whose class rows have a finite, moderate
    MLE."""
    query, labels, support, support_labels = dirichlet_mixture(
        4, 5, 40, present=5, n_shot=5, seed=21
    )
    newton = EMDirichlet(hard=hard, n_iter=5, solver="newton")
    reference = EMDirichlet(hard=hard, n_iter=5)
    a = newton.fit_probabilities(query, support, support_labels)
    b = reference.fit_probabilities(query, support, support_labels)
    assert reference.state_.mm_iters.max() < 1000  # every MM row converged
    assert torch.equal(a.query_r.argmax(-1), b.query_r.argmax(-1))
    torch.testing.assert_close(a.alpha, b.alpha, rtol=1e-3, atol=0)
    assert newton.state_.mm_iters.max() < 20


def test_lambda_equal_to_query_size_is_the_em_e_step():
    """Design §6.5: lambda = |Q|, no support: R = pi_k Dir(x|a_k) / sum_j pi_j Dir(x|a_j)."""
    query, _ = dirichlet_mixture(2, 6, 30, present=3, seed=2)
    engine = EMDirichletEngine(lambda_coef=1.0)
    state = engine.update_alpha(engine.init(query))
    pi = state.r.mean(1)
    new = engine.update_assignments(state)
    dens = (
        torch.distributions.Dirichlet(state.alpha.unsqueeze(1)).log_prob(query.unsqueeze(2)).exp()
    )
    expected = pi.unsqueeze(1) * dens
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(new.r, expected, rtol=1e-9, atol=1e-12)


def test_permutation_invariance():
    """Design §6.6: permuting queries permutes R; relabelling classes permutes every output."""
    query, _, support, labels = dirichlet_mixture(2, 6, 30, present=3, n_shot=1, seed=3)
    engine = EMDirichletEngine(mm_max_iter=200)
    base, _ = run(engine, engine.init(query, support, labels), 4)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    moved, _ = run(engine, engine.init(query[:, order], support, labels), 4)
    torch.testing.assert_close(moved.query_r, base.query_r[:, order], rtol=1e-7, atol=1e-10)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    inverse = torch.argsort(perm)
    relabelled, _ = run(
        engine, engine.init(query[..., perm], support[..., perm], inverse[labels]), 4
    )
    torch.testing.assert_close(relabelled.query_r, base.query_r[..., perm], rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(
        relabelled.alpha, base.alpha[:, perm][:, :, perm], rtol=1e-7, atol=1e-10
    )
    assert torch.equal(relabelled.query_r.argmax(-1), inverse[base.query_r.argmax(-1)])


def test_recovers_synthetic_dirichlet_mixtures():
    """Design §6.8: K=20, 4 present classes, alpha_kk = 8 / 0.5, |Q|=75, informative start.

    The code's lambda; the loops are shortened (8 outer, 100 inner iterations) to keep the
    test fast (the full 20 x 1000 reach the same purity on these tasks).
    """
    query, labels = dirichlet_mixture(8, 20, 75, present=4, seed=4)
    est = EMDirichlet(n_iter=8, mm_max_iter=100)
    predicted = est.predict_zero_shot(query)
    clusters = est.state_.query_r.argmax(-1)
    purity = []
    for c, y in zip(clusters, labels, strict=True):
        counts = torch.zeros(20, 20)
        counts.index_put_((c, y), torch.ones(75), accumulate=True)
        purity.append(counts.max(1).values.sum().item() / 75)
    assert np.mean(purity) >= 0.95
    assert (predicted == labels).double().mean() >= 0.9


def test_few_shot_support_rows_stay_at_their_labels():
    query, _, support, labels = dirichlet_mixture(2, 5, 20, present=3, n_shot=2, seed=5)
    engine = EMDirichletEngine(mm_max_iter=100)
    state, _ = run(engine, engine.init(query, support, labels), 3)
    onehot = torch.nn.functional.one_hot(labels, 5).double()
    assert torch.equal(state.r[:, : support.shape[1]], onehot)


def test_class_without_query_mass_fits_its_support():
    """Design §6.10: zero query responsibility for k -> alpha_k is the MLE of k's support."""
    query, _, support, labels = dirichlet_mixture(1, 4, 30, present=3, n_shot=60, seed=6)
    engine = EMDirichletEngine(mm_max_iter=5000, mm_tol=1e-28)
    state = engine.init(query, support, labels)
    r = state.r.clone()
    r[:, support.shape[1] :, 2] = 0
    r[:, support.shape[1] :] /= r[:, support.shape[1] :].sum(-1, keepdim=True)
    state = engine.update_alpha(replace(state, r=r))
    mle = minka_fit(support[0, labels[0] == 2].log().mean(0, keepdim=True))
    torch.testing.assert_close(state.alpha[0, 2:3], mle, rtol=1e-9, atol=0)


def test_empty_class_keeps_alpha_and_never_gives_nan():
    """Design §6.11: a class with zero weight keeps its alpha; no NaN anywhere."""
    query, _ = dirichlet_mixture(2, 8, 30, present=2, seed=7)
    engine = EMDirichletEngine(hard=True, mm_max_iter=200)
    state = engine.init(query)
    onehot = torch.nn.functional.one_hot(query.argmax(-1), 8).double()
    state = replace(state, r=onehot, alpha=state.alpha * 1.7)
    empty = onehot.sum(1) == 0
    assert empty.any()
    new = engine.update_alpha(state)
    torch.testing.assert_close(new.alpha[empty], state.alpha[empty], rtol=0, atol=0)
    assert (new.mm_iters[empty] == 0).all()
    final, info = run(engine, new, 10)
    assert torch.isfinite(final.alpha).all() and torch.isfinite(info.trace).all()
    assert torch.isfinite(final.r).all()


# -- Pyro: the objective is the model's negative ELBO -----------------------------------


def _case(hard=False, coef=1.0, n_shot=1, solver="mm"):
    query, _, support, labels = dirichlet_mixture(3, 5, 12, present=3, n_shot=max(n_shot, 1))
    if n_shot == 0:
        support, labels = support[:, :0], labels[:, :0]
    return ConformanceCase(
        make_engine=lambda: EMDirichletEngine(
            lambda_coef=coef, hard=hard, mm_max_iter=50, solver=solver
        ),
        model=partial(em_dirichlet_model, lambda_coef=coef),
        data=(query, support, labels),
        n_steps=4,
        particles=200,
        repeats=5,
    )


@pytest.mark.parametrize(
    "hard,coef,n_shot", [(False, 1.0, 1), (False, 2.0, 0), (True, 1.0, 1), (False, 0.0, 0)]
)
def test_engine_passes_conformance(hard, coef, n_shot):
    """Monotone J, batched = single, float32 ~ float64, Trace_ELBO = -J (design §2)."""
    check_engine(_case(hard, coef, n_shot))


@pytest.mark.parametrize("hard,n_shot", [(False, 1), (True, 0)])
@pytest.mark.slow
def test_newton_engine_passes_conformance(hard, n_shot):
    """The Newton inner solver keeps J monotone, batched = single, no host sync, devices."""
    check_engine(_case(hard, 1.0, n_shot, solver="newton"))


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("zero_shot", [False, True])
@pytest.mark.slow
def test_production_engine_passes_conformance(hard, zero_shot):
    """The engine exactly as the estimator builds it by default (the reference MM loop in
    few-shot, bounded MM in zero-shot, default lambda), K = 10 so that lambda/|Q| = 2: no
    host synchronisation in a step, every tensor on the data's device, and the rest."""
    query, _, support, labels = dirichlet_mixture(3, 10, 12, present=3, n_shot=1, seed=13)
    if zero_shot:
        support, labels = support[:, :0], labels[:, :0]
    estimator = EMDirichlet(hard=hard)
    engine = estimator.make_engine(zero_shot=zero_shot)
    assert engine.coef(10) == 2.0 and not engine.mm_early_exit
    preset = BOUNDED_MM if zero_shot else REFERENCE_MM
    assert (engine.solver, engine.mm_max_iter) == (preset["solver"], preset["mm_max_iter"])
    check_engine(
        ConformanceCase(
            make_engine=partial(estimator.make_engine, zero_shot=zero_shot),
            model=partial(em_dirichlet_model, lambda_coef=engine.coef(10)),
            data=(query, support, labels),
            n_steps=2,
            particles=200,
            repeats=5,
        )
    )


@pytest.mark.parametrize("n_shot", [0, 2])
def test_objective_equals_enumerated_negative_elbo(n_shot):
    """Design §6.7: J equals Pyro's TraceEnum_ELBO loss (exact enumeration over c_n)."""
    case = _case(coef=3.0, n_shot=n_shot)
    engine = case.make_engine()
    state, _ = run(engine, engine.init(*case.data), 3)
    elbo = pyro.infer.TraceEnum_ELBO(max_plate_nesting=2)
    with pyro.get_param_store().scope():  # the declaration's pyro.param sites: alpha, pi
        for name, value in engine.point_estimates(state).items():
            pyro.param(name, value)
        guide = pyro.infer.config_enumerate(engine.guide(state))
        loss = elbo.loss(case.model, guide, *case.data)
    assert loss == pytest.approx(state.objective.sum().item(), rel=1e-9)


# -- zero-shot matching -------------------------------------------------------------------


def test_hungarian_matching_is_the_best_injective_assignment():
    """Design §6.9: injective map; accuracy equals the brute-force best assignment."""
    g = torch.Generator().manual_seed(8)
    k = 5
    for _ in range(5):
        probs = torch.softmax(3 * torch.randn(1, 25, k, generator=g, dtype=F64), -1)
        clusters = torch.randint(0, 4, (1, 25), generator=g)
        matched = match_clusters(clusters, probs)
        used = clusters.unique()
        classes = [matched[0, clusters[0] == c][0].item() for c in used]
        assert len(set(classes)) == len(classes)
        for c in used:  # every member of a cluster gets the same class
            assert matched[0, clusters[0] == c].unique().numel() == 1
        means = torch.stack([probs[0, clusters[0] == c].mean(0) for c in used])
        best = max(
            itertools.permutations(range(k), len(used)),
            key=lambda p: sum(means[i, p[i]].item() for i in range(len(used))),
        )
        assert classes == list(best)
    # Table 6 mode: argmax of the cluster mean, classes may repeat
    probs = torch.tensor([[[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]]], dtype=F64)
    clusters = torch.tensor([[0, 1, 1]])
    assert match_clusters(clusters, probs, "argmax").tolist() == [[0, 0, 0]]
    assert match_clusters(clusters, probs, "hungarian").tolist() == [[0, 1, 1]]


# -- the inner loop compiled and replayed from CUDA graphs (dirichlet_mm_graph) ----------


@pytest.mark.parametrize("max_iter, check_every", [(1000, 50), (20, 1), (1, 50), (7, 3), (52, 50)])
def test_graph_schedule_has_the_eager_loops_checks(max_iter, check_every):
    """iteration 1, then blocks ending at each check, then the tail: the eager schedule."""
    from probfsl.inference.dirichlet_mm_graph import schedule

    checks = [i for i in range(1, max_iter) if is_check_iteration(i, check_every)]
    blocks, tail = schedule(max_iter, check_every)
    assert checks == [1 + m * check_every for m in range(1, blocks + 1)]
    assert 1 + blocks * check_every + tail == max_iter and tail >= 0


def _loop_rows(t=40, k=5, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    x = torch.distributions.Dirichlet(torch.ones(k)).sample((t, 30)).clamp_min(1e-15)
    stat = (x.log().mean(1) + 0.1 * torch.randn(t, k, generator=g)).unsqueeze(1)
    stat = stat.expand(t, k, k).contiguous().to(device, dtype)
    frozen = torch.zeros(t, k, dtype=torch.bool, device=device)
    frozen[::7, 1] = True
    return torch.ones(t, k, k, device=device, dtype=dtype), stat, frozen


def test_graphed_loop_orchestration_is_the_eager_loop(monkeypatch):
    """The captured loop's static buffers, blocks, tail and check indices, on the CPU: with
    capture replaced by running the recorded body at each replay, it is the eager loop
    exactly (float64, frozen rows), also when the buffers are reused by a second call."""
    from probfsl.inference import dirichlet_mm_graph as graph

    monkeypatch.setattr(graph, "capture", lambda body, device: body)
    monkeypatch.setattr(graph, "warm_up", lambda fn, device: fn())
    alpha, stat, frozen = _loop_rows(dtype=F64)
    masked = partial(masked_iteration, mm_dirichlet_step)
    checked = partial(checked_iteration, mm_dirichlet_step)
    for max_iter, check_every in ((120, 50), (20, 1), (7, 3), (1, 50)):
        blocks, tail = graph.schedule(max_iter, check_every)
        loop = graph._CapturedLoop(
            alpha, stat, series_coefficients(alpha), masked, checked, check_every, 1e-9, (1, tail)
        )
        for shift in (0.0, -0.2):
            args = (alpha, stat + shift, max_iter, 1e-9, check_every, frozen)
            eager, eager_iters = mm_dirichlet_fit(*args, compiled=False)
            out, active, stopped = loop.run(alpha, stat + shift, ~frozen, blocks, tail, check_every)
            assert torch.equal(out, eager)
            assert torch.equal(torch.where(active, max_iter, stopped), eager_iters)


@pytest.mark.slow
def test_compiled_inner_loop_matches_the_eager_loop_on_the_cpu():
    """compiled=True on the CPU (torch.compile, no graphs): the eager loop's alpha up to
    float32 rounding and the same stopping iterations; frozen rows untouched."""
    alpha, stat, frozen = _loop_rows()
    eager, eager_iters = mm_dirichlet_fit(alpha, stat, 120, 1e-11, 50, frozen, compiled=False)
    fused, fused_iters = mm_dirichlet_fit(alpha, stat, 120, 1e-11, 50, frozen, compiled=True)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=0)
    assert torch.equal(fused_iters, eager_iters)
    assert torch.equal(fused[frozen], alpha[frozen]) and bool((fused_iters[frozen] == 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("solver", ["mm", "newton"])
@pytest.mark.parametrize("max_iter, check_every", [(120, 50), (20, 1)])
def test_graphed_inner_loop_on_cuda_matches_the_eager_loop(solver, max_iter, check_every):
    """The default on CUDA (compiled, replayed from cached graphs): the eager loop's result
    on the same device up to float32 rounding (compared through each row's objective F,
    which Newton's discrete safeguard keeps stable where alpha itself may flip between
    two near-equal steps); a second call with other statistics replays the cached graphs."""
    from probfsl.inference import dirichlet_mm_graph

    alpha, stat, frozen = _loop_rows(device="cuda")
    for shift in (0.0, -0.2):
        shifted = stat + shift
        args = (alpha, shifted, max_iter, 1e-11, check_every, frozen)
        eager, eager_iters = mm_dirichlet_fit(*args, solver=solver, compiled=False)
        graphed, iters = mm_dirichlet_fit(*args, solver=solver)
        f_graphed, f_eager = dirichlet_nll(graphed, shifted), dirichlet_nll(eager, shifted)
        torch.testing.assert_close(f_graphed, f_eager, rtol=1e-5, atol=1e-4)
        if solver == "mm":  # Newton's float32 stopping test (1e-11) sits at rounding level
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=0)
            assert (iters == eager_iters).double().mean() > 0.9
        assert torch.equal(graphed[frozen], alpha[frozen])
    masked = compiled_iteration("masked", solver)
    assert any(key[3] is masked for key in dirichlet_mm_graph._loops)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_em_dirichlet_on_cuda_gives_the_eager_labels():
    """Estimator level, few-shot and zero-shot: graphed (default on CUDA) against eager."""
    query, _, support, support_labels = dirichlet_mixture(30, 5, 40, 5, n_shot=3)
    query, support = query.float().cuda(), support.float().cuda()
    support_labels = support_labels.cuda()
    for zero_shot in (False, True):
        labels = {}
        for compiled in (None, False):
            est = EMDirichlet(compiled=compiled, n_iter=5)
            if zero_shot:
                labels[compiled] = est.predict_zero_shot(query)
            else:
                labels[compiled] = est.fit_probabilities(query, support, support_labels)
                labels[compiled] = labels[compiled].query_r.argmax(-1)
        assert labels[None].device.type == "cuda"
        assert (labels[None] == labels[False]).double().mean() > 0.99
