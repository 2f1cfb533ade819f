"""The canonical layout of VMP: sites, their parameters and the plan.

Each site's value is laid out with the ``tasks`` axis first, then one named axis per
other plate and one per event dimension (``"x#e0"``); a Categorical's probabilities add a
category axis (``"z#cat"``), a precision matrix a second event axis (``"x#e0b"``). Every
message is an :func:`~probfsl.inference.vmp.einsum.ein` over these names. A
:class:`Plan` holds what the compiler (:mod:`probfsl.inference.vmp.compiler`) read off the
model; the sweeps only read it (and its per-plan caches of fixed quantities).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from probfsl.inference.vmp.checks import unwrap
from probfsl.inference.vmp.family import lookup

LOG_2PI = math.log(2 * math.pi)
TASKS = "tasks"


@dataclass
class LinearTerm:
    """One term J·w of an affine parameter Σ_k J_k w_k + b (VMP design §7.1): the parent ``w``,
    the Jacobian ``jac`` with axes ``jac_dims`` (the parameter's axes it varies along, plus
    ``axis``, the parent's last event axis that the map contracts; ``None`` for an
    elementwise map such as c · μ; a tuple of the parent's last plate axes where the map
    sums a plate of Normals over several plates)."""

    parent: str
    jac: torch.Tensor
    jac_dims: tuple
    axis: str | tuple | None
    #: the parameter's axis that J maps one to one onto ``axis`` (J the identity between
    #: them, the same along every other axis: ``Normal(f, s).to_event(1)`` of a
    #: MultivariateNormal f); ``None`` for any other J
    identity: str | None = None


@dataclass
class BilinearTerm:
    """The term B(u, v) of a parameter b + B(u, v), bilinear in two latent Gaussian sites
    (BayesPy's ``SumMultiply`` of two Gaussian nodes): ``h`` is ∂²B/∂u∂v with axes
    ``h_dims`` (the parameter's, then each parent's contracted axis, ``None`` where the
    parent maps elementwise)."""

    u: str
    v: str
    h: torch.Tensor
    h_dims: tuple
    axis_u: str | None
    axis_v: str | None


@dataclass
class Param:
    """How one parameter of a site is formed (VMP design §2)."""

    dims: tuple  # axes of the parameter (the site's, plus the category axis for probs)
    const: torch.Tensor | None = None  # fixed value (reduced axes ``const_dims``)
    const_dims: tuple = ()
    parent: str | None = None
    rename: dict = field(default_factory=dict)  # parent's axes -> the child's names
    coef: torch.Tensor | None = None  # c of a precision c * tau
    coef_dims: tuple = ()
    unit_coef: bool = False  # c = 1 exactly (read once by the compiler): no factor, ln c = 0
    comp: str | None = None  # the parent's component axis the child selects
    selector: str | None = None  # latent Categorical site selecting ``comp``
    index: torch.Tensor | None = None  # fixed one-hot selection [index_dims + comp]
    index_dims: tuple = ()
    terms: list = field(default_factory=list)  # LinearTerm of an affine map (const = b)
    bilinear: BilinearTerm | None = None  # a product of two latent Gaussians (const = b)
    #: further Gamma parents of a product precision c · parent · Π factors: (name, rename)
    factors: list = field(default_factory=list)
    derived: dict = field(default_factory=dict, init=False, repr=False)  # see derived


def derived(p: Param, kind: str) -> torch.Tensor:
    """A function of a fixed parameter, computed once per plan: ``square`` (m²), ``log``
    (ln c) and ``log_probs`` (ln π, clamped) of ``const``, ``log_coef`` (ln c) of ``coef``."""
    t = p.derived.get(kind)
    if t is None:
        if kind == "square":
            t = p.const.square()
        elif kind == "log":
            t = p.const.log()
        elif kind == "log_coef":
            t = p.coef.log()
        else:
            t = p.const.log().clamp_min(torch.finfo(p.const.dtype).min)
        p.derived[kind] = t
    return t


@dataclass
class Site:
    name: str
    family: str
    dims: tuple
    frames: list  # Pyro plate frames of the site
    batch_shape: tuple  # Pyro batch shape and the site's event_dim
    event_dim: int
    observed: bool
    value: torch.Tensor | None  # canonical observed value
    mask: torch.Tensor | None = None  # reduced mask and its axes
    mask_dims: tuple = ()
    fixed: torch.Tensor | None = None  # latent Categorical: one-hot of observed entries
    fixed_mask: torch.Tensor | None = None  # [dims] bool: entries that are observed
    pyro_name: str = ""  # the guide's site name (``z_unobserved`` for obs_mask sites)
    params: dict = field(default_factory=dict)
    n_cat: int = 0
    event_shape: tuple = ()
    stats: tuple = ()  # ⟨u⟩ of an observed site
    #: observed Normal data: (x, x²) stacked on the axis :func:`power_axis` gives, of which
    #: ``stats`` and ``value`` are views (:func:`normal_data`)
    powers: torch.Tensor | None = None
    keep: list = field(default_factory=list)  # Pyro batch axes that are plates ...
    perm: list = field(default_factory=list)  # ... and their order in the layout
    fn_name: str = ""  # the distribution's class name, for messages
    #: a latent Normal whose last event axis (or, for a plate of Normals, last plate axis:
    #: :mod:`~probfsl.inference.vmp.grouped_plates`) a linear map contracts: its factor is
    #: one MultivariateNormal over that axis (as BayesPy's GaussianARD), not a product
    joint: bool = False
    #: how many trailing layout axes the joint factor is over (a plate of Normals that a
    #: map sums over several plates: one Gaussian over their entries, the axes merged)
    joint_axes: int = 1
    #: a ``pyro.param`` site: its factor is a point (the value), updated to the maximiser
    #: of its children's terms; ``init`` is its initial value in the canonical layout
    point: bool = False
    init: torch.Tensor | None = None
    #: (chain name, position) of a latent Normal in a Gaussian Markov chain (the chain's
    #: factor is joint: :mod:`~probfsl.inference.vmp.gaussian_chain`)
    chain: tuple | None = None
    #: a latent Gaussian whose factor is its prior, q = p, never updated (``infer={"q":
    #: "prior"}``: :mod:`~probfsl.inference.vmp.at_prior`)
    at_prior: bool = False


@dataclass
class Plan:
    sites: dict  # name -> Site in model order
    latent: list  # update order
    sizes: dict  # axis name -> size
    children: dict  # latent name -> [(child name, role)]
    ref: torch.Tensor  # a data tensor (dtype and device)
    cache: dict = field(default_factory=dict)  # name -> (factor, its expected statistics)
    chains: dict = field(default_factory=dict)  # chain name -> its member sites in order
    #: constants of the data and fixed parameters (log-factorials of counts, the log
    #: determinant of a fixed precision): key -> (value, its axes), the value a tensor or a
    #: tuple of tensors in those axes (:func:`constant`)
    constants: dict = field(default_factory=dict)

    def take(self, index: torch.Tensor) -> Plan:
        """The plan of the tasks ``index`` alone: every tensor whose first axis is the
        tasks axis is indexed, the rest shared (the constants' rows taken, the caches of
        factors empty)."""
        sizes = dict(self.sizes)
        sizes[TASKS] = len(index)
        sites = {n: _take_site(s, index) for n, s in self.sites.items()}
        constants = {
            key: (_rows_of(value, dims, index), dims)
            for key, (value, dims) in self.constants.items()
        }
        return Plan(
            sites,
            self.latent,
            sizes,
            self.children,
            self.ref,
            chains=self.chains,
            constants=constants,
        )

    def observe(self, **values: torch.Tensor) -> Plan:
        """This plan with new observations of Normal sites, given by name in the model's
        shapes (a schedule that changes the data between blocks, e.g. BAVARDAGE's
        projected rows). Every map read off the model is kept, so a value may change
        only where the model uses it as that site's observation and nowhere else; the
        caches start empty. ``ValueError`` for a site that is not an observed Normal, a
        new shape, or values that are not finite."""
        sites = dict(self.sites)
        for name, value in values.items():
            s = sites.get(name)
            if s is None or not s.observed or s.powers is None:  # (x, x²): a Normal's data
                raise ValueError(f"{name!r} is not an observed Normal site of the model")
            v = canon(s, value.to(self.ref.dtype).expand(*s.batch_shape, *s.event_shape))
            if v.shape != s.value.shape:
                raise ValueError(f"{name!r}: shape {tuple(value.shape)} differs from the model's")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"{name!r}: the data hold NaN or infinite values")
            sites[name] = replace(s, **normal_data(v))
        return Plan(sites, self.latent, self.sizes, self.children, self.ref, chains=self.chains)

    def mean_field_pairs(self) -> list[tuple[str, str, str]]:
        """``(a, b, c)`` for each pair of latent Gaussian sites ``a``, ``b`` that the
        location of site ``c`` combines (an affine map of several latent Gaussian sites,
        ``x @ w + b``, or a product of two, ``c * mu``, ``(W * x).sum(-1)``) but that the plan
        fits with factors of their own: the likelihood couples them, the factors q(a) q(b)
        do not (Winn & Bishop's mean field). Point estimates and the members of one
        Gaussian Markov chain (one joint factor) pair with nothing; a member that pairs
        with a site outside its chain (a latent transition or observation matrix) is named
        as its chain, ``"the chain x0..x9"``. Each pair of factors is named once, at the
        first site that couples it, in model order."""

        def fitted(name: str) -> bool:
            s = self.sites.get(name)
            return s is not None and not s.observed and not s.point

        def factor(name: str) -> str:
            chain = self.sites[name].chain
            return name if chain is None else chain[0]

        def label(name: str) -> str:  # a chain member stands for its chain's factor
            chain = self.sites[name].chain
            if chain is None:
                return name
            members = self.chains[chain[0]]
            return f"the chain {members[0]}..{members[-1]}"

        def gaussian(name: str) -> bool:
            return lookup(self.sites[name].family).gaussian

        out, seen = [], set()
        for child in self.sites.values():
            for p in child.params.values():
                names = [t.parent for t in p.terms]
                if p.bilinear is not None:
                    names += [p.bilinear.u, p.bilinear.v]
                if not names and p.parent is not None:
                    names = [p.parent]
                names = [n for n in dict.fromkeys(names) if fitted(n)]
                # a latent Gaussian child whose mean reads latent Gaussian parents: its own
                # prior couples it with each of them (a hierarchy mu -> theta_j, a chain's
                # first state under a latent mean), unless they share a factor (one chain)
                if fitted(child.name) and gaussian(child.name) and any(map(gaussian, names)):
                    names = [n for n in names if gaussian(n)] + [child.name]
                for i, a in enumerate(names):
                    for b in names[i + 1 :]:
                        key = frozenset((factor(a), factor(b)))
                        if factor(a) != factor(b) and key not in seen:
                            seen.add(key)
                            out.append((label(a), label(b), child.name))
        return out

    def describe(self) -> str:
        """A readable account of the variational family this plan fits: one line per
        factor (its site, family, shape with the named axes and its structure: ``joint
        over axis ...`` for a Normal whose event axis a linear map sums, ``Gaussian Markov
        chain over ...``, ``elementwise`` for a product over entries, ``point estimate``,
        ``kept at its prior``), the structured factors of observed sites (a
        ``DiscreteHMM``'s hidden chain by forward-backward, a logistic site's Pólya-Gamma
        augmentation), then one line ``mean-field between A and B (coupled through site
        C)`` for each pair of :meth:`mean_field_pairs`. The factors are independent of one
        another (q is their product); only the structure within a factor is joint."""

        def shape(s: Site) -> str:
            return "[" + ", ".join(f"{d}={self.sizes[d]}" for d in s.dims) + "]"

        def structure(s: Site) -> str:
            record = lookup(s.family)
            if s.point:
                return "point estimate"
            if s.at_prior:
                return "kept at its prior (q = p, never updated)"
            if s.joint and s.joint_axes > 1:
                return "joint over axes " + ", ".join(s.dims[-s.joint_axes :])
            if s.joint:
                return f"joint over axis {s.dims[-1]}"
            if record.event_rank:
                axes = s.dims[-record.event_rank :]
                word = "axes" if len(axes) > 1 else "axis"
                return f"joint over {word} " + ", ".join(axes)
            return "elementwise"

        rows, done = [], set()
        for name in self.latent:
            s = self.sites[name]
            if s.chain is not None:
                chain = s.chain[0]
                if chain in done:
                    continue
                done.add(chain)
                members = self.chains[chain]
                rows.append(
                    (
                        chain,
                        s.family,
                        shape(s) + f" x {len(members)} steps",
                        "Gaussian Markov chain over " + " -> ".join(members),
                    )
                )
                continue
            rows.append((name, s.family, shape(s), structure(s)))
        for s in self.sites.values():
            if not s.observed:
                continue
            record = lookup(s.family)
            if record.structured:
                states = f"{s.name}#s"
                rows.append(
                    (
                        f"{s.name} (hidden chain)",
                        "Categorical",
                        shape(s)[:-1] + f", {states}={self.sizes[states]}]",
                        f"forward-backward chain over axis {s.dims[-1]}",
                    )
                )
            elif record.logistic and any(p.terms or p.bilinear for p in s.params.values()):
                rows.append((f"{s.name} (Pólya-Gamma)", "PolyaGamma", shape(s), "elementwise"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"VMP plan: q is the product of {len(rows)} factor{'s' * (len(rows) > 1)}"]
        for r in rows:
            lines.append(
                "  "
                + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True))
                + "  "
                + r[3]
            )
        observed = [s for s in self.sites.values() if s.observed]
        if observed:
            lines.append(
                "observed: " + ", ".join(f"{s.name} ({s.family} {shape(s)})" for s in observed)
            )
        for a, b, c in self.mean_field_pairs():
            lines.append(f"mean-field between {a} and {b} (coupled through site {c})")
        return "\n".join(lines)


def normal_data(v: torch.Tensor) -> dict:
    """The data fields of an observed Normal site with canonical values ``v``: (x, x²)
    stacked once on a new axis (``powers``; :func:`power_axis`), ``stats`` and ``value``
    views of it. The E ln N contraction reads the stack as one operand, and a batch of
    tasks is taken from it with one copy."""
    return _with_powers(torch.stack([v, v.square()], power_axis(v.dim())), v.dim())


def power_axis(ndim: int) -> int:
    """Where (x, x²) of data with ``ndim`` axes are stacked: before the last axis (an event
    axis: x and x² then stay views with unit stride for the batched products), or last
    where the data have at most a tasks and a points axis, so that each point's x m and
    −x²/2 are summed together (in float32, half the rounding of two partial sums that
    cancel)."""
    return -2 if ndim > 2 else -1


def _with_powers(powers: torch.Tensor, ndim: int) -> dict:
    x, x2 = powers.unbind(power_axis(ndim))
    return dict(value=x, stats=(x, x2), powers=powers)


def reduce_constant(t: torch.Tensor, dims: tuple, ulps: int = 0) -> tuple[torch.Tensor, tuple]:
    """Drop the axes along which ``t`` is constant (for cheaper contractions); with ``ulps``,
    constant up to that many units in the last place (the first slice is kept)."""

    eps = ulps * torch.finfo(t.dtype).eps if t.is_floating_point() else 0

    def near(lo: torch.Tensor, hi: torch.Tensor, first: torch.Tensor) -> bool:
        """|x − first| <= eps |first| for every x in [lo, hi] (x − first rounds monotonically
        in x, so the extremes decide; NaN never passes)."""
        bound = eps * first.abs()
        return bool(((hi - first <= bound) & (first - lo <= bound)).all())

    def constant(i: int) -> bool:
        first = t.narrow(i, 0, 1)
        if not ulps:
            return torch.equal(t, first.expand_as(t))
        lo, hi = torch.aminmax(t, dim=i, keepdim=True)
        return near(lo, hi, first)

    if ulps and t.numel():
        t0 = t.flatten()[0]
        if near(*torch.aminmax(t), t0):
            return t0, ()
    keep = [i for i in range(t.dim()) if t.shape[i] > 1 and not constant(i)]
    index = tuple(slice(None) if i in keep else 0 for i in range(t.dim()))
    return t[index], tuple(dims[i] for i in keep)


def dtype_of(trace) -> torch.dtype:
    """The dtype of the first floating value of a trace; where every value is discrete,
    that of the first floating parameter of its distributions (else torch's default)."""
    sites = [s for s in trace.nodes.values() if s["type"] == "sample"]
    for s in sites:
        v = s.get("value")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    for s in sites:
        for v in unwrap(s["fn"])[0].__dict__.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.dtype
    return torch.get_default_dtype()


def canon(site: Site, t: torch.Tensor) -> torch.Tensor:
    """A Pyro-shaped tensor (batch axes, then any trailing axes) in canonical layout."""
    nb = len(site.batch_shape)
    index = tuple(slice(None) if i in site.keep else 0 for i in range(nb))
    t = t[index]
    perm = list(site.perm) + list(range(len(site.keep), t.dim()))
    return t.permute(perm)


def to_pyro(site: Site, t: torch.Tensor) -> torch.Tensor:
    """A canonical value in the site's full Pyro shape (for ``poutine.condition``)."""
    return uncanon(site, t).expand(*site.batch_shape, *site.event_shape)


def uncanon(site: Site, t: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`canon`: back to the Pyro batch shape (+ trailing axes)."""
    nk = len(site.keep)
    inv = [0] * nk
    for i, p in enumerate(site.perm):
        inv[p] = i
    t = t.permute(inv + list(range(nk, t.dim())))
    shape = [1] * len(site.batch_shape)
    for j, i in enumerate(site.keep):
        shape[i] = t.shape[j]
    return t.reshape(shape + list(t.shape[nk:]))


def param_dims(s: Site, key: str) -> tuple:
    """Axes of a parameter: the site's, plus the category axis of probabilities, plus
    the second axis of a precision matrix; a Wishart's df has the plate axes only
    (:meth:`~probfsl.inference.vmp.family.Family.param_dims`)."""
    return lookup(s.family).param_dims(s, key)


def stat_dims(s: Site) -> tuple:
    """Axes of each expected sufficient statistic of the site."""
    return lookup(s.family).stat_dims(s)


def unit(plan: Plan, s: Site, ref: torch.Tensor) -> torch.Tensor:
    """Ones for a Gamma site, identity matrices for a Wishart site (the unit of a scaled
    parameter c · parent)."""
    return lookup(s.family).unit([plan.sizes[d] for d in s.dims], ref)


def _rows(t: torch.Tensor | None, dims: tuple, index: torch.Tensor):
    """``t`` at the tasks ``index`` when its first axis (named in ``dims``) is the tasks."""
    return t if t is None or not dims or dims[0] != TASKS else t.index_select(0, index)


def _rows_of(value, dims: tuple, index: torch.Tensor):
    """:func:`_rows` of a tensor or of each tensor of a tuple."""
    if isinstance(value, tuple):
        return tuple(_rows(t, dims, index) for t in value)
    return _rows(value, dims, index)


def constant(plan: Plan, key: tuple, make, dims: tuple):
    """A constant of the plan's data or fixed parameters in the axes ``dims`` (a tensor or
    a tuple of tensors), computed by ``make()`` once: a plan of fewer tasks
    (:meth:`Plan.take`, a compaction) takes its rows instead of computing it again."""
    hit = plan.constants.get(key)
    if hit is None:
        hit = plan.constants[key] = (make(), dims)
    return hit[0]


def _take_param(p: Param, index: torch.Tensor) -> Param:
    terms = [replace(t, jac=_rows(t.jac, t.jac_dims, index)) for t in p.terms]
    bilinear = p.bilinear
    if bilinear is not None:
        bilinear = replace(bilinear, h=_rows(bilinear.h, bilinear.h_dims, index))
    return replace(
        p,
        bilinear=bilinear,
        const=_rows(p.const, p.const_dims, index),
        coef=_rows(p.coef, p.coef_dims, index),
        index=_rows(p.index, p.index_dims, index),
        terms=terms,
    )


def _take_site(s: Site, index: torch.Tensor) -> Site:
    if s.powers is not None:
        data = _with_powers(_rows(s.powers, s.dims, index), s.value.dim())
    else:
        data = dict(
            value=_rows(s.value, s.dims, index),
            stats=tuple(_rows(t, s.dims, index) for t in s.stats),
        )
    return replace(
        s,
        mask=_rows(s.mask, s.mask_dims, index),
        fixed=_rows(s.fixed, s.dims, index),
        fixed_mask=_rows(s.fixed_mask, s.dims, index),
        init=_rows(s.init, s.dims, index),
        params={k: _take_param(p, index) for k, p in s.params.items()},
        **data,
    )
