"""GP-Tree: a tree of Pólya-Gamma GP binary classifiers, for few-shot class-incremental learning.

Achituve, Navon, Yemini, Chechik, Fetaya, "GP-Tree: A Gaussian Process Classifier for
Few-Shot Incremental Learning", ICML 2021 (PMLR 139, pp. 54–65), arXiv 2102.07868;
design: docs/design/gp-tree.md. Classes are the leaves of a binary tree built by recursive
2-means on the L2-normalised class means (§3.6); each internal node holds a binary GP
classifier with a Pólya-Gamma augmented logistic likelihood (§2); a class's probability
is the product of the node probabilities along its root-to-leaf path (§3.5).

Modules:

* :mod:`~probfsl.models.gp_tree.tree` — the tree type, hard k-means, 2-means splits,
  :func:`build_tree`, :func:`path_probabilities`;
* :mod:`~probfsl.models.gp_tree.model` — the Pyro model of the tree's node GPs
  (:func:`gp_tree_model`, :func:`gp_tree_exact_model`) and the padded node batches;
* :mod:`~probfsl.models.gp_tree.estimator` — :class:`GPTree`, the class-incremental
  classifier on features (VI or Gibbs base nodes, Gibbs novel stages);
* :mod:`~probfsl.models.gp_tree.few_shot` — :class:`GPTreeFewShot`, the
  :class:`~probfsl.models.base.FewShotClassifier` for ``probfsl run --method gp-tree``;
* :mod:`~probfsl.models.gp_tree.export` — ArviZ export and R-hat/ESS of the Gibbs chains.

Inference lives in :mod:`probfsl.inference.gp_tree_nodes` and :mod:`probfsl.inference.polya_gamma`.
"""

from probfsl.models.gp_tree.estimator import GPTree, group_by_size
from probfsl.models.gp_tree.few_shot import GPTreeFewShot
from probfsl.models.gp_tree.model import (
    gp_tree_exact_model,
    gp_tree_model,
    inducing_slots,
    node_batch,
)
from probfsl.models.gp_tree.tree import (
    Node,
    Tree,
    build_tree,
    hard_kmeans,
    path_probabilities,
    two_means_split,
)

__all__ = [
    "GPTree",
    "GPTreeFewShot",
    "Node",
    "Tree",
    "build_tree",
    "gp_tree_exact_model",
    "gp_tree_model",
    "group_by_size",
    "hard_kmeans",
    "inducing_slots",
    "node_batch",
    "path_probabilities",
    "two_means_split",
]
