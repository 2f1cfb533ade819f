"""Backbone selection from feature files by Bayesian evidence (``probfsl select``).

Kim, Jang, Han & Choi, CVPR 2016, §3.4: of several backbones that embed the same
labelled samples, the one whose features give the largest summed log evidence of the
one-vs-rest Bayesian linear regressions (eq. 13) is preferred. The mathematics is
:func:`probfsl.models.evidence.rank_backbones`; this module reads the files, checks
that they hold the same samples and ranks them. The command line prints the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probfsl.data.loaders import load_features
from probfsl.models.evidence import BackboneScore, rank_backbones
from probfsl.validation import as_device, check_float_dtype

__all__ = ["FileRanking", "rank_feature_files"]


@dataclass
class FileRanking:
    """Feature files ranked by evidence, best first, and the samples they were judged on."""

    ranking: list[BackboneScore]
    n_samples: int
    n_classes: int

    @property
    def best(self) -> str:
        """The path of the file with the largest summed log evidence."""
        return self.ranking[0].name


def rank_feature_files(
    paths: Sequence[str | Path],
    split: str | None = None,
    allow_pickle: bool = False,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device | None = None,
) -> FileRanking:
    """Rank feature files of the same samples by summed log evidence, best first.

    Uses the labelled rows (of ``split`` when given) of every file; the files must hold
    the same rows with the same labels (``ValueError`` otherwise, before any
    computation). The evidence is computed in ``dtype`` on ``device`` (default float64
    on the CPU: the evidence sums N log terms, which float32 rounds visibly).
    """
    check_float_dtype("dtype", dtype)
    device = as_device(device)
    if len(paths) < 1:
        raise ValueError("select needs at least one feature file")
    sets = [load_features(p, allow_pickle=allow_pickle) for p in paths]
    first = sets[0]
    for p, fs in zip(paths, sets, strict=True):
        if fs.features.shape[0] != first.features.shape[0]:
            raise ValueError(
                f"feature files have different row counts: {paths[0]} has "
                f"{first.features.shape[0]}, {p} has {fs.features.shape[0]}"
            )
        if not np.array_equal(fs.labels, first.labels):
            raise ValueError(f"{p} and {paths[0]} have different labels: not the same samples")
    rows = first.labels >= 0
    if split is not None:
        rows &= first.split == split
    labels = first.labels[rows]
    if labels.size == 0:
        raise ValueError(
            f"{paths[0]}: no labelled rows" + (f" in split {split!r}" if split else "")
        )
    features = {
        str(p): torch.as_tensor(fs.features[rows], dtype=dtype, device=device)
        for p, fs in zip(paths, sets, strict=True)
    }
    ranking = rank_backbones(features, torch.as_tensor(labels, device=device), dtype=dtype)
    return FileRanking(ranking, int(rows.sum()), len(np.unique(labels)))
