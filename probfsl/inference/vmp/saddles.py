"""Fixed points of the default start that no sweep leaves, found after a fit.

Coordinate ascent keeps any symmetry its start has. Two cases stop a fit at once with a
"converged" bound that is far from the optimum:

* a product of two latent Gaussian sites, ``(W * x).sum(-1)`` (Bayesian PCA, factor
  analysis), whose factors both have mean exactly 0: each update of one reads the other's
  mean, so W = x = 0 is a saddle point of the bound (Bayesian PCA: Bishop, PRML ch. 12;
  BayesPy starts such models with ``initialize_from_random``);
* a ``DiscreteHMM`` whose states have identical emission terms E ln p(x_n | z_n = k) at
  every step: the states' posteriors, hence their parameters' updates, stay identical
  (the label-switching symmetry of a mixture, which a latent Categorical's seeded
  random start breaks and an HMM's hidden chain, not a site, does not).

:func:`stopped_at_saddles` names them, per site, with the number of tasks: one host
synchronisation per site, after the loop.
"""

from __future__ import annotations

import torch

from probfsl.inference.vmp import hmm
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import TASKS, Plan
from probfsl.inference.vmp.moments import expected_stats


def stopped_at_saddles(plan: Plan, q: dict) -> list[str]:
    """One sentence per saddle of the fitted factors ``q`` (module docstring), naming the
    sites, the tasks affected and the start that leaves it."""
    out = []
    for s in plan.sites.values():
        emission_parents = [
            p.parent for k, p in s.params.items() if k in ("probs", "loc", "precision")
        ]
        states = plan.sizes.get(f"{s.name}#s", 0)
        hidden_chain = lookup(s.family).structured  # a DiscreteHMM
        if hidden_chain and states > 1 and any(n in q for n in emission_parents):
            emit = hmm.emission(plan, q, s)  # [tasks, ..., N, K]
            tied = _per_task(emit - emit[..., :1], s.dims.index(TASKS))
            count = int(tied.sum())
            if count:
                out.append(
                    f"the states of the DiscreteHMM {s.name!r} have identical emission terms "
                    f"in {count} of {len(tied)} task(s), a symmetric point that no sweep "
                    "leaves: give the states different priors, or start "
                    f"{' or '.join(repr(n) for n in emission_parents if n in q)} with "
                    "different values per state (init={site: value})"
                )
        for p in s.params.values():
            t = p.bilinear
            if t is None or not all(n in q and not plan.sites[n].point for n in (t.u, t.v)):
                continue
            tied = None
            for n in (t.u, t.v):
                zero = _per_task(expected_stats(plan, q, n)[0], plan.sites[n].dims.index(TASKS))
                tied = zero if tied is None else tied & zero
            count = int(tied.sum())
            if count:
                out.append(
                    f"the means of {t.u!r} and {t.v!r} (a product in the mean of {s.name!r}) "
                    f"are exactly 0 in {count} of {len(tied)} task(s), a saddle point of the "
                    f"bound that no sweep leaves: start one of them elsewhere, e.g. "
                    f"VMP(..., init={{{t.u!r}: 'prior'}}, seed=0)"
                )
    return out


def _per_task(t: torch.Tensor, axis: int) -> torch.Tensor:
    """Whether every entry of ``t`` is exactly 0, per index of its ``axis`` (the tasks)."""
    return (t == 0).movedim(axis, 0).reshape(t.shape[axis], -1).all(-1)
