"""Chain detection: Gaussian Markov chains among the latent Normal sites
(docs/design/vmp.md §6.7): scalar chains (each step a copy or an elementwise map of the one
before) and vector chains, the latent states of a linear-Gaussian state-space model (each
step a fixed matrix map of the one before, x_t ~ N(A_t x_{t−1} + b_t, diag(λ_t)⁻¹)).

Reads the plan once every parameter map is read (the locations and their parents);
marks each chain in the plan (``Plan.chains``, and each member's ``Site.chain``) so that
it gets one joint factor (:mod:`~probfsl.inference.vmp.gaussian_chain`).
"""

from __future__ import annotations

from probfsl.inference.vmp.checks import refuse
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import Plan, Site
from probfsl.inference.vmp.matrix_maps import matrix_of


def _predecessor(sites: dict[str, Site], site: Site) -> str | None:
    """The chain step before ``site``: the latent Normal its location copies (or maps
    elementwise, a s + d), with the same axes and no selection; ``None`` where ``site``
    is no chain step."""
    scalar = lookup(site.family).gaussian and lookup(site.family).elementwise
    if not scalar or site.observed or site.point or site.joint or site.mask is not None:
        return None
    loc = site.params.get("loc")
    if loc is None or loc.comp is not None or loc.bilinear is not None:
        return None
    if loc.parent is not None and not loc.terms:  # a copy of the step before
        pred = sites[loc.parent]
        renamed = all(loc.rename[d] == d for d in pred.dims)
    elif loc.parent is None and len(loc.terms) == 1 and loc.terms[0].axis is None:
        pred, renamed = sites[loc.terms[0].parent], True  # a s + d, elementwise
    else:
        return None
    same = pred.dims == site.dims and renamed
    special = pred.point or pred.joint or pred.mask is not None
    record = lookup(pred.family)
    plain = record.gaussian and record.elementwise and not special
    if not (same and plain and site.params["precision"].comp is None):
        return None
    return pred.name


def vector_predecessor(sites: dict[str, Site], site: Site, sizes: dict) -> str | None:
    """The vector chain step before ``site``: the latent Gaussian x_{t−1} whose last event
    axis the location of ``site`` contracts with a fixed matrix, x_t ~ N(A x_{t−1} + b,
    diag(λ)⁻¹) (a Normal with one event axis, ``.to_event(1)``), or with a latent matrix A
    (a Normal site with two event axes, :mod:`~probfsl.inference.vmp.matrix_maps`), with
    the same other axes and the same number of states, and no selection; ``None`` where
    ``site`` is no such step."""
    loc = _vector_state(site)
    if loc is None:
        return None
    if matrix_of(sites, loc) is not None:  # A x_{t−1} + b with A a latent matrix
        pred_name, axis = loc.bilinear.v, loc.bilinear.axis_v
    elif loc.bilinear is None and loc.parent is None and len(loc.terms) == 1:
        pred_name, axis = loc.terms[0].parent, loc.terms[0].axis
    else:
        return None
    pred = sites[pred_name]
    special = pred.observed or pred.point or pred.mask is not None or pred.event_dim != 1
    if special or axis is None or not lookup(pred.family).gaussian or pred.dims[-1] != axis:
        return None
    if pred.dims[:-1] != site.dims[:-1] or sizes[pred.dims[-1]] != sizes[site.dims[-1]]:
        return None
    return pred.name


def _vector_state(site: Site):
    """The location of ``site`` where it can be a state of a vector chain (a latent Normal
    with one event axis, no mask, its location and precision not selected); else None."""
    record = lookup(site.family)
    if not (record.gaussian and record.elementwise) or site.event_dim != 1:
        return None
    if site.observed or site.point or site.mask is not None:
        return None
    loc, prec = site.params.get("loc"), site.params.get("precision")
    if loc is None or prec is None or loc.comp is not None or prec.comp is not None:
        return None
    return loc


def copy_step(sites: dict[str, Site], site: Site) -> bool:
    """Whether ``site``, a latent Normal with one event axis, has the state before as its
    mean, x_t ~ N(x_{t−1}, diag(λ)⁻¹): a step of a vector chain with A = I and b = 0
    where its group of such steps holds a joint factor (:func:`vector_copies`)."""
    loc = _vector_state(site)
    if loc is None or loc.parent is None or loc.terms or loc.bilinear is not None:
        return False
    pred = sites[loc.parent]
    if pred.observed or pred.point or pred.mask is not None or pred.event_dim != 1:
        return False
    if not lookup(pred.family).gaussian or pred.dims[:-1] != site.dims[:-1]:
        return False
    return all(loc.rename[d] == d for d in pred.dims[:-1])


def vector_copies(sites: dict[str, Site]) -> set[str]:
    """The copy steps (:func:`copy_step`) whose group (the states linked by copy steps)
    holds a joint factor, an observation or a map that mixes a state's entries: the
    states of such a group are one vector chain (A = I), even those no observation
    reaches; in a group without one, each entry is a scalar chain of its own."""
    group = {n: n for n in sites}

    def root(n: str) -> str:
        while group[n] != n:
            n = group[n]
        return n

    steps = [s for s in sites.values() if copy_step(sites, s)]
    for s in steps:
        group[root(s.name)] = root(s.params["loc"].parent)
    joint = {root(s.name) for s in sites.values() if s.joint}
    # a group with no joint state, whose steps are not scalar chains either (the event
    # axes of a `.to_event(1)` state are its own), is a vector chain too: one factor per
    # state would be mean-field across time
    return {s.name for s in steps if root(s.name) in joint or _predecessor(sites, s) is None}


def find_chains(plan: Plan) -> None:
    """Gaussian Markov chains: latent Normal sites s_1, s_2, ... each of whose mean is
    the one before it, or an elementwise affine map of it (a s + d with fixed a and d:
    a drift, a scaled step), with the same axes and no selection, the first with any
    prior. Vector chains likewise: each state a Normal with one event axis whose mean is a
    fixed or latent matrix map of the state before (:func:`vector_predecessor`), the first
    a Normal or MultivariateNormal with any prior. A fork ends a chain. Each chain gets one
    joint factor (:mod:`~probfsl.inference.vmp.gaussian_chain`); a latent transition
    matrix keeps a factor of its own (mean-field between it and the chain), declared
    before the chain's first state (the chain's factor starts from its prior, which reads
    it: ``ValueError`` otherwise)."""
    sites = plan.sites
    successor: dict[str, str | None] = {}
    kind: dict[str, str] = {}  # a step's kind: a chain is all scalar or all vector steps
    copies = vector_copies(sites)
    for name in plan.latent:
        if name in copies:  # x_{t−1} itself, A = I: a vector step
            pred, kind[name] = sites[name].params["loc"].parent, "vector"
        else:
            pred, kind[name] = _predecessor(sites, sites[name]), "scalar"
        if pred is None:
            pred, kind[name] = vector_predecessor(sites, sites[name], plan.sizes), "vector"
        if pred is not None:
            successor[pred] = None if pred in successor else name  # a fork: no chain
    heads = [n for n, nxt in successor.items() if nxt and n not in successor.values()]
    for head in heads:
        members = [head, successor[head]]
        while successor.get(members[-1]) and kind[successor[members[-1]]] == kind[members[1]]:
            members.append(successor[members[-1]])
        name = f"chain:{head}"
        _check_matrices_first(plan, members)
        plan.chains[name] = members
        for position, member in enumerate(members):
            sites[member].chain = (name, position)
        if kind[members[1]] == "vector":
            # every state but the last is read by the next as a joint Gaussian (the last
            # may keep its marginal variances: no step reads it)
            for member in members[:-1]:
                _mark_joint_state(plan, sites[member])


def _mark_joint_state(plan: Plan, s: Site) -> None:
    """A state of a vector chain as a joint Gaussian over its event axis (as a state that
    a map contracts is), whether or not anything mixes its entries: a copy step (the
    state before as the mean) reads it so."""
    if s.joint or not lookup(s.family).elementwise:
        return
    axis = s.dims[-1]
    s.joint, s.joint_axes = True, 1
    plan.sizes[axis + "b"] = plan.sizes[axis]


def _check_matrices_first(plan: Plan, members: list[str]) -> None:
    """``ValueError`` for a latent transition matrix declared after the chain's first
    state (the chain's factor, started from its prior at that state, reads it)."""
    order = list(plan.sites)
    for member in members[1:]:
        s = plan.sites[member]
        matrix = matrix_of(plan.sites, s.params["loc"])
        if matrix is not None and order.index(matrix) > order.index(members[0]):
            raise refuse(
                member,
                s.fn_name,
                f"{matrix!r} ({plan.sites[matrix].fn_name})",
                f"the latent transition matrix must be declared before the chain's first "
                f"state {members[0]!r}",
            )
