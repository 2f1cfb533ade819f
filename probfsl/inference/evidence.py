"""Evidence maximisation for Bayesian linear regression (the Bayesian LS-SVM).

Kim, Jang, Han, Choi, "Learning to Select Pre-Trained Deep Representations with
Bayesian Evidence Framework", CVPR 2016 (docs/design/evidence.md).

Model, for each target column y (one per class, one-vs-rest 0/1 targets):
w ~ Normal(0, alpha^-1 I_D), y ~ Normal(X w, beta^-1 I_N), lambda = alpha / beta.

Everything is computed from one eigendecomposition of the smaller Gram matrix
(dual ``X X^T`` when N <= D, primal ``X^T X`` otherwise), shared by all targets:
with the thin SVD ``X = U diag(sigma) V^T``, ``s = sigma^2`` and the squared
projections ``c_dk = (u_d^T y_k)^2``,

* ``E(lambda) = ||y - X m||^2 + lambda ||m||^2 = E_0 + sum_d lambda c_d / (lambda + s_d)``
  where ``E_0`` is the least-squares residual (a sum of non-negative terms, which avoids
  the cancellation of the printed form ``y^T y - sum_d h_d^2 / (lambda + s_d)``,
  ``h_d^2 = s_d c_d``);
* the profile log evidence (eq. 17): ``F(lambda) = 1/2 sum_d log(lambda / (lambda + s_d))
  + N/2 log N - N/2 - N/2 log 2pi - N/2 log E(lambda)``;
* the fixed-point map of Algorithm 2 (with the factor N that the printed eq. 19 omits):
  ``f(lambda) = gamma(lambda) E(lambda) / (N Q(lambda))``, ``gamma = sum_d s_d/(lambda+s_d)``,
  ``Q = m^T m = sum_d h_d^2 / (lambda + s_d)^2``;
* Aitken's delta-squared acceleration (Algorithm 1).

**Engine contract.** The maximisation of the evidence over lambda is
:class:`EvidenceEngine` (init / step -> (state, info) / guide) driven by
:func:`~probfsl.inference.base.run`, for a lambda shared by the K targets of a task
(:func:`maximize_shared_evidence`, :class:`~probfsl.models.evidence.EvidenceLSSVM`'s
default) and for one lambda per target (:func:`maximize_evidence`, also behind
``rank_backbones`` and ``greedy_ensemble``). Outside the contract, on purpose:
``maximize_evidence(paper_exact=True)``, Algorithm 1 verbatim for reproducing the
paper (its stopping rule is on lambda and its unsafeguarded map is not monotone), and
the log-grid evaluations (:func:`grid_search`, :func:`evidence_curve`), which are closed
forms, not iterations.

All functions are batched: leading dimensions (backbones, tasks) on the features,
the trailing ``K`` dimension indexes targets (classes); hyperparameters are per
(batch, class). Zero eigenvalues contribute exactly zero to every expression, so
feature sets of different widths can be stacked after zero-padding their columns.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference.base import Engine, Info, RunInfo, run
from probfsl.inference.eigh import stable_eigh
from probfsl.inference.ops import aitken, clean_eigenvalues, gram_eigh
from probfsl.validation import as_float_tensor, check_choice, check_hyperparameter

LOG_2PI = math.log(2 * math.pi)
UPDATE_VARIANTS = ("algorithm2", "eq19", "mackay")


@dataclass
class Spectrum:
    """What the evidence needs from one decomposition of ``X`` (per batch element).

    Attributes:
        s: ``[..., r]`` non-zero eigenvalues of ``X X^T`` (exact zeros for null directions).
        c: ``[..., r, K]`` squared projections ``(u_d^T y_k)^2`` on the left singular vectors.
        e0: ``[..., K]`` least-squares residual ``||y - U U^T y||^2``.
        yy: ``[..., K]`` ``y^T y``.
        n: effective number of samples N (N - 1 with an intercept).
        dim: number of features D (used by the EM map and the posterior covariance).
        basis: ``[..., D, r]`` right singular vectors V (None when built from a Gram).
        proj: ``[..., r, K]`` ``u_d^T y_k`` (signed).
        mode: ``"dual"`` (eigh of the N x N Gram) or ``"primal"`` (D x D covariance).
    """

    s: torch.Tensor
    c: torch.Tensor
    e0: torch.Tensor
    yy: torch.Tensor
    n: int
    dim: int
    basis: torch.Tensor | None
    proj: torch.Tensor
    mode: str

    @property
    def mean_s(self) -> torch.Tensor:
        """``[...]`` mean of the non-zero eigenvalues (the scale of lambda)."""
        pos = self.s > 0
        return (self.s.sum(-1) / pos.sum(-1).clamp_min(1)).clamp_min(torch.finfo(self.s.dtype).tiny)


def _checked(
    x: torch.Tensor, y: torch.Tensor, name: str = "features"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., N, D]`` and targets ``y [..., N, K]`` checked by :mod:`probfsl.validation`
    (``TypeError`` for a non-float dtype, ``ValueError`` for NaN/inf or a shape mismatch)."""
    x = as_float_tensor(x, name)
    y = as_float_tensor(y, "targets")
    if x.ndim < 2:
        raise ValueError(f"{name} must be a [..., N, D] tensor, got shape {tuple(x.shape)}")
    if y.ndim != x.ndim or y.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"targets must be [..., N, K] matching {name} {tuple(x.shape)}, got {tuple(y.shape)}"
        )
    if x.shape[-2] < 2:
        raise ValueError(f"{name} need at least two samples, got N={x.shape[-2]}")
    return x, y


def spectrum(
    x: torch.Tensor,
    y: torch.Tensor,
    fit_intercept: bool = False,
    rel_tol: float = 1e-12,
    mode: str | None = None,
) -> Spectrum:
    """Decompose ``x [..., N, D]`` once and project the targets ``y [..., N, K]`` (design §3, §7).

    Uses ``eigh`` of the N x N Gram when N <= D (dual) and of the D x D covariance
    otherwise (primal); ``mode`` forces one. With ``fit_intercept`` X and y are centred
    and N becomes N - 1.
    Eigenvalues below ``rel_tol * max(s)`` are set to zero.
    """
    x, y = _checked(x, y)
    if mode not in (None, "dual", "primal"):
        raise ValueError(f"mode must be None, 'dual' or 'primal', got {mode!r}")
    y = y.to(x.dtype)
    n, d = x.shape[-2], x.shape[-1]
    if fit_intercept:
        x = x - x.mean(-2, keepdim=True)
        y = y - y.mean(-2, keepdim=True)
    if mode == "dual" or (mode is None and n <= d):
        s, u = gram_eigh(x, rel_tol)  # [..., N], [..., N, N]
        keep = s > 0
        proj = (u.mT @ y) * keep.unsqueeze(-1)  # u_d^T y
        sigma = s.sqrt()
        inv_sigma = torch.where(keep, 1 / sigma.clamp_min(torch.finfo(x.dtype).tiny), 0.0)
        basis = (x.mT @ u) * inv_sigma.unsqueeze(-2)  # V = X^T U / sigma
        resid = y - u @ proj
        e0 = (resid**2).sum(-2)
        mode = "dual"
    else:
        s, v = stable_eigh(x.mT @ x)  # [..., D], [..., D, D]
        s = clean_eigenvalues(s, rel_tol)
        keep = s > 0
        h = v.mT @ (x.mT @ y)  # h_d = sigma_d u_d^T y
        inv_sigma = torch.where(keep, 1 / s.sqrt().clamp_min(torch.finfo(x.dtype).tiny), 0.0)
        proj = h * inv_sigma.unsqueeze(-1)
        basis = v * keep.unsqueeze(-2)
        resid = y - x @ (basis @ (proj * inv_sigma.unsqueeze(-1)))
        e0 = (resid**2).sum(-2)
        mode = "primal"
    n_eff = n - 1 if fit_intercept else n
    return Spectrum(s, proj**2, e0, (y**2).sum(-2), n_eff, d, basis, proj, mode)


def spectrum_from_gram(
    gram: torch.Tensor, y: torch.Tensor, dim: int | None = None, rel_tol: float = 1e-12
) -> Spectrum:
    """A :class:`Spectrum` from Gram matrices ``X X^T`` ``[..., N, N]`` (no weights available).

    Used for ensembles, where the Gram of concatenated backbones is the sum of their Grams.
    """
    if gram.ndim < 2 or gram.shape[-1] != gram.shape[-2]:
        raise ValueError(f"gram must be [..., N, N], got {tuple(gram.shape)}")
    gram, y = _checked(gram, y, "gram")
    y = y.to(gram.dtype)
    s, u = stable_eigh(gram)
    s = clean_eigenvalues(s, rel_tol)
    proj = (u.mT @ y) * (s > 0).unsqueeze(-1)
    e0 = ((y - u @ proj) ** 2).sum(-2)
    n = gram.shape[-1]
    return Spectrum(s, proj**2, e0, (y**2).sum(-2), n, dim or n, None, proj, "dual")


def pool_spectra(sp: Spectrum) -> Spectrum:
    """One spectrum for the block-diagonal stack of a batch of problems ``[T, ...]``.

    Stacking T problems (episodes) with their own weights ``w_t ~ Normal(0, alpha^-1 I)``
    but shared hyperparameters gives one Bayesian linear regression whose Gram matrix is
    block diagonal: its eigenvalues are the union of the blocks' eigenvalues, its
    residual ``E_0`` and ``y^T y`` are the sums over the blocks, and N is the total number
    of rows. The log evidence of the pooled spectrum (Kim et al., CVPR 2016, eq. 14-17)
    is the sum of the blocks' log evidences at a common ``(alpha, beta_k)``, so
    :func:`maximize_shared_evidence` on it sets one lambda (and one ``beta_k`` per
    target) for all T problems. ``sp`` has one leading batch dimension ``[T, r]``,
    ``[T, r, K]``; the result is unbatched (``[T r]``, ``[T r, K]``, ``[K]``) and holds
    no weights.
    """
    if sp.s.ndim != 2:
        raise ValueError(f"pool_spectra needs one batch dimension [T, r], got {tuple(sp.s.shape)}")
    t, k = sp.s.shape[0], sp.c.shape[-1]
    return Spectrum(
        s=sp.s.reshape(-1),
        c=sp.c.reshape(-1, k),
        e0=sp.e0.sum(0),
        yy=sp.yy.sum(0),
        n=sp.n * t,
        dim=sp.dim * t,
        basis=None,
        proj=sp.proj.reshape(-1, k),
        mode=sp.mode,
    )


# ---------------------------------------------------------------------------------------
# Closed-form quantities as functions of lambda [..., K]


def _sl(sp: Spectrum, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast eigenvalues ``[..., r, 1]`` and lambda ``[..., 1, K]``."""
    return sp.s.unsqueeze(-1), lam.unsqueeze(-2)


def residual_energy(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """``E(lambda) = ||y - X m||^2 + lambda ||m||^2`` ``[..., K]`` (eq. 15), cancellation-free."""
    s, lm = _sl(sp, lam)
    return sp.e0 + (sp.c * lm / (lm + s)).sum(-2)


def effective_parameters(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """``gamma(lambda) = sum_d s_d / (lambda + s_d)`` ``[..., K]``."""
    s, lm = _sl(sp, lam)
    return (s / (lm + s)).sum(-2)


def weight_norm2(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """``Q(lambda) = m^T m = sum_d s_d c_d / (lambda + s_d)^2`` ``[..., K]``."""
    s, lm = _sl(sp, lam)
    return (s * sp.c / (lm + s) ** 2).sum(-2)


def _energy_floor(sp: Spectrum) -> torch.Tensor:
    return torch.finfo(sp.s.dtype).eps * sp.yy.clamp_min(1.0)


def log_evidence(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """Profile log evidence ``F(lambda)`` with ``beta = N / E(lambda)`` (eq. 16-17), ``[..., K]``.

    Equals ``log Normal(y | 0, beta^-1 I + alpha^-1 X X^T)`` at ``alpha = lambda beta``.
    """
    s, lm = _sl(sp, lam)
    n = sp.n
    energy = residual_energy(sp, lam).clamp_min(_energy_floor(sp))
    logdet = -torch.log1p(s / lm).sum(-2)
    return 0.5 * logdet + 0.5 * n * (math.log(n) - 1 - LOG_2PI) - 0.5 * n * energy.log()


def log_evidence_ab(sp: Spectrum, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Log evidence at any ``(alpha, beta)`` (spectral form, eq. 14), ``[..., K]``."""
    lam = alpha / beta
    s, lm = _sl(sp, lam)
    n = sp.n
    energy = residual_energy(sp, lam)
    logdet = -torch.log1p(s / lm).sum(-2)
    return 0.5 * logdet + 0.5 * n * (beta.log() - LOG_2PI) - 0.5 * beta * energy


def conditional_log_evidence(
    joint: Spectrum, support: Spectrum, alpha: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """``log p(y_q | y_s) = log p(y_s, y_q) - log p(y_s)`` at ``(alpha, beta)``, ``[..., K]``.

    ``joint`` is the spectrum of the support and query rows together, ``support`` that
    of the support rows alone (same batch shape and targets); each term is the log
    evidence of eq. 14 (Kim et al., CVPR 2016). The difference is the log density of
    the query targets under the posterior predictive of the regression fitted on the
    support, ``Normal(X_q m, beta^-1 (I + X_q (X_s^T X_s + lambda I)^-1 X_q^T))``: a
    held-out evidence, a density over the targets, so feature sets of different
    widths are compared on the same scale.
    """
    return log_evidence_ab(joint, alpha, beta) - log_evidence_ab(support, alpha, beta)


def profile_beta(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """``beta*(lambda) = N / E(lambda)`` (eq. 16)."""
    return sp.n / residual_energy(sp, lam).clamp_min(_energy_floor(sp))


def update(sp: Spectrum, lam: torch.Tensor, variant: str = "algorithm2") -> torch.Tensor:
    """One fixed-point map of lambda, ``[..., K]``.

    * ``"algorithm2"``: ``gamma E / (N Q)`` (Algorithm 2; the corrected eq. 19);
    * ``"eq19"``: ``gamma / (E Q)`` as printed in the paper (wrong; kept for the erratum test);
    * ``"mackay"``: ``gamma ||y - X m||^2 / ((N - gamma) Q)`` (MacKay, eq. 8-9; LogME).
    """
    gamma = effective_parameters(sp, lam)
    q = weight_norm2(sp, lam)
    energy = residual_energy(sp, lam)
    if variant == "algorithm2":
        return gamma * energy / (sp.n * q)
    if variant == "eq19":
        return gamma / (energy * q)
    if variant == "mackay":
        return gamma * (energy - lam * q) / ((sp.n - gamma) * q)
    raise ValueError(f"variant must be one of {UPDATE_VARIANTS}, got {variant!r}")


def em_update(
    sp: Spectrum, alpha: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """EM map of (alpha, beta) (eq. 11-12): never decreases the log evidence."""
    lam = alpha / beta
    s, a, b = sp.s.unsqueeze(-1), alpha.unsqueeze(-2), beta.unsqueeze(-2)
    q = weight_norm2(sp, lam)
    rss = residual_energy(sp, lam) - lam * q
    n_zero = (sp.s == 0).sum(-1, keepdim=True)
    n_pos = sp.s.shape[-1] - n_zero
    # zero entries of s contribute 1/alpha each to the first sum: replace them by the
    # D - r directions of the null space of X.
    tr_ainv = (1 / (a + b * s)).sum(-2) + (sp.dim - n_pos - n_zero) / alpha
    tr_xx = (s / (a + b * s)).sum(-2)
    return sp.dim / (q + tr_ainv), sp.n / (rss + tr_xx)


def posterior_mean(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """Weights ``m = (X^T X + lambda I)^-1 X^T y = V diag(sigma/(s+lambda)) U^T y``, [..., D, K]."""
    if sp.basis is None:
        raise ValueError("this spectrum was built from Gram matrices: it holds no weights")
    s, lm = _sl(sp, lam)
    return sp.basis @ (sp.proj * s.sqrt() / (lm + s))


def at_upper_limit(sp: Spectrum, res: EvidenceResult) -> torch.Tensor:
    """``[...]`` whether every target of a batch element has its lambda at the upper bound.

    There the profile evidence still rises as lambda -> infinity (e.g. one positive per
    one-vs-rest target, N <= D: Kim et al., CVPR 2016, eq. 17 has no finite maximiser)
    and the posterior mean is the vanishing ``X^T y / lambda`` (see :func:`decision_weights`).
    """
    upper = res.at_boundary & (res.lam > sp.mean_s.unsqueeze(-1))
    return upper.all(-1)


def decision_weights(
    sp: Spectrum, lam: torch.Tensor, limit: torch.Tensor | None = None
) -> torch.Tensor:
    """Scoring weights ``[..., D, K]``: the posterior mean m(lambda) (:func:`posterior_mean`),
    and for batch elements with ``limit`` (``[...]`` bool) its lambda -> infinity direction

        lim lambda m(lambda) / mean(s) = X^T y / mean(s) = V diag(sigma) U^T y / mean(s),

    which ranks a query x by x^T X^T y_k, the inner product with the sum of the rows of
    class k: the nearest class mean. It is computed without lambda, so it does not
    depend on where the clamp put lambda nor on rounding of scores of size 1/lambda.
    """
    if sp.basis is None:
        raise ValueError("this spectrum was built from Gram matrices: it holds no weights")
    s, lm = _sl(sp, lam)
    coef = s.sqrt() / (lm + s)
    if limit is not None:
        at_limit = s.sqrt() / sp.mean_s[..., None, None]
        coef = torch.where(limit[..., None, None], at_limit, coef)
    return sp.basis @ (sp.proj * coef)


def posterior_covariance(sp: Spectrum, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``A^-1 = V diag(1/(alpha + beta s)) V^T + (I - V V^T) / alpha``, ``[..., K, D, D]``."""
    if sp.basis is None:
        raise ValueError("this spectrum was built from Gram matrices: it holds no weights")
    v = sp.basis.unsqueeze(-3)  # [..., 1, D, r]
    a = alpha[..., :, None, None]
    inner = 1 / (alpha.unsqueeze(-1) + beta.unsqueeze(-1) * sp.s.unsqueeze(-2))  # [..., K, r]
    eye = torch.eye(sp.dim, dtype=sp.s.dtype, device=sp.s.device)
    vvt = v @ v.mT
    return (v * inner.unsqueeze(-2)) @ v.mT + (eye - vvt) / a


def _log_evidence_grid(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """``F`` for lambdas ``[..., K, G]`` at once (vectorised eq. 17), ``[..., K, G]``."""
    s = sp.s[..., :, None, None]  # [..., r, 1, 1]
    lm = lam.unsqueeze(-3)  # [..., 1, K, G]
    energy = sp.e0.unsqueeze(-1) + (sp.c.unsqueeze(-1) * lm / (lm + s)).sum(-3)
    energy = energy.clamp_min(_energy_floor(sp).unsqueeze(-1))
    logdet = -torch.log1p(s / lm).sum(-3)
    n = sp.n
    return 0.5 * logdet + 0.5 * n * (math.log(n) - 1 - LOG_2PI) - 0.5 * n * energy.log()


def evidence_curve(sp: Spectrum, lams: torch.Tensor) -> torch.Tensor:
    """``F`` on a grid of lambdas ``[G]`` for every target: ``[..., K, G]``."""
    grid = lams.to(dtype=sp.s.dtype, device=sp.s.device)
    return _log_evidence_grid(sp, grid.expand(*sp.yy.shape, grid.shape[-1]))


# ---------------------------------------------------------------------------------------
# Maximisation


@dataclass
class EvidenceResult:
    """Per (batch, class) result of :func:`maximize_evidence`; all fields ``[..., K]``."""

    lam: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    log_evidence: torch.Tensor
    n_iter: torch.Tensor
    converged: torch.Tensor
    at_boundary: torch.Tensor
    degenerate: torch.Tensor


def grid_search(
    sp: Spectrum, n_grid: int = 64, span: tuple[float, float] = (1e-6, 1e6)
) -> torch.Tensor:
    """Argmax of ``F`` over a log grid ``span x mean(s)`` (design §4 safeguard), ``[..., K]``."""
    unit = torch.logspace(
        math.log10(span[0]), math.log10(span[1]), n_grid, dtype=sp.s.dtype, device=sp.s.device
    )
    scale = sp.mean_s[..., None, None]  # [..., 1, 1]
    grid = (scale * unit).expand(*sp.yy.shape, n_grid)  # [..., K, G]
    values = _log_evidence_grid(sp, grid)
    best = values.argmax(-1, keepdim=True)
    return torch.gather(grid, -1, best).squeeze(-1)


def maximize_evidence(
    sp: Spectrum,
    lam_init: float | torch.Tensor = 1.0,
    accelerate: bool = True,
    variant: str = "algorithm2",
    paper_exact: bool = False,
    eps: float = 1e-5,
    max_iter: int = 500,
    n_grid: int = 64,
    grid_span: tuple[float, float] = (1e-6, 1e6),
    clamp: tuple[float, float] = (1e-10, 1e10),
    warn: bool = True,
    tol: float | None = None,
) -> EvidenceResult:
    """Maximise the profile evidence over lambda for every (batch, class) at once.

    By default the safeguarded version (design §4) of the paper's Algorithm 1:
    :class:`EvidenceEngine` (``"per_class"``) driven by
    :func:`~probfsl.inference.base.run`: start from the argmax of ``F`` on a
    ``n_grid``-point log grid spanning ``grid_span x mean(s)``; each step takes the best
    of {Aitken's delta-squared step of the map, one map, two maps, EM step, current
    lambda}, clamped to ``clamp x mean(s)``, so the evidence never decreases; a batch
    element stops when its summed evidence moves by less than ``tol`` (relative;
    default 16 machine epsilons) or after ``max_iter`` steps. ``at_boundary`` is flagged
    (with a warning) when the final lambda sits on a clamp or F still rises 100x further
    out (no finite maximiser, e.g. a single positive).

    ``paper_exact=True`` runs Algorithm 1 exactly as published instead: from
    ``lam_init``, no safeguards, stopping when ``|lambda - lambda_0| < eps`` (absolute)
    for each element. It is outside the engine contract on purpose: it reproduces the
    paper (its stopping rule is on lambda, and its unsafeguarded map need not increase
    the evidence), is no default of any estimator, and checks the host once per step.

    ``accelerate=False`` iterates the plain map instead of Aitken's step.
    """
    if variant not in UPDATE_VARIANTS:
        raise ValueError(f"variant must be one of {UPDATE_VARIANTS}, got {variant!r}")
    shape = sp.yy.shape
    dtype, device = sp.s.dtype, sp.s.device
    degenerate = (sp.yy <= 0) | (weight_norm2(sp, sp.mean_s.unsqueeze(-1).expand(shape)) <= 0)
    if not paper_exact:
        engine = EvidenceEngine(
            "per_class", n_grid=n_grid, grid_span=grid_span, clamp=clamp,
            accelerate=accelerate, variant=variant,
        )  # fmt: skip
        tol = 16 * torch.finfo(dtype).eps if tol is None else tol
        state, info = run(engine, engine.init_spectrum(_flat(sp)), max_iter, tol)
        res = engine.result(state, info)
        lam = torch.where(degenerate, state.hi.reshape(shape), res.lam.reshape(shape))
        lo, hi = state.lo.reshape(shape), state.hi.reshape(shape)
        # not where the evidence still rises as lambda -> infinity (no stationary point)
        rising = res.at_boundary.reshape(shape) & (lam > sp.mean_s.unsqueeze(-1))
        lam = newton_polish(sp, lam, lo, hi, ~rising & ~degenerate, shared=False)
        f_hat = log_evidence(sp, lam)
        # F still rising further out (flat supremum at lambda -> 0 or infinity): no maximiser
        beyond = (log_evidence(sp, lam * 1e-2) > f_hat) | (log_evidence(sp, lam * 1e2) > f_hat)
        at_clamp = (lam <= lo * (1 + 1e-9)) | (lam >= hi * (1 - 1e-9))
        # the grid argmax at an end of the span: F rises beyond it (res.at_boundary)
        at_boundary = (res.at_boundary.reshape(shape) | at_clamp | beyond) & ~degenerate
        n_iter = res.n_iter.reshape(shape)
        converged = res.converged.reshape(shape) & ~degenerate
    else:
        lam = torch.as_tensor(lam_init, dtype=dtype, device=device).expand(shape).clone()
        done = degenerate.clone()
        n_iter = torch.zeros(shape, dtype=torch.long, device=device)
        for _ in range(max_iter):
            if bool(done.all()):
                break
            l1 = update(sp, lam, variant)
            new = aitken(lam, l1, update(sp, l1, variant), positive=True) if accelerate else l1
            new = torch.where(done, lam, new)
            n_iter = n_iter + (~done).long()
            stop = ((new - lam).abs() < eps) | ~torch.isfinite(new)
            lam = new
            done = done | stop
        converged = done & ~degenerate & torch.isfinite(lam)
        at_boundary = ~torch.isfinite(lam) | (lam <= 0)
    if warn and bool((at_boundary & ~degenerate).any()):
        warnings.warn(
            f"evidence: lambda ended at a bound for {int((at_boundary & ~degenerate).sum())} of "
            f"{at_boundary.numel()} targets (no finite maximiser: e.g. a single positive, or exact "
            "interpolation with N <= D)",
            RuntimeWarning,
            stacklevel=2,
        )
    beta = profile_beta(sp, lam)
    return EvidenceResult(
        lam=lam,
        alpha=lam * beta,
        beta=beta,
        log_evidence=log_evidence(sp, lam),
        n_iter=n_iter,
        converged=converged,
        at_boundary=at_boundary,
        degenerate=degenerate,
    )


def shared_update(sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
    """Fixed-point map of a lambda shared by the K targets, ``[..., K]`` (equal along K).

    Each target keeps its profile ``beta_k = N / E_k``; the summed profile evidence
    ``G = sum_k F_k`` has ``dG/dlambda = sum_k [gamma / (2 lambda) - N Q_k / (2 E_k)]``
    (differentiating eq. 17: ``dE_k/dlambda = Q_k``), zero at

        lambda = gamma(lambda) / (N mean_k(Q_k(lambda) / E_k(lambda))),

    MacKay's fixed point with ``beta_k Q_k = N Q_k / E_k`` averaged over the targets;
    for K = 1 it is Algorithm 2's ``gamma E / (N Q)``. ``lam`` must be equal along K.
    """
    gamma = effective_parameters(sp, lam)
    energy = residual_energy(sp, lam).clamp_min(_energy_floor(sp))
    ratio = weight_norm2(sp, lam) / energy
    new = gamma.mean(-1, keepdim=True) / (sp.n * ratio.mean(-1, keepdim=True))
    return new.expand_as(lam)


def em_lambda(sp: Spectrum, lam: torch.Tensor, shared: bool) -> torch.Tensor:
    """The conditional-maximisation (EM) step of lambda at the profile betas, ``[..., K]``.

    E-step: ``w_k | y ~ Normal(m_k, (beta_k (lambda I + X^T X))^-1)`` with
    ``beta_k = N / E_k(lambda)``; M-step in lambda with the betas fixed, for the prior
    ``w_k ~ Normal(0, (lambda beta_k)^-1 I_D)``:
    ``lambda' = D / (beta_k E||w_k||^2) = D / (beta_k Q_k + t)`` per target, and
    ``D / (mean_k beta_k Q_k + t)`` for a shared lambda, where
    ``t = tr((lambda I + X^T X)^-1) = sum_d 1/(lambda + s_d) + (D - r)/lambda``. The
    expected complete log likelihood increases, so the log evidence at (lambda', beta)
    does, and the profile evidence ``G(lambda') >= G(lambda)`` (EM inequality).
    """
    s, lm = _sl(sp, lam)
    trace = (1 / (lm + s)).sum(-2) + (sp.dim - sp.s.shape[-1]) / lam
    bq = profile_beta(sp, lam) * weight_norm2(sp, lam)
    if shared:
        bq = bq.mean(-1, keepdim=True).expand_as(lam)
    return sp.dim / (bq + trace)


def _flat(sp: Spectrum) -> Spectrum:
    """``sp`` with its batch dimensions flattened into one leading task dimension."""

    def f(t: torch.Tensor | None, tail: int) -> torch.Tensor | None:
        return None if t is None else t.reshape(-1, *t.shape[t.ndim - tail :])

    return Spectrum(
        f(sp.s, 1), f(sp.c, 2), f(sp.e0, 1), f(sp.yy, 1), sp.n, sp.dim,
        f(sp.basis, 2), f(sp.proj, 2), sp.mode,
    )  # fmt: skip


def _slopes(sp: Spectrum, lam: torch.Tensor, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """First and second derivatives of ``F`` (:func:`log_evidence`, summed over the
    targets when ``shared``) in ``u = log lambda``. With ``a_d = lambda / (lambda + s_d)``,
    ``b_d = 1 - a_d`` (``da/du = a b``) and ``E = e0 + sum_d c_d a_d`` (eq. 15):
    ``F' = 1/2 sum_d b_d - N/2 E'/E`` (zero at eq. 19's fixed point, ``E' = lambda Q``)
    and ``F'' = -1/2 sum_d a_d b_d - N/2 (E''/E - (E'/E)^2)``."""
    s, lm = _sl(sp, lam)
    a, b = lm / (lm + s), s / (lm + s)  # [..., r, K]
    ab = a * b
    energy = residual_energy(sp, lam).clamp_min(_energy_floor(sp))
    e1 = (sp.c * ab).sum(-2) / energy
    e2 = (sp.c * ab * (b - a)).sum(-2) / energy
    grad = 0.5 * b.sum(-2) - 0.5 * sp.n * e1
    curv = -0.5 * ab.sum(-2) - 0.5 * sp.n * (e2 - e1**2)
    if shared:
        return grad.sum(-1, keepdim=True), curv.sum(-1, keepdim=True)
    return grad, curv


#: step lengths tried along the Newton direction, in units of the Newton step: halvings
#: (backtracking) and doublings (the steady crawl towards a finite limit at lambda -> 0 or
#: infinity, where the Newton step in log lambda stays of order one)
NEWTON_FACTORS = tuple(2.0**j for j in range(-12, 7))


def _newton_step(
    sp: Spectrum,
    lam: torch.Tensor,
    value: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    shared: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One safeguarded Newton step on ``log lambda`` of the profile evidence ``value`` at
    ``lam [..., K]`` (clamped to ``[lo, hi]``): the new ``lam`` and its value.

    Direction ``-F'/F''`` where ``F'' < 0``, one log unit uphill otherwise. Of the step
    lengths :data:`NEWTON_FACTORS`: the full step when it does not lower the evidence,
    lengthened while each doubling raises it; otherwise the longest shorter step that
    does not lower it; otherwise no move. The full step is also taken where its predicted
    rise ``-F'^2 / (2 F'')`` is below the rounding of ``F``, where comparing evidences
    cannot decide and the local quadratic model does. No host synchronisation.
    """
    factors = torch.tensor(NEWTON_FACTORS, dtype=lam.dtype, device=lam.device)
    unit = NEWTON_FACTORS.index(1.0)
    grad, curv = _slopes(sp, lam, shared)
    grad, curv = grad.expand_as(lam), curv.expand_as(lam)
    newton = torch.where(curv < 0, -grad / curv, grad.sign())
    newton = torch.where(torch.isfinite(newton), newton, torch.zeros_like(newton))
    tries = (lam.log() + newton * factors.reshape(-1, *[1] * lam.dim())).exp()
    tries = torch.maximum(torch.minimum(tries, hi), lo)  # [C, ..., K]
    vals = torch.stack([_profile_value(sp, t, shared) for t in tries])
    vals = torch.where(torch.isfinite(vals), vals, -math.inf)
    rises = (vals[unit + 1 :] > vals[unit:-1]).long().cumprod(0).sum(0)
    ok = vals[: unit + 1] >= value
    rise = -0.5 * grad * newton
    blind = (curv < 0) & (rise <= 64 * torch.finfo(lam.dtype).eps * value.abs().clamp_min(1.0))
    ok[unit] |= blind & torch.isfinite(vals[unit])
    index = torch.arange(unit + 1, device=lam.device).reshape(-1, *[1] * lam.dim())
    shorter = torch.where(ok, index, -1).amax(0)
    pick = torch.where(ok[unit], unit + rises, shorter)
    moved = pick >= 0
    pick = pick.clamp_min(0).unsqueeze(0)
    new_lam = torch.where(moved, tries.gather(0, pick).squeeze(0), lam)
    new_val = torch.where(moved, vals.gather(0, pick).squeeze(0), value)
    return new_lam, new_val


def _profile_value(sp: Spectrum, lam: torch.Tensor, shared: bool) -> torch.Tensor:
    """``F(lambda)`` per target, or its sum over the targets (kept along them) when
    ``shared``."""
    f = log_evidence(sp, lam)
    return f.sum(-1, keepdim=True).expand_as(f) if shared else f


def newton_polish(
    sp: Spectrum,
    lam: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    active: torch.Tensor,
    shared: bool,
    max_steps: int = 64,
    check_every: int = 4,
) -> torch.Tensor:
    """``lam [..., K]`` moved by safeguarded Newton steps on ``log lambda``
    (:func:`_newton_step`) to the stationary point of the profile evidence (eq. 17-19)
    where ``active``, clamped to ``[lo, hi]``; with ``shared`` one lambda per batch element
    maximises the summed evidence.

    A fixed-point loop that stops once the evidence moves by less than its tolerance
    leaves lambda about 1e-6 (relative) short of ``F' = 0`` on a flat maximum; Newton's
    steps converge there quadratically. Every ``check_every`` steps one host
    synchronisation asks whether any lambda still moves by more than ``sqrt(eps)``
    (relative); the loop ends when none does, or after ``max_steps``. The evidence never
    decreases beyond rounding.
    """
    rtol = torch.finfo(lam.dtype).eps ** 0.5
    lam = torch.where(active, lam.clamp(lo, hi), lam)
    value = _profile_value(sp, lam, shared)
    value = torch.where(torch.isfinite(value), value, -math.inf)
    for i in range(max_steps):
        new, new_value = _newton_step(sp, lam, value, lo, hi, shared)
        new = torch.where(active, new, lam)
        value = torch.where(active, new_value, value)
        moving = (new - lam).abs() > rtol * lam
        lam = new
        if (i + 1) % check_every == 0 and not bool(moving.any()):
            break
    return lam


def solve_evidence(
    sp: Spectrum,
    lambda_mode: str = "shared",
    lam_init: float | torch.Tensor = 1.0,
    accelerate: bool = True,
    paper_exact: bool = False,
    warn: bool = True,
) -> EvidenceResult:
    """The hand-written engine's fit of ``sp`` as the estimator's ``lambda_mode`` asks:
    :func:`maximize_shared_evidence` (``"shared"``: one lambda per batch element) or
    :func:`maximize_evidence` (``"per_class"``: one per target, with ``lam_init``,
    ``accelerate``, ``paper_exact`` and ``warn``)."""
    if lambda_mode == "shared":
        return maximize_shared_evidence(sp)
    return maximize_evidence(
        sp, lam_init=lam_init, accelerate=accelerate, paper_exact=paper_exact, warn=warn
    )


def maximize_shared_evidence(
    sp: Spectrum,
    n_grid: int = 64,
    grid_span: tuple[float, float] = (1e-6, 1e6),
    clamp: tuple[float, float] = (1e-10, 1e10),
    max_iter: int = 200,
    tol: float | None = None,
) -> EvidenceResult:
    """One lambda per batch element shared by its K targets, maximising ``G = sum_k F_k``.

    Each target keeps its own profile ``beta_k = N / E_k(lambda)``. A library option,
    not in the paper: per-class lambdas can differ by orders of magnitude, which puts
    the one-vs-rest scores on different scales. :class:`EvidenceEngine` (``"shared"``)
    driven by :func:`~probfsl.inference.base.run`: start at the argmax of ``G`` on an
    ``n_grid``-point log grid over ``grid_span x mean(s)``, then safeguarded fixed-point
    steps until ``G`` moves by less than ``tol`` (relative; default 16 machine epsilons
    of the spectrum's dtype) or ``max_iter`` steps. ``at_boundary`` marks a grid argmax
    at either end of the span (no finite maximiser inside it: e.g. 1-shot tasks, where
    ``G`` rises to its supremum as lambda -> infinity) or a lambda on a clamp.
    """
    batch = sp.yy.shape
    flat = _flat(sp)
    engine = EvidenceEngine("shared", n_grid=n_grid, grid_span=grid_span, clamp=clamp)
    tol = 16 * torch.finfo(sp.s.dtype).eps if tol is None else tol
    state, info = run(engine, engine.init_spectrum(flat), max_iter, tol)
    res = engine.result(state, info)
    out = EvidenceResult(*(getattr(res, f.name).reshape(batch) for f in fields(res)))
    rising = out.at_boundary & (out.lam > sp.mean_s.unsqueeze(-1))
    lo, hi = state.lo.reshape(batch), state.hi.reshape(batch)
    lam = newton_polish(sp, out.lam, lo, hi, ~rising & ~out.degenerate, shared=True)
    # the polish may end on a clamp (G flat to rounding up to it: the lambda -> infinity
    # limit of a grid argmax inside the span)
    at_clamp = (lam <= lo * (1 + 1e-9)) | (lam >= hi * (1 - 1e-9))
    at_boundary = out.at_boundary | (at_clamp & ~out.degenerate)
    beta = profile_beta(sp, lam)
    return replace(
        out,
        lam=lam,
        alpha=lam * beta,
        beta=beta,
        log_evidence=log_evidence(sp, lam),
        at_boundary=at_boundary,
    )


# ---------------------------------------------------------------------------------------
# Engine for the model/guide contract

LAMBDA_MODES = ("shared", "per_class")


@dataclass
class EvidenceState:
    """Type-II ML state of a batch of tasks; ``lam``, ``lo``, ``hi``, ``grid_boundary``
    are ``[T, K]`` (equal along K for a shared lambda), ``objective`` ``[T]``.

    ``spectrum`` is the one decomposition of each task's X (constant over the steps);
    ``objective`` is the summed log evidence ``sum_k F_k(lambda_k)`` at the profile
    betas, which is also the ELBO of the guide (exact posterior of w).
    """

    spectrum: Spectrum
    lam: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    grid_boundary: torch.Tensor
    objective: torch.Tensor

    @property
    def beta(self) -> torch.Tensor:
        """``[T, K]`` profile noise precisions ``N / E_k(lambda_k)`` (eq. 16)."""
        return profile_beta(self.spectrum, self.lam)

    @property
    def alpha(self) -> torch.Tensor:
        """``[T, K]`` prior precisions ``lambda_k beta_k``."""
        return self.lam * self.beta

    @property
    def log_evidence(self) -> torch.Tensor:
        """``[T, K]`` ``F_k(lambda_k)`` (eq. 17)."""
        return log_evidence(self.spectrum, self.lam)


@dataclass(frozen=True)
class EvidenceInfo(Info):
    """What one evidence step reports: the objective and the new ``lam [T, K]``."""

    lam: torch.Tensor


class EvidenceEngine(Engine):
    """Type-II maximum likelihood of lambda with the exact Gaussian posterior of w as guide.

    Data: ``x [T, N, D]``, one-vs-rest targets ``y [T, N, K]``. Model (declared in Pyro,
    in the rotated basis, by :func:`probfsl.derived.evidence.rotated_evidence_model`):
    ``w_k ~ Normal(0, (lambda_k beta_k)^-1 I)``, ``y_k ~ Normal(X w_k, beta_k^-1 I)``,
    with one lambda per task (``"shared"``) or per target (``"per_class"``).

    * ``init``: one eigendecomposition per task (:func:`spectrum`), then lambda at the
      argmax of the objective on a log grid (``lam_init`` starts there instead).
      ``variant`` picks the per-target map (:func:`update`); a shared lambda uses
      :func:`shared_update`.
    * ``step``: the safeguarded fixed point: candidates {Aitken's delta-squared step of
      the fixed-point map (:func:`shared_update`, or Algorithm 2 per target), one map,
      two maps (only one map with ``accelerate=False``), the EM step :func:`em_lambda`,
      the current lambda}, each clamped to
      ``clamp x mean(s)``; the one with the highest profile evidence is kept (per task
      when shared, per target otherwise). MacKay's map alone is not guaranteed to
      increase the evidence; the choice among candidates that include the current
      lambda makes every step monotone by construction, and the EM candidate (a proper
      EM step, monotone by the EM inequality) keeps it moving uphill wherever the map
      overshoots. Without host synchronisation.
    * ``guide``: point masses on the hyperparameters at the profile betas and the exact
      posterior ``Normal(m_k, (beta_k (lambda_k I + X^T X))^-1)`` on each w_k, so Pyro's
      ``Trace_ELBO`` is the log evidence ``sum_k F_k``, the state's objective.
    """

    maximize = True

    def __init__(
        self,
        lambda_mode: str = "shared",
        fit_intercept: bool = False,
        lam_init: float | None = None,
        n_grid: int = 64,
        grid_span: tuple[float, float] = (1e-6, 1e6),
        clamp: tuple[float, float] = (1e-10, 1e10),
        accelerate: bool = True,
        variant: str = "algorithm2",
    ) -> None:
        check_choice("lambda_mode", lambda_mode, LAMBDA_MODES)
        check_choice("variant", variant, UPDATE_VARIANTS)
        check_hyperparameter("lam_init", lam_init, positive=True, optional=True)
        check_hyperparameter("n_grid", n_grid, integer=True, low=2)
        for name, pair in (("grid_span", grid_span), ("clamp", clamp)):
            lo = check_hyperparameter(f"{name}[0]", pair[0], positive=True)
            if check_hyperparameter(f"{name}[1]", pair[1], positive=True) <= lo:
                raise ValueError(f"{name} must be an increasing pair, got {pair!r}")
        self.lambda_mode = lambda_mode
        self.fit_intercept = fit_intercept
        self.lam_init = lam_init
        self.n_grid = int(n_grid)
        self.grid_span = grid_span
        self.clamp = clamp
        self.accelerate = accelerate
        self.variant = variant

    @property
    def shared(self) -> bool:
        return self.lambda_mode == "shared"

    def init(self, x: torch.Tensor, y: torch.Tensor) -> EvidenceState:
        """Decompose each task's ``x [T, N, D]`` once; start lambda (targets ``y [T, N, K]``)."""
        if getattr(x, "ndim", None) != 3 or getattr(y, "ndim", None) != 3:
            raise ValueError(
                f"expected x [T, N, D] and y [T, N, K], got {tuple(getattr(x, 'shape', ()))}, "
                f"{tuple(getattr(y, 'shape', ()))}"
            )
        return self.init_spectrum(spectrum(x, y, self.fit_intercept))

    def init_spectrum(self, sp: Spectrum) -> EvidenceState:
        """Initial state from an existing :class:`Spectrum` with one task dimension."""
        if sp.yy.ndim != 2:
            raise ValueError(f"the spectrum must be [T, K], got batch shape {tuple(sp.yy.shape)}")
        scale = sp.mean_s.unsqueeze(-1).expand_as(sp.yy)
        lo, hi = self.clamp[0] * scale, self.clamp[1] * scale
        if self.lam_init is None:
            unit = torch.logspace(
                math.log10(self.grid_span[0]), math.log10(self.grid_span[1]), self.n_grid,
                dtype=sp.s.dtype, device=sp.s.device,
            )  # fmt: skip
            grid = (scale.unsqueeze(-1) * unit).contiguous()  # [T, K, G]
            values = _log_evidence_grid(sp, grid)
            if self.shared:
                values = values.sum(-2, keepdim=True).expand_as(values)
            best = values.argmax(-1, keepdim=True)
            lam = torch.gather(grid, -1, best).squeeze(-1).clamp(lo, hi)
            boundary = ((best == 0) | (best == self.n_grid - 1)).squeeze(-1)
        else:
            lam = torch.full_like(sp.yy, float(self.lam_init))
            boundary = torch.zeros_like(sp.yy, dtype=torch.bool)
        objective = log_evidence(sp, lam).sum(-1)
        return EvidenceState(sp, lam, lo, hi, boundary, objective)

    def _map(self, sp: Spectrum, lam: torch.Tensor) -> torch.Tensor:
        return shared_update(sp, lam) if self.shared else update(sp, lam, self.variant)

    def step(self, state: EvidenceState) -> tuple[EvidenceState, EvidenceInfo]:
        """One safeguarded fixed-point step (see the class docstring)."""
        sp, l0 = state.spectrum, state.lam
        l1 = self._map(sp, l0)
        moves = [l1]
        if self.accelerate:
            l2 = self._map(sp, l1)
            moves = [aitken(l0, l1, l2, positive=True), l1, l2]
        cands = torch.stack([*moves, em_lambda(sp, l0, self.shared)])
        cands = cands.nan_to_num(nan=0.0).clamp(state.lo, state.hi)
        cands = torch.cat([cands, l0.unsqueeze(0)])  # [C, T, K]; the last keeps lambda
        per_target = log_evidence(sp, cands)
        per_target = torch.where(torch.isfinite(per_target), per_target, -math.inf)
        score = per_target.sum(-1, keepdim=True).expand_as(cands) if self.shared else per_target
        best = score.argmax(0, keepdim=True)  # ties go to the first candidate
        lam = torch.gather(cands, 0, best).squeeze(0)
        objective = torch.gather(per_target, 0, best).squeeze(0).sum(-1)
        new = dataclasses.replace(state, lam=lam, objective=objective)
        return new, EvidenceInfo(objective, lam)

    def keep(self, frozen: torch.Tensor, old: EvidenceState, new: EvidenceState) -> EvidenceState:
        """Only ``lam`` and ``objective`` change over the steps."""
        lam = torch.where(frozen.unsqueeze(-1), old.lam, new.lam)
        objective = torch.where(frozen, old.objective, new.objective)
        return dataclasses.replace(new, lam=lam, objective=objective)

    def result(self, state: EvidenceState, info: RunInfo) -> EvidenceResult:
        """The :class:`EvidenceResult` ``[T, K]`` of a run."""
        sp, lam = state.spectrum, state.lam
        beta = state.beta
        at_clamp = (lam <= state.lo * (1 + 1e-9)) | (lam >= state.hi * (1 - 1e-9))
        return EvidenceResult(
            lam=lam,
            alpha=lam * beta,
            beta=beta,
            log_evidence=log_evidence(sp, lam),
            n_iter=info.n_steps.unsqueeze(-1).expand_as(lam),
            converged=info.converged.unsqueeze(-1).expand_as(lam),
            at_boundary=state.grid_boundary | at_clamp,
            degenerate=sp.yy <= 0,
        )

    def guide(self, state: EvidenceState) -> Callable[..., None]:
        """Point masses on (lambda or alpha, beta), the exact posterior on w ``[T, K, D]``."""
        sp, lam = state.spectrum, state.lam
        beta = state.beta
        mean = posterior_mean(sp, lam).mT  # [T, K, D]
        cov = posterior_covariance(sp, lam * beta, beta)  # [T, K, D, D]
        n_tasks, n_targets = lam.shape
        shared = self.shared

        def guide(x: torch.Tensor, y: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            with pyro.plate("tasks", n_tasks, dim=-2):
                if shared:
                    pyro.sample("lam", dist.Delta(lam[:, :1]))
                with pyro.plate("targets", n_targets, dim=-1):
                    if not shared:
                        pyro.sample("alpha", dist.Delta(lam * beta))
                    pyro.sample("beta", dist.Delta(beta))
                    pyro.sample("w", dist.MultivariateNormal(mean, covariance_matrix=cov))

        return guide


__all__ = [
    "LAMBDA_MODES",
    "EvidenceEngine",
    "EvidenceInfo",
    "EvidenceResult",
    "EvidenceState",
    "Spectrum",
    "at_upper_limit",
    "conditional_log_evidence",
    "decision_weights",
    "em_lambda",
    "em_update",
    "evidence_curve",
    "grid_search",
    "log_evidence",
    "log_evidence_ab",
    "maximize_evidence",
    "maximize_shared_evidence",
    "solve_evidence",
    "posterior_covariance",
    "pool_spectra",
    "posterior_mean",
    "profile_beta",
    "spectrum",
    "spectrum_from_gram",
    "shared_update",
    "update",
]
