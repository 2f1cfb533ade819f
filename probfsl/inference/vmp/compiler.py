"""The VMP compiler: a Pyro model and its data read into a
:class:`~probfsl.inference.vmp.layout.Plan`.

One trace gives the sites, their plates and distributions (:meth:`Compiler.compile`),
with every latent site at a value of the compiler's own (:func:`draw`, away from the
edges of its support; never a draw from the site's prior, which for a vague Gamma
underflows to 0); Pyro's provenance tracking (``pyro.infer.inspect.get_dependencies``)
gives each site's parents; one run of the model with every latent site at another such value
(``poutine.condition``) shows which parameters they move, and how a parent enters a
parameter is then verified on those values: a location must equal the parent's value
(broadcast over the child's extra axes, the parent's event axes right-aligned with the
child's), a precision must equal c·(parent) with c fixed (c is read off the form the
first run computes it in: :mod:`~probfsl.inference.vmp.monomials`), a Categorical's
probabilities must equal the Dirichlet parent. A parent plate missing from the child is
a mixture component axis, selected by a latent Categorical site or by a fixed index (the
component of each entry carried from the parent by the model's indexing). Anything else
is refused (:func:`~probfsl.inference.vmp.checks.refuse`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.poutine.messenger import Messenger

from probfsl.inference.vmp import at_prior, branches
from probfsl.inference.vmp.checks import (
    all_finite,
    check_data,
    check_parameters,
    close,
    data_device,
    data_dtype,
    refuse,
    support_holds,
    support_refusal,
    unwrap,
)
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import REGISTRY, Family, lookup, of_distribution
from probfsl.inference.vmp.layout import (
    TASKS,
    BilinearTerm,
    LinearTerm,
    Param,
    Plan,
    Site,
    canon,
    dtype_of,
    param_dims,
    reduce_constant,
    to_pyro,
    unit,
)
from probfsl.inference.vmp.monomials import Monomial, coefficient, origin, plain
from probfsl.inference.vmp.selection import select

#: parameters that are c · parent (c fixed) rather than a copy of the parent
SCALED = ("precision", "rate")


def _roles(family: str, key: str) -> tuple[str, ...]:
    """The families of the parents parameter ``key`` of a ``family`` site may take."""
    return lookup(family).roles.get(key, ())


def _point_family(constraint) -> Family | None:
    """The family a ``pyro.param`` of ``constraint`` is traced as (positive -> Gamma, real
    -> Normal, simplex -> Dirichlet, unit_interval -> Beta)."""
    return next((f for f in REGISTRY.values() if f.point_constraint is constraint), None)


def _shared_point(name: str, want: tuple | None = None) -> ValueError:
    shape = (
        "" if want is None else f"; give it the batch shape {want} (or declare it inside the plate)"
    )
    return ValueError(
        f"VMP cannot point-estimate the pyro.param site {name!r}: it needs one value per "
        f"task, an axis of the tasks' length where the {TASKS!r} plate puts it (a parameter "
        f"shared by every task would couple the tasks){shape}"
    )


def _model_failed(err: Exception, args: tuple, kwargs: dict) -> ValueError:
    """The error of a model that fails on the user's inputs, naming integer or bool data
    (a frequent cause: Pyro's densities of continuous and Bernoulli sites need floats)."""
    ints = [
        i
        for i, a in enumerate((*args, *kwargs.values()))
        if torch.is_tensor(a) and not a.is_floating_point()
    ]
    hint = (
        f"; argument(s) {ints} are integer or bool tensors: the data of a continuous or "
        "Bernoulli site must be float32 or float64 (a Categorical site's labels must lie in "
        "its support, also where obs_mask hides them)"
        if ints
        else ""
    )
    return ValueError(f"the model failed on these inputs: {err}{hint}")


class _StartAt(Messenger):
    """Gives the lifted ``pyro.param`` sites their initial values (unless a run sets them),
    so that every trace sees the model's own starting point."""

    def __init__(self, values: dict) -> None:
        super().__init__()
        self.values = values

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.values and msg["value"] is None:
            msg["value"] = self.values[msg["name"]]


def draw(family: str, shape: list, n_cat: int = 0, generator=None) -> torch.Tensor:
    """A value of a latent site of ``family`` and ``shape`` away from the edges of its
    support (float64 or int64, on the CPU): what the compiler reads the model at. A draw
    from the site's prior will not do: a vague Gamma(0.01, 0.01) puts most of its mass
    below 1e-30 and underflows to 0, and the parameter maps read off such values are
    wrong (:meth:`~probfsl.inference.vmp.family.Family.draw`)."""
    return lookup(family).draw(shape, n_cat, generator)


class _DrawLatent(Messenger):
    """Gives every latent site of a supported family a :func:`draw` from its own stream
    (``seed``; the verifying run's values come from another), on the device of the site's
    parameters and in ``dtype`` (the data's; else the parameters'), instead of a draw from
    its prior. The plan so does not depend on the user's random stream, and torch's
    samplers are spared (from the prior probabilities of a Categorical, a tenth of the
    plan derivation on 1,000 mixture tasks). With ``symbolic``, a Gamma or Wishart site's
    value (drawn, or a point estimate's) is a :class:`~probfsl.inference.vmp.monomials.Monomial`,
    so that the precisions and rates it enters carry their form c · τ. With ``pattern``
    (``"high"`` or ``"low"``), every site takes a value at one end of its support instead
    (:func:`~probfsl.inference.vmp.branches.extreme`)."""

    def __init__(
        self,
        seed: int,
        dtype: torch.dtype | None = None,
        symbolic: bool = False,
        pattern: str | None = None,
    ):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype, self.symbolic, self.pattern = dtype, symbolic, pattern

    def _pyro_sample(self, msg) -> None:
        if msg["is_observed"]:
            return
        base, _ = unwrap(msg["fn"])
        record = of_distribution(base)
        if msg["value"] is None:
            self._draw(msg, base, record)
        value = msg["value"]
        if self.symbolic and record is not None and record.symbolic and torch.is_tensor(value):
            msg["value"] = Monomial.of(value, msg["name"])

    def _draw(self, msg, base, record: Family | None) -> None:
        if record is None or record.observed_only:
            return  # left to the model's sampler; the compiler refuses the site later
        like = record.reference(base)
        if like is None or not like.is_floating_point():
            return  # the model's sampler decides (and fails on integer parameters)
        n_cat = record.categories(base)
        shape = list(msg["fn"].shape())
        value = None if self.pattern is None else record.extreme(shape, n_cat, self.pattern)
        if value is None:
            value = record.draw(shape, n_cat, self.generator)
        if value.is_floating_point():
            msg["value"] = value.to(device=like.device, dtype=self.dtype or like.dtype)
        else:
            msg["value"] = value.to(like.device)


def _nearby(family: str, key: str) -> str:
    hint = lookup(family).hints.get(key)
    return f"; its {key} may be {hint}" if hint else ""


#: autograd nodes that keep a map affine in its input
_AFFINE_NODES = (
    "Add",
    "Sub",
    "Neg",
    "Mul",
    "Div",
    "Sum",
    "Mean",
    "MatMul",
    "Mm",
    "Bmm",
    "Mv",
    "Dot",
    "Expand",
    "View",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Permute",
    "Transpose",
    "T",
    "Index",
    "Select",
    "Slice",
    "Cat",
    "Stack",
    "Clone",
    "ToCopy",
    "Unsafe",
    "AsStrided",
    "Alias",
)


def _through(value: torch.Tensor, leaf: torch.Tensor) -> str:
    """The operations on the paths from ``leaf`` to ``value`` that are not affine (``exp``,
    ``pow``, ...), read off the autograd graph, for a refusal to name."""
    reaches: dict = {}

    def visit(node) -> bool:
        if node is None:
            return False
        if node not in reaches:
            reaches[node] = False  # a graph has no cycles; this guards the recursion
            hit = getattr(node, "variable", None) is leaf
            reaches[node] = any([visit(child) for child, _ in node.next_functions]) or hit
        return reaches[node]

    visit(value.grad_fn)
    names = {
        type(node).__name__.removesuffix("Backward0").removesuffix("Backward1")
        for node, hit in reaches.items()
        if hit and type(node).__name__ != "AccumulateGrad"
    }
    found = sorted(n.lower() for n in names if not n.startswith(_AFFINE_NODES))
    return ", ".join(found) or "a non-affine function"


def _matches(got: torch.Tensor, expect: torch.Tensor, rounding: torch.Tensor | None = None) -> bool:
    """Whether a parameter's random-value run agrees with the map read off the model
    (relative 1e-5, absolute 1e-6 of its largest entry), up to ``rounding`` per entry
    where given (the error bound of a sum of many terms, n ε Σ|terms|: a float32 map
    contracting hundreds of coefficients rounds by more than 1e-5)."""
    scale = got.abs().amax() if got.numel() else got.new_ones(())
    if rounding is None:
        return close(got, expect, rtol=1e-5, atol=1e-6 * float(scale))
    bound = 1e-5 * expect.abs() + 1e-6 * scale + rounding
    return bool(((got - expect).abs() <= bound).all())


def _first_task(args: tuple, kwargs: dict, n_tasks: int | None = None) -> tuple | None:
    """The arguments sliced to the first task: every tensor whose leading axis has the
    tasks' length (that of the first tensor argument unless ``n_tasks``); ``None`` when
    there is one task or none."""
    if n_tasks is None:
        n_tasks = next((a.shape[0] for a in (*args, *kwargs.values()) if _batched(a)), 1)
    if n_tasks <= 1:
        return None

    def first(a):
        return a[:1] if _batched(a) and a.shape[0] == n_tasks else a

    return tuple(map(first, args)), {k: first(v) for k, v in kwargs.items()}


def _batched(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dim() > 0


def _tempering(scale: Any, family: str, observed: bool) -> float | None:
    """The factor of a site's ``poutine.scale``: 1.0 without one; a positive finite number
    on a latent Categorical site (a tempered prior: its E ln p enters the bound, its
    factor's update and its messages times the factor, through the site's mask); None
    (refused) otherwise."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            return None
        scale = float(scale)  # a trace-time read, once per compilation
    if scale == 1.0:
        return 1.0
    if not lookup(family).labels or observed or not (0 < scale < float("inf")):
        return None
    return float(scale)


class Compiler:
    """Reads one model's plan for given data (the module docstring); ``order`` is the
    latent sites' update order (default: the model's declaration order)."""

    def __init__(self, model: Callable[..., Any], order: list[str] | None = None) -> None:
        self.model, self.order = model, order
        self._runs: dict = {}  # parameters of every site under probe values, per kind
        self.points: dict[str, torch.Tensor] = {}  # pyro.param name -> initial value
        self._dtype: torch.dtype | None = None  # the data's floating dtype (data_dtype)

    def _lift(self, params: dict) -> None:
        """Trace each ``pyro.param`` site from now on as a sample site of the family its
        constraint names (``poutine.lift`` with a placeholder law that only gives it shape
        and support): positive -> Gamma (a precision or rate), real -> Normal (a location),
        simplex -> Dirichlet, unit_interval -> Beta. The sweeps never use the placeholder:
        a point site's update is the maximiser of its children's terms (VMP design §7.2)."""
        prior = {}
        for name, node in params.items():
            value = node["value"].detach()
            if self._dtype is not None and value.is_floating_point():
                value = value.to(self._dtype)  # the data's dtype, as every parameter
            constraint = node["kwargs"].get("constraint", constraints.real)
            family = _point_family(constraint)
            if family is None:
                raise ValueError(
                    f"VMP cannot point-estimate the pyro.param site {name!r}: its constraint "
                    f"{constraint} is none of positive (a precision or rate), real (a "
                    "location), simplex (probabilities) or unit_interval (a probability)"
                )
            law = family.placeholder(value)
            # a Dirichlet's last axis is its own event
            event_dim = (node["kwargs"].get("event_dim") or 0) - family.event_rank
            prior[name] = law.to_event(event_dim) if event_dim > 0 else law
            self.points[name] = value
        self.model = _StartAt(self.points)(poutine.lift(self.model, prior=prior))

    def _trace(self, args, kwargs, values=None, grad=False, seed=0, symbolic=False, pattern=None):
        """One run of the model: its latent sites at ``values`` (conditioned), or drawn
        from the stream ``seed`` (:class:`_DrawLatent`, ``symbolic`` or not, at the
        ``pattern`` of extremes if given; the verifying probes use 2)."""
        if values is None:
            model = _DrawLatent(seed, self._dtype, symbolic, pattern)(self.model)
        else:
            model = poutine.condition(self.model, data=values)
        with torch.set_grad_enabled(grad), data_device(args, kwargs):
            return poutine.trace(model).get_trace(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> Plan:
        """Read the model's sites, parents and parameter maps (module docstring).

        The model runs with an empty Pyro parameter store (``pyro.param`` sites take the
        initial values the model gives them; the user's store is left as it was)."""
        with pyro.get_param_store().scope():
            return self._compile(args, kwargs)

    def _compile(self, args: tuple, kwargs: dict) -> Plan:
        check_data(args, kwargs)
        self._dtype = data_dtype(args, kwargs)
        try:  # parameters are checked below, naming the site (Pyro's check names none)
            with pyro.validation_enabled(False):
                trace = self._trace(args, kwargs, symbolic=True)
        except (NotImplementedError, RuntimeError, ZeroDivisionError) as err:
            raise _model_failed(err, args, kwargs) from None
        params = {n: s for n, s in trace.nodes.items() if s["type"] == "param"}
        if params:  # point estimates: traced as sample sites of their family from now on
            self._lift(params)
            with pyro.validation_enabled(False):
                trace = self._trace(args, kwargs, symbolic=True)
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
        check_parameters(raw)
        self._check_structure(trace, args, kwargs)
        ref = next((plain(s["value"]) for s in raw if s["value"].is_floating_point()), None)
        if ref is None:  # every value discrete: the first floating parameter's dtype
            ref = torch.zeros((), dtype=dtype_of(trace), device=raw[0]["value"].device)
        sizes: dict[str, int] = {}
        sites: dict[str, Site] = {}
        for s in raw:
            name = s["name"]
            if name.endswith("_observed") and name[:-9] + "_unobserved" in trace.nodes:
                continue  # merged with its ``_unobserved`` twin below
            site = self._read_site(s, trace, sizes)
            sites[site.name] = site
        latent = [n for n, s in sites.items() if not s.observed]
        # variational EM: the factors (E-step) before the point estimates (M-step), so that
        # the first sweep reads the model's initial values of the parameters
        latent = [n for n in latent if not sites[n].point] + [n for n in latent if sites[n].point]
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
        plan = Plan(sites, latent, sizes, {n: [] for n in latent}, ref)
        self._find_parents(plan, trace, args, kwargs)
        self._check_counts(plan)
        for p in (p for s in sites.values() for p in s.params.values() if p.coef is not None):
            p.unit_coef = bool((p.coef == 1).all())
        self._find_chains(plan)
        at_prior.check(plan)
        runs, one_task = getattr(self, "_probe_runs", ([], False))
        self._probe_runs = ([], False)  # the traces are not kept with the compiler
        with torch.no_grad():
            branches.check(plan, runs, one_task, self._params, self._dtype)
        for name in self.points:
            roles = {role for _, role in plan.children[name]}
            if not roles:
                raise ValueError(
                    f"VMP cannot point-estimate the pyro.param site {name!r}: no site uses it "
                    "as a parameter"
                )
            if "concentration" in roles and len(roles) > 1:
                raise ValueError(
                    f"VMP cannot point-estimate the pyro.param site {name!r}: it is a "
                    "Dirichlet's concentration and also enters other sites"
                )
        return plan

    def _read_site(self, s: dict, trace, sizes: dict) -> Site:
        name, fn = s["name"], s["fn"]
        base, mask = unwrap(fn)
        record = of_distribution(base)
        family = None if record is None else record.name
        merged = name.endswith("_unobserved") and name[:-11] + "_observed" in trace.nodes
        logical = name[:-11] if merged else name
        fname = type(base).__name__
        if family is None:
            raise refuse(logical, fname, "-", f"{fname} is not a supported family")
        scale = _tempering(s["scale"], family, bool(s["is_observed"]) and not merged)
        if scale is None:
            raise refuse(
                logical,
                fname,
                "-",
                "poutine.scale is supported only as one positive number on a latent "
                "Categorical site (a tempered prior)",
            )
        frames = [f for f in s["cond_indep_stack"] if f.vectorized]
        batch_shape = tuple(fn.batch_shape)
        if TASKS not in [f.name for f in frames] and logical in self.points:
            frames = frames + self._tasks_frame_of_point(logical, trace, batch_shape)
        if TASKS not in [f.name for f in frames]:
            raise refuse(logical, fname, "-", f"the site has no batched {TASKS!r} plate")
        by_dim = {f.dim: f for f in frames}
        keep, dims = [], []
        for i, size in enumerate(batch_shape):
            f = by_dim.get(i - len(batch_shape))
            if f is not None:
                keep.append(i)
                dims.append(f.name)
                sizes[f.name] = f.size
            elif size != 1:
                at = i - len(batch_shape)
                raise refuse(
                    logical,
                    fname,
                    "-",
                    f"its batch axis at dim {at} (size {size}, batch shape "
                    f"{tuple(batch_shape)}) is not declared by a plate; declare a plate of "
                    f"size {size} at dim={at} around the site, or move the axis into the "
                    "event shape with .to_event()",
                )
        try:
            full = torch.broadcast_shapes(s["value"].shape, batch_shape + tuple(fn.event_shape))
        except RuntimeError:
            raise refuse(logical, fname, "-", "its value does not fit its distribution") from None
        if tuple(full[: len(batch_shape)]) != batch_shape:
            raise refuse(logical, fname, "-", "its value has more batch axes than its distribution")
        event_shape = tuple(full[len(batch_shape) :])
        if logical in self.points:  # its own value, not the plate's broadcast, per task
            at = next(i for i in keep if by_dim[i - len(batch_shape)].name == TASKS)
            own = (1,) * (len(full) - s["value"].dim()) + tuple(s["value"].shape)
            if own[at] != sizes[TASKS]:
                raise _shared_point(logical)
        for j, size in enumerate(event_shape):
            dims.append(f"{logical}#e{j}")
            sizes[dims[-1]] = size
        order = sorted(range(len(keep)), key=lambda i: dims[i] != TASKS)
        dims = [dims[i] for i in order] + dims[len(keep) :]
        site = Site(
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
        site.keep, site.perm = keep, order  # how to canonicalise Pyro tensors
        site.fn_name = fname
        site.at_prior = at_prior.marked(s)
        if logical in self.points:
            site.point, site.fn_name = True, "pyro.param"
            init = self.points[logical].to(dtype_of(trace))
            site.init = canon(site, init.expand(batch_shape + event_shape))
        why = record.declare(site, base, sizes)  # categories, states, x xᵀ's second axis
        if why is not None:
            raise refuse(logical, fname, "-", why)
        if record.observed_only and not site.observed:
            raise refuse(
                logical,
                fname,
                "-",
                f"a latent {fname} site is not supported; declare a latent discrete value "
                "as a Categorical site",
            )
        if record.latent_only and site.observed:
            raise refuse(logical, fname, "-", f"an observed {fname} site is not supported")
        full_mask = s["mask"]
        if mask is not None:
            full_mask = mask if full_mask is None else full_mask & mask
        if merged:
            if not record.labels:
                raise refuse(
                    logical,
                    fname,
                    "-",
                    "obs_mask (partly observed values) is supported on Categorical sites; "
                    "leave out missing continuous or count data with poutine.mask",
                )
            obs_site = trace.nodes[logical + "_observed"]
            obs_mask = torch.as_tensor(obs_site["mask"], device=obs_site["value"].device)
            obs_mask = canon(site, obs_mask.expand(batch_shape))
            obs_val = canon(site, obs_site["value"].expand(batch_shape)).long()
            site.fixed_mask = obs_mask.bool()
            one_hot = torch.nn.functional.one_hot(obs_val.clamp(0, site.n_cat - 1), site.n_cat)
            site.fixed = one_hot.to(dtype_of(trace))
            full_mask = None  # the ~obs_mask of the unobserved twin
        if full_mask is None and scale != 1.0:
            full_mask = True  # a tempered site: its scale is its mask
        if full_mask is not None and not (full_mask is True and scale == 1.0):
            m = torch.as_tensor(full_mask, device=s["value"].device)
            m = canon(site, m.expand(batch_shape)).to(dtype_of(trace)) * scale
            if not site.observed and not record.labels:
                raise refuse(logical, fname, "-", "a mask on a latent continuous site")
            site.mask, site.mask_dims = reduce_constant(m, site.dims[: m.dim()])
        if site.observed:
            self._read_data(site, record, base, s["value"], dtype_of(trace))
        return site

    @staticmethod
    def _read_data(site: Site, record: Family, base, value: torch.Tensor, dtype) -> None:
        """An observed site's data, checked (whole numbers where the family counts, in
        their support, with finite statistics) and stored with their statistics."""
        name, fname = site.name, site.fn_name
        if record.whole_numbers:  # counts, labels
            if value.dtype == torch.bool:
                value = value.to(dtype)
            if not bool(torch.isfinite(value).all()):
                raise refuse(name, fname, "-", "its data hold NaN or infinite values")
            whole = value.round() if value.is_floating_point() else value
            if not bool(((value >= 0) & (value == whole)).all()):
                raise refuse(name, fname, "-", "its data must be whole numbers >= 0")
            limit = record.data_limit(base, site)
            if limit is not None and not bool((value <= limit[0]).all()):
                raise refuse(name, fname, "-", limit[1])
            if not record.labels:  # counts are taken in the data's dtype
                value = value.to(dtype)
        if not record.labels and not value.is_floating_point():
            raise refuse(name, fname, "-", f"its data are {value.dtype}; give float32 or float64")
        v = canon(site, value.expand(site.batch_shape + site.event_shape))
        record.observe(site, v, dtype)
        if record.labels:
            return
        inside = support_holds(site.family, v)  # a Gamma's data > 0, a Dirichlet's rows, ...
        finite = all_finite(*record.checked_stats(site))
        if not bool(finite if inside is None else finite & inside):
            if not bool(torch.isfinite(v).all()):
                raise refuse(name, fname, "-", "its data hold NaN or infinite values")
            outside = support_refusal(name, fname, site.family, v, site.dims)
            if outside is not None:
                raise outside
            raise refuse(
                name,
                fname,
                "-",
                f"the sufficient statistics of its data (squares or logarithms) are not "
                f"finite in {v.dtype}: rescale the data, or check for zeros or negative "
                "values under a Gamma or Dirichlet",
            )

    def _check_structure(self, trace, args, kwargs) -> None:
        """``ValueError`` when the model's structure (its sites, their distributions and
        shapes) changes with the values of its latent sites: Python control flow on a
        latent value, which message passing cannot follow. Checked by tracing the model
        again with other draws of its latent sites and with every site at each end of its
        support (:func:`~probfsl.inference.vmp.branches.extreme`), on the first task alone
        (the arguments sliced to it) where the model runs on it. The runs are kept
        (``_probe_runs``) for :func:`~probfsl.inference.vmp.branches.check`, which holds
        the parameters of the finished plan to them."""

        def shape(t):
            return [
                (n, type(s["fn"]).__name__, tuple(s["value"].shape))
                for n, s in t.nodes.items()
                if s["type"] == "sample"
            ]

        device = next((v.device for v in (*args, *kwargs.values()) if torch.is_tensor(v)), None)
        cuda = [device] if device is not None and device.type == "cuda" else []
        # the user's random streams are left as they were (the CPU's and the data's GPU's)
        with torch.random.fork_rng(devices=cuda), pyro.validation_enabled(False):
            one = _first_task(args, kwargs)
            one_task = False
            if one is not None:
                try:
                    trace = self._trace(*one)
                    args, kwargs = one
                    one_task = True
                except Exception:  # the model needs every task: check on all of them
                    pass
            first = shape(trace)
            runs = [trace]
            # streams other than the first run's (0), then each end of every support
            for seed, pattern in ((1, None), (3, None), (4, "high"), (5, "low")):
                torch.random.default_generator.manual_seed(seed)
                for d in cuda:
                    with torch.cuda.device(d):
                        torch.cuda.manual_seed(seed)
                try:
                    run = self._trace(args, kwargs, seed=seed, pattern=pattern)
                except Exception:
                    if pattern is None:
                        raise
                    continue  # the model fails at these extremes: they prove nothing
                if shape(run) != first:
                    raise ValueError(
                        "VMP cannot follow this model: its sites change with the values of "
                        "its latent sites (Python control flow on a latent value)"
                    )
                if pattern is not None:  # random draws seldom cross a branch the ends miss
                    runs.append(run)
            self._probe_runs = (runs, one_task)

    def _params(self, site: Site, tr_site: dict) -> dict[str, torch.Tensor]:
        """The site's parameters in its canonical layout (precision for a Normal), floating
        ones in the data's dtype: a prior written with Python numbers holds float32 tensors
        (Pyro's default), and float64 data keep their precision."""
        res = self._read_params(site, tr_site)
        if self._dtype is None:
            return res
        return {k: v.to(self._dtype) if v.is_floating_point() else v for k, v in res.items()}

    def _read_params(self, site: Site, tr_site: dict) -> dict[str, torch.Tensor]:
        base, _ = unwrap(tr_site["fn"])
        params, laid_out = lookup(site.family).read_params(base, site)
        if laid_out:
            return params
        full = site.batch_shape + site.event_shape
        return {k: canon(site, v.expand(full)) for k, v in params.items()}

    def _probes(self, plan: Plan) -> dict:
        """A random value of every latent site, canonical layout (for the verifying run)."""
        g = torch.Generator().manual_seed(2)
        out = {}
        for n in plan.latent:
            x = plan.sites[n]
            v = draw(x.family, [plan.sizes[d] for d in x.dims], x.n_cat, g)
            ref = plan.ref
            out[n] = v.to(ref) if v.is_floating_point() else v.to(ref.device)
        return out

    def _find_parents(self, plan: Plan, trace, args, kwargs) -> None:
        sites = plan.sites
        base_values = {
            sites[n].pyro_name: plain(trace.nodes[sites[n].pyro_name]["value"]) for n in plan.latent
        }
        # the first trace took these very values: its parameters are the base ones, those
        # that Gamma or Wishart sites enter with their form c · Π τ (kept in ``_forms``)
        base_params = {n: self._params(s, trace.nodes[s.pyro_name]) for n, s in sites.items()}
        self._forms = {
            (n, k): v for n, ps in base_params.items() for k, v in ps.items() if k in SCALED
        }
        base_params = {n: {k: plain(v) for k, v in ps.items()} for n, ps in base_params.items()}
        self._runs: dict = {"probes": self._probes(plan)}
        # site-level parents by Pyro's provenance tracking (one run of the model) ...
        from pyro.infer.inspect import get_dependencies

        deps = None
        model = _DrawLatent(0, self._dtype)(self.model)  # the compiler's values, as every run
        one = _first_task(args, kwargs, plan.sizes[TASKS])
        if one is not None:  # the structure of one task (cheaper); all tasks if that fails
            with contextlib.suppress(Exception), data_device(args, kwargs):
                deps = get_dependencies(model, *one)["prior_dependencies"]
        if deps is None:  # Pyro computes each site's log-density here
            try:
                with data_device(args, kwargs):
                    deps = get_dependencies(model, args, kwargs)["prior_dependencies"]
            except (NotImplementedError, RuntimeError) as err:
                raise _model_failed(err, args, kwargs) from None
        logical = {sites[n].pyro_name: n for n in plan.latent}
        # ... and which parameters move when every latent site takes a random value
        values = dict(base_values)
        values.update(
            {sites[n].pyro_name: to_pyro(sites[n], v) for n, v in self._runs["probes"].items()}
        )
        with pyro.validation_enabled(False):
            tr = self._trace(args, kwargs, values)
        check_parameters(
            [tr.nodes[x.pyro_name] for x in sites.values()],
            " when the latent sites it depends on take other values (a pyro.param used as a "
            "scale, rate or precision needs constraint=constraints.positive)",
        )
        self._runs["verify"] = {n: self._params(x, tr.nodes[x.pyro_name]) for n, x in sites.items()}
        for n, s in sites.items():
            site_pa = [
                logical[d] for d in deps.get(s.pyro_name, {}) if d in logical and logical[d] != n
            ]
            for k, v in base_params[n].items():
                if k == "logits":  # read only for Pólya-Gamma logits (below)
                    continue
                pa = []
                moved = not torch.equal(self._runs["verify"][n][k], v)
                gaussian = [p for p in site_pa if lookup(sites[p].family).gaussian]
                if moved and k == "probs" and lookup(s.family).logistic and gaussian:
                    # logits affine in Gaussian sites: Pólya-Gamma augmentation (§7.3)
                    if len(gaussian) < len(site_pa):
                        others = ", ".join(repr(p) for p in site_pa if p not in gaussian)
                        raise refuse(
                            n,
                            s.fn_name,
                            others,
                            "logits affine in Normal sites are supported; these parents also "
                            "move its probabilities",
                        )
                    p = self._linear_map(plan, s, "logits", gaussian, base_values, args, kwargs)
                    s.params["logits"] = p
                    for term in p.terms:
                        plan.children[term.parent].append((n, "logits"))
                    continue
                if moved:
                    fits = _roles(s.family, k)
                    pa = [p for p in site_pa if sites[p].family in fits]
                    if not pa:
                        desc = ", ".join(f"{p!r} ({sites[p].fn_name})" for p in site_pa) or "-"
                        why = f"its {k} depends on them non-conjugately{_nearby(s.family, k)}"
                        if k in SCALED and any(
                            sites[p].point
                            and lookup(sites[p].family).point_constraint is constraints.real
                            for p in site_pa
                        ):
                            why += (
                                "; a pyro.param used as a scale, rate or precision needs "
                                "constraint=constraints.positive"
                            )
                        raise refuse(n, s.fn_name, desc, why)
                    pa = self._movers(plan, s, k, v, pa, base_values, args, kwargs)
                try:
                    s.params[k] = self._param_map(plan, s, k, v, pa, base_values, args, kwargs)
                except ValueError:
                    if k != lookup(s.family).affine_parameter or any(
                        lookup(sites[p].family).labels for p in pa
                    ):
                        raise
                    try:
                        s.params[k] = self._linear_map(plan, s, k, pa, base_values, args, kwargs)
                    except ValueError:
                        if len(pa) != 2:
                            raise
                        s.params[k] = self._bilinear_map(plan, s, k, pa, base_values, args, kwargs)
                p = s.params[k]
                if k == "concentration" and p.parent is not None:  # a Dirichlet's
                    self._check_dirichlet_concentration(s, sites[p.parent])
                if p.parent is not None:
                    plan.children[p.parent].append((n, k))
                for factor, _ in p.factors:
                    plan.children[factor].append((n, k))
                for term in p.terms:
                    plan.children[term.parent].append((n, k))
                if p.bilinear is not None:
                    plan.children[p.bilinear.u].append((n, k))
                    plan.children[p.bilinear.v].append((n, k))
                if p.selector is not None and (n, "select") not in plan.children[p.selector]:
                    plan.children[p.selector].append((n, "select"))
            self._name_selected_constants(s)
            self._check_selectors(s)

    @staticmethod
    def _name_selected_constants(s: Site) -> None:
        """Give a selected constant table the component axis of the site's selected parents."""
        named = {p.selector: p.comp for p in s.params.values() if p.parent and p.comp}
        for p in s.params.values():
            placeholder = f"{p.selector}#cat"
            if p.parent is None and p.comp == placeholder and p.selector in named:
                p.comp = named[p.selector]
                p.const_dims = tuple(p.comp if d == placeholder else d for d in p.const_dims)

    def _check_selectors(self, s: Site) -> None:
        gathered = [p for p in s.params.values() if p.comp is not None]
        if len({(p.comp, p.selector) for p in gathered}) > 1:
            raise refuse(
                s.name, s.fn_name, "-", "its parameters select components by different indices"
            )
        if len({p.comp for p in gathered if p.index is not None}) > 1 or (
            len(gathered) > 1 and gathered[0].index is not None
        ):
            idx = [p.index for p in gathered]
            if any(not torch.equal(idx[0], i) for i in idx[1:]):
                raise refuse(s.name, s.fn_name, "-", "its parameters use different indices")

    def _selected_constant(self, plan, s, key, dims, selector, base_values, args, kwargs):
        """A fixed per-component table chosen by a Categorical site (``Vindex(c)[..., z]``)."""
        z = plan.sites[selector]
        comp = f"{z.name}#cat"
        shape = [plan.sizes[d] for d in z.dims]

        def run(z_value):
            values = dict(base_values)
            values[z.pyro_name] = to_pyro(z, z_value)
            tr = self._trace(args, kwargs, values)
            return self._params(s, tr.nodes[s.pyro_name])[key]

        if not set(z.dims) <= set(dims):
            raise refuse(s.name, s.fn_name, repr(selector), "the selector has axes the child lacks")
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
        expect = ein(
            dims,
            [(table, dims + (comp,)), (one_hot, z.dims + (comp,))],
            dims + (comp,),
            plan.sizes,
            table,
        )
        if not close(run(probe), expect):
            raise refuse(s.name, s.fn_name, repr(selector), f"its {key} is not selected by it")
        c, cd = reduce_constant(table, dims + (comp,))
        return Param(dims, const=c, const_dims=cd, comp=comp, selector=selector)

    def _linear_map(self, plan, s: Site, key, pa, base_values, args, kwargs) -> Param:
        """An affine parameter Σ_k J_k w_k + b of Normal or MultivariateNormal parents
        (:mod:`~probfsl.inference.vmp.linear_maps`).

        One run of the model with each parent's value a leaf of autograd gives the
        parameter as a function of the parents. It is affine in a parent when the gradient
        of ⟨parameter, v⟩ does not depend on that parent (a structural property of the
        graph: no rounding of numbers); J's columns come from differentiating the map
        u ↦ Jᵀu once more, b from the base values, and the whole map is then checked on the
        random values of every latent site."""
        sites = plan.sites
        dims = param_dims(s, key)
        parents = [sites[p] for p in pa]
        desc = ", ".join(f"{w.name!r} ({w.fn_name})" for w in parents)
        value, leaves = self._as_function(s, key, parents, base_values, args, kwargs)
        if not value.requires_grad:
            raise refuse(s.name, s.fn_name, desc, f"its {key} does not depend on them")
        terms, offset = [], value.detach()
        for w in parents:
            axis = self._contracted_axis(s, w, dims, desc)
            jac = self._jacobian(value, leaves[w.name], w, axis, s, desc)
            jac_dims = dims + ((axis,) if axis else ())
            over = dims + ((axis,) if axis else ())
            offset = offset - ein(
                dims, [(jac, jac_dims), (leaves[w.name].detach(), w.dims)], over, plan.sizes, jac
            )
            jac, jac_dims = reduce_constant(jac, jac_dims)
            terms.append(LinearTerm(w.name, jac, jac_dims, axis))
            if axis is not None and lookup(w.family).elementwise:
                w.joint = True
                plan.sizes[axis + "b"] = plan.sizes[axis]
        const, const_dims = reduce_constant(offset, dims)
        param = Param(dims, const=const, const_dims=const_dims, terms=terms)
        # the affine hypothesis on random values of every latent site (one shared run)
        probes = self._runs["probes"]
        got = self._runs["verify"][s.name][key]
        expect = ein(dims, [(const, const_dims)], dims, plan.sizes, got)
        # Σ|terms| of this run and of the base run (which gave b) and their number, for
        # the rounding bound
        size, n = expect.abs() + got.abs(), 1
        for t in terms:
            w = sites[t.parent]
            over = dims + ((t.axis,) if t.axis else ())
            ops = [(t.jac, t.jac_dims), (probes[t.parent], w.dims)]
            expect = expect + ein(dims, ops, over, plan.sizes, got)
            both = probes[t.parent].abs() + leaves[t.parent].detach().abs()
            size = size + ein(
                dims, [(t.jac.abs(), t.jac_dims), (both, w.dims)], over, plan.sizes, got
            )
            n += plan.sizes[t.axis] if t.axis else 1
        if not _matches(got, expect, n * torch.finfo(got.dtype).eps * size):
            raise refuse(
                s.name,
                s.fn_name,
                desc,
                f"its {key} is not an affine function of them with fixed coefficients "
                "(linear maps of Normal sites with observed coefficients, and products of "
                "two of them, are supported; a non-linear function is not)",
            )
        return param

    def _product_map(self, plan, s: Site, key, value, mains, base_values) -> Param:
        """A precision c · Π_k τ_k of several Gamma sites (a scale mixture: a Student-t is a
        Normal whose precision is λ·u with u ~ Gamma(ν/2, ν/2) per point; VMP design §7.4). Each
        factor's axes are the child's (event axes right-aligned); c is read off the first
        run and checked on the random values of every latent site."""
        sites, dims = plan.sites, param_dims(s, key)
        desc = ", ".join(f"{m!r} ({sites[m].fn_name})" for m in mains)
        renames = []
        for m in mains:
            parent = sites[m]
            rename = {d: d for d in parent.dims}
            n_ev = parent.event_dim
            for j in range(n_ev):
                rename[parent.dims[len(parent.dims) - n_ev + j]] = dims[len(dims) - n_ev + j]
            if any(rename[d] not in dims for d in parent.dims):
                raise refuse(
                    s.name, s.fn_name, desc, "a factor of its precision has axes the child lacks"
                )
            renames.append(rename)

        def product(values):
            total = 1
            for m, rename in zip(mains, renames, strict=True):
                total = total * ein(
                    dims,
                    [(values[m], tuple(rename[d] for d in sites[m].dims))],
                    dims,
                    plan.sizes,
                    value,
                )
            return total

        form = self._coefficient(s, key, [sites[m] for m in mains])
        if form is not None:
            coef, coef_dims = reduce_constant(form, dims)
        else:  # read off the base run (see :meth:`_param_map`)
            base = {m: canon(sites[m], base_values[sites[m].pyro_name]) for m in mains}
            coef, coef_dims = reduce_constant(value / product(base), dims, ulps=8)
        got = self._runs["verify"][s.name][key]
        expect = ein(dims, [(coef, coef_dims)], dims, plan.sizes, got) * product(
            self._runs["probes"]
        )
        if not close(got, expect):
            raise refuse(
                s.name, s.fn_name, desc, f"its {key} is not c times the product of these sites"
            )
        return Param(
            dims,
            parent=mains[0],
            rename=renames[0],
            coef=coef,
            coef_dims=coef_dims,
            factors=list(zip(mains[1:], renames[1:], strict=True)),
        )

    def _traced_index(self, s, key, parent, code, base_values, args, kwargs):
        """The code (``code``: canonical layout of ``parent``) of the entry of the parent's
        value that each entry of parameter ``key`` of ``s`` copies, read off one run with
        the parent at its first value carrying those codes as origins
        (:func:`~probfsl.inference.vmp.monomials.origin`); ``None`` where the parameter
        is not a (scaled) copy of entries of that value alone."""
        if key == "probs":  # normalised by the model: not a fixed selection VMP supports
            return None
        values = dict(base_values)
        name = parent.pyro_name
        values[name] = Monomial.of(base_values[name], name, to_pyro(parent, code))
        tr = self._trace(args, kwargs, values)
        got = origin(self._read_params(s, tr.nodes[s.pyro_name])[key], name)
        return None if got is None else plain(got)

    def _coefficient(self, s: Site, key: str, parents: list[Site]) -> torch.Tensor | None:
        """c of the parameter ``key`` of ``s`` where it is c · Π τ over these ``parents``,
        read off its form in the first run (:mod:`~probfsl.inference.vmp.monomials`): the
        model's own constants, with no rounding. ``None`` where it has no such form."""
        form = self._forms.get((s.name, key))
        return coefficient(form, [p.pyro_name for p in parents])

    @staticmethod
    def _find_chains(plan: Plan) -> None:
        """Gaussian Markov chains: latent Normal sites s_1, s_2, ... each of whose mean is
        the one before it, or an elementwise affine map of it (a s + d with fixed a and d:
        a drift, a scaled step), with the same axes and no selection, the first with any
        prior. Each chain gets one joint factor
        (:mod:`~probfsl.inference.vmp.gaussian_chain`)."""
        sites = plan.sites

        def link(s: Site) -> str | None:
            scalar = lookup(s.family).gaussian and lookup(s.family).elementwise
            if not scalar or s.observed or s.point or s.joint or s.mask is not None:
                return None
            p = s.params.get("loc")
            if p is None or p.comp is not None or p.bilinear is not None:
                return None
            if p.parent is not None and not p.terms:  # a copy of the step before
                pred = sites[p.parent]
                renamed = all(p.rename[d] == d for d in pred.dims)
            elif p.parent is None and len(p.terms) == 1 and p.terms[0].axis is None:
                pred, renamed = sites[p.terms[0].parent], True  # a s + d, elementwise
            else:
                return None
            same = pred.dims == s.dims and renamed
            special = pred.point or pred.joint or pred.mask is not None
            gaussian = lookup(pred.family)
            plain = gaussian.gaussian and gaussian.elementwise and not special
            if not (same and plain and s.params["precision"].comp is None):
                return None
            return pred.name

        successor: dict = {}
        for name in plan.latent:
            pred = link(sites[name])
            if pred is not None:
                successor[pred] = None if pred in successor else name  # a fork: no chain
        heads = [n for n, nxt in successor.items() if nxt and n not in successor.values()]
        for head in heads:
            members = [head]
            while successor.get(members[-1]):
                members.append(successor[members[-1]])
            name = f"chain:{head}"
            plan.chains[name] = members
            for position, member in enumerate(members):
                sites[member].chain = (name, position)

    @staticmethod
    def _tasks_frame_of_point(name: str, trace, batch_shape: tuple) -> list:
        """The ``tasks`` plate of a ``pyro.param`` declared outside it: its axis at the
        plate's position must have the tasks' length (one value per task)."""
        frame = next(
            (
                f
                for node in trace.nodes.values()
                if node["type"] == "sample"
                for f in node["cond_indep_stack"]
                if f.name == TASKS and f.vectorized
            ),
            None,
        )
        if frame is None:
            raise _shared_point(name)
        at = len(batch_shape) + frame.dim
        if at < 0 or batch_shape[at] != frame.size:
            want = [1] * max(len(batch_shape), -frame.dim)
            want[frame.dim] = frame.size
            raise _shared_point(name, tuple(want))
        return [frame]

    def _movers(self, plan, s: Site, key, value, pa, base_values, args, kwargs) -> list:
        """The candidates of ``pa`` that move parameter ``key`` of ``s`` (site-level
        provenance names every parent of the site; where two candidates share a family,
        one run with each at its random value alone tells them apart)."""
        sites = plan.sites
        families = [sites[p].family for p in pa if not lookup(sites[p].family).labels]
        if len(families) == len(set(families)):
            return pa
        movers = []
        for p in pa:
            if lookup(sites[p].family).labels:
                movers.append(p)
                continue
            kind = ("alone", p)
            if kind not in self._runs:
                values = dict(base_values)
                probe = self._runs["probes"][p]
                values[sites[p].pyro_name] = to_pyro(sites[p], probe)
                tr = self._trace(args, kwargs, values)
                self._runs[kind] = {
                    n: self._params(x, tr.nodes[x.pyro_name]) for n, x in sites.items()
                }
            if not torch.equal(self._runs[kind][s.name][key], value):
                movers.append(p)
        return movers

    @staticmethod
    def _check_counts(plan: Plan) -> None:
        """``ValueError`` naming the site for an observed Poisson, Bernoulli or Binomial
        whose rate or probabilities depend on no latent site (a fixed law, or a rate
        c · λ with every c = 0, which makes it fixed at 0), and for a Poisson rate c · λ
        with c = 0 where a count above 0 is observed (:meth:`_check_exposures`); one host
        synchronisation per such site."""
        for s in plan.sites.values():
            record = lookup(s.family)
            if not s.observed or not record.needs_latent_parent or "logits" in s.params:
                continue
            key = record.linear_parameter
            p = s.params[key]
            if p.parent is None:
                zero = record.positive_exposure and p.const is not None and not bool(p.const.any())
                why = (
                    "its rate is 0 (an exposure of 0?), so it does not depend on its Gamma "
                    "parent; a rate c * lambda needs every exposure c > 0"
                    if zero
                    else f"its {key} is fixed (it depends on no latent site); an observed "
                    f"{s.fn_name}'s {key} must be {record.hints[key]}"
                )
                raise refuse(s.name, s.fn_name, "-", why)
            if record.positive_exposure and p.coef is not None:
                Compiler._check_exposures(plan, s, p)

    @staticmethod
    def _check_exposures(plan: Plan, s: Site, p) -> None:
        """``ValueError`` naming the site and the first entry where a Poisson rate c · λ
        has c = 0 (an exposure of 0) but a count above 0 is observed: a rate of 0 gives
        such a count probability 0 (ln 0 in the bound). At a count of 0 the entry has
        probability one and adds nothing (0 ln 0 = 0), and is accepted."""
        zero = p.coef <= 0
        if not bool(zero.any()):
            return
        dims, sizes = s.dims, plan.sizes
        zero = ein(dims, [(zero.to(s.value.dtype), p.coef_dims)], dims, sizes, s.value)
        bad = (zero > 0) & (s.value > 0)
        if s.mask is not None:
            bad = bad & (ein(dims, [(s.mask, s.mask_dims)], dims, sizes, s.value) > 0)
        if not bool(bad.any()):
            return
        at = tuple(int(i) for i in bad.nonzero()[0])
        where = ", ".join(
            f"{'task' if d == TASKS else d} {i}" for d, i in zip(dims, at, strict=True)
        )
        raise refuse(
            s.name,
            s.fn_name,
            f"{p.parent!r} (Gamma)",
            f"its rate c * {p.parent} is 0 at {where} (an exposure of 0?) where the count "
            f"{float(s.value[at]):g} is observed, which a rate of 0 gives probability 0; "
            "a rate c * lambda needs an exposure c > 0 wherever a count is above 0",
        )

    @staticmethod
    def _check_dirichlet_concentration(s: Site, parent: Site) -> None:
        """A Dirichlet's concentration may depend on a point estimate (an M step by Minka's
        fixed point) of an observed Dirichlet, not on a latent site (no conjugate form)."""
        if not (parent.point and s.observed):
            raise refuse(
                s.name,
                s.fn_name,
                f"{parent.name!r} ({parent.fn_name})",
                "the concentration of an observed Dirichlet may be a point estimate "
                "(pyro.param with constraint positive), not a latent site",
            )

    def _as_function(self, s: Site, key, parents, base_values, args, kwargs) -> tuple:
        """Parameter ``key`` of ``s`` from one run with each parent's value a leaf of
        autograd (at its base value), and those leaves by name."""
        leaves, values = {}, dict(base_values)
        with torch.enable_grad():  # the values stay linked to the leaves under no_grad too
            for w in parents:
                leaf = canon(w, base_values[w.pyro_name]).detach().clone().requires_grad_(True)
                leaves[w.name] = leaf
                values[w.pyro_name] = to_pyro(w, leaf)
        tr = self._trace(args, kwargs, values, grad=True)
        with torch.enable_grad():
            return self._params(s, tr.nodes[s.pyro_name])[key], leaves

    def _bilinear_map(self, plan, s: Site, key, pa, base_values, args, kwargs) -> Param:
        """A parameter b + B(u, v) bilinear in two latent Gaussian sites, e.g. ``c * mu`` or
        ``(W * x).sum(-1)`` with both factors latent (mean-field between them). H =
        ∂²B/∂u∂v comes from automatic differentiation (each column of J_u differentiated
        in v), b from the base values, and the map is checked on random values of every
        latent site."""
        sites, dims = plan.sites, param_dims(s, key)
        u, v = sites[pa[0]], sites[pa[1]]
        desc = f"{u.name!r} ({u.fn_name}), {v.name!r} ({v.fn_name})"
        axis_u = self._contracted_axis(s, u, dims, desc)
        axis_v = self._contracted_axis(s, v, dims, desc)
        value, leaves = self._as_function(s, key, (u, v), base_values, args, kwargs)
        with torch.enable_grad():
            h = self._mixed_derivative(value, leaves[u.name], leaves[v.name], axis_u, axis_v)
        h_dims = dims + tuple(a for a in (axis_u, axis_v) if a)
        over = h_dims
        product = ein(
            dims,
            [(h, h_dims), (leaves[u.name].detach(), u.dims), (leaves[v.name].detach(), v.dims)],
            over,
            plan.sizes,
            h,
        )
        const, const_dims = reduce_constant(value.detach() - product, dims)
        h, h_dims_kept = reduce_constant(h, h_dims)
        term = BilinearTerm(u.name, v.name, h, h_dims_kept, axis_u, axis_v)
        probes = self._runs["probes"]
        got = self._runs["verify"][s.name][key]
        ops = [(h, h_dims_kept), (probes[u.name], u.dims), (probes[v.name], v.dims)]
        expect = ein(dims, [(const, const_dims)], dims, plan.sizes, got)
        expect = expect + ein(dims, ops, over, plan.sizes, got)
        if not _matches(got, expect):
            raise refuse(
                s.name,
                s.fn_name,
                desc,
                f"its {key} is neither affine in these sites nor a product of two of them "
                "(affine maps and bilinear products of Normal sites are supported)",
            )
        for w, axis in ((u, axis_u), (v, axis_v)):
            if axis is not None and lookup(w.family).elementwise:
                w.joint = True
                plan.sizes[axis + "b"] = plan.sizes[axis]
        return Param(dims, const=const, const_dims=const_dims, bilinear=term)

    @staticmethod
    def _mixed_derivative(value, leaf_u, leaf_v, axis_u, axis_v) -> torch.Tensor:
        """∂²value/∂u_a∂v_b per element of ``value`` [..., A, B] (A, B present where the
        parent's last axis is contracted), by differentiating u ↦ J_uᵀU, then each
        column of J_u in v the same way."""
        n_u = leaf_u.shape[-1] if axis_u else 1
        n_v = leaf_v.shape[-1] if axis_v else 1
        dummy = torch.zeros_like(value, requires_grad=True)
        (gu,) = torch.autograd.grad(value, leaf_u, dummy, create_graph=True)
        rows = []
        for a in range(n_u):
            pick = torch.zeros(n_u, dtype=leaf_u.dtype, device=leaf_u.device)
            pick[a] = 1
            weight = pick if axis_u else 1
            (col,) = torch.autograd.grad((gu * weight).sum(), dummy, create_graph=True)
            second = torch.zeros_like(col, requires_grad=True)
            (gv,) = torch.autograd.grad(col, leaf_v, second, create_graph=True, allow_unused=True)
            entries = []
            for b in range(n_v):
                pick_v = torch.zeros(n_v, dtype=leaf_v.dtype, device=leaf_v.device)
                pick_v[b] = 1
                if gv is None:
                    entries.append(torch.zeros_like(value))
                    continue
                (h,) = torch.autograd.grad(
                    (gv * (pick_v if axis_v else 1)).sum(),
                    second,
                    retain_graph=True,
                    allow_unused=True,
                )
                entries.append(torch.zeros_like(value) if h is None else h.detach())
            rows.append(torch.stack(entries, -1) if axis_v else entries[0])
        return torch.stack(rows, -2 if axis_v else -1) if axis_u else rows[0]

    @staticmethod
    def _contracted_axis(s: Site, w: Site, dims: tuple, desc: str) -> str | None:
        """The parent's axis that a linear map sums over: its last event axis (or none, for
        an elementwise map); every other parent axis must be one of the child's."""
        if w.event_dim > 1:
            raise refuse(
                s.name, s.fn_name, desc, "a linear map of a parent with more than one event axis"
            )
        axis = w.dims[-1] if w.event_dim == 1 and w.dims[-1] not in dims else None
        extra = [d for d in w.dims if d not in dims and d != axis]
        if extra:
            raise refuse(
                s.name,
                s.fn_name,
                desc,
                f"the map sums over the parent's plate axes {extra}; sum over an event axis "
                "of the parent instead",
            )
        return axis

    @staticmethod
    def _jacobian(value, leaf, w: Site, axis, s: Site, desc: str) -> torch.Tensor:
        """∂value/∂leaf, per element of ``value`` and (with ``axis``) per entry of the
        parent's last event axis; ``ValueError`` unless the map is affine in the leaf."""
        with torch.enable_grad():
            v = torch.ones_like(value)
            (g,) = torch.autograd.grad(value, leaf, v, create_graph=True, allow_unused=True)
            if g is None:
                raise refuse(s.name, s.fn_name, desc, "it does not depend on the parent")
            if g.requires_grad:
                (h,) = torch.autograd.grad(g.sum(), leaf, retain_graph=True, allow_unused=True)
                if h is not None:
                    raise refuse(
                        s.name,
                        s.fn_name,
                        repr(w.name) + f" ({w.fn_name})",
                        "the parent enters non-linearly (linear maps of Normal sites are "
                        f"supported; this parent enters through {_through(value, leaf)})",
                    )
            u = torch.zeros_like(value, requires_grad=True)
            (gu,) = torch.autograd.grad(value, leaf, u, create_graph=True)
            if axis is None:
                (jac,) = torch.autograd.grad(gu.sum(), u, allow_unused=True)
                return torch.zeros_like(value) if jac is None else jac.detach()
            n_cols = leaf.shape[-1]
            picks = torch.eye(n_cols, dtype=leaf.dtype, device=leaf.device)
            picks = picks.reshape(n_cols, *[1] * (leaf.dim() - 1), n_cols).expand(
                n_cols, *leaf.shape
            )
            with contextlib.suppress(RuntimeError):  # every column at once, where vmap can
                (cols,) = torch.autograd.grad(
                    gu, u, picks, retain_graph=True, allow_unused=True, is_grads_batched=True
                )
                if cols is None:
                    return torch.zeros(*value.shape, n_cols, dtype=value.dtype, device=value.device)
                return cols.detach().movedim(0, -1)
            cols = []
            for p in range(n_cols):
                pick = torch.zeros(leaf.shape[-1], dtype=leaf.dtype, device=leaf.device)
                pick[p] = 1
                (col,) = torch.autograd.grad(
                    (gu * pick).sum(), u, retain_graph=True, allow_unused=True
                )
                cols.append(torch.zeros_like(value) if col is None else col.detach())
            return torch.stack(cols, -1)

    def _param_map(self, plan, s: Site, key, value, pa, base_values, args, kwargs) -> Param:
        """How the parents ``pa`` enter parameter ``key`` of ``s``. An event axis of a parent
        of a mixture whose size equals the child's axis it would align with is first read
        as that axis, then, if that is refused, as the selector's component axis
        (``Vindex(mu)[..., z]`` with ``mu`` a vector of K means)."""
        try:
            return self._param_map_as(plan, s, key, value, pa, base_values, args, kwargs)
        except ValueError:
            sites = plan.sites
            selectors = [p for p in pa if lookup(sites[p].family).labels]
            mains = [sites[p] for p in pa if not lookup(sites[p].family).labels]
            if len(selectors) != 1 or len(mains) != 1 or lookup(mains[0].family).outer_axis:
                raise
            parent, dims, n_cat = mains[0], param_dims(s, key), sites[selectors[0]].n_cat
            events = parent.dims[len(parent.dims) - parent.event_dim :]
            tail = dims[len(dims) - len(events) :] if events else ()
            # an event axis aligned with a child's axis of the same size as the components
            candidates = [
                d
                for d, c in zip(events, tail, strict=True)
                if plan.sizes[d] == n_cat == plan.sizes[c]
            ]
            for axis in candidates:
                with contextlib.suppress(ValueError):
                    return self._param_map_as(
                        plan, s, key, value, pa, base_values, args, kwargs, component=axis
                    )
            raise

    def _param_map_as(
        self, plan, s: Site, key, value, pa, base_values, args, kwargs, component=None
    ) -> Param:
        """:meth:`_param_map` with the parent's event axis ``component`` (if any) read as the
        selector's component axis."""
        sites = plan.sites
        dims = param_dims(s, key)
        if not pa:
            if lookup(s.family).matrix:  # matrices keep every axis
                return Param(dims, const=value, const_dims=dims)
            c, cd = reduce_constant(value, dims)
            return Param(dims, const=c, const_dims=cd)
        record = lookup(s.family)
        want = record.conjugate.get(key)
        mains = [p for p in pa if not lookup(sites[p].family).labels]
        selectors = [p for p in pa if lookup(sites[p].family).labels]
        pa_desc = ", ".join(f"{p!r} ({sites[p].fn_name})" for p in pa)
        if not mains and len(selectors) == 1 and record.selectable_constant:
            return self._selected_constant(
                plan, s, key, dims, selectors[0], base_values, args, kwargs
            )
        if key == record.product_parameter and len(mains) > 1 and not selectors:
            if all(sites[m].family == want for m in mains):
                return self._product_map(plan, s, key, value, mains, base_values)
        if (
            want is None
            or len(mains) != 1
            or len(selectors) > 1
            or sites[mains[0]].family != want
            or (selectors and record.labels and not s.observed)
        ):
            why = f"its {key} is not a conjugate function{_nearby(s.family, key)}"
            raise refuse(s.name, s.fn_name, pa_desc, why)
        parent = sites[mains[0]]
        selector = selectors[0] if selectors else None
        p_desc = f"{parent.name!r} ({parent.fn_name})"
        # the parent's event axes, right-aligned with the parameter's trailing axes
        n_ev = parent.event_dim
        if n_ev > len(dims):
            raise refuse(s.name, s.fn_name, p_desc, "the parent has more axes than the child")
        rename = {d: d for d in parent.dims}
        for j in range(n_ev):
            rename[parent.dims[len(parent.dims) - n_ev + j]] = dims[len(dims) - n_ev + j]
        if lookup(parent.family).outer_axis:  # the second axis of its x xᵀ
            rename[parent.dims[-1] + "b"] = rename[parent.dims[-1]] + "b"
        for d in parent.dims:
            if d == component or (rename[d] in dims and plan.sizes[d] != plan.sizes[rename[d]]):
                if selectors and not lookup(parent.family).outer_axis and rename[d] != d:
                    # an event axis of component values (Vindex(mu)[..., z] with mu a vector
                    # of K means): the selector's category axis, not one of the child's
                    rename[d] = f"{selectors[0]}#cat"
                    continue
                raise refuse(s.name, s.fn_name, p_desc, f"axis {rename[d]} differs in size")
        pdims = tuple(rename[d] for d in parent.dims)
        missing = [d for d in pdims if d not in dims]
        if len(missing) > 1:
            raise refuse(s.name, s.fn_name, p_desc, "more than one parent axis is selected")
        comp = missing[0] if missing else None
        if selector and comp is None:
            selector = None  # the site depends on it through another parameter
        param = Param(dims, parent=parent.name, rename=rename, comp=comp, selector=selector)

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
            raise refuse(s.name, s.fn_name, p_desc, f"{selector!r} has the wrong number of values")
        pshape = [plan.sizes[d] for d in parent.dims]
        wishart = lookup(parent.family).matrix and lookup(parent.family).symbolic

        def gathered(parent_value, sel_value):
            """The parent's value selected (and broadcast) into the parameter's layout."""
            if comp is not None and selector is not None:
                z = sites[selector]
                eff = sel_value
                if z.fixed_mask is not None:
                    eff = torch.where(z.fixed_mask, z.fixed.argmax(-1), sel_value)
                return select(parent_value, pdims, comp, eff, z.dims, dims, plan.sizes)
            ops = [(parent_value, pdims)]
            if comp is not None:
                ops.append((param.index, param.index_dims))
            return ein(dims, ops, dims + ((comp,) if comp else ()), plan.sizes, value)

        def set_coef(c, ulps=8):
            """c of a precision c * tau (c I for a precision matrix: the scalar is kept),
            constant up to ``ulps`` where it was read off numbers."""
            if wishart:
                c = c[..., 0, 0]
                param.coef, param.coef_dims = reduce_constant(c, dims[:-2], ulps=ulps)
                return c[..., None, None]
            param.coef, param.coef_dims = reduce_constant(c, dims, ulps=ulps)
            return c

        c = None
        form = self._coefficient(s, key, [parent]) if key in SCALED else None
        if form is not None:
            c = set_coef(form, ulps=0)
        if comp is not None and selector is None:
            # a fixed index: the component of each entry of the parameter, carried to it
            # from the parent's value by the model's own indexing (origins of a form)
            ci = pdims.index(comp)
            code = torch.arange(plan.sizes[comp], device=value.device)
            code = code.reshape([-1 if i == ci else 1 for i in range(len(pdims))]).expand(pshape)
            idx = self._traced_index(s, key, parent, code, base_values, args, kwargs)
            if idx is None:  # no form: read off a run at values coded by component
                if key in SCALED and c is None:  # c first, from a run at unit precision
                    c = set_coef(
                        run(
                            "ones",
                            lambda: {
                                n: to_pyro(sites[n], unit(plan, sites[n], value))
                                for n in plan.latent
                                if lookup(sites[n].family).symbolic
                            },
                        )
                    )
                positive = key in SCALED or key == "concentration"  # coded from 1, not 0
                coded = code.to(value.dtype) + 1 if positive else code.to(value.dtype)
                if wishart:
                    coded = coded[..., :1] * unit(plan, parent, value)
                got = run(
                    ("code", parent.name, comp), lambda: {parent.name: to_pyro(parent, coded)}
                )
                if key in SCALED:
                    got = got / c - 1
                elif positive:
                    got = got - 1
                if wishart:
                    got = got[..., :1, :1].expand(got.shape)
                idx = got.round().long()
            idx, idx_dims = reduce_constant(idx, dims)
            if key == "probs" or not bool(((idx >= 0) & (idx < plan.sizes[comp])).all()):
                raise refuse(s.name, s.fn_name, p_desc, "the parent is not selected by an index")
            one_hot = torch.nn.functional.one_hot(idx.clamp(0, plan.sizes[comp] - 1))
            param.index, param.index_dims = one_hot.to(value.dtype), idx_dims + (comp,)
        elif selector is not None and not set(sites[selector].dims) <= set(dims):
            raise refuse(s.name, s.fn_name, p_desc, f"{selector!r} has axes the child lacks")
        if key in SCALED and c is None:
            # c read off the base run as value / parent (a parameter computed outside the
            # operations a form follows), checked below
            base = gathered(
                canon(parent, base_values[parent.pyro_name]),
                None
                if selector is None
                else canon(sites[selector], base_values[sites[selector].pyro_name]),
            )
            c = set_coef(value / base)
        # verify the hypothesis on random values of every latent site (one shared run)
        got = run("verify", lambda: {n: to_pyro(sites[n], v) for n, v in probes().items()})
        expect = gathered(probes()[parent.name], probes().get(selector))
        if key in SCALED:
            expect = expect * c
        if key in record.log_parameters:
            expect = expect.log()
        if not close(got, expect):
            raise refuse(
                s.name, s.fn_name, p_desc, f"its {key} is not a (selected) copy of the parent"
            )
        return param
