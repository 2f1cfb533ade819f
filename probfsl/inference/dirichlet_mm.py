"""Block majorize-minimize for Dirichlet mixtures on the probability simplex (EM-Dirichlet).

Martin, Huang, Shakeri, Pesquet & Ben Ayed, "Transductive Zero-Shot and Few-Shot
CLIP", CVPR 2024 (docs/design/em-dirichlet.md). Each sample is a probability vector
``x_n`` in the simplex of R^K; class ``k`` has a Dirichlet law ``Dir(alpha_k)``. The
engine minimises, per task, objective (6) of the paper (design §3.5)::

    J(R, A) = - sum_{n in S u Q} sum_k R_nk ln Dir(x_n | alpha_k)        (-L, eq. 7)
              + sum_{n in Q} sum_k R_nk ln R_nk                          (Phi, eq. 8; soft only)
              - lambda sum_k pi_k ln pi_k,   pi = mean_{n in Q} R_n       (lambda Psi, eq. 9)

by three closed-form block steps (paper Algorithm 2):

* :func:`mm_dirichlet_fit` — the MM-quadratic Dirichlet step (paper Algorithm 1,
  Lemma 1): a weighted Dirichlet maximum-likelihood fit per class, solved by a
  closed-form elementwise update, no inverse digamma; or (``solver="newton"``) by
  :func:`newton_dirichlet_step`, Newton-Raphson with Minka's (2000) diagonal-plus-
  rank-one Hessian safeguarded by the MM step: the same fixed point in about 10
  instead of up to 1000 iterations;
* proportions ``pi = mean_Q R`` from the previous assignments (design §3.2);
* :func:`assignment_logits` — the closed-form assignment step (design §3.3): the
  concave ``Psi`` is replaced by its tangent, so
  ``r_n = softmax_k(ln Dir(x_n|alpha_k) + (lambda/|Q|) ln pi_k)`` (hard variant:
  one-hot argmax).

Every tensor has a leading task dimension ``B``. With ``lambda = |Q|`` and no
support this is exactly EM for a Dirichlet mixture (paper Prop. 1).
:class:`EMDirichletEngine` is the outer loop under the engine contract of
:mod:`probfsl.inference.base` (driven by ``run``); its objective ``J`` is the
negative ELBO of the Pyro model :func:`probfsl.derived.em_dirichlet.em_dirichlet_model`
(the one declaration both engines are checked against) under the guide Categorical(r),
with alpha and ``pi`` (at its profile value) as the model's point estimates.

Outside the ``run`` contract: the inner Algorithm-1 loop :func:`mm_dirichlet_fit`. It
is one block of the outer MM (the alpha step inside one engine step), with its own
stopping rule: the reference code's per-(task, class)-row test on
||Delta alpha||^2 / ||alpha||^2 every ``check_every`` iterations, each row being an
independent Dirichlet fit. It follows the same discipline as ``run``: rows that
converged are masked (``torch.where``), not removed, the test runs on the device, and
the loop makes no host synchronisation (an optional early exit makes one per check).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pyro
import pyro.distributions as dist
import torch
from pyro.ops.indexing import Vindex

from probfsl.inference.base import Engine, Info
from probfsl.inference.dirichlet_mm_graph import graphed_fit
from probfsl.validation import check_task_tensors

#: added to the probabilities before taking logs (official code; no renormalisation)
EPS = 1e-15
#: empty-class threshold on sum_n R_nk (design §3.1)
EMPTY = 1e-15
#: the reference code's inner Algorithm-1 loop (design §3.1, §4); the engine's default
#: (keyword arguments of both the engine and the estimator)
REFERENCE_MM = {"solver": "mm", "mm_max_iter": 1000, "mm_tol": 1e-11, "mm_check_every": 50}
#: bounded block MM (at most 20 inner iterations per outer iteration, per-row check every
#: iteration): the estimator's zero-shot default, 20-50x faster (see EMDirichletEngine)
BOUNDED_MM = {"solver": "mm", "mm_max_iter": 20, "mm_tol": 1e-11, "mm_check_every": 1}
#: safeguarded Newton inner loop (:func:`newton_dirichlet_step`): the same fixed point as
#: the reference loop, reached in about 10 iterations from alpha = 1 (quadratic
#: convergence) instead of up to 1000; at most 20 per outer iteration, checked every one;
#: the estimator's few-shot default
NEWTON = {"solver": "newton", "mm_max_iter": 20, "mm_tol": 1e-11, "mm_check_every": 1}

_ZETA = [
    None,
    None,
    math.pi**2 / 6,
    1.2020569031595942,
    math.pi**4 / 90,
    1.0369277551433699,
    math.pi**6 / 945,
    1.0083492773819228,
    math.pi**8 / 9450,
    1.0020083928260822,
    math.pi**10 / 93555,
    1.0004941886041195,
    1.0002460865533080,
    1.0001227133475785,
    1.0000612481350587,
]
# c(t) = sum_{k>=2} 2 (-1)^k zeta(k) (k-1)/k t^(k-2): coefficients of the series at 0
_SERIES = [2 * (-1) ** k * _ZETA[k] * (k - 1) / k for k in range(2, 11)]
_SERIES_BELOW = 0.05
#: the Newton step is taken only where it keeps sum(alpha) at most this (see
#: :func:`newton_dirichlet_step`); larger rows move by MM steps
NEWTON_MAX_SUM = 1e4


def series_coefficients(like: torch.Tensor) -> torch.Tensor:
    """``[8]`` the coefficients of t^1..t^8 of the series of :func:`curvature`, as 0-d
    fills in the dtype and on the device of ``like`` (no host-to-device copy)."""
    return torch.stack([like.new_full((), c) for c in _SERIES[1:]])


def _series_curvature(t: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
    """The Taylor series of :func:`curvature` at 0, evaluated at min(t, 0.05) (Horner:
    a_0 + t (a_1 + t (... + t (a_7 + t a_8))), ``coefficients`` = a_1..a_8)."""
    if coefficients is None:
        coefficients = series_coefficients(t)
    ts = t.clamp(max=_SERIES_BELOW)
    series = torch.addcmul(coefficients[-2], coefficients[-1], ts)  # a_7 + t a_8
    for j in range(len(coefficients) - 3, -1, -1):  # a_6 .. a_1
        series = torch.addcmul(coefficients[j], series, ts)
    return series.mul_(ts).add_(_SERIES[0])


def curvature(
    t: torch.Tensor,
    lgamma1: torch.Tensor | None = None,
    digamma1: torch.Tensor | None = None,
) -> torch.Tensor:
    """Erdogan-Fessler curvature of phi(t) = ln Gamma(t + 1) at ``t >= 0`` (paper Lemma 1).

    c(t) = 2 (phi(0) - phi(t) + t phi'(t)) / t^2 for t > 0 and c(0) = phi''(0) = pi^2/6.
    The quadratic ``phi(beta) + phi'(beta)(a - beta) + c(beta)/2 (a - beta)^2`` majorises
    ``phi`` on [0, inf) because phi'' is decreasing. Below t = 0.05 the difference in the
    numerator cancels catastrophically, so the Taylor series
    ``c(t) = sum_{k>=2} 2 (-1)^k zeta(k) (k-1)/k t^(k-2)`` (9 terms, relative error
    < 3e-12) is used, chosen elementwise (``torch.where``).
    ``lgamma1`` = ln Gamma(t+1) and ``digamma1`` = digamma(t+1) may be passed when known.
    """
    small = t < _SERIES_BELOW
    if lgamma1 is None or digamma1 is None:
        tl = torch.where(small, torch.ones_like(t), t)
        lgamma1, digamma1 = torch.lgamma(tl + 1), torch.special.digamma(tl + 1)
    else:
        tl = t
    direct = 2 * (tl * digamma1 - lgamma1) / tl.square()
    return torch.where(small, _series_curvature(t), direct)


def mm_dirichlet_step(
    alpha: torch.Tensor, stat: torch.Tensor, coefficients: torch.Tensor | None = None
) -> torch.Tensor:
    """One MM-quadratic iteration (paper Algorithm 1) for rows ``alpha`` [..., K].

    ``stat`` [..., K] is the weighted mean log-feature s_k. With beta = alpha, per coordinate:
    b_i = digamma(beta_i + 1) - digamma(sum_j beta_j) - c(beta_i) beta_i - s_i and the new
    alpha_i is the positive root of c(beta_i) a^2 + b_i a = 1, computed without cancellation
    as 2 / (b + sqrt(b^2 + 4c)) when b > 0 and (sqrt(b^2 + 4c) - b) / (2c) otherwise.
    The update never increases F(alpha) = -ln Gamma(sum alpha) + sum ln Gamma(alpha_i)
    - sum (alpha_i - 1) s_i (:func:`dirichlet_nll`); its fixed point is the Dirichlet MLE.

    Branch-free and free of host synchronisations: the curvature c(beta) is, elementwise,
    the series of :func:`curvature` where beta < 0.05 and otherwise
    c(beta) beta = 2 (digamma(beta + 1) - ln Gamma(beta + 1) / beta) formed directly (equal
    to :func:`curvature` times beta up to rounding). ``coefficients`` =
    :func:`series_coefficients` of ``alpha`` may be passed when iterating. Cost: the two
    special functions (digamma and ln Gamma of beta + 1) dominate, then the 9-term
    series; the other arithmetic is done in place on their buffers (about 35 torch
    calls in all).
    """
    shifted = alpha + 1
    digamma1 = torch.special.digamma(shifted)
    lgamma1 = torch.lgamma(shifted)
    del shifted
    small = alpha < _SERIES_BELOW
    series = _series_curvature(alpha, coefficients)
    # c beta = 2 (t phi'(t) - phi(t)) / t with t = beta; in place on the lgamma buffer
    c_alpha = lgamma1.div_(alpha).sub_(digamma1).mul_(-2)
    c = torch.where(small, series, c_alpha / alpha)
    c_alpha = torch.where(small, series.mul_(alpha), c_alpha)
    del series
    # b, in place on the digamma buffer
    b = digamma1.sub_(torch.special.digamma(alpha.sum(-1, keepdim=True)))
    b = b.sub_(c_alpha).sub_(stat)
    del c_alpha
    # u = |b| + sqrt(b^2 + 4c) has no cancellation: root = 2/u (b > 0) or u/(2c) (b <= 0)
    u = torch.addcmul(c, b, b, value=0.25).sqrt_().mul_(2).add_(b.abs())
    return torch.where(b > 0, u.reciprocal().mul_(2), u.div_(c.mul_(2)))


def newton_dirichlet_step(
    alpha: torch.Tensor, stat: torch.Tensor, coefficients: torch.Tensor | None = None
) -> torch.Tensor:
    """One safeguarded Newton-Raphson iteration for rows ``alpha`` [..., K] (same optimum).

    Minka, "Estimating a Dirichlet distribution" (2000), §1: for
    F(alpha) = -ln Gamma(A) + sum_i ln Gamma(alpha_i) - sum_i (alpha_i - 1) s_i
    (:func:`dirichlet_nll`, A = sum_i alpha_i) the gradient is
    g_i = digamma(alpha_i) - digamma(A) - s_i and the Hessian is
    H = diag(q) - c 1 1^T with q_i = trigamma(alpha_i), c = trigamma(A), so by
    Sherman-Morrison the Newton direction is, in O(K),
    d = H^{-1} g = (g - b) / q,   b = sum_j (g_j / q_j) / (sum_j 1 / q_j - 1 / c).
    The step is shortened to stay inside alpha > 0:
    alpha_N = alpha - theta d, theta = min(1, 0.9 min_{d_i > 0} alpha_i / d_i) (theta = 1
    near the optimum, where the convergence is quadratic).

    Safeguard (branch-free, per row, ``torch.where``): the MM-quadratic step
    alpha_MM = :func:`mm_dirichlet_step` is also formed and the row takes alpha_N only
    where it is finite, sum(alpha_N) <= ``NEWTON_MAX_SUM`` (1e4, whatever the dtype) and
    F(alpha_N) <= F(alpha_MM); otherwise alpha_MM. The bound on the sum matters for rows
    whose maximum-likelihood alpha does not exist or is huge (a cluster of one sample or
    of near-duplicates: F decreases without bound, or nearly, as alpha grows along it):
    there Newton about doubles alpha at every iteration, and F ~ A ln A would soon lose
    all its digits (in float32 first), so the comparison would be noise and float32 and
    float64 would part. Beyond the bound such rows grow by MM steps (about +10 per
    iteration for K = 41), as in the reference loop, whose 1000 inner iterations reach
    a sum of about 1e4 in one outer iteration. Each iteration
    therefore decreases F at least as much as an MM iteration (MM's monotone guarantee
    is kept, up to rounding of F) and the fixed point is the same (the Dirichlet MLE:
    g = 0). Cost: about 2.5 MM iterations (digamma, trigamma and ln Gamma of the rows
    and their sums besides the MM step); no host synchronisation.
    """
    total = alpha.sum(-1, keepdim=True)
    q = torch.special.polygamma(1, alpha)
    c = torch.special.polygamma(1, total)
    g = torch.special.digamma(alpha).sub_(torch.special.digamma(total)).sub_(stat)
    inv_q = q.reciprocal()
    b = (g * inv_q).sum(-1, keepdim=True) / (inv_q.sum(-1, keepdim=True) - c.reciprocal())
    d = g.sub_(b).mul_(inv_q)
    # largest step fraction keeping alpha > 0 (0.9 of the way to the boundary)
    bound = torch.where(d > 0, alpha / d, torch.full_like(alpha, math.inf))
    theta = bound.amin(-1, keepdim=True).mul_(0.9).clamp_(max=1.0)
    newton = alpha - theta * d
    mm = mm_dirichlet_step(alpha, stat, coefficients)
    f_newton = dirichlet_nll(newton, stat)
    take = torch.isfinite(f_newton) & (f_newton <= dirichlet_nll(mm, stat))
    take = take & (newton.sum(-1) <= NEWTON_MAX_SUM)
    return torch.where(take.unsqueeze(-1), newton, mm)


#: names of the inner solvers (keyword ``solver``)
SOLVERS = {"mm": mm_dirichlet_step, "newton": newton_dirichlet_step}


def dirichlet_nll(alpha: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
    """Per-row weighted Dirichlet NLL divided by the weight (the MM step's target).

    F(alpha) = -ln Gamma(sum_i alpha_i) + sum_i ln Gamma(alpha_i) - sum_i (alpha_i - 1) s_i,
    shape ``alpha.shape[:-1]``.
    """
    return -torch.lgamma(alpha.sum(-1)) + torch.lgamma(alpha).sum(-1) - ((alpha - 1) * stat).sum(-1)


def is_check_iteration(i: int, check_every: int) -> bool:
    """Whether the per-row convergence test follows MM iteration ``i`` (1-based).

    The reference code tests after iterations check_every + 1, 2 check_every + 1, ...
    (its ``l % 50 == 0`` on a counter that starts at 0 after the first update).
    """
    return i > check_every and (i - 1) % check_every == 0


def mm_dirichlet_fit(
    alpha: torch.Tensor,
    stat: torch.Tensor,
    max_iter: int = 1000,
    tol: float = 1e-11,
    check_every: int = 50,
    frozen: torch.Tensor | None = None,
    early_exit: bool = False,
    solver: str = "mm",
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Iterate :func:`mm_dirichlet_step` (or ``solver``'s step) from the warm start ``alpha``
    (design §3.1).

    Args:
        alpha: ``[..., K]`` starting Dirichlet parameters (one row per task and class).
        stat: ``[..., K]`` weighted mean log-features of the rows.
        max_iter: at most this many MM iterations (reference code: 1000).
        tol: a row stops once ||alpha_new - alpha||^2 / ||alpha||^2 < tol at a check
            (reference code: 1e-11; the paper's Table 3 uses 1e-13).
        check_every: iterations between convergence checks (reference code: 50; the
            first check follows iteration ``check_every + 1``, :func:`is_check_iteration`).
        frozen: ``[...]`` bool, rows that keep their ``alpha`` (empty classes).
        early_exit: ask the host after every check whether any row still moves and stop
            when none does (one synchronisation per check). The result is the same
            either way; without it the loop makes no host synchronisation and always
            runs ``max_iter`` iterations.
        solver: ``"mm"`` (:func:`mm_dirichlet_step`, the reference code's Algorithm 1)
            or ``"newton"`` (:func:`newton_dirichlet_step`: the same fixed point, each
            iteration decreasing F at least as much as an MM iteration).
        compiled: run each iteration ``torch.compile``'d, and on CUDA replay the
            iterations from CUDA graphs (:mod:`probfsl.inference.dirichlet_mm_graph`;
            about 20x faster on a GPU, where the eager loop is bound by kernel launches).
            ``None``: on CUDA tensors, unless ``early_exit``. The same arithmetic; the
            fused kernels round differently (relative differences near 1e-6 in float32).

    Convergence is tested per row on the device (each row is an independent Dirichlet
    fit): a row that converged, or is frozen, is masked (``torch.where``) and keeps its
    value, so every row gets the result it would get alone and the shapes never change.
    Every iteration decreases each row's :func:`dirichlet_nll`, so stopping after any
    number of iterations (``max_iter`` small) is a partial minimisation that still
    decreases the objective (block MM with inexact blocks).
    Returns the new ``alpha`` and the number of iterations each row ran.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {tuple(SOLVERS)}, got {solver!r}")
    step = SOLVERS[solver]
    if frozen is None:
        active = torch.ones(alpha.shape[:-1], dtype=torch.bool, device=alpha.device)
    else:
        active = ~frozen
    if compiled is None:
        compiled = alpha.is_cuda and not early_exit
    if compiled:
        masked = compiled_iteration("masked", solver)
        checked = compiled_iteration("checked", solver)
    else:
        masked = functools.partial(masked_iteration, step)
        checked = functools.partial(checked_iteration, step)
    coefficients = series_coefficients(alpha)
    if compiled and alpha.is_cuda and not early_exit:
        alpha, active, stopped = graphed_fit(
            alpha, stat, coefficients, active, masked, checked, max_iter, tol, check_every
        )
        return alpha, torch.where(active, max_iter, stopped)
    # iteration at which each row stopped; rows still active at the end ran them all
    stopped = torch.zeros(alpha.shape[:-1], dtype=torch.long, device=alpha.device)
    done = 0
    for i in range(1, max_iter + 1):
        if i < max_iter and is_check_iteration(i, check_every):
            alpha, active, stopped = checked(alpha, stat, coefficients, active, stopped, i, tol)
        else:
            alpha = masked(alpha, stat, coefficients, active)
        done = i
        if early_exit and is_check_iteration(i, check_every) and not bool(active.any()):
            break
    return alpha, torch.where(active, done, stopped)


def masked_iteration(
    step: Callable, alpha: torch.Tensor, stat: torch.Tensor, coefficients, active: torch.Tensor
) -> torch.Tensor:
    """One inner iteration: rows in ``active`` take ``step(alpha, stat)``, others keep alpha."""
    return torch.where(active.unsqueeze(-1), step(alpha, stat, coefficients), alpha)


def checked_iteration(
    step: Callable,
    alpha: torch.Tensor,
    stat: torch.Tensor,
    coefficients,
    active: torch.Tensor,
    stopped: torch.Tensor,
    i,
    tol: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One inner iteration followed by the reference code's per-row test (design §3.1): a row
    stops once ||alpha_new - alpha||^2 < tol ||alpha||^2, and ``stopped`` records the
    iteration ``i`` at which it did. Returns (alpha, active, stopped)."""
    new = step(alpha, stat, coefficients)
    moving = ~((new - alpha).square().sum(-1) < tol * alpha.square().sum(-1))
    alpha = torch.where(active.unsqueeze(-1), new, alpha)
    stopped = torch.where(active & ~moving, i, stopped)
    return alpha, active & moving, stopped


def _masked_mm(alpha, stat, coefficients, active):
    return masked_iteration(mm_dirichlet_step, alpha, stat, coefficients, active)


def _checked_mm(alpha, stat, coefficients, active, stopped, i, tol):
    return checked_iteration(mm_dirichlet_step, alpha, stat, coefficients, active, stopped, i, tol)


def _masked_newton(alpha, stat, coefficients, active):
    return masked_iteration(newton_dirichlet_step, alpha, stat, coefficients, active)


def _checked_newton(alpha, stat, coefficients, active, stopped, i, tol):
    return checked_iteration(
        newton_dirichlet_step, alpha, stat, coefficients, active, stopped, i, tol
    )


#: one function (one code object, so one compilation cache) per kind and solver
_ITERATIONS = {
    ("masked", "mm"): _masked_mm,
    ("checked", "mm"): _checked_mm,
    ("masked", "newton"): _masked_newton,
    ("checked", "newton"): _checked_newton,
}


@functools.cache
def compiled_iteration(kind: str, solver: str) -> Callable:
    """``torch.compile``'d :func:`masked_iteration` (``kind="masked"``) or
    :func:`checked_iteration` (``"checked"``) for the inner step named ``solver``.

    Shapes become dynamic at the first recompilation (torch's default), so new batch
    sizes do not pile up compilations; without ``fullgraph``, torch falls back to eager
    rather than failing should it ever reach its recompilation limit.
    """
    return torch.compile(_ITERATIONS[kind, solver])


def dirichlet_log_density(log_x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``[B, N, K]`` matrix ln Dir(x_n | alpha_k) from ``log_x`` [B, N, K] and ``alpha`` [B, K, K].

    ln Dir(x|alpha) = ln Gamma(sum_i alpha_i) - sum_i ln Gamma(alpha_i)
    + sum_i (alpha_i - 1) ln x_i.
    """
    norm = torch.lgamma(alpha.sum(-1)) - torch.lgamma(alpha).sum(-1)
    return log_x @ (alpha - 1).transpose(-1, -2) + norm.unsqueeze(-2)


def weighted_log_stat(log_x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sufficient statistics s_k = sum_n R_nk ln x_n / sum_n R_nk ([B, K, K]) and weights [B, K]."""
    weight = r.sum(-2)
    stat = r.transpose(-1, -2) @ log_x / weight.clamp_min(EMPTY).unsqueeze(-1)
    return stat, weight


def assignment_logits(
    log_density: torch.Tensor, pi: torch.Tensor, lambda_coef: float
) -> torch.Tensor:
    """Logits of the assignment step: ln Dir(x_n|alpha_k) + (lambda/|Q|) ln(pi_k + 1e-15)."""
    return log_density + lambda_coef * torch.log(pi + EPS).unsqueeze(-2)


def default_lambda_coef(n_classes: int, k_eff: int = 5) -> float:
    """The reference code's lambda/|Q| = floor(K / k_eff) (design §3.7; k_eff = 5)."""
    return float(n_classes // k_eff)


@dataclass(frozen=True)
class EMDirichletInfo(Info):
    """What one :meth:`EMDirichletEngine.step` reports.

    Attributes:
        objective: ``[B]`` J after the step.
        mm_iters: ``[B, K]`` inner MM iterations each class row ran in the alpha step.
    """

    mm_iters: torch.Tensor


@dataclass
class DirichletMixtureState:
    """Variables of a batch of ``B`` tasks (``S`` support rows first, then ``Q`` queries).

    Attributes:
        log_x: ``[B, S+Q, K]`` ln(x + 1e-15).
        n_support: S.
        r: ``[B, S+Q, K]`` assignments; support rows are the one-hot labels.
        alpha: ``[B, K, K]`` Dirichlet parameters, row k for class k.
        pi: ``[B, K]`` query proportions mean_Q r (profiled point estimate).
        objective: ``[B]`` J(r, alpha) of design §3.5 (to be minimised).
        mm_iters: ``[B, K]`` inner MM iterations of the last alpha step.
    """

    log_x: torch.Tensor
    n_support: int
    r: torch.Tensor
    alpha: torch.Tensor
    pi: torch.Tensor
    objective: torch.Tensor
    mm_iters: torch.Tensor

    @property
    def query_r(self) -> torch.Tensor:
        """``[B, Q, K]`` query assignments."""
        return self.r[:, self.n_support :]


class EMDirichletEngine(Engine):
    """EM-Dirichlet (soft) or Hard EM-Dirichlet, paper Algorithm 2, as a batched MM engine.

    Data: ``init(query, support=None, support_labels=None)`` with ``query`` [B, Q, K]
    probability vectors, ``support`` [B, S, K] and integer ``support_labels`` [B, S] in
    0..K-1 (few-shot; empty or None for zero-shot). Initialisation: R_Q = the input
    probabilities, R_S = one-hot labels, alpha = 1. One :meth:`step` is one outer
    iteration: alpha step (Algorithm 1, warm-started), proportions from the old R, then
    the assignment step. ``objective`` is J (design §3.5), non-increasing after every block.

    Args:
        lambda_coef: lambda / |Q|, the weight of the partition-complexity (MDL) term per
            query. ``None`` gives the reference code's floor(K / k_eff) (design §3.7); 1 is
            plain EM (paper Prop. 1); 0 drops the MDL term. This is the method's one
            sensitive knob: on a synthetic K=10 task with a shared bias toward one class
            the reference default (2) scored 0.24 against 0.64 for plain EM and 0.53 for
            the argmax baseline (design §4), and it is 0 (no MDL) when K < k_eff.
        k_eff: the assumed number of classes present in a task, for the default lambda.
        hard: one-hot assignments and no entropy barrier (Hard EM-Dirichlet).
        mm_max_iter: inner Algorithm-1 iterations per outer iteration, at most
            (default 1000 = reference; ``BOUNDED_MM`` uses 20).
        mm_tol: per-row stopping tolerance on ||alpha_new - alpha||^2 / ||alpha||^2
            (reference: 1e-11).
        mm_check_every: iterations between per-row convergence checks (reference: 50;
            ``BOUNDED_MM``: 1, a converged row stops at once).
        mm_early_exit: let the inner loop ask the host, after each check, whether any row
            still moves and stop when none does (:func:`mm_dirichlet_fit`): the same
            result, fewer iterations for a batch of a few tasks, but up to
            ``mm_max_iter / mm_check_every`` host synchronisations per step. Off by
            default: :meth:`step` then makes no host synchronisation (a converged row is
            masked, not removed, so in a large batch the inner loop runs ``mm_max_iter``
            iterations anyway: some row nearly always does).
        solver: the inner step, ``"mm"`` (:func:`mm_dirichlet_step`, the reference) or
            ``"newton"`` (:func:`newton_dirichlet_step`; ``NEWTON`` = 20 iterations,
            checked every one). The ``mm_*`` settings apply to either.
        compiled: the inner loop fused by ``torch.compile`` and, on CUDA, replayed from
            CUDA graphs (``mm_dirichlet_fit``'s ``compiled``); ``None`` = on CUDA only.

    Reference mode (the default, ``REFERENCE_MM``) versus bounded mode (``BOUNDED_MM``):
    each MM iteration decreases the class's weighted NLL, so stopping the inner loop
    early is an inexact block minimisation and J still never increases (design §6.4;
    tested); a row that has not converged continues from its warm start at the next
    outer iteration. The cap matters for rows whose maximum-likelihood alpha does not
    exist or is huge: a cluster holding one sample (or near-duplicates) has a
    likelihood that increases without bound as alpha_k grows along x_n, and MM-quadratic
    grows sum(alpha_k) by only about 10 per iteration (K = 41), so the reference loop
    spends all 1000 inner iterations on such rows in every outer iteration (21-35 % of
    the rows of WordNet zero-shot tasks) to push alpha_k up by ~10^4 each time. With a
    cap of 20 they still grow (and stay absorbing) at 1/50 of the cost: on WordNet
    zero-shot tasks the bounded mode was 18-24x faster (measured when converged rows
    left the loop; now that they are masked, a batch runs 20 against 1000 inner
    iterations per outer one) and its accuracy is within the
    reference's confidence interval (paired difference -0.01 ± 0.05 hard, +0.25 ± 0.40
    soft on 100 tasks; benchmarks/results/em_dirichlet.md). In few-shot tasks with few
    classes (K = 5) rows with a large but finite MLE are not reached within 20 x 20
    iterations and the soft variant's accuracy moved by +4 points, so the bounded mode is
    not the few-shot default. Freezing non-existent-MLE rows instead (no step at all)
    changed 17 % of the hard-variant zero-shot predictions (-1.6 points), so such rows
    are never frozen; only classes with no weight are.
    """

    maximize = False

    def __init__(
        self,
        lambda_coef: float | None = None,
        k_eff: int = 5,
        hard: bool = False,
        mm_max_iter: int = 1000,
        mm_tol: float = 1e-11,
        mm_check_every: int = 50,
        mm_early_exit: bool = False,
        solver: str = "mm",
        compiled: bool | None = None,
    ) -> None:
        if lambda_coef is not None and not (lambda_coef >= 0 and math.isfinite(lambda_coef)):
            raise ValueError(f"lambda_coef must be a finite number >= 0, got {lambda_coef}")
        if k_eff < 1:
            raise ValueError(f"k_eff must be at least 1, got {k_eff}")
        if mm_max_iter < 1 or mm_check_every < 1:
            raise ValueError(
                f"mm_max_iter and mm_check_every must be positive, got {mm_max_iter}, "
                f"{mm_check_every}"
            )
        if not mm_tol >= 0:
            raise ValueError(f"mm_tol must be >= 0, got {mm_tol}")
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {tuple(SOLVERS)}, got {solver!r}")
        self.lambda_coef = lambda_coef
        self.k_eff = k_eff
        self.hard = hard
        self.mm_max_iter = mm_max_iter
        self.mm_tol = mm_tol
        self.mm_check_every = mm_check_every
        self.mm_early_exit = mm_early_exit
        self.solver = solver
        self.compiled = compiled

    # -- data ---------------------------------------------------------------------------
    def coef(self, n_classes: int) -> float:
        """lambda / |Q| for ``n_classes`` simplex dimensions."""
        if self.lambda_coef is None:
            return default_lambda_coef(n_classes, self.k_eff)
        return float(self.lambda_coef)

    @staticmethod
    def _check(query, support, support_labels) -> None:
        from probfsl.data.simplex import check_probabilities

        check_probabilities(query, "query", ndim=3)
        if (support is None) != (support_labels is None):
            raise ValueError("support and support_labels must be given together")
        if support is None:
            return
        check_probabilities(support, "support", ndim=3, allow_empty=True)
        check_task_tensors(support, support_labels, query, query.shape[-1], partial_support=True)

    def init(
        self,
        query: torch.Tensor,
        support: torch.Tensor | None = None,
        support_labels: torch.Tensor | None = None,
    ) -> DirichletMixtureState:
        self._check(query, support, support_labels)
        b, _, k = query.shape
        if support is None:
            support = query.new_zeros(b, 0, k)
            support_labels = torch.zeros(b, 0, dtype=torch.long, device=query.device)
        x = torch.cat([support, query], 1)
        onehot = torch.nn.functional.one_hot(support_labels.long(), k).to(query.dtype)
        r = torch.cat([onehot, query], 1)  # both variants start from R_Q = X_Q (soft)
        state = DirichletMixtureState(
            log_x=torch.log(x + EPS),
            n_support=support.shape[1],
            r=r,
            alpha=query.new_ones(b, k, k),
            pi=r[:, support.shape[1] :].mean(1),
            objective=query.new_zeros(b),
            mm_iters=torch.zeros(b, k, dtype=torch.long, device=query.device),
        )
        return replace(state, objective=self.objective(state))

    @staticmethod
    def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)

    # -- block steps --------------------------------------------------------------------
    def step(self, state: DirichletMixtureState) -> tuple[DirichletMixtureState, EMDirichletInfo]:
        """One outer iteration of Algorithm 2: alpha step, then proportions + assignments.

        The ``[B, S+Q, K]`` log-density matrix is computed once per outer iteration and
        shared by the assignment step and the objective after it (alpha does not change
        in between). The objective between the two blocks is not needed here and is not
        computed (:meth:`update_alpha` computes it). No host synchronisation unless
        ``mm_early_exit``.
        """
        state, log_density = self._alpha_step(state, with_objective=False)
        state = self._assignment_step(state, log_density)
        return state, EMDirichletInfo(state.objective, state.mm_iters)

    def update_alpha(self, state: DirichletMixtureState) -> DirichletMixtureState:
        """Algorithm 1 per class on the R-weighted statistic; empty classes keep alpha."""
        return self._alpha_step(state)[0]

    def update_assignments(self, state: DirichletMixtureState) -> DirichletMixtureState:
        """Design §3.2-3.3: pi from the current R, then the closed-form query assignments."""
        return self._assignment_step(state, dirichlet_log_density(state.log_x, state.alpha))

    def fit_alpha(
        self, alpha: torch.Tensor, mean_log: torch.Tensor, empty: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1 per class from the weighted mean log-probabilities ``mean_log``
        [..., K, K], with this engine's inner loop; the classes ``empty`` [..., K] keep
        their alpha (their statistic is set to -10). Returns alpha and the iterations."""
        mean_log = torch.where(empty.unsqueeze(-1), torch.full_like(mean_log, -10.0), mean_log)
        return mm_dirichlet_fit(
            alpha,
            mean_log,
            self.mm_max_iter,
            self.mm_tol,
            self.mm_check_every,
            frozen=empty,
            early_exit=self.mm_early_exit,
            solver=self.solver,
            compiled=self.compiled,
        )

    def _alpha_step(
        self, state: DirichletMixtureState, with_objective: bool = True
    ) -> tuple[DirichletMixtureState, torch.Tensor]:
        stat, weight = weighted_log_stat(state.log_x, state.r)
        alpha, iters = self.fit_alpha(state.alpha, stat, weight <= EMPTY)
        log_density = dirichlet_log_density(state.log_x, alpha)
        new = replace(state, alpha=alpha, mm_iters=iters)
        if not with_objective:
            return new, log_density
        return replace(new, objective=self.objective(new, log_density)), log_density

    def _assignment_step(
        self, state: DirichletMixtureState, log_density: torch.Tensor
    ) -> DirichletMixtureState:
        s = state.n_support
        pi = state.r[:, s:].mean(1)
        logits = assignment_logits(log_density[:, s:], pi, self.coef(pi.shape[-1]))
        r_q = self._one_hot_argmax(logits) if self.hard else torch.softmax(logits, -1)
        r = torch.cat([state.r[:, :s], r_q], 1)
        new = replace(state, r=r, pi=r_q.mean(1))
        return replace(new, objective=self.objective(new, log_density))

    # -- objective ----------------------------------------------------------------------
    def objective(
        self, state: DirichletMixtureState, log_density: torch.Tensor | None = None
    ) -> torch.Tensor:
        """J(R, alpha) of design §3.5 per task: -L + Phi (soft only) + lambda Psi.

        ``log_density`` = :func:`dirichlet_log_density` of ``state`` when already known.
        """
        s = state.n_support
        if log_density is None:
            log_density = dirichlet_log_density(state.log_x, state.alpha)
        data = -(state.r * log_density).sum((-1, -2))
        r_q = state.r[:, s:]
        n_query = r_q.shape[1]
        pi = r_q.mean(1)
        mdl = -self.coef(pi.shape[-1]) * n_query * torch.special.xlogy(pi, pi).sum(-1)
        if self.hard:
            return data + mdl
        return data + torch.special.xlogy(r_q, r_q).sum((-1, -2)) + mdl

    # -- Pyro guide ---------------------------------------------------------------------
    def point_estimates(self, state: DirichletMixtureState) -> dict[str, torch.Tensor]:
        """The values of the declaration's ``pyro.param`` sites
        (:func:`probfsl.derived.em_dirichlet.em_dirichlet_model`): the concentrations
        ``alpha [B, K, K]`` and the proportions ``pi = mean_Q r`` as ``[B, 1, K]``."""
        return {"alpha": state.alpha, "pi": state.pi.unsqueeze(-2)}

    def guide(self, state: DirichletMixtureState):
        """Categorical(r_n) for the query classes (alpha and pi are the declaration's
        point estimates: :meth:`point_estimates`)."""
        r_q = state.query_r

        def guide(query, support=None, support_labels=None, *args, **kwargs) -> None:
            with pyro.plate("tasks", query.shape[0], dim=-2):
                with pyro.plate("queries", query.shape[1], dim=-1):
                    pyro.sample("c", dist.Categorical(probs=r_q))

        return guide


def gather_alpha(alpha: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``alpha_{labels}``: alpha [..., B, 1, K, K] indexed by labels [..., B, N] -> [..., B, N, K].

    Works with Pyro's enumerated or particle-vectorised ``labels``.
    """
    return Vindex(alpha)[..., labels, :]
