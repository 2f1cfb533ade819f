"""Evidence LS-SVM: the checklist of docs/design/evidence.md §6 and the estimator."""

import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from probfsl.derived.evidence import declared_data, rotate, rotated_evidence_model
from probfsl.inference.base import run
from probfsl.inference.evidence import (
    EvidenceEngine,
    _slopes,
    em_lambda,
    em_update,
    evidence_curve,
    log_evidence,
    log_evidence_ab,
    maximize_evidence,
    maximize_shared_evidence,
    newton_polish,
    posterior_covariance,
    posterior_mean,
    profile_beta,
    shared_update,
    spectrum,
    spectrum_from_gram,
    update,
)
from probfsl.models.evidence import EvidenceLSSVM, greedy_ensemble, rank_backbones
from probfsl.testing import ConformanceCase, audit_devices, check_engine

F64 = torch.float64


def _problem(n, d, k=3, seed=0, nonneg=True):
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.rand(n, d, generator=g, dtype=F64)
        if nonneg
        else torch.randn(n, d, generator=g, dtype=F64)
    )
    x = x / x.norm(dim=1, keepdim=True)
    labels = torch.arange(n) % k
    # informative features: shift each class along its own direction
    x = x + 0.3 * torch.nn.functional.one_hot(labels, d).to(F64)
    x = x / x.norm(dim=1, keepdim=True)
    return x, torch.nn.functional.one_hot(labels, k).to(F64), labels


def _mvn_log_evidence(x, y, alpha, beta):
    n = x.shape[0]
    cov = torch.eye(n, dtype=F64) / beta + x @ x.T / alpha
    return torch.distributions.MultivariateNormal(torch.zeros(n, dtype=F64), cov).log_prob(y)


def _eq7(x, y, alpha, beta):
    """Paper eq. 7 with the explicit D x D matrix A."""
    n, d = x.shape
    a = alpha * torch.eye(d, dtype=F64) + beta * x.T @ x
    m = beta * torch.linalg.solve(a, x.T @ y)
    return (
        d / 2 * math.log(alpha)
        + n / 2 * math.log(beta)
        - 0.5 * torch.linalg.slogdet(a)[1]
        - beta / 2 * ((y - x @ m) ** 2).sum()
        - alpha / 2 * (m @ m)
        - n / 2 * math.log(2 * math.pi)
    )


@pytest.mark.parametrize("n,d", [(40, 10), (12, 30)])
def test_log_evidence_equals_marginal_gaussian_and_eq7(n, d):
    """Checklist 1: eq. 17 = MVN(0, I/beta + XX^T/alpha).log_prob(y) = eq. 7 (rtol 1e-10)."""
    x, y, _ = _problem(n, d)
    sp = spectrum(x, y)
    assert sp.mode == ("primal" if n > d else "dual")
    lam = torch.tensor([0.05, 0.7, 3.0], dtype=F64)
    f = log_evidence(sp, lam)
    beta = profile_beta(sp, lam)
    alpha = lam * beta
    for k in range(3):
        ref = _mvn_log_evidence(x, y[:, k], alpha[k], beta[k])
        torch.testing.assert_close(f[k], ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(_eq7(x, y[:, k], alpha[k], beta[k]), ref, rtol=1e-10, atol=1e-10)
    # eq. 14 at arbitrary (alpha, beta), not only at the profile beta
    a2, b2 = alpha * 1.7, beta * 0.6
    for k in range(3):
        torch.testing.assert_close(
            log_evidence_ab(sp, a2, b2)[k],
            _mvn_log_evidence(x, y[:, k], a2[k], b2[k]),
            rtol=1e-10,
            atol=1e-10,
        )


def test_printed_eq19_converges_elsewhere():
    """Checklist 2: the printed eq. (19) (no factor N) has a different limit (erratum)."""
    x, y, _ = _problem(60, 8)
    sp = spectrum(x, y)
    right = maximize_evidence(sp, paper_exact=True).lam
    wrong = maximize_evidence(sp, paper_exact=True, variant="eq19").lam
    assert ((wrong - right).abs() / right > 0.1).all()


@pytest.mark.parametrize("paper_exact", [True, False])
def test_fixed_point_is_the_grid_maximum(paper_exact):
    """Checklist 3: fixed point = argmax of F on a dense 4000-point log grid."""
    x, y, _ = _problem(80, 12)
    sp = spectrum(x, y)
    res = maximize_evidence(sp, paper_exact=paper_exact)
    assert res.converged.all() and not res.at_boundary.any()
    grid = torch.logspace(-5, 4, 4000, dtype=F64)
    curve = evidence_curve(sp, grid)
    step = math.log(grid[1] / grid[0])
    best = grid[curve.argmax(-1)]
    assert ((res.lam.log() - best.log()).abs() <= step).all()
    assert (res.log_evidence >= curve.max(-1).values - 1e-9).all()


def test_aitken_same_fixed_point_in_fewer_iterations():
    """Checklist 4: Aitken and plain iteration agree (rtol 1e-4); Aitken needs fewer steps."""
    x, y, _ = _problem(80, 12, k=4)
    sp = spectrum(x, y)
    fast = maximize_evidence(sp, paper_exact=True, accelerate=True)
    slow = maximize_evidence(sp, paper_exact=True, accelerate=False, eps=1e-9)
    torch.testing.assert_close(fast.lam, slow.lam, rtol=1e-4, atol=0)
    assert (fast.n_iter < slow.n_iter).all()


def test_mackay_profile_and_em_maps_share_the_fixed_point():
    """Checklist 5."""
    x, y, _ = _problem(50, 10)
    sp = spectrum(x, y)
    lam = maximize_evidence(sp).lam
    torch.testing.assert_close(update(sp, lam), lam, rtol=1e-7, atol=0)
    torch.testing.assert_close(update(sp, lam, "mackay"), lam, rtol=1e-7, atol=0)
    beta = profile_beta(sp, lam)
    a, b = em_update(sp, lam * beta, beta)
    torch.testing.assert_close(a / b, lam, rtol=1e-7, atol=0)
    # EM is an ascent method on L(alpha, beta)
    a0, b0 = lam * beta * 3, beta / 2
    a1, b1 = em_update(sp, a0, b0)
    assert (log_evidence_ab(sp, a1, b1) >= log_evidence_ab(sp, a0, b0)).all()


def test_matches_sklearn_bayesian_ridge():
    """Checklist 6: lambda_/alpha_ = our lambda and scores_[-1] = F (N > D)."""
    sklearn = pytest.importorskip("sklearn.linear_model")
    x, y, _ = _problem(60, 8)
    res = maximize_evidence(spectrum(x, y))
    for k in range(y.shape[1]):
        br = sklearn.BayesianRidge(
            fit_intercept=False,
            alpha_1=0,
            alpha_2=0,
            lambda_1=0,
            lambda_2=0,
            tol=1e-12,
            max_iter=100000,
            compute_score=True,
        ).fit(x.numpy(), y[:, k].numpy())
        assert br.lambda_ / br.alpha_ == pytest.approx(res.lam[k].item(), rel=1e-6)
        assert br.scores_[-1] == pytest.approx(res.log_evidence[k].item(), rel=1e-9)


def test_weights_and_dual_primal_agree():
    """Checklist 7: w = solve(X^T X + lambda I, X^T y); dual and primal paths agree."""
    lam = torch.tensor([0.1, 1.0, 5.0], dtype=F64)
    for n, d in [(15, 25), (40, 10)]:
        x, y, _ = _problem(n, d)
        eye = torch.eye(d, dtype=F64)
        direct = torch.stack(
            [torch.linalg.solve(x.T @ x + lam[k] * eye, x.T @ y[:, k]) for k in range(3)], -1
        )
        dual, primal = spectrum(x, y, mode="dual"), spectrum(x, y, mode="primal")
        assert spectrum(x, y).mode == ("dual" if n <= d else "primal")
        for sp in (dual, primal):
            torch.testing.assert_close(posterior_mean(sp, lam), direct, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(
            log_evidence(dual, lam), log_evidence(primal, lam), rtol=1e-10, atol=1e-10
        )
        torch.testing.assert_close(
            log_evidence(spectrum_from_gram(x @ x.T, y), lam),
            log_evidence(dual, lam),
            rtol=1e-10,
            atol=1e-10,
        )


@pytest.mark.parametrize("n,d", [(15, 25), (40, 10)])
def test_posterior_covariance_is_inverse_precision(n, d):
    """``V diag(1/(alpha + beta s)) V^T + (I - V V^T)/alpha`` = dense ``A^-1`` (dual, primal)."""
    x, y, _ = _problem(n, d)
    sp = spectrum(x, y)
    alpha = torch.tensor([0.5, 1.7, 3.0], dtype=F64)
    beta = torch.tensor([2.0, 20.0, 7.0], dtype=F64)
    cov = posterior_covariance(sp, alpha, beta)
    for k in range(3):
        a = alpha[k] * torch.eye(d, dtype=F64) + beta[k] * x.T @ x
        torch.testing.assert_close(cov[k], torch.linalg.inv(a), rtol=1e-8, atol=1e-10)


def test_zero_columns_leave_evidence_unchanged():
    """Checklist 8."""
    x, y, _ = _problem(40, 10)
    base = maximize_evidence(spectrum(x, y))
    padded = maximize_evidence(spectrum(torch.cat([x, torch.zeros(40, 50, dtype=F64)], 1), y))
    torch.testing.assert_close(padded.lam, base.lam, rtol=1e-7, atol=0)
    torch.testing.assert_close(padded.log_evidence, base.log_evidence, rtol=1e-10, atol=1e-10)


def test_ensemble_gram_additivity():
    """Checklist 9: F from summed Grams = F of the explicit concatenation."""
    x1, y, _ = _problem(30, 12, seed=1)
    x2, _, _ = _problem(30, 20, seed=2)
    lam = torch.tensor([0.3, 1.0, 2.0], dtype=F64)
    summed = spectrum_from_gram(x1 @ x1.T + x2 @ x2.T, y)
    explicit = spectrum(torch.cat([x1, x2], 1), y)
    torch.testing.assert_close(
        log_evidence(summed, lam), log_evidence(explicit, lam), rtol=1e-10, atol=1e-10
    )


def test_batched_over_backbones_equals_loop():
    """Checklist 10: K classes x M backbones in one call = the loop over single problems."""
    xs = [_problem(30, d, seed=s)[0] for s, d in [(1, 8), (2, 8), (3, 8)]]
    _, y, _ = _problem(30, 8)
    batched = maximize_evidence(spectrum(torch.stack(xs), y.expand(3, -1, -1)))
    for m, x in enumerate(xs):
        for k in range(3):
            single = maximize_evidence(spectrum(x, y[:, k : k + 1]))
            torch.testing.assert_close(batched.lam[m, k : k + 1], single.lam, rtol=1e-6, atol=0)
            torch.testing.assert_close(
                batched.log_evidence[m, k : k + 1], single.log_evidence, rtol=1e-10, atol=1e-10
            )


def test_degenerate_cases_are_finite_and_flagged():
    """Checklist 11: P = 1, all-zero target, N <= D interpolation, duplicate rows."""
    x, _, _ = _problem(12, 30)
    y = torch.zeros(12, 3, dtype=F64)
    y[0, 0] = 1  # a single positive
    y[:4, 2] = 1  # interpolation possible (N <= D), column 1 all zero
    x = torch.cat([x, x[:3]], 0)  # duplicate rows
    y = torch.cat([y, y[:3]], 0)
    with pytest.warns(RuntimeWarning, match="bound"):
        res = maximize_evidence(spectrum(x, y))
    assert torch.isfinite(res.log_evidence).all() and torch.isfinite(res.lam).all()
    assert res.at_boundary[0] and res.degenerate[1] and not res.degenerate[0]


def test_paper_counterexample_safeguards_keep_the_better_point():
    """Safeguards: the result is never below the grid maximum (design §3 caveat, N <= D)."""
    x, y, _ = _problem(25, 60, k=5, seed=4)
    with pytest.warns(RuntimeWarning, match="bound"):
        safe = maximize_evidence(spectrum(x, y))
    grid = evidence_curve(spectrum(x, y), torch.logspace(-8, 6, 600, dtype=F64))
    # F is flat as lambda -> 0 when y can be interpolated: within 1e-4 of the supremum,
    # and flagged when the supremum is not attained
    assert (safe.log_evidence >= grid.max(-1).values - 1e-4).all()
    lower_end = grid.argmax(-1) == 0
    assert lower_end.any() and (safe.at_boundary[lower_end]).all()


def _tasks(n_tasks=3, n=14, d=5, k=3, seed=3):
    """Informative one-vs-rest tasks ``x [T, N, D]``, ``y [T, N, K]`` (interior maxima)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n).expand(n_tasks, n) % k
    centres = torch.randn(n_tasks, k, d, generator=g, dtype=F64)
    x = centres.gather(1, labels.unsqueeze(-1).expand(-1, -1, d))
    x = x + 0.8 * torch.randn(n_tasks, n, d, generator=g, dtype=F64)
    return x, torch.nn.functional.one_hot(labels, k).to(F64)


def _dense_log_evidence(x, y, alpha, beta):
    """``sum_k log MVN(y_k | 0, I/beta_k + X X^T/alpha_k)`` per task, by brute force."""
    return torch.stack(
        [
            sum(
                _mvn_log_evidence(x[t], y[t, :, k], alpha[t, k], beta[t, k])
                for k in range(y.shape[-1])
            )
            for t in range(x.shape[0])
        ]
    )


class _OnTheDeclaration(EvidenceEngine):
    """The hand-written engine scored against the method's one Pyro declaration,
    :func:`~probfsl.derived.evidence.rotated_evidence_model` (data ``x``, ``y``, rotated
    as the derived engine rotates them): its lambda and beta are the declaration's
    ``pyro.param`` values and the guide is the exact q(z) at them, so Pyro's
    ``Trace_ELBO`` is the log evidence of the state's hyperparameters."""

    def point_estimates(self, state):
        if self.shared:  # one problem per task, its K targets sharing lambda
            return {"lam": state.lam[:, :1, None], "beta": state.beta[..., None]}
        return {"lam": state.lam.reshape(-1, 1, 1), "beta": state.beta.reshape(-1, 1, 1)}

    def guide(self, state):
        points = self.point_estimates(state)

        def guide(x, y):
            sigma, proj, _ = declared_data(rotate(x, y), self.lambda_mode)
            shrink = points["lam"] + sigma**2  # z_dk | y ~ Normal(sigma_d y~_dk / (lam + s_d), ...)
            loc, scale = sigma * proj / shrink, (points["beta"] * shrink).rsqrt()
            t, k, n = proj.shape
            with pyro.plate("tasks", t, dim=-3), pyro.plate("targets", k, dim=-2):
                with pyro.plate("coords", n, dim=-1):
                    pyro.sample("z", dist.Normal(loc, scale))

        return guide


def _declaration(mode):
    """:func:`rotated_evidence_model` on the engine's data ``x``, ``y``."""

    def model(x, y):
        sigma, proj, scale = declared_data(rotate(x, y), mode)
        rotated_evidence_model(sigma, proj, scale.reshape(-1, 1, 1))  # lambda: the estimate

    return model


@pytest.mark.parametrize("mode", ["shared", "per_class"])
def test_engine_conformance_exact_evidence(mode):
    """check_engine in production configuration (grid start, clamps): Pyro's Trace_ELBO of
    the method's declaration (rotated_evidence_model) with the exact q(z) at the engine's
    lambda and beta is the log evidence, which is the dense-MVN log evidence of each task
    at the state's hyperparameters; monotone, batch invariant, float32 ~ float64, devices
    follow, no host syncs in step."""
    x, y = _tasks()
    engine = EvidenceEngine(mode)
    state, _ = run(engine, engine.init(x, y), 15)
    exact = _dense_log_evidence(x, y, state.alpha, state.beta)
    torch.testing.assert_close(state.objective, exact, rtol=1e-10, atol=1e-10)
    if mode == "shared":
        assert (state.lam == state.lam[:, :1]).all()
    case = ConformanceCase(
        make_engine=lambda: _OnTheDeclaration(mode),
        model=_declaration(mode),
        data=(x, y),
        n_steps=15,
        exact_log_evidence=exact,
        max_plate_nesting=3,
        particles=64,
        repeats=3,
    )
    check_engine(case)


@pytest.mark.parametrize("mode", ["shared", "per_class"])
def test_engine_ascends_to_the_stationary_point_from_far(mode):
    """From lambda far from the optimum the evidence rises at every step (monotone by
    construction: the current lambda is a candidate) and strictly at the first; the run
    converges on the device to dG/dlambda = 0 (autograd of the summed eq. 17), the maximum
    of G on a dense grid."""
    x, y = _tasks(seed=4)
    engine = EvidenceEngine(mode, lam_init=1e-4)
    state, info = run(engine, engine.init(x, y), 200, tol=1e-15)
    trace = info.trace
    assert ((trace[1:] - trace[:-1]) >= -1e-12 * trace.abs().max()).all()
    assert (trace[1] > trace[0] + 1e-3).all()
    assert info.converged.all() and (info.n_steps < 200).all()
    sp = state.spectrum
    lam = state.lam.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(log_evidence(sp, lam).sum(), lam)
    if mode == "shared":
        grad = grad.sum(-1)  # dG/dlambda of the shared lambda
    assert (grad.abs() * state.lam[:, 0 if mode == "shared" else slice(None)] < 1e-6).all()
    grid = torch.logspace(-4, 4, 8001, dtype=F64)
    curve = evidence_curve(sp, grid)  # [T, K, G]
    best = curve.sum(-2).amax(-1) if mode == "shared" else curve.amax(-1).sum(-1)
    assert (state.objective >= best - 1e-9).all()


def test_shared_fixed_point_map_and_em_step():
    """At the maximiser of G the shared map and the EM step return lambda; away from it the
    EM step raises G (EM inequality) and the map moves lambda towards the maximiser."""
    x, y = _tasks(n_tasks=1)
    sp = spectrum(x[0], y[0])
    res = maximize_shared_evidence(sp)
    torch.testing.assert_close(shared_update(sp, res.lam), res.lam, rtol=1e-6, atol=0)
    torch.testing.assert_close(em_lambda(sp, res.lam, True), res.lam, rtol=1e-6, atol=0)
    for factor in (1e-2, 1e2):
        far = res.lam * factor
        g_far = log_evidence(sp, far).sum()
        assert log_evidence(sp, em_lambda(sp, far, True)).sum() > g_far
        moved = shared_update(sp, far)
        assert ((moved.log() - far.log()) * math.copysign(1, -math.log(factor)) > 0).all()


def test_estimator_fit_predict_and_multilabel():
    x, _, labels = _problem(90, 15, k=3, seed=5)
    model = EvidenceLSSVM(lambda_mode="per_class").fit_probe(x.numpy(), labels.numpy())
    assert model.coef_.shape == (3, 15) and model.log_evidence_.shape == (3,)
    assert (model.predict(x.numpy()) == labels.numpy()).mean() > 0.9
    # predict returns the type it was given: NumPy in, NumPy out; tensor in, tensor out
    assert isinstance(model.predict(x.numpy()), np.ndarray)
    assert torch.equal(model.predict(x), torch.as_tensor(model.predict(x.numpy())))
    proba = model.predict_proba(x)
    torch.testing.assert_close(proba.sum(-1), torch.ones(90, dtype=F64))
    assert model.total_log_evidence_ == pytest.approx(model.log_evidence_.sum().item())
    per = EvidenceLSSVM(score="mean_per_sample", lambda_mode="per_class").fit_probe(x, labels)
    assert per.total_log_evidence_ == pytest.approx(model.total_log_evidence_ / 90)
    ind = torch.nn.functional.one_hot(labels, 3)
    multi = EvidenceLSSVM(lambda_mode="per_class").fit_probe(x, ind)
    torch.testing.assert_close(multi.lambda_, model.lambda_)
    model32 = EvidenceLSSVM(dtype=torch.float32, lambda_mode="per_class").fit_probe(
        x.float(), labels
    )
    torch.testing.assert_close(model32.lambda_.double(), model.lambda_, rtol=1e-3, atol=0)


def test_rank_backbones_orders_by_evidence_and_greedy_rejects_noise():
    """Checklist 12 and the ranking."""
    g = torch.Generator().manual_seed(7)
    n, k = 60, 3
    labels = torch.arange(n) % k
    signal = torch.nn.functional.one_hot(labels, 16).to(F64) * 2 + 0.3 * torch.rand(
        n, 16, generator=g, dtype=F64
    )
    weak = torch.nn.functional.one_hot(labels, 16).to(F64) * 0.4 + torch.rand(
        n, 16, generator=g, dtype=F64
    )
    noise = torch.rand(n, 24, generator=g, dtype=F64)
    ranking = rank_backbones({"noise": noise, "signal": signal, "weak": weak}, labels)
    assert [b.name for b in ranking] == ["signal", "weak", "noise"]
    for b in ranking:
        model = EvidenceLSSVM(center=False, lambda_mode="per_class").fit_probe(
            {"noise": noise, "signal": signal, "weak": weak}[b.name], labels
        )
        assert b.log_evidence == pytest.approx(model.total_log_evidence_, rel=1e-9)
    ens = greedy_ensemble({"noise": noise, "signal": signal}, labels)
    assert ens.selected == ["signal"] and ens.accepted == [True, False]
    dup = greedy_ensemble({"a": signal, "b": signal.clone()}, labels, fit_model=False)
    assert dup.selected == ["a"] or abs(dup.trace[1] - dup.trace[0]) < 1e-6 * abs(dup.trace[0])


@pytest.mark.filterwarnings("ignore:evidence. lambda ended")
def test_episodic_path_matches_single_task_fit():
    from probfsl.data.builtin import load_dataset
    from probfsl.data.tasks import sample_episodes

    fs = load_dataset("omniglot")
    eps = sample_episodes(fs, n_tasks=6, way=5, shot=5, n_query=15, seed=0, dtype=F64)
    model = EvidenceLSSVM().fit_base(*fs.base(F64))
    proba = model.predict_proba(eps)
    assert proba.shape == (6, 15, 5)
    assert torch.isfinite(proba).all()
    lam_batch = model.last_lambda_.clone()
    single = EvidenceLSSVM().fit_base(*fs.base(F64))
    single.fit_probe(eps.support[2], eps.support_labels[2])
    torch.testing.assert_close(single.lambda_, lam_batch[2], rtol=1e-6, atol=0)
    scores = single.decision_function(eps.query[2])
    assert (scores.argmax(-1) == proba[2].argmax(-1)).all()
    acc = (proba.argmax(-1) == eps.query_labels).double().mean()
    assert acc > 0.6


@pytest.mark.parametrize(
    "features,labels,match",
    [
        (np.random.rand(10, 4), np.zeros(10, dtype=int), "two classes"),
        (np.random.rand(1, 4), np.array([0]), "single sample"),
        (np.ones((10, 4)), np.arange(10) % 2, "constant"),
        (np.full((10, 4), np.nan), np.arange(10) % 2, "NaN"),
        (np.random.rand(10, 4), np.arange(9) % 2, "labels must be"),
    ],
)
def test_bad_input_raises(features, labels, match):
    with pytest.raises(ValueError, match=match):
        EvidenceLSSVM().fit_probe(features, labels)


def test_rank_backbones_rejects_different_row_counts():
    with pytest.raises(ValueError, match="different row counts"):
        rank_backbones([np.random.rand(10, 4), np.random.rand(11, 4)], np.arange(10) % 2)


def test_diagnostics_datatree_and_plot(tmp_path):
    pytest.importorskip("arviz_base")
    x, _, labels = _problem(40, 6, seed=8)
    model = EvidenceLSSVM(lambda_mode="per_class").fit_probe(x, labels)
    from probfsl.models.evidence import evidence_datatree, plot_evidence

    tree = evidence_datatree(model, n_draws=400)
    w = tree["posterior"]["w"].values  # [chain, draw, class, feature]
    assert w.shape == (1, 400, 3, 6)
    np.testing.assert_allclose(w.mean((0, 1)), model.coef_.numpy(), atol=0.2)
    curve = tree["evidence_curve"]["log_evidence"].values
    assert (curve.max(-1) <= model.log_evidence_.numpy() + 1e-6).all()
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = plot_evidence(tree)
    assert len(ax.lines) == 6


def test_no_warning_on_well_posed_problem():
    x, y, _ = _problem(60, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        maximize_evidence(spectrum(x, y))


def test_shared_lambda_maximises_the_summed_evidence():
    x, y, labels = _problem(50, 12, k=4, seed=9)
    sp = spectrum(x, y)
    shared = maximize_shared_evidence(sp)
    assert (shared.lam == shared.lam[0]).all()
    grid = torch.logspace(-4, 3, 2000, dtype=F64)
    total = evidence_curve(sp, grid).sum(0)
    assert shared.log_evidence.sum() >= total.max() - 1e-8
    # per-class optimum is an upper bound for the shared one
    assert maximize_evidence(sp).log_evidence.sum() >= shared.log_evidence.sum() - 1e-9
    model = EvidenceLSSVM(center=False).fit_probe(x, labels)
    torch.testing.assert_close(model.lambda_, shared.lam)
    with pytest.raises(ValueError, match="lambda_mode"):
        EvidenceLSSVM(lambda_mode="global").fit_probe(x, labels)


@pytest.mark.parametrize("shared", [False, True])
def test_lambda_ends_at_a_stationary_point(shared):
    """Newton's polish leaves F' (in log lambda) at rounding where the fixed-point loop's
    stopping rule (a relative change of the evidence) stops short on flat maxima; its
    steps never lower the evidence, and they do move lambda (the check is not vacuous)."""
    x, y, _ = _problem(40, 15, k=4, seed=3)
    sp = spectrum(x, y)
    fit = maximize_shared_evidence if shared else maximize_evidence
    res = fit(sp)
    grad, curv = _slopes(sp, res.lam, shared)
    interior = ~res.at_boundary & ~res.degenerate
    assert interior.any()
    assert (grad.abs() <= 1e-7 * curv.abs().clamp_min(1.0))[
        interior[..., :1] if shared else interior
    ].all()
    rough = newton_polish(
        sp, res.lam * 1.01, res.lam * 1e-3, res.lam * 1e3, interior, shared, max_steps=0
    )
    polished = newton_polish(sp, rough, res.lam * 1e-3, res.lam * 1e3, interior, shared)
    assert torch.equal(rough, res.lam * 1.01)
    torch.testing.assert_close(polished, res.lam, rtol=1e-9, atol=0)
    after, before = log_evidence(sp, polished), log_evidence(sp, rough)
    if shared:  # the shared lambda maximises the sum over the classes
        after, before = after.sum(-1), before.sum(-1)
    assert (after >= before - 1e-12).all()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.filterwarnings("ignore:evidence. lambda ended")
def test_estimator_types_state_devices_and_compute_dtype():
    """Arrays in, arrays out; tensors in, tensors out (predict and predict_proba, features);
    predict_proba never changes the fitted state; every tensor made by fit and
    predict_proba follows the data's device; the compute dtype is recorded."""
    from probfsl.data.builtin import load_dataset
    from probfsl.data.tasks import sample_episodes

    x, _, labels = _problem(60, 8, k=3, seed=11)
    model = audit_devices(lambda: EvidenceLSSVM(center=False).fit_probe(x, labels))
    assert model.compute_dtype_ == F64
    assert EvidenceLSSVM(dtype=torch.float32).compute_dtype_ == torch.float32
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(model).items()}
    proba_np = model.predict_proba(x.numpy())
    proba_t = audit_devices(lambda: model.predict_proba(x))
    assert isinstance(proba_np, np.ndarray) and isinstance(proba_t, torch.Tensor)
    np.testing.assert_array_equal(proba_np, proba_t.numpy())
    assert isinstance(model.predict(x.numpy()), np.ndarray)
    assert isinstance(model.predict(x), torch.Tensor)
    assert np.array_equal(model.predict(x.numpy()), proba_np.argmax(-1))
    assert all(_same(state[k], v) for k, v in vars(model).items())

    fs = load_dataset("omniglot")
    for mode in ("shared", "per_class"):
        est = EvidenceLSSVM(lambda_mode=mode).fit_base(*fs.base())
        fitted = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in est.fitted_state().items()
        }
        for shot in (1, 5):
            eps = sample_episodes(fs, n_tasks=4, way=5, shot=shot, n_query=5, seed=shot)
            proba = audit_devices(lambda: est.predict_proba(eps))  # noqa: B023
            assert isinstance(proba, torch.Tensor) and proba.dtype == torch.float32
            assert isinstance(est.predict(eps), torch.Tensor)
            assert est.fitted_state().keys() == fitted.keys()
            assert all(_same(est.fitted_state()[k], v) for k, v in fitted.items())


@pytest.mark.filterwarnings("ignore:evidence. lambda ended")
def test_estimator_labels_agree_across_input_dtypes():
    """The float64 upcast (compute_dtype_) makes float32 and float64 episodes agree."""
    from probfsl.data.builtin import load_dataset
    from probfsl.data.tasks import sample_episodes

    fs = load_dataset("omniglot")
    labels = []
    for dtype in (torch.float32, F64):
        eps = sample_episodes(fs, n_tasks=30, way=5, shot=5, n_query=15, seed=9, dtype=dtype)
        proba = EvidenceLSSVM().fit_base(*fs.base(dtype)).predict_proba(eps)
        assert proba.dtype == dtype
        labels.append(proba.argmax(-1))
    assert torch.equal(labels[0], labels[1])
