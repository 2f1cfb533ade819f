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

One factor is joint over one axis: a map that sums over two plates of a site, or two maps
that sum one site over different plates, would need a factor joint over both (a Gaussian
over D₁ D₂ entries) and are refused (:func:`refusal`), with the fix: one plate of D₁ D₂
entries, reshaped in the model, which is grouped. A product of factors over the entries
would not be fitted by coordinate ascent here: the entries coupled by one sum are updated
together, and a simultaneous (Jacobi) update of coupled coordinates may lower the bound.

:func:`plate_groups` says which plates are grouped; :class:`JointOverPlate` is the factor
as a distribution in the model's shape (for :meth:`VMP.posterior
<probfsl.inference.vmp.VMP.posterior>` and :meth:`VMP.guide
<probfsl.inference.vmp.VMP.guide>`): draws are joint over the plate, and its
``log_prob`` spreads the joint log-density ln q(w) evenly over the plate's entries, so
that their sum, which Pyro's ``Trace_ELBO`` takes, is ln q(w).
"""

from __future__ import annotations

import torch
from pyro.distributions import MultivariateNormal, TorchDistribution
from torch.distributions import constraints

from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import TASKS, Site, uncanon

_NO_SHAPE = torch.Size()


def plate_groups(parent: Site, axes: list) -> bool:
    """Whether a linear map that sums over the plate axes ``axes`` of ``parent`` groups
    them into one joint factor: one plate axis of a Normal site without event axes (a
    plate of independent Normals), the last axis of the site's layout (where
    :func:`arrange` has moved it), where the joint factor keeps the axis it is joint over;
    never a member of a Gaussian Markov chain."""
    return _groupable(parent, axes) and parent.dims[-1] == axes[0]


def _groupable(parent: Site, axes: list) -> bool:
    """One summed plate axis of a latent Normal site without event axes, outside chains."""
    record = lookup(parent.family)
    return (
        len(axes) == 1
        and axes[0] != TASKS
        and record.elementwise
        and record.gaussian
        and parent.event_dim == 0
        and parent.chain is None
    )


def summed_plates(parent: Site, dims: tuple) -> list:
    """The plate axes of ``parent`` (without event axes) that a parameter with axes
    ``dims`` sums over: those it does not have."""
    n_plates = len(parent.dims) - parent.event_dim
    return [d for d in parent.dims[:n_plates] if d not in dims]


def arrange(ctx: CompileContext, parent: Site, dims: tuple) -> None:
    """Before a linear map with axes ``dims`` is read: where it sums over one plate of a
    plate of Normals (:func:`_groupable`) that is not yet the last axis of the site's
    layout, move that axis last (the joint factor's event position), unless the factor is
    already joint over another axis (:func:`refusal` then says why)."""
    axes = summed_plates(parent, dims)
    if not _groupable(parent, axes) or parent.dims[-1] == axes[0] or parent.joint:
        return
    move_last(parent, axes[0], ctx.probes)


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
    if parent.joint and len(axes) == 1 and _groupable(parent, axes):
        return (
            f"the map sums over the parent's plate axis {axes[0]!r}, and another map sums "
            f"it over {parent.dims[-1]!r}: a factor joint over one axis cannot hold both "
            f"(a Gaussian joint over both axes is not supported); {one}"
        )
    if len(axes) > 1:
        return (
            f"the map sums over the parent's plate axes {axes}, which cannot be grouped "
            "into one joint Gaussian factor (a factor is joint over one axis); " + one
        )
    return (
        f"the map sums over the parent's plate axes {axes}, which cannot be grouped into "
        "one joint Gaussian factor: a plate of latent Normal sites without event axes is "
        "grouped over one plate axis (not tasks); sum over an event axis (.to_event(1)) "
        "instead"
    )


def grouped_plate(s: Site) -> str | None:
    """The plate axis a site's joint factor groups (None for a site that is not a
    grouped plate of Normals: a ``.to_event(1)`` Normal is joint over an event axis)."""
    return s.dims[-1] if s.joint and s.event_dim == 0 else None


def plate_dim(s: Site) -> int:
    """The Pyro batch dim (negative) of the plate a site's joint factor groups: the
    Pyro axis of the layout's last plate axis."""
    return s.keep[s.perm[-1]] - len(s.batch_shape)


class JointOverPlate(TorchDistribution):
    """A MultivariateNormal over one plate axis, in the model's batch shape (each entry
    of the plate an element of the batch, as Pyro's plate makes it).

    ``joint`` is the factor, batched over the other axes, with the plate axis as its
    event axis; ``dim`` is the plate's batch dim (negative). Samples are drawn from
    ``joint`` and the plate axis moved into place; ``log_prob`` gives each entry
    ln q(w) / D, whose sum over the plate is the joint log-density."""

    arg_constraints: dict = {}
    support = constraints.real
    has_rsample = True

    def __init__(self, joint: MultivariateNormal, dim: int, validate_args=None):
        if dim >= 0:
            raise ValueError(f"dim must be a negative batch dim, got {dim}")
        self.joint, self.dim = joint, dim
        shape = list(joint.batch_shape)
        size = joint.event_shape[0]
        at = len(shape) + dim + 1
        if at < 0:
            raise ValueError(
                f"plate dim {dim} lies left of the factor's batch shape {tuple(shape)}"
            )
        shape.insert(at, size)
        super().__init__(torch.Size(shape), torch.Size(), validate_args=validate_args)

    @property
    def size(self) -> int:
        return self.joint.event_shape[0]

    def expand(self, batch_shape, _instance=None):
        batch_shape = list(batch_shape)
        if batch_shape[self.dim] != self.size:
            raise ValueError(
                f"cannot expand the plate axis (size {self.size}) at dim {self.dim} to "
                f"batch shape {tuple(batch_shape)}"
            )
        del batch_shape[self.dim]
        return JointOverPlate(self.joint.expand(torch.Size(batch_shape)), self.dim)

    def rsample(self, sample_shape=_NO_SHAPE):
        return self.joint.rsample(sample_shape).movedim(-1, self.dim)

    def sample(self, sample_shape=_NO_SHAPE):
        with torch.no_grad():
            return self.rsample(sample_shape)

    def log_prob(self, value):
        lp = self.joint.log_prob(value.movedim(self.dim, -1)) / self.size
        lp = lp.unsqueeze(self.dim)
        shape = list(lp.shape)
        shape[self.dim] = self.size
        return lp.expand(shape)

    @property
    def mean(self):
        return self.joint.mean.movedim(-1, self.dim)

    @property
    def variance(self):
        return self.joint.variance.movedim(-1, self.dim)

    def entropy(self):
        h = self.joint.entropy() / self.size
        return h.unsqueeze(self.dim).expand(self.batch_shape)


def posterior(s: Site, loc: torch.Tensor, precision: torch.Tensor) -> JointOverPlate:
    """The joint factor of a grouped plate site (canonical ``loc`` [..., D] and
    ``precision`` [..., D, D]) as a :class:`JointOverPlate` in the model's batch shape."""
    dim = plate_dim(s)
    loc = uncanon(s, loc).expand(s.batch_shape)
    precision = uncanon(s, precision)
    precision = precision.expand(*s.batch_shape, precision.shape[-1])
    joint = MultivariateNormal(
        loc.movedim(dim, -1), precision_matrix=precision.movedim(dim - 1, -2)
    )
    return JointOverPlate(joint, dim)
