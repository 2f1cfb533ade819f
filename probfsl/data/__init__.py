"""Feature sets, loaders, built-in data sets and task sampling."""

from probfsl.data.builtin import DATASETS, load_dataset
from probfsl.data.featureset import FeatureSet
from probfsl.data.loaders import load_features, load_npz, load_pickle, load_torch
from probfsl.data.tasks import (
    Episodes,
    ZeroShotTasks,
    episodes_from_indices,
    load_task_file,
    sample_episodes,
    sample_task_indices,
    sample_zero_shot_tasks,
    save_task_file,
)

__all__ = [
    "DATASETS",
    "Episodes",
    "FeatureSet",
    "ZeroShotTasks",
    "episodes_from_indices",
    "load_dataset",
    "load_features",
    "load_npz",
    "load_pickle",
    "load_task_file",
    "load_torch",
    "sample_episodes",
    "sample_task_indices",
    "sample_zero_shot_tasks",
    "save_task_file",
]
