"""Site reading: each sample site of the first trace read into a
:class:`~probfsl.inference.vmp.layout.Site` (docs/design/vmp.md §6.3).

Reads the first trace and the point estimates' initial values
(:class:`~probfsl.inference.vmp.context.CompileContext`); returns the sites by logical
name and the sizes of their named axes (:func:`read_sites`), the latent sites in their
update order (:func:`latent_order`) and the plan's reference tensor
(:func:`reference_value`). A site's family is its record in the registry
(:func:`~probfsl.inference.vmp.family.of_distribution`); it is observed or latent
(``obs_mask`` halves merged), its plates and event dimensions become named axes, its
``poutine.scale`` a temper (a latent Categorical only), its mask a reduced tensor, and an
observed site's data are checked and stored with their statistics (:func:`read_data`).
Anything else is refused (:func:`~probfsl.inference.vmp.checks.refuse`).
"""

from __future__ import annotations

from typing import Any

import pyro.distributions as dist
import torch
from pyro.poutine.trace_struct import Trace

from probfsl.inference.vmp import at_prior
from probfsl.inference.vmp.checks import (
    all_finite,
    first_offender,
    position,
    refuse,
    support_holds,
    support_refusal,
    unwrap,
)
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.family import Family, lookup, of_distribution
from probfsl.inference.vmp.layout import TASKS, Site, canon, dtype_of, reduce_constant
from probfsl.inference.vmp.monomials import plain


def shared_point_error(name: str, want: tuple | None = None) -> ValueError:
    """The refusal of a ``pyro.param`` site shared by every task (``want``: the batch
    shape it should have, where known)."""
    shape = (
        "" if want is None else f"; give it the batch shape {want} (or declare it inside the plate)"
    )
    return ValueError(
        f"VMP cannot point-estimate the pyro.param site {name!r}: it needs one value per "
        f"task, an axis of the tasks' length where the {TASKS!r} plate puts it (a parameter "
        f"shared by every task would couple the tasks){shape}"
    )


def tempering(scale: Any, family: str, observed: bool) -> float | None:
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


def sample_sites(trace: Trace) -> list[dict]:
    """The trace's sample sites that VMP reads (no deterministic, ``Delta`` or subsample
    site); ``ValueError`` where there are none."""
    nodes = [
        s
        for s in trace.nodes.values()
        if s["type"] == "sample"
        and not s["infer"].get("_deterministic")
        and not isinstance(s["fn"], dist.Delta)
        and type(s["fn"]).__name__ != "_Subsample"
    ]
    if not nodes:
        raise ValueError("VMP needs a model with sample sites; this model has none")
    return nodes


def reference_value(nodes: list[dict], trace: Trace) -> torch.Tensor:
    """The plan's reference tensor (its dtype and device): the first floating value of a
    site of ``nodes``, else a zero in the first floating parameter's dtype."""
    ref = next((plain(s["value"]) for s in nodes if s["value"].is_floating_point()), None)
    if ref is None:  # every value discrete: the first floating parameter's dtype
        ref = torch.zeros((), dtype=dtype_of(trace), device=nodes[0]["value"].device)
    return ref


def read_sites(
    ctx: CompileContext, trace: Trace, nodes: list[dict]
) -> tuple[dict[str, Site], dict[str, int]]:
    """Every site of ``nodes`` (:func:`sample_sites`) by logical name, in model order (an
    ``obs_mask`` site's halves as one), and the sizes of their named axes."""
    sizes: dict[str, int] = {}
    sites: dict[str, Site] = {}
    for node in nodes:
        name = node["name"]
        if name.endswith("_observed") and name[:-9] + "_unobserved" in trace.nodes:
            continue  # merged with its ``_unobserved`` twin
        site = read_site(ctx, node, trace, sizes)
        sites[site.name] = site
    return sites, sizes


def latent_order(sites: dict[str, Site], sizes: dict[str, int], order: list[str] | None) -> list:
    """The latent sites in their update order: ``order`` where given, else the model's
    declaration order with the point estimates last (variational EM: the factors, the E
    step, before the point estimates, the M step, so that the first sweep reads the model's
    initial values of the parameters). ``ValueError`` for a model without latent sites, an
    axis of size 0, or an ``order`` that does not list the latent sites."""
    latent = [n for n, s in sites.items() if not s.observed]
    latent = [n for n in latent if not sites[n].point] + [n for n in latent if sites[n].point]
    if not latent:
        raise ValueError(
            f"VMP needs at least one latent site; every site of the model is observed "
            f"({sorted(sites)})"
        )
    empty = sorted(name for name, size in sizes.items() if size == 0)
    if empty:
        raise ValueError(f"VMP needs data: the plate(s) or axes {empty} have size 0")
    if order is not None:
        if sorted(order) != sorted(latent):
            raise ValueError(f"order must list the latent sites {latent}, got {order}")
        latent = list(order)
    return latent


def read_site(ctx: CompileContext, node: dict, trace: Trace, sizes: dict[str, int]) -> Site:
    """One sample site (its trace ``node``) as a :class:`Site`, its axes' sizes added to
    ``sizes``: layout, point estimate, the family's declarations, mask and data."""
    scale, site = _site_layout(ctx, node, trace, sizes)
    logical, fname = site.name, site.fn_name
    base, _ = unwrap(node["fn"])
    record = of_distribution(base)
    batch_shape, event_shape = site.batch_shape, site.event_shape
    site.at_prior = at_prior.marked(node)
    if logical in ctx.points:
        site.point, site.fn_name = True, "pyro.param"
        init = ctx.points[logical].to(dtype_of(trace))
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
    _read_mask(site, node, trace, scale)
    if site.observed:
        read_data(site, record, base, node["value"], dtype_of(trace))
    return site


def _site_layout(
    ctx: CompileContext, node: dict, trace: Trace, sizes: dict[str, int]
) -> tuple[float, Site]:
    """The site's temper and its :class:`Site`: family, named axes (plates then event
    axes, ``tasks`` first) and how Pyro's tensors map to them."""
    name, fn = node["name"], node["fn"]
    base, _ = unwrap(fn)
    record = of_distribution(base)
    family = None if record is None else record.name
    merged = name.endswith("_unobserved") and name[:-11] + "_observed" in trace.nodes
    logical = name[:-11] if merged else name
    fname = type(base).__name__
    if family is None:
        raise refuse(logical, fname, "-", f"{fname} is not a supported family")
    observed = bool(node["is_observed"]) and not merged
    scale = tempering(node["scale"], family, observed)
    if scale is None:
        raise refuse(
            logical,
            fname,
            "-",
            "poutine.scale is supported only as one positive number on a latent "
            "Categorical site (a tempered prior)",
        )
    frames = _plate_frames(ctx, node, trace, logical)
    batch_shape = tuple(fn.batch_shape)
    keep, dims = _plate_axes(node, frames, sizes, logical)
    full = _full_shape(node, logical)
    event_shape = tuple(full[len(batch_shape) :])
    if logical in ctx.points:  # its own value, not the plate's broadcast, per task
        at = next(keep[j] for j, d in enumerate(dims) if d == TASKS)
        own = (1,) * (len(full) - node["value"].dim()) + tuple(node["value"].shape)
        if own[at] != sizes[TASKS]:
            raise shared_point_error(logical)
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
        observed,
        None,
        pyro_name=name,
        event_shape=event_shape,
    )
    site.keep, site.perm = keep, order  # how to canonicalise Pyro tensors
    site.fn_name = fname
    return scale, site


def _plate_frames(ctx: CompileContext, node: dict, trace: Trace, logical: str) -> list:
    """The site's vectorised plates; a ``pyro.param`` declared outside the ``tasks`` plate
    takes it (:func:`tasks_frame_of_point`). ``ValueError`` without a ``tasks`` plate."""
    frames = [f for f in node["cond_indep_stack"] if f.vectorized]
    batch_shape = tuple(node["fn"].batch_shape)
    if TASKS not in [f.name for f in frames] and logical in ctx.points:
        frames = frames + tasks_frame_of_point(logical, trace, batch_shape)
    if TASKS not in [f.name for f in frames]:
        fname = type(unwrap(node["fn"])[0]).__name__
        raise refuse(logical, fname, "-", f"the site has no batched {TASKS!r} plate")
    return frames


def _plate_axes(
    node: dict, frames: list, sizes: dict[str, int], logical: str
) -> tuple[list[int], list[str]]:
    """The Pyro batch axes that are plates and their names, in Pyro's order (their sizes
    added to ``sizes``); ``ValueError`` for a batch axis of size > 1 that no plate
    declares."""
    batch_shape = tuple(node["fn"].batch_shape)
    by_dim = {f.dim: f for f in frames}
    keep, dims = [], []
    for i, size in enumerate(batch_shape):
        frame = by_dim.get(i - len(batch_shape))
        if frame is not None:
            keep.append(i)
            dims.append(frame.name)
            sizes[frame.name] = frame.size
        elif size != 1:
            at = i - len(batch_shape)
            fname = type(unwrap(node["fn"])[0]).__name__
            raise refuse(
                logical,
                fname,
                "-",
                f"its batch axis at dim {at} (size {size}, batch shape "
                f"{tuple(batch_shape)}) is not declared by a plate; declare a plate of "
                f"size {size} at dim={at} around the site, or move the axis into the "
                "event shape with .to_event()",
            )
    return keep, dims


def _full_shape(node: dict, logical: str) -> torch.Size:
    """The shape of the site's value broadcast with its distribution's batch and event
    shapes; ``ValueError`` where they do not fit or the value has more batch axes."""
    fn = node["fn"]
    batch_shape = tuple(fn.batch_shape)
    fname = type(unwrap(fn)[0]).__name__
    try:
        full = torch.broadcast_shapes(node["value"].shape, batch_shape + tuple(fn.event_shape))
    except RuntimeError:
        raise refuse(logical, fname, "-", "its value does not fit its distribution") from None
    if tuple(full[: len(batch_shape)]) != batch_shape:
        raise refuse(logical, fname, "-", "its value has more batch axes than its distribution")
    return full


def _read_mask(site: Site, node: dict, trace: Trace, scale: float) -> None:
    """The site's mask (``poutine.mask``, a masked distribution, the unobserved entries of
    an ``obs_mask`` site, times a temper ``scale``), reduced, and an ``obs_mask`` site's
    observed labels (``fixed``, ``fixed_mask``)."""
    base, mask = unwrap(node["fn"])
    logical, fname = site.name, type(base).__name__  # a point's too (not "pyro.param")
    record = of_distribution(base)
    merged = site.pyro_name != site.name
    batch_shape = site.batch_shape
    full_mask = node["mask"]
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
        observed = trace.nodes[logical + "_observed"]
        obs_mask = torch.as_tensor(observed["mask"], device=observed["value"].device)
        obs_mask = canon(site, obs_mask.expand(batch_shape))
        labels = canon(site, observed["value"].expand(batch_shape)).long()
        site.fixed_mask = obs_mask.bool()
        one_hot = torch.nn.functional.one_hot(labels.clamp(0, site.n_cat - 1), site.n_cat)
        site.fixed = one_hot.to(dtype_of(trace))
        full_mask = None  # the ~obs_mask of the unobserved twin
    if full_mask is None and scale != 1.0:
        full_mask = True  # a tempered site: its scale is its mask
    if full_mask is not None and not (full_mask is True and scale == 1.0):
        tensor = torch.as_tensor(full_mask, device=node["value"].device)
        tensor = canon(site, tensor.expand(batch_shape)).to(dtype_of(trace)) * scale
        if not site.observed and not record.labels:
            raise refuse(logical, fname, "-", "a mask on a latent continuous site")
        site.mask, site.mask_dims = reduce_constant(tensor, site.dims[: tensor.dim()])


def tasks_frame_of_point(name: str, trace: Trace, batch_shape: tuple) -> list:
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
        raise shared_point_error(name)
    at = len(batch_shape) + frame.dim
    if at < 0 or batch_shape[at] != frame.size:
        want = [1] * max(len(batch_shape), -frame.dim)
        want[frame.dim] = frame.size
        raise shared_point_error(name, tuple(want))
    return [frame]


def read_data(
    site: Site, record: Family, base: Any, value: torch.Tensor, dtype: torch.dtype
) -> None:
    """An observed site's data, checked (whole numbers where the family counts, in
    their support, with finite statistics) and stored with their statistics. Integer or
    bool data are taken where the family's data are whole numbers or labels
    (:meth:`~probfsl.inference.vmp.family.Family.takes_integer_data`): counts in the
    model's floating ``dtype`` (after the checks), a Categorical site's labels as given,
    a hidden Markov chain's labels in ``dtype`` before its record checks them."""
    name, fname = site.name, site.fn_name
    if not value.is_floating_point() and not record.takes_integer_data(base):
        raise refuse(name, fname, "-", f"its data are {value.dtype}; give float32 or float64")
    if record.whole_numbers:  # counts, labels
        if value.dtype == torch.bool:
            value = value.to(dtype)
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            why = "its data hold NaN or infinite values"
            raise refuse(name, fname, "-", why + _offender(site, value, ~finite))
        whole = value.round() if value.is_floating_point() else value
        inside = (value >= 0) & (value == whole)
        if not bool(inside.all()):
            why = "its data must be whole numbers >= 0"
            raise refuse(name, fname, "-", why + _offender(site, value, ~inside))
        limit = record.data_limit(base, site)
        if limit is not None and not bool((value <= limit[0]).all()):
            raise refuse(name, fname, "-", limit[1] + _offender(site, value, value > limit[0]))
        if not record.labels:  # counts are taken in the data's dtype
            value = value.to(dtype)
    elif not value.is_floating_point():  # labels its record checks (a chain's emissions)
        value = value.to(dtype)
    laid_out = canon(site, value.expand(site.batch_shape + site.event_shape))
    record.observe(site, laid_out, dtype)
    if record.labels:
        return
    inside = support_holds(site.family, laid_out)  # a Gamma's data > 0, a Dirichlet's rows
    finite = all_finite(*record.checked_stats(site))
    if not bool(finite if inside is None else finite & inside):
        if not bool(torch.isfinite(laid_out).all()):
            why = "its data hold NaN or infinite values"
            raise refuse(name, fname, "-", why + _offender(site, laid_out, None))
        outside = support_refusal(name, fname, site.family, laid_out, site.dims)
        if outside is not None:
            raise outside
        raise refuse(
            name,
            fname,
            "-",
            f"the sufficient statistics of its data (squares or logarithms) are not "
            f"finite in {laid_out.dtype}: rescale the data, or check for zeros or negative "
            "values under a Gamma or Dirichlet",
        )


def _offender(site: Site, value: torch.Tensor, bad: torch.Tensor | None) -> str:
    """``; the entry at task 0, n 3 is -2``: the first entry of the data ``value`` (Pyro's
    shape; canonical where ``bad`` is None, which then marks the entries that are not
    finite) that ``bad`` marks, by the site's axes, for a refusal of data; empty where
    none is found in the site's layout."""
    if bad is None:
        laid, laid_bad = value, ~torch.isfinite(value)
    else:
        full = tuple(site.batch_shape) + tuple(site.event_shape)
        try:
            laid, laid_bad = canon(site, value.expand(full)), canon(site, bad.expand(full))
        except RuntimeError:  # data in a shape the layout does not take: no position
            return ""
    at = first_offender(laid_bad)
    if at is None:
        return ""
    return f"; the entry at {position(site.dims, at)} is {float(laid[at]):.6g}"
