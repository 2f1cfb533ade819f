"""A latent Gaussian matrix times a latent Gaussian vector: a location M x + b with M a
Normal site of two event axes (rows, columns) and x a Normal or MultivariateNormal vector
(docs/design/vmp.md §6.6, §7.1, §7.5).

The latent transition matrix of a state-space model, x_t ~ N(A x_{t−1} + b, diag(λ)⁻¹),
and a latent observation matrix, y_t ~ N(C x_t, ...), are of this form (Beal 2003, ch. 5;
BayesPy's ``GaussianMarkovChain`` with a Gaussian ``A`` node, and ``Dot(C, X)``). The map is
bilinear in (M, x): loc_i = b_i + Σ_{k,j,l} H_{ikjl} M_kj x_l, read here as a
:class:`~probfsl.inference.vmp.layout.BilinearTerm` whose H carries the matrix's row axis as
well as the two contracted axes (the columns of M, the entries of x). Each entry of the
location must read one row of M (H_{ikjl} = 0 for k ≠ i: ``A @ x``, ``einsum("ij,j->i")``,
``(A * x).sum(-1)``), so that the messages to M keep its rows independent: q(M) is Gaussian
per row, joint over the columns (Winn & Bishop 2005, Table 1; the row-wise second moments
⟨M_k M_kᵀ⟩ are what the bound and the messages read). Everything else is the bilinear
algebra of :mod:`~probfsl.inference.vmp.linear_maps`, mean-field between M and x; inside a
Gaussian Markov chain the joint lag-one moments replace the products of means
(:mod:`~probfsl.inference.vmp.gaussian_chain`).

H comes from automatic differentiation (the mixed derivative ∂²loc/∂M∂x, per entry of the
vector), the map is proved bilinear structurally (the gradient in each of M and x does not
depend on that site) and then checked on the probe values of every latent site.
"""

from __future__ import annotations

import contextlib

import torch

from probfsl.inference.vmp.affine_maps import agrees, as_function, refuse_unless_affine
from probfsl.inference.vmp.checks import refuse
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import BilinearTerm, Param, Site, param_dims, reduce_constant


def is_matrix(s: Site) -> bool:
    """A latent Normal site with two event axes (rows, columns): a matrix M of M x."""
    record = lookup(s.family)
    return record.gaussian and record.elementwise and s.event_dim == 2 and not s.observed


def matrix_of(sites: dict, p: Param) -> str | None:
    """The latent matrix M of a location M x + b read by :func:`matrix_vector_map` (``None``
    for any other parameter); ``sites`` are the plan's."""
    b = p.bilinear
    if b is None or not is_matrix(sites[b.u]) or b.axis_u is None:
        return None
    return b.u


def matrix_vector_map(ctx: CompileContext, child: Site, key: str, parents: list[str]) -> Param:
    """Parameter ``key`` of ``child`` as b + M x (module docstring), or a ``ValueError``
    naming the site and its parents."""
    plan = ctx.plan
    sites = [plan.sites[p] for p in parents]
    desc = ", ".join(f"{w.name!r} ({w.fn_name})" for w in sites)
    matrices = [w for w in sites if is_matrix(w)]
    vectors = [w for w in sites if lookup(w.family).gaussian and w.event_dim == 1]
    if len(parents) != 2 or len(matrices) != 1 or len(vectors) != 1:
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            "a parent with two event axes is read as a latent matrix M in M x + b, with x "
            "a latent Normal or MultivariateNormal vector (one event axis); these parents "
            "are not of that form",
        )
    m, x = matrices[0], vectors[0]
    dims = param_dims(child, key)
    rows, cols, axis_x = m.dims[-2], m.dims[-1], x.dims[-1]
    sizes = plan.sizes
    out = dims[-1] if child.event_dim else None
    if out is None or sizes[out] != sizes[rows] or sizes[cols] != sizes[axis_x]:
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            f"{m.name!r} must map {x.name!r} to the site's last event axis: a "
            f"{sizes.get(out, 1)} x {sizes[axis_x]} matrix, got {sizes[rows]} x {sizes[cols]}",
        )
    extra = [d for d in m.dims[:-2] + x.dims[:-1] if d not in dims]
    if extra:
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            f"the map sums over the parents' plate axes {extra}; sum over their event axes",
        )
    value, leaves = as_function(ctx, child, key, (m, x))
    if not value.requires_grad:
        raise refuse(child.name, child.fn_name, desc, f"its {key} does not depend on them")
    with torch.enable_grad():
        for w in (m, x):
            refuse_unless_affine(
                value,
                leaves[w.name],
                child,
                w,
                desc,
                "a product M x of a latent matrix and a latent vector is supported",
            )
        h = _mixed_derivative(value, leaves[m.name], leaves[x.name])
    # H per entry i of the location, row k and column j of M, entry l of x
    h_dims = dims + (rows, cols, axis_x)
    shape = [1] * h.dim()
    shape[dims.index(out)], shape[len(dims)] = sizes[out], sizes[rows]
    other_rows = 1 - torch.eye(sizes[out], dtype=h.dtype, device=h.device).reshape(shape)
    if bool((h * other_rows).ne(0).any()):  # H_{ikjl} ≠ 0 for some k ≠ i
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            f"each entry of its {key} must read one row of {m.name!r} (M x, as "
            f"'A @ x' or einsum('...ij,...j->...i', A, x); not x @ A)",
        )
    base = [(leaves[m.name].detach(), m.dims), (leaves[x.name].detach(), x.dims)]
    product = ein(dims, [(h, h_dims)] + base, h_dims, sizes, h)
    const, const_dims = reduce_constant(value.detach() - product, dims)
    h, h_kept = reduce_constant(h, h_dims)
    term = BilinearTerm(m.name, x.name, h, h_kept, cols, axis_x)
    got = ctx.runs["verify"][child.name][key]
    probes = [(ctx.probes[m.name], m.dims), (ctx.probes[x.name], x.dims)]
    expect = ein(dims, [(const, const_dims)], dims, sizes, got)
    expect = expect + ein(dims, [(h, h_kept)] + probes, h_dims, sizes, got)
    if not agrees(got, expect):
        raise refuse(
            child.name,
            child.fn_name,
            desc,
            f"its {key} is not M x + b with fixed b at other values of these sites",
        )
    for w, axis in ((m, cols), (x, axis_x)):
        if lookup(w.family).elementwise:  # a joint factor over the contracted axis
            w.joint = True
            sizes[axis + "b"] = sizes[axis]
    return Param(dims, const=const, const_dims=const_dims, bilinear=term)


def _mixed_derivative(value: torch.Tensor, leaf_m: torch.Tensor, leaf_x: torch.Tensor):
    """H = ∂²value/∂M∂x per entry of ``value`` [..., K, J, L] (rows and columns of M,
    entries of x): for each entry l of x, u ↦ ∂(uᵀ value)/∂x_l is linear in M; its
    gradient in M, differentiated in u per entry of M."""
    n_rows, n_cols, n_x = leaf_m.shape[-2], leaf_m.shape[-1], leaf_x.shape[-1]
    dummy = torch.zeros_like(value, requires_grad=True)
    (gx,) = torch.autograd.grad(value, leaf_x, dummy, create_graph=True)
    picks = torch.eye(n_rows * n_cols, dtype=leaf_m.dtype, device=leaf_m.device)
    picks = picks.reshape(n_rows * n_cols, *[1] * (leaf_m.dim() - 2), n_rows, n_cols)
    picks = picks.expand(n_rows * n_cols, *leaf_m.shape)
    per_x = []
    for col in range(n_x):
        (gm,) = torch.autograd.grad(
            gx[..., col].sum(), leaf_m, create_graph=True, allow_unused=True
        )
        if gm is None or not gm.requires_grad:
            per_x.append(value.new_zeros(*value.shape, n_rows, n_cols))
            continue
        per_x.append(_entries(gm, dummy, picks, n_rows, n_cols, value))
    return torch.stack(per_x, -1)


def _entries(gm, dummy, picks, n_rows, n_cols, value) -> torch.Tensor:
    """∂gm_kj/∂dummy for every entry (k, j) of M, [..., K, J] after ``value``'s axes (all
    at once where vmap can, else entry by entry)."""
    with contextlib.suppress(RuntimeError):
        (d,) = torch.autograd.grad(
            gm, dummy, picks, retain_graph=True, allow_unused=True, is_grads_batched=True
        )
        if d is None:
            return value.new_zeros(*value.shape, n_rows, n_cols)
        return d.detach().movedim(0, -1).reshape(*value.shape, n_rows, n_cols)
    out = []
    for pick in picks:
        (d,) = torch.autograd.grad((gm * pick).sum(), dummy, retain_graph=True, allow_unused=True)
        out.append(torch.zeros_like(value) if d is None else d.detach())
    return torch.stack(out, -1).reshape(*value.shape, n_rows, n_cols)
