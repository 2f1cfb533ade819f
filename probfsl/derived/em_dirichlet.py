"""EM-Dirichlet's inference derived from its declaration by VMP.

Martin, Huang, Shakeri, Pesquet & Ben Ayed, "Transductive Zero-Shot and Few-Shot CLIP",
CVPR 2024 (docs/design/em-dirichlet.md). :func:`em_dirichlet_model` declares the method in
plain Pyro (design §2): per task, a mixture of Dirichlet laws on the probability simplex
whose concentrations ``alpha`` [K, K] and query proportions ``pi`` [K] are point
estimates (``pyro.param``), a latent class per query whose Categorical prior is tempered
by lambda / |Q| (``poutine.scale``: the paper's MDL partition-complexity term, design §2),
and support rows whose classes are given. :func:`fit_probabilities` hands it to
:class:`~probfsl.inference.VMP`, which derives the coordinate updates that the
hand-written engine (:class:`~probfsl.inference.dirichlet_mm.EMDirichletEngine`) codes by
hand:

* ``alpha``: the maximiser of its terms, a weighted Dirichlet fit per class (paper
  Algorithm 1, design §3.1);
* ``c``: r_n = softmax_k(ln Dir(x_n | alpha_k) + (lambda/|Q|) ln pi_k) (design §3.3);
* ``pi``: the proportions mean_Q r (design §3.2).

Its ELBO is minus the paper's objective (6) (J of design §3.5), as the declaration shows.
What is not inference on the model is mirrored from the estimator, so that both engines
take the same steps: the initialisation (R_Q = the input probabilities, alpha = 1, pi =
their mean), the order of the block updates (alpha, then the assignments with the
proportions of the previous assignments, then the proportions: Algorithm 2), the solver of
the alpha step (the MM-quadratic iterations of Algorithm 1 with the estimator's
``mm_*`` stopping rule, and its handling of classes without weight, design §3.1 and §3.7,
through :func:`probfsl.inference.vmp.dirichlet_points.solved_by`), the ``+1e-15`` added to
the probabilities before their logarithm (design §2), the outer iteration count and the
tolerance. Only the soft variant is a variational update; Hard EM-Dirichlet (one-hot
assignments) has no derived engine.
"""

from __future__ import annotations

from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.ops.indexing import Vindex

from probfsl.data.simplex import check_probabilities
from probfsl.inference.base import CHECK_EVERY, Info, RunInfo, run
from probfsl.inference.dirichlet_mm import (
    EMPTY,
    EPS,
    DirichletMixtureState,
    EMDirichletEngine,
)
from probfsl.inference.vmp import VMP, VMPState, dirichlet_points
from probfsl.validation import check_task_tensors

#: the block order of one outer iteration (paper Algorithm 2; see the module docstring)
ORDER = ["alpha", "c", "pi"]


def em_dirichlet_model(
    query: torch.Tensor,
    support: torch.Tensor | None = None,
    support_labels: torch.Tensor | None = None,
    lambda_coef: float = 1.0,
) -> None:
    """Mixture of Dirichlet laws on the simplex with a tempered class prior (design §2).

    ``query`` [B, Q, K] and ``support`` [B, S, K] are probability vectors (``+1e-15`` is
    added here, as in the reference code), ``support_labels`` [B, S] their classes;
    ``lambda_coef`` is lambda / |Q| (0: no prior on the classes, plain maximum likelihood).
    """
    b, n_query, k = query.shape
    with pyro.plate("tasks", b, dim=-2):
        with pyro.plate("classes", k, dim=-1):
            ones = query.new_ones(b, k, k)
            alpha = pyro.param("alpha", ones, constraint=constraints.positive, event_dim=1)
        rows = alpha.unsqueeze(-3)  # [B, 1, K, K]: row k is the Dirichlet of class k
        if support is not None and support.shape[1] > 0:
            with pyro.plate("support", support.shape[1], dim=-1):
                x_s = dist.Dirichlet(Vindex(rows)[..., support_labels, :])
                pyro.sample("x_support", x_s, obs=support + EPS)
        if lambda_coef > 0:
            pi = pyro.param("pi", query.mean(1, keepdim=True), constraint=constraints.simplex)
            prior = poutine.scale(scale=float(lambda_coef))
        else:
            pi, prior = query.new_full((b, 1, k), 1.0 / k), poutine.mask(mask=False)
        with pyro.plate("queries", n_query, dim=-1):
            with prior:
                c = pyro.sample("c", dist.Categorical(pi))
            pyro.sample("x", dist.Dirichlet(Vindex(rows)[..., c, :]), obs=query + EPS)


class AlphaStep:
    """The alpha step of the hand-written engine as the M step of ``alpha`` (design §3.1).

    Called by VMP with the concentrations [B, K, K] and the statistics S_kj = sum_n r_nk
    ln x_nj and R_k = sum_n r_nk (expanded to [B, K, K]); returns the concentrations after
    :meth:`~probfsl.inference.dirichlet_mm.EMDirichletEngine.fit_alpha` on the weighted mean
    log-features S / R: classes whose weight is at most 1e-15 keep theirs (the reference
    code's masking). Each MM iteration lowers the class's negative log-likelihood, so the
    bound never falls. Records the inner iterations of every call in ``history``.
    """

    def __init__(self, engine: EMDirichletEngine) -> None:
        self.engine = engine
        self.history: list[torch.Tensor] = []

    def __call__(
        self, alpha: torch.Tensor, stat: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        weight = weight[..., 0]
        empty = weight <= EMPTY
        mean_log = stat / weight.clamp_min(EMPTY).unsqueeze(-1)
        alpha, iters = self.engine.fit_alpha(alpha, mean_log, empty)
        self.history.append(iters)
        return alpha


class EMDirichletVMP(VMP):
    """VMP on :func:`em_dirichlet_model`, scheduled as the hand-written engine.

    ``init(query, support=None, support_labels=None)`` starts the assignments at the input
    probabilities (``init_resp``), ``alpha`` at 1 and ``pi`` at their mean (the
    declaration's initial values); every :meth:`step` updates alpha (by ``alpha_step``),
    then the assignments, then the proportions (paper Algorithm 2). Converged tasks are
    masked, not removed from the batch, as in the hand-written loop.

    Args:
        alpha_step: the M step of ``alpha`` (:class:`AlphaStep`).
        lambda_coef: lambda / |Q| of the declaration.
        max_iter, tol: outer iterations and relative tolerance (0: run them all).
    """

    compacts = False

    def __init__(
        self, alpha_step: AlphaStep, lambda_coef: float, max_iter: int = 20, tol: float = 0.0
    ) -> None:
        super().__init__(
            em_dirichlet_model,
            max_iter=max_iter,
            tol=tol,
            check_every=CHECK_EVERY,
            order=ORDER if lambda_coef > 0 else ORDER[:2],  # no pi without its prior
            check_growth=1.0,
        )
        self.alpha_step, self.lambda_coef = alpha_step, float(lambda_coef)

    def init(
        self,
        query: torch.Tensor,
        support: torch.Tensor | None = None,
        support_labels: torch.Tensor | None = None,
        init_resp: dict | None = None,
    ) -> VMPState:
        init_resp = {"c": query} if init_resp is None else init_resp
        data = (query, support, support_labels, self.lambda_coef)
        return super().init(*data, init_resp=init_resp)

    def step(self, state: VMPState) -> tuple[VMPState, Info]:
        with dirichlet_points.solved_by(self.alpha_step):
            return super().step(state)


def fit_probabilities(
    make_engine: Callable[[bool], EMDirichletEngine],
    n_iter: int | None,
    tol: float | None,
    query: torch.Tensor,
    support: torch.Tensor | None = None,
    support_labels: torch.Tensor | None = None,
) -> tuple[DirichletMixtureState, RunInfo]:
    """EM-Dirichlet (soft) on probability vectors by VMP on :func:`em_dirichlet_model`.

    Args:
        make_engine: the hand-written engine of the estimator for zero-shot (True) or
            few-shot (False) data (:meth:`~probfsl.models.em_dirichlet.EMDirichlet.
            make_engine`): its λ, its inner loop and its ``hard`` flag are used.
        n_iter, tol: the outer iterations (None: 20) and their tolerance (None: 0, all
            iterations run).
        query: ``[B, Q, K]`` probability vectors.
        support, support_labels: ``[B, S, K]`` and ``[B, S]`` (few-shot), or None.

    Returns:
        The state in the hand-written engine's form (``query_r``, ``alpha``, ``pi``, J
        as ``objective``, inner iterations of each task's last alpha step) and the run's
        information, its trace that of J ``[steps + 1, B]`` (minus the ELBO).
    """
    n_iter = 20 if n_iter is None else n_iter
    tol = 0.0 if tol is None else tol
    check_probabilities(query, "query", ndim=3)
    if (support is None) != (support_labels is None):
        raise ValueError("support and support_labels must be given together")
    b, n_query, k = query.shape
    if support is None:
        support = query.new_zeros(b, 0, k)
        support_labels = torch.zeros(b, 0, dtype=torch.long, device=query.device)
    check_probabilities(support, "support", ndim=3, allow_empty=True)
    check_task_tensors(support, support_labels, query, k, partial_support=True)
    zero_shot = support.shape[1] == 0
    engine = make_engine(zero_shot)
    if engine.hard:
        raise ValueError(
            "engine='derived' runs the soft EM-Dirichlet only: one-hot assignments (hard=True) "
            "are not a variational update"
        )
    coef = engine.coef(k)
    alpha_step = AlphaStep(engine)
    vmp = EMDirichletVMP(alpha_step, coef, max_iter=n_iter, tol=tol)
    vmp.warn = False  # n_iter is the estimator's budget, as in the hand-written loop
    given = (None, None) if zero_shot else (support, support_labels.long())
    state, info = vmp.fit(query, *given)
    r_q = state.q["c"][0]
    onehot = torch.nn.functional.one_hot(support_labels.long(), k).to(query.dtype)
    last = (info.n_steps - 1).clamp_min(0)
    iters = torch.stack(alpha_step.history)[last, torch.arange(b, device=query.device)]
    result = DirichletMixtureState(
        log_x=torch.log(torch.cat([support, query], 1) + EPS),
        n_support=support.shape[1],
        r=torch.cat([onehot, r_q], 1),
        alpha=vmp.point_estimates(state)["alpha"],
        pi=r_q.mean(1),
        objective=-state.objective,
        mm_iters=iters,
    )
    return result, info._replace(trace=-info.trace)


def handwritten_fit(
    make_engine: Callable[[bool], EMDirichletEngine],
    n_iter: int | None,
    tol: float | None,
    query: torch.Tensor,
    support: torch.Tensor | None = None,
    support_labels: torch.Tensor | None = None,
) -> tuple[DirichletMixtureState, RunInfo]:
    """EM-Dirichlet (soft or hard) by the hand-written engine, driven by
    :func:`~probfsl.inference.base.run`: the signature and the result of
    :func:`fit_probabilities` (``n_iter`` None: 10 hard, 20 soft; ``tol`` None: every
    iteration runs)."""
    zero_shot = support is None or (
        isinstance(support, torch.Tensor) and support.ndim == 3 and support.shape[1] == 0
    )
    engine = make_engine(zero_shot)
    state = engine.init(query, support, support_labels)
    n_iter = n_iter if n_iter is not None else (10 if engine.hard else 20)
    return run(engine, state, n_iter, tol, check_every=CHECK_EVERY)


#: EM-Dirichlet's engines by the estimator's ``engine`` hyperparameter; each maps
#: (make_engine, n_iter, tol, query, support, support_labels) to (state, RunInfo)
ENGINES: dict[str, Callable[..., tuple[DirichletMixtureState, RunInfo]]] = {
    "handwritten": handwritten_fit,
    "derived": fit_probabilities,
}
