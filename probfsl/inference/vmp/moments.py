"""Expected statistics of the factors of VMP, in the canonical layout.

⟨u(x)⟩ of every site (observed values, or the moments of its factor q), cached per factor
in the plan and shared by every message and bound term that reads them (Winn & Bishop
(2005) §3: a node's messages to its children are its expected statistics).
"""

from __future__ import annotations

import torch

from probfsl.inference import expfam
from probfsl.inference.expfam.block import spd_inverse
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.grouped_plates import to_layout
from probfsl.inference.vmp.layout import Plan, Site, stat_dims


def expected_stats(plan: Plan, q: dict, name: str) -> tuple:
    """⟨u⟩ of a site in its canonical layout: observed values or the factor's moments.
    A joint Normal site (:attr:`~probfsl.inference.vmp.layout.Site.joint`) reports the
    elementwise (⟨x⟩, ⟨x²⟩) that its Normal prior and copy-children use; its full second
    moment is :func:`second_moment`."""
    s = plan.sites[name]
    if s.observed:
        return s.stats
    hit = plan.cache.get(name)
    if hit is not None and hit[0] is q[name]:
        return hit[1]
    if s.point:
        stats = point_stats(s, q[name][0])
    elif lookup(s.family).compact_factor:
        # digamma once per distinct shape (see :func:`compact`)
        shape = broadcast_shape(q[name])
        stats = compact_block(s, q[name]).expected_stats()
        stats = tuple(t.expand(shape) for t in stats)
    else:
        block = factor_block(plan, q, name)
        if isinstance(block, expfam.MultivariateNormal):  # ⟨x xᵀ⟩, for second_moment
            stats, cov = _mvn_moments(block)
            second = to_layout(plan, s, stats[1], matrix=True) if s.joint else stats[1]
            _cache_factor(plan, ("second", name), q[name], second)
            covariance = to_layout(plan, s, cov, matrix=True) if s.joint else cov
            _cache_factor(plan, ("covariance", name), q[name], covariance)
            var = cov.diagonal(dim1=-2, dim2=-1)  # Var x, for :func:`variance`
            if s.joint:  # in the layout's axes (a merged factor's split back)
                diagonal = stats[1].diagonal(dim1=-2, dim2=-1)
                stats = (to_layout(plan, s, stats[0]), to_layout(plan, s, diagonal))
                var = to_layout(plan, s, var)
            _cache_factor(plan, ("variance", name), q[name], var)
            _cache_factor(plan, name, q[name], stats)
            return stats
        stats = block.expected_stats()
    if s.joint and not s.point:  # in the layout's axes (a merged factor's split back)
        diagonal = stats[1].diagonal(dim1=-2, dim2=-1)
        stats = (to_layout(plan, s, stats[0]), to_layout(plan, s, diagonal))
    plan.cache[name] = (q[name], stats)
    return stats


def second_moment(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """⟨x xᵀ⟩ over the last event axis of a joint Normal or MultivariateNormal factor."""
    hit = plan.cache.get(("second", name))
    if hit is not None and hit[0] is q[name]:
        return hit[1]
    s = plan.sites[name]
    if s.point:
        value = q[name][0]
        second = value.unsqueeze(-1) * value.unsqueeze(-2)
    else:  # computed with the first moments (one inverse of the precision for both)
        expected_stats(plan, q, name)
        hit = plan.cache.get(("second", name))
        if hit is not None and hit[0] is q[name]:
            return hit[1]
        second = factor_block(plan, q, name).expected_stats()[1]
        second = to_layout(plan, s, second, matrix=True) if s.joint else second
    plan.cache[("second", name)] = (q[name], second)
    return second


def covariance(plan: Plan, q: dict, name: str) -> torch.Tensor | None:
    """Cov x over the last event axis of a MultivariateNormal factor, in the axes of
    :func:`second_moment`: the P⁻¹ its moments were formed from (cached with them by
    :func:`expected_stats`), not ⟨x xᵀ⟩ − ⟨x⟩⟨x⟩ᵀ. ``None`` for a site whose factor is
    not one (a point, a step of a Gaussian chain)."""
    hit = plan.cache.get(("covariance", name))
    if hit is None or hit[0] is not q[name]:
        expected_stats(plan, q, name)
        hit = plan.cache.get(("covariance", name))
    return hit[1] if hit is not None and hit[0] is q[name] else None


def _mvn_moments(block: expfam.MultivariateNormal) -> tuple:
    """(⟨x⟩, ⟨x xᵀ⟩ = P⁻¹ + m mᵀ) of a MultivariateNormal block N(m, P⁻¹), as
    :meth:`~probfsl.inference.expfam.MultivariateNormal.expected_stats` computes them, and
    the covariance P⁻¹ they were formed from (its diagonal: :func:`variance`)."""
    m, chol, cov = block.loc, block.chol, block.cov
    if cov is None:
        cov = spd_inverse(block.precision) if chol is None else torch.cholesky_inverse(chol)
    return (m, cov + m.unsqueeze(-1) * m.unsqueeze(-2)), cov


def variance(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """Var x of each entry of the latent Normal site ``name`` (a factor of its own: not a
    point, not a step of a Gaussian chain), in its canonical layout, read off its factor:
    1/λ of an elementwise factor N(m, λ⁻¹), the diagonal of P⁻¹ of a joint one N(m, P⁻¹).
    Not ⟨x²⟩ − ⟨x⟩², which cancels where Var x ≪ ⟨x⟩²: float32 keeps no digit of a
    variance below 6e-8 ⟨x⟩². Cached per factor (a joint factor's by
    :func:`expected_stats`, which forms the covariance)."""
    hit = plan.cache.get(("variance", name))
    if hit is not None and hit[0] is q[name]:
        return hit[1]
    s = plan.sites[name]
    if s.joint:  # the diagonal of the covariance that the moments were formed from
        expected_stats(plan, q, name)  # caches the variances where it forms the covariance
        hit = plan.cache.get(("variance", name))
        if hit is not None and hit[0] is q[name]:
            return hit[1]
        diagonal = _mvn_moments(factor_block(plan, q, name))[1].diagonal(dim1=-2, dim2=-1)
        var = to_layout(plan, s, diagonal)
    else:
        precision = q[name][1]
        var = compact(precision).reciprocal().expand(precision.shape)
    plan.cache[("variance", name)] = (q[name], var)
    return var


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its broadcast axes (stride 0, size > 1) narrowed to size 1: a view that
    holds each distinct value once (a Gamma shape a₀ + ½ Σ_n r_nk is one value per class,
    broadcast over the event axis), on which an elementwise function costs less."""
    if 0 not in t.stride() or not any(
        st == 0 and n > 1 for n, st in zip(t.shape, t.stride(), strict=True)
    ):
        return t
    index = tuple(
        slice(0, 1) if st == 0 and n > 1 else slice(None)
        for n, st in zip(t.shape, t.stride(), strict=True)
    )
    return t[index]


def broadcast_shape(tensors) -> tuple:
    """The shape that ``tensors`` broadcast to (:func:`torch.broadcast_shapes`, cheaper)."""
    n = max(t.dim() for t in tensors)
    out = [1] * n
    for t in tensors:
        for i, size in enumerate(t.shape, n - t.dim()):
            if size != 1:
                out[i] = size
    return tuple(out)


def compact_block(s: Site, params: tuple):
    """:func:`block_of` on the :func:`compact` views of ``params`` (an elementwise family:
    its results broadcast back to the full shape)."""
    return block_of(s, tuple(compact(t) for t in params))


def broadcast_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` computed once per distinct value along the axes that both broadcast
    (stride 0), which stay broadcast in the result."""
    if a.shape != b.shape:
        return a + b
    ca, cb = compact(a), compact(b)
    if ca is a or cb is b:
        return a + b
    shared = [i for i in range(a.dim()) if a.shape[i] > 1 and a.stride(i) == 0 and b.stride(i) == 0]
    if not shared:
        return a + b
    index = tuple(slice(0, 1) if i in shared else slice(None) for i in range(a.dim()))
    return (a[index] + b[index]).expand(a.shape)


def block_of(s: Site, params: tuple):
    """The factor of site ``s`` with parameters ``params`` as an exponential-family block
    (a joint Normal site's factor is a MultivariateNormal over its last event axis)."""
    return (expfam.MultivariateNormal if s.joint else lookup(s.family).block)(*params)


def factor_block(plan: Plan, q: dict, name: str):
    """:func:`block_of` the factor ``q[name]``; a MultivariateNormal one with the Cholesky
    factor of its precision (or, 2 × 2, its covariance) that its update computed
    (:func:`keep_cholesky`), where it is still that factor, so that its moments and
    entropy do not factorise (or invert) it again."""
    block = block_of(plan.sites[name], q[name])
    if isinstance(block, expfam.MultivariateNormal):
        hit = plan.cache.get(("chol", name))
        if hit is not None and hit[0] is q[name]:
            block.chol = hit[1]
        hit = plan.cache.get(("cov", name))
        if hit is not None and hit[0] is q[name]:
            block.cov = hit[1]
    return block


def keep_cholesky(plan: Plan, name: str, block) -> tuple:
    """The factor (loc, precision) of a MultivariateNormal ``block`` from an update, its
    Cholesky factor (a 2 × 2 one's covariance) kept with it for :func:`factor_block`."""
    factor = (block.loc, block.precision)
    if block.chol is not None:
        _cache_factor(plan, ("chol", name), factor, block.chol)
    if block.cov is not None:  # a 2 × 2 factor's covariance, formed in its update
        _cache_factor(plan, ("cov", name), factor, block.cov)
    return factor


def _factor_keys(name: str) -> tuple:
    """The plan-cache keys of a MultivariateNormal factor's Cholesky factor (or 2 × 2
    covariance), moments, second moment, covariance and variances (:func:`keep_cholesky`,
    :func:`expected_stats`), which :func:`carry_over` and :func:`carry_rows` carry."""
    return (
        ("chol", name),
        ("cov", name),
        name,
        ("second", name),
        ("variance", name),
        ("covariance", name),
    )


def _cache_factor(plan: Plan, key, factor: tuple, value) -> None:
    """``plan.cache[key] = (factor, value)``, the entry of the factor it replaces kept
    under ``("previous", key)``: the factor a masked step (:func:`carry_over`) may restore
    for its frozen tasks."""
    old = plan.cache.get(key)
    if old is not None and old[0] is not factor:
        plan.cache[("previous", key)] = old
    plan.cache[key] = (factor, value)


def _entry(plan: Plan, key, factor: tuple):
    """The value cached under ``key`` (or its previous entry) for this very ``factor``."""
    for k in (key, ("previous", key)):
        hit = plan.cache.get(k)
        if hit is not None and hit[0] is factor:
            return hit[1]
    return None


def carry_rows(plan: Plan, to: Plan, q: dict, taken: dict, rows) -> None:
    """Cache in ``to`` (the plan of some tasks of ``plan``: a compaction) the Cholesky
    factors and moments of the MultivariateNormal factors ``taken[name]`` = ``rows(t)``
    of every parameter ``t`` of ``q[name]``, as ``rows`` of their values cached in
    ``plan``, so that the compacted factors are not factorised again."""
    for name, factor in taken.items():
        for key in _factor_keys(name):
            value = _entry(plan, key, q[name])
            if value is not None:
                value = tuple(map(rows, value)) if isinstance(value, tuple) else rows(value)
                to.cache[key] = (factor, value)


def carry_over(plan: Plan, where, old: dict, new: dict, merged: dict) -> None:
    """Cache the Cholesky factors and moments of the MultivariateNormal factors of a masked
    step: ``merged[name]`` is ``where(old[name], new[name])`` parameter by parameter (the
    frozen tasks' factor from ``old``, the others' from ``new``), so its cached values are
    the same merge of the two factors' cached values, and it is not factorised again. Only
    where both factors' values are cached; ``where(a, b)`` merges one tensor."""
    for name, factor in merged.items():
        for key in _factor_keys(name):
            a, b = _entry(plan, key, old[name]), _entry(plan, key, new[name])
            if a is None or b is None:
                continue
            if isinstance(a, tuple):
                value = tuple(where(x, y) for x, y in zip(a, b, strict=True))
            else:
                value = where(a, b)
            plan.cache[key] = (factor, value)


def parent_ops(plan, q, s, key):
    """Operands of the parameter ``key`` of site ``s``: a list per statistic."""
    p = s.params[key]
    if p.parent is None:
        return None
    stats = expected_stats(plan, q, p.parent)
    sd = stat_dims(plan.sites[p.parent])
    return [(t, tuple(p.rename[d] for d in dims)) for t, dims in zip(stats, sd, strict=True)]


def weights(plan, q, s):
    """The selection weights of a mixture site: (tensor, axes) or None, and comp."""
    for p in s.params.values():
        if p.comp is None:
            continue
        if p.selector is None:
            return [(p.index, p.index_dims)], p.comp
        z = plan.sites[p.selector]
        r = q[p.selector][0]
        return [(r, z.dims + (p.comp,))], p.comp
    return [], None


def point_stats(s: Site, value: torch.Tensor) -> tuple:
    """u(θ) of a point estimate θ, in the statistics of its family."""
    return lookup(s.family).point_stats(value)


def point_mode(s: Site, eta: tuple) -> torch.Tensor:
    """argmax_θ η·u(θ): the point that maximises its children's terms (VMP design §7.2), e.g.
    a precision θ = −η₂/η₁ = Σ ½ / Σ ½⟨(x − m)²⟩ (an EM step of type-II maximum likelihood)."""
    return lookup(s.family).point_mode(eta, s)


def precision_factors(plan: Plan, q: dict, s: Site) -> list:
    """(name, [⟨τ⟩ operand, ⟨ln τ⟩ operand]) of each Gamma factor of the precision of the
    Normal site ``s`` (none when it is fixed)."""
    p = s.params["precision"]
    if p.parent is None:
        return []
    out = [(p.parent, parent_ops(plan, q, s, "precision"))]
    for name, rename in p.factors:
        stats = expected_stats(plan, q, name)
        dims = tuple(rename[d] for d in plan.sites[name].dims)
        out.append((name, [(stats[0], dims), (stats[1], dims)]))
    return out
