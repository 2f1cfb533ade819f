"""The few-shot evaluation protocol: accuracy over tasks with a 95% confidence interval,
and the calibration of the query probabilities (:mod:`probfsl.evaluation.calibration`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from probfsl.data.tasks import Episodes
from probfsl.evaluation.calibration import calibration_per_task, mean_ci
from probfsl.models.base import FewShotClassifier
from probfsl.progress import progress as progress_display


@dataclass
class EvalResult:
    """Mean query accuracy over tasks, its 95% interval (both in percent) and speed.

    When the scored predictions were probabilities, ``calibration`` maps each metric
    of :data:`probfsl.evaluation.calibration.METRICS` (ECE, adaptive ECE, NLL, Brier)
    to its mean over tasks and 95% half-width; it is empty for hard labels.
    """

    accuracy: float
    ci95: float
    seconds: float
    tasks_per_second: float
    n_tasks: int
    per_task_accuracy: np.ndarray = field(repr=False)
    calibration: dict[str, tuple[float, float]] = field(default_factory=dict)
    per_task_calibration: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    #: the method that ran, where the estimator says so (``preset="auto"``: the method
    #: tuned, or nearest centroid where it fell back, :attr:`probfsl.tuning.AutoPreset.method_run_`)
    method_run: str | None = None
    #: seconds spent preparing for the tasks' shapes before predicting (the search of
    #: ``preset="auto"``, a temperature fit; :meth:`FewShotClassifier.prepare`), not in
    #: ``seconds`` or ``tasks_per_second``
    tuning_seconds: float = 0.0

    def summary(self) -> dict:
        """The JSON-friendly fields (without per-task values); calibration metrics flat,
        as ``ece`` and ``ece_ci95`` and so on."""
        out = asdict(self)
        for key in ("per_task_accuracy", "calibration", "per_task_calibration"):
            out.pop(key)
        if out["method_run"] is None:
            out.pop("method_run")
        for name, (mean, ci) in self.calibration.items():
            out[name], out[f"{name}_ci95"] = mean, ci
        return out

    def __str__(self) -> str:
        text = f"{self.accuracy:.2f} ± {self.ci95:.2f} %"
        if self.method_run:
            text = f"(ran {self.method_run}) {text}"
        if self.calibration:
            text += "  " + "  ".join(
                f"{name} {mean:.3f} ± {ci:.3f}" for name, (mean, ci) in self.calibration.items()
            )
        speed = f"{self.tasks_per_second:.0f} tasks/s"
        if self.tuning_seconds:
            speed += f"; tuning {self.tuning_seconds:.1f} s before"
        return text + f"  ({speed})"


def accuracy_ci(per_task: np.ndarray) -> tuple[float, float]:
    """Mean and 95% half-width 1.96·std/√T of per-task accuracies, in percent.

    The std is the unbiased one (ddof=1), as in the literature's evaluation code.
    """
    per_task = np.asarray(per_task, dtype=np.float64)
    if per_task.size == 0:
        raise ValueError("accuracy_ci needs at least one task")
    std = per_task.std(ddof=1) if per_task.size > 1 else 0.0
    return 100 * per_task.mean(), 100 * 1.96 * std / np.sqrt(per_task.size)


class _Tally:
    """Per-task accuracies and calibration of scored batches, and the time spent.

    The per-task values go into arrays of ``n_tasks`` made once: many small arrays kept
    across batches would pin the heap between the batches' large, freed feature tensors
    and let the process grow with the number of tasks. With an ``estimator``,
    :meth:`score` runs it on a batch (the default tally of :func:`evaluate_stream`)."""

    def __init__(self, n_tasks: int, estimator: FewShotClassifier | None = None) -> None:
        self.estimator = estimator
        self.per_task = np.full(n_tasks, np.nan)
        self.calibration: dict[str, np.ndarray] = {}
        self.done, self.seconds, self.tuning_seconds = 0, 0.0, 0.0

    def timed(self, predict: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """``predict(*args)``, its time (to the end of the device's work) added."""
        tic = time.perf_counter()
        predicted = predict(*args)
        if predicted.device.type == "cuda":
            torch.cuda.synchronize(predicted.device)
        self.seconds += time.perf_counter() - tic
        return predicted

    def prepared(self, estimator: FewShotClassifier, episodes: Episodes) -> None:
        """``estimator.prepare(episodes)``, its time kept apart as tuning time."""
        tic = time.perf_counter()
        estimator.prepare(episodes)
        self.tuning_seconds += time.perf_counter() - tic

    def score(
        self, episodes: Episodes, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> None:
        """The estimator prepared for the batch's task shape, its probabilities on the
        batch (moved to ``device`` and ``dtype``) timed and tallied."""
        self.prepared(self.estimator, episodes[:1].to(device, dtype))  # the shape
        proba = self.timed(_predict_on, self.estimator, episodes, device, dtype)
        self.add(proba, episodes.query_labels)

    def add(self, predicted: torch.Tensor, labels: torch.Tensor) -> None:
        labels = labels.to(predicted.device)
        rows = slice(self.done, self.done + labels.shape[0])
        if predicted.ndim == 3:
            for name, values in calibration_per_task(predicted, labels).items():
                if name not in self.calibration:
                    self.calibration[name] = np.full(self.per_task.size, np.nan)
                self.calibration[name][rows] = values.double().cpu().numpy()
            predicted = predicted.argmax(-1)
        self.per_task[rows] = (predicted == labels).double().mean(-1).cpu().numpy()
        self.done = rows.stop

    def result(self) -> EvalResult:
        per_task = self.per_task[: self.done]
        acc, ci = accuracy_ci(per_task)
        per_task_calibration = {k: v[: self.done] for k, v in self.calibration.items()}
        return EvalResult(
            accuracy=acc,
            ci95=ci,
            seconds=self.seconds,
            tasks_per_second=len(per_task) / max(self.seconds, 1e-9),
            n_tasks=len(per_task),
            per_task_accuracy=per_task,
            calibration={k: mean_ci(v) for k, v in per_task_calibration.items()},
            per_task_calibration=per_task_calibration,
            tuning_seconds=self.tuning_seconds,
        )


def score_batches(
    predict: Callable[[int, int], torch.Tensor],
    labels: torch.Tensor,
    batch_size: int = 1000,
    progress: bool = False,
) -> EvalResult:
    """Accuracy of ``predict(start, stop)`` against ``labels`` [T, Q].

    ``predict`` returns hard labels ``[B, Q]`` or class probabilities ``[B, Q, K]``;
    probabilities are also scored for calibration (ECE, adaptive ECE, NLL, Brier).
    The tasks are scored in batches of ``batch_size``; the timing covers ``predict`` only.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n_tasks = labels.shape[0]
    tally = _Tally(n_tasks)
    with progress_display(n_tasks, "run", "tasks", progress) as bar:
        for start in range(0, n_tasks, batch_size):
            stop = min(start + batch_size, n_tasks)
            tally.add(tally.timed(predict, start, stop), labels[start:stop])
            bar.update(stop - start)
    return tally.result()


def _predict_on(estimator, episodes: Episodes, device, dtype) -> torch.Tensor:
    return estimator.predict_proba(episodes.to(device, dtype))


def evaluate_stream(
    estimators: Mapping[str, FewShotClassifier],
    batch: Callable[[int, int], Episodes],
    n_tasks: int,
    batch_size: int = 1000,
    progress: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tally: Callable[[int, Any], Any] = _Tally,
) -> dict[str, EvalResult]:
    """Every estimator of ``estimators`` on the same tasks, made one batch at a time.

    ``batch(start, stop)`` returns tasks ``start .. stop-1`` (for example
    :func:`probfsl.data.tasks.sample_episodes` with ``start``: each task is seeded by its
    index, so the tasks do not depend on the batch size). Only one batch of features is
    in memory at a time, so memory stays flat in ``n_tasks``; the per-task scores are
    kept. Timing covers each estimator's work on the batches (moving the batch to
    ``device`` and ``dtype`` included), not the making of the tasks; an estimator's
    preparation for a task shape (:meth:`FewShotClassifier.prepare`: the search of
    ``preset="auto"``) is timed apart, as ``tuning_seconds``.

    ``tally(n_tasks, estimator)`` makes the running score of one estimator: its
    ``score(episodes, device, dtype)`` scores a batch and its ``result()`` is that
    estimator's entry of the returned dict. The default scores accuracy and calibration
    (:class:`EvalResult`); :func:`probfsl.evaluation.open_set.evaluate_open_set_stream`
    streams open-set tasks through the same loop with its own tally.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    tallies = {name: tally(n_tasks, estimator) for name, estimator in estimators.items()}
    with progress_display(n_tasks, "run", "tasks", progress) as bar:
        for start in range(0, n_tasks, batch_size):
            episodes = batch(start, min(start + batch_size, n_tasks))
            for running in tallies.values():
                running.score(episodes, device, dtype)
            bar.update(len(episodes))
    return {name: running.result() for name, running in tallies.items()}


def evaluate(
    estimator: FewShotClassifier,
    episodes: Episodes,
    batch_size: int = 1000,
    progress: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> EvalResult:
    """Run ``estimator`` over every task of ``episodes`` in batches and score the queries:
    accuracy (argmax of ``predict_proba``) and calibration of the probabilities.

    Timing covers the estimator's work on the batches (moving each batch to
    ``device`` included), not the sampling of the tasks. ``method_run`` of the result
    names the method that ran where the estimator says so (``preset="auto"``).
    """
    result = evaluate_stream(
        {"estimator": estimator},
        lambda start, stop: episodes[start:stop],
        len(episodes),
        batch_size,
        progress,
        device,
        dtype,
    )["estimator"]
    inner = getattr(estimator, "estimator_", estimator)  # through temperature scaling
    result.method_run = getattr(inner, "method_run_", None)
    return result
