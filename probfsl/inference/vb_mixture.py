"""Mean-field VB for BAVARDAGE's isotropic Gaussian mixture, with the adaptive projection.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), §3.3-3.4, Algorithm 1 and
Appendix 6.2 (eq. 3-5, 24); implementation spec ``bavardage.md`` §3.5-3.9.

The model (:mod:`probfsl.models.bavardage`) in the reduced space u ∈ R^d, Λ = τ I:
π ~ Dir(α_o 1_K) (or fixed uniform, "balanced"), μ_k ~ N(m_o = 0, (β_o τ)^{-1} I),
z_n ~ Cat(π) for the queries, u_n ~ N(μ_{z_n}, τ^{-1} I), the support z observed.
The mean-field factors are q(π) = Dir(α), q(μ_k) = N(m_k, (β_k τ)^{-1} I), q(z_n) = Cat(o_n).

:class:`BavardageVB` is an :class:`~probfsl.inference.base.Engine`. Its data are
``(x_support [T, S, D], support_labels [T, S], x_query [T, Q, D])`` and an optional
initial responsibility tensor. What u is depends on ``projection``:

* ``"frozen"``: u = the adaptive PLDA projection of x computed once from the initial
  responsibilities, then held fixed. Every step is coordinate ascent on the ELBO of
  §3.9, which therefore never decreases (the conformance and monotone tests use it).
  With ``d = D`` data already in the reduced space use ``"identity"`` instead.
* ``"adaptive"``: the projection is refitted from the current responsibilities before
  every M step (BAVARDAGE, spec §3.8). The ELBO is then not monotone, since u changes.
* ``"identity"``: u = x (VB in the full feature space, the "no PLDA" ablation; also the
  mode for data that already are the reduced u).
* ``"adaptive_gram"``: ``"adaptive"`` where the data rows are the rows of each task's
  whitened Gram matrix (support = K[:, :S], query = K[:, S:], K [T, N, N]); every
  projection then works on [N, N] matrices only
  (:func:`~probfsl.inference.plda.centroid_projection_gram`), the fast path of spec §8.

``init`` computes the projection and performs the M step; ``step`` performs the E step,
(re)projects (adaptive mode) and the M step, so n_vb iterations of the reference loop
"PLDA, M, E" are ``init`` + (n_vb - 1) ``step`` + a final :meth:`BavardageVB.e_step`
(:func:`fit_bavardage_vb`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.base import Engine
from probfsl.inference.kmeans import softmax_last
from probfsl.inference.plda import (
    GlobalWhitening,
    centroid_projection,
    centroid_projection_gram,
)
from probfsl.validation import check_task_tensors

PROJECTIONS = ("adaptive", "frozen", "identity", "adaptive_gram")
LOG_2PI = math.log(2 * math.pi)


@dataclass
class VBMixtureState:
    """Variational factors of a batch of tasks (support rows first, then the queries).

    Attributes:
        x: features the projection acts on, [T, N, D].
        support_labels: [T, S] observed labels of the first S rows.
        u: the data of the model (projected features), [T, N, d].
        resp: o, [T, N, K]; support rows are one-hot.
        alpha: q(π) = Dir(alpha), [T, K]; None in the balanced model (π fixed uniform).
        beta: q(μ_k) precision factors β_k, [T, K] (precision β_k τ).
        mean: q(μ_k) means m_k, [T, K, d].
        objective: the ELBO of spec §3.9 for the current factors and u, [T]; None for an
            intermediate state of a loop that skipped it (``objective=False``).
    """

    x: torch.Tensor
    support_labels: torch.Tensor
    u: torch.Tensor
    resp: torch.Tensor
    alpha: torch.Tensor | None
    beta: torch.Tensor
    mean: torch.Tensor
    objective: torch.Tensor | None

    @property
    def n_support(self) -> int:
        return self.support_labels.shape[1]

    @property
    def query_resp(self) -> torch.Tensor:
        """q(z) of the queries, [T, Q, K]."""
        return self.resp[:, self.n_support :]


class BavardageVB(Engine):
    """Closed-form mean-field VB (spec §3.6-3.7) with BAVARDAGE's adaptive projection (§3.5).

    Args:
        way: K, the number of classes.
        tau: τ = T_vb, the fixed isotropic precision Λ = τ I.
        alpha0: α_o of the symmetric Dirichlet prior on π.
        beta0: β_o of the prior μ_k ~ N(0, (β_o τ)^{-1} I).
        gamma: shrinkage γ of the centroids defining the projection (eq. 8); default β_o.
        balanced: π fixed uniform (the code's balanced mode: no α, no digamma term).
        count_support: the paper's α_k = α_o + N_k (support counted; the support labels are
            then draws of π too). Default False: the code's α_k = α_o + N_k - L.
        projection: ``"adaptive"``, ``"frozen"``, ``"identity"`` or ``"adaptive_gram"``
            (module docstring).
        metric: when x are not whitened rows but rows whose whitened metric is given by a
            :class:`~probfsl.inference.plda.GlobalWhitening` (the fast global mode).
    """

    maximize = True

    def __init__(
        self,
        way: int,
        tau: float = 4.0,
        alpha0: float = 2.0,
        beta0: float = 10.0,
        gamma: float | None = None,
        balanced: bool = False,
        count_support: bool = False,
        projection: str = "frozen",
        metric: GlobalWhitening | None = None,
    ) -> None:
        if way < 2:
            raise ValueError(f"way must be at least 2, got {way}")
        for name, value in (("tau", tau), ("alpha0", alpha0), ("beta0", beta0)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
        self.way, self.tau, self.alpha0, self.beta0 = way, float(tau), float(alpha0), float(beta0)
        self.gamma = float(beta0 if gamma is None else gamma)
        self.balanced, self.count_support = balanced, count_support
        self.projection, self.metric = projection, metric

    # ------------------------------------------------------------------ data and init
    def _check(self, support, support_labels, query, resp) -> None:
        check_task_tensors(support, support_labels, query, self.way)
        n = support.shape[1] + query.shape[1]
        if resp is not None and resp.shape != (support.shape[0], n, self.way):
            raise ValueError(
                f"resp must be [T, N, K]={(support.shape[0], n, self.way)}, got {tuple(resp.shape)}"
            )

    def init(
        self,
        support: torch.Tensor,
        support_labels: torch.Tensor,
        query: torch.Tensor,
        resp: torch.Tensor | None = None,
        *,
        objective: bool = True,
    ) -> VBMixtureState:
        """Project with the initial responsibilities ``resp`` [T, N, K] and do the M step.

        Without ``resp`` the queries start uniform over the classes. The support rows of
        ``resp`` are reset to the one-hot labels. ``objective=False`` skips the ELBO.
        """
        self._check(support, support_labels, query, resp)
        x = torch.cat([support, query], 1)
        onehot = torch.nn.functional.one_hot(support_labels, self.way).to(x.dtype)
        if resp is None:
            resp = x.new_full((x.shape[0], query.shape[1], self.way), 1.0 / self.way)
        else:
            resp = resp[:, support.shape[1] :].to(x)
        resp = torch.cat([onehot, resp], 1)
        u = x if self.projection == "identity" else self._project(x, resp)
        empty = x.new_zeros(x.shape[0])
        state = VBMixtureState(x, support_labels, u, resp, None, empty, empty, empty)
        return self.m_step(state, objective)

    def _project(self, x: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        if self.projection == "adaptive_gram":
            return centroid_projection_gram(x, resp, self.gamma)
        return centroid_projection(x, resp, self.gamma, self.metric)

    # ------------------------------------------------------------------ updates
    def step(self, state: VBMixtureState, objective: bool = True) -> VBMixtureState:
        """E step, then (adaptive mode) the PLDA refit, then the M step.

        The objective is evaluated once, after the M step (use :meth:`e_step` and
        :meth:`m_step` separately to see the ELBO after each update); ``objective=False``
        skips it (the state's objective is then None).
        """
        state = replace(state, resp=self._update_resp(state))
        if self.projection in ("adaptive", "adaptive_gram"):
            state = replace(state, u=self._project(state.x, state.resp))
        return self.m_step(state, objective)

    def m_step(self, state: VBMixtureState, objective: bool = True) -> VBMixtureState:
        """Spec §3.6 (paper eq. 3-4): q(π) and q(μ) given q(z).

        β_k = β_o + N_k, m_k = (β_o m_o + Σ_n o_nk u_n) / β_k with m_o = 0, and
        α_k = α_o + N_k - L (code; queries only) or α_o + N_k (``count_support``).
        """
        resp, u = state.resp, state.u
        counts = resp.sum(1)  # N_k over support and queries, [T, K]
        beta = self.beta0 + counts
        mean = resp.transpose(1, 2) @ u / beta.unsqueeze(-1)
        alpha = None
        if not self.balanced:
            n_k = counts if self.count_support else state.query_resp.sum(1)
            alpha = self.alpha0 + n_k
        new = replace(state, alpha=alpha, beta=beta, mean=mean)
        return replace(new, objective=self.elbo(new) if objective else None)

    def log_rho(self, state: VBMixtureState) -> torch.Tensor:
        """Spec §3.7 (paper eq. 24): ln ρ_nk for every row, [T, N, K].

        ln ρ_nk = ψ(α_k) - ψ(Σ_j α_j) - (τ/2)||u_n - m_k||^2 - (d/2) ln 2π - d/(2β_k)
        + (d/2) ln τ; the digamma term is absent in the balanced model.
        """
        u, m, beta = state.u, state.mean, state.beta
        d = u.shape[-1]
        sq = (
            u.square().sum(-1, keepdim=True)
            - 2 * u @ m.transpose(1, 2)
            + m.square().sum(-1).unsqueeze(1)
        ).clamp_min(0)
        out = -0.5 * self.tau * sq - (d / (2 * beta)).unsqueeze(1)
        out = out + 0.5 * d * (math.log(self.tau) - LOG_2PI)
        if state.alpha is not None:
            out = out + self.expected_log_pi(state.alpha).unsqueeze(1)
        return out

    def _update_resp(self, state: VBMixtureState) -> torch.Tensor:
        n_s = state.n_support
        log_rho = self.log_rho(state)[:, n_s:]
        return torch.cat([state.resp[:, :n_s], softmax_last(log_rho)], 1)

    def e_step(self, state: VBMixtureState) -> VBMixtureState:
        """Spec §3.7: o_n = softmax(ln ρ_n) for the queries; the support rows stay one-hot.

        The softmax is the exact, max-shifted one (so this is a coordinate-ascent step);
        the reference code adds float32 eps to numerator and denominator, which changes
        o by at most about 1e-6.
        """
        new = replace(state, resp=self._update_resp(state))
        return replace(new, objective=self.elbo(new))

    # ------------------------------------------------------------------ ELBO
    @staticmethod
    def expected_log_pi(alpha: torch.Tensor) -> torch.Tensor:
        """⟨ln π_k⟩ = ψ(α_k) - ψ(Σ_j α_j) under Dir(α)."""
        return expfam.Dirichlet(alpha).expected_stats()[0]

    def elbo(self, state: VBMixtureState) -> torch.Tensor:
        """The ELBO of spec §3.9 for a fixed u, [T] (its balanced and paper variants too)."""
        u, m, beta, resp = state.u, state.mean, state.beta, state.resp
        d, k = u.shape[-1], self.way
        tau = self.tau
        sq = (
            u.square().sum(-1, keepdim=True)
            - 2 * u @ m.transpose(1, 2)
            + m.square().sum(-1).unsqueeze(1)
        ).clamp_min(0)
        # line 1: E ln N(u_n | μ_k, τ^{-1} I), all rows
        lik = 0.5 * d * (math.log(tau) - LOG_2PI) - 0.5 * tau * sq - (d / (2 * beta)).unsqueeze(1)
        total = (resp * lik).sum((1, 2))
        # line 4 + line 7: E ln p(μ) + H[q(μ)]
        b0t = self.beta0 * tau
        prior_mu = (
            0.5 * d * (math.log(b0t) - LOG_2PI)
            - 0.5 * b0t * m.square().sum(-1)
            - d * self.beta0 / (2 * beta)
        )
        h_mu = 0.5 * d * (1 + LOG_2PI - torch.log(beta * tau))
        total = total + (prior_mu + h_mu).sum(-1)
        # line 5: H[q(z)] of the queries
        q_resp = state.query_resp
        total = total - torch.special.xlogy(q_resp, q_resp).sum((1, 2))
        if state.alpha is None:  # balanced: E ln p(z) = -ln K per query
            return total - math.log(k) * q_resp.sum((1, 2))
        q_pi = expfam.Dirichlet(state.alpha)
        e_log_pi = q_pi.expected_stats()[0]
        z_resp = resp if self.count_support else q_resp
        total = total + (z_resp.sum(1) * e_log_pi).sum(-1)  # line 2
        # line 3 + line 6: E ln Dir(π | α_o) - E ln q(π) = -KL(q(π) ‖ Dir(α_o))
        return total - q_pi.kl(expfam.Dirichlet(torch.full_like(state.alpha, self.alpha0)))

    # ------------------------------------------------------------------ guide
    def guide(self, state: VBMixtureState):
        """Pyro guide for :func:`probfsl.models.bavardage.bavardage_model` (data = u)."""
        alpha, beta, mean, q_resp, tau = (
            state.alpha,
            state.beta,
            state.mean,
            state.query_resp,
            self.tau,
        )

        def guide(u_support, support_labels, u_query, *args, **kwargs) -> None:
            with pyro.plate("tasks", u_support.shape[0], dim=-2):
                if alpha is not None:
                    pyro.sample("pi", dist.Dirichlet(alpha.unsqueeze(-2)))
                with pyro.plate("classes", mean.shape[1], dim=-1):
                    scale = (beta * tau).rsqrt().unsqueeze(-1).expand_as(mean)
                    pyro.sample("mu", dist.Normal(mean, scale).to_event(1))
                with pyro.plate("queries", q_resp.shape[1], dim=-1):
                    pyro.sample("z", dist.Categorical(probs=q_resp))

        return guide


@dataclass
class BavardageFit:
    """Result of :func:`fit_bavardage_vb`: the final state (whose ``objective`` is the final
    ELBO) and, when traced, the ELBO after every update."""

    state: VBMixtureState
    elbo_trace: torch.Tensor | None  # [n_vb + 1, T]: after each M step, then the final E step


def fit_bavardage_vb(
    engine: BavardageVB,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    resp: torch.Tensor | None = None,
    n_iter: int = 5,
    trace: bool = True,
) -> BavardageFit:
    """The reference loop of spec §3.8: ``n_iter`` x (PLDA projection, M step, E step).

    The returned state's ``query_resp`` are BAVARDAGE's query probabilities. Without
    ``trace`` only the final ELBO is computed (about 8% of the work at n_iter = 5).
    """
    if n_iter < 1:
        raise ValueError(f"n_iter must be at least 1, got {n_iter}")
    state = engine.init(support, support_labels, query, resp, objective=trace)
    elbos = [state.objective]
    for _ in range(n_iter - 1):
        state = engine.step(state, objective=trace)
        elbos.append(state.objective)
    state = engine.e_step(state)
    elbos.append(state.objective)
    return BavardageFit(state, torch.stack(elbos) if trace else None)
