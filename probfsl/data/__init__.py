"""Feature sets, loaders, built-in data sets and task sampling.

The names below are loaded from their modules on first use (PEP 562), so that importing
this package (for example for the names of the built-in data sets) does not import torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING

#: where each public name lives
_HOMES = {
    "DATASETS": "builtin",
    "load_dataset": "builtin",
    "FeatureSet": "featureset",
    "load_features": "loaders",
    "load_npz": "loaders",
    "load_pickle": "loaders",
    "load_torch": "loaders",
    "Episodes": "episodes",
    "ZeroShotTasks": "tasks",
    "episodes_from_indices": "tasks",
    "iter_episodes": "tasks",
    "TaskFile": "task_files",
    "load_task_file": "tasks",
    "sample_episodes": "tasks",
    "sample_task_indices": "tasks",
    "sample_zero_shot_tasks": "tasks",
    "save_task_file": "tasks",
}

__all__ = [
    "DATASETS",
    "Episodes",
    "FeatureSet",
    "ZeroShotTasks",
    "episodes_from_indices",
    "iter_episodes",
    "TaskFile",
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


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'probfsl.data' has no attribute {name!r}")
    value = getattr(import_module(f"probfsl.data.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


if TYPE_CHECKING:
    from probfsl.data.builtin import DATASETS, load_dataset
    from probfsl.data.episodes import Episodes
    from probfsl.data.featureset import FeatureSet
    from probfsl.data.loaders import load_features, load_npz, load_pickle, load_torch
    from probfsl.data.task_files import TaskFile
    from probfsl.data.tasks import (
        ZeroShotTasks,
        episodes_from_indices,
        iter_episodes,
        load_task_file,
        sample_episodes,
        sample_task_indices,
        sample_zero_shot_tasks,
        save_task_file,
    )
