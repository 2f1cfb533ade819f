"""Closed-form inference for GP-Tree's binary Pólya-Gamma GP nodes, batched over nodes.

Achituve, Navon, Yemini, Chechik, Fetaya, "GP-Tree: A Gaussian Process Classifier for
Few-Shot Incremental Learning", ICML 2021 (§3, App. A); docs/design/gp-tree.md §3.2–3.3.

Every tensor has a leading node dimension ``V``: a batch of independent binary GP
classifiers with their own data, padded to a common size and masked. Padded training
points get ω = 0 and κ = 0 (no information), padded inducing points an identity prior
block, so a padded node equals the unpadded one exactly. Both engines honour the
:class:`probfsl.inference.base.Engine` contract (tasks = nodes) and are driven by
:func:`probfsl.inference.base.run`; their Pyro models (one row of the batch per internal
node of a tree) are in :mod:`probfsl.models.gp_tree.model`.

* :class:`GibbsNodes` — block Gibbs over (f, ω) for exact-kernel nodes, ``n_chains``
  chains per node at once (§3.2), without any K⁻¹: with B = I + Ω^½KΩ^½,
  f | ω ~ N(Σκ, Σ), Σ = K − KΩ^½B⁻¹Ω^½K, drawn by Matheron's rule
  f = g − KΩ^½B⁻¹(Ω^½g + e), g ~ N(Kκ, K), e ~ N(0, I); ω | f ~ PG(1, f). A sampler:
  its state's ``objective`` is the current augmented log marginal log p(y | ω) (when
  tracked), which need not increase, and :func:`~probfsl.inference.base.run` is given
  no tolerance.
* :class:`VINodes` — the inducing-point variational node (§3.3) with q(f̄) = N(μ̃, Σ̃),
  q(ω_i) = PG(1, c_i), closed-form coordinate updates and the correct ELBO (§3.8 item 1;
  ``code_elbo=True`` reproduces the official code's two flipped signs).
* :func:`gauss_hermite_sigmoid` — E[σ(f)], f ~ N(μ, σ²), by 20-point Gauss–Hermite
  quadrature (the nodes and weights of gpytorch's ``GaussHermiteQuadrature1D``).

Host synchronisations: a Gibbs sweep makes none (B ⪰ I is factorised without a check);
a VI step makes one, :func:`safe_cholesky`'s check of the factorisation of Σ̃⁻¹ (a
jitter retry needs to know whether the first factorisation failed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pyro
import pyro.distributions as dist
import torch

from probfsl.inference.base import Engine, Info, run
from probfsl.inference.polya_gamma import (
    CounterRNG,
    PolyaGamma,
    _pg_series_draw,
    log_cosh,
    pg_mean,
    sample_pg_exact,
)
from probfsl.validation import check_choice, check_hyperparameter

# ----------------------------------------------------------------------------- kernels


def normalize(x: torch.Tensor) -> torch.Tensor:
    """L2-normalise the last dimension (GP-Tree's kernels act on x/||x||)."""
    return torch.nn.functional.normalize(x, dim=-1)


def rbf_kernel(
    x1: torch.Tensor,
    x2: torch.Tensor,
    outputscale: torch.Tensor,
    lengthscale: torch.Tensor,
) -> torch.Tensor:
    """s·exp(−‖x1−x2‖²/(2l²)) for ``x1 [V, a, D]``, ``x2 [V, b, D]``, ``s, l [V]`` → ``[V, a, b]``.

    Same value as gpytorch's ``ScaleKernel(RBFKernel())`` with batch shape ``[V]``.
    """
    sq = (
        x1.pow(2).sum(-1).unsqueeze(-1)
        + x2.pow(2).sum(-1).unsqueeze(-2)
        - 2 * x1 @ x2.transpose(-1, -2)
    ).clamp_min(0)
    l2 = lengthscale.pow(2)[..., None, None]
    return outputscale[..., None, None] * torch.exp(-sq / (2 * l2))


def masked_gram(k: torch.Tensor, mask: torch.Tensor, jitter: float) -> torch.Tensor:
    """K + jitter·I on real rows; identity rows/columns on padded ones."""
    m = mask.to(k.dtype)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    return k * m.unsqueeze(-1) * m.unsqueeze(-2) + eye * (jitter * m + (1 - m)).unsqueeze(-1)


def safe_cholesky(a: torch.Tensor, max_tries: int = 5) -> torch.Tensor:
    """Cholesky with escalating jitter retries (1e-8·mean diag, ×10 each try), as in the code."""
    chol, info = torch.linalg.cholesky_ex(a)
    if not bool((info > 0).any()):
        return chol
    diag = a.diagonal(dim1=-2, dim2=-1).mean(-1).abs().clamp_min(1e-12)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for i in range(max_tries):
        jit = diag * 10.0 ** (-8 + i + (2 if a.dtype == torch.float32 else 0))
        chol, info = torch.linalg.cholesky_ex(a + jit[..., None, None] * eye)
        if not bool((info > 0).any()):
            return chol
    raise ValueError("matrix is not positive definite even with jitter (check the inputs)")


# ------------------------------------------------------------------ Gauss–Hermite predictive

_GH_CACHE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def gauss_hermite_sigmoid(
    mean: torch.Tensor, var: torch.Tensor, n_points: int = 20
) -> torch.Tensor:
    """E[σ(f)] for f ~ N(mean, var): Σ_j w_j σ(mean + √(2 var) t_j)/√π (Hermite nodes t_j)."""
    if n_points not in _GH_CACHE:
        _GH_CACHE[n_points] = np.polynomial.hermite.hermgauss(n_points)
    t, w = _GH_CACHE[n_points]
    t = torch.as_tensor(t, dtype=mean.dtype, device=mean.device)
    w = torch.as_tensor(w, dtype=mean.dtype, device=mean.device) / math.sqrt(math.pi)
    f = mean.unsqueeze(-1) + (2 * var.clamp_min(0)).sqrt().unsqueeze(-1) * t
    return (torch.sigmoid(f) * w).sum(-1)


# ------------------------------------------------------------------------- validation


def check_node_data(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
    """``ValueError`` unless ``x [V, n, D]``, ``y [V, n]`` ∈ {0, 1} and ``mask [V, n]`` agree."""
    if x.ndim != 3:
        raise ValueError(f"x must be [V, n, D], got shape {tuple(x.shape)}")
    if y.shape != x.shape[:2] or mask.shape != x.shape[:2]:
        raise ValueError(
            f"y and mask must be [V, n]={tuple(x.shape[:2])}, got {tuple(y.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or inf")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("y must hold 0/1 node labels")
    if not bool(mask.bool().any(-1).all()):
        raise ValueError("mask: every node needs at least one training point")


# ------------------------------------------------------------------------------ Gibbs


@dataclass
class GibbsState:
    """Gibbs chains of a batch of nodes.

    Attributes:
        x: ``[V, n, D]`` node inputs (L2-normalised), ``mask`` ``[V, n]``, ``kappa``
            ``[V, n]`` = y − ½ (0 on padding).
        K: ``[V, n, n]`` prior covariance with jitter; ``chol_K`` its Cholesky factor.
        omega: ``[V, S, n]`` current ω of S chains (0 on padding); ``f`` the last f draw.
        outputscale, lengthscale: ``[V]`` kernel hyper-parameters.
        log_marginal: ``[V]`` mean over chains of the augmented log marginal likelihood
            log p(y | ω, X) at the current ω (:func:`augmented_log_marginal`); None
            unless the engine has ``track_objective``.
        f_trace, omega_trace: f and ω after ``init`` and every sweep when recorded, else None.
        rng: the :class:`~probfsl.inference.polya_gamma.CounterRNG` of per-node streams
            when :meth:`GibbsNodes.init` was given ``keys``; None: the engine's generator.
        chol_failed: ``[V]`` bool, nodes whose prior Cholesky factorisation failed, when
            :meth:`GibbsNodes.init` ran with ``checked=False`` (the caller checks it, once
            for all its batches); None otherwise (a failure raised at once).
    """

    x: torch.Tensor
    mask: torch.Tensor
    kappa: torch.Tensor
    K: torch.Tensor
    chol_K: torch.Tensor
    omega: torch.Tensor
    f: torch.Tensor
    outputscale: torch.Tensor
    lengthscale: torch.Tensor
    log_marginal: torch.Tensor | None = None
    f_trace: list | None = None
    omega_trace: list | None = None
    rng: CounterRNG | None = None
    chol_failed: torch.Tensor | None = None

    @property
    def objective(self) -> torch.Tensor:
        """The contract's ``[V]`` objective of a sampler: ``log_marginal`` (the current
        augmented log marginal, a random quantity that need not increase from sweep to
        sweep, so monotonicity does not apply), or zeros when it is not tracked."""
        if self.log_marginal is not None:
            return self.log_marginal
        return self.kappa.new_zeros(self.kappa.shape[0])


class GibbsNodes(Engine):
    """Block Gibbs sampler for exact-kernel PG-GP nodes, all nodes and chains at once (§3.2).

    An :class:`~probfsl.inference.base.Engine` whose ``step`` is one sweep (f | ω, then
    ω | f); :meth:`fit` drives it with :func:`~probfsl.inference.base.run` (a fixed number
    of sweeps, no tolerance: a sampler does not converge to a point). Its Pyro model is
    :func:`probfsl.models.gp_tree.model.gp_tree_exact_model`.

    Args:
        n_chains: independent chains per node (code default 30).
        outputscale, lengthscale: fixed RBF hyper-parameters (code: 8 and 1).
        jitter: added to the kernel diagonal (code: 1e-3).
        sampler: ``"torch"`` (on device, :func:`sample_pg_torch`) or ``"exact"``
            (``polyagamma`` on CPU).
        generator: torch generator for the normal and Gamma draws (``"torch"`` sampler),
            used unless :meth:`init` is given per-node ``keys``.
        seed: seed of the NumPy generator of the ``"exact"`` sampler (which draws ω on the
            CPU from one stream, so its results depend on the batch even with ``keys``).
        record: keep f and ω after every sweep (for ArviZ diagnostics).
        track_objective: compute log p(y | ω) after every sweep (one more Cholesky per
            sweep) into ``state.log_marginal``; otherwise the objective is zero.
    """

    maximize = True

    def __init__(
        self,
        n_chains: int = 30,
        outputscale: float = 8.0,
        lengthscale: float = 1.0,
        jitter: float = 1e-3,
        sampler: str = "torch",
        generator: torch.Generator | None = None,
        seed: int | None = 0,
        record: bool = False,
        track_objective: bool = False,
    ) -> None:
        self.n_chains = check_hyperparameter("n_chains", n_chains, integer=True, low=1)
        self.outputscale = check_hyperparameter("outputscale", outputscale, positive=True)
        self.lengthscale = check_hyperparameter("lengthscale", lengthscale, positive=True)
        self.jitter = check_hyperparameter("jitter", jitter, nonnegative=True)
        self.sampler = check_choice("sampler", sampler, ("torch", "exact"))
        self.generator = generator
        self._rng = np.random.default_rng(seed)
        self.record = record
        self.track_objective = track_objective

    def _log_marginal(self, state: GibbsState) -> torch.Tensor | None:
        return augmented_log_marginal(state).mean(-1) if self.track_objective else None

    # -- draws
    def _randn(self, shape, like: torch.Tensor, rng: CounterRNG | None) -> torch.Tensor:
        if rng is not None:
            return rng.normal(tuple(shape), like.dtype)
        return torch.randn(shape, dtype=like.dtype, device=like.device, generator=self.generator)

    def _pg(self, f: torch.Tensor, mask: torch.Tensor, rng: CounterRNG | None) -> torch.Tensor:
        if self.sampler == "torch":
            w = _pg_series_draw(f, 1.0, 20, self.generator if rng is None else rng)
        else:
            w = sample_pg_exact(f, random_state=self._rng)
        return w * mask.unsqueeze(-2).to(w.dtype)

    def init(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        keys: torch.Tensor | None = None,
        checked: bool = True,
    ) -> GibbsState:
        """Kernel matrices and the code's initialisation f⁰ ~ N(0, K), ω⁰ ~ PG(1, f⁰).

        ``checked=False`` is for callers that built the node data themselves from
        validated input and run many batches: the input checks are skipped and the
        factorisation of K is not checked on the host (no synchronisation); its failures
        are left in ``state.chol_failed`` for the caller to test once.

        ``keys [V]`` (integers) give node v its own random stream (a
        :class:`~probfsl.inference.polya_gamma.CounterRNG`), so that its chains do not
        depend on the other nodes of the batch (for a given padded size n); without them
        the engine's ``generator`` draws for the whole batch.
        """
        if checked:
            check_node_data(x, y, mask)
        rng = None
        if keys is not None:
            if not isinstance(keys, torch.Tensor):
                raise TypeError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
            if keys.shape != x.shape[:1] or keys.is_floating_point():
                raise ValueError(f"keys must be integers of shape [V={x.shape[0]}]")
            rng = CounterRNG(keys.to(x.device))
        x = normalize(x)
        mask = mask.bool()
        m = mask.to(x.dtype)
        V = x.shape[0]
        s = x.new_full((V,), self.outputscale)
        ls = x.new_full((V,), self.lengthscale)
        K = masked_gram(rbf_kernel(x, x, s, ls), mask, self.jitter)
        chol_failed = None
        if checked:
            chol_K = safe_cholesky(K)
        else:
            chol_K, info = torch.linalg.cholesky_ex(K)
            chol_failed = info > 0
        kappa = (y.to(x.dtype) - 0.5) * m
        eps = self._randn((V, self.n_chains, x.shape[1]), x, rng)
        f = (chol_K.unsqueeze(1) @ eps.unsqueeze(-1)).squeeze(-1)
        omega = self._pg(f, mask, rng)
        state = GibbsState(x, mask, kappa, K, chol_K, omega, f, s, ls, rng=rng)
        state.chol_failed = chol_failed
        state.log_marginal = self._log_marginal(state)
        if self.record:
            state.f_trace, state.omega_trace = [f], [omega]
        return state

    def sample_f(self, state: GibbsState) -> torch.Tensor:
        """One draw of f | ω, y for every node and chain (Matheron's rule, no K⁻¹).

        Chains are rows of ``[V, S, n]`` matrices, so K and L_K act by one GEMM per node
        (x ↦ x Kᵀ) rather than S broadcast matrix-vector products.
        """
        K, kappa, omega = state.K, state.kappa, state.omega
        V, S, n = omega.shape
        eps = self._randn((V, S, n), omega, state.rng)
        Kk = (K @ kappa.unsqueeze(-1)).squeeze(-1)  # [V, n]
        g = Kk.unsqueeze(1) + eps @ state.chol_K.transpose(-1, -2)  # g ~ N(Kκ, K)
        sw = omega.sqrt()
        r = sw * g + self._randn((V, S, n), omega, state.rng)
        v = _solve_B(K, sw, r)
        return g - (sw * v) @ K  # K symmetric: rows (K Ω^½ v)ᵀ

    def sample_omega(self, state: GibbsState, f: torch.Tensor) -> torch.Tensor:
        """One draw of ω | f ~ PG(1, f) for every node, chain and (real) point."""
        return self._pg(f, state.mask, state.rng)

    def step(self, state: GibbsState) -> tuple[GibbsState, Info]:
        """One sweep: f | ω, then ω | f ~ PG(1, f)."""
        f = self.sample_f(state)
        omega = self.sample_omega(state, f)
        new = replace(state, f=f, omega=omega)
        new.log_marginal = self._log_marginal(new)
        if self.record:
            new.f_trace = [*state.f_trace, f]
            new.omega_trace = [*state.omega_trace, omega]
        return new, Info(new.objective)

    def keep(self, frozen: torch.Tensor, old: GibbsState, new: GibbsState) -> GibbsState:
        """The default selection on the tensor fields; the recorded traces and the random
        streams are the new state's (a sampler is run without a tolerance anyway)."""
        bare = dict(f_trace=None, omega_trace=None, rng=None)
        kept = super().keep(frozen, replace(old, **bare), replace(new, **bare))
        return replace(kept, f_trace=new.f_trace, omega_trace=new.omega_trace, rng=new.rng)

    def guide(self, state: GibbsState) -> Callable[..., None]:
        """A Pyro guide of the exact-kernel node model (sites ``f`` and ``omega``).

        Each call picks one chain per node uniformly and returns its current ω (a point
        mass) and a draw of f from the exact conditional p(f | ω, y) = N(Σκ, Σ) of that
        chain (Rao–Blackwellised). A sampler has no variational density, so the guide is
        for drawing posterior samples through Pyro (e.g.
        :func:`probfsl.diagnostics.arviz.draws_from_guide`), not for an ELBO.
        """
        omega, mask = state.omega, state.mask

        def guide(x, y, mask_, keys=None):
            V, S, n = omega.shape
            pick = torch.randint(S, (V,), device=omega.device, generator=self.generator)
            w = omega[torch.arange(V, device=omega.device), pick]  # [V, n]
            chosen = replace(state, omega=w.unsqueeze(1), rng=None)
            f = self.sample_f(chosen)[:, 0]
            with pyro.plate("nodes", V, dim=-2):
                pyro.sample("f", dist.Delta(f.unsqueeze(-2), event_dim=1))
                with pyro.plate("points", n, dim=-1), pyro.poutine.mask(mask=mask):
                    pyro.sample("omega", dist.Delta(w))

        return guide

    def fit(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        n_sweeps: int = 10,
        keys: torch.Tensor | None = None,
        checked: bool = True,
    ) -> GibbsState:
        """``init`` (with optional per-node stream ``keys``; ``checked`` as there) then
        ``n_sweeps`` sweeps (code default 10), driven by :func:`~probfsl.inference.base.run`."""
        n_sweeps = check_hyperparameter("n_sweeps", n_sweeps, integer=True, nonnegative=True)
        state, _ = run(self, self.init(x, y, mask, keys, checked), n_sweeps)
        return state


def _chol_B(K: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Cholesky of B = I + Ω^½ K Ω^½ for ``K [V, n, n]`` and ``sw = √ω [V, S, n]``.

    B ⪰ I (K is positive definite, ω ≥ 0), so its eigenvalues are at least 1 and the
    factorisation of finite input cannot fail: no check, no host synchronisation.
    """
    B = K.unsqueeze(1) * sw.unsqueeze(-1)
    B.mul_(sw.unsqueeze(-2))
    B.diagonal(dim1=-2, dim2=-1).add_(1.0)
    return torch.linalg.cholesky_ex(B)[0]


def _solve_B(K: torch.Tensor, sw: torch.Tensor, r: torch.Tensor, max_elems: int = 2**25):
    """B⁻¹r for every node and chain (``r [V, S, n]``), B = I + Ω^½KΩ^½ per chain.

    B is formed and factorised for blocks of chains holding at most ``max_elems`` matrix
    entries (memory bound for many chains on large nodes; results do not depend on it).
    """
    V, S, n = sw.shape
    step = max(1, max_elems // max(1, V * n * n))
    if step >= S:
        return torch.cholesky_solve(r.unsqueeze(-1), _chol_B(K, sw)).squeeze(-1)
    out = torch.empty_like(r)
    for a in range(0, S, step):
        b = slice(a, a + step)
        chol = _chol_B(K, sw[:, b])
        out[:, b] = torch.cholesky_solve(r[:, b].unsqueeze(-1), chol).squeeze(-1)
    return out


def _posterior_mean_f(K: torch.Tensor, kappa: torch.Tensor, sw: torch.Tensor, chol_B):
    """m_f = Σκ = Kκ − KΩ^½B⁻¹Ω^½Kκ, ``[V, S, n]``."""
    Kk = (K @ kappa.unsqueeze(-1)).squeeze(-1).unsqueeze(1)
    v = torch.cholesky_solve((sw * Kk).unsqueeze(-1), chol_B).squeeze(-1)
    return Kk - (sw * v) @ K


def augmented_log_marginal(state: GibbsState) -> torch.Tensor:
    """log p(y | ω, X) = ½κᵀΣκ − ½log|B| − n log 2 per node and chain, ``[V, S]`` (§3.2).

    Equal to log N(Ω⁻¹κ | 0, K + Ω⁻¹) + (n/2)log 2π − ½Σlog ω + ½Σκ²/ω − n log 2.
    """
    sw = state.omega.sqrt()
    chol_B = _chol_B(state.K, sw)
    m_f = _posterior_mean_f(state.K, state.kappa, sw, chol_B)
    n = state.mask.sum(-1).to(state.K.dtype).unsqueeze(-1)
    logdet = 2 * chol_B.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return 0.5 * (state.kappa.unsqueeze(1) * m_f).sum(-1) - 0.5 * logdet - n * math.log(2.0)


def gibbs_predict(
    state: GibbsState,
    x_star: torch.Tensor,
    n_points: int = 20,
    chunk: int | None = None,
    return_moments: bool = False,
):
    """p(y_v = 1 | x*) for ``x_star [V, N, D]`` (or ``[N, D]``, shared by all nodes) → ``[V, N]``.

    Per chain: μ* = k*ᵀα, α = κ − Ω m_f (= (K + Ω⁻¹)⁻¹Ω⁻¹κ), σ*² = k** − ‖L_B⁻¹Ω^½k*‖²;
    the node probability is the mean over chains of E[σ(f*)] (Gauss–Hermite). With
    ``return_moments`` also returns μ*, σ*² ``[V, S, N]``.
    """
    if x_star.ndim == 2:
        x_star = x_star.unsqueeze(0).expand(state.x.shape[0], -1, -1)
    V, D = state.x.shape[0], state.x.shape[-1]
    if x_star.ndim != 3 or x_star.shape[0] != V or x_star.shape[-1] != D:
        raise ValueError(f"x_star must be [V={V}, N, D={D}], got {tuple(x_star.shape)}")
    x_star = normalize(x_star)
    sw = state.omega.clamp_min(0).sqrt()
    chol_B = _chol_B(state.K, sw)
    m_f = _posterior_mean_f(state.K, state.kappa, sw, chol_B)
    alpha = state.kappa.unsqueeze(1) - state.omega * m_f  # [V, S, n]
    m = state.mask.to(x_star.dtype)
    if chunk is None:  # keep the [V, S, n, chunk] solve at about 2**23 elements
        chunk = max(16, 2**23 // max(1, state.omega.numel()))
    probs, mus, vars_ = [], [], []
    for start in range(0, x_star.shape[1], chunk):
        xs = x_star[:, start : start + chunk]
        ks = rbf_kernel(state.x, xs, state.outputscale, state.lengthscale) * m.unsqueeze(-1)
        mu = alpha @ ks  # [V, S, N]
        w = torch.linalg.solve_triangular(chol_B, sw.unsqueeze(-1) * ks.unsqueeze(1), upper=False)
        var = (state.outputscale[:, None, None] - w.pow(2).sum(-2)).clamp_min(1e-12)
        probs.append(gauss_hermite_sigmoid(mu, var, n_points).mean(1))
        if return_moments:
            mus.append(mu)
            vars_.append(var)
    p = torch.cat(probs, -1)
    if return_moments:
        return p, torch.cat(mus, -1), torch.cat(vars_, -1)
    return p


# -------------------------------------------------------------------------------- VI


@dataclass
class VITerms:
    """Kernel quantities of the inducing-point node (§3.3 notation)."""

    Kmm: torch.Tensor  # [V, M, M] with jitter (identity on padded inducing points)
    chol_Kmm: torch.Tensor
    A: torch.Tensor  # [V, n, M] = K_nm K_mm⁻¹ (zero rows on padded points)
    Ktilde: torch.Tensor  # [V, n] = K_ii − (A K_mn)_ii
    kappa: torch.Tensor  # [V, n] = y − ½ (0 on padding)
    mask: torch.Tensor  # [V, n] float


@dataclass
class VIState:
    """Variational factors of a batch of inducing-point nodes.

    Attributes:
        data: the tensors given to :meth:`VINodes.init` (x, y, mask, z, zmask, s, l).
        eta: ``[V, M]`` natural parameter Σ̃⁻¹μ̃; ``prec`` ``[V, M, M]`` = Σ̃⁻¹ (= −2H).
        c: ``[V, n]`` PG tilts of q(ω_i) = PG(1, c_i).
        objective: ``[V]`` the ELBO of each node.
        terms: the :class:`VITerms` of ``data`` (computed once; a caller that changes
            the kernel hyper-parameters replaces ``data`` and ``terms`` together).
        moments: (μ̃, Σ̃, chol Σ̃⁻¹) of (η, Λ), cached by :meth:`VINodes.step` so the
            next step does not factorise Λ again; None until computed.
    """

    data: tuple
    eta: torch.Tensor
    prec: torch.Tensor
    c: torch.Tensor
    objective: torch.Tensor
    terms: VITerms
    moments: tuple | None = None


def vi_terms(
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    z: torch.Tensor,
    zmask: torch.Tensor,
    outputscale: torch.Tensor,
    lengthscale: torch.Tensor,
    jitter: float = 1e-2,
) -> VITerms:
    """K_mm, A = K_nm K_mm⁻¹ and K̃ for normalised inputs ``x`` and inducing inputs ``z``."""
    x, z = normalize(x), normalize(z)
    m = mask.to(x.dtype)
    zm = zmask.to(x.dtype)
    Kmm = masked_gram(rbf_kernel(z, z, outputscale, lengthscale), zmask.bool(), jitter)
    chol = safe_cholesky(Kmm)
    Knm = rbf_kernel(x, z, outputscale, lengthscale) * m.unsqueeze(-1) * zm.unsqueeze(-2)
    A = torch.cholesky_solve(Knm.transpose(-1, -2), chol).transpose(-1, -2)
    Ktilde = ((outputscale.unsqueeze(-1) - (A * Knm).sum(-1)) * m).clamp_min(0)
    kappa = (y.to(x.dtype) - 0.5) * m
    return VITerms(Kmm, chol, A, Ktilde, kappa, m)


def q_moments(eta: torch.Tensor, prec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """μ̃ = Λ⁻¹η and Σ̃ = Λ⁻¹ from the natural parameters (Λ = Σ̃⁻¹)."""
    mu, Sigma, _ = _q_factors(eta, prec)
    return mu, Sigma


def _q_factors(eta: torch.Tensor, prec: torch.Tensor):
    """(μ̃, Σ̃, chol Λ): :func:`q_moments` plus the Cholesky factor of Λ = Σ̃⁻¹."""
    chol = safe_cholesky(prec)
    Sigma = torch.cholesky_inverse(chol)
    mu = torch.cholesky_solve(eta.unsqueeze(-1), chol).squeeze(-1)
    return mu, Sigma, chol


def _second_moment(t: VITerms, mu: torch.Tensor, Sigma: torch.Tensor) -> tuple:
    Amu = (t.A @ mu.unsqueeze(-1)).squeeze(-1)
    ASA = ((t.A @ Sigma) * t.A).sum(-1)
    return Amu, ASA


def vi_elbo(
    t: VITerms,
    mu: torch.Tensor,
    Sigma: torch.Tensor,
    c: torch.Tensor,
    code_elbo: bool = False,
    chol_prec: torch.Tensor | None = None,
) -> torch.Tensor:
    """The node ELBO (§3.3, with its constants, so it is a true lower bound on log p(y)).

    L = Σ_i [κ_i(Aμ̃)_i − ½θ_i(K̃_ii + (AΣ̃Aᵀ)_ii + (Aμ̃)_i²) + ½θ_i c_i² − log cosh(c_i/2) − log 2]
        − KL(N(μ̃, Σ̃) ‖ N(0, K_mm)),   θ_i = tanh(c_i/2)/(2c_i).

    ``code_elbo=True`` flips the signs of θ(AΣ̃Aᵀ)_ii and θ(Aμ̃)_i², as the official code
    does (design §3.8; only for reproducing its hyper-parameter gradients).
    ``chol_prec`` (the Cholesky factor of Σ̃⁻¹, when known) gives log|Σ̃| = −log|Σ̃⁻¹|
    without factorising Σ̃.
    """
    Amu, ASA = _second_moment(t, mu, Sigma)
    theta = pg_mean(c)
    if code_elbo:
        quad = t.Ktilde - ASA - Amu.pow(2)
    else:
        quad = t.Ktilde + ASA + Amu.pow(2)
    data = (
        t.kappa * Amu
        - 0.5 * theta * quad
        + 0.5 * theta * c.pow(2)
        - log_cosh(c / 2)
        - math.log(2.0)
    ) * t.mask
    M = mu.shape[-1]
    Kinv_S = torch.cholesky_solve(Sigma, t.chol_Kmm)
    Kinv_mu = torch.cholesky_solve(mu.unsqueeze(-1), t.chol_Kmm).squeeze(-1)
    logdet_K = 2 * t.chol_Kmm.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    if chol_prec is None:
        logdet_S = 2 * safe_cholesky(Sigma).diagonal(dim1=-2, dim2=-1).log().sum(-1)
    else:
        logdet_S = -2 * chol_prec.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    kl = 0.5 * (
        Kinv_S.diagonal(dim1=-2, dim2=-1).sum(-1) + (mu * Kinv_mu).sum(-1) - M + logdet_K - logdet_S
    )
    return data.sum(-1) - kl


class VINodes(Engine):
    """Inducing-point PG-GP nodes with closed-form updates (design §3.3), batched over nodes.

    ``init(x, y, mask, z, zmask, outputscale, lengthscale)``; a step is (1) the exact
    maximiser c_i = √(K̃_ii + (AΣ̃Aᵀ)_ii + (Aμ̃)_i²) then (2) the natural-parameter update
    η ← (1−ρ)η + ρAᵀκ, Λ ← (1−ρ)Λ + ρ(K_mm⁻¹ + AᵀΘA) (full batch, so n/|B| = 1). With
    ρ = ``natural_lr`` = 1 each update is the exact coordinate optimum, so the ELBO never
    decreases. The code's default ρ = 0.1 (paper 0.05) is for mini-batch SGD with DKL.
    Its Pyro model is :func:`probfsl.models.gp_tree.model.gp_tree_model` (one row per node).

    A step makes one host synchronisation: :func:`safe_cholesky`'s check of the
    factorisation of Λ (the jitter retry must know whether it failed).
    """

    maximize = True

    def __init__(self, jitter: float = 1e-2, natural_lr: float = 1.0, code_elbo: bool = False):
        if not 0 < natural_lr <= 1:
            raise ValueError(f"natural_lr must be in (0, 1], got {natural_lr}")
        self.jitter = jitter
        self.natural_lr = natural_lr
        self.code_elbo = code_elbo

    def terms(self, state_or_data) -> VITerms:
        data = state_or_data.data if isinstance(state_or_data, VIState) else state_or_data
        return vi_terms(*data, jitter=self.jitter)

    def init(self, x, y, mask, z, zmask, outputscale, lengthscale) -> VIState:
        """η = 0, Λ = I (H = −½I), c = 1 (design §3.3)."""
        check_node_data(x, y, mask)
        if z.ndim != 3 or z.shape[0] != x.shape[0] or z.shape[-1] != x.shape[-1]:
            raise ValueError(f"z must be [V, M, D] matching x, got {tuple(z.shape)}")
        if not torch.isfinite(z).all():
            raise ValueError("z contains NaN or inf")
        data = (x, y, mask, z, zmask, outputscale, lengthscale)
        return self.init_from_terms(data, self.terms(data))

    def init_from_terms(self, data: tuple, t: VITerms) -> VIState:
        """:meth:`init` (without the input checks) given the kernel terms of ``data``
        already computed, e.g. by a caller that also needs them with gradients."""
        eta, prec, c = self.initial_factors(t.A.shape[0], t.A.shape[-1], t.A)
        moments = _q_factors(eta, prec)
        mu, Sigma, chol = moments
        elbo = vi_elbo(t, mu, Sigma, c, self.code_elbo, chol)
        return VIState(data, eta, prec, c, elbo, t, moments)

    @staticmethod
    def initial_factors(V: int, M: int, like: torch.Tensor):
        """η = 0, Λ = I, c = 1 (``like`` gives dtype, device and the number of points)."""
        eta = like.new_zeros(V, M)
        prec = torch.eye(M, dtype=like.dtype, device=like.device).expand(V, M, M).clone()
        return eta, prec, like.new_ones(V, like.shape[1])

    def update_c(self, t: VITerms, mu, Sigma) -> torch.Tensor:
        Amu, ASA = _second_moment(t, mu, Sigma)
        return (t.Ktilde + ASA + Amu.pow(2)).clamp_min(0).sqrt()

    def update_q(self, t: VITerms, c, eta, prec) -> tuple[torch.Tensor, torch.Tensor]:
        theta = pg_mean(c) * t.mask
        Kinv = torch.cholesky_inverse(t.chol_Kmm)
        target_prec = Kinv + t.A.transpose(-1, -2) @ (theta.unsqueeze(-1) * t.A)
        target_eta = (t.A.transpose(-1, -2) @ t.kappa.unsqueeze(-1)).squeeze(-1)
        rho = self.natural_lr
        prec = (1 - rho) * prec + rho * target_prec
        prec = 0.5 * (prec + prec.transpose(-1, -2))
        return (1 - rho) * eta + rho * target_eta, prec

    def step(self, state: VIState) -> tuple[VIState, Info]:
        """c then q(f̄) (§3.3 steps 1–2) with the state's kernel terms, and the new ELBO.

        The moments of the new q(f̄) are cached in the returned state.
        """
        t = state.terms
        mu, Sigma, _ = state.moments or _q_factors(state.eta, state.prec)
        c = self.update_c(t, mu, Sigma)
        eta, prec = self.update_q(t, c, state.eta, state.prec)
        moments = _q_factors(eta, prec)
        mu, Sigma, chol = moments
        elbo = vi_elbo(t, mu, Sigma, c, self.code_elbo, chol)
        new = VIState(state.data, eta, prec, c, elbo, t, moments)
        return new, Info(elbo)

    def guide(self, state: VIState) -> Callable[..., None]:
        """Pyro guide of :func:`~probfsl.models.gp_tree.model.gp_tree_model`: f̄_v ~ q(f̄_v)
        = N(μ̃_v, Σ̃_v), f_v | f̄_v ~ p(f_v | f̄_v), ω_vi ~ q(ω_vi) = PG(1, c_vi).

        Pyro has no Pólya-Gamma distribution: q(ω) is
        :class:`~probfsl.inference.polya_gamma.PolyaGamma`, whose ``log_prob`` is the
        exponentially tilted PG(1, 0) density (so ``Trace_ELBO`` can score it).
        """
        t = state.terms
        mu, Sigma = q_moments(state.eta, state.prec)
        c = state.c

        def guide(x, y, mask, z, zmask, outputscale, lengthscale):
            with pyro.plate("nodes", x.shape[0], dim=-2):
                fbar = pyro.sample(
                    "fbar", dist.MultivariateNormal(mu.unsqueeze(-2), Sigma.unsqueeze(-3))
                )
                node_sites(t, fbar, c)

        return guide

    def predict(
        self, state: VIState, x_star: torch.Tensor, n_points: int = 20, return_moments=False
    ):
        """p(y_v = 1 | x*) = GH-E[σ], μ* = k*ᵀK⁻¹μ̃, σ*² = k** − k*ᵀK⁻¹k* + k*ᵀK⁻¹Σ̃K⁻¹k*."""
        x, y, mask, z, zmask, s, ls = state.data
        if x_star.ndim == 2:
            x_star = x_star.unsqueeze(0).expand(x.shape[0], -1, -1)
        t = state.terms
        mu, Sigma = q_moments(state.eta, state.prec)
        mean, var = vi_predictive_moments(t, mu, Sigma, z, zmask, s, ls, x_star)
        p = gauss_hermite_sigmoid(mean, var, n_points)
        return (p, mean, var) if return_moments else p


def vi_predictive_moments(t, mu, Sigma, z, zmask, s, ls, x_star):
    """Predictive mean and variance ``[V, N]`` of the inducing-point node (§3.3)."""
    zn, xs = normalize(z), normalize(x_star)
    Kms = rbf_kernel(zn, xs, s, ls) * zmask.to(xs.dtype).unsqueeze(-1)
    a = torch.cholesky_solve(Kms, t.chol_Kmm)  # [V, M, N]
    mean = (a * mu.unsqueeze(-1)).sum(-2)
    var = s.unsqueeze(-1) - (Kms * a).sum(-2) + (a * (Sigma @ a)).sum(-2)
    return mean, var.clamp_min(1e-12)


# ------------------------------------------------------- Pyro sites of an inducing node


def node_sites(t: VITerms, fbar: torch.Tensor, c: torch.Tensor | None) -> None:
    """Sites shared by the model (``c`` None) and the guide of inducing-point nodes.

    f_vi | f̄_v ~ N((A f̄_v)_i, K̃_ii) (the SVGP conditional: only its marginals enter
    the likelihood, so the ELBO is unchanged by treating the f_vi as conditionally
    independent, Hensman et al. 2015), ω_vi ~ PG(1, c_vi) in the guide and PG(1, 0) in
    the model, where y_vi enters through p(y, ω | f) = ½ exp(κf − ωf²/2) PG(ω | 1, 0)
    (the augmented likelihood, §2). Called inside the ``nodes`` plate (dim −2); ``fbar``
    is ``[V, 1, M]``.
    """
    fbar = fbar.squeeze(-2)
    loc = (t.A @ fbar.unsqueeze(-1)).squeeze(-1)
    scale = t.Ktilde.clamp_min(1e-10).sqrt()
    mask = t.mask.bool()
    with pyro.plate("points", t.A.shape[1], dim=-1), pyro.poutine.mask(mask=mask):
        f = pyro.sample("f", dist.Normal(loc, scale))
        tilt = torch.zeros_like(t.kappa) if c is None else c
        omega = pyro.sample("omega", PolyaGamma(tilt))
        if c is None:
            pyro.factor("y", t.kappa * f - omega * f.pow(2) / 2 - math.log(2.0))
