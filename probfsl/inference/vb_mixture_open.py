"""BAVARDAGE's VB mixture with a background component: the open-set posterior.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), extended to few-shot open-set
recognition (Boudiaf, Bennequin et al., "Model-Agnostic Few-Shot Open-Set Recognition",
2022) by one more mixture component (:mod:`probfsl.inference.background`):

    π = (π_0, (1 - π_0) ρ),  π_0 ~ Beta(a_open, a_closed),  ρ ~ Dirichlet(α_o 1_K)
    u_q | z_q = k ~ N(μ_k, τ^{-1} I)  (k = 1..K, BAVARDAGE's classes),
    u_q | z_q = 0 ~ p_0(u)           (the background, a fixed density).

(π_0, ρ) is π ~ Dirichlet(a_open, α_o, ..., α_o) when a_closed = K α_o (aggregation
property); the balanced model keeps ρ uniform and infers π_0 alone. The mean-field factors
are BAVARDAGE's plus q(π_0) = Beta and the queries' background responsibility o_q0:

* E step: o_q0 ∝ exp(E ln π_0) p_0(y_q) and o_qk ∝ exp(E ln(1 - π_0) + E ln ρ_k
  + E ln N(u_q | μ_k, τ^{-1} I)) N(r_q | 0, τ_r^{-1} I);
* M step: BAVARDAGE's q(ρ), q(μ_k) from the class responsibilities only (a query's
  background share pulls no centroid), q(π_0) = Beta(a_open + Σ_q o_q0,
  a_closed + Σ_q (1 - o_q0));
* projection: BAVARDAGE's adaptive PLDA projection from the class responsibilities.

The background cannot live in the projected space alone: u = q^T y keeps the K - 1
directions of the class centroids, in which a query of another class is as close to the
known centroids as a query of theirs. What sets it apart is its residual r_q, the part of
its whitened row y_q outside that span (||r_q||^2 = ||y_q||^2 - ||u_q||^2, from the Gram
matrix). So the classes' densities are completed to the full whitened space: BAVARDAGE's
density of u_q (its tempered precision τ) times N(r_q | 0, τ_r^{-1} I_{D-d}), τ_r the
base classes' whitened within-class precision; that factor is the same for every class,
so the class responsibilities among themselves are BAVARDAGE's. The background is the
base classes' predictive of a new class in the whitened space, N(W^T m_b, W^T (Σ_b + Σ_w)
W) (W the global whitening, :func:`probfsl.inference.background.fit_background`), fixed
over the iterations. With ``projection="identity"`` (VB in the feature space, no
residual) the background is N(m_b, κ (Σ_b + Σ_w)), κ = 1 / (τ w), w the base classes'
average within-class variance (tempered as the classes are). The ELBO counts the
residual factor for the queries only (it is constant for the support given u).

The projected space with a class-shared residual factor leaves the background weak (open
queries keep most of their class mass and pull the centroids). So the estimator uses the
full-space reading (:attr:`OpenBackground.open_log_odds`): a query's joint over the
components is taken as z_q ∈ {open, closed} first, with odds π_0 p_0(x) against
(1 - π_0) p_closed(x), p_0 and p_closed = (1/K) Σ_k p_k the base classes' two-covariance
predictives of a new class and of the known classes given the support, in the full
centred, normalised feature space
(:meth:`~probfsl.inference.background.TwoCovarianceReading.open_log_odds`); then the
class given "closed" from BAVARDAGE's projected model:

    o_q0 = σ(E ln π_0 - E ln(1 - π_0) + ln p_0(x_q) - ln p_closed(x_q)),
    o_qk = (1 - o_q0) softmax_k(E ln ρ_k + E ln N(u_q | μ_k, τ^{-1} I)).

The M step, q(π_0) and the projection are unchanged (class statistics weighted by o_qk,
which sum to 1 - o_q0). The objective traced is the ELBO of this nested model with
ln p_closed(x_q) in place of the classes' residual factor.

Free components (``n_free`` = J > 0). The open queries of a task are not scattered like
the background's draws: they come from a few other classes, and a query the odds leave
mostly "closed" is shared among the known classes only. J more components without
support, z_q ∈ {1..K, K+1..K+J}, give those queries clusters of their own: their means
have the prior of every component, μ_j ~ N(0, (β_o τ)^{-1} I) (the centre of the base
classes in the centred, whitened space, as the background), their weights are BAVARDAGE's
(ρ ~ Dirichlet(α_o 1_{K+J}), so an unused one empties out; uniform in the balanced
model), and the projection is computed from all K + J clusters. A query's split is the
nested one above with the K + J components in place of the K classes,

    o_q0 = σ(E ln π_0 - E ln(1 - π_0) + ln p_0(x_q) - ln p_closed(x_q)),
    o_qk = (1 - o_q0) softmax_k(E ln ρ_k + E ln N(u_q | μ_k, τ^{-1} I)), k = 1..K+J,

and P(none of the K classes) = o_q0 + Σ_{j > K} o_qj (:attr:`OpenVBMixtureState.open_proba`).
The engine is BAVARDAGE's with K + J components (the support labels only the first K),
so with J = 0 it is the model above, and with the background's weight at zero (o_q0 = 0)
it is :class:`~probfsl.inference.vb_mixture.BavardageVB` with K + J components.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from probfsl.inference.background import open_fraction_expectations, open_fraction_prior
from probfsl.inference.class_stats import one_hot_support
from probfsl.inference.vb_mixture import (
    LOG_2PI,
    BavardageVB,
    VBMixtureState,
    _softmax_and_logsumexp,
)

__all__ = [
    "BavardageOpenVB",
    "OpenBackground",
    "OpenVBMixtureState",
    "open_columns",
    "open_log_odds_of",
    "temper_open",
    "with_free_components",
    "with_open_log_odds",
]


#: the frames of the transductive methods' open contrast (their ``open_frame``): the task
#: re-centred on its queries' mean and normalised again, or centred on the base mean only
#: (:class:`~probfsl.inference.background.TwoCovarianceReading`, ``query_centring``)
OPEN_FRAMES = ("queries", "base")


def temper_open(proba: torch.Tensor, scale: float, shift: float = 0.0) -> torch.Tensor:
    """``proba`` [..., K + 1] (P(none of the K classes) last) with the log-odds of the last
    column multiplied by ``scale`` a (a temperature 1 / a, Guo et al., "On Calibration of
    Modern Neural Networks", ICML 2017) and moved by ``shift`` b (Platt's intercept,
    "Probabilistic Outputs for Support Vector Machines", 1999):

        P'(open) = σ(a (ln P(open) - ln(1 - P(open))) + b),
        P'(k) = (1 - P'(open)) P(k) / Σ_j P(j),

    so the known columns keep their ratios (their argmax) and the order of the queries by
    P(open) is unchanged (the AUROC); a = 1, b = 0 returns ``proba``. A query whose known
    columns are all zero keeps them so. The log-odds are read off ``proba``
    (:func:`open_log_odds_of`), so in float32 they stop near ±87; the transductive methods
    scale the exact log-odds of their last reading instead
    (:meth:`~probfsl.models.base.OpenSetBackground.tempered_open`)."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    if not math.isfinite(shift):
        raise ValueError(f"shift must be finite, got {shift!r}")
    if scale == 1 and shift == 0:
        return proba
    return with_open_log_odds(proba, scale * open_log_odds_of(proba) + shift)


def open_log_odds_of(proba: torch.Tensor) -> torch.Tensor:
    """ln P(open) - ln Σ_k P(k) of ``proba`` [..., K + 1] (P(open) last), a probability of
    0 read as the dtype's smallest positive number (finite log-odds)."""
    tiny = torch.finfo(proba.dtype).tiny
    closed = proba[..., :-1].sum(-1)
    return proba[..., -1].clamp_min(tiny).log() - closed.clamp_min(tiny).log()


def with_free_components(log_odds: torch.Tensor, closed: torch.Tensor, way: int) -> torch.Tensor:
    """ln P(open) - ln P(known) [T, Q] where P(open) = o_q0 + Σ_{j > K} o_qj, the background's
    and the J free components' mass (:class:`BavardageOpenVB`): ``log_odds`` [T, Q] is
    ln o_q0 - ln(1 - o_q0), ``closed`` [T, Q, K + J] the closed components'
    responsibilities (the ``way`` = K classes first), read for their shares of 1 - o_q0.
    In log space, so that a query read as surely open keeps its log-odds:
    ln P(known) = ln σ(-ℓ) + ln s_known, ln P(open) = ln(σ(ℓ) + σ(-ℓ) s_free)."""
    tiny = torch.finfo(closed.dtype).tiny
    log_total = closed.sum(-1).clamp_min(tiny).log()
    log_known = closed[..., :way].sum(-1).clamp_min(tiny).log() - log_total
    log_free = closed[..., way:].sum(-1).clamp_min(tiny).log() - log_total
    log_closed = torch.nn.functional.logsigmoid(-log_odds)
    log_open = torch.logaddexp(torch.nn.functional.logsigmoid(log_odds), log_closed + log_free)
    return log_open - (log_closed + log_known)


def open_columns(known: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """[..., K + 1]: P(open) = σ(``logit``) last and the known columns ``known`` [..., K]
    rescaled to 1 - σ(``logit``) with their ratios kept (a query whose known columns are
    all zero keeps them so)."""
    tiny = torch.finfo(known.dtype).tiny
    ratio = (torch.sigmoid(-logit) / known.sum(-1).clamp_min(tiny)).unsqueeze(-1)
    return torch.cat([known * ratio, torch.sigmoid(logit).unsqueeze(-1)], -1)


def with_open_log_odds(proba: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """``proba`` [..., K + 1] with P(open) = σ(``logit``) in its last column and the known
    columns rescaled to 1 - σ(``logit``) with their ratios kept (:func:`open_columns`)."""
    return open_columns(proba[..., :-1], logit)


@dataclass
class OpenBackground:
    """The background of :class:`BavardageOpenVB` for a batch of tasks.

    Attributes:
        log_lik: ln p_0 of every query in the full (whitened) feature space, [T, Q].
        sq_norms: the squared whitened norm of every row, [T, N] (``None`` with
            ``projection="identity"``, whose u is the full space).
        dim: D, the dimension of the full space.
        residual_precision: the precision of the residuals outside the projection's
            span under a known class (the base classes' whitened within-class precision).
        open_log_odds: ln p_0(x_q) - ln p_closed(x_q) [T, Q] in the full feature space
            (the two-covariance contrast of
            :meth:`~probfsl.inference.background.TwoCovarianceReading.open_log_odds`);
            when given, the background-vs-classes split of every query is taken from it
            (the full-space reading of the module docstring) and ``log_lik``,
            ``sq_norms`` and the residual are unused.
    """

    log_lik: torch.Tensor
    sq_norms: torch.Tensor | None
    dim: int
    residual_precision: float = 1.0
    open_log_odds: torch.Tensor | None = None


@dataclass
class OpenVBMixtureState(VBMixtureState):
    """:class:`~probfsl.inference.vb_mixture.VBMixtureState` with the background.

    ``resp`` holds the class responsibilities (a query's row sums to 1 - o_q0).

    Attributes:
        open_resp: o_q0 of the queries, [T, Q].
        open_alpha: q(π_0) = Beta(open_alpha[..., 0], open_alpha[..., 1]), [T, 2].
        open_log_lik: ln p_0(u_q) of the queries under the current projection, [T, Q].
    """

    open_resp: torch.Tensor | None = None
    open_alpha: torch.Tensor | None = None
    open_log_lik: torch.Tensor | None = None
    n_free: int = 0

    @property
    def component_proba(self) -> torch.Tensor:
        """[T, Q, K + J + 1]: the responsibilities of the K classes, the J free
        components, then o_q0."""
        return torch.cat([self.query_resp, self.open_resp.unsqueeze(-1)], -1)

    @property
    def open_proba(self) -> torch.Tensor:
        """[T, Q, K + 1]: the K class responsibilities, then P(none of them) = o_q0 plus
        the free components' responsibilities."""
        q = self.query_resp
        way = q.shape[-1] - self.n_free
        other = self.open_resp + q[..., way:].sum(-1)
        return torch.cat([q[..., :way], other.unsqueeze(-1)], -1)


class BavardageOpenVB(BavardageVB):
    """:class:`~probfsl.inference.vb_mixture.BavardageVB` with a background component
    (module docstring). ``projection`` is ``"adaptive"``, ``"adaptive_gram"`` or
    ``"identity"``; ``background`` an :class:`OpenBackground` of the batch;
    ``open_prior`` the prior mean of π_0; ``n_free`` the free components J (module
    docstring). ``way`` is the K known classes; the engine's :attr:`way` is then its
    K + J mixture components and :attr:`known` K. The initial responsibilities of
    :meth:`init` are ``[T, N, K + J + 1]`` (the classes, the free components, the
    background last)."""

    def __init__(
        self,
        way: int,
        background: OpenBackground,
        open_prior: float = 0.5,
        n_free: int = 0,
        **kwargs,
    ) -> None:
        if isinstance(n_free, bool) or not isinstance(n_free, int) or n_free < 0:
            raise ValueError(f"n_free must be a non-negative integer, got {n_free!r}")
        if n_free and background.open_log_odds is None:
            raise ValueError("n_free > 0 needs the background's open_log_odds")
        super().__init__(way + n_free, **kwargs)
        if self.projection == "frozen":
            raise ValueError("the open-set engine supports the adaptive and identity projections")
        self.known, self.n_free = way, n_free
        self.background = background
        self.open_prior = float(open_prior)
        self.a_open, self.a_closed = open_fraction_prior(self.open_prior)

    # ------------------------------------------------------------------ init, projection
    def init(self, support, support_labels, query, resp=None) -> OpenVBMixtureState:
        """Background and classes from ``resp`` [T, N, K + 1] (uniform without), then the
        projection and the M step."""
        x = torch.cat([support, query], 1)
        n_s = support.shape[1]
        onehot = one_hot_support(support_labels, self.way, x.dtype)
        shape = (x.shape[0], x.shape[1], self.way + 1)
        if resp is None:
            resp = x.new_full(shape, 1.0 / (self.way + 1))
        elif resp.shape != shape:
            raise ValueError(f"resp must be [T, N, K + J + 1]={shape}, got {tuple(resp.shape)}")
        resp = resp.to(x)
        q_resp, open_resp = resp[:, n_s:, : self.way], resp[:, n_s:, self.way]
        empty = x.new_zeros(x.shape[0])
        state = OpenVBMixtureState(
            x,
            support_labels,
            x,
            torch.cat([onehot, q_resp], 1),
            None,
            empty,
            empty,
            empty,
            open_resp=open_resp,
            n_free=self.n_free,
        )
        return self.m_step(self.project(state))

    def project(self, state: OpenVBMixtureState) -> OpenVBMixtureState:
        """BAVARDAGE's projection from the class responsibilities (adaptive modes)."""
        if state.open_log_lik is None:
            state = replace(state, open_log_lik=self.background.log_lik)
        return super().project(state)

    def residual_log_lik(self, state: OpenVBMixtureState) -> torch.Tensor:
        """ln N(r_q | 0, τ_r^{-1} I) of the queries' whitened residuals r_q outside the
        projection's span, [T, Q]: the same for every class (so the closed-set
        responsibilities do not see it), it completes the class densities to the full
        space in which the background's density is taken."""
        bg = self.background
        if bg.sq_norms is None:
            return state.u.new_zeros(state.u.shape[0], state.u.shape[1] - state.n_support)
        n_s, d = state.n_support, state.u.shape[-1]
        u = state.u[:, n_s:]
        residual = (bg.sq_norms[:, n_s:] - u.square().sum(-1)).clamp_min(0)
        extra = bg.dim - d
        tau_r = bg.residual_precision
        return -0.5 * tau_r * residual + 0.5 * extra * (math.log(tau_r) - LOG_2PI)

    # ------------------------------------------------------------------ updates
    def m_step(self, state: OpenVBMixtureState) -> OpenVBMixtureState:
        """q(π_0) from the queries' background responsibilities, then BAVARDAGE's M step
        on the class responsibilities (and the ELBO)."""
        open_mass = state.open_resp.sum(-1)
        closed = state.open_resp.shape[-1] - open_mass
        alpha = torch.stack([self.a_open + open_mass, self.a_closed + closed], -1)
        return super().m_step(replace(state, open_alpha=alpha))

    def _log_rho(self, state: OpenVBMixtureState, log_lik: torch.Tensor) -> torch.Tensor:
        """ln ρ of the queries, [T, Q, K + 1] (the background last)."""
        a = state.open_alpha
        e_open, e_closed = open_fraction_expectations(
            a[..., 0] - self.a_open, a[..., 1] - self.a_closed, self.open_prior
        )
        odds = self.background.open_log_odds
        if odds is not None:  # full-space reading: classes | closed from the projected model
            classes = log_lik[:, state.n_support :]
            if state.alpha is not None:
                classes = classes + self.expected_log_pi(state.alpha).unsqueeze(1)
            classes = torch.log_softmax(classes, -1) + e_closed.view(-1, 1, 1)
            background = odds.to(classes) + e_open.unsqueeze(-1)
            return torch.cat([classes, background.unsqueeze(-1)], -1)
        classes = log_lik[:, state.n_support :] + e_closed.view(-1, 1, 1)
        classes = classes + self.residual_log_lik(state).unsqueeze(-1)
        if state.alpha is None:
            classes = classes - torch.log(classes.new_tensor(float(self.way)))
        else:
            classes = classes + self.expected_log_pi(state.alpha).unsqueeze(1)
        background = state.open_log_lik + e_open.unsqueeze(-1)
        return torch.cat([classes, background.unsqueeze(-1)], -1)

    def e_step(self, state: OpenVBMixtureState) -> OpenVBMixtureState:
        """o_q = softmax(ln ρ_q) over the K classes and the background; the ELBO after it."""
        n_s = state.n_support
        log_lik = self.expected_log_lik(state)
        resp, log_norm = _softmax_and_logsumexp(self._log_rho(state, log_lik))
        new = replace(
            state,
            resp=torch.cat([state.resp[:, :n_s], resp[..., : self.way]], 1),
            open_resp=resp[..., self.way],
        )
        return replace(new, objective=self._open_elbo(new, log_lik, log_norm.sum((1, 2))))

    def _elbo_after_m(self, state: OpenVBMixtureState) -> torch.Tensor:
        log_lik = self.expected_log_lik(state)
        resp = torch.cat([state.query_resp, state.open_resp.unsqueeze(-1)], -1)
        log_rho = self._log_rho(state, log_lik)
        query = (resp * log_rho).sum((1, 2)) - torch.special.xlogy(resp, resp).sum((1, 2))
        return self._open_elbo(state, log_lik, query)

    def elbo(self, state: OpenVBMixtureState) -> torch.Tensor:
        return self._elbo_after_m(state)

    def _open_elbo(self, state, log_lik, query) -> torch.Tensor:
        """BAVARDAGE's ELBO given the queries' terms ``query`` (background included), minus
        KL(q(π_0) ‖ its prior)."""
        a = state.open_alpha
        prior = torch.tensor([self.a_open, self.a_closed], dtype=a.dtype, device=a.device)
        # no argument validation: its checks read the values on the host in every iteration
        q = torch.distributions.Beta(a[..., 0], a[..., 1], validate_args=False)
        p = torch.distributions.Beta(
            prior[0].expand_as(a[..., 0]), prior[1].expand_as(a[..., 1]), validate_args=False
        )
        return self._elbo(state, log_lik, query) - torch.distributions.kl_divergence(q, p)

    def guide(self, state):
        """Refused: the open-set model (a background of fixed density beside the classes
        and a Beta open fraction) has no Pyro declaration, so there is no model for a
        guide to be judged against; the closed-set engine's guide would describe another
        model."""
        raise ValueError(
            "the open-set BAVARDAGE engine has no Pyro declaration, hence no guide; "
            "check the closed-set engine (VBMixture) against Pyro instead"
        )
