"""Affine and bilinear maps of Gaussian sites: y ~ Normal(Σ_k J_k w_k + b, (c β)^-1/2), or
y ~ Normal(B(u, v) + b, ...) with B bilinear in two latent sites (docs/design/vmp.md §7.1).

BayesPy's ``Dot``, ``SumMultiply`` and ``Add``, read off a plain Pyro model: ``X @ w``,
``(X * w).sum(-1)``, ``a + b`` and ``c * mu`` with observed coefficients. The compiler
(:func:`~probfsl.inference.vmp.affine_maps.linear_map`) finds each Jacobian J_k by
automatic differentiation and proves the map affine structurally (the gradient of the
parameter does not depend on the parent); this module supplies the two quantities the
Normal algebra needs:

* the moments of the parameter, ⟨loc⟩ = b + Σ_k J_k⟨w_k⟩ and
  ⟨loc²⟩ = ⟨loc⟩² + Σ_k (J_k⟨w_k w_kᵀ⟩J_kᵀ − (J_k⟨w_k⟩)²) (factors independent across k);
* the message to each parent w_k, with the residual r = ⟨y⟩ − ⟨loc⟩ + J_k⟨w_k⟩:
  (Σ_n c⟨β⟩ r_n J_nk, −½ Σ_n c⟨β⟩ J_nk J_nkᵀ); a matrix second part when the map contracts
  the parent's last event axis, or the summed plate of a plate of Normals (laid out last:
  :mod:`~probfsl.inference.vmp.grouped_plates`), its factor then joint over that axis;
  elementwise otherwise. A plate of Normals summed over several plates contracts them all
  (``LinearTerm.axis`` a tuple, ⟨w wᵀ⟩ over their second copies), its factor one Gaussian
  over their merged entries.
"""

from __future__ import annotations

import torch

from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.grouped_plates import contracted
from probfsl.inference.vmp.layout import BilinearTerm, LinearTerm, Param, Plan
from probfsl.inference.vmp.moments import covariance, expected_stats, second_moment


def _paired(term: LinearTerm) -> tuple:
    """J's axes with the contracted axes renamed to their second copies (for J S Jᵀ)."""
    return _second_copy(term.jac_dims, term.axis)


def _copies(axis: str | tuple | None) -> tuple:
    """The second copies of the contracted axes (the other side of ⟨w wᵀ⟩)."""
    return tuple(a + "b" for a in contracted(axis))


def term_mean(plan: Plan, q: dict, p: Param, term: LinearTerm) -> torch.Tensor:
    """J⟨w⟩ in the parameter's axes."""
    w = plan.sites[term.parent]
    m = expected_stats(plan, q, term.parent)[0]
    if term.identity:  # ⟨w⟩ itself, its axis read as the parameter's
        return ein(p.dims, [(m, _as_parameter(w.dims, term))], p.dims, plan.sizes, plan.ref)
    over = p.dims + contracted(term.axis)
    return ein(p.dims, [(term.jac, term.jac_dims), (m, w.dims)], over, plan.sizes, plan.ref)


def _as_parameter(dims: tuple, term: LinearTerm) -> tuple:
    """``dims`` with the parent's axis renamed to the parameter's axis that an identity J
    maps onto it (:attr:`~probfsl.inference.vmp.layout.LinearTerm.identity`)."""
    return tuple(term.identity if d == term.axis else d for d in dims)


def _as_parent(ops: list, term: LinearTerm) -> list:
    """Operands in the parameter's axes with its axis that an identity J maps onto the
    parent's renamed to the parent's (the product with J, without J)."""
    return [(t, tuple(term.axis if d == term.identity else d for d in dims)) for t, dims in ops]


def _as_parent_dims(dims: tuple, term: LinearTerm) -> tuple:
    """:func:`_as_parent` of a tuple of axis names (without repeats)."""
    return tuple(dict.fromkeys(term.axis if d == term.identity else d for d in dims))


def _identity_variance(plan: Plan, q: dict, term: LinearTerm) -> tuple | None:
    """Var w of each entry (the diagonal of its factor's covariance), in the parameter's
    axes: J Cov(w) Jᵀ for an identity J. ``None`` where the parent's factor is not a
    MultivariateNormal (the general product with J then)."""
    cov = covariance(plan, q, term.parent) if term.identity else None
    if cov is None:
        return None
    w = plan.sites[term.parent]
    return cov.diagonal(dim1=-2, dim2=-1), _as_parameter(w.dims, term)


def _second(plan: Plan, q: dict, name: str, axis: str | tuple | None) -> tuple:
    """⟨w wᵀ⟩ over the contracted axes (its axes) or ⟨w²⟩ elementwise (no axis)."""
    w = plan.sites[name]
    if axis is None:
        return expected_stats(plan, q, name)[1], w.dims
    return second_moment(plan, q, name), w.dims + _copies(axis)


def _second_copy(dims: tuple, axis: str | tuple | None) -> tuple:
    """``dims`` with the contracted axes renamed to their second copies (unchanged
    without one)."""
    axes = contracted(axis)
    return tuple(d + "b" if d in axes else d for d in dims)


def _covariance(plan: Plan, q: dict, name: str, axis: str | tuple | None) -> tuple:
    """Cov w over the contracted axes (the factor's own, :func:`~probfsl.inference.vmp.
    moments.covariance`, where it has one; else ⟨w wᵀ⟩ − ⟨w⟩⟨w⟩ᵀ), or Var w elementwise."""
    w = plan.sites[name]
    mean = expected_stats(plan, q, name)[0]
    if axis is None:
        return expected_stats(plan, q, name)[1] - mean.square(), w.dims
    cov = covariance(plan, q, name)
    if cov is not None:
        return cov, w.dims + _copies(axis)
    k = len(contracted(axis))
    left = mean.reshape(*mean.shape, *[1] * k)
    right = mean.reshape(*mean.shape[: mean.dim() - k], *[1] * k, *mean.shape[mean.dim() - k :])
    return second_moment(plan, q, name) - left * right, w.dims + _copies(axis)


def _paired_h(term: BilinearTerm, which: tuple) -> tuple:
    """H's axes with the contracted axes of ``which`` parents renamed to second copies."""
    rename = {a: a + "b" for a in which if a}
    return tuple(rename.get(d, d) for d in term.h_dims)


def bilinear_moments(plan: Plan, q: dict, p: Param) -> tuple:
    """(⟨loc⟩, ⟨loc²⟩, Var loc) of b + B(u, v) under q(u) q(v):
    ⟨B⟩ = H·⟨u⟩·⟨v⟩, ⟨B²⟩ = H H ⟨u uᵀ⟩ ⟨v vᵀ⟩ (contracted over both pairs of axes)."""
    t, sizes, ref = p.bilinear, plan.sizes, plan.ref
    u, v = plan.sites[t.u], plan.sites[t.v]
    mean_u, mean_v = expected_stats(plan, q, t.u)[0], expected_stats(plan, q, t.v)[0]
    h = (t.h, t.h_dims)
    over = p.dims + tuple(a for a in (t.axis_u, t.axis_v) if a)
    product = ein(p.dims, [h, (mean_u, u.dims), (mean_v, v.dims)], over, sizes, ref)
    # Var B = H H (Cov u ⊗ ⟨v vᵀ⟩ + ⟨u⟩⟨u⟩ᵀ ⊗ Cov v): from covariances, not E[B²] − ⟨B⟩²,
    # which cancels badly in float32
    sv = _second(plan, q, t.v, t.axis_v)
    cov_u, cov_v = _covariance(plan, q, t.u, t.axis_u), _covariance(plan, q, t.v, t.axis_v)
    outer_u = [(mean_u, u.dims), (mean_u, _second_copy(u.dims, t.axis_u))]
    paired = (t.h, _paired_h(t, (t.axis_u, t.axis_v)))
    over2 = over + tuple(a + "b" for a in (t.axis_u, t.axis_v) if a)
    var = ein(p.dims, [h, paired, cov_u, sv], over2, sizes, ref)
    var = var + ein(p.dims, [h, paired, cov_v] + outer_u, over2, sizes, ref)
    mean = ein(p.dims, [(p.const, p.const_dims)], p.dims, sizes, ref) + product
    return mean, mean.square() + var, var


def bilinear_message(
    plan: Plan, q: dict, p: Param, parent: str, precision: list, data: torch.Tensor
) -> list:
    """m_{y → parent} for b + B(u, v): the map is linear in the parent with Jacobian H⟨other⟩,
    whose second moment is H H ⟨other otherᵀ⟩ (mean-field between u and v)."""
    t, sizes, ref = p.bilinear, plan.sizes, plan.ref
    mine, other = (t.axis_u, t.axis_v) if parent == t.u else (t.axis_v, t.axis_u)
    other_name = t.v if parent == t.u else t.u
    w, o = plan.sites[parent], plan.sites[other_name]
    mean_o = expected_stats(plan, q, other_name)[0]
    h = (t.h, t.h_dims)
    residual = data - ein(p.dims, [(p.const, p.const_dims)], p.dims, sizes, ref)
    over = p.dims + tuple(a for a in (t.axis_u, t.axis_v) if a)
    eta1 = ein(w.dims, precision + [(residual, p.dims), h, (mean_o, o.dims)], over, sizes, ref)
    so = _second(plan, q, other_name, other)
    if mine is None:
        paired = (t.h, _paired_h(t, (other,)))
        over2 = over + ((other + "b",) if other else ())
        return [eta1, -0.5 * ein(w.dims, precision + [h, paired, so], over2, sizes, ref)]
    paired = (t.h, _paired_h(t, (mine, other)))
    out = w.dims + (mine + "b",)
    over2 = over + tuple(a + "b" for a in (mine, other) if a)
    return [eta1, -0.5 * ein(out, precision + [h, paired, so], over2, sizes, ref)]


def moments(plan: Plan, q: dict, p: Param) -> tuple[torch.Tensor, torch.Tensor]:
    """(⟨loc⟩, ⟨loc²⟩) of an affine parameter, each in the parameter's axes; kept with the
    factors they come from (a sweep asks for them once per message and bound term)."""
    t = p.bilinear
    deps = tuple(q[d.parent] for d in p.terms) if t is None else (q[t.u], q[t.v])
    hit = p.derived.get("moments")
    if hit is None or not all(a is b for a, b in zip(hit[0], deps, strict=True)):
        value = _moments(plan, q, p) if t is None else bilinear_moments(plan, q, p)
        hit = p.derived["moments"] = (deps, value)
    return hit[1][:2]


def _moments(plan: Plan, q: dict, p: Param) -> tuple[torch.Tensor, torch.Tensor]:
    sizes, ref = plan.sizes, plan.ref
    mean = ein(p.dims, [(p.const, p.const_dims)], p.dims, sizes, ref)
    var = 0
    for term in p.terms:
        w = plan.sites[term.parent]
        j = (term.jac, term.jac_dims)
        part = term_mean(plan, q, p, term)
        mean = mean + part
        if term.axis is None:
            m, m2 = expected_stats(plan, q, term.parent)
            var = var + ein(p.dims, [j, j, (m2 - m.square(), w.dims)], p.dims, sizes, ref)
        elif (var_w := _identity_variance(plan, q, term)) is not None:
            var = var + ein(p.dims, [var_w], p.dims, sizes, ref)
        else:
            s2 = second_moment(plan, q, term.parent)
            over = p.dims + contracted(term.axis) + _copies(term.axis)
            ops = [j, (s2, w.dims + _copies(term.axis)), (term.jac, _paired(term))]
            var = var + ein(p.dims, ops, over, sizes, ref) - part.square()
    return mean, mean.square() + var


def mean(plan: Plan, q: dict, p: Param) -> torch.Tensor:
    """⟨loc⟩ = b + Σ_k J_k⟨w_k⟩ of an affine parameter, in its axes (with the cache of
    :func:`moments`)."""
    if p.bilinear is not None:
        return moments(plan, q, p)[0]
    deps = tuple(q[t.parent] for t in p.terms)
    hit = p.derived.get("mean")
    if hit is not None and all(a is b for a, b in zip(hit[0], deps, strict=True)):
        return hit[1]
    sizes, ref = plan.sizes, plan.ref
    value = ein(p.dims, [(p.const, p.const_dims)], p.dims, sizes, ref)
    for term in p.terms:
        value = value + term_mean(plan, q, p, term)
    p.derived["mean"] = (deps, value)
    return value


def second_moment_terms(plan: Plan, q: dict, p: Param) -> list[list]:
    """⟨loc²⟩ as a sum of products: ``[[(⟨loc⟩², axes)], J_1 Cov(w_1) J_1ᵀ, ...]``, each
    an operand list for :func:`~probfsl.inference.vmp.einsum.ein`. A caller that sums
    ⟨loc²⟩ against its own operands contracts each product as a whole, so a map over many
    rows (a design matrix against a joint Gaussian) sums J Jᵀ over its rows first instead
    of forming each row's variance (:func:`moments` forms them)."""
    if p.bilinear is not None:  # ⟨loc⟩² and Var loc, formed apart (no cancellation)
        loc = moments(plan, q, p)[0]
        return [[(loc.square(), p.dims)], [(p.derived["moments"][1][2], p.dims)]]
    terms = [[(mean(plan, q, p).square(), p.dims)]]
    for term in p.terms:
        j = (term.jac, term.jac_dims)
        var_w = _identity_variance(plan, q, term)
        if var_w is not None:
            terms.append([var_w])
            continue
        cov = _covariance(plan, q, term.parent, term.axis)
        if term.axis is None:
            terms.append([j, j, cov])
        else:
            terms.append([j, cov, (term.jac, _paired(term))])
    return terms


def message(
    plan: Plan, q: dict, p: Param, parent: str, precision: list, data: torch.Tensor
) -> list:
    """m_{y → parent} for the affine parameter ``p`` of a Normal child with expected value
    ``data`` (in ``p.dims``) and precision operands ``precision`` (mask, c, ⟨β⟩)."""
    if p.bilinear is not None:
        return bilinear_message(plan, q, p, parent, precision, data)
    sizes, ref = plan.sizes, plan.ref
    term = next(t for t in p.terms if t.parent == parent)
    w = plan.sites[parent]
    residual = data - mean(plan, q, p) + term_mean(plan, q, p, term)
    j = (term.jac, term.jac_dims)
    over = p.dims + contracted(term.axis)
    if term.identity:
        ops = _as_parent(precision + [(residual, p.dims)], term)
        eta1 = ein(w.dims, ops, _as_parent_dims(over, term), sizes, ref)
    else:
        eta1 = ein(w.dims, precision + [(residual, p.dims), j], over, sizes, ref)
    if term.axis is None:
        return [eta1, -0.5 * ein(w.dims, precision + [j, j], over, sizes, ref)]
    out = w.dims + _copies(term.axis)
    over = over + _copies(term.axis)
    eta2 = ein(out, precision + [j, (term.jac, _paired(term))], over, sizes, ref)
    return [eta1, -0.5 * eta2]
