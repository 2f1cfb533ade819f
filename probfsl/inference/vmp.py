"""Variational message passing derived from a Pyro model (spec ``vmp.md``).

Winn & Bishop, "Variational Message Passing", JMLR 6 (2005) §3-4; Bishop, *PRML* (2006)
§10.1-10.4. Given a Pyro model of conjugate-exponential sites with a leading ``tasks``
plate, :class:`VMP` reads the model's structure from ``pyro.poutine.trace`` and derives

* the mean-field factor of each latent site, in the family of its prior;
* the coordinate update of each factor, η*_i = E[η_i(pa_i)] + Σ_children m_{c→i}
  (spec §1), one batched tensor contraction per message;
* the analytic ELBO Σ_sites E_q[ln p(x | pa)] + Σ_latent H[q] (Winn & Bishop §3.3);
* a Pyro guide with the model's signature, and the posterior factors as
  ``torch.distributions`` objects.

**How the structure is read.** Each site's value is laid out with one named axis per
plate (by plate name) and one per event dimension; every update is then an ``einsum`` over
named axes. Parents come from Pyro's provenance tracking
(``pyro.infer.inspect.get_dependencies``), and one run of the model with every latent site
at a random value (``poutine.condition``) shows which parameters they move. How a parent
enters a parameter is then *verified* numerically on those values: a location must equal
the parent's value (broadcast over the child's extra axes, the parent's event axes
right-aligned with the child's), a precision (1/scale², or a precision matrix) must equal
c·(parent) with c fixed, a Categorical's probabilities must equal the Dirichlet parent.
A parent plate missing from the child is a mixture component axis: the child must select
it by a latent Categorical site (``Vindex(mu)[..., z, :]``) or by a constant index (labels
given as data); a fixed per-class table selected by a latent site is accepted too.
Anything else is refused with a ``ValueError`` naming the site, its distribution and the
parent (spec §5), before any update. Deriving the plan costs a few runs of the model
(``init``, with the data's device as the default device, so that Pyro's plates and torch's
samplers put their tensors with the data); the sweeps never run it.

**Supported pairs** (child parameter ← parent): see :data:`SUPPORTED`.

**Partially observed labels.** ``pyro.sample("z", Categorical(pi), obs=labels,
obs_mask=observed)`` (Pyro's own mechanism: sites ``z_observed`` and ``z_unobserved``) is one
Categorical factor whose observed entries are fixed one-hot and never updated.

**Initialisation** (spec §4). Latent Categorical sites start from the given responsibilities
(``init(..., init_resp={site: probs})``), or from one-hot observed entries and
uniform-plus-noise elsewhere (noise from a fixed seed over the non-task axes, the same for
every task, so a batch equals its tasks run alone). Every other factor starts at its prior
and is then updated once from those responsibilities (an M step before the first E step).

**Schedule.** One ``step`` updates every latent site once, in the order the model declares
them (or ``order``), and makes no host synchronisation. ``fit`` is ``init`` followed by the
shared loop :func:`probfsl.inference.base.run`: a task whose ELBO moved by less than ``tol``
(relative) in one sweep has converged, and from then on its factors are kept
(:meth:`VMP.keep` masks it; the batch is never shrunk); the host asks whether every task
has converged once every ``check_every`` sweeps.

**Cost of a sweep.** What is fixed is computed once per plan: a coefficient c of
c·τ (read off the model as 1 ± 1 ulp) is snapped to its exact value and kept as a scalar;
ln c, m², ln π of fixed parameters and the priors' natural parameters and log-normalisers
are cached. Expected statistics are cached per factor and reused by the entropies; terms
without the data's axes stay unbroadcast until the last addition; a pairwise contraction of
the same large operands (Σ_n r_nk x_nd for both the mean's and the precision's messages) is
done once per sweep; small contractions are one ``einsum`` call. When a Categorical factor
was updated last, its ELBO terms and its children's are its normaliser Σ_n ln Σ_k e^η_nk.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from probfsl.inference import expfam
from probfsl.inference.base import Engine, Info, RunInfo, run
from probfsl.validation import check_hyperparameter

LOG_2PI = math.log(2 * math.pi)
TASKS = "tasks"
FAMILIES = {
    "Normal": dist.Normal,
    "Gamma": dist.Gamma,
    "Dirichlet": dist.Dirichlet,
    "Categorical": dist.Categorical,
    "MultivariateNormal": dist.MultivariateNormal,
    "Wishart": dist.Wishart,
}
SUPPORTED = (
    "Normal(loc <- Normal site, scale = (c * tau)^-1/2 <- Gamma site), each optionally "
    "indexed by a Categorical site or a fixed index; Categorical(probs <- Dirichlet site); "
    "MultivariateNormal(loc <- MultivariateNormal site, precision_matrix = c * Lambda <- "
    "Wishart site), optionally indexed likewise; Dirichlet, Gamma and Wishart with fixed "
    "parameters"
)


# ---------------------------------------------------------------------------- layouts
def _ein(
    out: tuple, ops: list, over: tuple, sizes: dict, ref: torch.Tensor, expand: bool = True
) -> torch.Tensor:
    """Σ over ``over`` (and every operand axis not in ``out``) of the product of ``ops``.

    With ``expand=False`` an axis of ``out`` that no operand has keeps size 1 (broadcastable).

    ``ops`` are ``(tensor, axis names)``; an axis of ``over`` that no operand has counts its
    size; an axis of ``out`` that no operand has is broadcast.
    """
    key = (out, tuple([d for _, d in ops]), over)
    plan = _SPECS.get(key)
    if plan is None:
        out, over = tuple(out), tuple(over)
        letters: dict[str, str] = {}

        def sub(dims):
            return "".join(letters.setdefault(d, chr(ord("a") + len(letters))) for d in dims)

        present = {d for _, dims in ops for d in dims}
        extra = tuple(d for d in over if d not in present and d not in out)
        kept = tuple(d for d in out if d in present)
        spec = ",".join(sub(dims) for _, dims in ops) + "->" + sub(kept)
        identity = len(ops) == 1 and tuple(ops[0][1]) == kept
        plan = (spec, extra, kept, identity, tuple(d in present for d in out))
        if len(_SPECS) > 4096:
            _SPECS.clear()
        _SPECS[key] = plan
    spec, extra, kept, identity, has = plan
    if identity:
        res = ops[0][0]
    elif ops:
        res = _contract(spec, [t for t, _ in ops])
    else:
        res = torch.ones((), dtype=ref.dtype, device=ref.device)
    n_extra = math.prod(sizes[d] for d in extra)
    if n_extra != 1:
        res = res * n_extra
    if len(kept) < len(out):
        shape = [sizes[d] if h else 1 for d, h in zip(out, has, strict=True)]
        res = res.reshape(shape)
        if expand:
            res = res.expand([sizes[d] for d in out])
    return res


_SPECS: dict = {}
_PATHS: dict = {}


#: one ``einsum`` call contracts the operands when the product of all axes (a bound on any
#: intermediate) is below this or at most twice the largest operand; otherwise opt_einsum's
#: pairwise path is followed
_SMALL = 1 << 12


def _contract(spec: str, tensors: list) -> torch.Tensor:
    """``torch.einsum`` pairwise along opt_einsum's path, the path cached per (spec, shapes)."""
    if len(tensors) <= 2:
        return _einsum(spec, tensors)
    key = (spec, tuple([t.shape for t in tensors]))
    steps = _PATHS.get(key)
    if steps is None:
        subs = spec.split("->")[0].split(",")
        sizes = {
            c: n
            for sub, t in zip(subs, tensors, strict=True)
            for c, n in zip(sub, t.shape, strict=True)
        }
        full = math.prod(sizes.values())
        if full <= _SMALL or full <= 2 * max(t.numel() for t in tensors):
            steps = ()
        else:
            import opt_einsum

            _, info = opt_einsum.contract_path(spec, *key[1], shapes=True)
            steps = [(tuple(c[0]), c[2]) for c in info.contraction_list]
        if len(_PATHS) > 4096:
            _PATHS.clear()
        _PATHS[key] = steps
    if not steps:
        return _einsum(spec, tensors)
    ops = list(tensors)
    for inds, pair_spec in steps:
        args = [ops.pop(i) for i in inds]
        ops.append(_pair(pair_spec, args))
    return ops[0]


#: pairwise contractions of large operands within one sweep, keyed by the operands' identity
#: (the entry holds them, so an id is not reused while it lives) and the relabelled spec:
#: Σ_n r_nk x_nd serves both the mean's and the precision's message. Cleared every sweep.
_MEMO: dict = {}
_MEMO_MIN = 1 << 15


def _pair(spec: str, args: list) -> torch.Tensor:
    """One pairwise step of :func:`_contract`, reused when the same operands recur."""
    if len(args) != 2 or min(args[0].numel(), args[1].numel()) < _MEMO_MIN:
        return _einsum(spec, args)
    ins, res = spec.split("->")
    subs = ins.split(",")
    order = sorted(range(2), key=lambda i: id(args[i]))
    letters: dict[str, str] = {}
    canon = tuple(
        "".join(letters.setdefault(c, chr(97 + len(letters))) for c in sub)
        for sub in [subs[order[0]], subs[order[1]], res]
    )
    key = (canon, id(args[order[0]]), id(args[order[1]]))
    hit = _MEMO.get(key)
    if hit is None:
        hit = (_einsum(spec, args), args[0], args[1])
        _MEMO[key] = hit
    return hit[0]


def _einsum(spec: str, tensors: list) -> torch.Tensor:
    """``torch.einsum`` without its Python wrapper (the operands are plain tensors and the
    path is chosen by :func:`_contract`)."""
    return torch._VF.einsum(spec, tensors)


def _snap(c: torch.Tensor, ulps: int = 8) -> torch.Tensor:
    """``c`` rounded to 3 digits fewer than its dtype carries, where that moves it by at most
    ``ulps`` units in the last place. A coefficient read off the model as value / parent
    (e.g. ((τ^-1/2)^-2) / τ = 1 ± 1 ulp) becomes exact, so :func:`_reduce` finds it constant."""
    if not c.is_floating_point():
        return c
    finfo = torch.finfo(c.dtype)
    digits = max(1, math.floor(-math.log10(finfo.eps)) - 3)
    x = c.double()
    a = x.abs()
    k = digits - 1 - torch.floor(torch.log10(torch.where(a > 0, a, torch.ones_like(a))))
    up = torch.pow(10.0, k.clamp_min(0))  # exact powers of ten (k <= 22)
    down = torch.pow(10.0, (-k).clamp_min(0))
    r = (torch.round(x * up / down) * down / up).to(c.dtype)
    ok = torch.isfinite(r) & ((r - c).abs() <= ulps * finfo.eps * c.abs())
    return torch.where(ok, r, c)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """``torch.allclose`` (|a − b| ≤ atol + rtol |b|, NaN never close) in fewer passes."""
    return torch.equal(a, b) or bool(((a - b).abs() <= atol + rtol * b.abs()).all())


def _broadcast(a: tuple, b: tuple) -> tuple:
    """The broadcast of two shapes (``ValueError`` if they do not broadcast)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b, strict=True)):
        raise ValueError(f"shapes {a} and {b} do not broadcast")
    return tuple(max(x, y) if 1 in (x, y) else x for x, y in zip(a, b, strict=True))


def _reduce(t: torch.Tensor, dims: tuple, ulps: int = 0) -> tuple[torch.Tensor, tuple]:
    """Drop the axes along which ``t`` is constant (for cheaper contractions); with ``ulps``,
    constant up to that many units in the last place (the first slice is kept)."""

    eps = ulps * torch.finfo(t.dtype).eps if t.is_floating_point() else 0

    def constant(i: int) -> bool:
        first = t.narrow(i, 0, 1).expand_as(t)
        if not ulps:
            return torch.equal(t, first)
        return bool(((t - first).abs() <= eps * first.abs()).all())

    if ulps and t.numel():
        t0 = t.flatten()[0]
        if bool(((t - t0).abs() <= eps * t0.abs()).all()):
            return t0, ()
    keep = [i for i in range(t.dim()) if t.shape[i] > 1 and not constant(i)]
    index = tuple(slice(None) if i in keep else 0 for i in range(t.dim()))
    return t[index], tuple(dims[i] for i in keep)


@dataclass
class _Param:
    """How one parameter of a site is formed (spec §2)."""

    dims: tuple  # axes of the parameter (the site's, plus the category axis for probs)
    const: torch.Tensor | None = None  # fixed value (reduced axes ``const_dims``)
    const_dims: tuple = ()
    parent: str | None = None
    rename: dict = field(default_factory=dict)  # parent's axes -> the child's names
    coef: torch.Tensor | None = None  # c of a precision c * tau
    coef_dims: tuple = ()
    comp: str | None = None  # the parent's component axis the child selects
    selector: str | None = None  # latent Categorical site selecting ``comp``
    index: torch.Tensor | None = None  # fixed one-hot selection [index_dims + comp]
    index_dims: tuple = ()
    derived: dict = field(default_factory=dict, init=False, repr=False)  # see _derived


def _derived(p: _Param, kind: str) -> torch.Tensor:
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
class _Site:
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


@dataclass
class _Plan:
    sites: dict  # name -> _Site in model order
    latent: list  # update order
    sizes: dict  # axis name -> size
    children: dict  # latent name -> [(child name, role)]
    ref: torch.Tensor  # a data tensor (dtype and device)
    cache: dict = field(default_factory=dict)  # name -> (factor, its expected statistics)


@dataclass
class VMPState:
    """Factors of every latent site (canonical layout, ``tasks`` first) and the ELBO.

    Attributes:
        plan: the structure derived from the model (shared by every state of a fit).
        q: site name -> the factor's parameters: Normal (loc, precision), Gamma (shape,
            rate), Dirichlet (concentration,), Categorical (probs,).
        objective: the analytic ELBO [T].
    """

    plan: _Plan
    q: dict
    objective: torch.Tensor


def _data_device(args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """The data's device (that of the first tensor argument) as the default device while the
    model runs (``init`` only): Pyro's plates and torch's samplers create tensors without
    ``device=``, and they must land with the data. A no-op without tensor arguments."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return torch.device(a.device)
    return contextlib.nullcontext()


def _all_finite(*tensors: torch.Tensor | None) -> torch.Tensor:
    """A 0-d bool tensor (no host sync): every value of ``tensors`` is finite."""
    oks = [torch.isfinite(t).all() for t in tensors if t is not None]
    return torch.stack(oks).all()


def _check_parameters(sites: list[dict]) -> None:
    """``ValueError`` naming the site and the parameter when a distribution's parameter
    is outside its constraint (a negative scale, a concentration of 0, ...); one host
    synchronisation when every parameter is valid."""
    checks = []
    for s in sites:
        base, _ = _unwrap(s["fn"])
        for name, constraint in getattr(base, "arg_constraints", {}).items():
            value = base.__dict__.get(name)  # the parameters given, not derived ones
            if torch.is_tensor(value):
                checks.append((s["name"], type(base).__name__, name, constraint, value))
    if not checks:
        return
    if bool(torch.stack([c.check(v).all() for *_, c, v in checks]).all()):
        return
    for site, fname, name, constraint, value in checks:
        if not bool(constraint.check(value).all()):
            raise _refuse(site, fname, "-", f"its parameter {name} is outside {constraint}")


def _check_data(args: tuple, kwargs: dict) -> None:
    """``ValueError`` before any tracing: tensor arguments with no task (a leading axis of
    size 0) or no entries."""
    tensors = [(i, a) for i, a in enumerate((*args, *kwargs.values())) if torch.is_tensor(a)]
    for i, a in tensors:
        if a.dim() > 0 and a.shape[0] == 0:
            raise ValueError(f"VMP needs at least one task: argument {i} has 0 rows")
        if a.numel() == 0:
            raise ValueError(f"VMP needs data: argument {i} has shape {tuple(a.shape)}")


def _refuse(site: str, fn: str, parent: str, why: str) -> ValueError:
    """The refusal of spec §5: names the site, its distribution and the offending parent."""
    where = f"site {site!r} ({fn})" + ("" if parent == "-" else f" with parent {parent}")
    return ValueError(f"VMP cannot use {where}: {why}. Supported: {SUPPORTED}")


def _unwrap(fn):
    """Strip Independent / Masked / Expanded wrappers: (base, mask or None)."""
    mask = None
    while True:
        if isinstance(fn, torch.distributions.Independent):
            fn = fn.base_dist
        elif isinstance(fn, dist.MaskedDistribution):
            m = fn._mask
            mask = m if mask is None else mask & m
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            fn = fn.base_dist
        else:
            return fn, mask


def _family(fn) -> str | None:
    for name, cls in FAMILIES.items():
        if type(fn) is cls:
            return name
    return None


class VMP(Engine):
    """Batched variational message passing for a Pyro model (module docstring).

    Args:
        model: a Pyro model whose data carry a leading task axis inside a ``tasks`` plate.
        max_iter: maximum number of sweeps of :meth:`fit`.
        tol: in :meth:`fit`, a task has converged (and is frozen) once its ELBO changes by
            less than ``tol`` · max(1, |ELBO|) in one sweep; 0 runs all ``max_iter`` sweeps.
        check_every: :meth:`fit` first asks the device whether every task has converged
            after ``check_every`` sweeps (the loop's only host synchronisation) ...
        check_growth: ... and then at gaps growing by this factor
            (:func:`probfsl.inference.base.check_steps`; 1 = every ``check_every``
            sweeps). The default 2 (checks after 2, 4, 8, 16, ... sweeps) makes the number
            of checks logarithmic in the sweeps the slowest task needs, so it does not
            grow with the batch (``vmp-gmm`` on Omniglot: 33 host synchronisations per
            call on 100 and on 1,000 tasks, against 36 and 40 with 1). The price is up
            to twice the (masked) sweeps: 30 % fewer tasks/s on one CPU thread on 1,000
            tasks; on a CPU, where a check costs nothing, 1 is the faster setting.
        order: the latent sites' update order (default: the model's declaration order).
        seed: seed of the initial noise of latent Categorical sites.
    """

    maximize = True

    def __init__(
        self,
        model: Callable[..., Any],
        max_iter: int = 100,
        tol: float = 1e-6,
        check_every: int = 2,
        order: list[str] | None = None,
        seed: int = 0,
        check_growth: float = 2.0,
    ) -> None:
        if not callable(model):
            raise TypeError(f"model must be callable, got {type(model).__name__}")
        check_hyperparameter("max_iter", max_iter, integer=True, low=1)
        check_hyperparameter("tol", tol, nonnegative=True)
        check_hyperparameter("check_every", check_every, integer=True, low=1)
        check_hyperparameter("check_growth", check_growth, low=1)
        check_hyperparameter("seed", seed, integer=True, nonnegative=True)
        self.check_growth = float(check_growth)
        self.model, self.max_iter, self.tol = model, int(max_iter), float(tol)
        self.check_every, self.order, self.seed = int(check_every), order, seed

    # ================================================================ compiling
    def _trace(self, args, kwargs, values=None):
        model = self.model if values is None else poutine.condition(self.model, data=values)
        with torch.no_grad(), _data_device(args, kwargs):
            return poutine.trace(model).get_trace(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> _Plan:
        """Read the model's sites, parents and parameter maps (module docstring)."""
        _check_data(args, kwargs)
        try:  # parameters are checked below, naming the site (Pyro's check names none)
            with pyro.validation_enabled(False):
                trace = self._trace(args, kwargs)
        except (NotImplementedError, RuntimeError, ZeroDivisionError) as err:
            ints = [
                i
                for i, a in enumerate((*args, *kwargs.values()))
                if torch.is_tensor(a) and not a.is_floating_point()
            ]
            hint = (
                f"; argument(s) {ints} are integer tensors: the data of a continuous site "
                "must be float32 or float64"
                if ints
                else ""
            )
            raise ValueError(f"the model failed on these inputs: {err}{hint}") from None
        params = [n for n, s in trace.nodes.items() if s["type"] == "param"]
        if params:
            raise ValueError(
                f"VMP cannot use the pyro.param site(s) {params}: point-estimated parameters "
                "are not supported; give them as fixed values or as latent sites with priors"
            )
        raw = [
            s
            for s in trace.nodes.values()
            if s["type"] == "sample"
            and not s["infer"].get("_deterministic")
            and not isinstance(s["fn"], dist.Delta)
            and type(s["fn"]).__name__ != "_Subsample"
        ]
        if not raw:
            raise ValueError("VMP needs a model with sample sites; this model has none")
        _check_parameters(raw)
        self._check_structure(trace, args, kwargs)
        ref = next((s["value"] for s in raw if s["value"].is_floating_point()), None)
        if ref is None:  # no floating value: the first value's device, the default dtype
            ref = torch.zeros((), device=raw[0]["value"].device if raw else "cpu")
        sizes: dict[str, int] = {}
        sites: dict[str, _Site] = {}
        for s in raw:
            name = s["name"]
            if name.endswith("_observed") and name[:-9] + "_unobserved" in trace.nodes:
                continue  # merged with its ``_unobserved`` twin below
            site = self._read_site(s, trace, sizes)
            sites[site.name] = site
        latent = [n for n, s in sites.items() if not s.observed]
        if not latent:
            raise ValueError(
                f"VMP needs at least one latent site; every site of the model is observed "
                f"({sorted(sites)})"
            )
        empty = sorted(name for name, size in sizes.items() if size == 0)
        if empty:
            raise ValueError(f"VMP needs data: the plate(s) or axes {empty} have size 0")
        if self.order is not None:
            if sorted(self.order) != sorted(latent):
                raise ValueError(f"order must list the latent sites {latent}, got {self.order}")
            latent = list(self.order)
        plan = _Plan(sites, latent, sizes, {n: [] for n in latent}, ref)
        self._find_parents(plan, trace, args, kwargs)
        _MEMO.clear()
        return plan

    def _read_site(self, s: dict, trace, sizes: dict) -> _Site:
        name, fn = s["name"], s["fn"]
        base, mask = _unwrap(fn)
        family = _family(base)
        merged = name.endswith("_unobserved") and name[:-11] + "_observed" in trace.nodes
        logical = name[:-11] if merged else name
        fname = type(base).__name__
        if family is None:
            raise _refuse(logical, fname, "-", f"{fname} is not a supported family")
        if s["scale"] != 1.0:
            raise _refuse(logical, fname, "-", "poutine.scale is not supported")
        frames = [f for f in s["cond_indep_stack"] if f.vectorized]
        if TASKS not in [f.name for f in frames]:
            raise _refuse(logical, fname, "-", f"the site has no batched {TASKS!r} plate")
        batch_shape = tuple(fn.batch_shape)
        by_dim = {f.dim: f for f in frames}
        keep, dims = [], []
        for i, size in enumerate(batch_shape):
            f = by_dim.get(i - len(batch_shape))
            if f is not None:
                keep.append(i)
                dims.append(f.name)
                sizes[f.name] = f.size
            elif size != 1:
                raise _refuse(logical, fname, "-", "a batch axis is not declared by a plate")
        full = _broadcast(tuple(s["value"].shape), batch_shape + tuple(fn.event_shape))
        if tuple(full[: len(batch_shape)]) != batch_shape:
            raise _refuse(
                logical, fname, "-", "its value has more batch axes than its distribution"
            )
        event_shape = tuple(full[len(batch_shape) :])
        for j, size in enumerate(event_shape):
            dims.append(f"{logical}#e{j}")
            sizes[dims[-1]] = size
        order = sorted(range(len(keep)), key=lambda i: dims[i] != TASKS)
        dims = [dims[i] for i in order] + dims[len(keep) :]
        site = _Site(
            logical,
            family,
            tuple(dims),
            frames,
            batch_shape,
            len(event_shape),
            bool(s["is_observed"]) and not merged,
            None,
            pyro_name=name,
            event_shape=event_shape,
        )
        site._keep, site._perm = keep, order  # how to canonicalise Pyro tensors
        site.fn_name = fname
        if family == "Categorical":
            site.n_cat = base.probs.shape[-1]
            sizes[f"{logical}#cat"] = site.n_cat
        if family == "MultivariateNormal":
            sizes[dims[-1] + "b"] = event_shape[-1]  # the second axis of x xᵀ
        if family == "Wishart" and site.observed:
            raise _refuse(logical, fname, "-", "an observed Wishart site is not supported")
        full_mask = s["mask"]
        if mask is not None:
            full_mask = mask if full_mask is None else full_mask & mask
        if merged:
            obs_site = trace.nodes[logical + "_observed"]
            obs_mask = torch.as_tensor(obs_site["mask"], device=obs_site["value"].device)
            obs_mask = self._canon(site, obs_mask.expand(batch_shape))
            obs_val = self._canon(site, obs_site["value"].expand(batch_shape)).long()
            site.fixed_mask = obs_mask.bool()
            one_hot = torch.nn.functional.one_hot(obs_val.clamp(0, site.n_cat - 1), site.n_cat)
            site.fixed = one_hot.to(self._dtype_of(trace))
            full_mask = None  # the ~obs_mask of the unobserved twin
        if full_mask is not None and not (isinstance(full_mask, bool) and full_mask):
            m = torch.as_tensor(full_mask, device=s["value"].device)
            m = self._canon(site, m.expand(batch_shape))
            if not site.observed and family != "Categorical":
                raise _refuse(logical, fname, "-", "a mask on a latent continuous site")
            site.mask, site.mask_dims = _reduce(m.to(self._dtype_of(trace)), site.dims[: m.dim()])
        if site.observed:
            value = s["value"]
            if family != "Categorical" and not value.is_floating_point():
                raise _refuse(
                    logical, fname, "-", f"its data are {value.dtype}; give float32 or float64"
                )
            v = self._canon(site, value.expand(batch_shape + event_shape))
            site.value = v
            if family == "Categorical":
                site.stats = (
                    torch.nn.functional.one_hot(v.long(), site.n_cat).to(self._dtype_of(trace)),
                )
            elif family == "MultivariateNormal":
                site.stats = (v, None)  # x xᵀ enters as x ⊗ x (see _mvn_ops)
            elif family in ("Normal", "Gamma"):
                site.stats = (v, v.square() if family == "Normal" else v.log())
            else:
                site.stats = (v.log(),)
            square = v.square() if family == "MultivariateNormal" else None  # x xᵀ's terms
            if family != "Categorical" and not bool(_all_finite(v, *site.stats, square)):
                if not bool(torch.isfinite(v).all()):
                    raise _refuse(logical, fname, "-", "its data hold NaN or infinite values")
                raise _refuse(
                    logical,
                    fname,
                    "-",
                    f"the sufficient statistics of its data (squares or logarithms) are not "
                    f"finite in {v.dtype}: rescale the data, or check for zeros or negative "
                    "values under a Gamma or Dirichlet",
                )
        return site

    def _check_structure(self, trace, args, kwargs) -> None:
        """``ValueError`` when the model's structure (its sites, their distributions and
        shapes) changes with the values of its latent sites: Python control flow on a
        latent value, which message passing cannot follow. Checked by tracing the model
        again with other draws of its latent sites."""

        def shape(t):
            return [
                (n, type(s["fn"]).__name__, tuple(s["value"].shape))
                for n, s in t.nodes.items()
                if s["type"] == "sample"
            ]

        first = shape(trace)
        device = next((v.device for v in (*args, *kwargs.values()) if torch.is_tensor(v)), None)
        cuda = [device] if device is not None and device.type == "cuda" else []
        # the user's random streams are left as they were (the CPU's and the data's GPU's)
        with torch.random.fork_rng(devices=cuda), pyro.validation_enabled(False):
            for seed in (1, 2, 3, 4):
                torch.random.default_generator.manual_seed(seed)
                for d in cuda:
                    with torch.cuda.device(d):
                        torch.cuda.manual_seed(seed)
                if shape(self._trace(args, kwargs)) != first:
                    raise ValueError(
                        "VMP cannot follow this model: its sites change with the values of "
                        "its latent sites (Python control flow on a latent value)"
                    )

    @staticmethod
    def _dtype_of(trace) -> torch.dtype:
        for s in trace.nodes.values():
            v = s.get("value")
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.dtype
        return torch.get_default_dtype()

    @staticmethod
    def _canon(site: _Site, t: torch.Tensor) -> torch.Tensor:
        """A Pyro-shaped tensor (batch axes, then any trailing axes) in canonical layout."""
        nb = len(site.batch_shape)
        index = tuple(slice(None) if i in site._keep else 0 for i in range(nb))
        t = t[index]
        perm = list(site._perm) + list(range(len(site._keep), t.dim()))
        return t.permute(perm)

    def _to_pyro(self, site: _Site, t: torch.Tensor) -> torch.Tensor:
        """A canonical value in the site's full Pyro shape (for ``poutine.condition``)."""
        return self._uncanon(site, t).expand(*site.batch_shape, *site.event_shape)

    def _uncanon(self, site: _Site, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_canon`: back to the Pyro batch shape (+ trailing axes)."""
        nk = len(site._keep)
        inv = [0] * nk
        for i, p in enumerate(site._perm):
            inv[p] = i
        t = t.permute(inv + list(range(nk, t.dim())))
        shape = [1] * len(site.batch_shape)
        for j, i in enumerate(site._keep):
            shape[i] = t.shape[j]
        return t.reshape(shape + list(t.shape[nk:]))

    # ------------------------------------------------------------------ parents
    @staticmethod
    def _param_dims(s: _Site, key: str) -> tuple:
        """Axes of a parameter: the site's, plus the category axis of probabilities, plus
        the second axis of a precision matrix; a Wishart's df has the plate axes only."""
        if key == "probs":
            return s.dims + (f"{s.name}#cat",)
        if s.family == "MultivariateNormal" and key == "precision":
            return s.dims + (s.dims[-1] + "b",)
        if s.family == "Wishart" and key == "df":
            return s.dims[:-2]
        return s.dims

    @staticmethod
    def _stat_dims(s: _Site) -> tuple:
        """Axes of each expected sufficient statistic of the site."""
        d = s.dims
        return {
            "Categorical": (d + (f"{s.name}#cat",),),
            "Dirichlet": (d,),
            "MultivariateNormal": (d, d + (d[-1] + "b",)),
            "Wishart": (d, d[:-2]),
        }.get(s.family, (d, d))

    def _params(self, site: _Site, tr_site: dict) -> dict[str, torch.Tensor]:
        """The site's parameters in its canonical layout (precision for a Normal)."""
        base, _ = _unwrap(tr_site["fn"])
        full = site.batch_shape + site.event_shape
        if site.family == "MultivariateNormal":
            d = site.event_shape[-1]
            loc = self._canon(site, base.loc.expand(full))
            prec = self._canon(site, base.precision_matrix.expand(full + (d,)))
            return {"loc": loc, "precision": prec}
        if site.family == "Wishart":
            df = self._canon(site, base.df.expand(site.batch_shape))
            return {"df": df, "scale": self._canon(site, base.covariance_matrix.expand(full))}
        if site.family == "Normal":
            out = {"loc": base.loc, "precision": base.scale.pow(-2)}
        elif site.family == "Gamma":
            out = {"concentration": base.concentration, "rate": base.rate}
        elif site.family == "Dirichlet":
            out = {"concentration": base.concentration}
        else:
            out = {"probs": base.probs}
        res = {}
        for k, v in out.items():
            extra = (site.n_cat,) if k == "probs" else ()
            res[k] = self._canon(site, v.expand(full + extra))
        return res

    def _probes(self, plan: _Plan) -> dict:
        """A random value of every latent site, canonical layout (for the verifying run)."""
        g = torch.Generator().manual_seed(2)
        cpu = dict(generator=g, dtype=torch.float64, device=g.device)
        out = {}
        for n in plan.latent:
            x = plan.sites[n]
            shape = [plan.sizes[d] for d in x.dims]
            if x.family == "Normal":
                v = torch.randn(shape, **cpu)
            elif x.family == "Gamma":
                v = 0.5 + torch.rand(shape, **cpu)
            elif x.family == "Dirichlet":
                v = torch.rand(shape, **cpu) + 0.05
                v = v / v.sum(-1, keepdim=True)
            elif x.family == "MultivariateNormal":
                v = torch.randn(shape, **cpu)
            elif x.family == "Wishart":
                a = torch.randn(shape, **cpu)
                eye = torch.eye(shape[-1], dtype=a.dtype, device=a.device)
                v = a @ a.transpose(-1, -2) / shape[-1] + eye
            else:
                v = torch.randint(0, x.n_cat, shape, generator=g, device=g.device)
            ref = plan.ref
            out[n] = v.to(ref) if v.is_floating_point() else v.to(ref.device)
        return out

    def _find_parents(self, plan: _Plan, trace, args, kwargs) -> None:
        sites = plan.sites
        base_values = {
            sites[n].pyro_name: trace.nodes[sites[n].pyro_name]["value"] for n in plan.latent
        }
        # the first trace drew these very values: its parameters are the base ones
        base_params = {n: self._params(s, trace.nodes[s.pyro_name]) for n, s in sites.items()}
        self._runs: dict = {"probes": self._probes(plan)}
        # site-level parents by Pyro's provenance tracking (one run of the model) ...
        from pyro.infer.inspect import get_dependencies

        deps = None
        n_tasks = plan.sizes[TASKS]
        if n_tasks > 1:  # the structure of one task (cheaper); all tasks if that fails

            def first(a):
                if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n_tasks:
                    return a[:1]
                return a

            with contextlib.suppress(Exception), _data_device(args, kwargs):
                one = get_dependencies(
                    self.model, tuple(map(first, args)), {k: first(v) for k, v in kwargs.items()}
                )
                deps = one["prior_dependencies"]
        if deps is None:
            with _data_device(args, kwargs):
                deps = get_dependencies(self.model, args, kwargs)["prior_dependencies"]
        logical = {sites[n].pyro_name: n for n in plan.latent}
        # ... and which parameters move when every latent site takes a random value
        values = dict(base_values)
        values.update(
            {
                sites[n].pyro_name: self._to_pyro(sites[n], v)
                for n, v in self._runs["probes"].items()
            }
        )
        tr = self._trace(args, kwargs, values)
        self._runs["verify"] = {n: self._params(x, tr.nodes[x.pyro_name]) for n, x in sites.items()}
        for n, s in sites.items():
            site_pa = [
                logical[d] for d in deps.get(s.pyro_name, {}) if d in logical and logical[d] != n
            ]
            for k, v in base_params[n].items():
                pa = []
                if not torch.equal(self._runs["verify"][n][k], v):
                    fits = _ROLES.get((s.family, k), ())
                    pa = [p for p in site_pa if sites[p].family in fits]
                    if not pa:
                        desc = ", ".join(f"{p!r} ({sites[p].fn_name})" for p in site_pa) or "-"
                        raise _refuse(
                            n, s.fn_name, desc, f"its {k} depends on them non-conjugately"
                        )
                s.params[k] = self._param_map(plan, s, k, v, pa, base_values, args, kwargs)
                p = s.params[k]
                if p.parent is not None:
                    plan.children[p.parent].append((n, k))
                if p.selector is not None and (n, "select") not in plan.children[p.selector]:
                    plan.children[p.selector].append((n, "select"))
            self._name_selected_constants(s)
            self._check_selectors(s)

    @staticmethod
    def _name_selected_constants(s: _Site) -> None:
        """Give a selected constant table the component axis of the site's selected parents."""
        named = {p.selector: p.comp for p in s.params.values() if p.parent and p.comp}
        for p in s.params.values():
            placeholder = f"{p.selector}#cat"
            if p.parent is None and p.comp == placeholder and p.selector in named:
                p.comp = named[p.selector]
                p.const_dims = tuple(p.comp if d == placeholder else d for d in p.const_dims)

    def _check_selectors(self, s: _Site) -> None:
        gathered = [p for p in s.params.values() if p.comp is not None]
        if len({(p.comp, p.selector) for p in gathered}) > 1:
            raise _refuse(
                s.name, s.fn_name, "-", "its parameters select components by different indices"
            )
        if len({p.comp for p in gathered if p.index is not None}) > 1 or (
            len(gathered) > 1 and gathered[0].index is not None
        ):
            idx = [p.index for p in gathered]
            if any(not torch.equal(idx[0], i) for i in idx[1:]):
                raise _refuse(s.name, s.fn_name, "-", "its parameters use different indices")

    def _selected_constant(self, plan, s, key, dims, selector, base_values, args, kwargs):
        """A fixed per-component table chosen by a Categorical site (``Vindex(c)[..., z]``)."""
        z = plan.sites[selector]
        comp = f"{z.name}#cat"
        shape = [plan.sizes[d] for d in z.dims]

        def run(z_value):
            values = dict(base_values)
            values[z.pyro_name] = self._to_pyro(z, z_value)
            tr = self._trace(args, kwargs, values)
            return self._params(s, tr.nodes[s.pyro_name])[key]

        if not set(z.dims) <= set(dims):
            raise _refuse(
                s.name, s.fn_name, repr(selector), "the selector has axes the child lacks"
            )
        table = torch.stack(
            [
                run(torch.full(shape, k, dtype=torch.long, device=plan.ref.device))
                for k in range(z.n_cat)
            ],
            -1,
        )
        g = torch.Generator().manual_seed(3)
        probe = torch.randint(0, z.n_cat, shape, generator=g, device=g.device)
        probe = probe.to(plan.ref.device)
        eff = (
            probe if z.fixed_mask is None else torch.where(z.fixed_mask, z.fixed.argmax(-1), probe)
        )
        one_hot = torch.nn.functional.one_hot(eff, z.n_cat).to(table)
        expect = _ein(
            dims,
            [(table, dims + (comp,)), (one_hot, z.dims + (comp,))],
            dims + (comp,),
            plan.sizes,
            table,
        )
        if not _close(run(probe), expect):
            raise _refuse(s.name, s.fn_name, repr(selector), f"its {key} is not selected by it")
        c, cd = _reduce(table, dims + (comp,))
        return _Param(dims, const=c, const_dims=cd, comp=comp, selector=selector)

    def _param_map(self, plan, s: _Site, key, value, pa, base_values, args, kwargs) -> _Param:
        sites = plan.sites
        dims = self._param_dims(s, key)
        if not pa:
            if s.family in ("MultivariateNormal", "Wishart"):  # matrices keep every axis
                return _Param(dims, const=value, const_dims=dims)
            c, cd = _reduce(value, dims)
            return _Param(dims, const=c, const_dims=cd)
        want = {
            ("Normal", "loc"): "Normal",
            ("Normal", "precision"): "Gamma",
            ("Categorical", "probs"): "Dirichlet",
            ("MultivariateNormal", "loc"): "MultivariateNormal",
            ("MultivariateNormal", "precision"): "Wishart",
        }.get((s.family, key))
        mains = [p for p in pa if sites[p].family != "Categorical"]
        selectors = [p for p in pa if sites[p].family == "Categorical"]
        pa_desc = ", ".join(f"{p!r} ({sites[p].fn_name})" for p in pa)
        if not mains and len(selectors) == 1 and s.family == "Normal":
            return self._selected_constant(
                plan, s, key, dims, selectors[0], base_values, args, kwargs
            )
        if (
            want is None
            or len(mains) != 1
            or len(selectors) > 1
            or sites[mains[0]].family != want
            or (selectors and s.family == "Categorical")
        ):
            raise _refuse(s.name, s.fn_name, pa_desc, f"its {key} is not a conjugate function")
        parent = sites[mains[0]]
        selector = selectors[0] if selectors else None
        p_desc = f"{parent.name!r} ({parent.fn_name})"
        # the parent's event axes, right-aligned with the parameter's trailing axes
        n_ev = parent.event_dim
        if n_ev > len(dims):
            raise _refuse(s.name, s.fn_name, p_desc, "the parent has more axes than the child")
        rename = {d: d for d in parent.dims}
        for j in range(n_ev):
            rename[parent.dims[len(parent.dims) - n_ev + j]] = dims[len(dims) - n_ev + j]
        if parent.family == "MultivariateNormal":  # the second axis of its x xᵀ
            rename[parent.dims[-1] + "b"] = rename[parent.dims[-1]] + "b"
        pdims = tuple(rename[d] for d in parent.dims)
        for d in parent.dims:
            if rename[d] in dims and plan.sizes[d] != plan.sizes[rename[d]]:
                raise _refuse(s.name, s.fn_name, p_desc, f"axis {rename[d]} differs in size")
        missing = [d for d in pdims if d not in dims]
        if len(missing) > 1:
            raise _refuse(s.name, s.fn_name, p_desc, "more than one parent axis is selected")
        comp = missing[0] if missing else None
        if selector and comp is None:
            selector = None  # the site depends on it through another parameter
        param = _Param(dims, parent=parent.name, rename=rename, comp=comp, selector=selector)

        def run(kind, make):
            """Parameter ``key`` of ``s`` with the latent values ``make()`` (one model run
            per kind, shared by every parameter)."""
            if kind not in self._runs:
                values = dict(base_values)
                values.update({sites[n].pyro_name: v for n, v in make().items()})
                tr = self._trace(args, kwargs, values)
                self._runs[kind] = {
                    n: self._params(x, tr.nodes[x.pyro_name]) for n, x in sites.items()
                }
            return self._runs[kind][s.name][key]

        def probes():
            return self._runs["probes"]

        if selector and sites[selector].n_cat != plan.sizes[comp]:
            raise _refuse(s.name, s.fn_name, p_desc, f"{selector!r} has the wrong number of values")
        pshape = [plan.sizes[d] for d in parent.dims]
        wishart = parent.family == "Wishart"

        def gathered(parent_value, sel_value):
            """The parent's value selected (and broadcast) into the parameter's layout."""
            ops = [(parent_value, pdims)]
            if comp is not None and selector is None:
                ops.append((param.index, param.index_dims))
            elif comp is not None:
                z = sites[selector]
                eff = sel_value
                if z.fixed_mask is not None:
                    eff = torch.where(z.fixed_mask, z.fixed.argmax(-1), sel_value)
                oh = torch.nn.functional.one_hot(eff, plan.sizes[comp]).to(value)
                ops.append((oh, z.dims + (comp,)))
            return _ein(dims, ops, dims + ((comp,) if comp else ()), plan.sizes, value)

        def set_coef(c):
            """c of a precision c * tau (c I for a precision matrix: the scalar is kept)."""
            if wishart:
                c = c[..., 0, 0]
                coef, param.coef_dims = _reduce(c, dims[:-2], ulps=8)
                param.coef = _snap(coef)
                return c[..., None, None]
            coef, param.coef_dims = _reduce(c, dims, ulps=8)
            param.coef = _snap(coef)
            return c

        c = None
        if comp is not None and selector is None:
            # a fixed index: c from a run at unit precision, then a component-coded run
            if key == "precision":
                c = set_coef(
                    run(
                        "ones",
                        lambda: {
                            n: self._to_pyro(sites[n], self._unit(plan, sites[n], value))
                            for n in plan.latent
                            if sites[n].family in ("Gamma", "Wishart")
                        },
                    )
                )
            ci = pdims.index(comp)
            code = torch.arange(plan.sizes[comp], dtype=value.dtype, device=value.device)
            code = code.reshape([-1 if i == ci else 1 for i in range(len(pdims))]).expand(pshape)
            coded = code + 1 if key == "precision" else code
            if wishart:
                coded = coded[..., :1] * self._unit(plan, parent, value)
            got = run(
                ("code", parent.name, comp), lambda: {parent.name: self._to_pyro(parent, coded)}
            )
            if key == "precision":
                got = got / c - 1
            if wishart:
                got = got[..., :1, :1].expand(got.shape)
            idx = got.round().long()
            idx, idx_dims = _reduce(idx, dims)
            if key == "probs" or not bool(((idx >= 0) & (idx < plan.sizes[comp])).all()):
                raise _refuse(s.name, s.fn_name, p_desc, "the parent is not selected by an index")
            one_hot = torch.nn.functional.one_hot(idx.clamp(0, plan.sizes[comp] - 1))
            param.index, param.index_dims = one_hot.to(value.dtype), idx_dims + (comp,)
        elif selector is not None and not set(sites[selector].dims) <= set(dims):
            raise _refuse(s.name, s.fn_name, p_desc, f"{selector!r} has axes the child lacks")
        if key == "precision" and c is None:
            # c from the base run (the values first drawn), checked below on random values
            base = gathered(
                self._canon(parent, base_values[parent.pyro_name]),
                None
                if selector is None
                else self._canon(sites[selector], base_values[sites[selector].pyro_name]),
            )
            c = set_coef(value / base)
        # verify the hypothesis on random values of every latent site (one shared run)
        got = run("verify", lambda: {n: self._to_pyro(sites[n], v) for n, v in probes().items()})
        expect = gathered(probes()[parent.name], probes().get(selector))
        if key == "precision":
            expect = expect * c
        if not _close(got, expect):
            raise _refuse(
                s.name, s.fn_name, p_desc, f"its {key} is not a (selected) copy of the parent"
            )
        return param

    @staticmethod
    def _unit(plan: _Plan, s: _Site, ref: torch.Tensor) -> torch.Tensor:
        """Ones for a Gamma site, identity matrices for a Wishart site."""
        shape = [plan.sizes[d] for d in s.dims]
        if s.family == "Wishart":
            eye = torch.eye(shape[-1], dtype=ref.dtype, device=ref.device)
            return eye.expand(shape)
        return ref.new_ones(shape)

    # ================================================================ expectations
    def _stats(self, plan: _Plan, q: dict, name: str) -> tuple:
        """⟨u⟩ of a site in its canonical layout: observed values or the factor's moments."""
        s = plan.sites[name]
        if s.observed:
            return s.stats
        hit = plan.cache.get(name)
        if hit is not None and hit[0] is q[name]:
            return hit[1]
        stats = self._block(s, q[name]).expected_stats()
        plan.cache[name] = (q[name], stats)
        return stats

    @staticmethod
    def _block(s: _Site, params: tuple):
        return _BLOCKS[s.family](*params)

    def _parent_ops(self, plan, q, s, key):
        """Operands of the parameter ``key`` of site ``s``: a list per statistic."""
        p = s.params[key]
        if p.parent is None:
            return None
        stats = self._stats(plan, q, p.parent)
        sd = self._stat_dims(plan.sites[p.parent])
        return [(t, tuple(p.rename[d] for d in dims)) for t, dims in zip(stats, sd, strict=True)]

    def _weights(self, plan, q, s):
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

    def _normal_ops(self, plan, q, s):
        """Operand lists of a Normal site's expected log-density (see :meth:`_normal_terms`)."""
        loc, prec = s.params["loc"], s.params["precision"]
        X1 = X2 = None
        if s.observed or s.name in q:
            x = self._stats(plan, q, s.name)
            X1, X2 = [(x[0], s.dims)], [(x[1], s.dims)]
        mu = self._parent_ops(plan, q, s, "loc")
        if mu is None:
            L1 = [(loc.const, loc.const_dims)]
            L2 = [(_derived(loc, "square"), loc.const_dims)]
        else:
            L1, L2 = [mu[0]], [mu[1]]
        tau = self._parent_ops(plan, q, s, "precision")
        if tau is None:
            c = [(prec.const, prec.const_dims)]
            lnc = [(_derived(prec, "log"), prec.const_dims)]
            T1, T2 = [], None
        else:
            c = [(prec.coef, prec.coef_dims)]
            lnc = [(_derived(prec, "log_coef"), prec.coef_dims)]
            T1, T2 = [tau[0]], [tau[1]]
        M = [] if s.mask is None else [(s.mask, s.mask_dims)]
        W, comp = self._weights(plan, q, s)
        return dict(X1=X1, X2=X2, L1=L1, L2=L2, c=c, lnc=lnc, T1=T1, T2=T2, M=M, W=W, comp=comp)

    def _normal_loglik(self, plan, o, out, weights):
        """E ln N(x | m, c τ) summed over the site's axes into ``out``:
        ½(ln c + ⟨ln τ⟩) − ½ ln 2π − ½ c⟨τ⟩(⟨x²⟩ − 2⟨x⟩⟨m⟩ + ⟨m²⟩) (PRML eq. 10.46 per axis)."""
        over, ref = o["over"], plan.ref
        mw = o["M"] + weights
        pr = mw + o["c"] + o["T1"]

        def e(ops):  # broadcastable: terms without the data's axes stay small
            return _ein(out, ops, over, plan.sizes, ref, expand=False)

        small = 0.5 * e(mw + o["lnc"]) - 0.5 * LOG_2PI * e(mw)
        if o["T2"] is not None:
            small = small + 0.5 * e(mw + o["T2"])
        small = small - 0.5 * e(pr + o["L2"])
        res = e(pr + o["X1"] + o["L1"]) - 0.5 * e(pr + o["X2"]) + small
        return res.expand([plan.sizes[d] for d in out])

    def _mvn_ops(self, plan, q, s):
        """Operand lists of a MultivariateNormal site: E ln N(x | m, c Λ) per vector is
        ½(D ln c + ⟨ln|Λ|⟩) − (D/2) ln 2π − ½ c tr(⟨Λ⟩(⟨x xᵀ⟩ − 2⟨x⟩⟨m⟩ᵀ + ⟨m mᵀ⟩))
        (PRML eq. 10.64-10.71, Winn & Bishop Table 2)."""
        e = s.dims[-1]
        eb = e + "b"

        def to_b(dims):
            return tuple(eb if d == e else d for d in dims)

        o = dict(X1=None, X1b=None, X2=None)
        if s.observed or s.name in q:
            x = self._stats(plan, q, s.name)
            o.update(X1=[(x[0], s.dims)], X1b=[(x[0], to_b(s.dims))], X2=[(x[1], s.dims + (eb,))])
            if s.observed:  # x xᵀ as two operands: never materialised, [N, D, D] per task
                o["X2"] = o["X1"] + o["X1b"]
        mu = self._parent_ops(plan, q, s, "loc")
        if mu is None:
            m = s.params["loc"].const
            mm = m.unsqueeze(-1) * m.unsqueeze(-2)
            o.update(L1=[(m, s.dims)], L1b=[(m, to_b(s.dims))], L2=[(mm, s.dims + (eb,))])
        else:
            o.update(L1=[mu[0]], L1b=[(mu[0][0], to_b(mu[0][1]))], L2=[mu[1]])
        prec = s.params["precision"]
        lam = self._parent_ops(plan, q, s, "precision")
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
        o["W"], o["comp"] = self._weights(plan, q, s)
        o["over"] = s.dims[:-1] + ((o["comp"],) if o["comp"] else ())
        o["eb"] = eb
        return o

    def _mvn_loglik(self, plan, o, out, weights):
        mw = o["M"] + weights

        def e(ops):
            return _ein(out, ops, o["over"], plan.sizes, plan.ref)

        d = plan.sizes[o["eb"]]
        total = -0.5 * d * LOG_2PI * e(mw)
        for ld in o["ldet"]:
            total = total + 0.5 * e(mw + ld)
        lam = mw + o["Lam"]
        quad = e(lam + o["X2"]) - 2 * e(lam + o["X1"] + o["L1b"]) + e(lam + o["L2"])
        return total - 0.5 * quad

    # ================================================================ ELBO
    def _site_elbo(self, plan: _Plan, q: dict, name: str) -> torch.Tensor:
        """E_q[ln p(x_site | pa)] [T]."""
        s, out = plan.sites[name], (TASKS,)
        if s.family == "Normal":
            hit = plan.cache.get(("loglik", name))
            if hit is not None and all(a is q[n] for n, a in zip(hit[0], hit[1], strict=True)):
                # Σ_k r_nk E ln N(x_n | θ_k), from the message just sent to the selector
                _, _, loglik, dims, selector = hit
                ops = [(q[selector][0], dims), (loglik, dims)]
                return _ein(out, ops, dims, plan.sizes, plan.ref)
            o = self._normal_ops(plan, q, s)
            o["over"] = s.dims + ((o["comp"],) if o["comp"] else ())
            return self._normal_loglik(plan, o, out, o["W"])
        if s.family == "MultivariateNormal":
            o = self._mvn_ops(plan, q, s)
            return self._mvn_loglik(plan, o, out, o["W"])
        if s.family == "Categorical":
            R = self._stats(plan, q, name)[0]
            cd = s.dims + (f"{s.name}#cat",)
            pi = self._parent_ops(plan, q, s, "probs")
            if pi is None:
                p = s.params["probs"]
                pi = [(_derived(p, "log_probs"), p.const_dims)]
            M = [] if s.mask is None else [(s.mask, s.mask_dims)]
            return _ein(out, M + [(R, cd)] + pi, cd, plan.sizes, plan.ref)
        # E ln p = Σ_i η_i·⟨u_i⟩ − A(η) with η and Σ A fixed (computed once per plan)
        block, eta, a_total = self._prior(plan, s)
        lp = 0
        for t, u, n in zip(eta, self._stats(plan, q, name), block._stat_dims, strict=True):
            lp = lp + expfam.families._sum_last(t * u, n)
        return self._sum_tasks(expfam.families._sum_last(lp, block.event_dim)) - a_total

    def _prior(self, plan: _Plan, s: _Site) -> tuple:
        """The fixed prior block of a Gamma, Dirichlet or Wishart site (full layout), its
        natural parameters and its log-normaliser summed per task, cached in the plan."""
        hit = plan.cache.get(("prior", s.name))
        if hit is None:
            block = self._prior_block(plan, s)
            hit = (block, block.natural(), self._sum_tasks(block.log_normalizer()))
            plan.cache[("prior", s.name)] = hit
        return hit

    def _prior_block(self, plan: _Plan, s: _Site):
        """The fixed prior of a Gamma or Dirichlet site, in its full layout."""
        full = [
            _ein(p.dims, [(p.const, p.const_dims)], (), plan.sizes, p.const)
            for p in s.params.values()
        ]
        return self._block(s, tuple(full))

    @staticmethod
    def _sum_tasks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1).sum(-1) if t.dim() > 1 else t

    def elbo(self, state: VMPState) -> torch.Tensor:
        """The analytic ELBO [T]: Σ_sites E ln p(x | pa) + Σ_latent H[q] (Winn & Bishop §3.3)."""
        return self._elbo(state.plan, state.q)

    def _elbo(self, plan: _Plan, q: dict) -> torch.Tensor:
        total, no_site, no_entropy = 0, set(), set()
        for name in plan.latent:  # Categorical factors just updated (see _lse_applies)
            hit = plan.cache.get(("lse", name))
            if hit is not None and hit[0] is q[name][0]:
                if all(q[n] is v for n, v in hit[2]):
                    total = total + hit[1]
                    no_site.update([name] + [c for c, _ in plan.children[name]])
                    no_entropy.add(name)
        for name, s in plan.sites.items():
            if name not in no_site:
                total = total + self._site_elbo(plan, q, name)
            if not s.observed and name not in no_entropy:
                total = total + self._sum_tasks(self._entropy(plan, q, name))
        return total

    @staticmethod
    def _lse_applies(plan: _Plan, s: _Site) -> bool:
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

    def _entropy(self, plan: _Plan, q: dict, name: str) -> torch.Tensor:
        """H[q] = A − η·⟨u⟩ with the cached ⟨u⟩ (a Categorical's own form keeps 0 ln 0 = 0)."""
        s = plan.sites[name]
        block = self._block(s, q[name])
        if s.family == "Categorical":
            return block.entropy()
        return -block.expected_log_prob(self._stats(plan, q, name))

    # ================================================================ updates
    def _natural(self, plan: _Plan, q: dict, name: str, children: bool = True) -> tuple:
        """η* of a latent site: its prior's expected natural parameter plus (``children``)
        its children's messages (spec §1)."""
        s, sizes = plan.sites[name], plan.sizes
        if s.family == "Normal":
            o = self._normal_ops(plan, q, s)
            o["over"] = s.dims + ((o["comp"],) if o["comp"] else ())
            pr = o["W"] + o["c"] + o["T1"]
            eta1 = _ein(s.dims, pr + o["L1"], o["over"], sizes, plan.ref)
            eta2 = -0.5 * _ein(s.dims, pr, o["over"], sizes, plan.ref)
            eta = [eta1, eta2]
        elif s.family == "Categorical":
            cd = s.dims + (f"{s.name}#cat",)
            pi = self._parent_ops(plan, q, s, "probs")
            if pi is None:
                p = s.params["probs"]
                pi = [(_derived(p, "log_probs"), p.const_dims)]
            eta = [_ein(cd, pi, cd, sizes, plan.ref)]
        elif s.family == "MultivariateNormal":
            o = self._mvn_ops(plan, q, s)
            lam = o["W"] + o["Lam"]
            eta1 = _ein(s.dims, lam + o["L1b"], o["over"], sizes, plan.ref)
            eta2 = -0.5 * _ein(s.dims + (o["eb"],), lam, o["over"], sizes, plan.ref)
            eta = [eta1, eta2]
        else:
            natural = self._prior(plan, s)[1]
            eta = [
                t.expand([sizes[d] for d in dims])
                for t, dims in zip(natural, self._stat_dims(s), strict=True)
            ]
        for child, role in plan.children[name] if children else ():
            for i, m in enumerate(self._message(plan, q, child, role, s)):
                eta[i] = eta[i] + m
        return tuple(eta)

    def _message(self, plan, q, child: str, role: str, to: _Site) -> list:
        """m_{child → to}: the coefficients of u(to) in E ln p(child | pa) (spec §2 table)."""
        c, sizes, ref = plan.sites[child], plan.sizes, plan.ref
        if c.family == "Categorical":  # role probs, to a Dirichlet
            p = c.params["probs"]
            cd = c.dims + (f"{c.name}#cat",)
            out = tuple(p.rename[d] for d in to.dims)
            M = [] if c.mask is None else [(c.mask, c.mask_dims)]
            R = self._stats(plan, q, child)[0]
            return [_ein(out, M + [(R, cd)], cd, sizes, ref)]
        if c.family == "MultivariateNormal":
            return self._mvn_message(plan, q, c, role, to)
        o = self._normal_ops(plan, q, c)
        o["over"] = c.dims + ((o["comp"],) if o["comp"] else ())
        mw = o["M"] + o["W"]
        if role == "select":
            out = to.dims + (o["comp"],)
            loglik = self._normal_loglik(plan, o, out, [])
            # cached for the ELBO once q(z) is updated: valid while the other factors stay
            names = [p.parent for p in c.params.values() if p.parent]
            names += [] if c.observed else [child]
            plan.cache[("loglik", child)] = (names, [q[n] for n in names], loglik, out, to.name)
            return [loglik]
        p = c.params[role]
        out = tuple(p.rename[d] for d in to.dims)

        def e(ops):
            return _ein(out, ops, o["over"], sizes, ref)

        if role == "loc":
            pr = mw + o["c"] + o["T1"]
            return [e(pr + o["X1"]), -0.5 * e(pr)]
        cc = mw + o["c"]  # role precision, to a Gamma
        quad = e(cc + o["X2"]) - 2 * e(cc + o["X1"] + o["L1"]) + e(cc + o["L2"])
        return [-0.5 * quad, 0.5 * e(mw)]

    def _mvn_message(self, plan, q, c: _Site, role: str, to: _Site) -> list:
        """Messages of a MultivariateNormal child: to its mean (⟨cΛ⟩⟨x⟩, −⟨cΛ⟩/2), to its
        Wishart precision (−c⟨(x − m)(x − m)ᵀ⟩/2, 1/2), to its selector E ln N per component."""
        o = self._mvn_ops(plan, q, c)
        sizes, ref = plan.sizes, plan.ref
        if role == "select":
            return [self._mvn_loglik(plan, o, to.dims + (o["comp"],), [])]
        p = c.params[role]
        out1, out2 = (tuple(p.rename[d] for d in dims) for dims in self._stat_dims(to))
        mw = o["M"] + o["W"]

        def e(out, ops):
            return _ein(out, ops, o["over"], sizes, ref)

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

    def _update(self, plan: _Plan, q: dict, name: str, children: bool = True) -> tuple:
        s = plan.sites[name]
        eta = self._natural(plan, q, name, children)
        if s.family == "Categorical":
            m = eta[0].amax(-1, keepdim=True)  # softmax, fewer passes than torch's
            r = (eta[0] - m).exp_()
            z = r.sum(-1, keepdim=True)
            r = r.div_(z)
            if s.fixed_mask is not None:
                r = torch.where(s.fixed_mask.unsqueeze(-1), s.fixed, r)
            elif children and self._lse_applies(plan, s):
                lse = self._sum_tasks((m + z.log()).squeeze(-1))
                others = [(n, q[n]) for n in plan.latent if n != name]
                plan.cache[("lse", name)] = (r, lse, others)
            return (r,)
        b = _BLOCKS[s.family].from_natural(*eta)
        return tuple(getattr(b, f) for f in _FIELDS[s.family])

    # ================================================================ engine API
    def init(self, *args: Any, init_resp: dict | None = None, **kwargs: Any) -> VMPState:
        """Derive the plan, initialise the factors (module docstring) and compute the ELBO.

        ``init_resp`` maps latent Categorical site names to initial probabilities in the
        site's Pyro shape plus the category axis (observed entries are reset to one-hot).
        """
        plan = self.compile(*args, **kwargs)
        sizes, ref = plan.sizes, plan.ref
        init_resp = dict(init_resp or {})
        q: dict = {}
        for name in plan.latent:
            s = plan.sites[name]
            if s.family != "Categorical":
                continue
            shape = [sizes[d] for d in s.dims] + [s.n_cat]
            if name in init_resp:
                r = self._canon(s, init_resp.pop(name).to(ref).expand(*s.batch_shape, s.n_cat))
                if tuple(r.shape) != tuple(shape) or not bool(torch.isfinite(r).all()):
                    raise ValueError(f"init_resp[{name!r}] must be finite with shape {shape}")
            else:
                # drawn on the CPU generator (the same numbers on every device), then moved
                g = torch.Generator().manual_seed(self.seed)
                noise = torch.rand(shape[1:], generator=g, dtype=torch.float64, device=g.device)
                r = (1 + 0.1 * noise.to(ref)).expand(shape)
            r = r / r.sum(-1, keepdim=True)
            if s.fixed_mask is not None:
                r = torch.where(s.fixed_mask.unsqueeze(-1), s.fixed, r)
            q[name] = (r,)
        if init_resp:
            raise ValueError(f"init_resp names no latent Categorical site: {sorted(init_resp)}")
        others = [n for n in plan.latent if plan.sites[n].family != "Categorical"]
        for name in others:  # priors first, then one update from the responsibilities
            q[name] = self._update(plan, q, name, children=False)
        for name in others:
            q[name] = self._update(plan, q, name)
        objective = self._elbo(plan, q)
        _MEMO.clear()
        return VMPState(plan, q, objective)

    def step(self, state: VMPState) -> tuple[VMPState, Info]:
        """One sweep: every latent site's coordinate update, in order, then the ELBO.

        No host synchronisation; convergence and freezing are :func:`run`'s (:meth:`keep`).
        """
        plan, q = state.plan, dict(state.q)
        _MEMO.clear()
        for name in plan.latent:
            q[name] = self._update(plan, q, name)
        objective = self._elbo(plan, q)
        _MEMO.clear()
        return VMPState(plan, q, objective), Info(objective)

    def keep(self, frozen: torch.Tensor, old: VMPState, new: VMPState) -> VMPState:
        """``new`` with the factors and ELBO of the ``frozen`` tasks ([T] bool) from ``old``.

        Every factor parameter leads with the tasks axis (the canonical layout), so each is
        one ``torch.where``; the plan (data, fixed parameters, caches) is shared by every
        state of a fit and is never touched.
        """

        def where(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.where(frozen.reshape(-1, *[1] * (b.dim() - 1)), a, b)

        q = {
            name: tuple(where(a, b) for a, b in zip(old.q[name], params, strict=True))
            for name, params in new.q.items()
        }
        return VMPState(new.plan, q, where(old.objective, new.objective))

    def fit(
        self, *args: Any, init_resp: dict | None = None, **kwargs: Any
    ) -> tuple[VMPState, RunInfo]:
        """``init``, then :func:`probfsl.inference.base.run` for up to ``max_iter`` sweeps.

        With ``tol > 0`` a task that has converged is frozen (masked: its factors stop
        changing, the batch keeps its size), so every task gets the result it would get
        alone; the loop ends once every task has converged, checked after ``check_every``
        sweeps and then at gaps growing by ``check_growth``. Returns the final state and
        the :class:`~probfsl.inference.base.RunInfo` (ELBO trace, sweeps per task,
        converged).
        """
        state = self.init(*args, init_resp=init_resp, **kwargs)
        tol = self.tol if self.tol > 0 else None
        return run(self, state, self.max_iter, tol, self.check_every, self.check_growth)

    def posterior(self, state: VMPState) -> dict[str, torch.distributions.Distribution]:
        """Site name -> the factor q as a batched distribution in the model's shape."""
        out = {}
        for name in state.plan.latent:
            s = state.plan.sites[name]
            params = state.q[name]
            p = [self._uncanon(s, t) for t in params]
            p = [t.expand(*s.batch_shape, *t.shape[len(s.batch_shape) :]) for t in p]
            if s.family == "MultivariateNormal":
                d = dist.MultivariateNormal(p[0], precision_matrix=p[1])
            elif s.family == "Wishart":
                d = dist.Wishart(p[0], covariance_matrix=p[1])
            elif s.family == "Normal":
                d = dist.Normal(p[0], p[1].rsqrt())
            elif s.family == "Gamma":
                d = dist.Gamma(p[0], p[1])
            elif s.family == "Dirichlet":
                d = dist.Dirichlet(p[0])
            else:
                d = dist.Categorical(probs=p[0])
            ev = s.event_dim - {"Dirichlet": 1, "MultivariateNormal": 1, "Wishart": 2}.get(
                s.family, 0
            )
            out[name] = d.to_event(ev) if ev else d
        return out

    def guide(self, state: VMPState) -> Callable[..., None]:
        """A Pyro guide with the model's signature sampling every latent site from q."""
        post = self.posterior(state)
        plan = state.plan

        def guide(*args, **kwargs) -> None:
            frames = {f.name: f for n in plan.latent for f in plan.sites[n].frames}
            plates = {k: pyro.plate(k, f.size, dim=f.dim) for k, f in frames.items()}
            for name in plan.latent:
                s = plan.sites[name]
                d = post[name]
                if s.fixed_mask is not None:
                    d = d.mask(self._uncanon(s, ~s.fixed_mask).expand(s.batch_shape))
                with contextlib.ExitStack() as stack:
                    for f in s.frames:
                        stack.enter_context(plates[f.name])
                    pyro.sample(s.pyro_name, d)

        return guide


_FIELDS = {
    "MultivariateNormal": ("loc", "precision"),
    "Wishart": ("df", "scale"),
    "Normal": ("loc", "precision"),
    "Gamma": ("shape", "rate"),
    "Dirichlet": ("concentration",),
    "Categorical": ("probs",),
}


#: which parent families may enter each parameter (Categorical: as a selector)
_ROLES = {
    ("Normal", "loc"): ("Normal", "Categorical"),
    ("Normal", "precision"): ("Gamma", "Categorical"),
    ("Categorical", "probs"): ("Dirichlet", "Categorical"),
    ("MultivariateNormal", "loc"): ("MultivariateNormal", "Categorical"),
    ("MultivariateNormal", "precision"): ("Wishart", "Categorical"),
}

_BLOCKS = {
    "MultivariateNormal": expfam.MultivariateNormal,
    "Wishart": expfam.Wishart,
    "Normal": expfam.Normal,
    "Gamma": expfam.Gamma,
    "Dirichlet": expfam.Dirichlet,
    "Categorical": expfam.Categorical,
}
