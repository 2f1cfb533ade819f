"""Executing a :class:`~probfsl.run_spec.RunSpec`: :func:`run`, the one path of every
evaluation run (``probfsl run``, each cell of ``probfsl sweep``, and Python code).

:func:`run` applies the command line's policy (the checks made before any work, the
default search on base-class episodes, temperature calibration, running without base
classes where a method can) and then :func:`run_setting` (few-shot and open-set tasks)
or :func:`run_zero_shot` evaluates the method against its baseline. The checks on the
data that :func:`run` makes before its work (:func:`check_tasks_possible`,
:func:`params_without_base`) are the ones a sweep makes on each cell before it starts.

Messages name the ``probfsl run`` options (``--way``, ``--preset``) that a
:class:`~probfsl.run_spec.RunSpec`'s fields of the same names stand for.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable

import torch

import probfsl
from probfsl.data import (
    FeatureSet,
    load_dataset,
    load_features,
    sample_episodes,
    sample_task_indices,
    sample_zero_shot_tasks,
)
from probfsl.data.episodes import Episodes
from probfsl.data.open_set import default_open_way
from probfsl.data.simplex import zero_shot_probabilities
from probfsl.data.task_files import TaskFile
from probfsl.evaluation import text_table
from probfsl.evaluation.open_set import (
    evaluate_open_set_stream,
    has_open_posterior,
    open_set_baselines,
)
from probfsl.evaluation.protocol import evaluate_stream
from probfsl.evaluation.zero_shot import evaluate_argmax, evaluate_zero_shot
from probfsl.methods import DEFAULTS, method_info
from probfsl.models.base import MIN_BACKGROUND_CLASSES, OPEN_PRIOR, shared_backgrounds
from probfsl.run_spec import OPEN_QUERIES_WITH_FILE, RunSpec
from probfsl.temperature import TemperatureScaled
from probfsl.tuning import (
    BASELINE,
    SEARCH_SEED,
    SEARCH_SPACES,
    auto_preset,
    auto_preset_zero_shot,
    make_estimator,
)
from probfsl.validation import as_device

#: the torch dtype of each ``dtype`` name (:data:`probfsl.run_spec.DTYPES`)
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}

#: why a method cannot run without base-class rows (methods whose only use of the base
#: classes is centring run with ``center=False`` instead)
NEEDS_BASE = {
    "bavardage": "its PLDA projection and whitening come from the base classes' scatter",
    "slem": "its negative exemplars are the base-class features",
}

#: the baselines' fields of an open-set row: their open-set metrics (closed accuracy is
#: nearest centroid's, the row's ``baseline_accuracy``)
BASELINE_OPEN_METRICS = ("auroc", "aupr", "prec_at_90_recall")


def run(spec: RunSpec, *, progress: bool = True) -> dict:
    """Execute ``spec``: the row of the results table (the fields of ``probfsl run --out``).

    The policy, in order:

    1. Everything that can be checked without the data: the device exists on this
       machine, the task file's headers read, the hyperparameters' values and the
       preset build an estimator (a ``ValueError`` before anything is loaded).
    2. The data: ``spec.features`` when it is a :class:`~probfsl.data.FeatureSet`, else
       the built-in data set or the feature file, loaded. A task file is checked against
       them once (with progress) and sets way, shot and queries.
    3. One task of the setting is drawn (:func:`check_tasks_possible`) and one batch is
       checked to fit in the free memory, before any search.
    4. The preset: with no ``preset`` and no ``params``, a tunable method on data with
       base classes is tuned on base-class episodes (``"auto"``, with a note on stderr);
       ``"defaults"`` keeps the constructor's defaults.
    5. Calibration: ``calibrate=None`` means a temperature fitted on base-class episodes
       where ``"auto"`` is used (nothing to fit without base classes; in open-set tasks
       it tempers the known classes' columns), else none.
    6. Without base classes, a method whose only use of them is centring runs with
       ``center=False`` (a note); another is a ``ValueError`` (:func:`params_without_base`).
    7. ``"auto"``: the search on base-class episodes of the run's setting, with its own
       seed (:data:`probfsl.tuning.SEARCH_SEED`: ``spec.seed`` draws the tasks, not the
       base episodes); with ``open_queries`` its base episodes hold as many open queries
       from other base classes, and candidates are ranked by the accuracy of the
       known-class queries (:func:`probfsl.tuning.auto_preset`); asked for explicitly it
       prints its table on stdout. Its choice
       may be another method (the baseline, where the method scored below it).
    8. The evaluation: :func:`run_zero_shot` for ``zero_shot``, else :func:`run_setting`
       (the method and nearest centroid on the same tasks, a batch at a time). With
       ``"auto"`` the row's ``method`` is the method asked for, its ``method_run`` the one
       that ran, ``preset`` says ``auto (...)`` and ``auto`` describes the choice.

    Notes (the default search, running without centring, a fitted temperature) go to
    stderr as ``probfsl: note: ...`` lines; ``progress`` shows the task bar.
    """
    # everything that can be checked without the data is checked first
    device = check_device(spec.device)
    dtype = TORCH_DTYPES[spec.dtype]
    batch_size = spec.batch_size
    if batch_size is None:
        batch_size = method_info(spec.method).cpu_batch if device.type == "cpu" else 1000
    params = dict(spec.params)
    if spec.engine is not None:
        params["engine"] = spec.engine
    task_file = open_task_file(spec)  # its headers: a malformed file fails before any work
    preset = None if spec.preset == DEFAULTS else spec.preset
    open_queries = spec.open_queries
    # unknown or invalid hyperparameters and presets fail before loading
    make_estimator(spec.method, None if preset == "auto" or spec.zero_shot else preset, **params)
    if preset == "auto":
        make_estimator(spec.method, "auto", **params)  # a method without a search space
    fs = load_data(spec)
    way, shot, query = spec.way, spec.shot, spec.query
    if task_file is not None:  # one pass over its values (shown), then the tasks' shape
        task_file.check(len(fs.labels), progress=progress, labels=fs.labels)
        way, shot, query = task_file.shape
        open_queries, query = _split_file_queries(task_file, query)
    check_tasks_possible(spec, fs)  # before any search on the base classes
    _check_batch_memory(
        fs, dtype, way, shot, query, open_queries, batch_size, spec.tasks, spec.zero_shot
    )
    if spec.preset is None and not spec.params and auto_by_default(spec.method, fs):
        note(
            f"{spec.method}: --preset auto, the default where the data have base classes "
            f"(hyperparameters tuned on base-class episodes; --preset {DEFAULTS} opts out)"
        )
        preset = "auto"
    # in open-set tasks the temperature applies to the known classes' columns
    calibrate = spec.calibrate or ("temperature" if preset == "auto" else "none")
    if calibrate == "temperature" and fs.classes_in("base").size == 0:
        if spec.calibrate == "temperature":
            raise ValueError(f"--calibrate temperature needs base classes; {fs.name} has none")
        calibrate = "none"  # the default with --preset auto: nothing to fit it on
    auto_note, method = None, spec.method
    if not spec.zero_shot:
        params = params_without_base(spec.method, fs, None if preset == "auto" else preset, params)
    params, prior_note = with_open_fraction(
        spec.method, params, open_queries, query, None if preset == "auto" else preset
    )
    if prior_note:
        note(prior_note)
    if preset == "auto":
        # the search's own seed: the run's seed draws the tasks, not the base episodes
        choice = auto_choice(
            spec.method, fs, params, device, dtype, progress,
            way=way, shot=shot, query=query, balance=spec.balance, alpha=spec.alpha,
            episodes=spec.episodes, seed=SEARCH_SEED, zero_shot=spec.zero_shot,
            min_classes=spec.min_classes, max_classes=spec.max_classes,
            open_queries=open_queries,
        )  # fmt: skip
        if choice.result is not None and spec.preset == "auto":
            print_tuning(choice.result, choice)
        if choice.note:
            note(f"--preset auto: {choice.note}")
        auto_note = choice.describe()
        run_preset, method = choice.preset, choice.method or spec.method
        # the method chosen (the baseline a search fell back to) takes the run's fraction
        params, chosen_note = with_open_fraction(
            method, choice.params, open_queries, query, run_preset
        )
        if chosen_note and not prior_note:
            note(chosen_note)
        if choice.result is not None and spec.preset is None:
            chosen = f"preset {run_preset!r} with {params}" if run_preset else params
            note(f"--preset auto chose {method} {chosen} ('probfsl tune' shows the search)")
    else:
        run_preset = preset
    if spec.zero_shot:
        row = run_zero_shot(
            method,
            fs,
            spec.tasks,
            spec.min_classes,
            spec.max_classes,
            query,
            spec.seed,
            dtype,
            batch_size,
            progress=progress,
            params=params,
            device=device,
            preset=preset,
        )
    else:
        row = run_setting(
            method,
            fs,
            way,
            shot,
            query,
            spec.balance,
            spec.alpha,
            spec.tasks,
            spec.seed,
            device,
            dtype,
            progress=progress,
            task_file=task_file,
            batch_size=batch_size,
            preset=run_preset,
            params=params,
            calibrate=calibrate,
            open_queries=spec.open_queries,  # a task file's own are read from it
        )
    if preset == "auto":
        row["method"] = spec.method
        row["preset"] = "auto" if run_preset is None else f"auto ({run_preset})"
        if method != spec.method:
            row["preset"] = f"auto ({method})"
        row["auto"] = auto_note
    return row


def note(message: str) -> None:
    """A one-line notice on stderr (stdout keeps the results)."""
    print(f"probfsl: note: {message}", file=sys.stderr)


def check_device(name: str) -> torch.device:
    """``--device``: cpu, cuda, cuda:N or mps, and only when this machine has it."""
    try:
        device = as_device(name)
    except ValueError as err:
        raise ValueError(f"--{err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {name}: MPS (Apple GPU) is not available on this machine")
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: unsupported device type; use cpu, cuda or mps")
    return device


def load_data(spec: RunSpec) -> FeatureSet:
    """The features of ``spec``: its :class:`~probfsl.data.FeatureSet`, or its built-in
    data set or feature file loaded."""
    if isinstance(spec.features, FeatureSet):
        return spec.features
    if spec.features is not None:
        return load_features(spec.features, allow_pickle=spec.allow_pickle)
    return load_dataset(spec.dataset)


def open_task_file(spec: RunSpec) -> TaskFile | None:
    """``spec.task_file`` opened (its array headers read; values are checked once the
    features are loaded), or ``None`` without one; errors start with ``--task-file PATH``."""
    from pathlib import Path

    if spec.task_file is None:
        return None
    if spec.zero_shot:
        raise ValueError("--task-file applies to few-shot runs, not --zero-shot")
    if not Path(spec.task_file).is_file():
        raise ValueError(f"--task-file: file not found: {spec.task_file}")
    return TaskFile(spec.task_file, name=f"--task-file {spec.task_file}")


def check_tasks_possible(spec: RunSpec, fs: FeatureSet) -> None:
    """``ValueError`` when ``fs`` cannot give the tasks of ``spec`` (one is drawn, with
    its open queries; a run from a task file is checked against its file instead)."""
    if spec.zero_shot:
        if fs.class_features is None:
            raise ValueError(
                f"{fs.name}: --zero-shot needs class embeddings (the file's "
                "'class_text_features' array, one row per class)"
            )
        sample_zero_shot_tasks(fs, 1, spec.min_classes, spec.max_classes, spec.query, spec.seed)
    elif spec.task_file is None:
        setting = (fs, 1, spec.way, spec.shot, spec.query, spec.balance, spec.alpha, spec.seed)
        try:
            sample_task_indices(*setting)
        except ValueError as err:
            hint = _task_shape_hint(fs, spec.way, spec.shot, spec.query, spec.balance)
            raise ValueError(f"{err}{hint}") from None
        n_open = spec.open_queries
        if n_open:
            try:
                sample_task_indices(*setting, n_open=n_open)
            except ValueError as err:
                raise ValueError(f"--open-queries {n_open}: {err}") from None
            _check_background_classes(fs, f"--open-queries {n_open}")
    elif TaskFile(spec.task_file).is_open:
        _check_background_classes(fs, f"--task-file {spec.task_file} (open-set tasks)")


def _check_background_classes(fs: FeatureSet, what: str) -> None:
    """``ValueError`` when ``fs`` has too few base classes for the background density
    that every open-set posterior reads."""
    n_base = fs.classes_in("base").size
    if n_base < MIN_BACKGROUND_CLASSES:
        raise ValueError(
            f"{what}: P(none of these classes) weighs each query against a background "
            "density learnt from the base classes (the spread of their class means), which "
            f"needs at least {MIN_BACKGROUND_CLASSES}; {fs.name} has {n_base} (split 'base')"
        )


def with_open_fraction(
    method: str,
    params: dict,
    open_queries: int,
    closed_queries: int,
    preset: str | None = None,
) -> tuple[dict, str | None]:
    """``params`` with ``open_prior`` = N / (N + Q), the open fraction of the run's tasks
    (``open_queries`` N and ``closed_queries`` Q per task), and a note saying so, for a
    method whose P(open) reads ``open_prior`` as π_0 (the inductive posterior); as given
    (and ``None``) for closed tasks, where ``params`` already hold an ``open_prior``, where
    the fraction is the method's default, and for the transductive mixtures, which infer
    π_0 per task (:attr:`~probfsl.models.base.OpenSetBackground.infers_open_fraction`).

    An open-set run declares how many of its queries are open as it declares ``--way``.
    With π_0 at the default 1/2, an inductive P(open) is too high where fewer queries are
    open (WordNet, 30 open of 105, nearest centroid: ECE-open 0.228, against 0.089 with
    the run's fraction). A transductive mixture's P(open) follows the open fraction it
    infers and the scale learnt on base episodes of the run's fraction; the run's
    fraction as its prior mean did not help it (ECE-open 0.113 either way there, 0.114
    against 0.102 with 150 open of 225)."""
    if not open_queries or "open_prior" in params:
        return params, None
    estimator = make_estimator(method, preset, **params)
    if getattr(estimator, "infers_open_fraction", True):
        return params, None
    # at most the declared bound of open_prior (tasks of nearly only open queries)
    fraction = min(open_queries / (open_queries + closed_queries), OPEN_PRIOR.high)
    if math.isclose(fraction, estimator.get_params()["open_prior"]):
        return params, None
    note = (
        f"{method}: open_prior {fraction:.3g}, the open fraction of the run's tasks "
        f"({open_queries} of {open_queries + closed_queries} queries; --param open_prior=P "
        "sets another)"
    )
    return {**params, "open_prior": fraction}, note


def _split_file_queries(task_file: TaskFile, n_query: int) -> tuple[int, int]:
    """``(open_queries, closed_queries)`` per task of a checked task file's ``n_query``
    queries: the open ones rounded to their mean over tasks (0 for closed tasks)."""
    open_queries = round(task_file.n_open)
    return open_queries, n_query - open_queries


def _task_shape_hint(fs: FeatureSet, way: int, shot: int, query: int, balance: str) -> str:
    """``"; try --way W --query Q"`` with the largest task the novel classes can form at
    ``shot`` (and ``way`` at most), or ``""`` when none can be formed."""
    import numpy as np

    rows = fs.rows("novel")
    sizes = np.sort(np.unique(fs.labels[rows], return_counts=True)[1])
    if sizes.size < 2 or shot < 1 or sizes.min() <= shot:
        return ""
    w = int(min(way, sizes.size)) if way >= 2 else 2
    if balance == "balanced":
        q = w * int(min(max(query // max(way, 1), 1), sizes[:w].min() - shot))
    else:
        q = int(min(query, sizes[:w].sum() - w * shot))
    if q < 1:
        return ""
    return f"; try --way {w} --query {q} (what the {sizes.size} novel classes can hold)"


def _free_memory() -> int | None:
    """Bytes of free physical memory (``None`` where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_batch_memory(
    fs: FeatureSet,
    dtype: torch.dtype,
    way: int,
    shot: int,
    query: int,
    open_queries: int,
    batch_size: int,
    tasks: int,
    zero_shot: bool,
) -> None:
    """``ValueError`` before any work when one batch of task features (with the copies the
    engines make, about 4 of them) would not fit in the free memory."""
    free = _free_memory()
    if free is None or zero_shot:
        return
    rows = way * shot + query + open_queries
    per_task = 4 * rows * fs.dim * torch.finfo(dtype).bits // 8
    batch = min(batch_size, tasks)
    if batch * per_task > free:
        fits = max(1, free // (2 * per_task))
        raise ValueError(
            f"--batch-size {batch}: one batch needs about {batch * per_task / 2**30:.1f} GiB "
            f"and {free / 2**30:.1f} GiB are free; use --batch-size {fits} (memory does not "
            "grow with --tasks: batches are made one at a time)"
        )


def auto_by_default(method: str, fs: FeatureSet) -> bool:
    """Whether a run tunes ``method`` on ``fs`` when no preset or parameter is given:
    wherever the data have base classes and the method has a search space."""
    return method in SEARCH_SPACES and fs.classes_in("base").size > 0


def params_without_base(method: str, fs: FeatureSet, preset: str | None, params: dict) -> dict:
    """``params`` for a run on ``fs``: unchanged when ``fs`` has base classes; without them,
    centring turned off (with a notice) for methods that can run so, else a ``ValueError``
    saying what is missing."""
    if fs.classes_in("base").size:
        return params
    if not make_estimator(method, preset, **params).needs_base:
        return params
    cls = method_info(method).load()
    if "center" not in params and "center" in inspect.signature(cls.__init__).parameters:
        unc = {**params, "center": False}
        if not make_estimator(method, preset, **unc).needs_base:
            note(f"{fs.name} has no base-class rows: {method} runs without centring")
            return unc
    reason = NEEDS_BASE.get(method, "center=True needs the base-class mean")
    raise ValueError(
        f"{method} needs base-class rows (split 'base') and {fs.name} has none: {reason}; "
        "extract base images with 'probfsl extract --split base' (or --base-dir) and "
        "'probfsl merge'"
    )


def auto_choice(
    method: str,
    fs: FeatureSet,
    fixed: dict,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    *,
    way: int = 5,
    shot: int = 1,
    query: int = 75,
    balance: str = "balanced",
    alpha: float = 2.0,
    episodes: int | None = None,
    seed: int = 0,
    criterion: str = "accuracy",
    zero_shot: bool = False,
    min_classes: int = 3,
    max_classes: int = 10,
    open_queries: int = 0,
):
    """``preset="auto"`` / ``probfsl tune``: the search on base classes, or its fallback
    (:func:`probfsl.tuning.auto_preset`, :func:`probfsl.tuning.auto_preset_zero_shot`),
    with the hyperparameters ``fixed``, in ``dtype`` on ``device``; ``episodes`` per
    candidate (``None``: the method's default; zero-shot: 300 tasks). ``open_queries``
    > 0 (an open-set run) tunes on base episodes with that many open queries from other
    base classes, by the accuracy of the known-class queries."""
    if zero_shot:
        return auto_preset_zero_shot(
            method,
            fs,
            min_classes,
            max_classes,
            query,
            n_tasks=episodes or 300,
            seed=seed,
            fixed=fixed,
            dtype=dtype,
            device=device,
            progress=progress,
        )
    return auto_preset(
        method,
        fs,
        way,
        shot,
        query,
        balance,
        alpha,
        n_episodes=episodes,
        seed=seed,
        criterion=criterion,
        fixed=fixed,
        dtype=dtype,
        device=device,
        progress=progress,
        open_queries=open_queries,
    )


def print_tuning(result, choice=None) -> None:
    """The search's table on stdout, then what is used: the search's best, or
    ``choice``'s fallback."""
    rows = result.table_rows()
    print(
        f"{result.method}: {len(rows)} candidates on base-class episodes, "
        f"criterion {result.criterion}, {result.seconds:.1f} s"
    )
    print(text_table(rows, list(rows[0])))
    if choice is None or choice.params == result.best:
        print(f"chosen: {result.best}")
    else:
        preset = f"preset {choice.preset!r} with " if choice.preset else ""
        print(f"chosen: {preset}{choice.params} (kept over the search's best {result.best})")


def _compute_dtype(estimator: object, dtype: torch.dtype) -> str:
    """The dtype the estimator computes in: ``compute_dtype_`` where a method upcasts
    (evidence-lssvm), else the data's ``dtype``; wrappers are looked through."""
    inner = getattr(estimator, "estimator", estimator)
    return str(getattr(inner, "compute_dtype_", dtype)).removeprefix("torch.")


def _versions() -> dict:
    return {"probfsl_version": probfsl.__version__, "torch_version": torch.__version__}


def run_setting(
    method: str,
    fs: FeatureSet,
    way: int,
    shot: int,
    query: int,
    balance: str,
    alpha: float,
    tasks: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool,
    task_file: str | TaskFile | None = None,
    batch_size: int = 1000,
    preset: str | None = None,
    params: dict | None = None,
    calibrate: str = "none",
    open_queries: int = 0,
) -> dict:
    """Evaluate ``method`` on one task setting; returns the row of the results table.

    The tasks are made one batch of ``batch_size`` at a time (sampled, or read from
    ``task_file``) and scored by the method and by nearest centroid (the baseline
    columns) before the next batch is made, so memory stays flat in ``tasks``.

    ``calibrate="temperature"`` tempers the query probabilities by one temperature
    fitted on base-class episodes of the same setting (:mod:`probfsl.temperature`; in
    open-set tasks the known classes' columns, P(open) as it is).

    ``open_queries > 0`` adds that many open queries to each task (the open-set
    protocol, :mod:`probfsl.data.open_set`) and scores the method's
    ``predict_proba_open`` beside two baselines on nearest centroid; an open-set
    ``task_file`` (one with ``open_classes``) is scored so with its own open queries
    (``open_queries`` is then the mean number per task). The row's ``open_note`` is
    empty, or says that P(open) could not be tuned on held-out base classes (too few to
    split); the same line goes to stderr.
    """
    estimator = make_estimator(method, preset, **(params or {}))
    open_set = f"--open-queries {open_queries}"
    if task_file is not None:
        if not isinstance(task_file, TaskFile):  # read a batch at a time, checked once
            task_file = TaskFile(task_file, name=f"--task-file {task_file}")
        if open_queries:
            raise ValueError(OPEN_QUERIES_WITH_FILE)
        task_file.check(len(fs.labels), progress=progress, labels=fs.labels)
        tasks = len(task_file)
        way, shot, query = task_file.shape
        open_queries, query = _split_file_queries(task_file, query)
        open_set = f"{task_file.name} (open-set tasks)"
    if open_queries and not has_open_posterior(estimator):
        raise ValueError(f"{open_set}: {method} has no open-set posterior")
    if calibrate == "temperature":
        # base episodes of the search's seed, not the run's: one temperature per setting
        estimator = TemperatureScaled(
            estimator, balance=balance, alpha=alpha, seed=SEARCH_SEED, n_open=open_queries
        )
    baseline = make_estimator(BASELINE, center=bool(fs.classes_in("base").size))
    with shared_backgrounds():  # the method and nearest centroid may preprocess alike
        estimator.fit_featureset(fs, dtype, device)
        baseline.fit_featureset(fs, dtype, device)
    if task_file is not None:

        def batch(start: int, stop: int):
            return task_file.episodes(fs, start, stop, dtype)
    else:

        def batch(start: int, stop: int):
            return sample_episodes(
                fs, stop - start, way, shot, query, balance, alpha, seed, start,
                dtype=dtype, n_open=open_queries,
            )  # fmt: skip

    calibration = {"calibrate": calibrate}
    if calibrate == "temperature":  # fitted before the timed run
        calibration["temperature"] = estimator.fit_shape(way, shot, query, dtype, device)
        if (way, shot, query) in estimator.notes_:
            note(f"--calibrate temperature: {estimator.notes_[(way, shot, query)]}")
    open_row = None
    if open_queries:
        if task_file is not None:
            open_way = task_file.open_way
        else:
            open_way = default_open_way(fs.classes_in("novel").size, way, open_queries)
        open_row = _run_open_set(
            estimator, baseline, batch, tasks, shot, open_queries, open_way,
            batch_size, progress, device, dtype,
        )  # fmt: skip
        open_note = estimator.open_background_note()
        open_row["open_note"] = open_note or ""
        if open_note:
            note(open_note)
    else:
        results = evaluate_stream(
            {"method": estimator, "baseline": baseline},
            batch,
            tasks,
            batch_size,
            progress,
            device,
            dtype,
        )
    setting_note = getattr(estimator, "estimator", estimator).setting_note(way, shot)
    if setting_note:
        note(setting_note)
    if open_row is not None:
        scores = {"tasks": open_row.pop("tasks")}
        base = {"baseline_accuracy": open_row.pop("baseline_accuracy")}
        base["baseline_ci95"] = open_row.pop("baseline_ci95")
    else:
        result, base = results["method"], results["baseline"]
        scores = {"tasks": result.n_tasks}
        scores.update({k: v for k, v in result.summary().items() if k != "n_tasks"})
        base = {"baseline_accuracy": base.accuracy, "baseline_ci95": base.ci95}
    return {
        "method": method,
        "method_run": method,
        "dataset": fs.name,
        **_versions(),
        "way": way,
        "shot": shot,
        "query": query,
        "balance": "file" if task_file is not None else balance,
        "alpha": alpha,
        "tasks": scores.pop("tasks"),
        "seed": seed,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "compute_dtype": _compute_dtype(estimator, dtype),
        "preset": preset,
        "params": params or {},
        **calibration,
        **scores,
        "baseline": BASELINE,
        **base,
        **(open_row or {}),
    }


def _run_open_set(
    estimator,
    baseline,
    batch: Callable[[int, int], Episodes],
    tasks: int,
    shot: int,
    open_queries: int,
    open_way: int,
    batch_size: int,
    progress: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """The open-set fields of a row: the method's ``predict_proba_open`` and the two
    baselines on nearest centroid (:func:`probfsl.evaluation.open_set.open_set_baselines`)
    on the same open-set tasks, made a batch at a time by ``batch(start, stop)``. Returns
    the method's metrics (closed ``accuracy`` and ``ci95``, ``auroc``, ``aupr``,
    ``prec_at_90_recall``, ``ece_open`` and the closed-set calibration, each with
    ``_ci95``), ``tasks``, ``seconds``, ``tasks_per_second``, ``baseline_accuracy`` /
    ``baseline_ci95``, and ``knn_*`` and ``msp_*`` fields of the baselines, with
    ``open_queries``, ``open_way`` and ``knn_k``."""
    baselines = open_set_baselines(baseline)
    results = evaluate_open_set_stream(
        {"method": estimator, **baselines}, batch, tasks, batch_size, progress, device, dtype
    )
    method = results["method"]
    row = {"tasks": method.n_tasks, **method.summary()}
    row["baseline_accuracy"], row["baseline_ci95"] = results["msp"].metrics["accuracy"]
    row["open_queries"] = open_queries
    row["open_way"] = open_way
    for name in baselines:
        for metric in BASELINE_OPEN_METRICS:
            row[f"{name}_{metric}"], row[f"{name}_{metric}_ci95"] = results[name].metrics[metric]
    row["knn_k"] = baselines["knn"].k or (1 if shot == 1 else 3)
    return row


def run_zero_shot(
    method: str,
    fs: FeatureSet,
    tasks: int,
    min_classes: int,
    max_classes: int,
    query: int,
    seed: int,
    dtype: torch.dtype,
    batch_size: int = 1000,
    progress: bool = False,
    params: dict | None = None,
    device: torch.device | None = None,
    preset: str | None = None,
) -> dict:
    """Zero-shot protocol (EM-Dirichlet): probabilities over all classes, matched clusters."""
    estimator = make_estimator(method, **(params or {}))
    if not hasattr(estimator, "predict_zero_shot"):
        raise ValueError(f"--zero-shot is not available for method {method!r}")
    zs = sample_zero_shot_tasks(fs, tasks, min_classes, max_classes, query, seed)
    device = torch.device("cpu") if device is None else device
    probs = zero_shot_probabilities(fs, zs, estimator.temperature, dtype).to(device)
    result = evaluate_zero_shot(estimator, probs, zs.query_labels, batch_size, progress)
    baseline = evaluate_argmax(probs, zs.query_labels, batch_size=batch_size)
    in_task = evaluate_argmax(probs, zs.query_labels, zs.classes, batch_size)
    return {
        "method": method,
        "method_run": method,
        "dataset": fs.name,
        **_versions(),
        "way": f"{min_classes}-{max_classes}",
        "shot": 0,
        "query": query,
        "balance": "natural",
        "tasks": result.n_tasks,
        "seed": seed,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "preset": preset,
        "params": params or {},
        **{k: v for k, v in result.summary().items() if k != "n_tasks"},
        "baseline": "argmax",
        "baseline_accuracy": baseline.accuracy,
        "baseline_ci95": baseline.ci95,
        "argmax_in_task_accuracy": in_task.accuracy,
        "argmax_in_task_ci95": in_task.ci95,
    }
