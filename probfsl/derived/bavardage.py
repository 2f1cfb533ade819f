"""BAVARDAGE's VB mixture derived from its declaration, with the PLDA map between blocks.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023), Algorithm 1; docs/design/bavardage.md
§3.5-3.9.

The declaration is :func:`bavardage_model`: the Gaussian mixture on u = x P (Dirichlet
weights, Normal class means, the support's classes observed, the queries' latent). P,
the adaptive PLDA projection, is a point-estimated linear map of the rows x: it is not a
maximiser of the bound but the paper's own rule (the LDA directions of the shrunk class
centroids of the current responsibilities), so it stays the hand-written
:meth:`~probfsl.inference.vb_mixture.BavardageVB.rows` and is updated between blocks, on
the paper's schedule. Everything else is derived by VMP (:class:`probfsl.inference.VMP`)
from the declaration, block by block:

    for each of the n_vb blocks:
        u = x P(o)                  the map, from the current responsibilities o
        q(π), q(μ) given q(z)       VMP's first sweep from the prior (the M step)
        q(z) of the queries         one VMP update (the E step)

This is the hand-written loop of :func:`~probfsl.inference.vb_mixture.fit_bavardage_vb`
(projection, M, E, ``n_vb`` times). The result is returned as the hand-written engine's
:class:`~probfsl.inference.vb_mixture.VBMixtureState`, so every diagnostic of the
estimator reads it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference.base import RunInfo
from probfsl.inference.class_stats import one_hot_support
from probfsl.inference.vb_mixture import BavardageVB, VBMixtureState, fit_bavardage_vb
from probfsl.inference.vmp import VMP, VMPState
from probfsl.inference.vmp.plan_cache import PlanCache


def bavardage_model(
    u_support: torch.Tensor,
    support_labels: torch.Tensor,
    u_query: torch.Tensor,
    way: int,
    tau: float = 4.0,
    alpha0: float = 2.0,
    beta0: float = 10.0,
    balanced: bool = False,
    count_support: bool = False,
) -> None:
    """The Gaussian mixture of design §2 for a batch of tasks, in the reduced space.

    In production (:class:`~probfsl.models.bavardage.Bavardage`, ``mode="bavardage"``) the
    data are the projected rows u = x P_b of the current VB block, P_b the adaptive PLDA
    projection: a fixed input of the block, not a random variable (module docstring).
    The hyperparameters are the estimator's: ``tau`` = ``temperature_vb_``, ``alpha0``, ``beta0``,
    ``balanced`` and ``count_support``.

    Args:
        u_support: [T, S, d] projected support features (their classes are observed).
        support_labels: [T, S] task-local labels in 0..K-1.
        u_query: [T, Q, d] projected query features.
        way: K.
        tau: τ = T_vb, the fixed precision Λ = τ I.
        alpha0, beta0: the priors' α_o and β_o (m_o = 0).
        balanced: π fixed uniform (the reference code's balanced mode), no ``pi`` site.
        count_support: the paper's variant where the support labels are draws of π too
            (an observed ``y_support`` site); by default, as in the code, only the
            query assignments are drawn from π.
    """
    t, d = u_support.shape[0], u_support.shape[-1]
    ref = u_support
    scale_u = ref.new_tensor(tau).rsqrt()
    with pyro.plate("tasks", t, dim=-2):
        if balanced:
            pi = ref.new_full((1, way), 1.0 / way)
        else:
            pi = pyro.sample("pi", dist.Dirichlet(ref.new_full((1, way), alpha0)))
        with pyro.plate("classes", way, dim=-1):
            prior_scale = ref.new_tensor(beta0 * tau).rsqrt()
            mu = pyro.sample("mu", dist.Normal(ref.new_zeros(d), prior_scale).to_event(1))
        onehot_s = one_hot_support(support_labels, way, ref.dtype)
        with pyro.plate("support", u_support.shape[1], dim=-1):
            if count_support:
                pyro.sample("y_support", dist.Categorical(probs=pi), obs=support_labels)
            pyro.sample("u_support", dist.Normal(onehot_s @ mu, scale_u).to_event(1), obs=u_support)
        with pyro.plate("queries", u_query.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(probs=pi))
            onehot_q = torch.nn.functional.one_hot(z, way).to(ref)
            pyro.sample("u_query", dist.Normal(onehot_q @ mu, scale_u).to_event(1), obs=u_query)


#: the arguments of :func:`bavardage_model` (and of the models that extend it, such as
#: bavardage-gamma's) that are the observations of its Normal sites and nothing else (their
#: dtype and shapes aside), by position: a kept plan takes new ones
#: (:class:`~probfsl.inference.vmp.plan_cache.PlanCache`)
OBSERVED_ROWS = {0: "u_support", 2: "u_query"}


def declared_model(engine: BavardageVB) -> Callable[..., None]:
    """:func:`~probfsl.derived.bavardage.bavardage_model` with the hand-written engine's
    hyperparameters (τ, α_o, β_o, balanced, count_support)."""
    return partial(
        bavardage_model,
        way=engine.way,
        tau=engine.tau,
        alpha0=engine.alpha0,
        beta0=engine.beta0,
        balanced=engine.balanced,
        count_support=engine.count_support,
    )


def run_blocks(
    model: Callable[..., None],
    engine: BavardageVB,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    resp: torch.Tensor,
    n_iter: int = 5,
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    plans: PlanCache | None = None,
) -> tuple[VMPState, torch.Tensor, torch.Tensor]:
    """``n_iter`` blocks (map, every other latent site, the queries' ``z``; module
    docstring) of any mixture ``model(u_support, support_labels, u_query)`` whose rows are
    observed Normal sites named ``u_support`` and ``u_query`` and whose queries' classes
    are a latent Categorical ``z``, from the responsibilities ``resp`` [T, N, K]; the map
    is ``engine``'s (:meth:`~probfsl.inference.vb_mixture.BavardageVB.rows`), or ``rows(x,
    resp)`` where given. The model
    is derived once (or taken from ``plans``, with the observations ``u_support`` and
    ``u_query``); each block starts its factors afresh on the new rows
    (:meth:`~probfsl.inference.vmp.layout.Plan.observe`, :meth:`VMP.start`).

    Returns the last VMP state, the responsibilities [T, N, K] (the support's one-hot) and
    the ELBO trace [n_iter + 1, T]: after each block's first sweep and, last, after the
    final update of ``z``. A model with other sites than BAVARDAGE's (a latent precision,
    say) runs unchanged: VMP derives its updates.
    """
    if n_iter < 1:
        raise ValueError(f"n_iter must be at least 1, got {n_iter}")
    vmp, n_s = VMP(model, plans=plans), support.shape[1]
    x = torch.cat([support, query], 1)
    onehot = one_hot_support(support_labels, engine.way, x.dtype)
    resp = torch.cat([onehot, resp[:, n_s:].to(x)], 1)
    u, plan, trace = x, None, []
    rows = engine.rows if rows is None else rows
    for block in range(n_iter):
        if engine.projection in ("adaptive", "adaptive_gram") or (
            engine.projection == "frozen" and block == 0
        ):
            u = rows(x, resp)
        if plan is None:  # derived once; later blocks change the rows only
            plan = vmp.compile(u[:, :n_s], support_labels, u[:, n_s:])
        else:
            plan = plan.observe(u_support=u[:, :n_s], u_query=u[:, n_s:])
        state = vmp.start(plan, init_resp={"z": resp[:, n_s:]})
        trace.append(state.objective)
        state = vmp.update(state, ["z"])
        resp = torch.cat([onehot, state.q["z"][0]], 1)
    trace.append(state.objective)
    return state, resp, torch.stack(trace)


def fit(
    engine: BavardageVB,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    resp: torch.Tensor,
    n_iter: int = 5,
    plans: PlanCache | None = None,
) -> tuple[VBMixtureState, RunInfo]:
    """BAVARDAGE's loop on its declaration (:func:`run_blocks` of :func:`declared_model`;
    its plan taken from ``plans`` where one was kept for these shapes, the observations
    :data:`OBSERVED_ROWS`): the state and info
    :func:`~probfsl.inference.vb_mixture.fit_bavardage_vb` returns."""
    model = declared_model(engine)
    state, resp, trace = run_blocks(
        model, engine, support, support_labels, query, resp, n_iter, plans=plans
    )
    x = torch.cat([support, query], 1)
    u = state.plan.sites["u_support"].value  # the last block's rows
    u = torch.cat([u, state.plan.sites["u_query"].value], 1)
    out = _as_mixture_state(engine, state, x, support_labels, u, resp)
    steps = torch.full_like(support_labels[:, 0], n_iter - 1)  # as the hand-written loop
    return out, RunInfo(trace, steps, torch.zeros_like(steps, dtype=torch.bool))


def _as_mixture_state(
    engine: BavardageVB,
    state: VMPState,
    x: torch.Tensor,
    support_labels: torch.Tensor,
    u: torch.Tensor,
    resp: torch.Tensor,
) -> VBMixtureState:
    """The VMP factors in the hand-written engine's parametrisation: q(μ_k) has precision
    β_k τ on every axis, q(π) = Dir(α)."""
    loc, precision = state.q["mu"]
    beta = precision[..., 0] / engine.tau
    alpha = None if engine.balanced else state.q["pi"][0].reshape(beta.shape)
    empty = VBMixtureState(x, support_labels, u, resp, alpha, beta, loc, state.objective)
    return replace(empty, mean=loc.reshape(*beta.shape, u.shape[-1]))


#: BAVARDAGE's engines by the estimator's ``engine`` hyperparameter: both map (the
#: hand-written engine that holds the hyperparameters and the projection, support,
#: support_labels, query, resp, n_iter) to (:class:`VBMixtureState`, :class:`RunInfo`)
ENGINES: dict[str, Callable[..., tuple[VBMixtureState, RunInfo]]] = {
    "handwritten": fit_bavardage_vb,
    "derived": fit,
}
