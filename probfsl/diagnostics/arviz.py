"""Export posteriors to ArviZ (``xarray.DataTree``) and summarise them with arviz_stats.

ArviZ is imported inside the functions, so ``import probfsl`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch


def _to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def to_datatree(
    posterior: Mapping[str, Any],
    dims: Mapping[str, list[str]] | None = None,
    coords: Mapping[str, Any] | None = None,
    sample_stats: Mapping[str, Any] | None = None,
    observed_data: Mapping[str, Any] | None = None,
    attrs: Mapping[str, Any] | None = None,
):
    """Build an ``xarray.DataTree`` from draws shaped ``[chain, draw, ...]``.

    Args:
        posterior: variable name -> draws (tensor or array), ``[chain, draw, *shape]``.
        dims: variable name -> names of its non-sample dimensions.
        coords: dimension name -> coordinate values.
        sample_stats: per-draw statistics (for example the ELBO), ``[chain, draw]``.
        observed_data: observed values (no sample dimensions).
        attrs: global attributes of the tree.
    """
    from arviz_base import from_dict

    data = {"posterior": {k: _to_numpy(v) for k, v in posterior.items()}}
    for name, group in (("sample_stats", sample_stats), ("observed_data", observed_data)):
        if group:
            data[name] = {k: _to_numpy(v) for k, v in group.items()}
    for name, values in data["posterior"].items():
        if values.ndim < 2:
            raise ValueError(f"posterior[{name!r}] must be [chain, draw, ...], got {values.shape}")
    return from_dict(
        data,
        dims=dict(dims or {}),
        coords={k: _to_numpy(v) for k, v in (coords or {}).items()},
        attrs={"/": dict(attrs)} if attrs else None,
    )


def draws_from_guide(
    guide: Callable[..., Any],
    args: tuple,
    sites: list[str],
    num_samples: int = 500,
    num_chains: int = 1,
) -> dict[str, torch.Tensor]:
    """Draw the latent ``sites`` from a Pyro guide, shaped ``[chain, draw, *site_shape]``.

    Works for any guide with the model's signature, including the closed-form
    guides of probfsl's engines (``engine.guide(state)``).
    """
    from pyro import poutine

    draws: dict[str, list[torch.Tensor]] = {s: [] for s in sites}
    for _ in range(num_samples * num_chains):
        trace = poutine.trace(guide).get_trace(*args)
        for site in sites:
            if site not in trace.nodes:
                raise ValueError(f"site {site!r} is not sampled by the guide")
            draws[site].append(trace.nodes[site]["value"].detach())
    return {
        s: torch.stack(v).reshape(num_chains, num_samples, *v[0].shape) for s, v in draws.items()
    }


def summary(tree, **kwargs):
    """``arviz_stats.summary`` of a DataTree (mean, sd, HDI, ESS, R-hat, ...)."""
    import arviz_stats

    return arviz_stats.summary(tree, **kwargs)
