"""Starting values of VMP's factors: ``VMP(model, init=...)`` or ``VMP.init(..., init=...)``.

A start is one of

* ``"prior"``: the mean of every latent Normal and MultivariateNormal factor drawn from
  its prior (the factor the prior gives it, its parents at their initial factors);
* a dict, site name -> a tensor (the factor's mean, in the site's Pyro shape: the batch
  shape, then the event shape; the factor's spread is the one its prior gives) or
  ``"prior"`` (that site's mean drawn as above); a latent Categorical site's tensor is its
  initial probabilities (as ``init_resp``), a ``pyro.param`` site's its initial value;
* a :class:`~probfsl.inference.vmp.engine.VMPState` of the same model on data of the same
  shapes: every factor taken from it.

The draws are seeded: site ``name``'s noise comes from a CPU generator seeded by the
engine's ``seed`` and the site's name (so a site's draws do not depend on which other
sites are drawn), is drawn over the site's non-task axes and shared by every task (so a
batch equals its tasks run alone, as the Categorical sites' initial noise), and is moved
to the data's device (the same numbers on every device).

A site given a start keeps it through ``init``: the other factors start as without one
(their prior, then one update from their children), reading the given ones.

How a family's factor takes a mean, and which families' means ``"prior"`` draws, is the
family record's (:meth:`~probfsl.inference.vmp.family.Family.start_at_mean`,
:meth:`~probfsl.inference.vmp.family.Family.start_drawn`).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from probfsl.inference.vmp import layout
from probfsl.inference.vmp.family import REGISTRY, lookup
from probfsl.inference.vmp.layout import Plan, Site


def normalise(plan: Plan, init: Any) -> dict:
    """``init`` as a dict site name -> tensor or ``"prior"`` (``"prior"`` alone: every
    latent site whose mean it draws: Normal and MultivariateNormal), checked against the
    plan: ``ValueError``
    (one sentence naming the site) for a name that is no latent site, a value of another
    shape, or a start the site's factor cannot take."""
    if init is None:
        return {}
    if isinstance(init, str):
        if init != "prior":
            raise ValueError(f'init must be "prior", a dict or a VMPState, got {init!r}')
        return {
            n: "prior"
            for n in plan.latent
            if _drawable(plan.sites[n]) and not plan.sites[n].at_prior
        }
    if not isinstance(init, dict):
        raise ValueError(f'init must be "prior", a dict or a VMPState, got {type(init).__name__}')
    out = {}
    for name, value in init.items():
        s = plan.sites.get(name)
        if s is None or s.observed:
            raise ValueError(f"init names {name!r}, which is not a latent site of the model")
        if s.chain is not None or s.at_prior:
            kind = "a Gaussian Markov chain" if s.chain is not None else "kept at its prior"
            raise ValueError(f"init cannot start site {name!r}: its factor is {kind}")
        record = lookup(s.family)
        labels = record.labels
        if isinstance(value, str):
            if value != "prior" or not _drawable(s):
                raise ValueError(
                    f'init[{name!r}] may be "prior" only for a latent {_drawn_families()} '
                    f"site; {name!r} is {s.fn_name}, give its mean"
                )
            out[name] = value
            continue
        if not (s.point or labels or record.takes_mean()):
            raise ValueError(f"init cannot start site {name!r}: a {s.fn_name} factor")
        v = torch.as_tensor(value, device=plan.ref.device).to(plan.ref)
        shape = tuple(s.batch_shape) + tuple(s.event_shape) + ((s.n_cat,) if labels else ())
        plates = sorted(s.keep)  # the Pyro batch axes that are plates
        if len(shape) > v.dim() == len(shape) - len(s.batch_shape) + len(plates):
            full = [1] * len(s.batch_shape) + list(v.shape[len(plates) :])
            for j, i in enumerate(plates):
                full[i] = v.shape[j]
            v = v.reshape(full)  # the unit batch axes (plates the site is not in) restored
        try:
            v = v.expand(shape)
        except RuntimeError:
            raise ValueError(
                f"init[{name!r}] must have the site's shape {shape} (or without its axes "
                f"of size 1 that are no plate of it), got {tuple(v.shape)}"
            ) from None
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"init[{name!r}] holds NaN or infinite values")
        out[name] = v
    return out


def _drawable(s: Site) -> bool:
    return lookup(s.family).draws_start() and not s.point and s.chain is None


def _drawn_families() -> str:
    """The families whose mean ``"prior"`` draws, in words (scalar ones first)."""
    drawn = sorted((r for r in REGISTRY.values() if r.draws_start()), key=lambda r: r.event_rank)
    names = [r.name for r in drawn]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of site ``name``'s draws: seeded by ``seed`` and the name."""
    mixed = seed * 2_654_435_761 % (1 << 62) + zlib.crc32(name.encode())
    return torch.Generator().manual_seed(mixed)


def draw(s: Site, factor: tuple, seed: int) -> tuple:
    """``factor`` (a Normal or MultivariateNormal factor from the prior) with its mean drawn
    from it by site ``s``'s generator (:func:`generator`; the family's
    :meth:`~probfsl.inference.vmp.family.Family.start_drawn`)."""
    return lookup(s.family).start_drawn(s, factor, generator(seed, s.name))


def gaussian_draw(factor: tuple, joint: bool, g: torch.Generator) -> tuple:
    """A Gaussian ``factor`` (loc, precision; a precision matrix where ``joint``) with its
    mean drawn from it: loc + L ε, L L^T its covariance, ε standard normal from ``g`` over
    the non-task axes (shared by the tasks)."""
    loc, precision = factor
    shape = torch.broadcast_shapes(loc.shape, precision.shape[:-1] if joint else precision.shape)
    eps = torch.randn(shape[1:], generator=g, dtype=torch.float64).to(loc).expand(shape)
    if joint:
        chol = torch.linalg.cholesky(precision)  # P = C C^T, so C^-T ε has covariance P^-1
        step = torch.linalg.solve_triangular(
            chol.transpose(-1, -2).expand(*shape, shape[-1]), eps.unsqueeze(-1), upper=True
        ).squeeze(-1)
    else:
        step = eps * precision.rsqrt()
    return (loc + step, precision)


def with_mean(s: Site, factor: tuple, value: torch.Tensor) -> tuple:
    """``factor`` (the prior's, canonical layout) moved to the mean ``value`` (canonical),
    as the family moves it (:meth:`~probfsl.inference.vmp.family.Family.start_at_mean`):
    a Normal's location; a Gamma's rate (its shape kept); a Beta's or Dirichlet's
    concentrations (their sum kept); a Wishart's scale (its degrees of freedom kept). A
    factor joint over several plates takes the mean over their merged entries."""
    if s.joint and s.joint_axes > 1:
        value = value.flatten(-s.joint_axes)
    return lookup(s.family).start_at_mean(s, factor, value)


def canonical(s: Site, value: torch.Tensor) -> torch.Tensor:
    """A start value in the site's Pyro shape, in the canonical layout (contiguous)."""
    return layout.canon(s, value).contiguous()


def from_state(plan: Plan, previous: Any) -> dict:
    """The factors of ``previous`` (a VMPState) for ``plan``: ``ValueError`` (one sentence
    naming the site) when its sites or their shapes differ."""
    missing = sorted(set(plan.latent) - set(previous.q))
    if missing:
        raise ValueError(f"init state has no factor of the latent site(s) {missing}")
    q = {}
    for name, factor in previous.q.items():
        if name in plan.sites and name not in plan.latent:
            raise ValueError(f"init state has a factor of {name!r}, an observed site here")
        ours = _shape_of(plan, name)
        theirs = _shape_of(previous.plan, name)
        if ours != theirs:
            raise ValueError(
                f"init state's factor of {name!r} is for shape {theirs}, the data give {ours}"
            )
        q[name] = tuple(t.to(plan.ref.device) for t in factor)
    return q


def _shape_of(plan: Plan, name: str) -> tuple | None:
    s = plan.sites.get(name)
    if s is None:  # a Gaussian chain's own entry: its members' sizes
        members = plan.chains.get(name, [])
        return tuple(_shape_of(plan, m) for m in members)
    return tuple(plan.sizes[d] for d in s.dims)
