"""ArviZ export of a fitted :class:`~probfsl.models.gp_tree.estimator.GPTree`'s Gibbs chains.

The latest stage's recorded Gibbs sweeps (``record=True``) become an ``xarray.DataTree``
(:func:`probfsl.diagnostics.arviz.to_datatree`) with the nodes' latent f, the predictive
class probabilities of every chain and the augmented log marginal likelihood
(Achituve et al., "GP-Tree", ICML 2021, §3.2), and R-hat / ESS from arviz_stats.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from probfsl.inference import gp_tree_nodes as gpn
from probfsl.models.gp_tree.tree import path_probabilities

#: a fitted :class:`~probfsl.models.gp_tree.estimator.GPTree` (typed loosely: the
#: estimator imports this module, so this one must not import it back)
FittedGPTree = Any


def to_datatree(model: FittedGPTree, X, rhat_threshold: float = 1.01, burn_in: int = 1):
    """ArviZ export of the latest Gibbs stage of ``model`` (fitted with ``record=True``).

    The first ``burn_in`` recorded states are dropped: state 0 is the sampler's
    starting point (a prior draw), so the default keeps the states after sweeps 1..n.

    posterior: ``f_<node>`` [chain, draw, point] — the Gibbs draws of each latest-stage
    Gibbs node's latent f at its training points (draw d = state after sweep
    d + burn_in), and ``class_prob`` [chain, draw, x, class] — the predictive class
    probabilities at ``X`` given each chain's ω after each sweep (base VI nodes are
    deterministic). sample_stats: ``log_marginal`` (sum over those nodes of
    log p(y | ω)). attrs: ``elbo_trace`` (VI base stage). Warns (RuntimeWarning) when an
    R-hat exceeds ``rhat_threshold``; the R-hat and ESS tables are returned by
    :func:`diagnostics`.
    """
    from probfsl.diagnostics.arviz import to_datatree as build

    X, _ = model._check_predict_x(X)
    groups = model.last_groups_
    if not groups or groups[0].state.omega_trace is None:
        raise ValueError("no recorded Gibbs chains: fit with record=True (Gibbs nodes)")
    posterior, dims = {}, {}
    n_draws = len(groups[0].state.omega_trace)
    if not 0 <= burn_in < n_draws:
        raise ValueError(f"burn_in must lie in 0..{n_draws - 1}, got {burn_in}")
    log_marg = 0.0
    for g in groups:
        tree_name = "root" if g is model.root_ else ("novel" if model.root_ else "base")
        st = g.state
        f = torch.stack(st.f_trace[burn_in:], 1)  # [V, draw, S, n]
        for i, v in enumerate(g.node_ids):
            name = f"f_{tree_name}{v}"
            n_v = int(st.mask[i].sum())
            posterior[name] = f[i, :, :, :n_v].transpose(0, 1)
            dims[name] = [f"point_{tree_name}{v}"]
        lm = []
        for w in st.omega_trace[burn_in:]:
            lm.append(gpn.augmented_log_marginal(_with_omega(st, w)).sum(0))
        log_marg = log_marg + torch.stack(lm, 1)  # [S, draw]
    probs = []
    for d in range(burn_in, n_draws):
        probs.append(chainwise_proba(model, X, d))
    posterior["class_prob"] = torch.stack(probs, 1)  # [S, draw, N, C]
    dims["class_prob"] = ["x", "class"]
    coords = {"class": np.asarray(model.classes_)}
    attrs = {}
    if model.elbo_trace_ is not None:
        attrs["elbo_trace"] = [float(v) for v in model.elbo_trace_]
    dt = build(
        posterior,
        dims=dims,
        coords=coords,
        sample_stats={"log_marginal": log_marg},
        attrs=attrs or None,
    )
    warn_rhat(dt, rhat_threshold, stacklevel=4)
    return dt


def diagnostics(datatree):
    """R-hat and bulk ESS (arviz_stats) of every posterior variable."""
    import arviz_stats

    return arviz_stats.rhat(datatree), arviz_stats.ess(datatree)


def warn_rhat(dt, threshold: float, stacklevel: int = 3) -> None:
    """RuntimeWarning when the largest R-hat of ``dt``'s posterior exceeds ``threshold``."""
    rhat, _ = diagnostics(dt)
    ds = rhat.posterior.to_dataset() if hasattr(rhat, "posterior") else rhat
    worst = max(float(np.nanmax(ds[v].values)) for v in ds.data_vars)
    if worst > threshold:
        warnings.warn(
            f"GP-Tree Gibbs chains: max R-hat {worst:.3f} > {threshold} "
            "(run more sweeps or chains)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def chainwise_proba(model: FittedGPTree, X: torch.Tensor, draw: int) -> torch.Tensor:
    """Class probabilities ``[S, N, C]`` of each chain given its ω after sweep ``draw``."""

    def node_probs_chainwise(tree, groups):
        out = X.new_empty(len(tree.nodes), model.n_chains, X.shape[0])
        for g in groups:
            if isinstance(g.state, gpn.GibbsState):
                st = _with_omega(g.state, g.state.omega_trace[draw])
                _, mu, var = gpn.gibbs_predict(st, X, return_moments=True)
                out[g.node_ids] = gpn.gauss_hermite_sigmoid(mu, var)
            else:
                out[g.node_ids] = g.engine.predict(g.state, X).unsqueeze(1)
        return out

    def per_chain(tree, groups):
        npb = node_probs_chainwise(tree, groups)
        return torch.stack([path_probabilities(tree, npb[:, s]) for s in range(model.n_chains)])

    with torch.no_grad():
        base = per_chain(model.base_tree_, model.base_groups_)
        if model.root_ is None:
            return base
        st = _with_omega(model.root_.state, model.root_.state.omega_trace[draw])
        _, mu, var = gpn.gibbs_predict(st, X, return_moments=True)
        pr = gpn.gauss_hermite_sigmoid(mu, var)[0]  # [S, N]
        novel = per_chain(model.novel_tree_, model.novel_groups_)
        return torch.cat([(1 - pr)[..., None] * base, pr[..., None] * novel], -1)


def _with_omega(state: gpn.GibbsState, omega: torch.Tensor) -> gpn.GibbsState:
    return replace(state, omega=omega)
