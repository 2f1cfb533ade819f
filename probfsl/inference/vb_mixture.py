"""Mean-field VB for BAVARDAGE's isotropic Gaussian mixture, with the adaptive projection.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), §3.3-3.4, Algorithm 1 and
Appendix 6.2 (eq. 3-5, 24); design: docs/design/bavardage.md §3.5-3.9.

The model (:func:`probfsl.derived.bavardage.bavardage_model`) in the reduced space
u ∈ R^d, Λ = τ I: π ~ Dir(α_o 1_K) (or fixed uniform, "balanced"),
μ_k ~ N(m_o = 0, (β_o τ)^{-1} I), z_n ~ Cat(π) for the queries, u_n ~ N(μ_{z_n}, τ^{-1} I),
the support z observed. The mean-field factors are q(π) = Dir(α),
q(μ_k) = N(m_k, (β_k τ)^{-1} I), q(z_n) = Cat(o_n).

:class:`BavardageVB` is an :class:`~probfsl.inference.base.Engine`. Its data are
``(x_support [T, S, D], support_labels [T, S], x_query [T, Q, D])`` and optional initial
responsibilities ``[T, N, K]``; u = x P is a linear projection of the rows x, with P
depending on ``projection``:

* ``"identity"``: u = x (VB in the full feature space, the "no PLDA" ablation; also the
  mode for data that already are the reduced u).
* ``"frozen"``: P is the adaptive PLDA projection (design §3.5, eq. 8-9) computed once from
  the initial responsibilities, then held fixed.
* ``"adaptive"`` (BAVARDAGE, design §3.8): P is recomputed from the current
  responsibilities at every step (:func:`~probfsl.inference.plda.centroid_projection`).
* ``"adaptive_gram"``: ``"adaptive"`` where the rows are those of each task's whitened
  Gram matrix (support = K[:, :S], query = K[:, S:], K [T, N, N]); every projection then
  works on [N, N] matrices only (:func:`~probfsl.inference.plda.centroid_projection_gram`,
  the fast path of design §8).

The engine:

* ``init``: the projection from the initial responsibilities, then the M step;
* ``step`` = :meth:`~BavardageVB.e_step`, :meth:`~BavardageVB.project` (adaptive modes),
  :meth:`~BavardageVB.m_step`; ``state.objective`` is the ELBO after the M step, and
  :class:`VBMixtureInfo` also reports the ELBO after the E step (before the projection
  update), which costs nothing extra (the log-normaliser of the E step's softmax);
* :func:`fit_bavardage_vb`: the reference loop of design §3.8, n_iter x (projection, M, E),
  is ``init``, ``n_iter - 1`` steps driven by :func:`~probfsl.inference.base.run` and a
  final closed-form E step.

What holds (tested in ``tests/test_bavardage_engine.py``, in the estimator's production
configuration too):

* For a fixed u every update is coordinate ascent on the ELBO of design §3.9: the E step
  (o_n = softmax ln ρ_n) maximises it over q(z), the M step over q(π), q(μ). So with
  ``"identity"`` and ``"frozen"`` the ELBO never decreases, after any update.
* With the adaptive projection, u changes at every step, and ELBOs under different P
  bound the evidence of different data: the trace need not be monotone across steps.
  Within a block where P is fixed (from one M step to the next E step), the ELBO does
  not decrease (Info's ``objective_e`` ≥ the previous state's objective), and after an
  update the M step does not lower the ELBO of the new u (objective ≥ the ELBO of the
  new u under the previous factors).
* P is not random: it is a deterministic function of the rows and of the
  responsibilities before the update. Given P, every state is a mean-field posterior of
  the model on u = x P, and Pyro's ``Trace_ELBO`` of (model on u, :meth:`BavardageVB.guide`)
  equals the analytic ELBO ``state.objective``.

Every tensor is made on the data's device and in its dtype, and ``step`` makes no host
synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.base import Engine, Info, RunInfo, run
from probfsl.inference.class_stats import one_hot_support
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
        x: rows the projection acts on, [T, N, D].
        support_labels: [T, S] observed labels of the first S rows.
        u: the data of the model, u = x P (projected rows), [T, N, d].
        resp: o, [T, N, K]; support rows are one-hot.
        alpha: q(π) = Dir(alpha), [T, K]; None in the balanced model (π fixed uniform).
        beta: q(μ_k) precision factors β_k, [T, K] (precision β_k τ).
        mean: q(μ_k) means m_k, [T, K, d].
        objective: the ELBO of design §3.9 for the current factors and u, [T].
    """

    x: torch.Tensor
    support_labels: torch.Tensor
    u: torch.Tensor
    resp: torch.Tensor
    alpha: torch.Tensor | None
    beta: torch.Tensor
    mean: torch.Tensor
    objective: torch.Tensor

    @property
    def n_support(self) -> int:
        return self.support_labels.shape[1]

    @property
    def query_resp(self) -> torch.Tensor:
        """q(z) of the queries, [T, Q, K]."""
        return self.resp[:, self.n_support :]


@dataclass(frozen=True)
class VBMixtureInfo(Info):
    """What :meth:`BavardageVB.step` reports.

    Attributes:
        objective: [T] the ELBO after the step (after its M step, under the new projection).
        objective_e: [T] the ELBO after the step's E step, under the projection of the
            previous step (no smaller than the previous state's objective).
    """

    objective_e: torch.Tensor


def squared_distances(u: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """||u_n - m_k||^2 [T, N, K] from u [T, N, d] and m [T, K, d] (expanded, clamped at 0)."""
    return (
        u.square().sum(-1, keepdim=True)
        - 2 * u @ mean.transpose(1, 2)
        + mean.square().sum(-1).unsqueeze(1)
    ).clamp_min(0)


def _softmax_and_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the last dimension and its log-normaliser [..., 1]; the softmax takes
    the same operations as :func:`probfsl.inference.class_stats.softmax_last`."""
    peak = logits.amax(-1, keepdim=True)
    e = (logits - peak).exp_()
    total = e.sum(-1, keepdim=True)
    return e.div_(total), peak + total.log()


class BavardageVB(Engine):
    """Closed-form mean-field VB (design §3.6-3.7) with BAVARDAGE's adaptive projection (§3.5).

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
            :class:`~probfsl.inference.plda.GlobalWhitening` (the D-wide global mode).
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
    ) -> VBMixtureState:
        """Project with the initial responsibilities ``resp`` [T, N, K] and do the M step.

        Without ``resp`` the queries start uniform over the classes. The support rows of
        ``resp`` are reset to the one-hot labels.
        """
        self._check(support, support_labels, query, resp)
        x = torch.cat([support, query], 1)
        onehot = one_hot_support(support_labels, self.way, x.dtype)
        if resp is None:
            resp = x.new_full((x.shape[0], query.shape[1], self.way), 1.0 / self.way)
        else:
            resp = resp[:, support.shape[1] :].to(x)
        resp = torch.cat([onehot, resp], 1)
        empty = x.new_zeros(x.shape[0])
        state = VBMixtureState(x, support_labels, x, resp, None, empty, empty, empty)
        if self.projection != "identity":
            state = replace(state, u=self.rows(x, resp))
        return self.m_step(state)

    def rows(self, x: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        """u = x P with P the adaptive PLDA projection of the responsibilities ``resp``
        (design §3.5, eq. 8-9): the model's data, for every mode but ``"identity"``."""
        if self.projection == "adaptive_gram":
            return centroid_projection_gram(x, resp, self.gamma)
        return centroid_projection(x, resp, self.gamma, self.metric)

    # ------------------------------------------------------------------ updates
    def step(self, state: VBMixtureState) -> tuple[VBMixtureState, VBMixtureInfo]:
        """E step, the projection update (adaptive modes), then the M step."""
        after_e = self.e_step(state)
        new = self.m_step(self.project(after_e))
        return new, VBMixtureInfo(new.objective, after_e.objective)

    def project(self, state: VBMixtureState) -> VBMixtureState:
        """Design §3.5: u = x P with P from the current responsibilities (adaptive modes).

        The factors and the objective are left as they were (they belong to the old u);
        in the other modes the state is returned unchanged.
        """
        if self.projection not in ("adaptive", "adaptive_gram"):
            return state
        return replace(state, u=self.rows(state.x, state.resp))

    def m_step(self, state: VBMixtureState) -> VBMixtureState:
        """Design §3.6 (paper eq. 3-4): q(π) and q(μ) given q(z), and the ELBO after it.

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
        return replace(new, objective=self._elbo_after_m(new))

    def _elbo_after_m(self, state: VBMixtureState) -> torch.Tensor:
        """The ELBO of :meth:`elbo` at a state right after the M step, in collapsed form.

        q(μ) and q(π) are then the exact conditionals given q(z), so their part of the
        bound is a log marginal likelihood (Bishop 2006, §10.1.1; §10.2 for the mixture):
        with o_n· = Σ_k o_nk and N_k = Σ_n o_nk,

            Σ_k [(d/2) ln(β_o/β_k) + (τ/2) β_k ||m_k||^2] + (d/2) ln(τ/2π) Σ_k N_k
            - (τ/2) Σ_n o_n· ||u_n||^2 + H[q(z)] + ln B(α) - ln B(α_o 1_K),

        ln B(a) = Σ_k ln Γ(a_k) - ln Γ(Σ_k a_k) (balanced: -ln K Σ_{n query} o_n· instead
        of the Dirichlet term). No [T, N, K] distance is formed.
        """
        u, m, beta, resp, tau = state.u, state.mean, state.beta, state.resp, self.tau
        d = u.shape[-1]
        weight = resp.sum(-1)  # o_n·, [T, N]
        total = 0.5 * d * (math.log(tau) - LOG_2PI) * weight.sum(-1)
        total = total - 0.5 * tau * (weight * u.square().sum(-1)).sum(-1)
        per_class = 0.5 * d * torch.log(self.beta0 / beta) + 0.5 * tau * beta * m.square().sum(-1)
        q_resp = state.query_resp
        total = total + per_class.sum(-1) - torch.special.xlogy(q_resp, q_resp).sum((1, 2))
        if state.alpha is None:
            return total - math.log(self.way) * q_resp.sum((1, 2))
        alpha = state.alpha
        log_b = torch.lgamma(alpha).sum(-1) - torch.lgamma(alpha.sum(-1))
        log_b0 = self.way * math.lgamma(self.alpha0) - math.lgamma(self.way * self.alpha0)
        return total + log_b - log_b0

    def expected_log_lik(self, state: VBMixtureState) -> torch.Tensor:
        """E_q ln N(u_n | μ_k, τ^{-1} I) for every row and class, [T, N, K]:
        -(τ/2)||u_n - m_k||^2 - d/(2β_k) + (d/2)(ln τ - ln 2π)."""
        d = state.u.shape[-1]
        out = -0.5 * self.tau * squared_distances(state.u, state.mean)
        out = out - (d / (2 * state.beta)).unsqueeze(1)
        return out + 0.5 * d * (math.log(self.tau) - LOG_2PI)

    def log_rho(self, state: VBMixtureState) -> torch.Tensor:
        """Design §3.7 (paper eq. 24): ln ρ_nk for every row, [T, N, K].

        ln ρ_nk = ψ(α_k) - ψ(Σ_j α_j) + E ln N(u_n | μ_k, τ^{-1} I)
        (:meth:`expected_log_lik`); the digamma term is absent in the balanced model.
        """
        out = self.expected_log_lik(state)
        if state.alpha is not None:
            out = out + self.expected_log_pi(state.alpha).unsqueeze(1)
        return out

    def e_step(self, state: VBMixtureState) -> VBMixtureState:
        """Design §3.7: o_n = softmax(ln ρ_n) for the queries; the support rows stay one-hot.

        The softmax is the exact, max-shifted one (so this is a coordinate-ascent step);
        the reference code adds float32 eps to numerator and denominator, which changes
        o by at most about 1e-6. The ELBO after the update needs no further pass: for a
        query, Σ_k o_nk (ln ρ_nk - ln o_nk) = ln Σ_k ρ_nk, the softmax's log-normaliser.
        """
        n_s = state.n_support
        log_lik = self.expected_log_lik(state)
        log_rho = log_lik[:, n_s:]
        if state.alpha is not None:
            log_rho = log_rho + self.expected_log_pi(state.alpha).unsqueeze(1)
        q_resp, log_norm = _softmax_and_logsumexp(log_rho)
        query = log_norm.squeeze(-1).sum(-1)
        if state.alpha is None:  # balanced: E ln p(z_n) = -ln K
            query = query - math.log(self.way) * q_resp.shape[1]
        new = replace(state, resp=torch.cat([state.resp[:, :n_s], q_resp], 1))
        return replace(new, objective=self._elbo(new, log_lik, query))

    # ------------------------------------------------------------------ ELBO
    @staticmethod
    def expected_log_pi(alpha: torch.Tensor) -> torch.Tensor:
        """⟨ln π_k⟩ = ψ(α_k) - ψ(Σ_j α_j) under Dir(α)."""
        return expfam.Dirichlet(alpha).expected_stats()[0]

    def elbo(self, state: VBMixtureState) -> torch.Tensor:
        """The ELBO of design §3.9 for a fixed u, [T] (its balanced and paper variants too)."""
        log_lik = self.expected_log_lik(state)
        q_resp = state.query_resp
        if state.alpha is None:  # balanced: E ln p(z_n = k) = -ln K
            e_log_pi = log_lik.new_full((1, 1, self.way), -math.log(self.way))
        else:
            e_log_pi = self.expected_log_pi(state.alpha).unsqueeze(1)
        # lines 1-2 (queries) and 5: E ln N(u_n | μ_k) + E ln π_k - ln o_nk, queries
        log_joint = log_lik[:, state.n_support :] + e_log_pi
        query = (q_resp * log_joint).sum((1, 2)) - torch.special.xlogy(q_resp, q_resp).sum((1, 2))
        return self._elbo(state, log_lik, query)

    def _elbo(self, state: VBMixtureState, log_lik: torch.Tensor, query: torch.Tensor):
        """The ELBO given ``log_lik`` (:meth:`expected_log_lik`) and the queries' terms
        ``query`` [T] = Σ_{n query} E_q[ln p(u_n, z_n | π, μ) - ln q(z_n)]."""
        m, beta = state.mean, state.beta
        d, n_s, tau = state.u.shape[-1], state.n_support, self.tau
        support_resp = state.resp[:, :n_s]
        # line 1, support rows: E ln N(u_n | μ_{y_n}, τ^{-1} I)
        total = query + (support_resp * log_lik[:, :n_s]).sum((1, 2))
        # line 4 + line 7: E ln p(μ) + H[q(μ)]
        b0t = self.beta0 * tau
        prior_mu = (
            0.5 * d * (math.log(b0t) - LOG_2PI)
            - 0.5 * b0t * m.square().sum(-1)
            - d * self.beta0 / (2 * beta)
        )
        h_mu = 0.5 * d * (1 + LOG_2PI - torch.log(beta * tau))
        total = total + (prior_mu + h_mu).sum(-1)
        if state.alpha is None:
            return total
        q_pi = expfam.Dirichlet(state.alpha)
        if self.count_support:  # line 2, support rows: the labels are draws of π too
            total = total + (support_resp.sum(1) * q_pi.expected_stats()[0]).sum(-1)
        # line 3 + line 6: E ln Dir(π | α_o) - E ln q(π) = -KL(q(π) ‖ Dir(α_o))
        return total - q_pi.kl(expfam.Dirichlet(torch.full_like(state.alpha, self.alpha0)))

    # ------------------------------------------------------------------ guide
    def guide(self, state: VBMixtureState):
        """Pyro guide for :func:`probfsl.derived.bavardage.bavardage_model` (data = u).

        It samples ``pi`` (unbalanced), ``mu`` and the query labels ``z`` from the factors
        of ``state`` whatever its arguments (the model's data), which only set the shapes.
        """
        alpha, beta, mean, q_resp, tau = (
            state.alpha,
            state.beta,
            state.mean,
            state.query_resp,
            self.tau,
        )

        def guide(*args, **kwargs) -> None:
            with pyro.plate("tasks", mean.shape[0], dim=-2):
                if alpha is not None:
                    pyro.sample("pi", dist.Dirichlet(alpha.unsqueeze(-2)))
                with pyro.plate("classes", mean.shape[1], dim=-1):
                    scale = (beta * tau).rsqrt().unsqueeze(-1).expand_as(mean)
                    pyro.sample("mu", dist.Normal(mean, scale).to_event(1))
                with pyro.plate("queries", q_resp.shape[1], dim=-1):
                    pyro.sample("z", dist.Categorical(probs=q_resp))

        return guide


def fit_bavardage_vb(
    engine: BavardageVB,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    resp: torch.Tensor | None = None,
    n_iter: int = 5,
) -> tuple[VBMixtureState, RunInfo]:
    """The reference loop of design §3.8: ``n_iter`` x (PLDA projection, M step, E step).

    ``engine.init`` (projection, M), ``n_iter - 1`` steps (E, projection, M) driven by
    :func:`~probfsl.inference.base.run`, and a final E step. The returned state's
    ``query_resp`` are BAVARDAGE's query probabilities and its ``objective`` the final
    ELBO; the info's ``trace`` [n_iter + 1, T] holds the ELBO after each M step (each
    under that iteration's projection) and, last, after the final E step.
    """
    if n_iter < 1:
        raise ValueError(f"n_iter must be at least 1, got {n_iter}")
    state, info = run(engine, engine.init(support, support_labels, query, resp), n_iter - 1)
    state = engine.e_step(state)
    return state, info._replace(trace=torch.cat([info.trace, state.objective.unsqueeze(0)]))
