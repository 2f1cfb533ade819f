"""The few-shot evaluation protocol: accuracy over tasks with a 95% confidence interval."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from probfsl.data.tasks import Episodes
from probfsl.models.base import FewShotClassifier


@dataclass
class EvalResult:
    """Mean query accuracy over tasks, its 95% interval (both in percent) and speed."""

    accuracy: float
    ci95: float
    seconds: float
    tasks_per_second: float
    n_tasks: int
    per_task_accuracy: np.ndarray = field(repr=False)

    def summary(self) -> dict:
        """The JSON-friendly fields (without the per-task accuracies)."""
        out = asdict(self)
        out.pop("per_task_accuracy")
        return out

    def __str__(self) -> str:
        return f"{self.accuracy:.2f} ± {self.ci95:.2f} %  ({self.tasks_per_second:.0f} tasks/s)"


def accuracy_ci(per_task: np.ndarray) -> tuple[float, float]:
    """Mean and 95% half-width 1.96·std/√T of per-task accuracies, in percent.

    The std is the unbiased one (ddof=1), as in the literature's evaluation code.
    """
    per_task = np.asarray(per_task, dtype=np.float64)
    if per_task.size == 0:
        raise ValueError("accuracy_ci needs at least one task")
    std = per_task.std(ddof=1) if per_task.size > 1 else 0.0
    return 100 * per_task.mean(), 100 * 1.96 * std / np.sqrt(per_task.size)


def score_batches(
    predict: Callable[[int, int], torch.Tensor],
    labels: torch.Tensor,
    batch_size: int = 1000,
    progress: bool = False,
) -> EvalResult:
    """Accuracy of ``predict(start, stop) -> [B, Q]`` predictions against ``labels`` [T, Q].

    The tasks are scored in batches of ``batch_size``; the timing covers ``predict`` only.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n_tasks = labels.shape[0]
    per_task, seconds = [], 0.0
    bar = tqdm(total=n_tasks, unit="task", disable=not progress, leave=False)
    for start in range(0, n_tasks, batch_size):
        stop = min(start + batch_size, n_tasks)
        tic = time.perf_counter()
        predicted = predict(start, stop)
        if predicted.device.type == "cuda":
            torch.cuda.synchronize(predicted.device)
        seconds += time.perf_counter() - tic
        correct = predicted == labels[start:stop].to(predicted.device)
        per_task.append(correct.double().mean(-1).cpu().numpy())
        bar.update(stop - start)
    bar.close()
    per_task = np.concatenate(per_task)
    acc, ci = accuracy_ci(per_task)
    return EvalResult(
        accuracy=acc,
        ci95=ci,
        seconds=seconds,
        tasks_per_second=len(per_task) / max(seconds, 1e-9),
        n_tasks=len(per_task),
        per_task_accuracy=per_task,
    )


def evaluate(
    estimator: FewShotClassifier,
    episodes: Episodes,
    batch_size: int = 1000,
    progress: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> EvalResult:
    """Run ``estimator`` over every task of ``episodes`` in batches and score the queries.

    Timing covers the estimator's work on the batches (moving each batch to
    ``device`` included), not the sampling of the tasks.
    """

    def predict(start: int, stop: int) -> torch.Tensor:
        return estimator.predict(episodes[start:stop].to(device, dtype))

    return score_batches(predict, episodes.query_labels, batch_size, progress)
