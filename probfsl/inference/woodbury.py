"""Closed forms of the square-loss exemplar machine (SLEM) against a shared negative set.

Rezende, Zepeda, Ponce, Bach, Pérez, "Kernel Square-Loss Exemplar Machines for Image
Retrieval", CVPR 2017, section "The square loss exemplar machine" (docs/design/slem.md §3).

Objective for one positive ``x0`` against negatives ``x_1..x_n`` (square loss l = (y - ŷ)²/2):

    J(omega, nu) = theta l(1, omega^T x0 + nu) + 1/n sum_i l(-1, omega^T x_i + nu)
                   + lambda/2 ||omega||^2

With ``mu`` and the biased covariance ``Sigma`` of the negatives, ``A = Sigma + lambda I``,
``delta = x0 - mu``:

* closed form: ``U = A + theta/(theta+1) delta delta^T``, ``omega = 2 theta/(theta+1) U^-1 delta``,
  ``nu = (theta - 1)/(theta + 1) - (theta x0 + mu)^T omega / (theta + 1)``;
* Sherman-Morrison (many exemplars, one factorisation of A): ``q = delta^T A^-1 delta``,
  ``omega = 2 theta / (theta q + theta + 1) A^-1 delta``: :func:`slem_woodbury`, the one
  implementation (the direct ``U`` solve is the tests' reference).

These are closed forms (one factorisation, one solve): no iterations, so nothing here is
an :class:`~probfsl.inference.base.Engine`. Their Pyro model, whose MAP (and posterior
mean) they are, is :func:`probfsl.models.slem.slem_model`.

So the direction is ``A^-1 (x0 - mu)`` for every theta: regularised LDA with the
background covariance. :class:`NegativeFactor` caches one factorisation of A, primal
(Cholesky of the d x d matrix) or dual when n < d (Woodbury:
``A^-1 = (I - Xc^T (lambda n I + Xc Xc^T)^-1 Xc) / lambda`` with centred negatives Xc).
Everything is batched over leading dimensions; dtype and device follow the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probfsl.validation import as_float_tensor


def _check(name: str, x: torch.Tensor, ndim: int = 2) -> None:
    """:func:`probfsl.validation.as_float_tensor` (float32/float64 tensor, finite) with at
    least ``ndim`` dimensions."""
    if as_float_tensor(x, name).ndim < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimensions, got {tuple(x.shape)}")


def background_statistics(negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[..., d]`` and biased covariance ``[..., d, d]`` of ``negatives [..., n, d]``."""
    _check("negatives", negatives)
    if negatives.shape[-2] < 2:
        raise ValueError(f"negatives: need at least two samples, got {negatives.shape[-2]}")
    mu = negatives.mean(-2)
    xc = negatives - mu.unsqueeze(-2)
    return mu, xc.mT @ xc / negatives.shape[-2]


def default_lambda(negatives: torch.Tensor, rel: float = 1e-3) -> torch.Tensor:
    """Spec default ``lambda = rel * trace(Sigma) / d`` (``[...]``).

    When the negatives have no spread (trace 0: every negative the same vector) the
    scale is taken from their second moment ``mean ||x||^2 / d`` instead, and from 1
    when they are all zero, so that ``Sigma + lambda I`` stays positive definite.
    """
    n, d = negatives.shape[-2], negatives.shape[-1]
    xc = negatives - negatives.mean(-2, keepdim=True)
    spread = (xc**2).sum((-2, -1)) / (n * d)
    second = (negatives**2).sum((-2, -1)) / (n * d)
    scale = torch.where(spread > 0, spread, torch.where(second > 0, second, 1.0))
    return rel * scale


def _lam(lam: float | torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    lam = torch.as_tensor(lam, dtype=ref.dtype, device=ref.device)
    if not bool((lam >= 0).all() & torch.isfinite(lam).all()):
        raise ValueError(f"lam must be finite and non-negative, got {lam}")
    return lam


def _check_theta(theta: float) -> None:
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ValueError(f"theta must be a positive finite number, got {theta!r}")


@dataclass
class NegativeFactor:
    """A cached factorisation of ``A = Sigma + lambda I`` for one negative set (batched)."""

    mu: torch.Tensor  # [..., d]
    lam: torch.Tensor  # [...]
    chol: torch.Tensor  # primal: chol(A) [..., d, d]; dual: chol(lambda n I + Xc Xc^T) [..., n, n]
    xc: torch.Tensor | None  # dual only: centred negatives [..., n, d]
    mode: str

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        """``A^-1 v`` for row vectors ``v [..., P, d]``."""
        if self.chol.ndim == 2 and v.ndim > 2:  # one factor for a batch: one wide solve
            flat = v.reshape(-1, v.shape[-1])
            return self.solve(flat).reshape(v.shape)
        if self.mode == "primal":
            return torch.cholesky_solve(v.mT, self.chol).mT
        inner = self.xc @ v.mT  # [..., n, P]
        corr = self.xc.mT @ torch.cholesky_solve(inner, self.chol)  # [..., d, P]
        return (v - corr.mT) / self.lam[..., None, None]


def factor_negatives(
    negatives: torch.Tensor, lam: float | torch.Tensor | None = None, dual: bool | None = None
) -> NegativeFactor:
    """Factorise ``A = Sigma + lambda I`` once (``lam=None``: :func:`default_lambda`).

    The dual (Woodbury) form is used when n < d (default) and needs lambda > 0.
    """
    _check("negatives", negatives)
    n, d = negatives.shape[-2], negatives.shape[-1]
    if n < 2:
        raise ValueError(f"negatives: need at least two samples, got {n}")
    lam = default_lambda(negatives) if lam is None else _lam(lam, negatives)
    lam = lam.expand(negatives.shape[:-2])
    mu = negatives.mean(-2)
    xc = negatives - mu.unsqueeze(-2)
    if dual is None:
        dual = n < d
    if dual:
        if bool((lam <= 0).any()):
            raise ValueError("the dual (Woodbury) form needs lam > 0")
        eye = torch.eye(n, dtype=xc.dtype, device=xc.device)
        chol = _cholesky(xc @ xc.mT + (lam * n)[..., None, None] * eye)
        return NegativeFactor(mu, lam, chol, xc, "dual")
    eye = torch.eye(d, dtype=xc.dtype, device=xc.device)
    a = xc.mT @ xc / n + lam[..., None, None] * eye
    return NegativeFactor(mu, lam, _cholesky(a), None, "primal")


def _cholesky(a: torch.Tensor) -> torch.Tensor:
    """Cholesky factor of ``Sigma + lambda I``; a ``ValueError`` naming ``lam`` when it is
    not positive definite (lam = 0 with a rank-deficient background)."""
    chol, info = torch.linalg.cholesky_ex(a)
    if bool((info != 0).any()):
        raise ValueError(
            "lam: Sigma + lam I of the negatives is not positive definite (lam = 0 with "
            "rank-deficient negatives?); use lam > 0"
        )
    return chol


def slem_woodbury(
    x0: torch.Tensor, factor: NegativeFactor, theta: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(omega, nu)`` for many exemplars ``x0 [..., P, d]`` via Sherman-Morrison (design §3)."""
    _check("x0", x0)
    _check_theta(theta)
    if x0.shape[-1] != factor.mu.shape[-1]:
        raise ValueError(
            f"x0 width {x0.shape[-1]} does not match the negatives' {factor.mu.shape[-1]}"
        )
    mu = factor.mu.unsqueeze(-2)
    delta = x0 - mu
    ainv_delta = factor.solve(delta)
    q = (delta * ainv_delta).sum(-1, keepdim=True)
    omega = 2 * theta / (theta * q + theta + 1) * ainv_delta
    nu = (theta - 1) / (theta + 1) - ((theta * x0 + mu) * omega).sum(-1) / (theta + 1)
    return omega, nu


def slem_descriptors(
    x: torch.Tensor, factor: NegativeFactor, normalize: bool = True
) -> torch.Tensor:
    """Exemplar descriptors ``A^-1 (x - mu)`` ``[..., P, d]``, L2-normalised by default."""
    _check("x", x)
    if x.shape[-1] != factor.mu.shape[-1]:
        raise ValueError(
            f"x width {x.shape[-1]} does not match the negatives' {factor.mu.shape[-1]}"
        )
    omega = factor.solve(x - factor.mu.unsqueeze(-2))
    return torch.nn.functional.normalize(omega, dim=-1) if normalize else omega


def slem_similarity(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Cosine similarities ``[..., P, R]`` between normalised SLEM descriptors."""
    a = torch.nn.functional.normalize(a, dim=-1)
    b = a if b is None else torch.nn.functional.normalize(b, dim=-1)
    return a @ b.mT


def lda_scores(query: torch.Tensor, means: torch.Tensor, factor: NegativeFactor) -> torch.Tensor:
    """Scores ``omega_c^T (x - (xbar_c + mu) / 2)`` with ``omega_c = A^-1 (xbar_c - mu)``.

    ``query [..., Q, d]``, class means ``[..., K, d]`` -> ``[..., Q, K]``. Up to a
    class-independent term this is ``xbar_c^T A^-1 x - xbar_c^T A^-1 xbar_c / 2``, the LDA
    discriminant with covariance A (design §3 "several positives", §6.9).
    """
    omega = factor.solve(means - factor.mu.unsqueeze(-2))  # [..., K, d]
    offset = -0.5 * (omega * (means + factor.mu.unsqueeze(-2))).sum(-1)  # [..., K]
    return query @ omega.mT + offset.unsqueeze(-2)
