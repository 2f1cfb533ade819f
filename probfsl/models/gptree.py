"""GP-Tree: a tree of Pólya-Gamma GP binary classifiers, for few-shot class-incremental learning.

Achituve, Navon, Yemini, Chechik, Fetaya, "GP-Tree: A Gaussian Process Classifier for
Few-Shot Incremental Learning", ICML 2021 (PMLR 139, pp. 54–65), arXiv 2102.07868;
probfsl spec ``gptree.md``.

The story (spec §2): classes are the leaves of a binary tree built by recursive 2-means
on the L2-normalised class means (§3.6). Each internal node v holds an independent GP
f_v ~ GP(0, s_v·RBF(l_v)) on L2-normalised features, and every training point routed
through v (its class is below v) has a node label y_v = 1 iff its class is in the right
subtree, with a logistic likelihood made conjugate by ω ~ PG(1, 0):
σ(f)^y(1−σ(f))^{1−y} = ½ e^{κf} E[e^{−ωf²/2}], κ = y − ½. A class's probability is the
product of the node probabilities along its root-to-leaf path (§3.5), so rows sum to one.
:func:`gptree_model` declares these sample sites (``f_v``, ``omega_v``, ``y_v``) in Pyro.

Inference lives in :mod:`probfsl.inference.gp_nodes` (Gibbs and inducing-point VI,
batched over nodes) and :mod:`probfsl.inference.polya_gamma`.

Estimators:

* :class:`GPTree` — multi-class GP classifier on features with class-incremental stages:
  ``fit`` (base stage: VI or Gibbs nodes), ``partial_fit`` (a novel stage, §3.7: new Gibbs
  subtree over all novel classes so far + a new Gibbs root whose left data are the base
  classes' inducing points; the base subtree is frozen), ``predict_proba``, ``predict``,
  ``to_datatree`` (ArviZ, R-hat/ESS).
* :class:`GPTreeFewShot` — the :class:`~probfsl.models.base.FewShotClassifier` for
  ``probfsl run --method gp-tree``: a Gibbs GP-Tree on each task's support, all nodes of
  all tasks sampled in one batch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from itertools import product
from typing import Self

import numpy as np
import pyro
import pyro.distributions as dist
import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference import gp_nodes as gpn
from probfsl.inference.polya_gamma import PolyaGamma, mix32
from probfsl.models.base import BaseMeanCentering, FewShotClassifier
from probfsl.validation import (
    as_float_tensor,
    as_label_tensor,
    check_base,
    check_choice,
    check_episodes,
    check_flag,
    check_float_dtype,
    check_hyperparameter,
)

# =============================================================================== the tree


@dataclass
class Node:
    """An internal node: its classes, the split, its depth and children (node indices)."""

    classes: tuple[int, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    depth: int
    parent: int | None = None
    left_child: int | None = None
    right_child: int | None = None


@dataclass
class Tree:
    """A binary class tree: C leaves (``classes``), C−1 internal ``nodes`` (node 0 = root)."""

    classes: tuple[int, ...]
    nodes: list[Node] = field(default_factory=list)

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def paths(self) -> tuple[np.ndarray, np.ndarray]:
        """``node [C, depth_max]`` (−1 padded) and ``go_right [C, depth_max]`` per class.

        Row c follows class ``classes[c]`` from the root to its leaf.
        """
        C = self.n_classes
        steps: dict[int, list[tuple[int, bool]]] = {c: [] for c in self.classes}
        for v, node in enumerate(self.nodes):
            for c in node.left:
                steps[c].append((v, False))
            for c in node.right:
                steps[c].append((v, True))
        depth = max((len(s) for s in steps.values()), default=0)
        node_idx = -np.ones((C, max(depth, 1)), dtype=np.int64)
        go_right = np.zeros((C, max(depth, 1)), dtype=bool)
        for i, c in enumerate(self.classes):
            for j, (v, r) in enumerate(sorted(steps[c], key=lambda s: self.nodes[s[0]].depth)):
                node_idx[i, j], go_right[i, j] = v, r
        return node_idx, go_right


def kmeans(
    x: np.ndarray, k: int, n_init: int = 10, seed: int = 42, max_iter: int = 200
) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ seeding, all ``n_init`` restarts vectorised (NumPy).

    Returns (labels [n], centres [k, D]) of the restart with the least inertia. Same
    algorithm as sklearn's ``KMeans(init="k-means++", n_init)``, not its RNG stream.
    """
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    sq = (x**2).sum(1)
    centres = np.empty((n_init, k, x.shape[1]))
    first = rng.integers(n, size=n_init)
    centres[:, 0] = x[first]
    d2 = np.maximum(sq[None] - 2 * centres[:, 0] @ x.T + sq[first][:, None], 0)
    for j in range(1, k):
        p = d2 / d2.sum(1, keepdims=True).clip(1e-300)
        p[~np.isfinite(p).all(1)] = 1.0 / n
        u = rng.random(n_init)[:, None]
        pick = (np.cumsum(p, 1) < u).sum(1).clip(max=n - 1)
        centres[:, j] = x[pick]
        d2 = np.minimum(d2, np.maximum(sq[None] - 2 * centres[:, j] @ x.T + sq[pick][:, None], 0))
    labels = np.zeros((n_init, n), dtype=np.int64)
    for _ in range(max_iter):
        dist2 = (centres**2).sum(-1)[:, :, None] - 2 * centres @ x.T  # [I, k, n] (+ ‖x‖²)
        new = dist2.argmin(1)
        onehot = np.eye(k)[new]  # [I, n, k]
        counts = onehot.sum(1)  # [I, k]
        sums = onehot.transpose(0, 2, 1) @ x
        upd = np.where(counts[..., None] > 0, sums / counts.clip(1)[..., None], centres)
        if (new == labels).all() and np.allclose(upd, centres):
            break
        labels, centres = new, upd
    inertia = ((x[None] - np.take_along_axis(centres, labels[..., None], 1)) ** 2).sum((1, 2))
    best = int(np.argmin(inertia))
    return labels[best], centres[best]


def two_means_split(
    prototypes: np.ndarray, seed: int = 42, n_init: int = 50, exact_max: int = 10
) -> np.ndarray:
    """Boolean "goes right" mask of a 2-means split of unit-norm ``prototypes [S, D]``.

    S = 2: the first (smaller label) goes left. S ≤ ``exact_max``: the global minimiser of
    the within-cluster sum of squares by enumerating all 2^{S−1}−1 bipartitions (what
    k-means++ with 50 restarts finds on such small sets, without its cost). Larger S:
    k-means++ with ``n_init`` restarts and ``seed`` (:func:`kmeans`; the official code uses
    sklearn ``KMeans(2, n_init=50, random_state=42)``, §3.6); cluster 1 goes right. The
    first prototype always goes left (a pure relabelling f → −f of the node). Both sides
    are never empty: when 2-means puts every prototype in one cluster (identical
    prototypes, e.g. identical class means or D = 1), the split is by index, the first
    ⌊S/2⌋ left and the rest right.
    """
    S = prototypes.shape[0]
    if S < 2:
        raise ValueError("a split needs at least two classes")
    if S == 2:
        return np.array([False, True])
    if S <= exact_max:
        bits = np.array(list(product([0, 1], repeat=S - 1)), dtype=np.float64)[1:]
        masks = np.concatenate([np.zeros((len(bits), 1)), bits], 1)  # first item stays left
        x = prototypes.astype(np.float64)
        total = (x**2).sum()
        n_r = masks.sum(1)
        sum_r = masks @ x
        sum_l = x.sum(0) - sum_r
        sse = total - (sum_r**2).sum(1) / n_r - (sum_l**2).sum(1) / (S - n_r)
        return masks[int(np.argmin(sse))].astype(bool)
    labels, _ = kmeans(prototypes, 2, n_init=n_init, seed=seed)
    right = labels == 1
    if right.all() or not right.any():  # one cluster only: split by index
        return np.arange(S) >= S // 2
    return ~right if right[0] else right


def build_tree(
    class_means: np.ndarray,
    classes: list[int] | tuple[int, ...],
    seed: int = 42,
    n_init: int = 50,
    exact_max: int = 10,
) -> Tree:
    """Recursive 2-means on the L2-normalised class means, breadth first (spec §3.6).

    ``class_means [C, D]`` are the raw (not normalised) per-class mean features, row i
    for ``classes[i]``. Deterministic for a fixed ``seed``. Terminates on any finite
    input: every split has two non-empty sides (:func:`two_means_split`), so the tree
    has exactly C − 1 internal nodes.
    """
    class_means = np.asarray(class_means, dtype=np.float64)
    classes = tuple(int(c) for c in classes)
    if class_means.ndim != 2 or class_means.shape[0] != len(classes) or not classes:
        raise ValueError(
            f"class_means must be [C={len(classes)}, D] (one row per class), "
            f"got shape {class_means.shape}"
        )
    if not np.isfinite(class_means).all():
        raise ValueError("class_means contains NaN or inf")
    if len(set(classes)) != len(classes):
        raise ValueError("classes must be distinct")
    protos = class_means / np.linalg.norm(class_means, axis=1, keepdims=True).clip(1e-12)
    pos = {c: i for i, c in enumerate(classes)}
    tree = Tree(classes)
    queue: list[tuple[tuple[int, ...], int | None, bool, int]] = [(classes, None, False, 0)]
    while queue:
        members, parent, is_right, depth = queue.pop(0)
        if len(members) < 2:
            continue
        members = tuple(sorted(members))
        right = two_means_split(protos[[pos[c] for c in members]], seed, n_init, exact_max)
        left_c = tuple(c for c, r in zip(members, right, strict=True) if not r)
        right_c = tuple(c for c, r in zip(members, right, strict=True) if r)
        v = len(tree.nodes)
        tree.nodes.append(Node(members, left_c, right_c, depth, parent))
        if parent is not None:
            if is_right:
                tree.nodes[parent].right_child = v
            else:
                tree.nodes[parent].left_child = v
        queue.append((left_c, v, False, depth + 1))
        queue.append((right_c, v, True, depth + 1))
    return tree


def chain_tree(classes: list[int] | tuple[int, ...]) -> Tree:
    """The stick-breaking tree (Linderman et al. 2015): node i splits {c_i} | {c_{i+1}, ...}."""
    classes = tuple(int(c) for c in classes)
    tree = Tree(classes)
    for i in range(len(classes) - 1):
        parent = i - 1 if i > 0 else None
        tree.nodes.append(Node(classes[i:], (classes[i],), classes[i + 1 :], i, parent))
        if parent is not None:
            tree.nodes[parent].right_child = i
    return tree


def path_probabilities(tree: Tree, node_probs: torch.Tensor) -> torch.Tensor:
    """Class probabilities ``[N, C]`` from node probabilities p(go right) ``[n_nodes, N]`` (§3.5).

    p(c | x) = Π_{v ∈ path(c)} p_v^{d_v(c)} (1 − p_v)^{1 − d_v(c)}; columns follow
    ``tree.classes``. Padding steps contribute a factor 1.
    """
    N = node_probs.shape[-1]
    if tree.n_classes == 1:
        return node_probs.new_ones(N, 1)
    node_idx, go_right = tree.paths()
    idx = torch.as_tensor(node_idx, device=node_probs.device)
    right = torch.as_tensor(go_right, device=node_probs.device)
    p = node_probs[idx.clamp_min(0)]  # [C, depth, N]
    p = torch.where(right.unsqueeze(-1), p, 1 - p)
    p = torch.where((idx >= 0).unsqueeze(-1), p, torch.ones_like(p))
    return p.prod(1).T


# ============================================================================ Pyro model


def gptree_model(
    x: torch.Tensor,
    y: torch.Tensor,
    tree: Tree,
    outputscale: float = 8.0,
    lengthscale: float = 1.0,
    jitter: float = 1e-3,
) -> None:
    """The generative model of GP-Tree given the tree (spec §2), one sample site per node.

    For internal node v with the training points ``x[i]`` whose label ``y[i]`` is in
    ``classes(v)``: ``f_v ~ N(0, K_v)`` (exact GP on x/‖x‖), ``omega_v ~ PG(1, 0)`` and
    ``y_v`` enters via the augmented factor ½ exp(κf − ωf²/2) (κ = y_v − ½), whose
    ω-marginal is the Bernoulli-logit likelihood σ(f)^{y_v}(1 − σ(f))^{1−y_v}.
    """
    xn = gpn.normalize(x)
    for v, node in enumerate(tree.nodes):
        rows = torch.isin(y, torch.as_tensor(node.classes, device=y.device))
        xv = xn[rows]
        yv = torch.isin(y[rows], torch.as_tensor(node.right, device=y.device)).to(x.dtype)
        s = x.new_tensor([outputscale])
        ls = x.new_tensor([lengthscale])
        K = gpn.rbf_kernel(xv[None], xv[None], s, ls)[0]
        K = K + jitter * torch.eye(len(xv), dtype=x.dtype, device=x.device)
        f = pyro.sample(f"f_{v}", dist.MultivariateNormal(x.new_zeros(len(xv)), K))
        with pyro.plate(f"points_{v}", len(xv)):
            omega = pyro.sample(f"omega_{v}", PolyaGamma(x.new_zeros(len(xv))))
            pyro.factor(f"y_{v}", (yv - 0.5) * f - omega * f**2 / 2 - math.log(2.0))


# ================================================================= node groups (batching)


def group_by_size(sizes: list[int], waste: float = 1.25) -> list[list[int]]:
    """Groups of node indices of similar size (padded cost ≤ ``waste`` × actual cost).

    Cost is n³ per node (Cholesky / n·M² products). Groups are batched, so fewer groups
    mean fewer kernel launches, but padding is paid in flops: on the 136-class Omniglot
    tree ``waste`` = 2 gives 8 groups and 1.75× the unpadded flops, 1.25 gives ~14
    groups and ~1.04× (the launch overhead of a group is milliseconds).
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            n_max = sizes[g[0]]
            actual = sum(sizes[j] ** 3 for j in g) + sizes[i] ** 3
            if n_max**3 * (len(g) + 1) <= waste * actual:
                g.append(i)
                continue
        groups.append([i])
    return groups


def _pad_rows(blocks: list[torch.Tensor], n_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[n_i, D]`` blocks into ``[V, n_max, D]`` and a ``[V, n_max]`` mask."""
    ref = blocks[0]
    out = ref.new_zeros(len(blocks), n_max, ref.shape[-1])
    mask = torch.zeros(len(blocks), n_max, dtype=torch.bool, device=ref.device)
    for i, b in enumerate(blocks):
        out[i, : len(b)] = b
        mask[i, : len(b)] = True
    return out, mask


def _node_data(tree: Tree, node_ids: list[int], feats: dict[int, torch.Tensor]):
    """Padded node inputs, 0/1 labels (1 = right) and mask for the nodes ``node_ids``."""
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
    x, mask = _pad_rows(xs, n_max)
    y = torch.zeros_like(mask, dtype=x.dtype)
    for i, yi in enumerate(ys):
        y[i, : len(yi)] = yi
    return x, y, mask


@dataclass
class GibbsGroup:
    """Gibbs-fitted nodes of one tree (indices into ``tree.nodes``) and their chains."""

    node_ids: list[int]
    state: gpn.GibbsState


@dataclass
class VIGroup:
    """VI-fitted nodes: indices, variational state and the class of each inducing slot."""

    node_ids: list[int]
    state: gpn.VIState
    engine: gpn.VINodes


def _fit_gibbs_tree(
    tree: Tree,
    feats: dict[int, torch.Tensor],
    engine: gpn.GibbsNodes,
    n_sweeps: int,
) -> list[GibbsGroup]:
    sizes = [sum(len(feats[c]) for c in n.classes) for n in tree.nodes]
    groups = []
    for ids in group_by_size(sizes):
        x, y, mask = _node_data(tree, ids, feats)
        groups.append(GibbsGroup(ids, engine.fit(x, y, mask, n_sweeps)))
    return groups


def _predict_groups(tree: Tree, groups, x: torch.Tensor) -> torch.Tensor:
    """Node probabilities ``[n_nodes, N]`` then class probabilities ``[N, C]``."""
    node_probs = x.new_empty(len(tree.nodes), x.shape[0])
    for g in groups:
        if isinstance(g, GibbsGroup):
            p = gpn.gibbs_predict(g.state, x)
        else:
            p = g.engine.predict(g.state, x)
        node_probs[g.node_ids] = p
    return path_probabilities(tree, node_probs)


# ================================================================================ checks


def _check_xy(X, y, name: str = "X") -> tuple[torch.Tensor, torch.Tensor]:
    """``X [N, D]`` (float32/float64, finite, non-empty) and labels ``y [N]`` (whole,
    non-negative numbers, on ``X``'s device), checked by :mod:`probfsl.validation`."""
    X = as_float_tensor(X, name, ndim=2)
    y = as_label_tensor(y, "y", n=X.shape[0], device=X.device)
    if y.ndim != 1:
        raise ValueError(f"y must be 1-D [N={X.shape[0]}], got shape {tuple(y.shape)}")
    if bool((y < 0).any()):
        raise ValueError("y must hold non-negative class labels")
    return X, y


# ============================================================================ estimators


class GPTree:
    """GP-Tree multi-class GP classifier with class-incremental stages (spec §3.7).

    Args:
        inference: ``"vi"`` (inducing-point VI nodes with learnt kernel hyper-parameters and
            inducing inputs on the base stage, §3.3) or ``"gibbs"`` (exact-kernel Gibbs nodes
            with fixed scales on the base stage, §3.2). Novel stages always use Gibbs.
        n_chains, n_sweeps: Gibbs chains per node and sweeps (code: 30 and 10).
        gibbs_outputscale, gibbs_lengthscale: fixed Gibbs kernel (code: 8 and 1). Default
            outputscale 64 here: on the same base-stage validation split (Gibbs base nodes,
            4 chains × 5 sweeps) held-out accuracy is 57.8 % with 8 and 60.2 % with 64.
            The larger scale mixes more slowly: on Omniglot novel stages the maximum R-hat
            after burn-in was 1.11 with 200 sweeps at 64 against 1.03 at 8, so use 8 (and
            more sweeps) when the posterior intervals matter more than accuracy.
        n_inducing: inducing points / stored exemplars per class, m_c (code: 5).
        vi_outputscale, vi_lengthscale: initial VI kernel (lengthscale ≥ 1e-2). The official
            code starts at outputscale 4, lengthscale 1; the default outputscale here is 128,
            chosen on a validation split of the Omniglot base-stage *training* data (136
            classes, 10 train / 5 held-out per class, VI 3 iterations, m_c = 5): held-out
            accuracy 53.4 / 59.4 / 60.7 / 61.3 / 62.2 / 59.4 % for outputscale
            4 / 16 / 32 / 64 / 128 / 512. On fixed (non-DKL) features a larger prior
            variance means weaker shrinkage of each node's f; the ELBO's Adam steps move the
            scale too little in a few iterations to find this by themselves.
        vi_iter: VI iterations, each = closed-form c and q(f̄) updates + one Adam step on the
            hyper-parameters (and X̄) with the loss Σ_v −L_v/n_v (§3.4). Default 3, an
            early stop chosen on the same base-stage validation split (outputscale 128,
            m_c = 5): held-out accuracy 62.2 / 61.5 / 61.8 / 59.7 % after 3 / 5 / 10 / 30
            iterations (61.3 % after 10 with ``vi_lr=0``, i.e. closed-form updates only). On
            fixed features the ELBO-optimal kernel and X̄ do not classify better than the
            validated prior, and each iteration costs O(Σ_v n_v M_v²).
        vi_lr: Adam learning rate for the hyper-parameters and X̄.
        learn_inducing: learn X̄ (True) or keep the k-means initialisation.
        natural_lr: ρ of the natural-parameter update (1 = exact optimum, full batch).
        code_elbo: use the official code's ELBO with the two flipped signs (§3.8).
        pg_sampler: ``"torch"`` (on device) or ``"exact"`` (polyagamma, CPU).
        kmeans_n_init, seed: tree 2-means restarts and seed (code: 50, 42); ``seed`` also
            seeds the Gibbs chains (stage t uses seed + t).
        dtype: computation dtype, float64 by default whatever the dtype of ``X`` (float64
            is advised for the Gibbs inverses: the fit upcasts float32 input); ``None``
            computes in the dtype of the base stage's ``X``. :meth:`predict_proba` returns
            probabilities in the dtype of its own ``X``.
        record: keep every Gibbs sweep of the latest stage, for :meth:`to_datatree`.

    Every tensor is created on the device of the base stage's ``X``; later stages and
    predictions move their ``X`` there.

    Fitted attributes: ``classes_`` (column order of ``predict_proba``: base classes
    sorted, then each stage's classes sorted), ``base_tree_``, ``base_groups_``,
    ``inducing_ [C_base, m_c, D]``, ``novel_tree_``, ``novel_groups_``, ``root_``,
    ``stage_`` (number of fitted stages), ``elbo_trace_`` (VI, ``[vi_iter+1]`` sum of
    node ELBOs).
    """

    def __init__(
        self,
        inference: str = "vi",
        n_chains: int = 30,
        n_sweeps: int = 10,
        gibbs_outputscale: float = 64.0,
        gibbs_lengthscale: float = 1.0,
        n_inducing: int = 5,
        vi_outputscale: float = 128.0,
        vi_lengthscale: float = 1.0,
        vi_iter: int = 3,
        vi_lr: float = 0.05,
        learn_inducing: bool = True,
        natural_lr: float = 1.0,
        code_elbo: bool = False,
        pg_sampler: str = "torch",
        kmeans_n_init: int = 50,
        seed: int = 42,
        dtype: torch.dtype | None = torch.float64,
        record: bool = False,
    ) -> None:
        hp = check_hyperparameter
        self.inference = check_choice("inference", inference, ("vi", "gibbs"))
        self.n_chains = hp("n_chains", n_chains, integer=True, low=1)
        self.n_sweeps = hp("n_sweeps", n_sweeps, integer=True, nonnegative=True)
        self.gibbs_outputscale = hp("gibbs_outputscale", gibbs_outputscale, positive=True)
        self.gibbs_lengthscale = hp("gibbs_lengthscale", gibbs_lengthscale, positive=True)
        self.n_inducing = hp("n_inducing", n_inducing, integer=True, low=1)
        self.vi_outputscale = hp("vi_outputscale", vi_outputscale, positive=True)
        self.vi_lengthscale = hp("vi_lengthscale", vi_lengthscale, low=1e-2)
        if vi_lengthscale <= 1e-2:  # the constraint's bound, l > 1e-2
            raise ValueError(f"vi_lengthscale must exceed 1e-2, got {vi_lengthscale!r}")
        self.vi_iter = hp("vi_iter", vi_iter, integer=True, nonnegative=True)
        self.vi_lr = hp("vi_lr", vi_lr, nonnegative=True)
        self.learn_inducing = check_flag("learn_inducing", learn_inducing)
        self.natural_lr = hp("natural_lr", natural_lr, positive=True, high=1)
        self.code_elbo = check_flag("code_elbo", code_elbo)
        self.pg_sampler = check_choice("pg_sampler", pg_sampler, ("torch", "exact"))
        self.kmeans_n_init = hp("kmeans_n_init", kmeans_n_init, integer=True, low=1)
        self.seed = hp("seed", seed, integer=True, nonnegative=True)
        self.dtype = None if dtype is None else check_float_dtype("dtype", dtype)
        self.record = check_flag("record", record)

    # ------------------------------------------------------------------ helpers
    def _gibbs_engine(self, stage: int, device) -> gpn.GibbsNodes:
        gen = torch.Generator(device=device).manual_seed(self.seed + stage)
        return gpn.GibbsNodes(
            n_chains=self.n_chains,
            outputscale=self.gibbs_outputscale,
            lengthscale=self.gibbs_lengthscale,
            sampler=self.pg_sampler,
            generator=gen,
            seed=self.seed + stage,
            record=self.record,
        )

    def _exemplars(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """m_c inducing inputs of one class: k-means centres (n_init 5, max_iter 200), or
        the points themselves (repeated cyclically) when there are ≤ m_c of them (§3.6)."""
        m = self.n_inducing
        if len(x) <= m:
            return x[torch.arange(m, device=x.device) % len(x)]
        _, centres = kmeans(x.detach().cpu().double().numpy(), m, n_init=5, seed=seed)
        return torch.as_tensor(centres, dtype=x.dtype, device=x.device)

    @staticmethod
    def _by_class(X: torch.Tensor, y: torch.Tensor) -> dict[int, torch.Tensor]:
        # deterministic order inside a class (sorted rows), so the fit ignores row order;
        # the lexicographic sort runs on the host, from one copy of X and y
        Xh, yh = X.detach().cpu().double().numpy(), y.cpu().numpy()
        order = np.lexsort((*Xh.T[::-1], yh))  # by class, then by row
        sorted_rows = X[torch.as_tensor(order, device=X.device)]
        classes, counts = np.unique(yh, return_counts=True)
        blocks = torch.split(sorted_rows, counts.tolist())
        return {int(c): b for c, b in zip(classes, blocks, strict=True)}

    @staticmethod
    def _means(feats: dict[int, torch.Tensor], classes) -> np.ndarray:
        means = torch.stack([feats[c].mean(0) for c in classes])
        return means.detach().cpu().double().numpy()

    # ------------------------------------------------------------------ base stage
    def fit(self, X, y) -> Self:
        """Base stage: build the tree over the classes of ``y`` and fit every node."""
        X, y = _check_xy(X, y)
        X = X.to(X.dtype if self.dtype is None else self.dtype)
        classes = sorted(torch.unique(y).tolist())
        if len(classes) < 2:
            raise ValueError(f"the base stage needs at least 2 classes, got {len(classes)}")
        feats = self._by_class(X, y)
        self.n_features_in_ = X.shape[1]
        self.base_classes_ = classes
        self.classes_ = list(classes)
        self.base_tree_ = build_tree(
            self._means(feats, classes), classes, self.seed, self.kmeans_n_init
        )
        self.inducing_ = torch.stack(
            [self._exemplars(feats[c], self.seed) for c in classes]
        )  # [C, m_c, D]
        if self.inference == "gibbs":
            eng = self._gibbs_engine(0, X.device)
            self.base_groups_ = _fit_gibbs_tree(self.base_tree_, feats, eng, self.n_sweeps)
            self.elbo_trace_ = None
            self.last_groups_ = self.base_groups_
        else:
            self.base_groups_, self.elbo_trace_ = self._fit_vi(feats)
            self.last_groups_ = []
        self.novel_classes_: list[int] = []
        self.novel_feats_: dict[int, torch.Tensor] = {}
        self.novel_tree_ = None
        self.novel_groups_: list = []
        self.root_ = None
        self.stage_ = 1
        return self

    def _fit_vi(self, feats: dict[int, torch.Tensor]) -> tuple[list[VIGroup], np.ndarray]:
        """Joint VI of all base nodes (§3.3–3.4): closed-form c, q(f̄), then one Adam step on
        per-node (outputscale, lengthscale) of a batched gpytorch ScaleKernel(RBF) and X̄."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import gpytorch

        tree = self.base_tree_
        pos = {c: i for i, c in enumerate(self.base_classes_)}
        Z = torch.nn.Parameter(self.inducing_.clone(), requires_grad=self.learn_inducing)
        sizes = [sum(len(feats[c]) for c in n.classes) for n in tree.nodes]
        engine = gpn.VINodes(natural_lr=self.natural_lr, code_elbo=self.code_elbo)
        groups, kernels, states, zidx = [], [], [], []
        for ids in group_by_size(sizes):
            x, yv, mask = _node_data(tree, ids, feats)
            m_max = self.n_inducing * max(len(tree.nodes[v].classes) for v in ids)
            idx = torch.zeros(len(ids), m_max, dtype=torch.long, device=x.device)
            zmask = torch.zeros(len(ids), m_max, dtype=torch.bool, device=x.device)
            for i, v in enumerate(ids):
                cls = [pos[c] for c in tree.nodes[v].classes]
                slots = torch.as_tensor(cls, device=x.device).repeat_interleave(self.n_inducing)
                within = torch.arange(self.n_inducing, device=x.device).repeat(len(cls))
                flat = slots * self.n_inducing + within
                idx[i, : len(flat)] = flat
                zmask[i, : len(flat)] = True
            kern = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(
                    batch_shape=torch.Size([len(ids)]),
                    lengthscale_constraint=gpytorch.constraints.GreaterThan(1e-2),
                ),
                batch_shape=torch.Size([len(ids)]),
            ).to(dtype=x.dtype, device=x.device)
            kern.outputscale = torch.full(
                (len(ids),), self.vi_outputscale, dtype=x.dtype, device=x.device
            )
            kern.base_kernel.lengthscale = torch.full(
                (len(ids), 1, 1), self.vi_lengthscale, dtype=x.dtype, device=x.device
            )
            n_v = torch.tensor([sizes[v] for v in ids], dtype=x.dtype, device=x.device)
            groups.append((ids, x, yv, mask, zmask, n_v))
            kernels.append(kern)
            zidx.append(idx)
            states.append(None)

        def group_data(k: int, detach: bool):
            ids, x, yv, mask, zmask, _ = groups[k]
            z = Z.reshape(-1, Z.shape[-1])[zidx[k]]
            s = kernels[k].outputscale
            ls = kernels[k].base_kernel.lengthscale.reshape(-1)
            if detach:
                z, s, ls = z.detach(), s.detach(), ls.detach()
            return (x, yv, mask, z, zmask, s, ls)

        params = [p for k in kernels for p in k.parameters()]
        if self.learn_inducing:
            params.append(Z)
        opt = torch.optim.Adam(params, lr=self.vi_lr)
        trace = []
        for it in range(self.vi_iter + 1):
            learn = it < self.vi_iter
            total = Z.new_zeros(())  # the sum of node ELBOs, kept on the device
            if learn:
                opt.zero_grad()
            for k in range(len(groups)):
                data = group_data(k, detach=not learn)
                with torch.set_grad_enabled(learn):
                    t = gpn.vi_terms(*data, jitter=engine.jitter)
                st = states[k]
                if st is None:
                    st = gpn.VIState(
                        data, *engine.initial_factors(t.A.shape[0], t.A.shape[-1], t.A), None
                    )
                with torch.no_grad():  # closed-form c then q(f̄), §3.3 1–2
                    td = gpn.VITerms(*(v.detach() for v in vars(t).values()))
                    st = engine.step_terms(st, td, objective=not learn)
                if learn:  # §3.3 step 3: gradient of −Σ_v L_v/n_v at the new (c, q)
                    mu, Sigma, chol = st.moments
                    elbo = gpn.vi_elbo(t, mu, Sigma, st.c, self.code_elbo, chol)
                    # one backward per group: the gradients add up over groups (shared X̄)
                    # exactly as for the summed loss, and each group's graph is freed at once
                    (-elbo / groups[k][5]).sum().backward()
                    st.objective = elbo.detach()
                states[k] = st
                total = total + st.objective.detach().sum()
            trace.append(total)
            if learn:
                opt.step()
        self.inducing_ = Z.detach().clone()
        for k in range(len(groups)):  # the state's data: final hyper-parameters, no graph
            states[k].data = group_data(k, detach=True)
        out = [VIGroup(groups[k][0], states[k], engine) for k in range(len(groups))]
        return out, torch.stack(trace).cpu().double().numpy()  # one transfer, after the loop

    # ------------------------------------------------------------------ novel stages
    def partial_fit(self, X, y, classes=None) -> Self:
        """A novel stage (§3.7): store the shots (m_c exemplars per class), rebuild the Gibbs
        subtree over all novel classes so far, fit a new Gibbs root (left: the base classes'
        m_c inducing inputs each; right: all stored novel features). Base nodes are frozen.

        ``classes`` (optional) lists the stage's classes; each must have samples.
        """
        if not hasattr(self, "stage_"):
            raise ValueError("call fit (the base stage) before partial_fit")
        X, y = _check_xy(X, y)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features but the model was fitted on {self.n_features_in_}"
            )
        X = X.to(device=self.inducing_.device, dtype=self.inducing_.dtype)
        y = y.to(self.inducing_.device)
        new = sorted(torch.unique(y).tolist())
        if classes is not None:
            if isinstance(classes, (str, bytes)) or not hasattr(classes, "__iter__"):
                raise TypeError(f"classes must be a sequence of labels, got {classes!r}")
            missing = sorted(set(int(c) for c in classes) - set(new))
            if missing:
                raise ValueError(f"classes {missing} of this stage have no samples")
            extra = sorted(set(new) - set(int(c) for c in classes))
            if extra:
                raise ValueError(f"y has labels {extra} not listed in classes")
        seen = sorted(set(new) & set(self.classes_))
        if seen:
            raise ValueError(f"stage contains classes already seen: {seen}")
        feats = self._by_class(X, y)
        for c in new:
            self.novel_feats_[c] = self._exemplars(feats[c], self.seed)
        self.novel_classes_ = self.novel_classes_ + new
        self.classes_ = self.classes_ + new
        stage = self.stage_
        eng = self._gibbs_engine(stage, X.device)
        ncls = self.novel_classes_
        self.novel_tree_ = build_tree(
            self._means(self.novel_feats_, ncls), ncls, self.seed, self.kmeans_n_init
        )
        self.novel_groups_ = _fit_gibbs_tree(
            self.novel_tree_, self.novel_feats_, eng, self.n_sweeps
        )
        base_x = self.inducing_.reshape(-1, self.inducing_.shape[-1])
        nov_x = torch.cat([self.novel_feats_[c] for c in ncls])
        rx = torch.cat([base_x, nov_x])[None]
        ry = torch.cat([base_x.new_zeros(len(base_x)), nov_x.new_ones(len(nov_x))])[None]
        rmask = torch.ones_like(ry, dtype=torch.bool)
        self.root_ = GibbsGroup([0], eng.fit(rx, ry, rmask, self.n_sweeps))
        self.last_groups_ = [self.root_, *self.novel_groups_]
        self.stage_ = stage + 1
        return self

    # ------------------------------------------------------------------ prediction
    def _check_predict_x(self, X) -> tuple[torch.Tensor, torch.dtype]:
        """``X`` checked, on the model's device and in its computation dtype, and the
        dtype it came in."""
        if not hasattr(self, "stage_"):
            raise ValueError("the model is not fitted: call fit first")
        X = as_float_tensor(X, "X", ndim=2)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {X.shape[1]} features but the model was fitted on {self.n_features_in_}"
            )
        return X.to(device=self.inducing_.device, dtype=self.inducing_.dtype), X.dtype

    def predict_proba(self, X) -> torch.Tensor:
        """Class probabilities ``[N, len(classes_)]`` (columns in ``classes_`` order), in the
        dtype of ``X`` (computed in the model's dtype), on the model's device."""
        X, out_dtype = self._check_predict_x(X)
        with torch.no_grad():
            base = _predict_groups(self.base_tree_, self.base_groups_, X)
            if self.root_ is None:
                return base.to(out_dtype)
            p_root = gpn.gibbs_predict(self.root_.state, X)[0]  # p(novel)
            novel = _predict_groups(self.novel_tree_, self.novel_groups_, X)
            out = torch.cat([(1 - p_root)[:, None] * base, p_root[:, None] * novel], 1)
            return out.to(out_dtype)

    def predict(self, X) -> torch.Tensor:
        """Predicted class labels (values from ``classes_``)."""
        proba = self.predict_proba(X)
        labels = torch.as_tensor(self.classes_, device=proba.device)
        return labels[proba.argmax(-1)]

    # ------------------------------------------------------------------ diagnostics
    def to_datatree(self, X, rhat_threshold: float = 1.01, burn_in: int = 1):
        """ArviZ export of the latest Gibbs stage (needs ``record=True``).

        The first ``burn_in`` recorded states are dropped: state 0 is the sampler's
        starting point (a prior draw), so the default keeps the states after sweeps 1..n.

        posterior: ``f_<node>`` [chain, draw, point] — the Gibbs draws of each latest-stage
        Gibbs node's latent f at its training points (draw d = state after sweep
        d + burn_in), and ``class_prob``
        [chain, draw, x, class] — the predictive class probabilities at ``X`` given each
        chain's ω after each sweep (base VI nodes are deterministic). sample_stats:
        ``log_marginal`` (sum over those nodes of log p(y | ω)). attrs: ``elbo_trace``
        (VI base stage). Warns (RuntimeWarning) when an R-hat exceeds ``rhat_threshold``;
        the R-hat and ESS tables are returned by :meth:`diagnostics`.
        """
        from probfsl.diagnostics.arviz import to_datatree

        X, _ = self._check_predict_x(X)
        groups = self.last_groups_
        if not groups or groups[0].state.omega_trace is None:
            raise ValueError("no recorded Gibbs chains: fit with record=True (Gibbs nodes)")
        posterior, dims = {}, {}
        n_draws = len(groups[0].state.omega_trace)
        if not 0 <= burn_in < n_draws:
            raise ValueError(f"burn_in must lie in 0..{n_draws - 1}, got {burn_in}")
        log_marg = 0.0
        for g in groups:
            tree_name = "root" if g is self.root_ else ("novel" if self.root_ else "base")
            st = g.state
            f = torch.stack(st.f_trace[burn_in:], 1)  # [V, draw, S, n]
            for i, v in enumerate(g.node_ids):
                name = f"f_{tree_name}{v}"
                n_v = int(st.mask[i].sum())
                posterior[name] = f[i, :, :, :n_v].transpose(0, 1)
                dims[name] = [f"point_{tree_name}{v}"]
            lm = []
            for w in st.omega_trace[burn_in:]:
                lm.append(gpn.augmented_log_marginal(_with_omega(st, w)).sum(0))
            log_marg = log_marg + torch.stack(lm, 1)  # [S, draw]
        probs = []
        for d in range(burn_in, n_draws):
            probs.append(self._chainwise_proba(X, d))
        posterior["class_prob"] = torch.stack(probs, 1)  # [S, draw, N, C]
        dims["class_prob"] = ["x", "class"]
        coords = {"class": np.asarray(self.classes_)}
        attrs = {}
        if self.elbo_trace_ is not None:
            attrs["elbo_trace"] = [float(v) for v in self.elbo_trace_]
        dt = to_datatree(
            posterior,
            dims=dims,
            coords=coords,
            sample_stats={"log_marginal": log_marg},
            attrs=attrs or None,
        )
        self._warn_rhat(dt, rhat_threshold)
        return dt

    @staticmethod
    def diagnostics(datatree):
        """R-hat and bulk ESS (arviz_stats) of every posterior variable."""
        import arviz_stats

        return arviz_stats.rhat(datatree), arviz_stats.ess(datatree)

    def _warn_rhat(self, dt, threshold: float) -> None:
        rhat, _ = self.diagnostics(dt)
        ds = rhat.posterior.to_dataset() if hasattr(rhat, "posterior") else rhat
        worst = max(float(np.nanmax(ds[v].values)) for v in ds.data_vars)
        if worst > threshold:
            warnings.warn(
                f"GP-Tree Gibbs chains: max R-hat {worst:.3f} > {threshold} "
                "(run more sweeps or chains)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _chainwise_proba(self, X: torch.Tensor, draw: int) -> torch.Tensor:
        """Class probabilities ``[S, N, C]`` of each chain given its ω after sweep ``draw``."""

        def node_probs_chainwise(tree, groups):
            out = X.new_empty(len(tree.nodes), self.n_chains, X.shape[0])
            for g in groups:
                if isinstance(g, GibbsGroup):
                    st = _with_omega(g.state, g.state.omega_trace[draw])
                    _, mu, var = gpn.gibbs_predict(st, X, return_moments=True)
                    out[g.node_ids] = gpn.gauss_hermite_sigmoid(mu, var)
                else:
                    out[g.node_ids] = g.engine.predict(g.state, X).unsqueeze(1)
            return out

        with torch.no_grad():

            def per_chain(tree, groups):
                npb = node_probs_chainwise(tree, groups)
                return torch.stack(
                    [path_probabilities(tree, npb[:, s]) for s in range(self.n_chains)]
                )

            base = per_chain(self.base_tree_, self.base_groups_)
            if self.root_ is None:
                return base
            st = _with_omega(self.root_.state, self.root_.state.omega_trace[draw])
            _, mu, var = gpn.gibbs_predict(st, X, return_moments=True)
            pr = gpn.gauss_hermite_sigmoid(mu, var)[0]  # [S, N]
            novel = per_chain(self.novel_tree_, self.novel_groups_)
            return torch.cat([(1 - pr)[..., None] * base, pr[..., None] * novel], -1)


def _with_omega(state: gpn.GibbsState, omega: torch.Tensor) -> gpn.GibbsState:
    from dataclasses import replace

    return replace(state, omega=omega)


# ===================================================================== few-shot episodes


class GPTreeFewShot(BaseMeanCentering, FewShotClassifier):
    """GP-Tree on each few-shot task's support (``probfsl run --method gp-tree``).

    Per task: the class tree by exact 2-means on the task's L2-normalised support means,
    then a Gibbs PG-GP at each of its K−1 nodes (§3.2; fixed RBF scales). All nodes of all
    tasks are sampled in one batch: node v of task t sees the task's whole support with a
    mask (its classes) and labels (1 = right subtree), so no Python loop over tasks or nodes
    runs in the sampler. Features are centred on the base mean (``center``) before the
    kernel's L2 normalisation; ``center=False`` uses them as they are (no ``fit_base``
    needed).

    Randomness: node v of a task draws from its own counter-based stream
    (:class:`~probfsl.inference.polya_gamma.CounterRNG`) keyed by (``seed``, a hash of the
    task's support features and labels, v), so a task's probabilities do not depend on the
    other tasks of its batch, on the batch size or on ``max_nodes`` (with the ``"torch"``
    PG sampler; ``"exact"`` draws ω from one NumPy stream on the CPU).

    Computes in the dtype and on the device of the episodes (float32 episodes give
    float32 chains; the tree is built on the host from the K class means of each task).

    Args:
        n_chains, n_sweeps: Gibbs chains per node and sweeps.
        outputscale, lengthscale: RBF kernel on normalised features (code: 8, 1).
        center: centre on the base-class mean (needs ``fit_base``).
        pg_sampler: ``"torch"`` or ``"exact"``.
        seed: seed of every task's random streams.
        max_nodes: nodes per sampler batch (memory bound; larger batches are split).
    """

    def __init__(
        self,
        n_chains: int = 20,
        n_sweeps: int = 10,
        outputscale: float = 8.0,
        lengthscale: float = 1.0,
        center: bool = True,
        pg_sampler: str = "torch",
        seed: int = 0,
        max_nodes: int = 2000,
    ) -> None:
        hp = check_hyperparameter
        self.n_chains = hp("n_chains", n_chains, integer=True, low=1)
        self.n_sweeps = hp("n_sweeps", n_sweeps, integer=True, nonnegative=True)
        self.outputscale = hp("outputscale", outputscale, positive=True)
        self.lengthscale = hp("lengthscale", lengthscale, positive=True)
        self.center = check_flag("center", center)
        self.pg_sampler = check_choice("pg_sampler", pg_sampler, ("torch", "exact"))
        self.seed = hp("seed", seed, integer=True, nonnegative=True)
        self.max_nodes = hp("max_nodes", max_nodes, integer=True, low=1)

    def fit_base(self, features, labels) -> Self:
        """Store the mean of the base ``features [N, D]`` (tensor or NumPy array)."""
        features, _ = check_base(features, labels)
        self.base_mean_ = features.mean(0)
        return self

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Query class probabilities ``[T, Q, K]`` (rows sum to one), spec §3.2 and §3.5."""
        mean = self.centring_mean()
        check_episodes(episodes, None if mean is None else mean.shape[-1])
        support = center_and_normalize(episodes.support, mean)
        query = center_and_normalize(episodes.query, mean)
        labels = episodes.support_labels.long()
        T, K, Q = support.shape[0], episodes.way, query.shape[1]
        dev = support.device
        onehot = torch.nn.functional.one_hot(labels, K).to(support.dtype)  # [T, n, K]
        means = (onehot.transpose(1, 2) @ support) / onehot.sum(1).unsqueeze(-1)
        means_np = means.detach().cpu().double().numpy()  # one transfer: trees on the host
        trees = [build_tree(means_np[t], list(range(K))) for t in range(T)]
        # node tables: task, position in its tree, class- and right-membership over K classes;
        # path tables: each class's root-to-leaf nodes (global indices) and directions
        node_task, node_pos, node_in, node_right = [], [], [], []
        path_node = np.full((T, K, K - 1), -1, dtype=np.int64)  # a path has ≤ K − 1 nodes
        path_right = np.zeros((T, K, K - 1), dtype=bool)
        for t, tree in enumerate(trees):
            start = len(node_task)
            for v, node in enumerate(tree.nodes):
                node_task.append(t)
                node_pos.append(v)
                node_in.append([c in node.classes for c in range(K)])
                node_right.append([c in node.right for c in range(K)])
            idx, right = tree.paths()
            path_node[t, :, : idx.shape[1]] = np.where(idx >= 0, idx + start, -1)
            path_right[t, :, : idx.shape[1]] = right
        node_task_t = torch.as_tensor(node_task, device=dev)
        node_in_t = torch.as_tensor(node_in, device=dev)
        node_right_t = torch.as_tensor(node_right, device=dev)
        task_keys = _task_keys(episodes.support, labels, self.seed)
        node_keys = mix32(task_keys[node_task_t] ^ mix32(torch.as_tensor(node_pos, device=dev)))
        engine = gpn.GibbsNodes(
            self.n_chains,
            self.outputscale,
            self.lengthscale,
            sampler=self.pg_sampler,
            seed=self.seed,
        )
        V = len(node_task)
        node_probs = query.new_empty(V, Q)
        for a in range(0, V, self.max_nodes):
            sl = slice(a, a + self.max_nodes)
            tt = node_task_t[sl]
            lab = labels[tt]  # [v, n]
            mask = torch.gather(node_in_t[sl], 1, lab)
            y = torch.gather(node_right_t[sl], 1, lab).to(support.dtype) * mask
            state = engine.fit(support[tt], y, mask, self.n_sweeps, keys=node_keys[sl])
            node_probs[sl] = gpn.gibbs_predict(state, query[tt])
        # p(c | x) = Π_{v on c's path} p_v or 1 − p_v (§3.5), all tasks at once
        idx = torch.as_tensor(path_node, device=dev)
        right = torch.as_tensor(path_right, device=dev).unsqueeze(-1)
        p = node_probs[idx.clamp_min(0)]  # [T, K, depth, Q]
        p = torch.where(right, p, 1 - p)
        p = torch.where((idx >= 0).unsqueeze(-1), p, torch.ones_like(p))
        out = p.prod(2).transpose(1, 2)  # [T, Q, K]
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError("GP-Tree produced non-finite probabilities (numerical failure)")
        return out


def _task_keys(support: torch.Tensor, labels: torch.Tensor, seed: int) -> torch.Tensor:
    """A 32-bit key ``[T]`` per task: a hash of ``seed`` and the task's support features
    (rounded to float32, so float32 and float64 copies of a task agree) and labels."""
    T = support.shape[0]
    words = support.to(torch.float32).view(torch.int32).to(torch.int64).reshape(T, -1)
    words = torch.cat([words, labels.to(torch.int64)], 1)
    pos = torch.arange(words.shape[1], device=support.device)
    h = mix32(words ^ mix32(pos)).sum(1)  # each term < 2³²: no overflow
    return mix32(mix32(h) ^ (int(seed) & 0xFFFFFFFF))
