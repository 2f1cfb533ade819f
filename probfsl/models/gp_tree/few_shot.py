"""GP-Tree on few-shot tasks: the FewShotClassifier behind ``probfsl run --method gp-tree``.

Achituve et al., "GP-Tree", ICML 2021, §3.2 and §3.5–3.6. Per task: the class tree
(:func:`~probfsl.models.gp_tree.tree.build_tree` on the support means), a Gibbs PG-GP at
each internal node (:class:`~probfsl.inference.gp_tree_nodes.GibbsNodes`, driven by
:func:`~probfsl.inference.base.run`), and the path products of the node probabilities.
All nodes of all tasks are sampled in one batch.
"""

from __future__ import annotations

from typing import Self

import numpy as np
import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.derived.gp_tree import ENGINES
from probfsl.inference.polya_gamma import mix32
from probfsl.inference.vb_mixture_open import OPEN_FRAMES
from probfsl.models.base import (
    BACKGROUND,
    BASE_MEAN,
    ENGINE,
    OPEN_PRIOR,
    BaseMeanCentering,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.models.gp_tree.tree import build_tree
from probfsl.schema import Choice, EstimatorSchema, Flag, Int, Real
from probfsl.validation import check_base, check_episodes


class GPTreeFewShot(OpenSetBackground, BaseMeanCentering, FewShotClassifier):
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
        engine: ``"handwritten"`` (block Gibbs sampling of each node on the exact kernel,
            §3.2) or ``"derived"``: the same node model, :func:`~probfsl.derived.gp_tree.
            gp_tree_exact_node`, with the mean-field Pólya-Gamma posterior that
            variational message passing derives for it in place of the Gibbs draws
            (deterministic; ``n_chains``, ``n_sweeps``, ``pg_sampler`` and ``seed`` then
            play no part).
    """

    #: the Gibbs streams are keyed by the support's labels (class docstring)
    relabelling_exact = False

    schema = EstimatorSchema(
        params={
            "n_chains": Int(low=1),
            "n_sweeps": Int(low=1),
            "outputscale": Real(positive=True),
            "lengthscale": Real(positive=True),
            "center": Flag(),
            "pg_sampler": Choice(("torch", "exact")),
            "seed": Int(nonnegative=True),
            "max_nodes": Int(low=1),
            "engine": ENGINE,
            "open_prior": OPEN_PRIOR,
            "open_frame": Choice(OPEN_FRAMES),
        },
        fitted=(BASE_MEAN, BACKGROUND),
    )

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
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
    ) -> None:
        self.n_chains = n_chains
        self.n_sweeps = n_sweeps
        self.outputscale = outputscale
        self.lengthscale = lengthscale
        self.center = center
        self.pg_sampler = pg_sampler
        self.seed = seed
        self.max_nodes = max_nodes
        self.engine = engine
        self.open_prior = open_prior
        self.open_frame = open_frame

    def fit_base(self, features, labels) -> Self:
        """Store the mean of the base ``features [N, D]`` (tensor or NumPy array)."""
        self._check_params()
        features, labels = check_base(features, labels)
        self.base_mean_ = features.mean(0)
        self.fit_background(center_and_normalize(features, self.centring_mean()), labels)
        return self

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K+1]``: :meth:`predict_proba` times 1 - P(open), and P(open) last.

        P(open) is the inductive outlier posterior of the two-covariance Gaussian reading
        of the centred, normalised features, with prior ``open_prior``
        (:meth:`~probfsl.models.base.OpenSetBackground.inductive_open`).
        It is read in the frame ``open_frame``: ``"base"``, or ``"queries"``, re-centred on
        the task's query mean (as :class:`~probfsl.models.nearest_centroid.NearestCentroid`).
        """
        proba = self.predict_proba(episodes)
        mean = self.centring_mean()
        support = center_and_normalize(episodes.support, mean)
        query = center_and_normalize(episodes.query, mean)
        return self.inductive_open(episodes, proba, support, query)

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Query class probabilities ``[T, Q, K]`` (rows sum to one), design §3.2 and §3.5."""
        self._check_params()
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
        task_keys = _task_keys(episodes.support, labels, int(self.seed))
        node_keys = mix32(task_keys[node_task_t] ^ mix32(torch.as_tensor(node_pos, device=dev)))
        # probfsl.derived.gp_tree: Gibbs sampling ("handwritten") or VMP's q(f) ("derived")
        node_probs_of = ENGINES[self.engine].few_shot(self)
        V = len(node_task)
        node_probs = query.new_empty(V, Q)
        failed = torch.zeros(V, dtype=torch.bool, device=dev)
        # node batches bound the memory; the node data come from validated episodes, so the
        # engine skips its checks and the factorisations are tested once, after the loop
        for a in range(0, V, int(self.max_nodes)):
            sl = slice(a, a + int(self.max_nodes))
            tt = node_task_t[sl]
            lab = labels[tt]  # [v, n]
            mask = torch.gather(node_in_t[sl], 1, lab)
            y = torch.gather(node_right_t[sl], 1, lab).to(support.dtype) * mask
            node_probs[sl], failed[sl] = node_probs_of(
                support[tt], y, mask, query[tt], node_keys[sl]
            )
        # p(c | x) = Π_{v on c's path} p_v or 1 − p_v (§3.5), all tasks at once
        idx = torch.as_tensor(path_node, device=dev)
        right = torch.as_tensor(path_right, device=dev).unsqueeze(-1)
        p = node_probs[idx.clamp_min(0)]  # [T, K, depth, Q]
        p = torch.where(right, p, 1 - p)
        p = torch.where((idx >= 0).unsqueeze(-1), p, torch.ones_like(p))
        out = p.prod(2).transpose(1, 2)  # [T, Q, K]
        if not bool(torch.isfinite(out).all() & ~failed.any()):
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
