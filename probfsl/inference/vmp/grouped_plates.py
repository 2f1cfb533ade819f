"""Plates of independent Normal sites that a linear map sums over, fitted as one joint
Gaussian factor over the plate axis (docs/design/vmp.md §7.1).

A plate of Normals, ``with pyro.plate("coefs", D): w = pyro.sample("w", Normal(m, s))``,
has the density Π_d N(w_d | m_d, s_d²) of the diagonal Gaussian over the plate axis: the
density of the ``.to_event(1)`` Normal. Where a likelihood sums over that axis (``X @ w``)
it couples the entries, so the plan groups them into one factor, a MultivariateNormal
over the plate axis (Winn & Bishop 2005 §3: a factor may hold any group of variables
whose conditionals are conjugate; BayesPy's ``GaussianARD``): its updates, messages and
bound are the ``.to_event(1)`` Normal's (``Site.joint``), and the prior's messages to
parents declared inside the plate (ARD precisions, one per coefficient) stay per entry,
since they read only the elementwise moments (⟨w_d⟩, ⟨w_d²⟩).

The summed plate may sit anywhere in the site's batch shape: weights ``W`` [D, C] of C
outputs, declared in a plate ``coefs`` (dim -2) and a plate ``outputs`` (dim -1) and used
as ``X @ W``, are joint over ``coefs`` and independent across ``outputs``, q(W) =
Π_c N(W_{·c} | m_c, Λ_c⁻¹) (the posterior of C separate regressions, which is exact
here: the likelihood Π_{n,c} N(y_nc | x_nᵀ W_{·c}, β⁻¹) does not couple the columns).
:func:`arrange` moves the summed axis to the end of the site's canonical layout (the
factor's event position; :func:`~probfsl.inference.vmp.layout.canon` and
:func:`~probfsl.inference.vmp.layout.uncanon` move it there and back), the other plates
stay batch axes of the factor.

A map may sum a site over several of its plates: ``W`` [A, B] in plates ``rows`` x
``cols`` with the mean ⟨X_n, W⟩ = Σ_ab X_nab W_ab couples all A·B entries. The plates are
then merged, as the user would by hand with one plate of A·B entries reshaped in the
model: :func:`arrange` moves them last in the layout (in their order), and the factor is
one MultivariateNormal over their A·B entries, row-major (``Site.joint_axes`` = 2). Only
the factor is merged; the layout keeps the plates as axes of their own, so that every
message, and every parent declared inside the plates (an ARD precision per entry, or per
row broadcast over the columns, whose message sums over them), contracts by axis names
as before. :func:`to_factor` turns natural parameters and messages over the layout's
axes into the factor's (elementwise second parts as diagonal matrices, [..., A, B, A',
B'] as [..., A·B, A·B]); :func:`to_layout` splits the factor's moments back. The other
plates of the site stay independent batch axes of the factor.

One factor is joint over one set of plates: two maps that sum one site over different
sets of plates (``X @ W`` over ``coefs`` and ``(W * v).sum(-1)`` over ``outputs``) would
need a factor joint over the union of those plates and are refused (:func:`refusal`),
with the fix: one plate of all the entries, reshaped in the model, which every map then
sums and which is grouped. A product of factors over the entries would not be fitted by
coordinate ascent here: the entries coupled by one sum are updated together, and a
simultaneous (Jacobi) update of coupled coordinates may lower the bound.

:func:`plate_groups` says which plates are grouped; :class:`JointOverPlate` is the factor
as a distribution in the model's shape (for :meth:`VMP.posterior
<probfsl.inference.vmp.VMP.posterior>` and :meth:`VMP.guide
<probfsl.inference.vmp.VMP.guide>`): draws are joint over the plate (or the merged
plates), and its ``log_prob`` spreads the joint log-density ln q(w) evenly over the
entries, so that their sum, which Pyro's ``Trace_ELBO`` takes, is ln q(w).
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import MultivariateNormal, TorchDistribution
from torch.distributions import constraints

from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import TASKS, Plan, Site, uncanon

_NO_SHAPE = torch.Size()


def contracted(axis: str | tuple | None) -> tuple:
    """The parent axes a linear term contracts (its ``axis``: none, one, or the several
    plate axes of a merged factor), as a tuple."""
    if axis is None:
        return ()
    return (axis,) if isinstance(axis, str) else tuple(axis)


def joint_axes(s: Site) -> tuple:
    """The layout axes a joint Normal factor is over: its last ``s.joint_axes`` axes."""
    return s.dims[len(s.dims) - s.joint_axes :]


def plate_groups(parent: Site, axes: list) -> bool:
    """Whether a linear map that sums over the plate axes ``axes`` of ``parent`` groups
    them into one joint factor: plate axes of a Normal site without event axes (a plate
    of independent Normals), the last axes of the site's layout (where :func:`arrange`
    has moved them), and the very axes its factor is joint over where another map has
    grouped it already; never a member of a Gaussian Markov chain."""
    k = len(axes)
    return (
        _groupable(parent, axes)
        and parent.dims[len(parent.dims) - k :] == tuple(axes)
        and (not parent.joint or parent.joint_axes == k)
    )


def _groupable(parent: Site, axes: list) -> bool:
    """Summed plate axes (one, or several of a latent site: merged into one) of a Normal
    site without event axes, outside chains, none of them the tasks axis."""
    record = lookup(parent.family)
    return (
        len(axes) >= 1
        and TASKS not in axes
        and (len(axes) == 1 or not parent.point)
        and record.elementwise
        and record.gaussian
        and parent.event_dim == 0
        and parent.chain is None
    )


def summed_plates(parent: Site, dims: tuple) -> list:
    """The plate axes of ``parent`` (without event axes) that a parameter with axes
    ``dims`` sums over: those it does not have, in the site's layout order."""
    n_plates = len(parent.dims) - parent.event_dim
    return [d for d in parent.dims[:n_plates] if d not in dims]


def arrange(ctx: CompileContext, parent: Site, dims: tuple) -> None:
    """Before a linear map with axes ``dims`` is read: where it sums over plates of a
    plate of Normals (:func:`_groupable`) that are not yet the last axes of the site's
    layout, move them last, in their order (the joint factor's event position, where
    several are merged into one), unless the factor is already joint over other axes
    (:func:`refusal` then says why)."""
    axes = summed_plates(parent, dims)
    at_end = parent.dims[len(parent.dims) - len(axes) :] == tuple(axes)
    if not _groupable(parent, axes) or at_end or parent.joint:
        return
    for axis in axes:
        move_last(parent, axis, ctx.probes)


def move_last(s: Site, axis: str, probes: dict) -> None:
    """Lay out site ``s`` with its plate ``axis`` last: its axes, how Pyro's tensors map
    to them (``perm``), its parameters' axes, and the canonical tensors read so far (its
    probe value, a point's initial value) follow. Every message contracts by axis names,
    so the maps read before keep their meaning."""
    at = s.dims.index(axis)
    old = s.dims
    s.dims = old[:at] + old[at + 1 :] + (axis,)
    s.perm = s.perm[:at] + s.perm[at + 1 :] + [s.perm[at]]
    for p in s.params.values():
        if p.dims[: len(old)] == old:
            p.dims = s.dims + p.dims[len(old) :]
    if s.name in probes:
        probes[s.name] = probes[s.name].movedim(at, -1)
    if s.init is not None:
        s.init = s.init.movedim(at, -1)


def refusal(parent: Site, dims: tuple) -> str:
    """Why a linear map with axes ``dims`` that sums over plates of ``parent`` is not
    grouped, and the fix."""
    axes = summed_plates(parent, dims)
    one = (
        "declare the weights in one plate of their entries' number and reshape them in the "
        "model (that plate is grouped), or sum over an event axis (.to_event(1)) instead"
    )
    if parent.joint and _groupable(parent, axes):
        mine, other = _named(axes), _named(joint_axes(parent))
        union = [d for d in parent.dims if d in axes or d in joint_axes(parent)]
        return (
            f"the map sums over the parent's plate {mine}, and another map sums it over "
            f"{other}: a factor joint over one set of plates cannot hold both (that needs "
            f"one Gaussian joint over the union of the plates, {union}, which is not "
            f"supported); {one}"
        )
    if len(axes) > 1 and parent.point and TASKS not in axes:
        return (
            f"the map sums the point estimate over its plate axes {axes}, which are not "
            "merged for a pyro.param (a latent plate of Normal sites is); declare it in one "
            "plate of its entries' number and reshape it in the model"
        )
    return (
        f"the map sums over the parent's plate axes {axes}, which cannot be grouped into "
        "one joint Gaussian factor: a plate of latent Normal sites without event axes is "
        "grouped over its summed plate axes (not tasks); sum over an event axis "
        "(.to_event(1)) instead"
    )


def _named(axes) -> str:
    """``axis 'a'`` or ``axes ['a', 'b']``, for a refusal."""
    axes = list(axes)
    return f"axis {axes[0]!r}" if len(axes) == 1 else f"axes {axes}"


def grouped_plate(s: Site) -> tuple | None:
    """The plate axes a site's joint factor groups (None for a site that is not a
    grouped plate of Normals: a ``.to_event(1)`` Normal is joint over an event axis)."""
    return joint_axes(s) if s.joint and s.event_dim == 0 else None


def plate_dims(s: Site) -> tuple:
    """The Pyro batch dims (negative) of the plates a site's joint factor groups, in the
    layout's order: layout axis j is the kept Pyro axis ``perm[j]``, the batch axis
    ``keep[perm[j]]``."""
    n = len(s.dims)
    return tuple(s.keep[s.perm[j]] - len(s.batch_shape) for j in range(n - s.joint_axes, n))


def merged_sizes(plan: Plan, s: Site) -> list:
    """The sizes of the axes a joint factor is over."""
    return [plan.sizes[d] for d in joint_axes(s)]


def to_factor(plan: Plan, s: Site, i: int, t: torch.Tensor) -> torch.Tensor:
    """A natural parameter (``i`` = 0: η₁, 1: η₂) of a joint Normal site, or a child's
    message, from the layout's axes to the factor's: the joint axes (k of them) merged
    into one (their entries in row-major order), an elementwise second part [..., A, B]
    made the diagonal matrix it is, a matrix one [..., A, B, A', B'] reshaped into
    [..., A·B, A·B]."""
    k = s.joint_axes
    if i == 1 and t.dim() >= len(s.dims) + k:  # a matrix message (over both copies)
        if k == 1:
            return t
        sizes = merged_sizes(plan, s) * 2
        t = t.expand(*t.shape[: t.dim() - 2 * k], *sizes)
        return t.flatten(-k).flatten(-k - 1, -2)
    if k > 1:  # η₁, or an elementwise η₂: the merged axis
        t = t.expand(*t.shape[: t.dim() - k], *merged_sizes(plan, s)).flatten(-k)
    return t if i == 0 else torch.diag_embed(t)


def to_layout(plan: Plan, s: Site, t: torch.Tensor, matrix: bool = False) -> torch.Tensor:
    """A moment of a joint Normal factor in the layout's axes: the merged axis (and,
    ``matrix``, its second copy: ⟨x xᵀ⟩) split back into the joint axes."""
    if s.joint_axes == 1:
        return t
    sizes = merged_sizes(plan, s)
    if matrix:
        return t.unflatten(-1, sizes).unflatten(-1 - len(sizes), sizes)
    return t.unflatten(-1, sizes)


class JointOverPlate(TorchDistribution):
    """A MultivariateNormal over the entries of one plate, or of several plates merged,
    in the model's batch shape (each entry of the plates an element of the batch, as
    Pyro's plates make it).

    ``joint`` is the factor, batched over the other axes, with the plates' entries as its
    event axis (row-major in the order of ``dim``); ``dim`` is the plate's batch dim
    (negative), or a tuple of the plates' dims, in that order. Samples are drawn from
    ``joint``, split into the plates and moved into place; ``log_prob`` gives each entry
    ln q(w) / D (D the number of entries), whose sum over the plates is the joint
    log-density."""

    arg_constraints: dict = {}
    support = constraints.real
    has_rsample = True

    def __init__(
        self,
        joint: MultivariateNormal,
        dim: int | tuple,
        sizes: tuple | None = None,
        validate_args=None,
    ):
        dims = (dim,) if isinstance(dim, int) else tuple(dim)
        sizes = (joint.event_shape[0],) if sizes is None else tuple(sizes)
        if not dims or any(d >= 0 for d in dims):
            raise ValueError(f"dim must be negative batch dims, got {dim}")
        if len(sizes) != len(dims) or math.prod(sizes) != joint.event_shape[0]:
            raise ValueError(
                f"plate sizes {sizes} do not give the factor's {joint.event_shape[0]} entries"
            )
        n = len(joint.batch_shape) + len(dims)
        at = [n + d for d in dims]
        if min(at) < 0 or len(set(at)) != len(at):
            raise ValueError(
                f"plate dims {dims} do not fit the factor's batch shape {tuple(joint.batch_shape)}"
            )
        rest = iter(joint.batch_shape)
        placed = dict(zip(at, sizes, strict=True))
        shape = [placed[i] if i in placed else next(rest) for i in range(n)]
        self.joint, self.dims, self.sizes = joint, dims, sizes
        super().__init__(torch.Size(shape), torch.Size(), validate_args=validate_args)

    @property
    def dim(self) -> int | tuple:
        """The plate's batch dim, or the plates' dims where several are merged."""
        return self.dims[0] if len(self.dims) == 1 else self.dims

    @property
    def size(self) -> int:
        return self.joint.event_shape[0]

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        """[..., D] (the merged entries last) to the model's shape: the entries split into
        the plates, each moved to its dim."""
        k = len(self.dims)
        return t.unflatten(-1, self.sizes).movedim(tuple(range(-k, 0)), self.dims)

    def _spread(self, t: torch.Tensor) -> torch.Tensor:
        """A value per joint draw [..., batch] expanded over the plates' entries."""
        k = len(self.dims)
        t = t.reshape(*t.shape, *[1] * k).movedim(tuple(range(-k, 0)), self.dims)
        shape = list(t.shape)
        for d, size in zip(self.dims, self.sizes, strict=True):
            shape[d] = size
        return t.expand(shape)

    def expand(self, batch_shape, _instance=None):
        batch_shape = list(batch_shape)
        if [batch_shape[d] for d in self.dims] != list(self.sizes):
            raise ValueError(
                f"cannot expand the plates (sizes {self.sizes}) at dims {self.dims} to "
                f"batch shape {tuple(batch_shape)}"
            )
        n = len(batch_shape)
        rest = [s for i, s in enumerate(batch_shape) if i - n not in self.dims]
        return JointOverPlate(self.joint.expand(torch.Size(rest)), self.dims, self.sizes)

    def rsample(self, sample_shape=_NO_SHAPE):
        return self._place(self.joint.rsample(sample_shape))

    def sample(self, sample_shape=_NO_SHAPE):
        with torch.no_grad():
            return self.rsample(sample_shape)

    def log_prob(self, value):
        k = len(self.dims)
        flat = value.movedim(self.dims, tuple(range(-k, 0))).flatten(-k)
        return self._spread(self.joint.log_prob(flat) / self.size)

    @property
    def mean(self):
        return self._place(self.joint.mean)

    @property
    def variance(self):
        return self._place(self.joint.variance)

    def entropy(self):
        return self._spread(self.joint.entropy() / self.size)


def posterior(s: Site, loc: torch.Tensor, precision: torch.Tensor) -> JointOverPlate:
    """The joint factor of a grouped plate site (canonical ``loc`` [..., D] and
    ``precision`` [..., D, D], D the entries of its merged plates) as a
    :class:`JointOverPlate` in the model's batch shape: split into the plates' axes,
    to Pyro's shape, and the plates' dims moved last and merged again."""
    dims = plate_dims(s)
    k = len(dims)
    sizes = tuple(s.batch_shape[d] for d in dims)
    loc = uncanon(s, loc.unflatten(-1, sizes)).expand(s.batch_shape)
    precision = uncanon(s, precision.unflatten(-1, sizes).unflatten(-1 - k, sizes))
    precision = precision.expand(*s.batch_shape, *sizes)
    last = tuple(range(-k, 0))
    loc = loc.movedim(dims, last).flatten(-k)
    precision = precision.movedim(tuple(d - k for d in dims), tuple(d - k for d in last))
    precision = precision.flatten(-k).flatten(-k - 1, -2)
    return JointOverPlate(MultivariateNormal(loc, precision_matrix=precision), dims, sizes)
