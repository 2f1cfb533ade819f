"""The evidence LS-SVM's inference derived from its declaration by VMP.

Kim, Jang, Han, Choi, "Learning to Select Pre-Trained Deep Representations with
Bayesian Evidence Framework", CVPR 2016 (docs/design/evidence.md): Bayesian linear
regression of each one-vs-rest 0/1 target on the features, ``w_k ~ Normal(0, (lambda
beta_k)^-1 I_D)``, ``y_k ~ Normal(X w_k, beta_k^-1 I_N)``, with ``lambda`` and ``beta_k``
type-II maximum-likelihood point estimates (``pyro.param``); ``lambda`` is shared by the
classes of a task (``"shared"``) or one per class (``"per_class"``, the paper).

**Why the declaration is in the rotated basis (design §3, §7).** Features are D = 1280
(or 64) wide while a support has N = 5-25 rows: a weight-space factor q(w) with a D x D
precision per task and class cannot be afforded for 1,000 tasks. With the
eigendecomposition of the support's Gram matrix ``X X^T = U diag(s) U^T`` (the paper's
single decomposition, shared by all classes), put ``z_k = diag(sigma)^-1 U^T X w_k``
(``sigma = sqrt(s)``; the coordinates of w_k in the row space of X) and
``y~_k = U^T y_k``. Since U is orthogonal and the part of w_k outside the row space of
X never reaches y, the regression is exactly

    z_dk ~ Normal(0, (lambda beta_k)^-1),   y~_dk ~ Normal(sigma_d z_dk, beta_k^-1),

N independent coordinates per class with ``|det U| = 1``: the same evidence
``p(y_k | lambda, beta_k)`` (eq. 14-17), the same stationary points, and the posterior
mean ``m_k = X^T U diag(1/sigma) E[z_k]`` (zero-eigenvalue coordinates keep the least
squares residual in y~ and contribute nothing else). :func:`rotated_evidence_model` declares
this regression in plain Pyro; the Gram matrix and its eigendecomposition are the data
preparation (:func:`rotate`), not inference. A dual (Gram) factor in the VMP language
would have done the same work with an N x N precision per class; the rotated
coordinates make the posterior diagonal, so nothing in the shared VMP files changed.

**What VMP derives** (:class:`~probfsl.inference.VMP`, order ``lam, beta, z``): the
exact factor q(z) given the point estimates and, for ``lambda`` and ``beta``, the exact
maximiser of their terms given q(z): the EM (conditional maximisation) map of type-II
maximum likelihood. With q(z) exact, the bound after a sweep is the log evidence.

**What this module chooses** (the paper's acceleration, Algorithm 1): that EM map alone
needs thousands of sweeps on 5-shot tasks (2,600 on average on Omniglot, some more than
20,000). :class:`DerivedEvidenceEngine` therefore runs the derived updates in the
paper's schedule:

* ``beta`` is profiled at fixed ``lambda`` (eq. 16) by two derived (beta, z) sweeps
  and Aitken's delta-squared step on ``1/beta`` (the derived beta map is affine in
  ``1/beta`` at fixed lambda, so the step lands on the profile value);
* one lambda "map" is one full derived sweep followed by that profile, a map of lambda
  whose fixed points are the stationary points of the profile evidence (eq. 17-19);
* lambda starts at the argmax of the declared model's profile evidence on a 64-point log
  grid over ``span x mean(s)`` (design §4; :func:`profile_log_evidence`, the model's
  Gaussian marginal in closed form);
* each engine step takes two maps and Aitken's step on ``log lambda`` (Algorithm 1;
  at most ``reach`` times the two maps' move, clamped to ``clamp x mean(s)``), and
  keeps, per task, the candidate with the highest log evidence among {the current
  state, the two maps, Aitken's step}: every step is monotone by construction (and a
  non-finite candidate never wins).

The loop is :func:`~probfsl.inference.base.run` with the hand-written engine's
tolerance (16 machine epsilons of the evidence, relative), for at most ``max_iter`` (10)
steps: on 5-shot tasks the EM map's rate is about ``1 - 1e-4`` and Aitken's step,
bounded by ``reach``, cannot finish there; the schedule is a warm start (measured on
1,000 Omniglot tasks, the agreement below is the same with 0, 10 or 200 steps).

**The stationary point: safeguarded Newton on the profile evidence.** The goal of the
paper's fixed point (Algorithm 1-2, eq. 19 with the factor N) is the stationary point of
the profile log evidence ``F(lambda)`` (eq. 16-17: beta profiled, ``dF/dlambda = 0``).
:func:`~probfsl.inference.evidence.newton_polish` reaches it directly, batched, by Newton
steps on ``log lambda`` of this regression's profile evidence in closed form (its
spectrum: the rotated coordinates, summed over the task's targets), each kept only where
the evidence does not decrease, lengthened by doublings while each raises it (a lambda
heading for a finite limit at 0 or infinity lands on the clamp) and otherwise halved; the
hand-written engine finishes with the same routine. Not polished: problems whose grid
argmax is the span's upper end, where the evidence still rises as lambda -> infinity (one
positive per target, design §3) and has no stationary point; their lambda, as arbitrary as
the hand-written engine's there, stays the schedule's. Then one derived profile of beta
and q(z) at the final lambda (the (beta, z) sweeps above): beta, q(z) and the bound still
come from VMP, and the bound is the log evidence there.

**Where the evidence has no finite maximiser** (1-shot tasks: design §3, Theorem 1
caveats), lambda ends beyond the span ``span x mean(s)`` the hand-written engine
searches (``at_boundary``); a task whose lambda is beyond its upper end for every class
is scored by the lambda -> infinity limit, the nearest class mean ``x^T X^T y_k /
mean(s)``, as :class:`~probfsl.models.evidence.EvidenceLSSVM` does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.inference import VMP
from probfsl.inference.base import Engine, Info, RunInfo, run
from probfsl.inference.evidence import (
    Spectrum,
    at_upper_limit,
    decision_weights,
    newton_polish,
    solve_evidence,
    spectrum,
)
from probfsl.inference.ops import aitken, gram_eigh
from probfsl.inference.vmp import messages
from probfsl.inference.vmp.einsum import sweeping
from probfsl.inference.vmp.engine import VMPState
from probfsl.validation import check_choice

LAMBDA_MODES = ("shared", "per_class")
LOG_2PI = math.log(2 * math.pi)


def rotated_evidence_model(sigma: torch.Tensor, proj: torch.Tensor, lam_init: torch.Tensor) -> None:
    """Bayesian linear regression in the rotated basis (module docstring; eq. 3-5, 15).

    ``sigma [T, 1, N]`` square roots of the Gram eigenvalues (0 for null directions),
    ``proj [T, K, N]`` the rotated targets ``U^T y_k``, ``lam_init [T, 1, 1]`` the
    starting ratio lambda = alpha / beta of each task (shared by its K targets);
    ``beta_k`` (per target) starts at 1. Both are type-II point estimates.
    """
    t, k, n = proj.shape
    with pyro.plate("tasks", t, dim=-3):
        lam = pyro.param("lam", lam_init, constraint=constraints.positive)
        with pyro.plate("targets", k, dim=-2):
            ones = torch.ones(t, k, 1, dtype=proj.dtype, device=proj.device)
            beta = pyro.param("beta", ones, constraint=constraints.positive)
            with pyro.plate("coords", n, dim=-1):
                z = pyro.sample("z", dist.Normal(proj.new_zeros(()), (lam * beta).rsqrt()))
                pyro.sample("y", dist.Normal(sigma * z, beta.rsqrt()), obs=proj)


@dataclass
class Rotation:
    """The support in the eigenbasis of its Gram matrix (one decomposition per task).

    Attributes:
        s: ``[T, N]`` eigenvalues of ``X X^T``, those below ``1e-12 x max`` set to 0.
        u: ``[T, N, N]`` eigenvectors.
        proj: ``[T, N, K]`` rotated targets ``U^T y``.
        scale: ``[T]`` mean non-zero eigenvalue (the scale of lambda).
    """

    s: torch.Tensor
    u: torch.Tensor
    proj: torch.Tensor
    scale: torch.Tensor


def rotate(x: torch.Tensor, y: torch.Tensor, rel_tol: float = 1e-12) -> Rotation:
    """Eigendecompose the Gram matrices of ``x [T, N, D]``, rotate ``y [T, N, K]`` (design §7)."""
    s, u = gram_eigh(x, rel_tol)
    pos = s > 0
    scale = s.sum(-1) / pos.sum(-1).clamp_min(1)
    return Rotation(s, u, u.mT @ y, scale.clamp_min(torch.finfo(s.dtype).tiny))


@dataclass
class DerivedEvidenceState:
    """The VMP state (factors, point estimates, bound ``[T]``) and the clamp of lambda."""

    vmp: VMPState
    lo: torch.Tensor
    hi: torch.Tensor

    @property
    def objective(self) -> torch.Tensor:
        """``[T]`` the log evidence summed over the task's targets (the bound, q(z) exact)."""
        return self.vmp.objective

    @property
    def lam(self) -> torch.Tensor:
        """``[T]`` lambda of each task."""
        return self.vmp.q["lam"][0].reshape(-1)


class DerivedEvidenceEngine(Engine):
    """Type-II maximum likelihood of :func:`rotated_evidence_model` with VMP's derived updates,
    in the paper's accelerated schedule (module docstring). Data: ``sigma [T, 1, N]``,
    ``proj [T, K, N]``, ``scale [T]`` (mean non-zero eigenvalue)."""

    maximize = True
    compacts = True

    def __init__(self, clamp: tuple[float, float] = (1e-10, 1e10), reach: float = 1e3) -> None:
        self.clamp, self.reach = clamp, reach
        self.vmp = VMP(rotated_evidence_model, order=["lam", "beta", "z"])

    def init(
        self, sigma: torch.Tensor, proj: torch.Tensor, scale: torch.Tensor, lam0: torch.Tensor
    ) -> DerivedEvidenceState:
        """VMP's initial factors at lambda = ``lam0 [T]``, then beta profiled."""
        state = self.vmp.init(sigma, proj, lam0.reshape(-1, 1, 1))
        lo, hi = self.clamp[0] * scale, self.clamp[1] * scale
        vmp = self._settle(state, state.q["lam"][0])
        return DerivedEvidenceState(vmp, lo, hi)

    @staticmethod
    def _sweep(state: VMPState, q: dict, names: tuple[str, ...]) -> None:
        for name in names:
            q[name] = messages.update(state.plan, q, name)

    def _settle(self, state: VMPState, lam: torch.Tensor) -> VMPState:
        """Lambda set to ``lam`` (canonical ``[T]``), beta profiled, q(z) exact, the bound."""
        q = dict(state.q)
        q["lam"] = (lam,)
        with sweeping():
            self._sweep(state, q, ("z",))
            inv = [q["beta"][0].reciprocal()]
            for _ in range(2):
                self._sweep(state, q, ("beta", "z"))
                inv.append(q["beta"][0].reciprocal())
            beta = aitken(*inv, positive=True).reciprocal()
            q["beta"] = (torch.where(beta > 0, beta, q["beta"][0]),)
            self._sweep(state, q, ("z",))
            objective = messages.elbo(state.plan, q)
        return VMPState(state.plan, q, objective)

    def _map(self, state: VMPState) -> VMPState:
        """One derived sweep (lam, beta, z), then beta profiled at the new lambda."""
        q = dict(state.q)
        with sweeping():
            self._sweep(state, q, ("lam",))
        return self._settle(state, q["lam"][0])

    def step(self, state: DerivedEvidenceState) -> tuple[DerivedEvidenceState, Info]:
        """Two maps, Aitken's step on log lambda, the clamp's ends; the best per task."""
        s0 = state.vmp
        s1 = self._map(s0)
        s2 = self._map(s1)
        logs = [s.q["lam"][0].log() for s in (s0, s1, s2)]
        lo, hi = state.lo, state.hi
        reach = self.reach * (logs[2] - logs[0]).abs()
        jump = logs[0] + (aitken(*logs) - logs[0]).clamp(-reach, reach)
        jump = jump.exp().clamp(lo, hi)
        best = s0  # a candidate must beat the current state (NaN never does)
        for cand in (s2, s1, self._settle(s0, jump)):
            better = cand.objective > best.objective
            best = self.vmp.keep(better, cand, best)
        new = dataclasses.replace(state, vmp=best)
        return new, Info(best.objective)

    def polish(
        self,
        state: DerivedEvidenceState,
        s: torch.Tensor,
        proj: torch.Tensor,
        free: torch.Tensor | None = None,
    ) -> DerivedEvidenceState:
        """Lambda moved to the stationary point of the profile evidence by safeguarded
        Newton steps (:func:`probfsl.inference.evidence.newton_polish`, on this
        regression's spectrum ``s``, ``proj``; only the tasks ``free [T]`` when given),
        then one derived (beta, z) profile there."""
        k = proj.shape[1]  # one lambda per problem, shared by its k targets
        sp = rotated_spectrum(s, proj)
        active = torch.ones_like(sp.yy, dtype=torch.bool) if free is None else free[:, None]
        wide = [t.unsqueeze(-1).expand(-1, k) for t in (state.lam, state.lo, state.hi)]
        lam = newton_polish(sp, *wide, active.expand(-1, k), shared=True)[:, 0]
        current = state.vmp.q["lam"][0]
        vmp = self._settle(state.vmp, lam.reshape(current.shape))
        return dataclasses.replace(state, vmp=vmp)

    def keep(
        self, frozen: torch.Tensor, old: DerivedEvidenceState, new: DerivedEvidenceState
    ) -> DerivedEvidenceState:
        return dataclasses.replace(new, vmp=self.vmp.keep(frozen, old.vmp, new.vmp))

    def take(self, state: DerivedEvidenceState, index: torch.Tensor) -> DerivedEvidenceState:
        return DerivedEvidenceState(
            self.vmp.take(state.vmp, index), state.lo[index], state.hi[index]
        )

    def put(
        self, full: DerivedEvidenceState, index: torch.Tensor, part: DerivedEvidenceState
    ) -> DerivedEvidenceState:
        return dataclasses.replace(full, vmp=self.vmp.put(full.vmp, index, part.vmp))

    def put_(
        self, full: DerivedEvidenceState, index: torch.Tensor, part: DerivedEvidenceState
    ) -> DerivedEvidenceState:
        return dataclasses.replace(full, vmp=self.vmp.put_(full.vmp, index, part.vmp))

    def guide(self, state: DerivedEvidenceState) -> Callable[..., None]:
        """VMP's guide: q(z) for the latent coordinates (the point estimates are fixed)."""
        return self.vmp.guide(state.vmp)


@dataclass
class DerivedEvidenceResult:
    """What :func:`derived_evidence` returns; ``[T, K]`` unless noted.

    ``lam``, ``beta``: point estimates; ``log_evidence``: per-target log evidence of the
    declared model at them (its marginal density, a closed form that sums to the VMP
    bound); ``at_boundary``: lambda beyond ``span x mean(s)``; ``at_limit [T]``: scored
    by the lambda -> infinity limit; ``weights [T, N, K]``: the dual scoring weights
    (query scores are ``x_q X^T weights``); ``info``: the run's trace and steps.
    """

    lam: torch.Tensor
    beta: torch.Tensor
    log_evidence: torch.Tensor
    at_boundary: torch.Tensor
    at_limit: torch.Tensor
    weights: torch.Tensor
    info: RunInfo


def profile_log_evidence(s: torch.Tensor, proj: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``max_beta log p(y~ | lambda, beta)`` of :func:`rotated_evidence_model` for lambdas
    ``lam [T, G]``, summed over the targets: ``[T, G]`` (``s [T, 1, N]``, ``proj [T, K, N]``).

    The declared model's marginal is ``y~_dk ~ Normal(0, (s_d / lambda + 1) / beta_k)``,
    whose maximiser in beta_k is ``N / sum_d y~_dk^2 lambda / (lambda + s_d)`` (eq. 16).
    """
    n = proj.shape[-1]
    lm = lam[:, :, None, None]  # [T, G, 1, 1]
    shrink = lm / (lm + s.unsqueeze(1))  # [T, G, 1, N]
    energy = (proj.unsqueeze(1) ** 2 * shrink).sum(-1)  # [T, G, K]
    floor = torch.finfo(s.dtype).eps * (proj**2).sum(-1).clamp_min(1.0).unsqueeze(1)
    energy = energy.clamp_min(floor)
    logdet = shrink.log().sum(-1)  # [T, G, 1]
    per_target = 0.5 * logdet - 0.5 * n * (energy / n).log() - 0.5 * n * (1 + LOG_2PI)
    return per_target.sum(-1)


def rotated_spectrum(s: torch.Tensor, proj: torch.Tensor) -> Spectrum:
    """The regression of :func:`rotated_evidence_model` (eigenvalues ``s [T, 1, N]``, rotated
    targets ``proj [T, K, N]``) as the hand-written engine's
    :class:`~probfsl.inference.evidence.Spectrum`: every coordinate is in ``s`` (the
    null ones with s = 0), so there is no separate least-squares residual."""
    c = proj.mT.square()
    n = proj.shape[-1]
    e0 = c.new_zeros(c.shape[0], c.shape[-1])
    return Spectrum(s[:, 0], c, e0, c.sum(-2), n, n, None, proj.mT, "dual")


def declared_data(
    rot: Rotation, lambda_mode: str = "shared"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The data of :func:`rotated_evidence_model` for a rotated support (:func:`rotate`):
    ``sigma [T', 1, N]``, ``proj [T', K', N]`` and the scale of lambda ``scale [T']``.

    ``"shared"``: one problem per task (T' = T, K' = K), its K targets sharing lambda;
    ``"per_class"``: T x K independent problems of one target each (T' = T K, K' = 1),
    task-major.
    """
    t, n, k = rot.proj.shape
    sigma = rot.s.sqrt().unsqueeze(-2)  # [T, 1, N]
    proj = rot.proj.mT  # [T, K, N]
    scale = rot.scale
    if lambda_mode == "per_class":  # T x K independent problems, one target each
        sigma = sigma.repeat_interleave(k, 0)
        proj = proj.reshape(t * k, 1, n)
        scale = scale.repeat_interleave(k, 0)
    return sigma, proj, scale


def derived_evidence(
    x: torch.Tensor,
    y: torch.Tensor,
    lambda_mode: str = "shared",
    span: tuple[float, float] = (1e-6, 1e6),
    clamp: tuple[float, float] = (1e-10, 1e10),
    n_grid: int = 64,
    max_iter: int = 10,
    tol: float | None = None,
    polish: bool = True,
) -> DerivedEvidenceResult:
    """Fit :func:`rotated_evidence_model` to supports ``x [T, N, D]`` with 0/1 targets
    ``y [T, N, K]``.

    Rotates each support once (:func:`rotate`), runs :class:`DerivedEvidenceEngine` with
    :func:`~probfsl.inference.base.run` (``tol``: relative change of the evidence, default
    16 machine epsilons of the dtype; at most ``max_iter`` steps), then, with ``polish``,
    moves lambda to the stationary point of the profile evidence
    (:meth:`DerivedEvidenceEngine.polish`) and reads the posterior mean off q(z).
    Tensors stay in ``x``'s dtype and on its device.
    """
    check_choice("lambda_mode", lambda_mode, LAMBDA_MODES)
    rot = rotate(x, y.to(x.dtype))
    t, n, k = rot.proj.shape
    sigma, proj, scale = declared_data(rot, lambda_mode)
    unit = torch.logspace(
        math.log10(span[0]), math.log10(span[1]), n_grid, dtype=x.dtype, device=x.device
    )
    grid = scale.unsqueeze(-1) * unit  # [T', G]
    best = profile_log_evidence(sigma**2, proj, grid).argmax(-1, keepdim=True)
    lam0 = torch.gather(grid, -1, best).squeeze(-1)
    grid_boundary = ((best == 0) | (best == n_grid - 1)).squeeze(-1).reshape(t, -1).expand(t, k)
    engine = DerivedEvidenceEngine(clamp)
    tol = 16 * torch.finfo(x.dtype).eps if tol is None else tol
    state, info = run(engine, engine.init(sigma, proj, scale, lam0), max_iter, tol, 1)
    if polish:  # not where the evidence still rises at the span's upper end
        state = engine.polish(state, sigma**2, proj, best.squeeze(-1) < n_grid - 1)
    est = engine.vmp.point_estimates(state.vmp)
    lam = est["lam"].reshape(t, -1).expand(t, k)
    beta = est["beta"].reshape(t, k)
    loc = state.vmp.q["z"][0].reshape(t, k, n)  # E[z] [T, K, N] (canonical layout)
    var = (rot.s.unsqueeze(-2) / lam.unsqueeze(-1) + 1) / beta.unsqueeze(-1)
    normal = dist.Normal(torch.zeros_like(var), var.sqrt())
    log_evidence = normal.log_prob(rot.proj.mT).sum(-1)
    ratio = lam / rot.scale.unsqueeze(-1)
    at_clamp = (ratio <= clamp[0] * (1 + 1e-9)) | (ratio >= clamp[1] * (1 - 1e-9))
    at_boundary = grid_boundary | at_clamp
    at_limit = (at_boundary & (ratio > 1)).all(-1)
    sigma_t = rot.s.sqrt()
    inv_sigma = torch.where(rot.s > 0, 1 / sigma_t.clamp_min(torch.finfo(x.dtype).tiny), 0.0)
    weights = rot.u @ (loc.mT * inv_sigma.unsqueeze(-1))  # U diag(1/sigma) E[z]: [T, N, K]
    limit = y.to(x.dtype) / rot.scale[:, None, None]  # X^T y / mean(s) in the dual
    weights = torch.where(at_limit[:, None, None], limit, weights)
    return DerivedEvidenceResult(lam, beta, log_evidence, at_boundary, at_limit, weights, info)


def derived_proba(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    way: int,
    temperature: float,
    lambda_mode: str = "shared",
) -> tuple[torch.Tensor, DerivedEvidenceResult]:
    """Query probabilities ``softmax(temperature x_q^T m_k)`` ``[T, Q, K]`` of prepared
    (centred, normalised) supports ``[T, N, D]`` and queries ``[T, Q, D]``, and the fit."""
    y = torch.nn.functional.one_hot(support_labels, way).to(support.dtype)
    res = derived_evidence(support, y, lambda_mode)
    scores = (query @ support.mT) @ res.weights
    return torch.softmax(temperature * scores, -1), res


# -- the engines of the estimator, side by side ------------------------------------------


@dataclass
class EpisodeFit:
    """What an evidence engine returns for a batch of episodes (``[T, K]`` unless noted).

    ``scores [T, Q, K]``: the queries' regression scores (the estimator's probabilities
    are ``softmax(temperature x scores)``); ``lam``, ``log_evidence``, ``at_boundary``:
    the fit per target; ``at_limit [T]``: the tasks scored by the lambda -> infinity
    limit.
    """

    scores: torch.Tensor
    lam: torch.Tensor
    log_evidence: torch.Tensor
    at_boundary: torch.Tensor
    at_limit: torch.Tensor


class EvidenceSettings(Protocol):
    """The hyperparameters of :class:`~probfsl.models.evidence.EvidenceLSSVM` an engine
    reads."""

    lambda_mode: str
    lam_init: float
    accelerate: bool
    paper_exact: bool
    fit_intercept: bool


def handwritten_episodes(
    support: torch.Tensor,
    query: torch.Tensor,
    support_labels: torch.Tensor,
    way: int,
    hp: EvidenceSettings,
) -> EpisodeFit:
    """The hand-written engine (:func:`~probfsl.inference.evidence.solve_evidence` on the
    support's spectrum) on prepared supports ``[T, N, D]`` and queries ``[T, Q, D]``."""
    y = torch.nn.functional.one_hot(support_labels, way).to(support.dtype)
    sp = spectrum(support, y, hp.fit_intercept)
    # one-shot classes have no finite maximiser: no warning
    res = solve_evidence(sp, hp.lambda_mode, hp.lam_init, hp.accelerate, hp.paper_exact, False)
    limit = at_upper_limit(sp, res)
    if hp.fit_intercept:
        limit = torch.zeros_like(limit)
    w = decision_weights(sp, res.lam, limit)  # [T, D, K]
    scores = query @ w
    if hp.fit_intercept:
        scores = scores + y.mean(-2, keepdim=True) - support.mean(-2, keepdim=True) @ w
    return EpisodeFit(scores, res.lam, res.log_evidence, res.at_boundary, limit)


def derived_episodes(
    support: torch.Tensor,
    query: torch.Tensor,
    support_labels: torch.Tensor,
    way: int,
    hp: EvidenceSettings,
) -> EpisodeFit:
    """The derived engine (:func:`derived_evidence`) on prepared supports and queries;
    ``fit_intercept=False`` and ``paper_exact=False`` only."""
    if hp.fit_intercept or hp.paper_exact:
        raise ValueError("engine='derived' supports fit_intercept=False and paper_exact=False only")
    y = torch.nn.functional.one_hot(support_labels, way).to(support.dtype)
    res = derived_evidence(support, y, hp.lambda_mode)
    scores = (query @ support.mT) @ res.weights
    return EpisodeFit(scores, res.lam, res.log_evidence, res.at_boundary, res.at_limit)


#: the evidence LS-SVM's engines by the estimator's ``engine`` hyperparameter; each maps
#: (support, query, support_labels, way, hyperparameters) to an :class:`EpisodeFit`
ENGINES: dict[str, Callable[..., EpisodeFit]] = {
    "handwritten": handwritten_episodes,
    "derived": derived_episodes,
}


__all__ = [
    "ENGINES",
    "LAMBDA_MODES",
    "DerivedEvidenceEngine",
    "DerivedEvidenceResult",
    "DerivedEvidenceState",
    "EpisodeFit",
    "EvidenceSettings",
    "Rotation",
    "declared_data",
    "derived_episodes",
    "derived_evidence",
    "derived_proba",
    "handwritten_episodes",
    "rotated_evidence_model",
    "profile_log_evidence",
    "rotate",
    "rotated_spectrum",
]
