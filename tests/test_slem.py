"""SLEM: the checklist of docs/design/slem.md §6, its Pyro model (the closed form
is its MAP and posterior mean) and the few-shot classifier.

SLEM is a closed form, outside the engine contract: no iterations, so the engine checks
about steps (monotone objective, ELBO of a guide, host syncs per step) do not apply."""

import numpy as np
import pytest
import torch
from pyro import poutine

from probfsl.inference.woodbury import (
    background_statistics,
    factor_negatives,
    lda_scores,
    slem_descriptors,
    slem_similarity,
    slem_woodbury,
)
from probfsl.models.slem import SLEM, SLEMEncoder, slem_model
from probfsl.testing import audit_devices

F64 = torch.float64


def slem_closed_form(x0, negatives, lam, theta=1.0):
    """Reference: the direct solve with ``U = A + theta/(theta+1) delta delta^T`` (design §3),
    one dense solve per exemplar, batched over leading dimensions."""
    mu, sigma = background_statistics(negatives)
    lam = torch.as_tensor(lam, dtype=x0.dtype)
    a = sigma + lam[..., None, None] * torch.eye(x0.shape[-1], dtype=x0.dtype)
    delta = x0 - mu.unsqueeze(-2)
    u = a.unsqueeze(-3) + theta / (theta + 1) * delta.unsqueeze(-1) * delta.unsqueeze(-2)
    omega = 2 * theta / (theta + 1) * torch.linalg.solve(u, delta)
    nu = (theta - 1) / (theta + 1) - ((theta * x0 + mu.unsqueeze(-2)) * omega).sum(-1) / (theta + 1)
    return omega, nu


def _log_joint(omega, nu, x0, neg, lam, theta):
    """Pyro's log joint of :func:`slem_model` at ``(omega, nu)``."""
    model = poutine.condition(slem_model, data={"omega": omega, "nu": nu})
    return poutine.trace(model).get_trace(x0, neg, lam, theta).log_prob_sum()


def _data(n=40, d=6, p=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    neg = torch.randn(n, d, generator=g, dtype=F64) @ torch.randn(d, d, generator=g, dtype=F64)
    pos = torch.randn(p, d, generator=g, dtype=F64) + 1.0
    return pos, neg


def _objective(omega, nu, x0, neg, lam, theta):
    loss = lambda y, yhat: 0.5 * (y - yhat) ** 2  # noqa: E731
    return (
        theta * loss(1.0, omega @ x0 + nu)
        + loss(-1.0, neg @ omega + nu).mean()
        + 0.5 * lam * omega @ omega
    )


@pytest.mark.parametrize("theta", [0.01, 1.0, 100.0])
def test_closed_form_equals_weighted_least_squares(theta):
    """Checklist 1 (lstsq on the sqrt-weighted system, unpenalised intercept) and 6 (gradient)."""
    pos, neg = _data()
    lam = 0.3
    n, d = neg.shape
    omega, nu = slem_closed_form(pos, neg, lam, theta)
    for p in range(pos.shape[0]):
        rows = torch.cat([pos[p : p + 1], neg], 0)
        design = torch.cat([rows, torch.ones(n + 1, 1, dtype=F64)], 1)
        weights = torch.cat(
            [torch.tensor([theta], dtype=F64), torch.full((n,), 1.0 / n, dtype=F64)]
        )
        targets = torch.cat([torch.ones(1, dtype=F64), -torch.ones(n, dtype=F64)])
        sw = weights.sqrt().unsqueeze(-1)
        # ridge on omega only: append sqrt(lam) I rows with a zero intercept column
        ridge = torch.cat([lam**0.5 * torch.eye(d, dtype=F64), torch.zeros(d, 1, dtype=F64)], 1)
        a = torch.cat([sw * design, ridge], 0)
        b = torch.cat([sw.squeeze(-1) * targets, torch.zeros(d, dtype=F64)])
        sol = torch.linalg.lstsq(a, b.unsqueeze(-1)).solution.squeeze(-1)
        torch.testing.assert_close(omega[p], sol[:d], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(nu[p], sol[d], rtol=1e-10, atol=1e-12)
        w = torch.cat([omega[p], nu[p : p + 1]]).clone().requires_grad_(True)
        _objective(w[:d], w[d], pos[p], neg, lam, theta).backward()
        assert w.grad.abs().max() < 1e-10


@pytest.mark.parametrize("theta", [0.01, 1.0, 100.0])
@pytest.mark.parametrize("dual", [False, True])
def test_woodbury_equals_direct_solve(theta, dual):
    """Checklist 2 and 5: Woodbury (primal and dual factor) = direct U solve, batched = loop."""
    pos, neg = _data(n=8 if dual else 40, d=12 if dual else 6)
    lam = 0.05
    factor = factor_negatives(neg, lam, dual=dual)
    assert factor.mode == ("dual" if dual else "primal")
    omega, nu = slem_woodbury(pos, factor, theta)
    ref_omega, ref_nu = slem_closed_form(pos, neg, lam, theta)
    torch.testing.assert_close(omega, ref_omega, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(nu, ref_nu, rtol=1e-9, atol=1e-11)
    for p in range(pos.shape[0]):
        single, _ = slem_woodbury(pos[p : p + 1], factor, theta)
        torch.testing.assert_close(single[0], omega[p], rtol=1e-12, atol=1e-14)


def test_batched_over_negative_sets():
    pos, neg = _data()
    pos2, neg2 = _data(seed=1)
    batched, _ = slem_closed_form(torch.stack([pos, pos2]), torch.stack([neg, neg2]), 0.2)
    torch.testing.assert_close(batched[1], slem_closed_form(pos2, neg2, 0.2)[0])


def test_theta_leaves_the_direction_unchanged():
    """Checklist 3."""
    pos, neg = _data()
    dirs = [
        torch.nn.functional.normalize(slem_closed_form(pos, neg, 0.1, t)[0], dim=-1)
        for t in (0.01, 1.0, 100.0)
    ]
    torch.testing.assert_close(dirs[0], dirs[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dirs[2], dirs[1], rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Only one sample")
def test_direction_equals_regularised_lda():
    """Checklist 4: lambda = 0 gives Sigma^-1 delta and sklearn's LDA(solver='lsqr') direction;
    lambda > 0 gives LDA with the covariance estimator Sigma + lambda I at lambda / pi_neg."""
    lda_mod = pytest.importorskip("sklearn.discriminant_analysis")
    pos, neg = _data(n=60)
    x0 = pos[:1]
    mu, sigma = background_statistics(neg)
    omega, _ = slem_closed_form(x0, neg, 0.0)
    ref = torch.linalg.solve(sigma, (x0 - mu)[0])
    cos = torch.nn.functional.cosine_similarity(omega[0], ref, dim=0)
    assert cos.item() == pytest.approx(1.0, abs=1e-12)
    xs = np.concatenate([x0.numpy(), neg.numpy()])
    ys = np.array([1] + [0] * neg.shape[0])
    coef = lda_mod.LinearDiscriminantAnalysis(solver="lsqr").fit(xs, ys).coef_[0]
    cos = np.dot(coef, omega[0].numpy()) / np.linalg.norm(coef) / omega[0].norm().item()
    assert cos == pytest.approx(1.0, abs=1e-9)

    lam = 0.5
    pi_neg = neg.shape[0] / (neg.shape[0] + 1)

    class RidgeCov:
        def fit(self, x):
            self.covariance_ = np.cov(x.T, bias=True) + lam * np.eye(x.shape[1])
            return self

    lda = lda_mod.LinearDiscriminantAnalysis(solver="lsqr", covariance_estimator=RidgeCov())
    coef = lda.fit(xs, ys).coef_[0]
    omega, _ = slem_closed_form(x0, neg, lam / pi_neg)
    cos = np.dot(coef, omega[0].numpy()) / np.linalg.norm(coef) / omega[0].norm().item()
    assert cos == pytest.approx(1.0, abs=1e-9)


def test_similarity_symmetric_unit_diagonal_and_shift_invariant():
    """Checklist 7."""
    pos, neg = _data(p=5)
    enc = SLEMEncoder(lam=0.1).fit(neg)
    sim = enc.similarity(pos)
    torch.testing.assert_close(sim, sim.T)
    torch.testing.assert_close(sim.diagonal(), torch.ones(5, dtype=F64))
    shift = torch.full((6,), 3.0, dtype=F64)
    shifted = SLEMEncoder(lam=0.1).fit(neg + shift).similarity(pos + shift)
    torch.testing.assert_close(shifted, sim, rtol=1e-9, atol=1e-11)
    desc = slem_descriptors(pos, enc.factor_)
    torch.testing.assert_close(slem_similarity(desc), sim)
    omega, nu = enc.exemplars(pos)
    torch.testing.assert_close(torch.nn.functional.normalize(omega, dim=-1), desc)


def test_large_lambda_is_nearest_class_mean():
    """Checklist 9: lambda -> infinity with LDA offsets = Euclidean nearest class mean."""
    g = torch.Generator().manual_seed(2)
    neg = torch.randn(50, 8, generator=g, dtype=F64)
    means = torch.randn(2, 5, 8, generator=g, dtype=F64)
    query = torch.randn(2, 30, 8, generator=g, dtype=F64)
    scores = lda_scores(query, means, factor_negatives(neg, 1e8))
    nearest = torch.cdist(query, means).argmin(-1)
    assert (scores.argmax(-1) == nearest).all()


def test_shared_covariance_classes_approach_bayes_rate():
    """Checklist 9: Gaussian classes with a shared covariance, large pool -> Bayes accuracy."""
    g = torch.Generator().manual_seed(3)
    d, k = 6, 4
    chol = torch.randn(d, d, generator=g, dtype=F64) * 0.5 + torch.eye(d, dtype=F64)
    centres = 1.5 * torch.randn(k, d, generator=g, dtype=F64)
    pool = torch.randn(4000, d, generator=g, dtype=F64) @ chol.T  # background: same covariance
    labels = torch.arange(2000) % k
    query = centres[labels] + torch.randn(2000, d, generator=g, dtype=F64) @ chol.T
    cov = chol @ chol.T
    bayes = lda_scores(query, centres, factor_negatives(pool * 0 + pool, 1e-9))
    precision = torch.linalg.inv(cov)
    exact = query @ precision @ centres.T - 0.5 * ((centres @ precision) * centres).sum(-1)
    agree = (bayes.argmax(-1) == exact.argmax(-1)).double().mean()
    assert agree > 0.97


def test_few_shot_classifier_on_builtin_data():
    from probfsl.data.builtin import load_dataset
    from probfsl.data.tasks import sample_episodes

    fs = load_dataset("omniglot")
    eps = sample_episodes(fs, n_tasks=20, way=5, shot=1, n_query=15, seed=0)
    model = SLEM().fit_base(*fs.base())
    proba = model.predict_proba(eps)
    assert proba.shape == (20, 15, 5) and proba.dtype == torch.float32
    torch.testing.assert_close(proba.sum(-1), torch.ones(20, 15))
    acc = (proba.argmax(-1) == eps.query_labels).double().mean()
    assert acc > 0.6
    with pytest.raises(ValueError, match="fit_base"):
        SLEM().predict_proba(eps)


def test_bad_input():
    with pytest.raises(ValueError, match="at least two"):
        factor_negatives(torch.randn(1, 4, dtype=F64), 0.1)
    factor = factor_negatives(torch.randn(5, 3, dtype=F64), 0.1)
    with pytest.raises(ValueError, match="NaN"):
        slem_woodbury(torch.full((1, 3), float("nan"), dtype=F64), factor)
    with pytest.raises(TypeError, match="float32 or float64"):
        slem_woodbury(torch.ones(1, 3, dtype=torch.long), factor)
    with pytest.raises(ValueError, match="lam"):
        factor_negatives(torch.randn(5, 3, dtype=F64), -1.0)


@pytest.mark.parametrize("theta", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("dual", [False, True])
def test_closed_form_is_the_map_of_the_pyro_model(theta, dual):
    """The gradient of the Pyro log joint at slem_woodbury's (omega, nu) is ~0 (float64) and
    every perturbation lowers the log joint: the closed form is the model's MAP."""
    pos, neg = _data(n=8 if dual else 40, d=12 if dual else 6, p=4)
    lam = 0.2
    omega, nu = slem_woodbury(pos, factor_negatives(neg, lam, dual=dual), theta)
    w = omega.clone().requires_grad_(True)
    b = nu.clone().requires_grad_(True)
    top = _log_joint(w, b, pos, neg, lam, theta)
    grad_w, grad_b = torch.autograd.grad(top, (w, b))
    scale = 1 + top.abs().item()
    assert grad_w.abs().max() < 1e-10 * scale and grad_b.abs().max() < 1e-10 * scale
    g = torch.Generator().manual_seed(5)
    for eps in (1e-3, 1e-1, 10.0):
        dw = eps * torch.randn(omega.shape, generator=g, dtype=F64)
        db = eps * torch.randn(nu.shape, generator=g, dtype=F64)
        with torch.no_grad():
            assert _log_joint(omega + dw, nu + db, pos, neg, lam, theta) < top
            assert _log_joint(omega + dw, nu, pos, neg, lam, theta) < top
            assert _log_joint(omega, nu + db, pos, neg, lam, theta) < top


def test_closed_form_is_the_conjugate_posterior_mean():
    """The log joint is quadratic in z = (omega, nu): the Gaussian posterior has precision
    H = -Hessian and mean z0 + H^-1 grad(z0) for any z0 (here 0), computed from the Pyro
    model by autograd; it equals the closed form, and its precision is positive definite."""
    pos, neg = _data(n=30, d=5, p=1)
    lam, theta = 0.3, 2.0
    d = pos.shape[-1]

    def log_joint(z):
        return _log_joint(z[:d].unsqueeze(0), z[d:], pos, neg, lam, theta)

    z0 = torch.zeros(d + 1, dtype=F64)
    hess = torch.autograd.functional.hessian(log_joint, z0)
    grad = torch.autograd.functional.jacobian(log_joint, z0)
    precision = -hess
    assert torch.linalg.eigvalsh(precision).min() > 0
    mean = z0 + torch.linalg.solve(precision, grad)
    omega, nu = slem_woodbury(pos, factor_negatives(neg, lam), theta)
    torch.testing.assert_close(mean[:d], omega[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mean[d], nu[0], rtol=1e-10, atol=1e-12)
    # the same Gaussian from a different expansion point: the log joint is exactly quadratic
    z1 = torch.randn(d + 1, generator=torch.Generator().manual_seed(1), dtype=F64)
    grad1 = torch.autograd.functional.jacobian(log_joint, z1)
    torch.testing.assert_close(z1 + torch.linalg.solve(precision, grad1), mean)


def test_model_batched_equals_single_exemplars():
    """The log joint of P exemplars in one plate is the sum of the single-exemplar ones."""
    pos, neg = _data(p=3)
    omega, nu = slem_woodbury(pos, factor_negatives(neg, 0.1))
    whole = _log_joint(omega, nu, pos, neg, 0.1, 1.0)
    parts = sum(
        _log_joint(omega[p : p + 1], nu[p : p + 1], pos[p : p + 1], neg, 0.1, 1.0) for p in range(3)
    )
    torch.testing.assert_close(whole, parts, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("dual", [False, True])
def test_closed_form_float32_agrees_with_float64(dual):
    pos, neg = _data(n=8 if dual else 40, d=12 if dual else 6)
    omega64, nu64 = slem_woodbury(pos, factor_negatives(neg, 0.5, dual=dual))
    omega32, nu32 = slem_woodbury(pos.float(), factor_negatives(neg.float(), 0.5, dual=dual))
    assert omega32.dtype == nu32.dtype == torch.float32
    torch.testing.assert_close(omega32.double(), omega64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(nu32.double(), nu64, rtol=1e-4, atol=1e-5)


def test_few_shot_labels_float32_agree_and_devices_follow():
    """float32 and float64 episodes give the same labels; every tensor predict_proba makes
    follows the data's device (meta as the default device catches one made without it)."""
    from probfsl.data.builtin import load_dataset
    from probfsl.data.tasks import sample_episodes

    fs = load_dataset("omniglot")
    labels = {}
    for dtype in (torch.float32, F64):
        eps = sample_episodes(fs, n_tasks=40, way=5, shot=5, n_query=15, seed=2, dtype=dtype)
        model = SLEM().fit_base(*fs.base(dtype))
        proba = audit_devices(lambda: model.predict_proba(eps))  # noqa: B023
        assert proba.dtype == dtype
        labels[dtype] = proba.argmax(-1)
    assert torch.equal(labels[torch.float32], labels[F64])
