"""A labelled bank of pre-extracted features, split into base and novel classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

SPLITS = ("base", "novel")


@dataclass
class FeatureSet:
    """Row-aligned features, labels and split of a few-shot data set.

    Attributes:
        features: ``[N, D]`` float array, one row per sample.
        labels: ``[N]`` integer class labels; ``-1`` marks rows outside any class
            (for example Omniglot's official one-shot runs).
        class_names: name of class ``c`` at position ``c``.
        split: ``[N]`` strings; few-shot tasks draw from ``"novel"`` rows and
            base-class statistics come from ``"base"`` rows. Other values are kept
            but never sampled.
        class_features: optional ``[C, D']`` class-level embeddings (for example
            text embeddings of class descriptions, used for zero-shot).
        name: a short name for tables.
        metadata: free-form extra per-row or per-set fields from the file.
    """

    features: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    split: np.ndarray
    class_features: np.ndarray | None = None
    name: str = "features"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.features = np.asarray(self.features)
        self.labels = np.asarray(self.labels).astype(np.int64)
        self.split = np.asarray(self.split).astype(str)
        validate_features(self.features, self.labels, self.split, source=self.name)
        n_classes = int(self.labels.max()) + 1 if (self.labels >= 0).any() else 0
        if len(self.class_names) < n_classes:
            raise ValueError(
                f"{self.name}: class_names has {len(self.class_names)} entries but labels "
                f"go up to {n_classes - 1}"
            )
        if self.class_features is not None:
            self.class_features = np.asarray(self.class_features)
            if self.class_features.ndim != 2 or self.class_features.shape[0] != len(
                self.class_names
            ):
                raise ValueError(
                    f"{self.name}: class_features must be [n_classes={len(self.class_names)}, D], "
                    f"got shape {self.class_features.shape}"
                )
            if not np.isfinite(self.class_features).all():
                raise ValueError(f"{self.name}: class_features contains NaN or inf")

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    def classes_in(self, split: str) -> np.ndarray:
        """Sorted labels of the classes that have rows in ``split``."""
        mask = (self.split == split) & (self.labels >= 0)
        return np.unique(self.labels[mask])

    def rows(self, split: str) -> np.ndarray:
        """Indices of the labelled rows in ``split``."""
        return np.flatnonzero((self.split == split) & (self.labels >= 0))

    def labelled_only(self, split: str) -> FeatureSet:
        """The same rows with every label outside ``split`` set to -1 (unlabelled), e.g.
        so that zero-shot tasks, which draw from all labelled classes, draw from one split."""
        return FeatureSet(
            features=self.features,
            labels=np.where(self.split == split, self.labels, -1),
            class_names=self.class_names,
            split=self.split,
            class_features=self.class_features,
            name=f"{self.name}[{split} classes]",
        )

    def base(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Base-class features and labels as tensors; a ``ValueError`` if there are none."""
        idx = self.rows("base")
        if idx.size == 0:
            raise ValueError(f"{self.name}: no base-class rows (split == 'base')")
        return (
            torch.as_tensor(self.features[idx], dtype=dtype),
            torch.as_tensor(self.labels[idx]),
        )

    def __repr__(self) -> str:
        counts = {s: int((self.split == s).sum()) for s in np.unique(self.split)}
        return (
            f"FeatureSet(name={self.name!r}, n={len(self.labels)}, dim={self.dim}, "
            f"classes={self.n_classes}, split={counts})"
        )


def validate_features(
    features: np.ndarray, labels: np.ndarray, split: np.ndarray, source: str
) -> None:
    """Raise ``ValueError`` naming ``source`` and the field when the arrays do not fit."""
    if features.ndim != 2:
        raise ValueError(f"{source}: 'features' must be 2-D [N, D], got shape {features.shape}")
    if not np.issubdtype(features.dtype, np.number):
        raise ValueError(f"{source}: 'features' must be numeric, got {features.dtype}")
    if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(
            f"{source}: 'labels' must be 1-D with one entry per feature row "
            f"({features.shape[0]}), got shape {labels.shape}"
        )
    if split.shape != labels.shape:
        raise ValueError(
            f"{source}: 'split' must have one entry per row ({labels.shape[0]}), "
            f"got shape {split.shape}"
        )
    if (labels < -1).any():
        raise ValueError(f"{source}: 'labels' must be >= 0 (or -1 for unlabelled rows)")
    bad = ~np.isfinite(features)
    if bad.any():
        rows = np.flatnonzero(bad.any(1))
        raise ValueError(
            f"{source}: 'features' contains NaN or inf ({rows.size} rows, first row {rows[0]})"
        )
