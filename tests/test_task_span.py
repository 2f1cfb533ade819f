"""BAVARDAGE's task-span whitening (docs/design/bavardage.md §3.1) without large per-task
decompositions.

The whitened Gram matrix K = y y^T of :func:`task_span_whitening` is compared with a
brute-force construction (SVD basis of each task's span, eigendecomposition of
U_t^T S_w^{-1} U_t, one task at a time, float64), on tasks with N > 32 points, including
rank-deficient ones; and a recording ``TorchFunctionMode`` checks that the CUDA route
calls no eigh / QR / SVD on a batch of matrices larger than 32 x 32 (on CUDA those run
one matrix at a time).
"""

from __future__ import annotations

import functools
from unittest import mock

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import probfsl.models.bavardage as bavardage_module
from probfsl.data.loaders import from_arrays
from probfsl.data.tasks import sample_episodes
from probfsl.inference.eigh import matrix_sign, stable_eigh
from probfsl.inference.plda import task_span_whitening
from probfsl.models.bavardage import Bavardage
from probfsl.testing import audit_devices

F64 = torch.float64
ROUTES = ("eigh", "sign")


def _precision(d: int, seed: int = 0, dtype=F64) -> torch.Tensor:
    """S_w^{-1} for a random S_w with eigenvalues log-uniform in [1e-3, 1]."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))
    lam = 10 ** (-3 * torch.rand(d, generator=g, dtype=F64))
    return ((q / lam) @ q.T).to(dtype)


def _tasks(t: int = 6, n: int = 40, d: int = 64, seed: int = 1) -> torch.Tensor:
    """Unit rows [t, n, d]; for t > 2, task 1 repeats 10 of its points and task 2 lies
    in a 20-dim subspace (both rank-deficient with n < d)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g, dtype=F64)
    x[:, :10] += 2 * torch.randn(t, 1, d, generator=g, dtype=F64)  # a correlated cluster
    if t > 2:
        x[1, n - 10 :] = x[1, :10]
        x[2] = torch.randn(n, 20, generator=g, dtype=F64) @ torch.randn(
            20, d, generator=g, dtype=F64
        )
    return x / x.norm(dim=-1, keepdim=True)


def _reference(x: torch.Tensor, precision: torch.Tensor, s_max: float | None):
    """Brute force, one task at a time: U_t = the left singular vectors of x^T with
    nonzero singular values, P = U_t^T S_w^{-1} U_t = V diag(a) V^T, and
    K = (x U_t) V diag(min(a, s_max^2)) V^T (x U_t)^T; also the eigenvalues a."""
    grams, eigenvalues = [], []
    for xt in x:
        u, sv, _ = torch.linalg.svd(xt.T, full_matrices=False)
        u = u[:, sv > sv[0] * 1e-10]
        a, v = torch.linalg.eigh(u.T @ precision @ u)
        f = a if s_max is None else a.clamp_max(s_max**2)
        c = xt @ u @ v
        grams.append((c * f) @ c.T)
        eigenvalues.append(a)
    return torch.stack(grams), eigenvalues


def _gram(y: torch.Tensor) -> torch.Tensor:
    return y @ y.mT


def _assert_gram_close(k: torch.Tensor, k_ref: torch.Tensor, rtol: float) -> None:
    err = (k - k_ref).norm(dim=(1, 2)) / k_ref.norm(dim=(1, 2))
    assert err.max() < rtol, f"relative errors {err.tolist()}"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("s_max", [None, 8.0, 20.0])
def test_whitened_gram_equals_the_brute_force_construction(route, s_max):
    x, precision = _tasks(), _precision(64)
    k_ref, eigenvalues = _reference(x, precision, s_max)
    if s_max == 8.0:  # clamping splits every task's spectrum: the spectral function matters
        for a in eigenvalues:
            assert 0 < (a > s_max**2).double().mean() < 1
    y = task_span_whitening(x, precision, s_max, method=route)
    assert y.shape == (6, 40, 40) and y.dtype == F64
    _assert_gram_close(_gram(y), k_ref, 1e-9)


@pytest.mark.parametrize("route", ROUTES)
def test_an_eigenvalue_on_the_clamping_threshold(route):
    """s_max^2 equal to an eigenvalue of P (sign(0) in the sign route) changes nothing."""
    x, precision = _tasks(t=2), _precision(64)
    _, eigenvalues = _reference(x, precision, None)
    s_max = float(eigenvalues[0][5].sqrt())
    y = task_span_whitening(x, precision, s_max, method=route)
    assert torch.isfinite(y).all()
    _assert_gram_close(_gram(y), _reference(x, precision, s_max)[0], 1e-9)


@pytest.mark.parametrize("route", ROUTES)
def test_float32_follows_float64(route):
    x, precision = _tasks(), _precision(64)
    k64 = _gram(task_span_whitening(x, precision, 8.0, method=route))
    y32 = task_span_whitening(x.float(), precision.float(), 8.0, method=route)
    assert y32.dtype == torch.float32
    _assert_gram_close(_gram(y32).double(), k64, 2e-4)


@pytest.mark.parametrize("route", ROUTES)
def test_batched_equals_one_task_at_a_time(route):
    x, precision = _tasks(), _precision(64)
    k = _gram(task_span_whitening(x, precision, 8.0, method=route))
    alone = torch.cat(
        [_gram(task_span_whitening(x[i : i + 1], precision, 8.0, method=route)) for i in range(6)]
    )
    torch.testing.assert_close(k, alone, rtol=1e-11, atol=1e-11)


def test_routes_agree_and_auto_picks_eigh_on_the_cpu():
    x, precision = _tasks(), _precision(64)
    y_auto = task_span_whitening(x, precision, 8.0)
    torch.testing.assert_close(y_auto, task_span_whitening(x, precision, 8.0, method="eigh"))
    torch.testing.assert_close(
        _gram(y_auto), _gram(task_span_whitening(x, precision, 8.0, method="sign"))
    )


LARGE_S_MAX = (1e6, 1e9, 1e12, 1e200)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("s_max", LARGE_S_MAX)
def test_a_large_finite_s_max_is_the_unclamped_whitening(route, s_max):
    """s_max far above every scale (eq. 7; 1e9 is a common way to write "no clamp")
    gives the whitened Gram matrix of s_max=None, rank-deficient tasks included: the
    jitter's metric must not grow with s_max."""
    x, precision = _tasks(), _precision(64)
    k_none = _gram(task_span_whitening(x, precision, None, method=route))
    k = _gram(task_span_whitening(x, precision, s_max, method=route))
    _assert_gram_close(k, k_none, 1e-12)
    _assert_gram_close(k, _reference(x, precision, None)[0], 1e-9)


def _anisotropic_feature_set(dim=160, n_base=40, n_novel=20, per_class=20, seed=0):
    """Classes with a shared anisotropic within-class covariance (scales 1 to 0.03), means
    close enough (spread 0.5 of the scales) that a fair share of queries is ambiguous."""
    rng = np.random.default_rng(seed)
    rotation = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    scales = np.logspace(0, -1.5, dim)
    means = 0.5 * rng.standard_normal((n_base + n_novel, dim)) * scales
    labels = np.repeat(np.arange(n_base + n_novel), per_class)
    noise = rng.standard_normal((len(labels), dim)) * scales
    features = (means[labels] + noise) @ rotation.T + 2 * rng.standard_normal(dim)
    fields = dict(features=features, labels=labels)
    return from_arrays(fields, "synthetic", base_classes=range(n_base))


@pytest.mark.parametrize("route", ROUTES)
def test_bavardage_at_a_large_finite_s_max_predicts_as_unclamped(route):
    """BAVARDAGE's labels (and probabilities) with ``whitening="task_span"`` at s_max = 1e6,
    1e9, 1e12 equal those of s_max=None, float64, on 5-way 1-shot tasks of 80 points in
    160 dimensions (the span route, N < D); an ordinary clamp (s_max = 5) still changes them.
    """
    fs = _anisotropic_feature_set()
    episodes = sample_episodes(fs, 20, 5, 1, 75, balance="dirichlet", seed=0, dtype=F64)
    assert episodes.support.shape[1] + episodes.query.shape[1] < episodes.support.shape[-1]
    whitening = functools.partial(task_span_whitening, method=route)

    def predict(s_max):
        est = Bavardage(s_max=s_max).fit_base(*fs.base(F64))
        with mock.patch.object(bavardage_module, "task_span_whitening", whitening):
            return est.predict_proba(episodes)

    unclamped = predict(None)
    probs = {s_max: predict(s_max) for s_max in (1e6, 1e9, 1e12)}
    agreement = {
        s_max: float((p.argmax(-1) == unclamped.argmax(-1)).double().mean())
        for s_max, p in probs.items()
    }
    assert all(a == 1 for a in agreement.values()), f"label agreement {agreement}"
    for p in probs.values():
        torch.testing.assert_close(p, unclamped, atol=1e-9, rtol=0)
    clamped = predict(5.0)
    assert (clamped - unclamped).abs().max() > 1e-2


def test_n_at_least_d_is_the_global_whitening_of_the_whole_space():
    x, precision = _tasks(t=2, n=40, d=24), _precision(24)  # full rank D
    k_ref, _ = _reference(x, precision, 8.0)
    for route in ROUTES:
        y = task_span_whitening(x, precision, 8.0, method=route)
        _assert_gram_close(_gram(y), k_ref, 1e-9)


def test_basis_reproduces_the_rows():
    x, precision = _tasks(t=2), _precision(64)
    y, basis = task_span_whitening(x, precision, 8.0, return_basis=True)
    torch.testing.assert_close(y, x @ basis.span @ basis.rotation * basis.scales.unsqueeze(1))
    assert (basis.scales <= 8.0 + 1e-12).all()


def test_bad_input_raises_value_error():
    x, precision = _tasks(t=1), _precision(64)
    with pytest.raises(ValueError, match="method"):
        task_span_whitening(x, precision, 8.0, method="qr")
    with pytest.raises(ValueError, match="s_max"):
        task_span_whitening(x, precision, -1.0)
    with pytest.raises(ValueError, match="precision"):
        task_span_whitening(x, precision[:10, :10], 8.0)


def test_matrix_sign_against_the_eigendecomposition():
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(4, 50, 50, generator=g, dtype=F64))
    lam = torch.randn(4, 50, generator=g, dtype=F64) * 10 ** (4 * torch.rand(4, 50, generator=g))
    a = (q * lam.unsqueeze(1)) @ q.mT
    torch.testing.assert_close(matrix_sign(a), (q * lam.sign().unsqueeze(1)) @ q.mT)


# ------------------------------------------------------------------ the CUDA property
_DECOMPOSITIONS = {
    torch.linalg.eigh,
    torch.linalg.eigvalsh,
    torch.linalg.eig,
    torch.linalg.eigvals,
    torch.linalg.qr,
    torch.linalg.svd,
    torch.linalg.svdvals,
    torch.svd,
    torch.qr,
}


class DecompositionRecorder(TorchFunctionMode):
    """Records (name, shape) of every eigen / QR / SVD call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DECOMPOSITIONS:
            self.calls.append((func.__name__.removeprefix("linalg_"), tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))

    def large_batched(self) -> list[tuple[str, tuple[int, ...]]]:
        """Calls on a batch of matrices larger than 32 x 32: on CUDA one kernel per matrix.
        (A single large matrix, shared by all tasks, is one call.)"""
        return [(f, s) for f, s in self.calls if len(s) > 2 and max(s[-2:]) > 32]


def test_recorder_sees_a_large_batched_eigendecomposition():
    """The check below can fail: the old route's eigh of [T, 40, 40] is caught."""
    m = torch.randn(3, 40, 40, dtype=F64)
    with DecompositionRecorder() as rec:
        stable_eigh(m @ m.mT)
        torch.linalg.qr(torch.randn(3, 64, 40, dtype=F64))
    assert rec.large_batched() == [("eigh", (3, 40, 40)), ("qr", (3, 64, 40))]


@pytest.mark.parametrize("s_max", [None, 8.0])
def test_sign_route_has_no_large_batched_decomposition(s_max):
    x, precision = _tasks(t=4, n=80, d=128), _precision(128)
    with DecompositionRecorder() as rec:
        y = task_span_whitening(x, precision, s_max, method="sign")
    assert rec.large_batched() == [], rec.calls
    _assert_gram_close(_gram(y), _reference(x, precision, s_max)[0], 1e-9)


@pytest.mark.parametrize("route", ROUTES)
def test_tensors_follow_the_data_device(route):
    x, precision = _tasks(t=2), _precision(64)
    y = audit_devices(lambda: task_span_whitening(x, precision, 8.0, method=route))
    assert y.device.type == "cpu"
