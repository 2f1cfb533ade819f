"""Evidence maximisation for Bayesian linear regression (the Bayesian LS-SVM).

Kim, Jang, Han, Choi, "Learning to Select Pre-Trained Deep Representations with
Bayesian Evidence Framework", CVPR 2016 (spec ``evidence.md``).

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

All functions are batched: leading dimensions (backbones, tasks) on the features,
the trailing ``K`` dimension indexes targets (classes); hyperparameters are per
(batch, class). Zero eigenvalues contribute exactly zero to every expression, so
feature sets of different widths can be stacked after zero-padding their columns.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference.base import Engine
from probfsl.inference.eigh import stable_eigh

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


def _check_xy(x: torch.Tensor, y: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ValueError(f"features must be a [..., N, D] tensor, got {getattr(x, 'shape', x)}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"features must be float32 or float64, got {x.dtype}")
    if not isinstance(y, torch.Tensor) or y.ndim != x.ndim or y.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"targets must be [..., N, K] matching features {tuple(x.shape)}, "
            f"got {tuple(getattr(y, 'shape', ()))}"
        )
    if x.shape[-2] < 2:
        raise ValueError(f"features need at least two samples, got N={x.shape[-2]}")
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        raise ValueError("features or targets contain NaN or inf")


def _clean(s: torch.Tensor, rel: float) -> torch.Tensor:
    """Eigenvalues below ``rel * max`` (and negative round-off) set to exactly zero."""
    top = s.amax(-1, keepdim=True)
    return torch.where(s > rel * top, s, torch.zeros_like(s))


def spectrum(
    x: torch.Tensor,
    y: torch.Tensor,
    fit_intercept: bool = False,
    rel_tol: float = 1e-12,
    mode: str | None = None,
) -> Spectrum:
    """Decompose ``x [..., N, D]`` once and project the targets ``y [..., N, K]`` (spec §3, §7).

    Uses ``eigh`` of the N x N Gram when N <= D (dual) and of the D x D covariance
    otherwise (primal); ``mode`` forces one. With ``fit_intercept`` X and y are centred
    and N becomes N - 1.
    Eigenvalues below ``rel_tol * max(s)`` are set to zero.
    """
    _check_xy(x, y)
    if mode not in (None, "dual", "primal"):
        raise ValueError(f"mode must be None, 'dual' or 'primal', got {mode!r}")
    y = y.to(x.dtype)
    n, d = x.shape[-2], x.shape[-1]
    if fit_intercept:
        x = x - x.mean(-2, keepdim=True)
        y = y - y.mean(-2, keepdim=True)
    if mode == "dual" or (mode is None and n <= d):
        s, u = stable_eigh(x @ x.mT)  # [..., N], [..., N, N]
        s = _clean(s, rel_tol)
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
        s = _clean(s, rel_tol)
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
    _check_xy(gram, y)
    y = y.to(gram.dtype)
    s, u = stable_eigh(gram)
    s = _clean(s, rel_tol)
    proj = (u.mT @ y) * (s > 0).unsqueeze(-1)
    e0 = ((y - u @ proj) ** 2).sum(-2)
    n = gram.shape[-1]
    return Spectrum(s, proj**2, e0, (y**2).sum(-2), n, dim or n, None, proj, "dual")


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


def _aitken(l0: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Aitken's delta-squared extrapolation with Algorithm 1's fallback to ``l2``."""
    denom = (l2 - l1) - (l1 - l0)
    cand = l0 - (l1 - l0) ** 2 / denom
    bad = ~torch.isfinite(cand) | (cand < 0) | (denom == 0)
    return torch.where(bad, l2, cand)


def grid_search(
    sp: Spectrum, n_grid: int = 64, span: tuple[float, float] = (1e-6, 1e6)
) -> torch.Tensor:
    """Argmax of ``F`` over a log grid ``span x mean(s)`` (spec §4 safeguard), ``[..., K]``."""
    unit = torch.logspace(
        math.log10(span[0]), math.log10(span[1]), n_grid, dtype=sp.s.dtype, device=sp.s.device
    )
    scale = sp.mean_s[..., None, None]  # [..., 1, 1]
    grid = (scale * unit).expand(*sp.yy.shape, n_grid)  # [..., K, G]
    values = _log_evidence_grid(sp, grid)
    best = values.argmax(-1, keepdim=True)
    return torch.gather(grid, -1, best).squeeze(-1)


def _step(
    sp: Spectrum,
    l0: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    variant: str,
    accelerate: bool,
    safeguarded: bool,
) -> torch.Tensor:
    """One outer step of Algorithm 1 (optionally safeguarded, see :func:`maximize_evidence`)."""
    l1 = update(sp, l0, variant)
    if accelerate:
        l2 = update(sp, l1, variant)
        new = _aitken(l0, l1, l2)
    else:
        l2 = new = l1
    if not safeguarded:
        return new
    beta0 = profile_beta(sp, l0)
    a_em, b_em = em_update(sp, l0 * beta0, beta0)
    cands = torch.stack([new, l1, l2, a_em / b_em], 0).nan_to_num(nan=0.0).clamp(lo, hi)
    cands = torch.cat([cands, l0.unsqueeze(0)], 0)
    vals = torch.stack([log_evidence(sp, c) for c in cands], 0)
    vals = torch.where(torch.isfinite(vals), vals, -math.inf)
    # ties (e.g. every candidate clamped to the same bound) go to the first candidate
    return torch.gather(cands, 0, vals.argmax(0, keepdim=True)).squeeze(0)


def maximize_evidence(
    sp: Spectrum,
    lam_init: float | torch.Tensor = 1.0,
    accelerate: bool = True,
    variant: str = "algorithm2",
    paper_exact: bool = False,
    eps: float = 1e-5,
    rtol: float = 1e-8,
    max_iter: int = 500,
    n_grid: int = 64,
    grid_span: tuple[float, float] = (1e-6, 1e6),
    clamp: tuple[float, float] = (1e-10, 1e10),
    warn: bool = True,
) -> EvidenceResult:
    """Maximise the profile evidence over lambda for every (batch, class) at once.

    Algorithm 1 of the paper: the fixed-point map (Algorithm 2) with Aitken's
    delta-squared step, stopping when ``|lambda - lambda_0| < eps`` (absolute) for
    each element; converged elements are frozen by a mask.

    ``paper_exact=True`` runs exactly that from ``lam_init``. Otherwise the spec's
    safeguards (§4) are added: start from the argmax of ``F`` on a ``n_grid``-point
    log grid spanning ``grid_span x mean(s)``; also stop on
    ``|log lambda - log lambda_0| < rtol``; clamp lambda to ``clamp x mean(s)``;
    take the best of {Aitken, one map, two maps, EM step} so the evidence never
    decreases; keep the grid argmax if it beats the fixed point; flag (and warn about)
    ``at_boundary`` when the final lambda sits on a clamp (no finite maximiser, e.g.
    a single positive).

    ``accelerate=False`` iterates the plain map instead of Aitken's step.
    """
    if variant not in UPDATE_VARIANTS:
        raise ValueError(f"variant must be one of {UPDATE_VARIANTS}, got {variant!r}")
    shape = sp.yy.shape
    dtype, device = sp.s.dtype, sp.s.device
    degenerate = (sp.yy <= 0) | (weight_norm2(sp, sp.mean_s.unsqueeze(-1).expand(shape)) <= 0)
    if paper_exact:
        lam = torch.as_tensor(lam_init, dtype=dtype, device=device).expand(shape).clone()
        lo = torch.zeros_like(lam)
        hi = torch.full_like(lam, math.inf)
    else:
        scale = sp.mean_s.unsqueeze(-1).expand(shape)
        lo, hi = clamp[0] * scale, clamp[1] * scale
        grid_best = grid_search(sp, n_grid, grid_span).clamp(lo, hi)
        lam = grid_best.clone()
    done = degenerate.clone()
    n_iter = torch.zeros(shape, dtype=torch.long, device=device)
    for _ in range(max_iter):
        if bool(done.all()):
            break
        l0 = lam
        new = _step(sp, l0, lo, hi, variant, accelerate, safeguarded=not paper_exact)
        new = torch.where(done, lam, new)
        n_iter = n_iter + (~done).long()
        stop = (new - l0).abs() < eps
        if not paper_exact:
            stop = stop | ((new.log() - l0.log()).abs() < rtol)
        stop = stop | ~torch.isfinite(new)
        lam = new
        done = done | stop
    converged = done & ~degenerate & torch.isfinite(lam)
    if not paper_exact:
        better = log_evidence(sp, grid_best) > log_evidence(sp, lam)
        lam = torch.where(better, grid_best, lam)
        lam = torch.where(degenerate, hi, lam)
        at_boundary = (lam <= lo * (1 + 1e-9)) | (lam >= hi * (1 - 1e-9))
        # F still rising further out (flat supremum at lambda -> 0 or infinity): no maximiser
        f_hat = log_evidence(sp, lam)
        beyond = (log_evidence(sp, lam * 1e-2) > f_hat) | (log_evidence(sp, lam * 1e2) > f_hat)
        at_boundary = (at_boundary | beyond) & ~degenerate
    else:
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


def maximize_shared_evidence(
    sp: Spectrum,
    n_grid: int = 64,
    grid_span: tuple[float, float] = (1e-6, 1e6),
    refine: int = 3,
) -> EvidenceResult:
    """One lambda per batch element shared by its K targets, maximising ``sum_k F_k(lambda)``.

    Each target keeps its own profile ``beta_k = N / E_k(lambda)``. A library option,
    not in the paper: per-class lambdas can differ by orders of magnitude, which puts
    the one-vs-rest scores on different scales. Log-grid search over ``grid_span x
    mean(s)``, then ``refine`` rounds of a 33-point grid between the neighbours of the
    best point. ``at_boundary`` marks a maximum at either end of the span.
    """
    shape = sp.yy.shape
    scale = sp.mean_s.unsqueeze(-1)  # [..., 1]
    log_lo = math.log(grid_span[0]) + scale.log()
    log_hi = math.log(grid_span[1]) + scale.log()
    steps = torch.linspace(0, 1, n_grid, dtype=sp.s.dtype, device=sp.s.device)
    grid = log_lo + (log_hi - log_lo) * steps  # [..., G] in log lambda
    width = (log_hi - log_lo) / (n_grid - 1)
    best, at_boundary = None, None
    for round_ in range(refine + 1):
        values = _log_evidence_grid(sp, grid.exp().unsqueeze(-2).expand(*shape, grid.shape[-1]))
        total = values.sum(-2)  # [..., G]
        idx = total.argmax(-1, keepdim=True)
        best = torch.gather(grid, -1, idx)  # [..., 1]
        if round_ == 0:
            at_boundary = (idx == 0) | (idx == n_grid - 1)
        steps33 = torch.linspace(-1, 1, 33, dtype=sp.s.dtype, device=sp.s.device)
        grid = best + width * steps33
        width = width / 16
    lam = best.exp().expand(shape)
    beta = profile_beta(sp, lam)
    f = log_evidence(sp, lam)
    zeros = torch.zeros(shape, dtype=torch.long, device=lam.device)
    return EvidenceResult(
        lam=lam,
        alpha=lam * beta,
        beta=beta,
        log_evidence=f,
        n_iter=zeros + refine + 1,
        converged=torch.ones(shape, dtype=torch.bool, device=lam.device),
        at_boundary=at_boundary.expand(shape),
        degenerate=(sp.yy <= 0),
    )


# ---------------------------------------------------------------------------------------
# Engine for the model/guide contract


@dataclass
class EvidenceState:
    """One evidence problem per task: ``x [T, N, D]``, ``y [T, N]``."""

    x: torch.Tensor
    y: torch.Tensor
    spectrum: Spectrum
    lam: torch.Tensor  # [T]
    alpha: torch.Tensor  # [T]
    beta: torch.Tensor  # [T]
    mean: torch.Tensor  # [T, D] posterior mean of w
    precision: torch.Tensor  # [T, D, D] posterior precision A = alpha I + beta X^T X
    objective: torch.Tensor  # [T] ELBO = log evidence at (alpha, beta) (exact posterior)


class EvidenceEngine(Engine):
    """Type-II maximum likelihood with the exact Gaussian posterior of w as the guide.

    ``init`` decomposes X once; each ``step`` is one safeguarded Aitken step of
    :func:`maximize_evidence` on lambda (with the profile beta). The guide puts point
    masses on alpha and beta and the exact posterior ``Normal(m, A^-1)`` on w, so
    Pyro's ``Trace_ELBO`` of :func:`probfsl.models.evidence.evidence_model` equals
    the log evidence at (alpha, beta).
    """

    maximize = True

    def __init__(self, lam_init: float = 1.0, fit_intercept: bool = False) -> None:
        if isinstance(lam_init, bool) or not isinstance(lam_init, (int, float)):
            raise TypeError(f"lam_init must be a real number, got {lam_init!r}")
        if not 0 < lam_init < math.inf:
            raise ValueError(f"lam_init must be positive and finite, got {lam_init!r}")
        self.lam_init = lam_init
        self.fit_intercept = fit_intercept

    def init(self, x: torch.Tensor, y: torch.Tensor) -> EvidenceState:
        if y.ndim != 2 or x.ndim != 3:
            raise ValueError(
                f"expected x [T, N, D] and y [T, N], got {tuple(x.shape)}, {tuple(y.shape)}"
            )
        sp = spectrum(x, y.unsqueeze(-1), self.fit_intercept)
        lam = torch.full(y.shape[:1], float(self.lam_init), dtype=x.dtype, device=x.device)
        return self._state(x, y, sp, lam)

    def _state(self, x, y, sp, lam) -> EvidenceState:
        beta = profile_beta(sp, lam.unsqueeze(-1)).squeeze(-1)
        alpha = lam * beta
        mean = posterior_mean(sp, lam.unsqueeze(-1)).squeeze(-1)
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        precision = alpha[:, None, None] * eye + beta[:, None, None] * (x.mT @ x)
        objective = log_evidence(sp, lam.unsqueeze(-1)).squeeze(-1)
        return EvidenceState(x, y, sp, lam, alpha, beta, mean, precision, objective)

    def step(self, state: EvidenceState) -> EvidenceState:
        sp, l0 = state.spectrum, state.lam.unsqueeze(-1)
        scale = sp.mean_s.unsqueeze(-1)
        lam = _step(sp, l0, 1e-10 * scale, 1e10 * scale, "algorithm2", True, True).squeeze(-1)
        return self._state(state.x, state.y, state.spectrum, lam)

    def guide(self, state: EvidenceState):
        def guide(x: torch.Tensor, y: torch.Tensor, *args, **kwargs) -> None:
            with pyro.plate("problems", x.shape[0], dim=-1):
                pyro.sample("alpha", dist.Delta(state.alpha))
                pyro.sample("beta", dist.Delta(state.beta))
                pyro.sample(
                    "w", dist.MultivariateNormal(state.mean, precision_matrix=state.precision)
                )

        return guide


__all__ = [
    "EvidenceEngine",
    "EvidenceResult",
    "EvidenceState",
    "Spectrum",
    "at_upper_limit",
    "decision_weights",
    "em_update",
    "evidence_curve",
    "grid_search",
    "log_evidence",
    "log_evidence_ab",
    "maximize_evidence",
    "maximize_shared_evidence",
    "posterior_covariance",
    "posterior_mean",
    "profile_beta",
    "spectrum",
    "spectrum_from_gram",
    "update",
]
