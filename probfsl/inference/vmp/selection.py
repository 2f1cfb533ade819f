"""A mixture's selection of components by a label, as one row lookup (the gather that
``Vindex(value)[..., z]`` performs), on tensors in named axes."""

from __future__ import annotations

import math

import torch


def aligned(t: torch.Tensor, dims: tuple, target: tuple, sizes: dict) -> torch.Tensor:
    """A view of ``t`` (axes ``dims``, a subset of ``target``) in the axes ``target``,
    broadcast to their sizes."""
    perm = sorted(range(len(dims)), key=lambda i: target.index(dims[i]))
    own = {dims[i]: t.shape[i] for i in range(len(dims))}
    view = [own.get(d, 1) for d in target]
    return t.permute(perm).reshape(view).expand([sizes[d] for d in target])


def select(value, dims: tuple, comp: str, index, index_dims: tuple, out: tuple, sizes: dict):
    """``value`` (axes ``dims``, one of them the component axis ``comp``) at the component
    ``index`` (integers, axes ``index_dims``), laid out in the axes ``out``: the gather a
    mixture's ``Vindex(value)[..., z]`` performs, as one row lookup (the rows of ``value``
    are its components per value of the axes it shares with ``index``)."""
    shared = tuple(d for d in dims if d in index_dims)
    own = tuple(d for d in dims if d != comp and d not in shared)
    extra = tuple(d for d in index_dims if d not in shared)
    table = aligned(value, dims, shared + (comp,) + own, sizes)
    n_shared = math.prod(sizes[d] for d in shared)
    table = table.reshape(n_shared * sizes[comp], math.prod(sizes[d] for d in own))
    idx = aligned(index, index_dims, shared + extra, sizes).reshape(n_shared, -1)
    base = torch.arange(n_shared, device=idx.device).unsqueeze(-1) * sizes[comp]
    rows = table.index_select(0, (base + idx).reshape(-1))
    got = rows.reshape([sizes[d] for d in shared + extra + own])
    return aligned(got, shared + extra + own, out, sizes)
