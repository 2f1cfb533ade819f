"""The background ("none of the K classes") density of open-set few-shot recognition.

Few-shot open-set recognition (Boudiaf, Bennequin et al., "Model-Agnostic Few-Shot
Open-Set Recognition", 2022; Jeong et al., "Few-shot Open-set Recognition by
Transformation Consistency", CVPR 2021) asks, for every query, the probability that it
belongs to none of the K classes of its task. probfsl answers it in each method's own
generative model by adding a component k = 0 to the model of the queries:

    z_q ~ Categorical(π),  π ~ Dirichlet(α_0, α_1..α_K),
    x_q | z_q = k ~ p_k(x)  (k ≥ 1, the method's class-conditional density),
    x_q | z_q = 0 ~ p_0(x)  (the background: a density of "any class", from the base classes).

This module holds what every method shares:

* :func:`fit_background`: the base classes' pooled mean, within-class and between-class
  covariances (their sum is the total covariance), optionally shrunk towards a multiple
  of the identity and blended with their isotropic parts (:meth:`BackgroundStats.blended`;
  the blends are chosen on held-out base classes, :mod:`probfsl.inference.open_temperature`).
  A new class's predictive under the two-covariance model of the base classes (class
  mean drawn from the between-class Gaussian, plus within-class noise) is
  N(mean, within + between): the background Gaussian.
* :func:`gaussian_log_density`: a batched Gaussian log-density through a Cholesky
  factor, for ``[T, Q, D]`` queries against one ``[D, D]`` factor or one per task
  (``[T, D, D]``); no Python loop over tasks, dtype and device those of the queries.
* :func:`open_posterior`: the inductive outlier posterior by enumeration over z,
  P(z = 0 | x) = π_0 p_0(x) / (π_0 p_0(x) + Σ_k π_k p_k(x)), with π_0 the prior open
  fraction and the known classes sharing 1 - π_0 equally (its log-odds:
  :func:`inductive_log_odds`).
* :func:`two_covariance_log_liks`: the class and background predictive log-likelihoods
  of the two-covariance (PLDA) model of Ioffe ("Probabilistic Linear Discriminant
  Analysis", ECCV 2006) and Prince & Elder (ICCV 2007): the generative reading of the
  inductive methods whose scores are discriminative; optionally (transductive) in the
  task's own frame, support and queries re-centred on the queries' mean
  (:func:`centre_on_queries`), where the background's mean can be inferred from the
  queries (:meth:`TwoCovarianceReading.infer_background_mean`).
* :func:`open_fraction_expectations`: E ln π_0 and E ln(1 - π_0) of the Beta posterior of
  the open fraction, the part of π that transductive methods infer per task. By the
  aggregation property, π ~ Dirichlet(α_0, α_1..α_K) is π_0 ~ Beta(α_0, Σ_k α_k) and
  π_{1:K} / (1 - π_0) ~ Dirichlet(α_1..α_K), independent: the class proportions of a
  method's closed-set model stay as they were, times (1 - π_0).
* :func:`reread_open`: the last coordinate update of the open responsibilities of a
  converged mixture under a new background (the class factors fixed).
* :func:`open_responsibility`: the queries' background responsibility in the nested
  reading of the transductive methods (z_q first "open" or "closed", then a class given
  "closed" from the method's own model), o_q0 = σ(E ln π_0 - E ln(1 - π_0) + ln p_0(x_q)
  - ln p_closed(x_q)), with q(π_0) the Beta posterior given the previous o_q0; the method
  then weights query q by 1 - o_q0 in every class statistic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "BackgroundStats",
    "attach_open",
    "centre_on_queries",
    "class_means",
    "fit_background",
    "gaussian_log_density",
    "open_fraction_expectations",
    "reread_open",
    "open_fraction_prior",
    "open_posterior",
    "inductive_log_odds",
    "open_log_ratio",
    "open_responsibility",
    "TwoCovarianceReading",
    "two_covariance_basis",
    "two_covariance_log_liks",
]

LOG_2PI = math.log(2 * math.pi)
#: pseudo-observations of the Beta prior of the open fraction in the transductive methods
OPEN_PRIOR_STRENGTH = 2.0


class BackgroundStats(NamedTuple):
    """The base classes' Gaussian statistics (one feature space, ``[D]`` and ``[D, D]``).

    ``mean`` the mean of the base class means, ``within`` the pooled within-class
    covariance, ``between`` the covariance of the class means; the background Gaussian
    is N(mean, within + between)."""

    mean: torch.Tensor
    within: torch.Tensor
    between: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        """The total covariance, within + between (the background's covariance)."""
        return self.within + self.between

    def to(self, reference: torch.Tensor) -> BackgroundStats:
        """The statistics in the dtype and on the device of ``reference``."""
        return BackgroundStats(*(t.to(reference) for t in self))

    def blended(self, within_mix: float = 0.0, between_mix: float = 0.0) -> BackgroundStats:
        """Each covariance S blended with its isotropic part, (1 - a) S + a (tr S / D) I
        (Ledoit & Wolf, 2004), a = ``within_mix`` for ``within`` and ``between_mix`` for
        ``between``, both in [0, 1] (0: unchanged, 1: isotropic with the same trace). As
        the shrinkage of :func:`fit_background` adds a multiple of I that the blend keeps,
        ``fit_background(x, y, λ).blended(a, b)`` is ``fit_background(x, y, λ, a, b)``."""
        _check_mix("within_mix", within_mix)
        _check_mix("between_mix", between_mix)
        return BackgroundStats(
            self.mean, _blend(self.within, within_mix), _blend(self.between, between_mix)
        )


def _check_mix(name: str, mix: float) -> None:
    if not 0 <= mix <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {mix}")


def _blend(cov: torch.Tensor, mix: float) -> torch.Tensor:
    """(1 - a) S + a (tr S / D) I for a = ``mix``; S itself for a = 0."""
    if mix == 0:
        return cov
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    return (1 - mix) * cov + mix * cov.trace() / cov.shape[-1] * eye


def class_means(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of each class's rows [C, D] of ``features`` [N, D] (classes in the sorted
    order of ``labels`` [N]), and each row's class index [N]."""
    _, inverse = labels.unique(return_inverse=True)
    onehot = torch.nn.functional.one_hot(inverse).to(features)  # [N, C]
    return onehot.T @ features / onehot.sum(0).unsqueeze(-1), inverse


def fit_background(
    features: torch.Tensor,
    labels: torch.Tensor,
    shrinkage: float = 1e-3,
    within_mix: float = 0.0,
    between_mix: float = 0.0,
) -> BackgroundStats:
    """Pooled mean, within- and between-class covariances of base ``features`` [N, D].

    ``labels`` [N]: any integer labels. Every class counts once in the between-class
    covariance (the mean of the class means, and their covariance); the within-class
    covariance pools every sample. Each covariance S is first blended with its isotropic
    part, S_a = (1 - a) S + a (tr S / D) I (Ledoit & Wolf, "A well-conditioned estimator
    for large-dimensional covariance matrices", 2004), a = ``within_mix`` for the
    within-class and ``between_mix`` for the between-class covariance (0: the sample
    covariance, 1: isotropic with the same trace); then both are shrunk towards
    ``shrinkage`` times their mean variance times the identity, S_a + λ (tr S / D) I (so
    that they are positive definite when D exceeds the number of samples or classes).
    Computed in the features' dtype and device.
    """
    if features.ndim != 2 or labels.shape != features.shape[:1]:
        raise ValueError(
            f"features must be [N, D] with labels [N], got {tuple(features.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if not shrinkage >= 0:
        raise ValueError(f"shrinkage must be non-negative, got {shrinkage}")
    _check_mix("within_mix", within_mix)
    _check_mix("between_mix", between_mix)
    means, inverse = class_means(features, labels)
    centre = means.mean(0)
    resid = features - means[inverse]
    within = resid.T @ resid / features.shape[0]
    spread = means - centre
    between = spread.T @ spread / means.shape[0]
    eye = torch.eye(features.shape[1], dtype=features.dtype, device=features.device)
    d = features.shape[1]
    floor = torch.finfo(features.dtype).eps
    w_mean, b_mean = within.trace() / d, between.trace() / d
    within = (1 - within_mix) * within + (within_mix + shrinkage) * w_mean * eye + floor * eye
    between = (1 - between_mix) * between + (between_mix + shrinkage) * b_mean * eye
    return BackgroundStats(centre, within, between)


def gaussian_log_density(
    x: torch.Tensor, mean: torch.Tensor, scale_tril: torch.Tensor
) -> torch.Tensor:
    """ln N(x | mean, L L^T) for every row of ``x`` [T, Q, D] (or [Q, D]).

    ``mean`` [D] or [T, D]; ``scale_tril`` L, the lower Cholesky factor of the
    covariance: [D, D] (one for all tasks, one triangular solve for every row at once) or
    [T, D, D] (one per task, batched). Returns [T, Q] (or [Q]).
    """
    d = x.shape[-1]
    diff = x - (mean.unsqueeze(-2) if mean.ndim == x.ndim - 1 and mean.ndim > 1 else mean)
    if scale_tril.ndim == 2:
        z = torch.linalg.solve_triangular(scale_tril, diff.reshape(-1, d).T, upper=False)
        maha = z.square().sum(0).reshape(diff.shape[:-1])
        log_det = scale_tril.diagonal().log().sum()
    else:
        z = torch.linalg.solve_triangular(scale_tril, diff.transpose(-1, -2), upper=False)
        maha = z.square().sum(-2)
        log_det = scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1).unsqueeze(-1)
    return -0.5 * maha - log_det - 0.5 * d * LOG_2PI


def open_posterior(
    class_log_lik: torch.Tensor,
    background_log_lik: torch.Tensor,
    open_prior: float,
    odds_scale: float = 1.0,
    odds_shift: float = 0.0,
) -> torch.Tensor:
    """P(z = k | x) for k = 1..K and 0 (last column), [T, Q, K + 1], by enumeration.

    ``class_log_lik`` [T, Q, K] ln p_k(x), ``background_log_lik`` [T, Q] ln p_0(x),
    ``open_prior`` π_0 in (0, 1); the known classes share 1 - π_0 equally:
    P(z = 0 | x) = σ(a (ln p_0(x) - ln p̄(x)) + b + logit π_0), p̄ = (1/K) Σ_k p_k, a =
    ``odds_scale`` and b = ``odds_shift`` (1 and 0: Bayes' rule, π_0 p_0 / (π_0 p_0 +
    Σ_k (1 - π_0) / K p_k); else the calibrated odds of
    :mod:`probfsl.inference.open_temperature`); the known classes get 1 - P(z = 0 | x) in
    proportion to p_k(x).
    """
    log_odds = inductive_log_odds(
        class_log_lik, background_log_lik, open_prior, odds_scale, odds_shift
    )
    return attach_open(torch.softmax(class_log_lik, -1), torch.sigmoid(log_odds))


def inductive_log_odds(
    class_log_lik: torch.Tensor,
    background_log_lik: torch.Tensor,
    open_prior: float,
    odds_scale: float = 1.0,
    odds_shift: float = 0.0,
) -> torch.Tensor:
    """ln P(z = 0 | x) - ln P(z ≠ 0 | x) [T, Q] of :func:`open_posterior` (same
    arguments): a (ln p_0(x) - ln p̄(x)) + b + logit π_0, finite where P(z = 0 | x) itself
    rounds to 0 or 1."""
    if not 0 < open_prior < 1:
        raise ValueError(f"open_prior must be in (0, 1), got {open_prior}")
    if not odds_scale > 0:
        raise ValueError(f"odds_scale must be positive, got {odds_scale}")
    if not math.isfinite(odds_shift):
        raise ValueError(f"odds_shift must be finite, got {odds_shift}")
    closed = torch.logsumexp(class_log_lik, -1) - math.log(class_log_lik.shape[-1])
    prior_odds = math.log(open_prior) - math.log1p(-open_prior)
    return odds_scale * (background_log_lik - closed) + odds_shift + prior_odds


def attach_open(proba: torch.Tensor, p_open: torch.Tensor) -> torch.Tensor:
    """[T, Q, K + 1]: the closed-set ``proba`` [T, Q, K] times 1 - ``p_open`` [T, Q], and
    ``p_open`` last (rows sum to one when those of ``proba`` do).

    1 - ``p_open`` is floored at the dtype's smallest normal number, so that the known
    columns of a query deemed certainly open keep the order of ``proba`` (the row then
    sums to 1 up to that amount)."""
    p_open = p_open.unsqueeze(-1)
    closed = (1 - p_open).clamp_min(torch.finfo(p_open.dtype).smallest_normal)
    return torch.cat([proba * closed, p_open], -1)


def open_fraction_prior(open_prior: float) -> tuple[float, float]:
    """The Beta prior (a_open, a_closed) of the open fraction π_0, with mean
    ``open_prior`` and :data:`OPEN_PRIOR_STRENGTH` pseudo-observations."""
    if not 0 < open_prior < 1:
        raise ValueError(f"open_prior must be in (0, 1), got {open_prior}")
    return OPEN_PRIOR_STRENGTH * open_prior, OPEN_PRIOR_STRENGTH * (1 - open_prior)


def open_fraction_expectations(
    open_mass: torch.Tensor, closed_mass: torch.Tensor, open_prior: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """E ln π_0 and E ln(1 - π_0), each [T], under the Beta posterior of the open
    fraction given the expected counts ``open_mass`` and ``closed_mass`` [T]."""
    a_open, a_closed = open_fraction_prior(open_prior)
    a = open_mass + a_open
    b = closed_mass + a_closed
    total = torch.digamma(a + b)
    return torch.digamma(a) - total, torch.digamma(b) - total


def open_responsibility(
    open_log_odds: torch.Tensor, open_resp: torch.Tensor, open_prior: float
) -> torch.Tensor:
    """The queries' background responsibility o_q0 [T, Q] after one update of q(π_0).

    ``open_log_odds`` [T, Q] is ln p_0(x_q) - ln p_closed(x_q) in the full feature space
    (:meth:`TwoCovarianceReading.open_log_odds`), ``open_resp`` [T, Q] the current o_q0.
    q(π_0) = Beta(a_open + Σ_q o_q0, a_closed + Σ_q (1 - o_q0)) (:func:`open_fraction_prior`),
    then o_q0 = σ(E ln π_0 - E ln(1 - π_0) + ``open_log_odds``): the mean-field update of
    the open/closed indicator of the nested mixture (module docstring; Bishop, PRML
    §10.2.1, for the Dirichlet-Categorical pair). The class responsibilities of the
    method's own model are then multiplied by 1 - o_q0.
    """
    return torch.sigmoid(open_log_ratio(open_log_odds, open_resp, open_prior))


def open_log_ratio(
    open_log_odds: torch.Tensor, open_resp: torch.Tensor, open_prior: float
) -> torch.Tensor:
    """ln o_q0 - ln(1 - o_q0) [T, Q] of :func:`open_responsibility` (its log-odds): a
    query's closed share is σ(-this), exact where 1 - o_q0 would round to 0."""
    open_mass = open_resp.sum(-1)
    e_open, e_closed = open_fraction_expectations(
        open_mass, open_resp.shape[-1] - open_mass, open_prior
    )
    return open_log_odds.to(open_resp) + (e_open - e_closed).unsqueeze(-1)


def reread_open(
    proba: torch.Tensor, open_log_odds: torch.Tensor, open_prior: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``proba`` [T, Q, C + 1] (C closed components, o_q0 last) after one more update of
    the open responsibilities under the contrast ``open_log_odds`` [T, Q], the class
    factors fixed, as (the closed components' shares [T, Q, C], each row summing to 1;
    the log-odds ℓ = ln o_q0' - ln(1 - o_q0') [T, Q]): o_q0' = σ(ℓ), component c's
    responsibility σ(-ℓ) times its share (:func:`~probfsl.inference.vb_mixture_open.open_columns`).
    Apart, they stay exact where the probabilities round to 0 or 1 (a float32 o_q0' is 1
    beyond log-odds of about 17, 1 - o_q0' is 0 beyond about 103, and the shares with it).

    A coordinate step of mean-field variational inference (Bishop, PRML §10.1.1 and
    §10.2.1; Winn & Bishop, JMLR 2005): q(π_0) from the current o_q0
    (:func:`open_responsibility`), then o_q0' = σ(E ln π_0 - E ln(1 - π_0) +
    ``open_log_odds``), and each closed column is o_qc / Σ_c o_qc times 1 - o_q0' (its share
    among the closed components, as the mixture left it). With the contrast the mixture
    iterated with it is one more pass of the open indicator alone; the transductive
    methods call it after their iterations with the contrast of the task's own
    background (:meth:`TwoCovarianceReading.infer_background_mean`), so that the
    background's mean inferred from the queries reads P(open) but does not move the
    class factors. A query whose closed columns are all zero shares 1 - o_q0' equally."""
    open_resp, closed = proba[..., -1], proba[..., :-1]
    total = closed.sum(-1, keepdim=True)
    tiny = torch.finfo(proba.dtype).tiny
    share = torch.where(total > 0, closed / total.clamp_min(tiny), 1.0 / closed.shape[-1])
    return share, open_log_ratio(open_log_odds, open_resp, open_prior)


def centre_on_queries(
    support: torch.Tensor, query: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``support`` [T, S, D] and ``query`` [T, Q, D] re-centred on each task's query mean
    and L2-normalised: x' = (x - x̄_Q) / ||x - x̄_Q|| (:class:`TwoCovarianceReading`)."""
    centre = query.mean(-2, keepdim=True)
    normalize = torch.nn.functional.normalize
    return normalize(support - centre, dim=-1), normalize(query - centre, dim=-1)


def two_covariance_basis(stats: BackgroundStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W [D, D], λ [D], ln|det W|): W^T within W = I and W^T between W = diag(λ)
    (simultaneous diagonalisation through the Cholesky factor L of ``within``; W = L^{-T} V
    with V orthogonal, so ln|det W| = -Σ ln L_ii)."""
    chol = torch.linalg.cholesky(stats.within)
    eye = torch.eye(chol.shape[0], dtype=chol.dtype, device=chol.device)
    inv = torch.linalg.solve_triangular(chol, eye, upper=False)  # L^{-1}
    lam, vec = torch.linalg.eigh(inv @ stats.between @ inv.T)
    return inv.T @ vec, lam.clamp_min(0), -chol.diagonal().log().sum()


class TwoCovarianceReading:
    """The two-covariance (PLDA) reading of a batch of tasks, for repeated evaluation.

    Holds the basis that whitens the base classes' ``within`` and diagonalises their
    ``between`` covariance (one D x D factorisation per batch), the support's per-class
    counts and sums in it, and the whitened queries. :meth:`class_log_lik` is the class
    predictive of every query given the support and, optionally, soft query counts (the
    transductive methods pass their current class responsibilities: the posterior of μ_k
    then pools the support and the weighted queries); :meth:`background_log_lik` is a new
    class's predictive N(mean, within + between); :meth:`open_log_odds` their contrast,
    ln p_0(x) - ln((1/K) Σ_k p_k(x)), with which a mixture's background responsibility is
    taken in the full feature space; :meth:`infer_background_mean` makes the background
    the task's own (its mean inferred from the queries). ``stats`` is cast to the dtype
    and device of ``query``; every method is batched over tasks.

    ``query_centring=True`` (transductive) reads the task in its own frame first: support
    and queries are re-centred on the mean of the task's queries and L2-normalised again,
    x' = (x - x̄_Q) / ||x - x̄_Q||, x̄_Q = (1/Q) Σ_q x_q, as the transductive methods of
    Boudiaf, Bennequin et al. (2022) centre a task on its own features. The queries mix
    the known and the open classes, so x̄_Q stands for the mean of the population the
    task's classes come from, the place of the base mean in the inductive frame. It
    expects features centred and L2-normalised as the base features of ``stats`` were;
    a row equal to x̄_Q stays zero.

    ``basis``: the ``basis`` attribute of a reading with the same ``stats`` (the D x D
    factorisation, reused rather than recomputed).
    """

    def __init__(
        self,
        support: torch.Tensor,
        support_labels: torch.Tensor,
        query: torch.Tensor,
        way: int,
        stats: BackgroundStats,
        query_centring: bool = False,
        basis: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if query_centring:
            support, query = centre_on_queries(support, query)
        stats = stats.to(query)
        if basis is None:
            basis = two_covariance_basis(stats)
        w, lam, log_jac = (t.to(query) for t in basis)
        ys = (support - stats.mean) @ w  # [T, S, D]
        self._hold(ys, support_labels, (query - stats.mean) @ w, way, (w, lam, log_jac))
        self.query_centring = query_centring

    def _hold(
        self,
        ys: torch.Tensor,
        support_labels: torch.Tensor,
        yq: torch.Tensor,
        way: int,
        basis: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        """Keep the projected queries and the support's per-class counts and sums."""
        self.basis = basis
        self.way, self.lam, self.log_jac = way, basis[1], basis[2]
        self.yq = yq  # [T, Q, D]
        self.yq_sq = yq.square()
        onehot = torch.nn.functional.one_hot(support_labels, way).to(ys)  # [T, S, K]
        self.counts = onehot.sum(1)  # [T, K]
        self.sums = onehot.transpose(1, 2) @ ys  # [T, K, D]
        # ln p_0 of the queries under the base classes' background and the contrast of
        # open_log_odds, computed at the first call and shared with copies (they depend on
        # the projection and the support alone)
        self._base_background: dict[str, torch.Tensor] = {}
        self.background_shift: torch.Tensor | None = None  # [T, 1, D], basis coordinates
        self.background_extra_var: torch.Tensor | None = None  # [T, 1, D]

    def copy(self) -> TwoCovarianceReading:
        """A reading of the same tasks under the same statistics, sharing this one's
        projected support and queries (no method changes them in place) and its base-class
        background log-likelihood, but with the base classes' background: what
        :meth:`infer_background_mean` sets is not carried over."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.background_shift = other.background_extra_var = None
        return other

    def infer_background_mean(self, odds_scale: float, open_prior: float) -> TwoCovarianceReading:
        """Infer the background's mean from the task's queries (in place; returns ``self``).

        The open queries of a task come from a few classes of their own, whose centre need
        not be the base classes'. So the background's mean m_0 is given the prior of a
        class mean, N(mean, between), and the open queries are draws of N(m_0, within +
        between); each query counts with its posterior probability of being open under
        the base-class background, o_q = σ(a (ln p_0 - ln p̄) + E ln π_0 - E ln(1 - π_0))
        (a = ``odds_scale``, the temperature learnt on held-out base classes,
        :mod:`probfsl.inference.open_temperature`; q(π_0) from ``open_prior``,
        :func:`open_responsibility`). In the basis, with noise variance 1 + λ_d and prior
        variance λ_d, m_0 has the conjugate posterior N(λ_d Σ_q o_q y_q / (1 + λ_d + N λ_d),
        λ_d (1 + λ_d) / (1 + λ_d + N λ_d)), N = Σ_q o_q, and :meth:`background_log_lik`
        becomes its predictive, the mean shifted and that posterior variance added. This is
        one variational update of q(m_0) from the base-class reading (Bishop, PRML
        §10.2.1): the known classes' predictives stay those given their support, as in the
        nested model. Each task gets its own; a second call is a ``RuntimeError``."""
        if self.background_shift is not None:
            raise RuntimeError("the background's mean is inferred already")
        odds = self.open_log_odds()
        start = torch.full_like(odds, open_prior)
        weight = open_responsibility(odds_scale * odds, start, open_prior)  # [T, Q]
        n = weight.sum(-1)[:, None, None]  # [T, 1, 1]
        noise = 1 + self.lam
        denom = noise + n * self.lam  # [T, 1, D]
        self.background_shift = self.lam * (weight.unsqueeze(1) @ self.yq) / denom
        self.background_extra_var = self.lam * noise / denom
        return self

    def class_log_lik(self, query_weights: torch.Tensor | None = None) -> torch.Tensor:
        """ln p_k(x_q) [T, Q, K]: class k's predictive given its support rows and, when
        ``query_weights`` [T, Q, K] is given, the queries counted with those weights."""
        counts, sums = self.counts, self.sums
        if query_weights is not None:
            query_weights = query_weights.to(self.yq)
            counts = counts + query_weights.sum(1)
            sums = sums + query_weights.transpose(1, 2) @ self.yq
        counts = counts.unsqueeze(-1)  # [T, K, 1]
        shrink = self.lam / (1 + counts * self.lam)  # posterior variance of μ_k, [T, K, D]
        post_mean = shrink * sums
        var = 1 + shrink  # [T, K, D]
        inv_var = var.reciprocal()
        maha = (
            self.yq_sq @ inv_var.transpose(1, 2)
            - 2 * self.yq @ (post_mean * inv_var).transpose(1, 2)
            + (post_mean.square() * inv_var).sum(-1).unsqueeze(1)
        )  # [T, Q, K]: Σ_d (y_d - m_kd)^2 / v_kd without a [T, Q, K, D] tensor
        d = self.yq.shape[-1]
        return -0.5 * (maha + var.log().sum(-1).unsqueeze(1) + d * LOG_2PI) + self.log_jac

    def background_log_lik(self) -> torch.Tensor:
        """ln p_0(x_q) [T, Q], the predictive of a new class, N(mean, within + between), or,
        after :meth:`infer_background_mean`, that of the task's background. The former
        does not change with the iterations of a mixture: it is computed once per reading
        (and its copies) and handed back; callers do not change it in place."""
        bg_var = 1 + self.lam
        d = self.yq.shape[-1]
        if self.background_shift is None:
            if "log_lik" not in self._base_background:
                quad = (self.yq_sq / bg_var).sum(-1)
                self._base_background["log_lik"] = (
                    -0.5 * (quad + bg_var.log().sum() + d * LOG_2PI) + self.log_jac
                )
            return self._base_background["log_lik"]
        bg_var = bg_var + self.background_extra_var  # [T, 1, D]
        quad = ((self.yq - self.background_shift).square() / bg_var).sum(-1)
        return -0.5 * (quad + bg_var.log().sum(-1) + d * LOG_2PI) + self.log_jac

    def open_log_odds(self, query_weights: torch.Tensor | None = None) -> torch.Tensor:
        """ln p_0(x_q) - ln((1/K) Σ_k p_k(x_q)) [T, Q] (``query_weights`` as in
        :meth:`class_log_lik`). Under the base classes' background and without query
        weights, computed once per reading and its copies (as :meth:`background_log_lik`:
        a search's candidates read the same contrast) and handed back; callers do not
        change it in place."""
        kept = query_weights is None and self.background_shift is None
        if kept and "open_log_odds" in self._base_background:
            return self._base_background["open_log_odds"]
        closed = torch.logsumexp(self.class_log_lik(query_weights), -1) - math.log(self.way)
        odds = self.background_log_lik() - closed
        if kept:
            self._base_background["open_log_odds"] = odds
        return odds


def two_covariance_log_liks(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    way: int,
    stats: BackgroundStats,
    query_centring: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class and background predictive log-likelihoods of the queries, [T, Q, K] and [T, Q].

    The two-covariance model of the base classes (Ioffe, ECCV 2006; Prince & Elder, ICCV
    2007): μ_k ~ N(mean, between), x | k ~ N(μ_k, within). Given the n_k support rows of
    class k, its predictive is N(posterior mean of μ_k, within + posterior covariance);
    the background is a new class's predictive, N(mean, within + between). Computed in
    the basis that whitens ``within`` and diagonalises ``between`` (one D x D
    factorisation per call, shared by every task): every density is then diagonal
    (:class:`TwoCovarianceReading`). ``stats`` is cast to the dtype and device of
    ``query``; ``query_centring`` as in :class:`TwoCovarianceReading` (transductive).
    """
    reading = TwoCovarianceReading(support, support_labels, query, way, stats, query_centring)
    return reading.class_log_lik(), reading.background_log_lik()
