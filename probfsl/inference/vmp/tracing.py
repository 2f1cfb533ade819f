"""Tracing and point estimates: the runs of the model that every other pass reads
(docs/design/vmp.md §6.1, §6.2).

Reads the model and the user's arguments off a
:class:`~probfsl.inference.vmp.context.CompileContext`; returns Pyro traces, each site's
parameters in the canonical layout, and the context with ``pyro.param`` sites lifted into
sample sites (:func:`lift_params`). Every latent site is at a value of the compiler's own
(:func:`draw`, away from the edges of its support; never a draw from the site's prior,
which for a vague Gamma underflows to 0) or at values given (``poutine.condition``). The
probe runs of parent discovery and of the parameter maps go through :func:`probe_run`,
which traces each kind of run once per compilation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pyro
import torch
from pyro import poutine
from pyro.distributions import constraints
from pyro.poutine.messenger import Messenger
from pyro.poutine.trace_struct import Trace
from torch.distributions import Distribution

from probfsl.inference.vmp.checks import data_device, unwrap
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.family import REGISTRY, Family, lookup, of_distribution
from probfsl.inference.vmp.layout import Plan, Site, canon
from probfsl.inference.vmp.monomials import Monomial


class StartAt(Messenger):
    """Gives the lifted ``pyro.param`` sites their initial values (unless a run sets them),
    so that every trace sees the model's own starting point."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.values = values

    def _pyro_sample(self, msg: dict) -> None:
        if msg["name"] in self.values and msg["value"] is None:
            msg["value"] = self.values[msg["name"]]


def draw(
    family: str, shape: list, n_cat: int = 0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A value of a latent site of ``family`` and ``shape`` away from the edges of its
    support (float64 or int64, on the CPU): what the compiler reads the model at. A draw
    from the site's prior will not do: a vague Gamma(0.01, 0.01) puts most of its mass
    below 1e-30 and underflows to 0, and the parameter maps read off such values are
    wrong (:meth:`~probfsl.inference.vmp.family.Family.draw`)."""
    return lookup(family).draw(shape, n_cat, generator)


class DrawLatent(Messenger):
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
    ) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype, self.symbolic, self.pattern = dtype, symbolic, pattern

    def _pyro_sample(self, msg: dict) -> None:
        base, _ = unwrap(msg["fn"])
        record = of_distribution(base)
        if msg["is_observed"]:
            self._float_counts(msg, base, record)
            return
        if msg["value"] is None:
            self._draw(msg, base, record)
        value = msg["value"]
        if self.symbolic and record is not None and record.symbolic and torch.is_tensor(value):
            msg["value"] = Monomial.of(value, msg["name"])

    def _float_counts(self, msg: dict, base: Any, record: Family | None) -> None:
        """Integer or bool data of a family that takes them (counts, 0/1 outcomes) in the
        model's floating dtype, so that its density can be evaluated as for float data
        (labels keep their integer dtype: they index)."""
        value = msg["value"]
        if (
            record is None
            or record.labels
            or not torch.is_tensor(value)
            or value.is_floating_point()
            or not record.takes_integer_data(base)
        ):
            return
        like = record.reference(base)
        floating = like is not None and like.is_floating_point()
        dtype = self.dtype or (like.dtype if floating else None)
        if dtype is not None:
            msg["value"] = value.to(dtype)

    def _draw(self, msg: dict, base: Any, record: Family | None) -> None:
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


def point_family(constraint: Any) -> Family | None:
    """The family a ``pyro.param`` of ``constraint`` is traced as (positive -> Gamma, real
    -> Normal, simplex -> Dirichlet, unit_interval -> Beta)."""
    return next((f for f in REGISTRY.values() if f.point_constraint is constraint), None)


def lift_params(ctx: CompileContext, params: dict[str, dict]) -> CompileContext:
    """The context whose model traces each ``pyro.param`` site (``params``: the trace's
    param nodes by name) as a sample site of the family its constraint names
    (``poutine.lift`` with a placeholder law that only gives it shape and support):
    positive -> Gamma (a precision or rate), real -> Normal (a location), simplex ->
    Dirichlet, unit_interval -> Beta; and whose ``points`` hold their initial values. The
    sweeps never use the placeholder: a point site's update is the maximiser of its
    children's terms (docs/design/vmp.md §7.2)."""
    prior = {}
    points = dict(ctx.points)
    for name, node in params.items():
        value = node["value"].detach()
        if ctx.dtype is not None and value.is_floating_point():
            value = value.to(ctx.dtype)  # the data's dtype, as every parameter
        constraint = node["kwargs"].get("constraint", constraints.real)
        family = point_family(constraint)
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
        points[name] = value
    model = StartAt(points)(poutine.lift(ctx.model, prior=prior))
    return replace(ctx, model=model, points=points)


def trace_drawn(
    ctx: CompileContext, seed: int = 0, symbolic: bool = False, pattern: str | None = None
) -> Trace:
    """One run of the model with its latent sites drawn from the stream ``seed``
    (:class:`DrawLatent`, ``symbolic`` or not, at the ``pattern`` of extremes if given;
    the verifying probes use 2)."""
    model = DrawLatent(seed, ctx.dtype, symbolic, pattern)(ctx.model)
    return _traced(ctx, model, grad=False)


def trace_at(ctx: CompileContext, values: dict[str, torch.Tensor], grad: bool = False) -> Trace:
    """One run of the model with its latent sites at ``values`` (by Pyro name,
    conditioned), with autograd on where ``grad``."""
    return _traced(ctx, poutine.condition(ctx.model, data=values), grad)


def _traced(ctx: CompileContext, model: Callable[..., Any], grad: bool) -> Trace:
    with torch.set_grad_enabled(grad), data_device(ctx.args, ctx.kwargs):
        return poutine.trace(model).get_trace(*ctx.args, **ctx.kwargs)


def first_trace(ctx: CompileContext) -> tuple[CompileContext, Trace]:
    """The first run of the model, symbolic (precisions and rates keep their form c · Π τ),
    with Pyro's checks of parameters off (they are checked later, naming the site); where
    it holds ``pyro.param`` sites, the context with them lifted (:func:`lift_params`) and
    the model traced again. ``ValueError`` where the model fails on the data."""
    try:
        with pyro.validation_enabled(False):
            trace = trace_drawn(ctx, symbolic=True)
    except (NotImplementedError, RuntimeError, ZeroDivisionError) as err:
        raise model_failed(err, ctx.args, ctx.kwargs) from None
    params = {n: s for n, s in trace.nodes.items() if s["type"] == "param"}
    if params:  # point estimates: traced as sample sites of their family from now on
        ctx = lift_params(ctx, params)
        with pyro.validation_enabled(False):
            trace = trace_drawn(ctx, symbolic=True)
    return ctx, trace


def model_failed(err: Exception, args: tuple, kwargs: dict) -> ValueError:
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


def is_batched(a: Any) -> bool:
    """Whether ``a`` is a tensor with a leading axis (one that may be the tasks')."""
    return isinstance(a, torch.Tensor) and a.dim() > 0


def first_task(args: tuple, kwargs: dict, n_tasks: int | None = None) -> tuple | None:
    """The arguments sliced to the first task: every tensor whose leading axis has the
    tasks' length (that of the first tensor argument unless ``n_tasks``); ``None`` when
    there is one task or none."""
    if n_tasks is None:
        n_tasks = next((a.shape[0] for a in (*args, *kwargs.values()) if is_batched(a)), 1)
    if n_tasks <= 1:
        return None

    def first(a: Any) -> Any:
        return a[:1] if is_batched(a) and a.shape[0] == n_tasks else a

    return tuple(map(first, args)), {k: first(v) for k, v in kwargs.items()}


def in_dtype(base: Distribution, dtype: torch.dtype) -> Distribution:
    """The distribution ``base`` with its floating tensors of fewer bits than ``dtype``,
    and those of the distributions it holds (a hidden Markov chain's emission law), in
    ``dtype``: a shallow copy, or ``base`` itself where none is. What a family record
    derives from them (a Normal's precision scale⁻², a MultivariateNormal's precision
    matrix) is then computed in ``dtype``: ``Normal(0.0, 10.0)`` holds float32 tensors
    (Pyro's default for Python numbers), and its precision 10⁻² computed in float32 is
    0.0099999998, where 10.0 itself is exact. Wider tensors are left as they are (their
    derived values are rounded to ``dtype`` once, afterwards)."""
    bits = torch.finfo(dtype).bits
    moved = {}
    for key, value in vars(base).items():
        if torch.is_tensor(value) and value.is_floating_point():
            if torch.finfo(value.dtype).bits < bits:
                moved[key] = value.to(dtype)
        elif isinstance(value, Distribution):
            inner = in_dtype(value, dtype)
            if inner is not value:
                moved[key] = inner
    if not moved:
        return base
    out = copy.copy(base)
    vars(out).update(moved)
    return out


def read_parameters(
    site: Site, node: dict, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The parameters of ``site`` in its trace ``node``, in its canonical layout (the
    family record's ``read_params``: precision for a Normal); computed from the
    distribution's tensors in ``dtype`` where given (:func:`in_dtype`), else in the dtype
    the model computed them in."""
    base, _ = unwrap(node["fn"])
    if dtype is not None:
        base = in_dtype(base, dtype)
    params, laid_out = lookup(site.family).read_params(base, site)
    if laid_out:
        return params
    full = site.batch_shape + site.event_shape
    return {k: canon(site, v.expand(full)) for k, v in params.items()}


def site_parameters(ctx: CompileContext, site: Site, node: dict) -> dict[str, torch.Tensor]:
    """The site's parameters in its canonical layout (precision for a Normal), floating
    ones in the data's dtype: a prior written with Python numbers holds float32 tensors
    (Pyro's default), and float64 data keep their precision. The distribution's own
    tensors are cast before anything is derived from them (:func:`in_dtype`): a Normal's
    scale 10.0, exact in float32, gives the precision 0.01 of float64 data; a number that
    float32 cannot hold (0.1) stays as torch rounded it."""
    params = read_parameters(site, node, ctx.dtype)
    if ctx.dtype is None:
        return params
    return {k: v.to(ctx.dtype) if v.is_floating_point() else v for k, v in params.items()}


def every_site_parameters(ctx: CompileContext, run: Trace) -> dict[str, dict[str, torch.Tensor]]:
    """The parameters of every site of the plan in the trace ``run``, by site name."""
    sites = ctx.plan.sites
    return {n: site_parameters(ctx, x, run.nodes[x.pyro_name]) for n, x in sites.items()}


def probe_run(
    ctx: CompileContext, kind: Any, make: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, dict[str, torch.Tensor]]:
    """The parameters of every site in the run of ``kind``: the model with its latent
    sites at their base values but for ``make()`` (latent values by site name, in the
    Pyro layout). Traced once per kind (``ctx.runs``), shared by every parameter."""
    if kind not in ctx.runs:
        sites = ctx.plan.sites
        values = dict(ctx.base_values)
        values.update({sites[n].pyro_name: v for n, v in make().items()})
        ctx.runs[kind] = every_site_parameters(ctx, trace_at(ctx, values))
    return ctx.runs[kind]


def probe_values(plan: Plan) -> dict[str, torch.Tensor]:
    """A random value of every latent site, canonical layout (for the verifying run)."""
    generator = torch.Generator().manual_seed(2)
    out = {}
    for n in plan.latent:
        site = plan.sites[n]
        value = draw(site.family, [plan.sizes[d] for d in site.dims], site.n_cat, generator)
        ref = plan.ref
        out[n] = value.to(ref) if value.is_floating_point() else value.to(ref.device)
    return out
