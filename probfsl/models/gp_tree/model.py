"""GP-Tree's generative model given the tree: one GP per internal node (docs/design/gp-tree.md §2).

Achituve et al., "GP-Tree", ICML 2021, §3.1–3.3. Each internal node v of the class tree
(:mod:`probfsl.models.gp_tree.tree`) holds an independent GP f_v ~ GP(0, s_v·RBF(l_v)) on
L2-normalised features. Every training point routed through v (its class is below v)
has a node label y_v = 1 iff its class is in the right subtree, with a logistic
likelihood made conjugate by ω ~ PG(1, 0):
σ(f)^y(1−σ(f))^{1−y} = ½ e^{κf} E[e^{−ωf²/2}], κ = y − ½.

The model is written over a batch of nodes, one row per internal node of a tree, padded
to a common number of points and masked (:func:`node_batch`; padded points carry no
information, so a padded row equals its node alone). Two parametrisations, each the
declared model of one engine of :mod:`probfsl.inference.gp_tree_nodes`:

* :func:`gp_tree_model` — with inducing values f̄_v at inputs X̄_v (the m_c exemplars of
  each class below v, :func:`inducing_slots`): f̄_v ~ N(0, K_mm), f_v | f̄_v the SVGP
  conditional; :class:`~probfsl.inference.gp_tree_nodes.VINodes` gives its guide
  q(f̄_v) = N(μ̃_v, Σ̃_v), q(ω_vi) = PG(1, c_vi).
* :func:`gp_tree_exact_model` — the exact kernel f_v ~ N(0, K_v) at the node's points,
  sampled by :class:`~probfsl.inference.gp_tree_nodes.GibbsNodes`.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference import gp_tree_nodes as gpn
from probfsl.inference.polya_gamma import PolyaGamma
from probfsl.models.gp_tree.tree import Tree


def gp_tree_model(
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    z: torch.Tensor,
    zmask: torch.Tensor,
    outputscale: torch.Tensor,
    lengthscale: torch.Tensor,
    jitter: float = 1e-2,
) -> None:
    """The tree's node GPs with inducing values (sites ``fbar``, ``f``, ``omega``, ``y``).

    Row v is internal node v: ``x [V, n, D]`` its routed points, ``y [V, n]`` their node
    labels (1 = right subtree), ``mask [V, n]``, ``z [V, M, D]`` and ``zmask [V, M]`` its
    inducing inputs, ``outputscale, lengthscale [V]`` its kernel. f̄_v ~ N(0, K_mm + jitter·I);
    f_vi | f̄_v ~ N((A f̄_v)_i, K̃_ii), A = K_nm K_mm⁻¹, K̃_ii = K_ii − (A K_mn)_ii (each
    f_vi has the GP's marginal N(0, K_ii) up to the jitter); ω_vi ~ PG(1, 0); y_vi enters
    through the augmented factor ½ exp(κf − ωf²/2), whose ω-marginal is
    σ(f)^{y}(1 − σ(f))^{1−y}. :meth:`VINodes.guide
    <probfsl.inference.gp_tree_nodes.VINodes.guide>` is its guide, whose ``Trace_ELBO`` is the
    engine's analytic ELBO.
    """
    t = gpn.vi_terms(x, y, mask, z, zmask, outputscale, lengthscale, jitter)
    zero = x.new_zeros(x.shape[0], 1, z.shape[1])
    with pyro.plate("nodes", x.shape[0], dim=-2):
        fbar = pyro.sample("fbar", dist.MultivariateNormal(zero, t.Kmm.unsqueeze(-3)))
        gpn.node_sites(t, fbar, None)


def gp_tree_exact_model(
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    keys: torch.Tensor | None = None,
    outputscale: float = 8.0,
    lengthscale: float = 1.0,
    jitter: float = 1e-3,
) -> None:
    """The tree's node GPs with the exact kernel (sites ``f``, ``omega``, ``y``).

    Row v is internal node v (as in :func:`gp_tree_model`): f_v ~ N(0, K_v + jitter·I) at
    its points (padded points: independent N(0, 1), no likelihood), ω_vi ~ PG(1, 0), and
    the augmented factor ½ exp(κf − ωf²/2). ``keys`` (the per-node random streams of
    :meth:`GibbsNodes.init <probfsl.inference.gp_tree_nodes.GibbsNodes.init>`) are not part
    of the model; they are accepted so that the model has the engine's data signature.
    """
    xn = gpn.normalize(x)
    m = mask.bool()
    V, n = m.shape
    s = x.new_full((V,), outputscale)
    ls = x.new_full((V,), lengthscale)
    K = gpn.masked_gram(gpn.rbf_kernel(xn, xn, s, ls), m, jitter)
    kappa = (y.to(x.dtype) - 0.5) * m.to(x.dtype)
    with pyro.plate("nodes", V, dim=-2):
        f = pyro.sample("f", dist.MultivariateNormal(x.new_zeros(V, 1, n), K.unsqueeze(-3)))
        f = f.squeeze(-2)
        with pyro.plate("points", n, dim=-1), pyro.poutine.mask(mask=m):
            omega = pyro.sample("omega", PolyaGamma(torch.zeros_like(kappa)))
            pyro.factor("y", kappa * f - omega * f.pow(2) / 2 - math.log(2.0))


# ==================================================================== the nodes' data


def node_batch(
    tree: Tree, node_ids: list[int], feats: dict[int, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded inputs ``[V, n_max, D]``, 0/1 node labels (1 = right) and mask ``[V, n_max]``
    of the nodes ``node_ids`` of ``tree``; ``feats`` maps a class to its rows ``[n_c, D]``.

    Node v's rows are its classes' rows in ``node.classes`` order; padding is zeros with
    mask False.
    """
    xs, ys = [], []
    for v in node_ids:
        node = tree.nodes[v]
        xs.append(torch.cat([feats[c] for c in node.classes]))
        ys.append(
            torch.cat(
                [
                    torch.full(
                        (len(feats[c]),),
                        float(c in node.right),
                        dtype=xs[-1].dtype,
                        device=xs[-1].device,
                    )
                    for c in node.classes
                ]
            )
        )
    n_max = max(len(x) for x in xs)
    ref = xs[0]
    x = ref.new_zeros(len(xs), n_max, ref.shape[-1])
    mask = torch.zeros(len(xs), n_max, dtype=torch.bool, device=ref.device)
    y = ref.new_zeros(len(xs), n_max)
    for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
        x[i, : len(xi)] = xi
        y[i, : len(yi)] = yi
        mask[i, : len(xi)] = True
    return x, y, mask


def inducing_slots(
    tree: Tree,
    node_ids: list[int],
    classes: list[int],
    n_inducing: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the flattened inducing inputs ``[C·m_c, D]`` that each node uses, and a mask.

    Node v's inducing inputs are the ``n_inducing`` exemplars of each class below it
    (§3.6), class ``classes[i]`` owning rows i·m_c … (i+1)·m_c − 1. Returns ``idx`` and
    ``zmask`` ``[V, M_max]`` (padded slots: index 0, mask False).
    """
    pos = {c: i for i, c in enumerate(classes)}
    m_max = n_inducing * max(len(tree.nodes[v].classes) for v in node_ids)
    idx = torch.zeros(len(node_ids), m_max, dtype=torch.long, device=device)
    zmask = torch.zeros(len(node_ids), m_max, dtype=torch.bool, device=device)
    for i, v in enumerate(node_ids):
        cls = [pos[c] for c in tree.nodes[v].classes]
        slots = torch.as_tensor(cls, device=device).repeat_interleave(n_inducing)
        within = torch.arange(n_inducing, device=device).repeat(len(cls))
        flat = slots * n_inducing + within
        idx[i, : len(flat)] = flat
        zmask[i, : len(flat)] = True
    return idx, zmask
