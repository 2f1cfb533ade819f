"""Data sets shipped inside the package, loadable by name.

* ``omniglot``: Omniglot (Lake et al., Science 2015) handwritten characters,
  EfficientNet-Lite0 features projected on the top 64 principal components of the
  base features. 136 base classes (small1 alphabets) and 106 novel classes
  (Japanese katakana, Sanskrit, Tagalog), 20 drawers each. MIT licence.
* ``wordnet``: WordNet 3.0 supersenses; each sample is a synset definition embedded
  with all-MiniLM-L6-v2 (384-d), with an embedding of each class description for
  zero-shot use. 41 classes; base/novel split from ``default_rng(0).permutation(41)``
  (first 21 base, last 20 novel). WordNet 3.0 licence.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the loaders import torch: only when data are loaded
    import numpy as np

    from probfsl.data.featureset import FeatureSet

DATASETS = {
    "omniglot": (
        "omniglot_pca64.npz",
        "Omniglot, EfficientNet-Lite0 features, PCA-64; 136 base / 106 novel classes",
    ),
    "wordnet": (
        "wordnet_minilm.npz",
        "WordNet supersense definitions, MiniLM-L6 (384-d) + class-description embeddings; "
        "21 base / 20 novel classes",
    ),
}


def dataset_path(name: str):
    """Path of a built-in data file inside the installed package."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; built-in datasets: {', '.join(DATASETS)}")
    return resources.files("probfsl.data") / "builtin" / DATASETS[name][0]


def wordnet_base_classes() -> np.ndarray:
    """The 21 base labels of the suggested WordNet split (the other 20 are novel)."""
    import numpy as np

    return np.random.default_rng(0).permutation(41)[:21]


def dataset_summary(name: str) -> dict:
    """``name``'s feature width, base and novel class counts and labelled samples, read
    with NumPy alone (``probfsl datasets`` answers without torch); the same counts as
    :func:`load_dataset`'s :class:`~probfsl.data.featureset.FeatureSet`."""
    import numpy as np

    with resources.as_file(dataset_path(name)) as file, np.load(file) as data:
        labels = data["labels"].astype(np.int64)
        if "split" in data.files:
            split = data["split"]
        else:
            base = np.isin(labels, wordnet_base_classes() if name == "wordnet" else [])
            split = np.where(base, "base", "novel")
        width = data["features"].shape[1]
    labelled = labels >= 0
    return {
        "name": name,
        "dim": int(width),
        "base": int(np.unique(labels[labelled & (split == "base")]).size),
        "novel": int(np.unique(labels[labelled & (split == "novel")]).size),
        "samples": int(labelled.sum()),
        "description": DATASETS[name][1],
    }


def load_dataset(name: str) -> FeatureSet:
    """Load a built-in data set by name (see :data:`DATASETS`).

    Features (and class embeddings) are stored as float16 to keep the package small and
    loaded as float32, the dtype every API accepts. ``split`` holds ``"base"`` and
    ``"novel"``; Omniglot's official one-shot runs (Lake et al.) are kept as
    ``"oneshot_train"`` / ``"oneshot_test"`` rows, which tasks never draw from.
    """
    import numpy as np

    from probfsl.data.loaders import load_npz

    path = dataset_path(name)
    with resources.as_file(path) as file:
        base = wordnet_base_classes() if name == "wordnet" else None
        fs = load_npz(file, name=name, base_classes=base)
    fs.features = fs.features.astype(np.float32)
    if fs.class_features is not None:
        fs.class_features = fs.class_features.astype(np.float32)
    return fs
