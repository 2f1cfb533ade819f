"""A labelled bank of pre-extracted features, split into base and novel classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probfsl.validation import as_device, as_label_array, check_float_dtype

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

    Construction validates every field (:func:`validate_features`): ``TypeError`` for
    non-numeric features or non-integer labels (strings), ``ValueError`` naming the
    field for a shape that does not fit, NaN/inf, labels below -1 or fractional
    labels (``0.5`` is rejected, never truncated; whole-number floats such as ``1.0``
    are accepted as integers).
    """

    features: np.ndarray
    labels: np.ndarray
    class_names: list[str]
    split: np.ndarray
    class_features: np.ndarray | None = None
    name: str = "features"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"FeatureSet name must be a string, got {type(self.name).__name__}")
        self.features = _as_array(self.features, f"{self.name}: 'features'")
        self.labels = as_label_array(
            _as_array(self.labels, f"{self.name}: 'labels'"), f"{self.name}: 'labels'"
        )
        split = _as_array(self.split, f"{self.name}: 'split'")
        if split.dtype.kind not in "US" and not (
            split.dtype.kind == "O" and all(isinstance(v, str) for v in split.ravel())
        ):
            raise TypeError(f"{self.name}: 'split' must hold strings, got {split.dtype}")
        self.split = split.astype(str)
        if isinstance(self.class_names, (str, bytes)) or not hasattr(self.class_names, "__len__"):
            raise TypeError(
                f"{self.name}: class_names must be a list of names, "
                f"got {type(self.class_names).__name__}"
            )
        self.class_names = [str(c) for c in self.class_names]
        validate_features(self.features, self.labels, self.split, source=self.name)
        n_classes = int(self.labels.max()) + 1 if (self.labels >= 0).any() else 0
        if len(self.class_names) < n_classes:
            raise ValueError(
                f"{self.name}: class_names has {len(self.class_names)} entries but labels "
                f"go up to {n_classes - 1}"
            )
        if self.class_features is not None:
            self.class_features = _as_array(self.class_features, f"{self.name}: class_features")
            if self.class_features.dtype.kind not in "iuf":
                raise TypeError(
                    f"{self.name}: class_features must be numeric, got {self.class_features.dtype}"
                )
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

    def base(
        self, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Base-class features (``dtype``) and labels as tensors on ``device`` (default the
        CPU); a ``ValueError`` if there are none or ``device`` is not a device."""
        return self._split_tensors("base", dtype, device)

    def novel(
        self, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Novel-class features (``dtype``) and labels as tensors on ``device`` (default the
        CPU), the rows few-shot tasks are drawn from; a ``ValueError`` if there are none."""
        return self._split_tensors("novel", dtype, device)

    def _split_tensors(self, split: str, dtype: torch.dtype, device) -> tuple:
        check_float_dtype("dtype", dtype)
        device = as_device(device)
        idx = self.rows(split)
        if idx.size == 0:
            raise ValueError(f"{self.name}: no {split}-class rows (split == {split!r})")
        return (
            torch.as_tensor(self.features[idx], dtype=dtype, device=device),
            torch.as_tensor(self.labels[idx], device=device),
        )

    @classmethod
    def of_base_classes(cls, features: torch.Tensor, labels: torch.Tensor) -> FeatureSet:
        """A FeatureSet whose every row is a base-class row (for estimators that
        sample base-class episodes from the features given to ``fit_base``)."""
        labels_np = labels.detach().cpu().numpy()
        return cls(
            features=features.detach().cpu().numpy(),
            labels=labels_np,
            class_names=[str(c) for c in range(int(labels_np.max()) + 1)],
            split=np.full(labels_np.shape, "base"),
            name="base features",
        )

    def __repr__(self) -> str:
        counts = {s: int((self.split == s).sum()) for s in np.unique(self.split)}
        return (
            f"FeatureSet(name={self.name!r}, n={len(self.labels)}, dim={self.dim}, "
            f"classes={self.n_classes}, split={counts})"
        )


def _as_array(x: object, name: str) -> np.ndarray:
    """``x`` (array, tensor, list) as a NumPy array; ``TypeError`` for other objects."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, (np.ndarray, list, tuple)):
        return np.asarray(x)
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def validate_features(
    features: np.ndarray, labels: np.ndarray, split: np.ndarray, source: str
) -> None:
    """Raise ``ValueError`` naming ``source`` and the field when the arrays do not fit
    (``TypeError`` for features that are not real numbers)."""
    if features.dtype.kind not in "iuf":
        raise TypeError(f"{source}: 'features' must be real numbers, got {features.dtype}")
    if features.ndim != 2:
        raise ValueError(f"{source}: 'features' must be 2-D [N, D], got shape {features.shape}")
    if features.shape[0] == 0 or features.shape[1] == 0:
        raise ValueError(f"{source}: 'features' is empty (shape {features.shape})")
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
