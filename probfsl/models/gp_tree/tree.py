"""GP-Tree's class tree: recursive 2-means on the class means (docs/design/gp-tree.md §3.6).

Achituve et al., "GP-Tree", ICML 2021, §3.5–3.6. Classes are the leaves of a binary tree
built by recursive 2-means on the L2-normalised class means; every internal node holds a
binary GP classifier, and a class's probability is the product of the node
probabilities along its root-to-leaf path (:func:`path_probabilities`).

Outside the engine contract of :mod:`probfsl.inference.base`: :func:`hard_kmeans`'s
Lloyd iterations. They run once, on the host in NumPy, on a handful of class means (or a
class's exemplars) before any inference, and decide a discrete structure (the tree, the
inducing inputs) rather than a posterior; nothing in them is batched over tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

import numpy as np
import torch


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


def hard_kmeans(
    x: np.ndarray, k: int, n_init: int = 10, seed: int = 42, max_iter: int = 200
) -> tuple[np.ndarray, np.ndarray]:
    """Hard k-means: Lloyd's algorithm with k-means++ seeding, all ``n_init`` restarts
    vectorised (NumPy, on the host). Not the soft (responsibility-weighted) k-means of
    :mod:`probfsl.inference.soft_kmeans`.

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
    k-means++ with ``n_init`` restarts and ``seed`` (:func:`hard_kmeans`; the official code uses
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
    labels, _ = hard_kmeans(prototypes, 2, n_init=n_init, seed=seed)
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
    """Recursive 2-means on the L2-normalised class means, breadth first (design §3.6).

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
