"""SLEM's exemplar machines derived from their declaration.

Rezende, Zepeda, Ponce, Bach, Pérez, "Kernel Square-Loss Exemplar Machines for Image
Retrieval" (CVPR 2017); docs/design/slem.md §2(a), §3.

:func:`slem_tasks_model` is the Gaussian linear model of
:func:`probfsl.models.slem.slem_model` with one exemplar per class of every task (the
class mean of the support) and the base features as the shared negatives: the weights
ω ~ N(0, λ⁻¹ I), the positive +1 with precision θ, each negative −1 with precision 1/n,
and the unpenalised intercept ν as a point estimate (``pyro.param``, its flat prior).
VMP (:class:`probfsl.inference.VMP`) derives the updates: q(ω) a joint Gaussian over the
feature axis, ν the maximiser of its terms given ⟨ω⟩. Alternating the two is coordinate
ascent on a Gaussian log posterior, so it converges (linearly) to the joint mode: the MAP
(ω*, ν*) of SLEM's objective; :func:`exemplar_weights` reaches that mode in a few sweeps
by Aitken's extrapolation, exact for this iteration.

The few-shot scores are the LDA discriminants of :class:`~probfsl.models.slem.SLEM`:
ω* = s A⁻¹ δ with δ = x_0 − μ (μ the negatives' mean, A = Σ + λI) and the class-dependent
scale s = 2θ / (θ δᵀA⁻¹δ + θ + 1) (design §3), so δᵀω* = s q with q = δᵀA⁻¹δ and
s = θ (2 − δᵀω*) / (θ + 1). The direction A⁻¹ δ = ω* / s then scores a query x as
(A⁻¹ δ)ᵀ (x − (x_0 + μ) / 2).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference.ops import aitken
from probfsl.inference.vmp import VMP
from probfsl.inference.woodbury import NegativeFactor, lda_scores


def slem_tasks_model(
    means: torch.Tensor, negatives: torch.Tensor, lam: torch.Tensor, theta: float = 1.0
) -> None:
    """SLEM's Gaussian linear model (design §2a) for exemplars ``means`` [T, K, d] against
    the shared ``negatives`` [n, d] with ridge ``lam`` (a scalar tensor)."""
    t, k, d = means.shape
    n = negatives.shape[0]
    with pyro.plate("tasks", t, dim=-2), pyro.plate("classes", k, dim=-1):
        nu = pyro.param("nu", means.new_zeros(t, k))  # flat prior: a point estimate
        omega = pyro.sample("omega", dist.Normal(means.new_zeros(d), lam.rsqrt()).to_event(1))
        positive = (omega * means).sum(-1) + nu
        pyro.sample("positive", dist.Normal(positive, theta**-0.5), obs=means.new_ones(t, k))
        scores = omega @ negatives.mT + nu.unsqueeze(-1)
        pyro.sample(
            "negatives", dist.Normal(scores, math.sqrt(n)).to_event(1), obs=-scores.new_ones(())
        )


def exemplar_weights(
    means: torch.Tensor,
    negatives: torch.Tensor,
    lam: torch.Tensor,
    theta: float = 1.0,
    rounds: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MAP ``(omega [T, K, d], nu [T, K])`` of :func:`slem_tasks_model`.

    A VMP sweep maps each exemplar's ν to ⟨ω⟩(ν), an affine function, and then to the
    maximiser of ν's terms, affine in ⟨ω⟩: one sweep is a scalar affine map
    ν ← a ν + b per exemplar, and Aitken's Δ² of three sweeps is its fixed point
    ν* = b / (1 − a) exactly (up to rounding). Each of the ``rounds`` runs three sweeps
    and moves ν to that extrapolation (where the sweeps still move it); a last sweep
    gives q(ω) at ν*.
    """
    vmp = VMP(slem_tasks_model)
    state = vmp.init(means, negatives, lam, theta)
    for _ in range(rounds):
        seen = [state.q["nu"][0]]
        for _ in range(2):
            state = vmp.update(state, ["omega", "nu"])
            seen.append(state.q["nu"][0])
        # where the sweeps no longer curve beyond rounding, ν stays the last sweep's
        nu = aitken(*seen, rtol=64 * torch.finfo(seen[2].dtype).eps)
        state = vmp.update(replace(state, q={**state.q, "nu": (nu,)}), ["omega", "nu"])
    omega = state.q["omega"][0]
    return omega, vmp.point_estimates(state)["nu"]


def map_lda_scores(
    query: torch.Tensor,
    means: torch.Tensor,
    negatives: torch.Tensor,
    lam: torch.Tensor,
    theta: float = 1.0,
) -> torch.Tensor:
    """The scores [T, Q, K] of :func:`probfsl.inference.woodbury.lda_scores`, from the
    derived MAP (module docstring)."""
    omega, _ = exemplar_weights(means, negatives, lam, theta)
    mu = negatives.mean(-2)
    scale = theta * (2 - ((means - mu) * omega).sum(-1, keepdim=True)) / (theta + 1)
    direction = omega / scale  # A⁻¹ (x_0 − μ)
    offset = -0.5 * (direction * (means + mu)).sum(-1)
    return query @ direction.mT + offset.unsqueeze(-2)


# -- the engines of the estimator, side by side ------------------------------------------

#: bytes of q(ω) precision matrices that the derived engine holds at once (tasks are
#: taken in chunks that fit)
DERIVED_MEMORY = 1 << 29


class SLEMEngine(Protocol):
    """What :class:`~probfsl.models.slem.SLEM` asks of an engine (both are closed forms,
    outside the iterative contract of :mod:`probfsl.inference.base`: the fitted base
    statistics in, the LDA scores out).

    Attributes:
        keeps_negatives: whether ``fit_base`` must keep the preprocessed base features
            (``negatives_``): the derived engine takes them as the declaration's data.
        note: what the engine costs, for the estimator's ``setting_note`` ("" if nothing).
    """

    keeps_negatives: bool
    note: str

    def scores(
        self,
        query: torch.Tensor,
        means: torch.Tensor,
        factor: NegativeFactor,
        negatives: torch.Tensor | None,
        lam: torch.Tensor,
    ) -> torch.Tensor:
        """LDA scores ``[T, Q, K]`` of the prepared queries ``[T, Q, d]`` against the class
        means ``[T, K, d]`` (``factor``, ``negatives`` and ``lam`` in the queries' dtype
        and on their device)."""


class HandwrittenSLEM:
    """The Woodbury closed form: one Cholesky factor of ``Σ + λI`` for every task
    (:func:`probfsl.inference.woodbury.lda_scores`)."""

    keeps_negatives = False
    note = ""

    def scores(self, query, means, factor, negatives, lam):
        return lda_scores(query, means, factor)


class DerivedSLEM:
    """The MAP of :func:`slem_tasks_model` by the updates VMP derives
    (:func:`map_lda_scores`), in chunks of tasks whose q(ω) fit :data:`DERIVED_MEMORY`."""

    keeps_negatives = True
    note = (
        "slem with engine='derived' fits a d x d Gaussian posterior per class of every "
        "task (the closed form factors one matrix for all tasks): seconds per 100 tasks "
        "at 64 dimensions, minutes at a few hundred"
    )

    def scores(self, query, means, factor, negatives, lam):
        if negatives is None:
            raise ValueError("engine='derived' needs the negatives: call fit_base with it set")
        # q(ω) holds a d x d precision per class of a task: chunks of tasks bound it
        per_task = means.shape[1] * means.shape[2] ** 2 * means.element_size()
        chunk = max(1, DERIVED_MEMORY // per_task)
        return torch.cat(
            [
                map_lda_scores(query[a : a + chunk], means[a : a + chunk], negatives, lam)
                for a in range(0, means.shape[0], chunk)
            ]
        )


#: SLEM's engines by the estimator's ``engine`` hyperparameter
ENGINES: dict[str, SLEMEngine] = {"handwritten": HandwrittenSLEM(), "derived": DerivedSLEM()}
