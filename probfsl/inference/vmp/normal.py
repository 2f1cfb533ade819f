"""The Normal family in VMP: a Normal site's expected log-density, its natural parameter
given its parents, and its messages to them (Winn & Bishop 2005, Table 1; PRML §10.1-10.2).

Operands are gathered once per call (:func:`ops`): the site's own statistics (⟨x⟩, ⟨x²⟩),
its mean's (a parent's, a fixed value's, or an affine map's moments), and its precision's
(c times a product of Gamma factors, or a fixed value), with the mask and the selection
weights of a mixture. A mixture child's messages to its means and precisions come from
its weighted statistics, computed once per update of the labels.
"""

from __future__ import annotations

import torch

from probfsl.inference.expfam.block import sum_terms
from probfsl.inference.vmp import gaussian_chain, linear_maps
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import (
    LOG_2PI,
    TASKS,
    Plan,
    Site,
    constant,
    derived,
    normal_data,
    power_axis,
)
from probfsl.inference.vmp.matrix_maps import matrix_of
from probfsl.inference.vmp.moments import (
    broadcast_shape,
    compact,
    expected_stats,
    parent_ops,
    precision_factors,
    variance,
    weights,
)


def fixed_prior(s: Site) -> bool:
    """A latent Normal site whose location and precision are both fixed (no parent, map,
    selection or mask): its prior is a block like a Gamma's, whose natural parameters and
    log-normaliser :func:`~probfsl.inference.vmp.messages.prior` computes once per plan
    instead of at every sweep."""
    return (
        not s.observed
        and not s.joint
        and not s.point
        and s.chain is None
        and s.mask is None
        and all(
            p.parent is None
            and not p.terms
            and p.bilinear is None
            and p.comp is None
            and not p.factors
            and p.const is not None
            for p in s.params.values()
        )
    )


def site_loglik(plan: Plan, q: dict, s: Site, out: tuple) -> torch.Tensor:
    """E ln N(x | m, c τ) of site ``s`` summed into ``out``, the bound's term: read off the
    message last sent to its selector where no factor it reads has changed since."""
    hit = plan.cache.get(("loglik", s.name))
    if hit is not None and all(a is q[n] for n, a in zip(hit[0], hit[1], strict=True)):
        # Σ_k r_nk E ln N(x_n | θ_k), from the message just sent to the selector
        _, _, per_component, dims, selector = hit
        weighted = [(q[selector][0], dims), (per_component, dims)]
        return ein(out, weighted, dims, plan.sizes, plan.ref)
    o = ops(plan, q, s)
    o["over"] = s.dims + ((o["comp"],) if o["comp"] else ())
    o["D"] = centred_square(plan, q, s, o)
    o["S"] = None if o["D"] is not None else shifted(plan, q, s, o)
    return loglik(plan, o, out, o["W"])


def fixed_prior_loglik(plan: Plan, q: dict, s: Site) -> torch.Tensor:
    """E ln N(x | m, τ⁻¹) of a site with a fixed prior (:func:`fixed_prior`) and factor
    q(x) = N(μ, λ⁻¹), summed per task: Σ ½ ln τ − ½ ln 2π − ½ τ ((μ − m)² + λ⁻¹). Its
    first terms, and m and τ in the site's layout, are computed once per plan. Not
    η·⟨u⟩ − A(η) = τ m μ − ½ τ (μ² + λ⁻¹) − ½ τ m² + ..., whose terms cancel where
    λ⁻¹ ≪ m² (a tight prior away from 0)."""
    hit = plan.cache.get(("fixed_prior", s.name))
    if hit is None:
        loc, prec = s.params["loc"], s.params["precision"]
        sizes, ref = plan.sizes, plan.ref
        m = ein(s.dims, [(loc.const, loc.const_dims)], (), sizes, ref)
        tau = ein(s.dims, [(prec.const, prec.const_dims)], (), sizes, ref)
        log_tau = [(0.5 * derived(prec, "log") - 0.5 * LOG_2PI, prec.const_dims)]
        hit = (m, tau, ein((TASKS,), log_tau, s.dims, sizes, ref))
        plan.cache[("fixed_prior", s.name)] = hit
    m, tau, const = hit
    mean, precision = q[s.name]
    quad = (mean - m).square_().add_(precision.reciprocal()).mul_(tau)
    return const - 0.5 * quad.reshape(quad.shape[0], -1).sum(-1)


def natural(plan: Plan, q: dict, s: Site) -> list:
    """E[η] of a latent Normal given its parents: (c⟨τ⟩⟨m⟩, −½ c⟨τ⟩)."""
    o = ops(plan, q, s)
    o["over"] = s.dims + ((o["comp"],) if o["comp"] else ())
    pr = o["W"] + o["c"] + o["T1"]
    eta1 = ein(s.dims, pr + o["L1"], o["over"], plan.sizes, plan.ref)
    eta2 = -0.5 * ein(s.dims, pr, o["over"], plan.sizes, plan.ref)
    return [eta1, eta2]


def ops(plan, q, s, chain: bool = True, moments: bool = True):
    """Operand lists of a Normal site's expected log-density (:func:`loglik`; ``lnc`` is
    None where ln c = 0; without ``moments``, an affine or bilinear mean's ``L1``, ``L2``
    and ``XL`` are None: its messages to the map's parents read neither); ``L2``,
    the mean's second moment, is a sum of operand lists (an affine mean's variance
    stays factored: :func:`~probfsl.inference.vmp.linear_maps.second_moment_terms`); for
    a step of a Gaussian chain (``chain``), ``XL`` holds the joint ⟨x m⟩ that replaces
    the product ⟨x⟩⟨m⟩ of independent factors."""
    loc, prec = s.params["loc"], s.params["precision"]
    X1 = X2 = None
    if s.observed or s.name in q:
        x = expected_stats(plan, q, s.name)
        X1, X2 = [(x[0], s.dims)], [(x[1], s.dims)]
    mu = parent_ops(plan, q, s, "loc")
    if (loc.terms or loc.bilinear is not None) and not moments:
        L1 = L2 = None
    elif loc.terms or loc.bilinear is not None:
        L1 = [(linear_maps.mean(plan, q, loc), loc.dims)]
        L2 = linear_maps.second_moment_terms(plan, q, loc)
    elif mu is None:
        L1 = [(loc.const, loc.const_dims)]
        L2 = [[(derived(loc, "square"), loc.const_dims)]]
    else:
        L1, L2 = [mu[0]], [[mu[1]]]
    factors = precision_factors(plan, q, s)
    if not factors:
        c = [(prec.const, prec.const_dims)]
        lnc = [(derived(prec, "log"), prec.const_dims)]
        T1, T2 = [], []
    else:  # c τ with c = 1 (the common case) has neither an operand c nor a term ln c
        c = [] if prec.unit_coef else [(prec.coef, prec.coef_dims)]
        lnc = None if prec.unit_coef else [(derived(prec, "log_coef"), prec.coef_dims)]
        T1, T2 = [f[0] for _, f in factors], [[f[1]] for _, f in factors]
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    W, comp = weights(plan, q, s)
    XL = X1 + L1 if X1 is not None and L1 is not None else None
    if chain and s.chain and s.chain[1] and s.chain[0] in q:
        XL = [(gaussian_chain.cross_moment(plan, q, s), s.dims)]
    return dict(
        name=s.name,
        observed=s.observed,
        X1=X1,
        X2=X2,
        L1=L1,
        L2=L2,
        XL=XL,
        c=c,
        lnc=lnc,
        T1=T1,
        T2=T2,
        M=M,
        W=W,
        comp=comp,
    )


def centred_square(plan: Plan, q: dict, s: Site, o: dict) -> list | None:
    """⟨(x − m)²⟩ of the Normal site ``s`` as a sum of operand lists,
    (⟨x⟩ − ⟨m⟩)² + Var x + Var m (x and m independent under q), where x and its mean m
    are elementwise with variances read off their factors (:func:`_variance`), or
    observed data under an affine or bilinear mean (:func:`_affine_residual`), or a step
    of a Gaussian chain (:func:`_chain_step_square`); None elsewhere (a latent site under
    such a mean, a selected mean, a vector chain's step under a latent matrix), where
    ⟨x²⟩ − 2⟨x⟩⟨m⟩ + ⟨m²⟩ is used.

    The expanded form cancels: its three terms are each about ⟨x⟩², and float32 keeps no
    digit of a ⟨(x − m)²⟩ below 6e-8 ⟨x⟩² (a tight prior N(3, 10⁻⁶) on a latent x, whose
    Var x is about 10⁻⁶, loses the whole term). The difference ⟨x⟩ − ⟨m⟩ is formed first."""
    loc = s.params["loc"]
    if s.observed and (loc.terms or loc.bilinear is not None) and not loc.comp and o["L2"]:
        return _affine_residual(plan, o)
    if s.chain is not None and s.chain[1] and s.chain[0] in q and o["X1"] is not None:
        return _chain_step_square(plan, q, s, o)
    if s.observed or o["X1"] is None or loc.terms or loc.bilinear is not None or loc.comp:
        return None
    var_x, var_m = _variance(plan, q, s), _loc_variance(plan, q, loc)
    if var_x is False or var_m is False:
        return None
    (m, m_dims), (x, dims) = o["L1"][0], o["X1"][0]
    if not set(m_dims) <= set(dims):
        return None
    at = ein(dims, [(m, m_dims)], (), plan.sizes, plan.ref, expand=False)
    terms = [[((x - at).square_(), dims)]]
    if var_x is not None:
        terms.append([(var_x, dims)])
    if var_m is not None:
        terms.append([var_m])
    return terms


def _chain_step_square(plan: Plan, q: dict, s: Site, o: dict) -> list | None:
    """⟨(s_t − m_t)²⟩ of a step of a scalar Gaussian chain, m_t = a s_{t−1} + d (a = 1, d = 0
    for a copy), as (⟨s_t⟩ − ⟨m_t⟩)² + Var(s_t − a s_{t−1}) with the variance from the
    chain's joint factor, V_t + a² V_{t−1} − 2a C_{t,t−1}: a chain far from 0 (a level of
    1,000 and steps of 0.1) keeps its float32 bound, which ⟨s_t²⟩ − 2⟨s_t m_t⟩ + ⟨m_t²⟩
    lost. A vector chain's step: :func:`_vector_step_square`."""
    name, t = s.chain
    pred = plan.chains[name][t - 1]
    if gaussian_chain.vector(plan, name):
        return _vector_step_square(plan, q, s, o)
    if plan.sites[pred].dims != s.dims:
        return None
    (m, m_dims), (x, dims) = o["L1"][0], o["X1"][0]
    if not set(m_dims) <= set(dims):
        return None
    at = ein(dims, [(m, m_dims)], (), plan.sizes, plan.ref, expand=False)
    var_t, var_pred = q[s.name][1].reciprocal(), q[pred][1].reciprocal()
    cov = q[name][0][..., t - 1]
    a, _ = gaussian_chain.step_map(plan, s)
    if a is None:
        var = var_t + var_pred - 2 * cov
    else:
        var = var_t + a.square() * var_pred - 2 * a * cov
    return [[((x - at).square_(), dims)], [(var, dims)]]


def _vector_step_square(plan: Plan, q: dict, s: Site, o: dict) -> list | None:
    """⟨(x_t − A x_{t−1} − b)_i²⟩ of a step of a vector Gaussian chain with a fixed A (a
    copy: A = I) as (⟨x_t⟩ − A⟨x_{t−1}⟩ − b)_i² + Cov(x_t − A x_{t−1})_ii, with
    Cov(x_t − A x_{t−1}) = Σ_t − C Aᵀ − A Cᵀ + A Σ_{t−1} Aᵀ, Σ the states' marginal
    covariances and C = Cov(x_t, x_{t−1}) the chain's lag-one covariance: a state-space model
    far from 0 keeps the digits of its residuals. None for a latent A (the expanded form)."""
    name, t = s.chain
    pred = plan.chains[name][t - 1]
    if matrix_of(plan.sites, s.params["loc"]) is not None:
        return None
    (m, m_dims), (x, dims) = o["L1"][0], o["X1"][0]
    if not set(m_dims) <= set(dims):
        return None
    at = ein(dims, [(m, m_dims)], (), plan.sizes, plan.ref, expand=False)
    a, _ = gaussian_chain.matrix_map(plan, q, s)
    cov_t, cov_pred = _state_covariance(q[s.name]), _state_covariance(q[pred])
    lag = q[name][0][..., t - 1, :, :]  # Cov(x_t, x_{t−1})
    var = cov_t.diagonal(dim1=-2, dim2=-1) - 2 * (lag * a).sum(-1) + ((a @ cov_pred) * a).sum(-1)
    return [[((x - at).square_(), dims)], [(var, dims)]]


def _state_covariance(factor: tuple) -> torch.Tensor:
    """Σ [..., D, D] of a vector chain state from its factor (mean, precision): a precision
    matrix (a joint state), or the marginal precisions of an elementwise one."""
    mean, precision = factor
    if precision.dim() == mean.dim():
        return torch.diag_embed(precision.reciprocal())
    return torch.cholesky_inverse(torch.linalg.cholesky(precision))


def _affine_residual(plan: Plan, o: dict) -> list:
    """⟨(x − m)²⟩ of observed data x under an affine mean m = Σ_i J_i w_i + b, as
    (x − ⟨m⟩)² + Σ_i J_i Cov(w_i) J_iᵀ, or a bilinear one (x − ⟨m⟩)² + Var m: the residual
    first, then the map's variance terms
    (:func:`~probfsl.inference.vmp.linear_maps.second_moment_terms` after its ⟨m⟩²). The
    expanded x² − 2x⟨m⟩ + ⟨m⟩² + ... cancels where the fit is close (weights far from 0,
    little noise: a float32 bound 1e-2 relative off, a float64 one 5e-10)."""
    (m, m_dims), (x, dims) = o["L1"][0], o["X1"][0]
    at = ein(dims, [(m, m_dims)], (), plan.sizes, plan.ref, expand=False)
    return [[((x - at).square_(), dims)]] + o["L2"][1:]


def _loc_variance(plan: Plan, q: dict | None, loc, structure: bool = False):
    """Var m of a Normal site's mean ``loc`` as an operand in the site's axes: None where
    it is 0 (a fixed value, data, a point estimate), False where it is not a Normal
    site's value with a factor of its own (:func:`_variance`); with ``structure``, only
    whether it is False."""
    if loc.parent is None:
        return None
    parent = plan.sites[loc.parent]
    record = lookup(parent.family)
    if not (record.gaussian and record.elementwise):  # a Normal site's (x, x²)
        return False
    if structure:  # a member of a vector chain has no marginal variance of its own here
        vector = parent.chain is not None and gaussian_chain.vector(plan, parent.chain[0])
        return False if vector and not parent.observed else None
    var = _variance(plan, q, parent)
    if var is None or var is False:
        return var
    return var, tuple(loc.rename[d] for d in parent.dims)


def _variance(plan: Plan, q: dict, s: Site):
    """Var of the entries of a Normal site's value
    (:func:`~probfsl.inference.vmp.moments.variance`; a member of a scalar Gaussian chain:
    its marginal under the chain's joint factor): None where it is 0 (data, a point
    estimate), False where no factor holds it (a member of a vector chain)."""
    if s.observed or s.point:
        return None
    if s.name not in q or (s.chain is not None and gaussian_chain.vector(plan, s.chain[0])):
        return False
    if s.chain is not None:  # a member's marginal, (mean, 1 / variance) of the joint factor
        return q[s.name][1].reciprocal()
    return variance(plan, q, s.name)


def shifted(plan: Plan, q: dict, s: Site, o: dict) -> dict | None:
    """The operands of an observed Normal site ``s`` shifted by c, a mean of its data
    (:func:`_shift`): x − c and its square stacked (``powers``), c (``c``), and its mean's
    moments ⟨m⟩ − c (``L1``) and ⟨(m − c)²⟩ = (⟨m⟩ − c)² + Var m (``L2``, one operand
    list). E ln N reads them as it reads x and m (x − m = (x − c) − (m − c)): its terms
    ⟨(x − c)²⟩, ⟨(x − c)(m − c)⟩, ⟨(m − c)²⟩ then cancel at the scale of the data's
    spread about c, not of ⟨x⟩². None where :func:`_shift` is. Cached while the mean's
    factor stays."""
    shift = _shift(plan, s, o)
    if shift is None:
        return None
    loc = s.params["loc"]
    deps = (q[loc.parent],) if loc.parent is not None else ()
    hit = plan.cache.get(("shifted", s.name))
    if hit is not None and all(a is b for a, b in zip(hit[0], deps, strict=True)):
        return hit[1]
    (m, m_dims), (c, dims), var_m = o["L1"][0], shift["c"], _loc_variance(plan, q, loc)
    mc = m - c if m_dims == dims else ein(dims, [(m, m_dims)], (), plan.sizes, plan.ref) - c
    second = mc.square() if var_m is None else mc.square().add_(_aligned(plan, dims, *var_m))
    value = dict(shift, L1=[(mc, dims)], L2=[[(second, dims)]])
    plan.cache[("shifted", s.name)] = (deps, value)
    return value


def _aligned(plan: Plan, dims: tuple, t: torch.Tensor, t_dims: tuple) -> torch.Tensor:
    """``t`` (axes ``t_dims``) in the axes ``dims``, size 1 where it has none."""
    return t if t_dims == dims else ein(dims, [(t, t_dims)], (), plan.sizes, plan.ref, False)


#: data this many spreads (standard deviations) from 0 are shifted in float64 too
FAR_IN_FLOAT64 = 30.0


def _shift(plan: Plan, s: Site, o: dict) -> dict | None:
    """c and the data shifted by it, (x − c, (x − c)²) stacked as
    :func:`~probfsl.inference.vmp.layout.normal_data` stacks (x, x²) (``powers``), of an
    observed Normal site ``s`` whose mean is a fixed value or a Normal site's value: c
    the mean of its data over the axes its mean does not have, one per task at least (a
    task's terms never read another's data), in the axes of x and m (``c``). Computed
    once per plan: the expanded form loses eps (⟨x⟩ / spread)² of the term (float32 6e-2
    at 10³ spreads from 0; float64 1e-6 per entry at 10⁵, 6e-4 nats over 500 points of
    1000 ± 0.01). In float32 always; in float64 where the data lie more than
    :data:`FAR_IN_FLOAT64` spreads from 0 (below, the expanded form keeps 13 digits and
    costs a tenth less: the benchmark mixture). None where the mean is an affine or
    bilinear map or a step of a Gaussian chain."""
    key = ("shift", s.name)
    if key in plan.cache:
        return plan.cache[key]
    loc, shift = s.params["loc"], None
    applies = (
        s.observed
        and not loc.terms
        and loc.bilinear is None
        and len(o["L1"]) == 1
        and o["XL"] is not None
        and o["XL"][0] is o["X1"][0]
        and (loc.parent is None or _loc_variance(plan, None, loc, structure=True) is not False)
    )
    if applies and plan.ref.dtype == torch.float64:
        # one host synchronisation per fit: the answer is kept through compactions
        applies = constant(plan, ("far from 0", s.name), lambda: _far_from_zero(s.value), ())
    if applies:
        x, m_dims = s.value, o["L1"][0][1]
        over = [i for i, d in enumerate(s.dims) if d not in m_dims and d != TASKS]
        c = x.mean(over, keepdim=True) if over else x
        c_dims = tuple(d for i, d in enumerate(s.dims) if i not in over)
        dims = m_dims + tuple(d for d in c_dims if d not in m_dims)
        c_at = _aligned(plan, dims, c.reshape([plan.sizes[d] for d in c_dims]), c_dims)
        shift = dict(c=(c_at, dims), powers=normal_data(x - c)["powers"])
    plan.cache[key] = shift
    return shift


def _far_from_zero(x: torch.Tensor) -> bool:
    """Whether the data ``x`` lie more than :data:`FAR_IN_FLOAT64` spreads from 0."""
    return x.numel() > 1 and bool(x.abs().max() > FAR_IN_FLOAT64 * x.std())


def loglik(plan, o, out, weights, offset=None):
    """E ln N(x | m, c τ) summed over the site's axes into ``out``:
    ½(ln c + ⟨ln τ⟩) − ½ ln 2π − ½ c⟨τ⟩(⟨x²⟩ − 2⟨x⟩⟨m⟩ + ⟨m²⟩) (PRML eq. 10.46 per axis),
    plus ``offset`` (a tensor broadcastable to ``out``) where given.

    The terms without the data's axes are summed at their own small size, then added once
    to the term that has them, in place: one full-size pass and no full-size temporary."""
    over, ref = o["over"], plan.ref
    mw = o["M"] + weights
    pr = mw + o["c"] + o["T1"]

    def e(ops):  # broadcastable: terms without the data's axes stay small
        return ein(out, ops, over, plan.sizes, ref, expand=False)

    small = -0.5 * LOG_2PI * e(mw)
    if o["lnc"] is not None:
        small = small + 0.5 * e(mw + o["lnc"])
    for log_tau in o["T2"]:  # ⟨ln τ⟩ of each factor of the precision
        small = small + 0.5 * e(mw + log_tau)
    centred, shift = o.get("D"), o.get("S")
    L1, L2 = (shift["L1"], shift["L2"]) if shift is not None else (o["L1"], o["L2"])
    if centred is None:
        small = small - 0.5 * sum_terms(e(pr + t) for t in L2)
    if offset is not None:
        small = small + offset
    if centred is not None:  # −½ c⟨τ⟩⟨(x − m)²⟩, from the difference (:func:`centred_square`)
        res = -0.5 * sum_terms(e(pr + t) for t in centred)
    elif o["observed"] and o["XL"] is not None and o["XL"][0] is o["X1"][0] and len(L1) == 1:
        # observed x: ⟨x⟩⟨m⟩ − ½⟨x²⟩ as one contraction over (x, x²) · (⟨m⟩, −½), with
        # (x, x²) stacked once per plan (a latent x would be stacked at every call); the
        # coefficients go first, so that their product with ⟨τ⟩ has the layout of the
        # powers and enters ``bmm`` as a view; x and m shifted by c where ``shift``
        # (:func:`shifted`)
        (m, m_dims), power = L1[0], "#power"
        at = power_axis(len(o["X1"][0][1]))
        coef = _stacked([m, torch.full_like(m, -0.5)], m_dims, power, at)
        powers = None if shift is None else shift["powers"]
        res = e([coef] + pr + [_powers(plan, o, power, powers)])
    else:
        res = e(pr + o["XL"]) - 0.5 * e(pr + o["X2"])
    # res is a new tensor (a contraction of several operands): add in place where it
    # already has the full shape
    if tuple(res.shape) == broadcast_shape((res, small)) and 0 not in res.stride():
        res = res.add_(small)
    else:
        res = res + small
    return res.expand([plan.sizes[d] for d in out])


def _weighted_applies(plan: Plan, c: Site, out: tuple, rest: list) -> bool:
    """Whether the messages of the mixture child ``c`` can be read off its weighted
    statistics Σ_n r_nk (1, x_n, x_n²) in the parent's axes ``out``: its selector is a
    latent Categorical and every other operand already lives in those axes."""
    selected = any(p.selector is not None for p in c.params.values())
    return selected and all(set(dims) <= set(out) for _, dims in rest)


def _stacked(tensors: list, dims: tuple, axis: str, at: int) -> tuple:
    """An operand of ``tensors`` (axes ``dims``) stacked on a new axis ``axis``, before
    their last axis (``at`` = -2, where there is one) or last: where
    :func:`~probfsl.inference.vmp.layout.normal_data` stacks the data they meet, so that
    the product reads both as views."""
    at = at if len(dims) > 1 else -1
    return torch.stack(tensors, at), _stacked_dims(dims, axis, at)


def _stacked_dims(dims: tuple, axis: str, at: int) -> tuple:
    """``dims`` with ``axis`` inserted where a stack on dim ``at`` (-2 or -1) puts it."""
    return dims[:-1] + (axis,) + dims[-1:] if at == -2 else dims + (axis,)


def _powers(plan: Plan, o: dict, axis: str, powers: torch.Tensor | None = None) -> tuple:
    """The operand (x, x²) of an observed site: its stacked data (or ``powers``, stacked
    alike: the shifted data of :func:`shifted`), the stack's axis named ``axis``."""
    s = plan.sites[o["name"]]
    powers = s.powers if powers is None else powers
    return powers, _stacked_dims(s.dims, axis, power_axis(len(s.dims)))


def _weighted(
    plan: Plan, q: dict, c: Site, o: dict, out: tuple, power: int, shift=None
) -> torch.Tensor:
    """Σ over the child's own axes of mask × q(z) × ⟨x^power⟩ in the axes ``out``: the
    mixture's sufficient statistics, computed once per update of q(z) (and of the child's
    factor if it is latent) and shared by the messages to the means and precisions; of
    the shifted data (x − c)^power where ``shift`` (:func:`shifted`)."""
    selector = next(p.selector for p in c.params.values() if p.selector is not None)
    key = ("weighted", c.name, out, power, shift is not None)
    deps = (q[selector],) if c.observed else (q[selector], q[c.name])
    hit = plan.cache.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], deps, strict=True)):
        return hit[1]
    if shift is not None and power:  # (x − c, (x − c)²): views of the shifted stack
        dims = o["X1"][0][1]
        stats = shift["powers"].unbind(power_axis(len(dims)))
        data = [(stats[power - 1], dims)]
    else:
        data = {0: [], 1: o["X1"], 2: o["X2"]}[power]
    value = ein(out, o["M"] + o["W"] + data, o["over"], plan.sizes, plan.ref)
    plan.cache[key] = (deps, value)
    return value


def _weighted_message(plan, q, c: Site, o: dict, role: str, out: tuple, others: list) -> list:
    """The messages of a Normal mixture child from its weighted statistics S0, S1, S2:
    to the mean (c⟨τ⟩ S1, −½ c⟨τ⟩ S0); to the precision
    (−½ c (S2 − 2 S1⟨μ⟩ + S0⟨μ²⟩), ½ S0) (PRML eq. 10.51-10.53), observed data and their
    mean shifted by c (:func:`shifted`) where it stays in the axes ``out``:
    S2 − 2 S1⟨μ⟩ + S0⟨μ²⟩ cancels at the scale of the data's spread about c."""
    sizes, ref = plan.sizes, plan.ref
    shift = _shift(plan, c, o)
    if shift is not None and not set(shift["c"][1]) <= set(out):
        shift = None

    def w(power):
        return [(_weighted(plan, q, c, o, out, power, shift), out)]

    if role == "loc":
        pr = o["c"] + o["T1"]
        s1 = w(1)
        if shift is not None:  # S1 = Σ r (x − c) + c S0: one pass over the data serves both
            s1 = [(s1[0][0] + ein(out, w(0) + [shift["c"]], out, sizes, ref), out)]
        return [ein(out, pr + s1, out, sizes, ref), -0.5 * ein(out, pr + w(0), out, sizes, ref)]
    shift = None if shift is None else shifted(plan, q, c, o)
    L1, L2 = (shift["L1"], shift["L2"]) if shift is not None else (o["L1"], o["L2"])
    cc = o["c"] + others
    quad = (
        ein(out, cc + w(2), out, sizes, ref)
        - 2 * ein(out, cc + w(1) + L1, out, sizes, ref)
        + sum_terms(ein(out, cc + w(0) + t, out, sizes, ref) for t in L2)
    )
    s0 = _weighted(plan, q, c, o, out, 0)  # ½ S0 stays broadcast where S0 is (Gamma update)
    return [-0.5 * quad, (0.5 * compact(s0)).expand(s0.shape)]


def _chain_to_matrix(plan: Plan, q: dict, c: Site, to: Site) -> bool:
    """Whether ``c`` is a step x_t ~ N(A x_{t−1} + b, ...) of a Gaussian Markov chain with
    a latent transition matrix ``to`` = A: its message to A reads the chain's joint
    ⟨x_t x_{t−1}ᵀ⟩, not the product of the two means."""
    if c.chain is None or not c.chain[1] or c.chain[0] not in q:
        return False
    return matrix_of(plan.sites, c.params["loc"]) == to.name


def message(plan: Plan, q: dict, c: Site, role: str, to: Site, offset=None) -> list:
    """m_{c → to} of a Normal child: to its mean (c⟨τ⟩⟨x⟩, −½ c⟨τ⟩), to a Gamma factor of
    its precision (−½ c Π_other⟨τ⟩ ⟨(x − m)²⟩, ½), to its selector E ln N per component
    (PRML eq. 10.46-10.53; an affine mean: :mod:`~probfsl.inference.vmp.linear_maps`).

    ``offset`` (selector only): a term of the selector's natural parameter added to the
    message as it is formed (:func:`loglik`); the message is then a new tensor that the
    caller may update in place, and it is not kept for the bound."""
    sizes, ref, child = plan.sizes, plan.ref, c.name
    p = None if role == "select" else c.params[role]
    mapped = p is not None and (bool(p.terms) or p.bilinear is not None)
    # to a parent of an affine or bilinear map: the map's moments are not read (the next
    # term that reads them computes them, with the parent's new factor)
    o = ops(plan, q, c, moments=not mapped)
    o["over"] = c.dims + ((o["comp"],) if o["comp"] else ())
    mw = o["M"] + o["W"]
    if role == "select":
        out = to.dims + (o["comp"],)
        o["S"] = shifted(plan, q, c, o)  # E ln N per component: x and m shifted by c
        per_component = loglik(plan, o, out, [], offset)
        if offset is not None:
            plan.cache.pop(("loglik", child), None)
            return [per_component]
        # cached for the ELBO once q(z) is updated: valid while the other factors stay
        names = [p.parent for p in c.params.values() if p.parent]
        names += [] if c.observed else [child]
        plan.cache[("loglik", child)] = (names, [q[n] for n in names], per_component, out, to.name)
        return [per_component]
    if mapped:  # an affine or bilinear loc
        pr = mw + o["c"] + o["T1"]
        if role == "loc" and _chain_to_matrix(plan, q, c, to):  # x_t's lag-one moments
            return gaussian_chain.matrix_message(plan, q, c, pr)
        return linear_maps.message(plan, q, p, to.name, pr, o["X1"][0][0])
    rename = p.rename if to.name == p.parent else dict(p.factors)[to.name]
    out = tuple(rename[d] for d in to.dims)

    def e(ops):
        return ein(out, ops, o["over"], sizes, ref)

    # role precision, to a Gamma: the other factors of a product precision stay in
    others = [f[0] for name, f in precision_factors(plan, q, c) if name != to.name]
    second = [op for t in o["L2"] for op in t]
    rest = o["c"] + (o["T1"] if role == "loc" else others + o["L1"] + second)
    if _weighted_applies(plan, c, out, rest):
        return _weighted_message(plan, q, c, o, role, out, others)
    if role == "loc":
        pr = mw + o["c"] + o["T1"]
        return [e(pr + o["X1"]), -0.5 * e(pr)]
    cc = mw + o["c"] + others
    centred = centred_square(plan, q, c, o)
    shift = None if centred is not None else shifted(plan, q, c, o)
    if centred is not None:  # ⟨(x − m)²⟩ from the difference, without cancellation
        quad = sum_terms(e(cc + t) for t in centred)
    elif shift is not None:  # ⟨((x − c) − (m − c))²⟩, expanded
        dims = o["X1"][0][1]
        x1, x2 = shift["powers"].unbind(power_axis(len(dims)))
        quad = e(cc + [(x2, dims)]) - 2.0 * e(cc + [(x1, dims)] + shift["L1"])
        quad = quad + sum_terms(e(cc + t) for t in shift["L2"])
    else:
        quad = e(cc + o["X2"]) - 2.0 * e(cc + o["XL"]) + sum_terms(e(cc + t) for t in o["L2"])
    return [-0.5 * quad, 0.5 * e(mw)]
