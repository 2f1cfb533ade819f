"""The Categorical family: labels, latent (a mixture's selector) or observed."""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.vmp import messages, normal
from probfsl.inference.vmp.einsum import ein
from probfsl.inference.vmp.family import Family, register
from probfsl.inference.vmp.layout import Plan, Site, canon, derived
from probfsl.inference.vmp.moments import expected_stats, parent_ops, weights


@register
class Categorical(Family):
    """u(z) = onehot(z); conjugate parent of its probabilities: a Dirichlet (selected by
    a Categorical site when observed), or a fixed table selected by a latent one."""

    name = "Categorical"
    pyro_class = dist.Categorical
    roles = {"probs": ("Dirichlet", "Categorical")}
    conjugate = {"probs": "Dirichlet"}
    hints = {
        "probs": "a Dirichlet site (selected by a Categorical site when the Categorical is "
        "observed), or, observed, a fixed table selected by a Categorical site"
    }
    labels = True
    whole_numbers = True
    selectable_constant = True
    block = expfam.Categorical
    fields = ("probs",)
    linear_parameter = "probs"
    forms = (
        "Categorical(probs <- Dirichlet site, indexed by a Categorical site when observed, or "
        "an observed one's fixed table indexed by a latent Categorical site; a latent one may "
        "be tempered by poutine.scale)",
    )

    def categories(self, base):
        return base.probs.shape[-1]

    def declare(self, site, base, sizes):
        site.n_cat = base.probs.shape[-1]
        sizes[f"{site.name}#cat"] = site.n_cat
        return None

    def read_params(self, base, site):
        full = site.batch_shape + site.event_shape + (site.n_cat,)
        return {"probs": canon(site, base.probs.expand(full))}, True

    def param_dims(self, site, key):
        return site.dims + (f"{site.name}#cat",) if key == "probs" else site.dims

    def stat_dims(self, site):
        return (site.dims + (f"{site.name}#cat",),)

    def data_limit(self, base, site):
        return site.n_cat - 1, f"its data must be labels 0 to {site.n_cat - 1}"

    def observe(self, site, value, dtype):
        # the labels were checked (whole, 0 to n_cat - 1: :meth:`data_limit`); the one-hot
        # rows written in ``dtype`` at once (``one_hot`` checks them again, in two host
        # synchronisations, and writes 64-bit integers first)
        site.value = value
        one_hot = torch.zeros(*value.shape, site.n_cat, dtype=dtype, device=value.device)
        site.stats = (one_hot.scatter_(-1, value.long().unsqueeze(-1), 1.0),)

    def draw(self, shape, n_cat, generator):
        return torch.randint(0, n_cat, shape, generator=generator, device="cpu")

    def extreme(self, shape, n_cat, pattern):
        return torch.full(shape, n_cat - 1 if pattern == "high" else 0, dtype=torch.long)

    def linear_child(self, site):
        # a linear child only where its probabilities are selected (a mixture's table)
        key = super().linear_child(site)
        return key if key is not None and site.params[key].comp is not None else None

    def linear_terms(self, plan, q, site):
        """Categorical(x | θ_z), u(θ) = ln θ: coefficients (one-hot x,)."""
        return [[(1, [(site.stats[0], site.dims + (f"{site.name}#cat",))])]], []

    def posterior(self, params):
        return dist.Categorical(probs=params[0])

    def natural(self, plan, q, site, kids):
        """E ln π, weighed by the mask (or a tempering scale); where its children are
        sites it selects (:func:`~probfsl.inference.vmp.messages.lse_applies`) and the
        first is a Normal site, its E ln N per component is formed with it: one full-size
        pass, not two."""
        cd = site.dims + (f"{site.name}#cat",)
        M = [] if site.mask is None else [(site.mask, site.mask_dims)]
        eta = ein(cd, M + [log_probs(plan, q, site)], cd, plan.sizes, plan.ref, expand=False)
        first = kids and messages.normal_selected(plan, kids[0][0])
        if first and messages.lse_applies(plan, site):
            (child, role), rest = kids[0], kids[1:]
            return normal.message(plan, q, plan.sites[child], role, site, offset=eta), rest
        if kids and kids[0][1] == "select":
            # labels under a selected table: the looked-up ⟨ln φ⟩ is a new tensor in the
            # layout of q(z); the prior term is added to it in place (one full-size
            # tensor less per update)
            c = plan.sites[kids[0][0]]
            if c.family == "Categorical" and self.linear_child(c) is not None:
                picked = label_lookup(plan, q, c, site)
                if picked is not None:
                    return [picked[0].add_(eta)], kids[1:]
        return [eta.expand([plan.sizes[d] for d in cd])], kids

    def labels_update(self, plan, q, site):
        """Labels whose one child is an observed Categorical under a table selected by them
        (LDA's topic per word): the softmax on the table (:func:`folded_update`)."""
        kids = plan.children[site.name]
        if site.mask is not None or site.fixed_mask is not None or len(kids) != 1:
            return None
        c = plan.sites[kids[0][0]]
        if kids[0][1] != "select" or c.family != self.name or self.linear_child(c) is None:
            return None
        return folded_update(plan, q, c, site)

    def message(self, plan, q, site, role, to):
        """To a Dirichlet: the counts Σ_n x_n; to the label choosing a fixed table:
        Σ_c x_nc ln table_kc. A selected Dirichlet table's: a linear child's, read off at
        the labels where it can be (:func:`label_lookup`, :func:`label_counts`)."""
        if self.linear_child(site) is not None:
            if role == "select":
                return label_lookup(plan, q, site, to)
            return label_counts(plan, q, site, to)
        p = site.params["probs"]
        cd = site.dims + (f"{site.name}#cat",)
        M = [] if site.mask is None else [(site.mask, site.mask_dims)]
        R = expected_stats(plan, q, site.name)[0]
        sizes, ref = plan.sizes, plan.ref
        if role == "select":
            ops = M + [(R, cd), log_probs(plan, q, site)]
            return [ein(to.dims + (p.comp,), ops, cd, sizes, ref)]
        out = tuple(p.rename[d] for d in to.dims)
        return [ein(out, M + [(R, cd)], cd, sizes, ref)]

    def loglik(self, plan, q, site, out):
        """Σ ⟨x⟩ ⟨ln π⟩, a table chosen by a selector weighted by its q. A selected
        Dirichlet table's: a linear child's."""
        if self.linear_child(site) is not None:
            return None
        R = expected_stats(plan, q, site.name)[0]
        cd = site.dims + (f"{site.name}#cat",)
        M = [] if site.mask is None else [(site.mask, site.mask_dims)]
        W, comp = weights(plan, q, site)
        over = cd + ((comp,) if comp else ())
        ops = M + W + [(R, cd), log_probs(plan, q, site)]
        return ein(out, ops, over, plan.sizes, plan.ref)


def log_probs(plan: Plan, q: dict, s: Site) -> tuple:
    """⟨ln π⟩ of a Categorical site's probabilities (a Dirichlet parent's, or the fixed
    ones' logarithm) as (tensor, axes)."""
    pi = parent_ops(plan, q, s, "probs")
    if pi is not None:
        return pi[0]
    p = s.params["probs"]
    return derived(p, "log_probs"), p.const_dims


def label_lookup(plan: Plan, q: dict, s: Site, to: Site) -> list | None:
    """The message of an observed Categorical x under a selected Dirichlet table φ to its
    selector z: E ln p(x_n | z_n = k) = ⟨ln φ_k⟩ at the label x_n, read from ⟨ln φ⟩ at
    precomputed positions (a linear child's message sums ⟨ln φ_k⟩ against the one-hot x,
    whose other terms are exact zeros: the same numbers, without the product over the
    categories). ``None`` (that sum) where x has a mask or axes that z does not have, or
    no labels.

    The result is laid out in memory as the natural parameter of z that it is added to
    (the axes of z's prior term ⟨ln π⟩, its categories as the components, then the
    child's other axes): that sum then runs along memory, and q(z) keeps the layout in
    which the products and sums that read it round as before."""
    p = s.params["probs"]
    out = to.dims + (p.comp,)
    if s.mask is not None or s.value is None or set(out) != set(s.dims + (p.comp,)):
        return None
    log_table, dims = parent_ops(plan, q, s, "probs")[0]
    own = f"{to.name}#cat"
    first = [p.comp if d == own else d for d in log_probs(plan, q, to)[1]]
    order = tuple(first + [d for d in out if d not in first])
    if not set(dims) <= set(order) | {f"{s.name}#cat"}:  # a table axis x does not have
        return None
    key = ("labels", s.name, tuple(log_table.shape))
    index = plan.cache.get(key)
    if index is None:
        index = plan.cache[key] = _positions(plan, s, log_table.shape, dims, order)
    picked = log_table.reshape(-1).index_select(0, index)
    picked = picked.view([plan.sizes[d] for d in order])
    return [picked.permute([order.index(d) for d in out])]


def folded_update(plan: Plan, q: dict, s: Site, to: Site) -> tuple | None:
    """q(z) of the labels ``to`` whose one child is ``s``, an observed Categorical x under
    a table φ that z selects, with the ELBO terms of :func:`~probfsl.inference.vmp.
    messages.lse_applies`: η_nk = ⟨ln π⟩_k + ⟨ln φ_k⟩ at x_n depends on n only through the
    axes of ⟨ln π⟩ and x_n, so the prior term is added to the table (in the axes of
    ⟨ln π⟩, the components first, then x's categories), the softmax and its ln Σ exp are
    taken there, and both are read off at the labels (q(z) laid out as
    :func:`label_lookup` lays out η): the same numbers, elementwise, as the softmax of η,
    on a table smaller than η (LDA: a document's 20 words take one of 12 values).
    ``None`` (the softmax of η) where :func:`label_lookup` does not apply, where φ has an
    axis that ⟨ln π⟩ does not or where the table would not be smaller."""
    key = ("folded", to.name)
    recipe = plan.cache.get(key, False)
    if recipe is None:
        return None
    log_table, dims = parent_ops(plan, q, s, "probs")[0]
    prior, prior_dims = log_probs(plan, q, to)
    if recipe is False:  # the axes and shapes of both are the plan's: worked out once
        recipe = _fold_recipe(plan, s, to, (dims, log_table.shape), (prior_dims, prior.shape))
        plan.cache[key] = recipe
        if recipe is None:
            return None
    table_view, prior_view, k, index, view, perm, lse_read = recipe
    # ⟨ln φ⟩ + ⟨ln π⟩ (the sum of :meth:`Categorical.natural`; the order of the operands
    # does not change it), row-major in the table's axes
    eta = log_table.permute(table_view[0]).reshape(table_view[1]) + prior.permute(
        prior_view[0]
    ).reshape(prior_view[1])
    eta = eta.contiguous()  # (already, from operands in their canonical layout)
    r, m, z = messages.softmax(eta.movedim(k, -1), True)  # in place: ``eta`` holds q(z)
    probs = eta.view(-1).index_select(0, index).view(view).permute(perm)
    if lse_read is None:
        return probs, None
    index, view, perm = lse_read
    lse = (m + z.log()).reshape(-1)  # the table's axes but the components, row-major
    return probs, messages.sum_tasks(lse.index_select(0, index).view(view).permute(perm))


def _fold_recipe(plan: Plan, s: Site, to: Site, table_of: tuple, prior_of: tuple):
    """How :func:`folded_update` reads ⟨ln φ⟩ and ⟨ln π⟩ (``table_of``, ``prior_of``: their
    axes and shapes) for the labels ``to`` and their child ``s``, worked out once per
    plan: the views of both in the table's axes, the place of the components in them,
    and the positions, shape and permutation that read q(z) and (where
    :func:`~probfsl.inference.vmp.messages.lse_applies`) ln Σ exp off at the labels.
    ``None``: the fold does not apply."""
    p = s.params["probs"]
    (dims, _), (prior_dims, _) = table_of, prior_of
    out = to.dims + (p.comp,)
    if s.mask is not None or s.value is None or set(out) != set(s.dims + (p.comp,)):
        return None
    own, cat = f"{to.name}#cat", f"{s.name}#cat"
    first = tuple(p.comp if d == own else d for d in prior_dims)
    rest = tuple(d for d in out if d not in first)
    if not set(first) <= set(out) or not set(dims) <= set(first) | {cat} or not rest:
        return None
    sizes = plan.sizes
    # the components outermost: the softmax's passes over them run along whole slices
    table = (p.comp,) + tuple(d for d in first if d != p.comp) + (cat,)
    shape = tuple(sizes[d] for d in table)
    if math.prod(shape) > math.prod(sizes[d] for d in out):
        return None
    views = _view_of(table_of, table), _view_of((first, prior_of[1]), table)
    if tuple(torch.broadcast_shapes(views[0][1], views[1][1])) != shape:
        return None  # an axis of size one in both (the positions are the full table's)
    order = first + rest
    index = _positions(plan, s, shape, table, order)
    read = (index, [sizes[d] for d in order], [order.index(d) for d in out])
    lse_read = None
    if messages.lse_applies(plan, to):
        kept = tuple(d for d in table if d != p.comp)
        order = kept[:-1] + rest
        index = _positions(plan, s, tuple(sizes[d] for d in kept), kept, order)
        lse_read = (index, [sizes[d] for d in order], [order.index(d) for d in to.dims])
    return (*views, 0, *read, lse_read)


def _view_of(of: tuple, target: tuple) -> tuple:
    """The permutation and shape that view a tensor of axes and shape ``of`` (its axes a
    subset of ``target``) in the axes ``target``, size 1 where it has none."""
    dims, shape = of
    perm = sorted(range(len(dims)), key=lambda i: target.index(dims[i]))
    own = dict(zip(dims, shape, strict=True))
    return perm, [own.get(d, 1) for d in target]


def label_counts(plan: Plan, q: dict, s: Site, to: Site) -> list | None:
    """The message of an observed Categorical x under a table φ selected by a latent label
    z to φ: the counts Σ_n q(z_n = k) [x_n = c], each entry of q(z) added at its component
    and x's label there (``scatter_add_``: a third of the time of the batched product with
    the one-hot x and its copy of q(z)): the terms of the linear child's sum over x's
    one-hot without its zeros, in the order that sum adds them (x's other axes in q(z)'s
    memory order), so the same numbers. ``None`` (that sum) where x has a mask, axes that
    q(z) does not have, or no labels, where φ has an axis that neither has, or where q(z)
    is not dense."""
    p = s.params["probs"]
    if s.mask is not None or s.value is None or p.selector is None:
        return None
    r = q[p.selector][0]
    r_dims = plan.sites[p.selector].dims + (p.comp,)
    own = f"{s.name}#cat"
    out = tuple(p.rename[d] for d in to.dims)
    if not set(s.dims) <= set(r_dims) or not set(out) <= set(r_dims) | {own}:
        return None
    perm = _memory_order(r)
    if perm is None:
        return None
    order = tuple(r_dims[i] for i in perm)
    shape = tuple(plan.sizes[d] for d in out)
    key = ("counts", s.name, shape, order)
    index = plan.cache.get(key)
    if index is None:
        index = plan.cache[key] = _positions(plan, s, shape, out, order, wide=True)
    counts = r.new_zeros(math.prod(shape)).scatter_add_(0, index, r.permute(perm).reshape(-1))
    return [counts.view(shape)]


def _memory_order(t: torch.Tensor) -> tuple | None:
    """The permutation of ``t``'s axes that lists them as laid out in memory (outermost
    first), where that makes it contiguous; ``None`` where it does not (broadcast or
    sliced axes)."""
    perm = tuple(sorted(range(t.dim()), key=lambda i: -t.stride(i)))
    return perm if t.permute(perm).is_contiguous() else None


def _positions(
    plan: Plan, s: Site, shape: tuple, dims: tuple, order: tuple, wide: bool = False
) -> torch.Tensor:
    """For every entry of the axes ``order`` (row-major), the position in the row-major
    flattening of a table of ``shape`` (axes ``dims``, x's categories among them) of the
    entry at its axes' coordinates and x's label there: ``[prod of order's sizes]``, in 32
    bits where they fit (half the bytes for ``index_select`` to read) unless ``wide``. The
    offsets of the other axes are summed on their own axes and added to the scaled labels
    in one pass over the full size (a compaction's first sweep forms them anew)."""
    cat = dims.index(f"{s.name}#cat")
    dtype = torch.int32 if math.prod(shape) < 2**31 and not wide else torch.int64
    labels = s.value.to(dtype)
    sizes = plan.sizes
    scaled = ein(order, [(labels, s.dims)], (), sizes, labels)  # broadcast (stride 0)
    offset = None
    for i, d in enumerate(dims):
        if i == cat or shape[i] == 1:
            continue
        coord = torch.arange(shape[i], dtype=dtype, device=labels.device) * math.prod(
            shape[i + 1 :]
        )
        coord = coord.reshape([shape[i] if o == d else 1 for o in order])
        offset = coord if offset is None else offset + coord
    flat = torch.empty([sizes[d] for d in order], dtype=dtype, device=labels.device)
    step = math.prod(shape[cat + 1 :])
    if offset is None:
        torch.mul(scaled, step, out=flat)
    else:
        torch.add(offset, scaled, alpha=step, out=flat)
    return flat.reshape(-1)
