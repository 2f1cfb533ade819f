"""The ``probfsl`` command: list data sets, run the demo, evaluate a method on tasks."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from probfsl.data import (
    DATASETS,
    FeatureSet,
    episodes_from_indices,
    load_dataset,
    load_features,
    load_task_file,
    sample_episodes,
)
from probfsl.evaluation import evaluate, text_table, write_results
from probfsl.methods import METHODS, make_estimator, parse_params

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _load(args: argparse.Namespace) -> FeatureSet:
    if args.features:
        return load_features(args.features)
    return load_dataset(args.dataset)


def _device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name)


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
    task_file: str | None = None,
    batch_size: int = 1000,
    preset: str | None = None,
    params: dict | None = None,
) -> dict:
    """Evaluate ``method`` on one task setting; returns the row of the results table."""
    estimator = make_estimator(method, preset, **(params or {}))
    estimator.fit_featureset(fs, dtype)
    if task_file:
        episodes = episodes_from_indices(fs, load_task_file(task_file), dtype)
    else:
        episodes = sample_episodes(fs, tasks, way, shot, query, balance, alpha, seed, dtype=dtype)
    result = evaluate(estimator, episodes, batch_size, progress, device, dtype)
    return {
        "method": method,
        "dataset": fs.name,
        "way": episodes.way,
        "shot": episodes.shot,
        "query": episodes.n_query,
        "balance": "file" if task_file else balance,
        "alpha": alpha,
        "tasks": result.n_tasks,
        "seed": seed,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "preset": preset,
        "params": params or {},
        **{k: v for k, v in result.summary().items() if k != "n_tasks"},
    }


def cmd_datasets(args: argparse.Namespace) -> int:
    rows = []
    for name, (_, description) in DATASETS.items():
        fs = load_dataset(name)
        rows.append(
            {
                "name": name,
                "dim": fs.dim,
                "base": len(fs.classes_in("base")),
                "novel": len(fs.classes_in("novel")),
                "samples": int((fs.labels >= 0).sum()),
                "description": description,
            }
        )
    print(text_table(rows, ["name", "dim", "base", "novel", "samples", "description"]))
    return 0


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
) -> dict:
    """Zero-shot protocol (EM-Dirichlet): probabilities over all classes, matched clusters."""
    from probfsl.data import sample_zero_shot_tasks
    from probfsl.models.em_dirichlet import evaluate_zero_shot, zero_shot_probabilities

    estimator = make_estimator(method, **(params or {}))
    if not hasattr(estimator, "predict_zero_shot"):
        raise ValueError(f"--zero-shot is not available for method {method!r}")
    zs = sample_zero_shot_tasks(fs, tasks, min_classes, max_classes, query, seed)
    probs = zero_shot_probabilities(fs, zs, estimator.temperature, dtype)
    result = evaluate_zero_shot(estimator, probs, zs.query_labels, batch_size, progress)
    return {
        "method": method,
        "dataset": fs.name,
        "way": f"{min_classes}-{max_classes}",
        "shot": 0,
        "query": query,
        "balance": "natural",
        "tasks": result.n_tasks,
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "params": params or {},
        **{k: v for k, v in result.summary().items() if k != "n_tasks"},
    }


def _print_tuning(result) -> None:
    rows = result.table_rows()
    print(
        f"{result.method}: {len(rows)} candidates on base-class episodes, "
        f"criterion {result.criterion}, {result.seconds:.1f} s"
    )
    print(text_table(rows, list(rows[0])))
    print(f"chosen: {result.best}")


#: methods whose ``probfsl run --features`` uses ``--preset auto`` unless told otherwise
AUTO_BY_DEFAULT = ("bavardage", "em-dirichlet", "gp-tree")


def _tune(args: argparse.Namespace, fs: FeatureSet):
    from probfsl.tuning import tune, tune_zero_shot

    if getattr(args, "zero_shot", False):
        return tune_zero_shot(
            args.method,
            fs,
            None,
            args.min_classes,
            args.max_classes,
            args.query,
            n_tasks=args.episodes,
            seed=args.seed,
            fixed=parse_params(args.param),
        )
    return tune(
        args.method,
        fs,
        None,
        args.way,
        args.shot,
        args.query,
        args.balance,
        args.alpha,
        n_episodes=args.episodes,
        seed=args.seed,
        criterion=getattr(args, "criterion", "accuracy"),
        fixed=parse_params(args.param),
    )


def cmd_tune(args: argparse.Namespace) -> int:
    fs = _load(args)
    result = _tune(args, fs)
    _print_tuning(result)
    if args.out:
        write_results(result.table_rows(), args.out)
        print(f"wrote {args.out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    fs = _load(args)
    if args.preset is None and args.features and not args.param:
        if args.method in AUTO_BY_DEFAULT:
            print(f"{args.method}: --preset auto (the default for your own features)")
            args.preset = "auto"
    if args.preset == "auto":
        result = _tune(args, fs)
        _print_tuning(result)
        args.preset, args.param = None, [f"{k}={v!r}" for k, v in result.best.items()]
    if args.zero_shot:
        row = run_zero_shot(
            args.method,
            fs,
            args.tasks,
            args.min_classes,
            args.max_classes,
            args.query,
            args.seed,
            DTYPES[args.dtype],
            args.batch_size,
            progress=sys.stderr.isatty(),
            params=parse_params(args.param),
        )
    else:
        row = run_setting(
            args.method,
            fs,
            args.way,
            args.shot,
            args.query,
            args.balance,
            args.alpha,
            args.tasks,
            args.seed,
            _device(args.device),
            DTYPES[args.dtype],
            progress=sys.stderr.isatty(),
            task_file=args.task_file,
            batch_size=args.batch_size,
            preset=args.preset,
            params=parse_params(args.param),
        )
    print(text_table([row]))
    if args.out:
        write_results([row], args.out)
        print(f"wrote {args.out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.threads is None:
        # 64-d tasks are small: one thread avoids oversubscribing a busy machine
        torch.set_num_threads(1)
    fs = load_dataset("omniglot")
    settings = [(shot, balance) for balance in ("balanced", "dirichlet") for shot in (1, 5)]
    rows = []
    tic = time.perf_counter()
    for shot, balance in settings:
        for name, info in METHODS.items():
            tasks = args.tasks or info.demo_tasks
            rows.append(
                run_setting(
                    name,
                    fs,
                    5,
                    shot,
                    75,
                    balance,
                    2.0,
                    tasks,
                    0,
                    torch.device("cpu"),
                    torch.float32,
                    progress=False,
                )
            )
    print("probfsl demo: built-in Omniglot (PCA-64), 5-way, 75 queries, seed 0\n")
    print(
        text_table(
            rows, ["method", "shot", "balance", "tasks", "accuracy", "ci95", "tasks_per_second"]
        )
    )
    print(f"\n{len(rows)} runs in {time.perf_counter() - tic:.1f} s")
    if args.out:
        write_results(rows, args.out)
        print(f"wrote {args.out}")
    return 0


def cmd_select(args: argparse.Namespace) -> int:
    from probfsl.models.evidence import select_main

    return select_main(args.features, split=args.split)


def cmd_extract(args: argparse.Namespace) -> int:
    from probfsl.data.extract import extract_main

    extract_main(args.images, args.backbone, args.out, args.image_size, args.batch_size, args.split)
    return 0


class _Parser(argparse.ArgumentParser):
    """Reports a usage error on one line (``probfsl: error: ...``) and exits with 2."""

    def error(self, message: str):
        self.exit(2, f"probfsl: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="probfsl", description="Bayesian few-shot learning on pre-extracted features."
    )
    parser.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        help="torch CPU threads (1 is often fastest on a busy machine)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("datasets", help="list the built-in data sets").set_defaults(func=cmd_datasets)

    demo = sub.add_parser("demo", help="every method on built-in Omniglot, 1/5-shot, (un)balanced")
    demo.add_argument("--tasks", type=_positive(int), default=None, help="tasks per setting")
    demo.add_argument("--out", help="write the results as .json or .csv")
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser("run", help="evaluate one method on few-shot tasks")
    run.add_argument(
        "--method",
        required=True,
        choices=list(METHODS),
        metavar="NAME",
        help=f"one of: {', '.join(METHODS)}",
    )
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dataset",
        choices=list(DATASETS),
        metavar="NAME",
        help=f"built-in data set: {', '.join(DATASETS)}",
    )
    source.add_argument(
        "--features", metavar="PATH", help=".npz with features, labels, split (or .pt / .pkl)"
    )
    run.add_argument("--way", type=_positive(int), default=5)
    run.add_argument("--shot", type=_positive(int), default=1)
    run.add_argument("--query", type=_positive(int), default=75, help="queries per task in all")
    run.add_argument("--balance", choices=["balanced", "dirichlet"], default="balanced")
    run.add_argument(
        "--alpha",
        type=_positive(float),
        default=2.0,
        help="Dirichlet concentration of the unbalanced query counts",
    )
    run.add_argument("--tasks", type=_positive(int), default=1000)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="cpu")
    run.add_argument("--dtype", choices=list(DTYPES), default="float32")
    run.add_argument("--batch-size", type=_positive(int), default=1000)
    run.add_argument(
        "--task-file",
        metavar="PATH",
        help="explicit task file (.npz of row indices) instead of sampling",
    )
    run.add_argument(
        "--preset",
        metavar="NAME",
        help="a published setting of the method, or 'auto' (tuned on base-class episodes; "
        f"the default of {', '.join(AUTO_BY_DEFAULT)} on --features without --param)",
    )
    run.add_argument(
        "--episodes",
        type=_positive(int),
        default=300,
        help="base-class episodes (zero-shot: tasks) per candidate with --preset auto",
    )
    run.add_argument(
        "--param",
        action="append",
        metavar="KEY=VALUE",
        help="a hyperparameter of the method (repeatable), e.g. whitening=global",
    )
    run.add_argument(
        "--zero-shot",
        action="store_true",
        help="zero-shot tasks (em-dirichlet): 3-10 classes from all classes, "
        "probabilities from the class embeddings",
    )
    run.add_argument("--min-classes", type=_positive(int), default=3)
    run.add_argument("--max-classes", type=_positive(int), default=10)
    run.add_argument("--out", metavar="FILE", help="write the result as .json or .csv")
    run.set_defaults(func=cmd_run)

    tune = sub.add_parser(
        "tune", help="choose a method's hyperparameters on episodes of the base classes"
    )
    tune.add_argument("--method", required=True, metavar="NAME")
    tsource = tune.add_mutually_exclusive_group(required=True)
    tsource.add_argument("--dataset", choices=list(DATASETS), metavar="NAME")
    tsource.add_argument("--features", metavar="PATH")
    tune.add_argument("--way", type=_positive(int), default=5)
    tune.add_argument("--shot", type=_positive(int), default=1)
    tune.add_argument("--query", type=_positive(int), default=75)
    tune.add_argument("--balance", choices=["balanced", "dirichlet"], default="balanced")
    tune.add_argument("--alpha", type=_positive(float), default=2.0)
    tune.add_argument(
        "--episodes", type=_positive(int), default=300, help="base-class episodes per candidate"
    )
    tune.add_argument("--criterion", choices=["accuracy", "objective"], default="accuracy")
    tune.add_argument(
        "--zero-shot",
        action="store_true",
        help="tune for zero-shot tasks (em-dirichlet) drawn from the base classes only",
    )
    tune.add_argument("--min-classes", type=_positive(int), default=3)
    tune.add_argument("--max-classes", type=_positive(int), default=10)
    tune.add_argument(
        "--param", action="append", metavar="KEY=VALUE", help="a fixed hyperparameter (repeatable)"
    )
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--out", metavar="FILE", help="write the candidates as .json or .csv")
    tune.set_defaults(func=cmd_tune)

    select = sub.add_parser(
        "select", help="rank backbones (feature files of the same samples) by Bayesian evidence"
    )
    select.add_argument(
        "--features",
        nargs="+",
        required=True,
        metavar="PATH",
        help="two or more .npz feature files with the same rows and labels",
    )
    select.add_argument("--split", default=None, help="use only the rows of this split")
    select.set_defaults(func=cmd_select)

    extract = sub.add_parser(
        "extract", help="features of a folder or zip of images (one subfolder per class)"
    )
    extract.add_argument("images", metavar="IMAGES", help="folder or .zip of class subfolders")
    extract.add_argument(
        "--backbone",
        default="efficientnet-lite0",
        choices=["efficientnet-lite0", "efficientnet-lite1"],
    )
    extract.add_argument("--out", required=True, metavar="FILE.npz")
    extract.add_argument(
        "--image-size",
        type=_positive(int),
        default=None,
        help="resize images to this size (default: the backbone's own)",
    )
    extract.add_argument("--batch-size", type=_positive(int), default=64)
    extract.add_argument("--split", default="novel", help="value of the split field")
    extract.set_defaults(func=cmd_extract)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        print(f"probfsl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
