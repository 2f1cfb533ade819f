"""The MultivariateNormal family in VMP: E ln N(x | m, c Λ) with a MultivariateNormal mean
and a Wishart precision (optionally selected), its natural parameter and its messages
(Winn & Bishop 2005, Table 2; PRML eq. 10.64-10.71).
"""

from __future__ import annotations

from probfsl.inference.expfam.block import logdet, sum_terms
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import LOG_2PI, Plan, Site, constant, stat_dims
from probfsl.inference.vmp.moments import covariance, expected_stats, parent_ops, weights


def natural(plan: Plan, q: dict, s: Site) -> list:
    """E[η] of a latent MultivariateNormal given its parents: (⟨cΛ⟩⟨m⟩, −½⟨cΛ⟩)."""
    o = ops(plan, q, s)
    lam = o["W"] + o["Lam"]
    eta1 = ein(s.dims, lam + o["L1b"], o["over"], plan.sizes, plan.ref)
    eta2 = -0.5 * ein(s.dims + (o["eb"],), lam, o["over"], plan.sizes, plan.ref)
    return [eta1, eta2]


def ops(plan, q, s):
    """Operand lists of a MultivariateNormal site: E ln N(x | m, c Λ) per vector is
    ½(D ln c + ⟨ln|Λ|⟩) − (D/2) ln 2π − ½ c tr(⟨Λ⟩(⟨x xᵀ⟩ − 2⟨x⟩⟨m⟩ᵀ + ⟨m mᵀ⟩))
    (PRML eq. 10.64-10.71, Winn & Bishop Table 2)."""
    e = s.dims[-1]
    eb = e + "b"

    def to_b(dims):
        return tuple(eb if d == e else d for d in dims)

    o = dict(X1=None, X1b=None, X2=None)
    if s.observed or s.name in q:
        x = expected_stats(plan, q, s.name)
        o.update(X1=[(x[0], s.dims)], X1b=[(x[0], to_b(s.dims))], X2=[(x[1], s.dims + (eb,))])
        if s.observed:  # x xᵀ as two operands: never materialised, [N, D, D] per task
            o["X2"] = o["X1"] + o["X1b"]
    mu = parent_ops(plan, q, s, "loc")
    if mu is None:
        m = s.params["loc"].const
        mm = constant(
            plan, ("outer_loc", s.name), lambda: m.unsqueeze(-1) * m.unsqueeze(-2), s.dims
        )
        o.update(L1=[(m, s.dims)], L1b=[(m, to_b(s.dims))], L2=[(mm, s.dims + (eb,))])
    else:
        o.update(L1=[mu[0]], L1b=[(mu[0][0], to_b(mu[0][1]))], L2=[mu[1]])
    prec = s.params["precision"]
    lam = parent_ops(plan, q, s, "precision")
    if lam is None:
        p = prec.const
        # ln|Λ| of the fixed precision: once per plan (a Cholesky per call otherwise)
        dims = prec.const_dims[:-2]
        ldet = constant(plan, ("logdet", s.name), lambda: logdet(p), dims)
        o.update(coef=[], Lam=[(p, prec.const_dims)], ldet=[[(ldet, dims)]])
    else:
        d = plan.sizes[e]
        coef = [(prec.coef, prec.coef_dims)]
        o.update(
            coef=coef,
            Lam=coef + [lam[0]],
            ldet=[[(d * prec.coef.log(), prec.coef_dims)], [lam[1]]],
        )
    o["M"] = [] if s.mask is None else [(s.mask, s.mask_dims)]
    o["W"], o["comp"] = weights(plan, q, s)
    o["over"] = s.dims[:-1] + ((o["comp"],) if o["comp"] else ())
    o["eb"] = eb
    return o


def centred(plan: Plan, q: dict, s: Site, o: dict) -> list | None:
    """⟨(x − m)(x − m)ᵀ⟩ of a MultivariateNormal site as operand lists: Cov x, Cov m and
    (⟨x⟩ − ⟨m⟩)(⟨x⟩ − ⟨m⟩)ᵀ (x and m independent under q), not ⟨x xᵀ⟩ − 2⟨x⟩⟨m⟩ᵀ + ⟨m mᵀ⟩,
    whose terms cancel where the covariances are small beside the means (float32 keeps no
    digit of a covariance below 6e-8 ⟨x⟩²). For a mean that is fixed, data or the value of
    a site with a MultivariateNormal factor, not selected; ``None`` otherwise (a selected
    mean, a step of a Gaussian chain: the expanded form then)."""
    if o["comp"] or o["X1"] is None:
        return None
    (x, dims), eb = o["X1"][0], o["eb"]
    (m, m_dims) = o["L1"][0]
    if not set(m_dims) <= set(dims):
        return None
    terms = []
    for name, cov_dims in ((s.name, dims + (eb,)), (s.params["loc"].parent, o["L2"][0][1])):
        w = plan.sites.get(name) if name else None
        if w is None or w.observed or w.point:
            continue  # a fixed value: no covariance
        cov = None if w.joint else covariance(plan, q, name)
        if cov is None:
            return None
        terms.append([(cov, cov_dims)])
    d = x - ein(dims, [(m, m_dims)], (), plan.sizes, plan.ref, expand=False)
    e = dims[-1]
    return [*terms, [(d, dims), (d, tuple(eb if a == e else a for a in dims))]]


def site_loglik(plan: Plan, q: dict, s: Site, out: tuple):
    """E ln N(x | m, c Λ) of site ``s`` summed into ``out`` (the bound's term), its
    quadratic term from :func:`centred` where that applies."""
    o = ops(plan, q, s)
    return loglik(plan, o, out, o["W"], centred(plan, q, s, o))


def loglik(plan, o, out, weights, centred_terms=None):
    """E ln N(x | m, c Λ) from the operands ``o`` of :func:`ops` (see there), with the
    quadratic term's ⟨(x − m)(x − m)ᵀ⟩ as ``centred_terms`` (:func:`centred`) where given."""
    mw = o["M"] + weights

    def e(ops):
        return ein(out, ops, o["over"], plan.sizes, plan.ref)

    d = plan.sizes[o["eb"]]
    total = -0.5 * d * LOG_2PI * e(mw)
    for ld in o["ldet"]:
        total = total + 0.5 * e(mw + ld)
    lam = mw + o["Lam"]
    if centred_terms is not None:
        quad = sum_terms(e(lam + t) for t in centred_terms)
    else:
        quad = e(lam + o["X2"]) - 2 * e(lam + o["X1"] + o["L1b"]) + e(lam + o["L2"])
    return total - 0.5 * quad


def message(plan, q, c: Site, role: str, to: Site) -> list:
    """Messages of a MultivariateNormal child: to its mean (⟨cΛ⟩⟨x⟩, −⟨cΛ⟩/2), to its
    Wishart precision (−c⟨(x − m)(x − m)ᵀ⟩/2, 1/2), to its selector E ln N per component."""
    o = ops(plan, q, c)
    sizes, ref = plan.sizes, plan.ref
    if role == "select":
        return [loglik(plan, o, to.dims + (o["comp"],), [])]
    p = c.params[role]
    out1, out2 = (tuple(p.rename[d] for d in dims) for dims in stat_dims(to))
    mw = o["M"] + o["W"]

    def e(out, ops):
        return ein(out, ops, o["over"], sizes, ref)

    if role == "loc":
        lam = mw + o["Lam"]
        return [e(out1, lam + o["X1b"]), -0.5 * e(out2, lam)]
    cc = mw + o["coef"]  # role precision, to a Wishart
    outer = (
        e(out1, cc + o["X2"])
        - e(out1, cc + o["X1"] + o["L1b"])
        - e(out1, cc + o["L1"] + o["X1b"])
        + e(out1, cc + o["L2"])
    )
    return [-0.5 * outer, 0.5 * e(out2, mw)]
