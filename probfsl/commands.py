"""What each ``probfsl`` subcommand does: argument handling and printing. The parser and
the entry point are :mod:`probfsl.cli`, which imports this module only once a command
runs (so that ``probfsl --help`` and argument errors need no torch).

``probfsl run`` builds a :class:`~probfsl.run_spec.RunSpec` from its arguments
(:func:`spec_from_args`) and executes it with :func:`probfsl.running.run`, the same
function a sweep's cells and Python code call; this module prints its row.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from probfsl.data import FeatureSet, load_dataset, load_features
from probfsl.evaluation import text_table, write_results
from probfsl.evaluation.open_set import OPEN_METRICS
from probfsl.evaluation.tables import COLUMNS
from probfsl.fileio import check_writable
from probfsl.methods import METHODS, parse_params
from probfsl.run_spec import RunSpec
from probfsl.running import (
    TORCH_DTYPES,
    auto_choice,
    check_device,
    print_tuning,
    run,
    run_setting,
    with_open_fraction,
)
from probfsl.running import auto_by_default as _auto_by_default
from probfsl.running import note as _note
from probfsl.selection import rank_feature_files
from probfsl.tuning import BASELINE, auto_preset, make_estimator, search_space


def _load(args: argparse.Namespace) -> FeatureSet:
    if args.features:
        return load_features(args.features, allow_pickle=getattr(args, "allow_pickle", False))
    return load_dataset(args.dataset)


def _device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """``--device`` (checked: :func:`probfsl.running.check_device`) and ``--dtype`` of a
    subcommand."""
    return check_device(args.device), TORCH_DTYPES[args.dtype]


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The :class:`~probfsl.run_spec.RunSpec` of ``probfsl run``'s parsed arguments
    (``--param KEY=VALUE`` read as Python literals)."""
    return RunSpec(
        method=args.method,
        dataset=args.dataset,
        features=args.features,
        allow_pickle=args.allow_pickle,
        way=args.way,
        shot=args.shot,
        query=args.query,
        balance=args.balance,
        alpha=args.alpha,
        tasks=args.tasks,
        open_queries=getattr(args, "open_queries", 0),
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        batch_size=args.batch_size,
        task_file=args.task_file or None,
        preset=args.preset,
        episodes=args.episodes,
        params=parse_params(args.param),
        engine=args.engine,
        calibrate=args.calibrate,
        zero_shot=args.zero_shot,
        min_classes=args.min_classes,
        max_classes=args.max_classes,
    )


def run_row(args: argparse.Namespace, fs: FeatureSet | None = None, progress: bool = True) -> dict:
    """What ``probfsl run`` computes for its parsed arguments ``args``: the row of the
    results table (:func:`probfsl.running.run` of :func:`spec_from_args`). ``fs``
    replaces loading ``--dataset`` / ``--features``; ``progress`` shows the task bar."""
    spec = spec_from_args(args)
    if fs is not None:
        spec = dataclasses.replace(spec, dataset=None, features=fs, allow_pickle=False)
    return run(spec, progress=progress)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, (".json", ".csv"))
    device, dtype = _device_and_dtype(args)
    fixed = parse_params(args.param)
    search_space(args.method)
    make_estimator(args.method, **fixed)  # bad hyperparameters fail before loading
    fs = _load(args)
    open_queries = getattr(args, "open_queries", 0)
    fixed, prior_note = with_open_fraction(args.method, fixed, open_queries, args.query)
    if prior_note:
        _note(prior_note)
    choice = auto_choice(
        args.method, fs, fixed, device, dtype,
        way=args.way, shot=args.shot, query=args.query, balance=args.balance,
        alpha=args.alpha, episodes=args.episodes, seed=args.seed, criterion=args.criterion,
        zero_shot=args.zero_shot, min_classes=args.min_classes, max_classes=args.max_classes,
        open_queries=open_queries,
    )  # fmt: skip
    if choice.result is None:
        raise ValueError(f"cannot tune {args.method} on {fs.name}: {choice.reason}")
    if choice.note:
        _note(choice.note)
    print_tuning(choice.result, choice)
    if args.out:
        write_results(choice.result.table_rows(), args.out)
        print(f"wrote {args.out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.out:
        check_writable(args.out, (".json", ".csv"))
    row = run(spec_from_args(args))
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
    distance and maximum softmax baselines on nearest centroid (the same tasks). Where
    the default search ran another method (``method_run``), its row says so, as the
    closed-set table shows ``method_run`` beside ``method``."""
    header = (
        f"open-set: {row['tasks']} tasks, {row['way']}-way {row['shot']}-shot, "
        f"{row['query']} closed + {row['open_queries']} open queries "
        f"({row['open_way']} open classes) per task; percent but ece_open; "
        "95% intervals over tasks"
    )
    base = row.get("baseline", BASELINE)
    ran = row.get("method_run", row["method"])
    what = "P(open)" if ran == row["method"] else f"ran {ran}, P(open)"
    method = {"scorer": f"{row['method']} ({what})"}
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
