"""What each ``probfsl`` subcommand does; the parser and the entry point are
:mod:`probfsl.cli`, which imports this module only once a command runs (so that
``probfsl --help`` and argument errors need no torch)."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

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
from probfsl.data.simplex import zero_shot_probabilities
from probfsl.data.task_files import TaskFile
from probfsl.evaluation import text_table, write_results
from probfsl.evaluation.open_set import (
    OPEN_METRICS,
    evaluate_open_set_stream,
    open_set_baselines,
)
from probfsl.evaluation.protocol import evaluate_stream
from probfsl.evaluation.tables import COLUMNS
from probfsl.evaluation.zero_shot import evaluate_argmax, evaluate_zero_shot
from probfsl.fileio import check_writable
from probfsl.methods import DEFAULTS, METHODS, method_info, methods_with_engines, parse_params
from probfsl.selection import rank_feature_files
from probfsl.temperature import TemperatureScaled
from probfsl.tuning import (
    BASELINE,
    SEARCH_SEED,
    SEARCH_SPACES,
    auto_preset,
    auto_preset_zero_shot,
    make_estimator,
    search_space,
)
from probfsl.validation import as_device

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _load(args: argparse.Namespace) -> FeatureSet:
    if args.features:
        return load_features(args.features, allow_pickle=getattr(args, "allow_pickle", False))
    return load_dataset(args.dataset)


def _note(message: str) -> None:
    """A one-line notice on stderr (stdout keeps the results)."""
    print(f"probfsl: note: {message}", file=sys.stderr)


def _device(name: str) -> torch.device:
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


def _device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """``--device`` (checked: :func:`_device`) and ``--dtype`` of a subcommand."""
    return _device(args.device), DTYPES[args.dtype]


def _compute_dtype(estimator: object, dtype: torch.dtype) -> str:
    """The dtype the estimator computes in: ``compute_dtype_`` where a method upcasts
    (evidence-lssvm), else the data's ``dtype``; wrappers are looked through."""
    inner = getattr(estimator, "estimator", estimator)
    return str(getattr(inner, "compute_dtype_", dtype)).removeprefix("torch.")


def _versions() -> dict:
    return {"probfsl_version": probfsl.__version__, "torch_version": torch.__version__}


#: why a method cannot run without base-class rows (methods whose only use of the base
#: classes is centring run with ``center=False`` instead)
NEEDS_BASE = {
    "bavardage": "its PLDA projection and whitening come from the base classes' scatter",
    "slem": "its negative exemplars are the base-class features",
}


def _without_base(method: str, fs: FeatureSet, preset: str | None, params: dict) -> dict:
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
            _note(f"{fs.name} has no base-class rows: {method} runs without centring")
            return unc
    reason = NEEDS_BASE.get(method, "center=True needs the base-class mean")
    raise ValueError(
        f"{method} needs base-class rows (split 'base') and {fs.name} has none: {reason}; "
        "extract base images with 'probfsl extract --split base' (or --base-dir) and "
        "'probfsl merge'"
    )


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
    fitted on base-class episodes of the same setting (:mod:`probfsl.temperature`).

    ``open_queries > 0`` adds that many open queries to each task (the open-set
    protocol, :mod:`probfsl.data.open_set`) and scores the method's
    ``predict_proba_open`` (:func:`_run_open_set`).
    """
    estimator = make_estimator(method, preset, **(params or {}))
    if calibrate == "temperature":
        # base episodes of the search's seed, not the run's: one temperature per setting
        estimator = TemperatureScaled(estimator, balance=balance, alpha=alpha, seed=SEARCH_SEED)
    if open_queries:
        if task_file is not None:
            raise ValueError(
                "--open-queries draws open-set tasks; it does not apply to --task-file "
                "(task files hold closed tasks)"
            )
        if not hasattr(estimator, "predict_proba_open"):
            extra = " with --calibrate temperature (use --calibrate none)" * (
                calibrate == "temperature"
            )
            raise ValueError(f"--open-queries: {method} has no open-set posterior{extra}")
    estimator.fit_featureset(fs, dtype, device)
    baseline = make_estimator(BASELINE, center=bool(fs.classes_in("base").size))
    baseline.fit_featureset(fs, dtype, device)
    if task_file is not None:
        if not isinstance(task_file, TaskFile):  # read a batch at a time, checked once
            task_file = TaskFile(task_file, name=f"--task-file {task_file}")
        task_file.check(len(fs.labels), progress=progress)
        tasks = len(task_file)
        way, shot, query = task_file.shape

        def batch(start: int, stop: int):
            return task_file.episodes(fs, start, stop, dtype)
    else:

        def batch(start: int, stop: int):
            return sample_episodes(
                fs, stop - start, way, shot, query, balance, alpha, seed, start, dtype=dtype
            )

    calibration = {"calibrate": calibrate}
    if calibrate == "temperature":  # fitted before the timed run
        calibration["temperature"] = estimator.fit_shape(way, shot, query, dtype, device)
        if (way, shot, query) in estimator.notes_:
            _note(f"--calibrate temperature: {estimator.notes_[(way, shot, query)]}")
    open_row = None
    if open_queries:
        open_row = _run_open_set(
            estimator, baseline, fs, way, shot, query, balance, alpha, tasks, seed,
            open_queries, batch_size, progress, device, dtype,
        )  # fmt: skip
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
    note = getattr(estimator, "estimator", estimator).setting_note(way, shot)
    if note:
        _note(note)
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


#: the baselines' fields of an open-set row: their open-set metrics (closed accuracy is
#: nearest centroid's, the row's ``baseline_accuracy``)
BASELINE_OPEN_METRICS = ("auroc", "aupr", "prec_at_90_recall")


def _run_open_set(
    estimator,
    baseline,
    fs: FeatureSet,
    way: int,
    shot: int,
    query: int,
    balance: str,
    alpha: float,
    tasks: int,
    seed: int,
    open_queries: int,
    batch_size: int,
    progress: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """The open-set fields of a row: the method's ``predict_proba_open`` and the two
    baselines on nearest centroid (:func:`probfsl.evaluation.open_set.open_set_baselines`)
    on the same open-set tasks, made a batch at a time. Returns the method's metrics
    (closed ``accuracy`` and ``ci95``, ``auroc``, ``aupr``, ``prec_at_90_recall``,
    ``ece_open`` and the closed-set calibration, each with ``_ci95``), ``tasks``,
    ``seconds``, ``tasks_per_second``, ``baseline_accuracy`` / ``baseline_ci95``, and
    ``knn_*`` and ``msp_*`` fields of the baselines, with ``open_queries``,
    ``open_way`` and ``knn_k``."""
    from probfsl.data.open_set import default_open_way

    def batch(start: int, stop: int):
        return sample_episodes(
            fs, stop - start, way, shot, query, balance, alpha, seed, start,
            dtype=dtype, n_open=open_queries,
        )  # fmt: skip

    baselines = open_set_baselines(baseline)
    results = evaluate_open_set_stream(
        {"method": estimator, **baselines}, batch, tasks, batch_size, progress, device, dtype
    )
    method = results["method"]
    row = {"tasks": method.n_tasks, **method.summary()}
    row["baseline_accuracy"], row["baseline_ci95"] = results["msp"].metrics["accuracy"]
    row["open_queries"] = open_queries
    row["open_way"] = default_open_way(fs.classes_in("novel").size, way, open_queries)
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


def _print_tuning(result, choice=None) -> None:
    """The search trace, then what is used: the search's best, or ``choice``'s fallback."""
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


def _auto_by_default(method: str, fs: FeatureSet) -> bool:
    """Whether ``probfsl run`` tunes ``method`` on ``fs`` when no preset or parameter is
    given: wherever the data have base classes and the method has a search space."""
    return method in SEARCH_SPACES and fs.classes_in("base").size > 0


def _auto(
    args: argparse.Namespace,
    fs: FeatureSet,
    fixed: dict,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
):
    """``--preset auto`` / ``probfsl tune``: the search on base classes, or its fallback,
    in ``dtype`` on ``device``."""
    if getattr(args, "zero_shot", False):
        return auto_preset_zero_shot(
            args.method,
            fs,
            args.min_classes,
            args.max_classes,
            args.query,
            n_tasks=args.episodes or 300,
            seed=args.seed,
            fixed=fixed,
            dtype=dtype,
            device=device,
            progress=progress,
        )
    return auto_preset(
        args.method,
        fs,
        args.way,
        args.shot,
        args.query,
        args.balance,
        args.alpha,
        n_episodes=args.episodes,
        seed=args.seed,
        criterion=getattr(args, "criterion", "accuracy"),
        fixed=fixed,
        dtype=dtype,
        device=device,
        progress=progress,
    )


def cmd_tune(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, (".json", ".csv"))
    device, dtype = _device_and_dtype(args)
    fixed = parse_params(args.param)
    search_space(args.method)
    make_estimator(args.method, **fixed)  # bad hyperparameters fail before loading
    fs = _load(args)
    choice = _auto(args, fs, fixed, device, dtype)
    if choice.result is None:
        raise ValueError(f"cannot tune {args.method} on {fs.name}: {choice.reason}")
    if choice.note:
        _note(choice.note)
    _print_tuning(choice.result, choice)
    if args.out:
        write_results(choice.result.table_rows(), args.out)
        print(f"wrote {args.out}")
    return 0


def _check_tasks_possible(args: argparse.Namespace, fs: FeatureSet) -> None:
    """``ValueError`` when ``fs`` cannot give the requested tasks (one is drawn)."""
    if args.zero_shot:
        if fs.class_features is None:
            raise ValueError(
                f"{fs.name}: --zero-shot needs class embeddings (the file's "
                "'class_text_features' array, one row per class)"
            )
        sample_zero_shot_tasks(fs, 1, args.min_classes, args.max_classes, args.query, args.seed)
    elif not args.task_file:
        setting = (fs, 1, args.way, args.shot, args.query, args.balance, args.alpha, args.seed)
        try:
            sample_task_indices(*setting)
        except ValueError as err:
            hint = _task_shape_hint(fs, args.way, args.shot, args.query, args.balance)
            raise ValueError(f"{err}{hint}") from None
        n_open = getattr(args, "open_queries", 0)
        if n_open:
            try:
                sample_task_indices(*setting, n_open=n_open)
            except ValueError as err:
                raise ValueError(f"--open-queries {n_open}: {err}") from None


def _open_task_file(args: argparse.Namespace) -> TaskFile | None:
    """``--task-file`` opened (its array headers read; values are checked once the
    features are loaded), or ``None`` without one; errors start with ``--task-file PATH``."""
    if not args.task_file:
        return None
    if args.zero_shot:
        raise ValueError("--task-file applies to few-shot runs, not --zero-shot")
    if not Path(args.task_file).is_file():
        raise ValueError(f"--task-file: file not found: {args.task_file}")
    return TaskFile(args.task_file, name=f"--task-file {args.task_file}")


def _free_memory() -> int | None:
    """Bytes of free physical memory (``None`` where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_batch_memory(args: argparse.Namespace, fs: FeatureSet, dtype: torch.dtype) -> None:
    """``ValueError`` before any work when one batch of task features (with the copies the
    engines make, about 4 of them) would not fit in the free memory."""
    free = _free_memory()
    if free is None or args.zero_shot:
        return
    rows = args.way * args.shot + args.query + getattr(args, "open_queries", 0)
    per_task = 4 * rows * fs.dim * torch.finfo(dtype).bits // 8
    batch = min(args.batch_size, args.tasks)
    if batch * per_task > free:
        fits = max(1, free // (2 * per_task))
        raise ValueError(
            f"--batch-size {batch}: one batch needs about {batch * per_task / 2**30:.1f} GiB "
            f"and {free / 2**30:.1f} GiB are free; use --batch-size {fits} (memory does not "
            "grow with --tasks: batches are made one at a time)"
        )


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


def _engine_param(method: str, engine: str, params: dict) -> str:
    """``--engine``'s value for ``method``; ``ValueError`` for a method with one engine or
    a ``--param engine=...`` that says otherwise."""
    with_engines = methods_with_engines()
    if method not in with_engines:
        raise ValueError(f"--engine: {method} has one engine; methods with two: {with_engines}")
    if params.get("engine", engine) != engine:
        raise ValueError(f"--engine {engine} and --param engine={params['engine']} disagree")
    return engine


def cmd_run(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, (".json", ".csv"))
    row = run_row(args)
    if args.zero_shot:  # hard labels: no calibration columns, and it says so
        _note("zero-shot predictions are hard labels (clusters matched to classes): no ECE/NLL")
        columns = [c for c in _shown_columns(row) if c not in ("ece", "nll", "brier")]
        print(text_table([row], [*columns, "argmax_in_task_accuracy"]))
    else:
        print(text_table([row], _shown_columns(row)))
    if row.get("open_queries"):
        print()
        print(open_set_table(row))
    if args.out:
        write_results([row], args.out)
        print(f"wrote {args.out}")
    return 0


def _pm_text(row: dict, key: str, half: str) -> str:
    """``"86.53 ± 0.87"``: a row's ``key`` and its 95% half-width ``half`` (three
    decimals for ECE-open; ``"–"`` when the row has no ``key``)."""
    if key not in row:
        return "–"
    digits = 3 if key.endswith("ece_open") else 2
    return f"{row[key]:.{digits}f} ± {row[half]:.{digits}f}"


def open_set_table(row: dict) -> str:
    """The open-set metrics of a run's row: the method's posterior, then the k-NN
    distance and maximum softmax baselines on nearest centroid (the same tasks)."""
    header = (
        f"open-set: {row['tasks']} tasks, {row['way']}-way {row['shot']}-shot, "
        f"{row['query']} closed + {row['open_queries']} open queries "
        f"({row['open_way']} open classes) per task; percent but ece_open; "
        "95% intervals over tasks"
    )
    base = row.get("baseline", BASELINE)
    method = {"scorer": f"{row['method']} (P(open))"}
    method["accuracy"] = _pm_text(row, "accuracy", "ci95")
    rows = [method]
    for name in (f"{row['knn_k']}-NN distance", "max softmax"):
        rows.append(
            {
                "scorer": f"{base} + {name}",
                "accuracy": _pm_text(row, "baseline_accuracy", "baseline_ci95"),
            }
        )
    for metric in OPEN_METRICS[1:]:
        method[metric] = _pm_text(row, metric, f"{metric}_ci95")
        for prefix, out in zip(("knn", "msp"), rows[1:], strict=True):
            out[metric] = _pm_text(row, f"{prefix}_{metric}", f"{prefix}_{metric}_ci95")
    return header + "\n" + text_table(rows, ["scorer", *OPEN_METRICS])


def _shown_columns(row: dict) -> list[str]:
    """The printed columns: with ``method_run`` beside ``method`` where another method
    (the baseline) ran."""
    columns = list(COLUMNS)
    if row.get("method_run", row["method"]) != row["method"]:
        columns.insert(columns.index("method") + 1, "method_run")
    return columns


def run_row(args: argparse.Namespace, fs: FeatureSet | None = None, progress: bool = True) -> dict:
    """What ``probfsl run`` computes for its parsed arguments ``args``: the row of the
    results table. ``fs`` replaces loading ``--dataset`` / ``--features`` (a sweep's worker
    hands in the features it already holds); ``progress`` shows the task bar."""
    # everything that can be checked without the data is checked first
    device, dtype = _device_and_dtype(args)
    if args.batch_size is None:
        info = method_info(args.method)
        args.batch_size = info.cpu_batch if device.type == "cpu" else 1000
    params = parse_params(args.param)
    if args.engine is not None:
        params["engine"] = _engine_param(args.method, args.engine, params)
    task_file = _open_task_file(args)  # its headers: a malformed file fails before any work
    preset = None if args.preset == DEFAULTS else args.preset
    if args.zero_shot and preset not in (None, "auto"):
        raise ValueError("--zero-shot takes no named --preset (only auto)")
    if args.zero_shot and args.calibrate == "temperature":
        raise ValueError("--calibrate temperature applies to few-shot runs, not --zero-shot")
    open_queries = getattr(args, "open_queries", 0)
    if open_queries and args.zero_shot:
        raise ValueError("--open-queries applies to few-shot runs, not --zero-shot")
    if open_queries and task_file is not None:
        raise ValueError(
            "--open-queries draws open-set tasks; it does not apply to --task-file "
            "(task files hold closed tasks)"
        )
    # unknown or invalid hyperparameters and presets fail before loading
    make_estimator(args.method, None if preset == "auto" or args.zero_shot else preset, **params)
    if preset == "auto":
        make_estimator(args.method, "auto", **params)  # a method without a search space
    fs = _load(args) if fs is None else fs
    if task_file is not None:  # one pass over its values (shown), then the tasks' shape
        task_file.check(len(fs.labels), progress=progress)
        args.way, args.shot, args.query = task_file.shape
    _check_tasks_possible(args, fs)  # before any search on the base classes
    _check_batch_memory(args, fs, dtype)
    if args.preset is None and not args.param and _auto_by_default(args.method, fs):
        _note(
            f"{args.method}: --preset auto, the default where the data have base classes "
            f"(hyperparameters tuned on base-class episodes; --preset {DEFAULTS} opts out)"
        )
        preset = "auto"
    # the temperature is fitted to the closed-set probabilities: an open-set run leaves
    # its posterior untempered unless asked
    tempered = preset == "auto" and not open_queries
    calibrate = args.calibrate or ("temperature" if tempered else "none")
    if calibrate == "temperature" and fs.classes_in("base").size == 0:
        if args.calibrate == "temperature":
            raise ValueError(f"--calibrate temperature needs base classes; {fs.name} has none")
        calibrate = "none"  # the default with --preset auto: nothing to fit it on
    auto_note, method = None, args.method
    if not args.zero_shot:
        params = _without_base(args.method, fs, None if preset == "auto" else preset, params)
    if preset == "auto":
        # the search's own seed: --seed draws the tasks, not the base episodes
        searched = argparse.Namespace(**{**vars(args), "seed": SEARCH_SEED})
        choice = _auto(searched, fs, params, device, dtype, progress)
        if choice.result is not None and args.preset == "auto":
            _print_tuning(choice.result, choice)
        if choice.note:
            _note(f"--preset auto: {choice.note}")
        auto_note = choice.describe()
        run_preset, params = choice.preset, choice.params
        method = choice.method or args.method
        if choice.result is not None and args.preset is None:
            chosen = f"preset {run_preset!r} with {params}" if run_preset else params
            _note(f"--preset auto chose {method} {chosen} ('probfsl tune' shows the search)")
    else:
        run_preset = preset
    if args.zero_shot:
        row = run_zero_shot(
            method,
            fs,
            args.tasks,
            args.min_classes,
            args.max_classes,
            args.query,
            args.seed,
            dtype,
            args.batch_size,
            progress=progress,
            params=params,
            device=device,
            preset=preset,
        )
    else:
        row = run_setting(
            method,
            fs,
            args.way,
            args.shot,
            args.query,
            args.balance,
            args.alpha,
            args.tasks,
            args.seed,
            device,
            dtype,
            progress=progress,
            task_file=task_file,
            batch_size=args.batch_size,
            preset=run_preset,
            params=params,
            calibrate=calibrate,
            open_queries=open_queries,
        )
    if preset == "auto":
        row["method"] = args.method
        row["preset"] = "auto" if run_preset is None else f"auto ({run_preset})"
        if method != args.method:
            row["preset"] = f"auto ({method})"
        row["auto"] = auto_note
    return row


def cmd_demo(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, (".json", ".csv"))
    device, dtype = _device_and_dtype(args)
    if args.threads is None:
        # 64-d tasks are small: one thread avoids oversubscribing a busy machine
        torch.set_num_threads(1)
    fs = load_dataset("omniglot")
    # the table says what ran; the per-run notes (fitted temperatures) would bury it,
    # and a note that every setting repeats is said once
    quiet = logging.getLogger("probfsl.temperature")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    stderr = sys.stderr
    sys.stderr = _OnceNotes(stderr)
    try:
        return _demo(args, fs, device, dtype)
    finally:
        sys.stderr.flush()
        sys.stderr = stderr
        quiet.setLevel(level)


class _OnceNotes:
    """A text stream in front of ``stream`` that lets each distinct ``probfsl: note:``
    line through once (other lines pass unchanged), whether it comes from ``print`` or
    from the ``probfsl`` logger."""

    def __init__(self, stream) -> None:
        self.stream, self.pending, self.seen = stream, "", set()

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.startswith("probfsl: note:"):
                if line in self.seen:
                    continue
                self.seen.add(line)
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _demo(args: argparse.Namespace, fs: FeatureSet, device, dtype) -> int:
    """The demo's runs and table (:func:`cmd_demo`)."""
    settings = [(shot, balance) for balance in ("balanced", "dirichlet") for shot in (1, 5)]
    rows = []
    tic = time.perf_counter()
    for shot, balance in settings:
        for name, info in METHODS.items():
            # the command line's defaults: the base-episode choice (shipped for the
            # built-in data, so no search runs here) and temperature calibration
            auto = _auto_by_default(name, fs)
            if auto:
                choice = auto_preset(name, fs, 5, shot, 75, balance, dtype=dtype, device=device)
            row = run_setting(
                choice.method or name if auto else name,
                fs,
                5,
                shot,
                75,
                balance,
                2.0,
                args.tasks or info.demo_tasks,
                0,
                device,
                dtype,
                progress=False,
                preset=choice.preset if auto else None,
                params=choice.params if auto else None,
                calibrate="temperature" if auto else "none",
            )
            row["method"] = name
            row["ran"] = (choice.method or "auto") if auto else "defaults"
            rows.append(row)
    print(
        "probfsl demo: built-in Omniglot (PCA-64), 5-way, 75 queries, seed 0, "
        f"{args.dtype} on {device}; each method at the command line's defaults (ran: "
        "'auto' = tuned on base-class episodes, or the baseline's name where the method "
        "scored below it there)"
    )
    if args.tasks is None:
        most = max(info.demo_tasks for info in METHODS.values())
        fewer = {name: info.demo_tasks for name, info in METHODS.items() if info.demo_tasks < most}
        print(
            f"tasks per row: {most}, but "
            + ", ".join(f"{n} for {name}" for name, n in fewer.items())
            + " (the slowest methods on the CPU, so that the demo takes a few minutes; "
            "--tasks N sets every row; the ci95 column is wider where there are fewer)"
        )
    print()
    print(
        text_table(
            rows,
            [
                "method",
                "ran",
                "shot",
                "balance",
                "tasks",
                "accuracy",
                "ci95",
                "baseline_accuracy",
                "ece",
                "nll",
                "brier",
                "tasks_per_second",
            ],
        )
    )
    print(f"\n{len(rows)} runs in {time.perf_counter() - tic:.1f} s")
    if args.out:
        write_results(rows, args.out)
        print(f"wrote {args.out}")
    return 0


def select_main(
    paths: Sequence[str | Path],
    split: str | None = None,
    allow_pickle: bool = False,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
    criterion: str = "episodes",
    way: int = 5,
    shot: int = 5,
    n_query: int = 75,
    episodes: int = 500,
    seed: int = 0,
) -> int:
    """``probfsl select --features A.npz B.npz ...``: print the evidence ranking
    (:func:`probfsl.selection.rank_feature_files`).

    One line per file, best first: for ``criterion="episodes"`` the mean conditional
    log evidence of the query labels per query with its 95 % interval and the paired
    difference to the best file; for ``"all-rows"`` the log evidence per sample and
    summed. The last line names the best file. Returns 0.
    """
    result = rank_feature_files(
        paths, split, allow_pickle, dtype, device,
        criterion=criterion, way=way, shot=shot, n_query=n_query, episodes=episodes, seed=seed,
        progress=True,
    )  # fmt: skip
    if result.note:
        _note(result.note)
    if result.criterion == "all-rows":
        print(
            f"evidence ranking on {result.n_samples} samples, {result.n_classes} classes "
            "(log evidence per sample, summed):"
        )
        for i, b in enumerate(result.ranking, 1):
            flag = f"  [{b.at_boundary} classes at a lambda bound]" if b.at_boundary else ""
            print(f"{i}. {b.name}  {b.per_sample:.6f}  ({b.log_evidence:.3f}, D={b.dim}){flag}")
    else:
        print(
            f"few-shot evidence on {result.n_episodes} {result.way}-way {result.shot}-shot "
            f"episodes ({result.n_query} queries, seed {result.seed}) from the {result.source} "
            f"({result.n_samples} samples, {result.n_classes} classes): mean log p(query "
            "labels | support) per query, 95% interval, paired difference to the best:"
        )
        for i, b in enumerate(result.ranking, 1):
            diff = "best" if i == 1 else f"{b.diff_to_best:+.4f} +- {b.diff_ci95:.4f}"
            flag = "  [lambda at a bound]" if b.at_boundary else ""
            print(
                f"{i}. {b.name}  {b.score:.4f} +- {b.ci95:.4f}  ({diff}, D={b.dim}, "
                f"lambda={b.lam:.3g}){flag}"
            )
    print(f"best: {result.best}")
    return 0


def cmd_select(args: argparse.Namespace) -> int:
    device, dtype = _device_and_dtype(args)
    return select_main(
        args.features, args.split, args.allow_pickle, dtype, device,
        args.criterion, args.way, args.shot, args.query, args.episodes, args.seed,
    )  # fmt: skip


def cmd_extract(args: argparse.Namespace) -> int:
    from probfsl.data.extract import extract_main

    executor = None
    if args.executor != "here":
        from probfsl.sweeps.executors import Resources, make_executor

        executor = make_executor(args.executor, Resources(), args.address, args.workers)
    elif args.workers or args.address:
        raise ValueError("--workers and --address need --executor local or ray")
    print(
        extract_main(
            args.images,
            args.backbone,
            args.out,
            args.image_size,
            args.batch_size,
            args.split,
            base_dir=args.base_dir,
            executor=executor,
        )
    )
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    from probfsl.data.loaders import merge_main

    print(merge_main(args.files, args.out))
    return 0
