"""The updates and the bound of VMP: messages, natural parameters and ELBO terms.

Winn & Bishop (2005) §3-4, spec ``vmp.md`` §1-2. For a latent site, η* = E[η(pa)] plus
the messages of its children (:func:`natural`); a child's message to a parent is the
coefficient of the parent's sufficient statistics in E ln p(child | pa) (:func:`message`);
the bound is Σ_sites E ln p(x | pa) + Σ_latent H[q] (:func:`elbo`). Every function takes
the :class:`~probfsl.inference.vmp.layout.Plan` and the current factors ``q`` (site name
-> the factor's parameters in the canonical layout) and contracts named axes with
:func:`~probfsl.inference.vmp.einsum.ein`.
"""

from __future__ import annotations

import torch

from probfsl.inference import expfam
from probfsl.inference.vmp import dirichlet_points, gaussian_chain, hmm, linear_maps, polya_gamma
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.layout import LOG_2PI, TASKS, Plan, Site, derived, stat_dims
from probfsl.inference.vmp.moments import (
    BLOCKS,
    FIELDS,
    block_of,
    expected_stats,
    parent_ops,
    point_mode,
    weights,
)


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


def normal_ops(plan, q, s, chain: bool = True):
    """Operand lists of a Normal site's expected log-density (:func:`normal_loglik`); for a
    step of a Gaussian chain (``chain``), ``XL`` holds the joint ⟨x m⟩ that replaces the
    product ⟨x⟩⟨m⟩ of independent factors."""
    loc, prec = s.params["loc"], s.params["precision"]
    X1 = X2 = None
    if s.observed or s.name in q:
        x = expected_stats(plan, q, s.name)
        X1, X2 = [(x[0], s.dims)], [(x[1], s.dims)]
    mu = parent_ops(plan, q, s, "loc")
    if loc.terms:
        mean, second = linear_maps.moments(plan, q, loc)
        L1, L2 = [(mean, loc.dims)], [(second, loc.dims)]
    elif mu is None:
        L1 = [(loc.const, loc.const_dims)]
        L2 = [(derived(loc, "square"), loc.const_dims)]
    else:
        L1, L2 = [mu[0]], [mu[1]]
    factors = precision_factors(plan, q, s)
    if not factors:
        c = [(prec.const, prec.const_dims)]
        lnc = [(derived(prec, "log"), prec.const_dims)]
        T1, T2 = [], []
    else:
        c = [(prec.coef, prec.coef_dims)]
        lnc = [(derived(prec, "log_coef"), prec.coef_dims)]
        T1, T2 = [f[0] for _, f in factors], [[f[1]] for _, f in factors]
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    W, comp = weights(plan, q, s)
    XL = X1 + L1 if X1 is not None else None
    if chain and s.chain and s.chain[1] and s.chain[0] in q:
        XL = [(gaussian_chain.cross_moment(plan, q, s), s.dims)]
    return dict(X1=X1, X2=X2, L1=L1, L2=L2, XL=XL, c=c, lnc=lnc, T1=T1, T2=T2, M=M, W=W, comp=comp)


def normal_loglik(plan, o, out, weights):
    """E ln N(x | m, c τ) summed over the site's axes into ``out``:
    ½(ln c + ⟨ln τ⟩) − ½ ln 2π − ½ c⟨τ⟩(⟨x²⟩ − 2⟨x⟩⟨m⟩ + ⟨m²⟩) (PRML eq. 10.46 per axis)."""
    over, ref = o["over"], plan.ref
    mw = o["M"] + weights
    pr = mw + o["c"] + o["T1"]

    def e(ops):  # broadcastable: terms without the data's axes stay small
        return ein(out, ops, over, plan.sizes, ref, expand=False)

    small = 0.5 * e(mw + o["lnc"]) - 0.5 * LOG_2PI * e(mw)
    for log_tau in o["T2"]:  # ⟨ln τ⟩ of each factor of the precision
        small = small + 0.5 * e(mw + log_tau)
    small = small - 0.5 * e(pr + o["L2"])
    res = e(pr + o["XL"]) - 0.5 * e(pr + o["X2"]) + small
    return res.expand([plan.sizes[d] for d in out])


def mvn_ops(plan, q, s):
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
        mm = m.unsqueeze(-1) * m.unsqueeze(-2)
        o.update(L1=[(m, s.dims)], L1b=[(m, to_b(s.dims))], L2=[(mm, s.dims + (eb,))])
    else:
        o.update(L1=[mu[0]], L1b=[(mu[0][0], to_b(mu[0][1]))], L2=[mu[1]])
    prec = s.params["precision"]
    lam = parent_ops(plan, q, s, "precision")
    if lam is None:
        p = prec.const
        o.update(
            coef=[],
            Lam=[(p, prec.const_dims)],
            ldet=[[(expfam.families._logdet(p), prec.const_dims[:-2])]],
        )
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


def mvn_loglik(plan, o, out, weights):
    mw = o["M"] + weights

    def e(ops):
        return ein(out, ops, o["over"], plan.sizes, plan.ref)

    d = plan.sizes[o["eb"]]
    total = -0.5 * d * LOG_2PI * e(mw)
    for ld in o["ldet"]:
        total = total + 0.5 * e(mw + ld)
    lam = mw + o["Lam"]
    quad = e(lam + o["X2"]) - 2 * e(lam + o["X1"] + o["L1b"]) + e(lam + o["L2"])
    return total - 0.5 * quad


def site_elbo(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """E_q[ln p(x_site | pa)], one value per task."""
    s, out = plan.sites[name], (TASKS,)
    if s.family == "DiscreteHMM":
        return hmm.loglik(plan, q, s, out)
    if "logits" in s.params:
        return polya_gamma.loglik(plan, q, s, out)
    if dirichlet_points.is_child(s):
        return dirichlet_points.loglik(plan, q, s, out, with_weights=True)
    if linear_key(s) is not None:
        return linear_loglik(plan, q, s, out, with_weights=True)
    if s.family == "Normal":
        hit = plan.cache.get(("loglik", name))
        if hit is not None and all(a is q[n] for n, a in zip(hit[0], hit[1], strict=True)):
            # Σ_k r_nk E ln N(x_n | θ_k), from the message just sent to the selector
            _, _, loglik, dims, selector = hit
            ops = [(q[selector][0], dims), (loglik, dims)]
            return ein(out, ops, dims, plan.sizes, plan.ref)
        o = normal_ops(plan, q, s)
        o["over"] = s.dims + ((o["comp"],) if o["comp"] else ())
        return normal_loglik(plan, o, out, o["W"])
    if s.family == "MultivariateNormal":
        o = mvn_ops(plan, q, s)
        return mvn_loglik(plan, o, out, o["W"])
    if s.family == "Categorical":
        R = expected_stats(plan, q, name)[0]
        cd = s.dims + (f"{s.name}#cat",)
        pi = parent_ops(plan, q, s, "probs")
        if pi is None:
            p = s.params["probs"]
            pi = [(derived(p, "log_probs"), p.const_dims)]
        M = [] if s.mask is None else [(s.mask, s.mask_dims)]
        return ein(out, M + [(R, cd)] + pi, cd, plan.sizes, plan.ref)
    # E ln p = Σ_i η_i·⟨u_i⟩ − A(η) with η and Σ A fixed (computed once per plan)
    block, eta, a_total = prior(plan, s)
    lp = 0
    for t, u, n in zip(eta, expected_stats(plan, q, name), block._stat_dims, strict=True):
        lp = lp + expfam.families._sum_last(t * u, n)
    return sum_tasks(expfam.families._sum_last(lp, block.event_dim)) - a_total


def prior(plan: Plan, s: Site) -> tuple:
    """The fixed prior block of a Gamma, Dirichlet or Wishart site (full layout), its
    natural parameters and its log-normaliser summed per task, cached in the plan."""
    hit = plan.cache.get(("prior", s.name))
    if hit is None:
        block = prior_block(plan, s)
        hit = (block, block.natural(), sum_tasks(block.log_normalizer()))
        plan.cache[("prior", s.name)] = hit
    return hit


def prior_block(plan: Plan, s: Site):
    """The fixed prior of a Gamma or Dirichlet site, in its full layout."""
    full = [
        ein(p.dims, [(p.const, p.const_dims)], (), plan.sizes, p.const) for p in s.params.values()
    ]
    return block_of(s, tuple(full))


def sum_tasks(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).sum(-1) if t.dim() > 1 else t


def elbo(plan: Plan, q: dict) -> torch.Tensor:
    """Σ_sites E ln p(x | pa) + Σ_latent H[q] per task (Winn & Bishop §3.3); with point
    estimates θ, the bound of p(data | θ) (variational EM)."""
    total, no_site, no_entropy = 0, set(), set()
    for name in plan.latent:  # Categorical factors just updated (see _lse_applies)
        hit = plan.cache.get(("lse", name))
        if hit is not None and hit[0] is q[name][0]:
            if all(q[n] is v for n, v in hit[2]):
                total = total + hit[1]
                no_site.update([name] + [c for c, _ in plan.children[name]])
                no_entropy.add(name)
    for name, s in plan.sites.items():
        if s.point:  # a point estimate has neither a prior term nor an entropy
            continue
        if name not in no_site:
            total = total + site_elbo(plan, q, name)
        if not s.observed and name not in no_entropy:
            total = total + sum_tasks(entropy(plan, q, name))
    return total


def lse_applies(plan: Plan, s: Site) -> bool:
    """Whether the ELBO terms of a Categorical factor q(z) = softmax(η) may be read off its
    update: when η is its prior's E ln π plus the per-component E ln N of its children,
    E ln p(z | π) + Σ_children E ln p(x | z, ·) + H[q(z)] = Σ_n ln Σ_k exp η_nk (the
    normaliser; PRML eq. 10.46-10.49), valid while no other factor has changed since.
    Needs no mask, no observed entries, and Normal children only (their E ln N cached)."""
    kids = plan.children[s.name]
    return (
        s.mask is None
        and s.fixed_mask is None
        and bool(kids)
        and all(role == "select" and plan.sites[c].family == "Normal" for c, role in kids)
    )


def entropy(plan: Plan, q: dict, name: str) -> torch.Tensor:
    """H[q] = A − η·⟨u⟩ with the cached ⟨u⟩ (a Categorical's own form keeps 0 ln 0 = 0)."""
    s = plan.sites[name]
    if s.chain:
        return gaussian_chain.entropy(plan, q, s)
    block = block_of(s, q[name])
    if s.family == "Categorical" or s.joint:
        return block.entropy()
    return -block.expected_log_prob(expected_stats(plan, q, name))


def natural(plan: Plan, q: dict, name: str, children: bool = True) -> tuple:
    """η* of a latent site: its prior's expected natural parameter plus (``children``)
    its children's messages (spec §1)."""
    s, sizes = plan.sites[name], plan.sizes
    if s.point:  # no prior term: the children's messages alone
        eta = [plan.ref.new_zeros([sizes[d] for d in dims]) for dims in stat_dims(s)]
    elif s.family == "Normal":
        o = normal_ops(plan, q, s)
        o["over"] = s.dims + ((o["comp"],) if o["comp"] else ())
        pr = o["W"] + o["c"] + o["T1"]
        eta1 = ein(s.dims, pr + o["L1"], o["over"], sizes, plan.ref)
        eta2 = -0.5 * ein(s.dims, pr, o["over"], sizes, plan.ref)
        eta = [eta1, eta2]
    elif s.family == "Categorical":
        cd = s.dims + (f"{s.name}#cat",)
        pi = parent_ops(plan, q, s, "probs")
        if pi is None:
            p = s.params["probs"]
            pi = [(derived(p, "log_probs"), p.const_dims)]
        eta = [ein(cd, pi, cd, sizes, plan.ref)]
    elif s.family == "Gamma" and s.params["rate"].parent is not None:
        eta = gamma_rate_natural(plan, q, s)
    elif s.family == "MultivariateNormal":
        o = mvn_ops(plan, q, s)
        lam = o["W"] + o["Lam"]
        eta1 = ein(s.dims, lam + o["L1b"], o["over"], sizes, plan.ref)
        eta2 = -0.5 * ein(s.dims + (o["eb"],), lam, o["over"], sizes, plan.ref)
        eta = [eta1, eta2]
    else:
        natural = prior(plan, s)[1]
        eta = [
            t.expand([sizes[d] for d in dims])
            for t, dims in zip(natural, stat_dims(s), strict=True)
        ]
    if s.joint:  # a diagonal prior, a full second natural parameter (matrix messages)
        eta[1] = torch.diag_embed(eta[1])
    for child, role in plan.children[name] if children else ():
        for i, m in enumerate(message(plan, q, child, role, s)):
            if s.joint and i == 1 and m.dim() < eta[1].dim():  # an elementwise message
                m = torch.diag_embed(m)
            eta[i] = eta[i] + m
    return tuple(eta)


def message(plan, q, child: str, role: str, to: Site) -> list:
    """m_{child → to}: the coefficients of u(to) in E ln p(child | pa) (spec §2 table)."""
    c, sizes, ref = plan.sites[child], plan.sizes, plan.ref
    if c.family == "DiscreteHMM":
        return hmm.message(plan, q, c, role, to)
    if "logits" in c.params:
        return polya_gamma.message(plan, q, c, to)
    if dirichlet_points.is_child(c):
        return dirichlet_points.message(plan, q, c, role, to)
    if linear_key(c) is not None:
        return linear_message(plan, q, c, role, to)
    if c.family == "Categorical":  # role probs, to a Dirichlet
        p = c.params["probs"]
        cd = c.dims + (f"{c.name}#cat",)
        out = tuple(p.rename[d] for d in to.dims)
        M = [] if c.mask is None else [(c.mask, c.mask_dims)]
        R = expected_stats(plan, q, child)[0]
        return [ein(out, M + [(R, cd)], cd, sizes, ref)]
    if c.family == "MultivariateNormal":
        return mvn_message(plan, q, c, role, to)
    o = normal_ops(plan, q, c)
    o["over"] = c.dims + ((o["comp"],) if o["comp"] else ())
    mw = o["M"] + o["W"]
    if role == "select":
        out = to.dims + (o["comp"],)
        loglik = normal_loglik(plan, o, out, [])
        # cached for the ELBO once q(z) is updated: valid while the other factors stay
        names = [p.parent for p in c.params.values() if p.parent]
        names += [] if c.observed else [child]
        plan.cache[("loglik", child)] = (names, [q[n] for n in names], loglik, out, to.name)
        return [loglik]
    p = c.params[role]
    if p.terms:  # an affine loc (the only parameter with terms)
        pr = mw + o["c"] + o["T1"]
        return linear_maps.message(plan, q, p, to.name, pr, o["X1"][0][0])
    rename = p.rename if to.name == p.parent else dict(p.factors)[to.name]
    out = tuple(rename[d] for d in to.dims)

    def e(ops):
        return ein(out, ops, o["over"], sizes, ref)

    # role precision, to a Gamma: the other factors of a product precision stay in
    others = [f[0] for name, f in precision_factors(plan, q, c) if name != to.name]
    rest = o["c"] + (o["T1"] if role == "loc" else others + o["L1"] + o["L2"])
    if _weighted_applies(plan, c, out, rest):
        return _weighted_message(plan, q, c, o, role, out, others)
    if role == "loc":
        pr = mw + o["c"] + o["T1"]
        return [e(pr + o["X1"]), -0.5 * e(pr)]
    cc = mw + o["c"] + others
    quad = e(cc + o["X2"]) - 2 * e(cc + o["XL"]) + e(cc + o["L2"])
    return [-0.5 * quad, 0.5 * e(mw)]


def _weighted_applies(plan: Plan, c: Site, out: tuple, rest: list) -> bool:
    """Whether the messages of the mixture child ``c`` can be read off its weighted
    statistics Σ_n r_nk (1, x_n, x_n²) in the parent's axes ``out``: its selector is a
    latent Categorical and every other operand already lives in those axes."""
    selected = any(p.selector is not None for p in c.params.values())
    return selected and all(set(dims) <= set(out) for _, dims in rest)


def _weighted(plan: Plan, q: dict, c: Site, o: dict, out: tuple, power: int) -> torch.Tensor:
    """Σ over the child's own axes of mask × q(z) × ⟨x^power⟩ in the axes ``out``: the
    mixture's sufficient statistics, computed once per update of q(z) (and of the child's
    factor if it is latent) and shared by the messages to the means and precisions."""
    selector = next(p.selector for p in c.params.values() if p.selector is not None)
    key = ("weighted", c.name, out, power)
    deps = (q[selector],) if c.observed else (q[selector], q[c.name])
    hit = plan.cache.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], deps, strict=True)):
        return hit[1]
    data = {0: [], 1: o["X1"], 2: o["X2"]}[power]
    value = ein(out, o["M"] + o["W"] + data, o["over"], plan.sizes, plan.ref)
    plan.cache[key] = (deps, value)
    return value


def _weighted_message(plan, q, c: Site, o: dict, role: str, out: tuple, others: list) -> list:
    """The messages of a Normal mixture child from its weighted statistics S0, S1, S2:
    to the mean (c⟨τ⟩ S1, −½ c⟨τ⟩ S0); to the precision
    (−½ c (S2 − 2 S1⟨μ⟩ + S0⟨μ²⟩), ½ S0) (PRML eq. 10.51-10.53)."""
    sizes, ref = plan.sizes, plan.ref

    def w(power):
        return [(_weighted(plan, q, c, o, out, power), out)]

    if role == "loc":
        pr = o["c"] + o["T1"]
        return [ein(out, pr + w(1), out, sizes, ref), -0.5 * ein(out, pr + w(0), out, sizes, ref)]
    cc = o["c"] + others
    quad = (
        ein(out, cc + w(2), out, sizes, ref)
        - 2 * ein(out, cc + w(1) + o["L1"], out, sizes, ref)
        + ein(out, cc + w(0) + o["L2"], out, sizes, ref)
    )
    return [-0.5 * quad, 0.5 * ein(out, w(0), out, sizes, ref)]


def mvn_message(plan, q, c: Site, role: str, to: Site) -> list:
    """Messages of a MultivariateNormal child: to its mean (⟨cΛ⟩⟨x⟩, −⟨cΛ⟩/2), to its
    Wishart precision (−c⟨(x − m)(x − m)ᵀ⟩/2, 1/2), to its selector E ln N per component."""
    o = mvn_ops(plan, q, c)
    sizes, ref = plan.sizes, plan.ref
    if role == "select":
        return [mvn_loglik(plan, o, to.dims + (o["comp"],), [])]
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


def update(plan: Plan, q: dict, name: str, children: bool = True) -> tuple:
    s = plan.sites[name]
    eta = natural(plan, q, name, children)
    if s.point and any(role == "concentration" for _, role in plan.children[name]):
        return (dirichlet_points.m_step(q[name][0], *eta),)
    if s.point:
        return (point_mode(s, eta),)
    if s.family == "Categorical":
        m = eta[0].amax(-1, keepdim=True)  # softmax, fewer passes than torch's
        r = (eta[0] - m).exp_()
        z = r.sum(-1, keepdim=True)
        r = r.div_(z)
        if s.fixed_mask is not None:
            r = torch.where(s.fixed_mask.unsqueeze(-1), s.fixed, r)
        elif children and lse_applies(plan, s):
            lse = sum_tasks((m + z.log()).squeeze(-1))
            others = [(n, q[n]) for n in plan.latent if n != name]
            plan.cache[("lse", name)] = (r, lse, others)
        return (r,)
    if s.joint:
        b = expfam.MultivariateNormal.from_natural(*eta)
        return b.loc, b.precision
    b = BLOCKS[s.family].from_natural(*eta)
    return tuple(getattr(b, f) for f in FIELDS[s.family])


# ------------------------------------------------- children linear in one parent's statistics
#: (child family, parameter) pairs whose E ln p(child | parent) is linear in the parent's
#: expected sufficient statistics (spec §7.4): Σ_i coef_i(x) ⟨u_i(parent)⟩ + const(x)
LINEAR_CHILDREN = {
    ("Poisson", "rate"),
    ("Bernoulli", "probs"),
    ("Binomial", "probs"),
    ("Gamma", "rate"),
    ("Categorical", "probs"),
}


def linear_key(s: Site) -> str | None:
    """The parameter through which ``s`` is a linear child of a parent (``None`` if it is
    not one). A Categorical is handled here only when its probabilities are selected."""
    for key, p in s.params.items():
        if p.parent is None or (s.family, key) not in LINEAR_CHILDREN:
            continue
        if s.family == "Categorical" and p.comp is None:
            return None
        return key
    return None


def _cached(plan: Plan, key: tuple, make):
    hit = plan.cache.get(key)
    if hit is None:
        hit = plan.cache[key] = make()
    return hit


def linear_terms(plan: Plan, q: dict, s: Site) -> tuple[list, list]:
    """E ln p(x | parent) of a linear child as ``(coefs, const)``: ``coefs[i]`` multiplies
    the parent's i-th expected statistic, each a list of (sign, operands); ``const`` is a
    list of (sign, operands) without the parent (spec §7.4):

    * Poisson(k | c λ), u(λ) = (λ, ln λ): coefficients (−c, k), const k ln c − ln k!;
    * Bernoulli(y | p), u(p) = (ln p, ln(1 − p)): (y, 1 − y);
    * Binomial(y | n, p): (y, n − y), const ln C(n, y);
    * Gamma(τ | a, c b), u(b) = (b, ln b): (−c⟨τ⟩, a), const a ln c + (a − 1)⟨ln τ⟩ − ln Γ(a);
    * Categorical(x | θ_z), u(θ) = ln θ: (one-hot x,).
    """
    key = linear_key(s)
    p, d = s.params[key], s.dims
    if s.family == "Categorical":
        return [[(1, [(s.stats[0], d + (f"{s.name}#cat",))])]], []
    if s.family in ("Bernoulli", "Binomial"):
        y = [(s.stats[0], d)]
        if s.family == "Bernoulli":
            return [[(1, y)], [(1, []), (-1, y)]], []
        n = s.params["total_count"]
        n_ops = [(n.const, n.const_dims)]

        def log_binom():
            nn = ein(d, n_ops, d, plan.sizes, s.stats[0])
            v = s.stats[0]
            return torch.lgamma(nn + 1) - torch.lgamma(v + 1) - torch.lgamma(nn - v + 1)

        lb = _cached(plan, ("log_binom", s.name), log_binom)
        return [[(1, y)], [(1, n_ops), (-1, y)]], [(1, [(lb, d)])]
    c, lnc = [(p.coef, p.coef_dims)], [(derived(p, "log_coef"), p.coef_dims)]
    if s.family == "Poisson":
        k = [(s.stats[0], d)]
        lgk = _cached(plan, ("log_factorial", s.name), lambda: torch.lgamma(s.stats[0] + 1))
        return [[(-1, c)], [(1, k)]], [(1, k + lnc), (-1, [(lgk, d)])]
    # Gamma(τ | a, c b)
    a = s.params["concentration"]
    a_ops = [(a.const, a.const_dims)]
    am1, lga = _cached(plan, ("gamma_shape", s.name), lambda: (a.const - 1, torch.lgamma(a.const)))
    tau, log_tau = expected_stats(plan, q, s.name) if s.observed or s.name in q else (None, None)
    const = [(1, a_ops + lnc), (-1, [(lga, a.const_dims)])]
    if log_tau is not None:
        const.append((1, [(am1, a.const_dims), (log_tau, d)]))
    coef1 = [(-1, c + [(tau, d)])] if tau is not None else []
    return [coef1, [(1, a_ops)]], const


def _linear_sum(plan: Plan, out: tuple, terms: list, extra: list, over: tuple) -> torch.Tensor:
    """Σ over ``over`` of Σ_j sign_j Π operands_j, each times the operands ``extra``."""
    total = 0
    for sign, ops in terms:
        total = total + sign * ein(out, extra + ops, over, plan.sizes, plan.ref, expand=False)
    return total


def linear_loglik(plan: Plan, q: dict, s: Site, out: tuple, with_weights: bool) -> torch.Tensor:
    """E ln p(x | parent) of a linear child summed into ``out`` (selection weights applied
    when ``with_weights``; without them, per component of the selected axis)."""
    key = linear_key(s)
    coefs, const = linear_terms(plan, q, s)
    u = parent_ops(plan, q, s, key)
    W, comp = weights(plan, q, s)
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    extra = M + (W if with_weights else [])
    over = s.dims + ((f"{s.name}#cat",) if s.family == "Categorical" else ())
    over = over + ((comp,) if comp else ())
    total = _linear_sum(plan, out, const, extra, over)
    for terms, stat in zip(coefs, u, strict=True):
        total = total + _linear_sum(plan, out, terms, extra + [stat], over)
    return total.expand([plan.sizes[x] for x in out])


def linear_message(plan: Plan, q: dict, s: Site, role: str, to: Site) -> list:
    """m_{s → to}: to the parent, the coefficients of its statistics summed over the
    child's axes (weighted by the selection); to the selector, E ln p per component."""
    W, comp = weights(plan, q, s)
    if role == "select":
        return [linear_loglik(plan, q, s, to.dims + (comp,), with_weights=False)]
    p = s.params[role]
    coefs, _ = linear_terms(plan, q, s)
    M = [] if s.mask is None else [(s.mask, s.mask_dims)]
    over = s.dims + ((f"{s.name}#cat",) if s.family == "Categorical" else ())
    over = over + ((comp,) if comp else ())
    out = []
    for terms, dims in zip(coefs, stat_dims(to), strict=True):
        o = tuple(p.rename[x] for x in dims)
        m = _linear_sum(plan, o, terms, M + W, over) if terms else 0
        out.append(
            torch.as_tensor(m, dtype=plan.ref.dtype, device=plan.ref.device).expand(
                [plan.sizes[x] for x in o]
            )
        )
    return out


def gamma_rate_natural(plan: Plan, q: dict, s: Site) -> list:
    """η of a Gamma factor whose rate is c · b with b a Gamma site: (−c⟨b⟩, a − 1) (the
    expected natural parameter of its prior, spec §1), b selected where it is indexed."""
    p, a = s.params["rate"], s.params["concentration"]
    W, comp = weights(plan, q, s)
    over = s.dims + ((comp,) if comp else ())
    b = parent_ops(plan, q, s, "rate")[0]
    eta1 = -ein(s.dims, W + [(p.coef, p.coef_dims), b], over, plan.sizes, plan.ref)
    eta2 = ein(s.dims, [(a.const - 1, a.const_dims)], s.dims, plan.sizes, plan.ref)
    return [eta1, eta2]
