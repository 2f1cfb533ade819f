"""The ``probfsl`` command: its parser and entry point.

Light on purpose: ``probfsl --help`` and argument errors import neither torch nor any
method; :mod:`probfsl.commands` (what each subcommand does; :mod:`probfsl.sweeps.command`
for ``sweep`` and ``report``) is imported once a command runs. The choices of ``probfsl
run``'s options come from :mod:`probfsl.run_spec` (:func:`~probfsl.run_spec.run_choices`),
which a sweep file's schema reads too.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Sequence
from importlib import import_module

import probfsl
from probfsl.data.builtin import DATASETS
from probfsl.method_table import METHOD_TABLE
from probfsl.methods import DEFAULTS, METHODS, parse_params
from probfsl.run_spec import BALANCES, CALIBRATIONS, DTYPES, ENGINES

#: the module of a subcommand's ``cmd_<name>`` where it is not :mod:`probfsl.commands`
COMMAND_MODULES = {
    "datasets": "probfsl.cli",
    "sweep": "probfsl.sweeps.command",
    "report": "probfsl.sweeps.command",
    "cache": "probfsl.tuning_cache",
}
#: ``probfsl select --criterion`` choices (:data:`probfsl.selection.CRITERIA`)
SELECT_CRITERIA = ("episodes", "all-rows")


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse would name this function ("invalid _non_negative_int value")
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


ALLOW_PICKLE_HELP = "load .pkl feature files (unpickling runs code from the file: trusted only)"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help with each option's default (where it has one), the epilog's lines as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        return f"{text} (default: {default})" if text else f"default: {default}"


class _Parser(argparse.ArgumentParser):
    """Reports a usage error on one line (``probfsl: error: ...``) and exits with 2,
    suggesting the closest choice or option for a typo."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        #: checks of the parsed arguments as a whole: ``check(namespace)`` returns the
        #: message of a usage error, or ``None``
        self.checks: list = []

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for check in self.checks:
            message = check(namespace)
            if message:
                self.error(message)
        return namespace, extras

    def format_help(self) -> str:
        if callable(self.epilog):  # made when asked for: it imports every method
            self.epilog = self.epilog()
        return super().format_help()

    def error(self, message: str):
        self.exit(
            2,
            f"probfsl: error: {message}{self._did_you_mean(message)} (see '{self.prog} --help')\n",
        )

    def _did_you_mean(self, message: str) -> str:
        import difflib
        import re

        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            word, options = choice[1], re.findall(r"'?([\w.-]+)'?", choice[2])
        else:
            unknown = re.search(r"unrecognized arguments: (\S+)", message)
            if not unknown:
                return ""
            word = unknown[1].split("=")[0]
            options = [o for a in self._actions for o in a.option_strings]
            for action in self._actions:  # the options of the subcommand given
                for sub in (getattr(action, "choices", None) or {}).values():
                    if isinstance(sub, argparse.ArgumentParser):
                        options += [o for a in sub._actions for o in a.option_strings]
        close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
        return f"; did you mean {close[0]!r}?" if close else ""


class _RaisingParser(_Parser):
    """A parser whose usage errors raise ``ValueError`` (for arguments made by code, such
    as a sweep's cells, rather than typed)."""

    def error(self, message: str):
        raise ValueError(f"{message}{self._did_you_mean(message)}")


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    """``probfsl run ARGV``'s parsed arguments; a usage error raises ``ValueError``."""
    return _raising_parser().parse_args(["run", *argv])


@functools.cache
def _raising_parser() -> argparse.ArgumentParser:
    return build_parser(_RaisingParser)


def _add_device_dtype(
    parser: argparse.ArgumentParser, dtype: str = "float32", why: str = ""
) -> None:
    """``--device`` (checked by :func:`_device` before any data is loaded) and ``--dtype``."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=dtype, help=why or f"default {dtype}"
    )


def _add_task_shape(parser: argparse.ArgumentParser) -> None:
    """``--way``, ``--shot``, ``--query``, ``--balance`` and ``--alpha``: the few-shot task
    setting (:mod:`probfsl.data.tasks`)."""
    parser.add_argument("--way", type=_positive(int), default=5, help="classes per task")
    parser.add_argument("--shot", type=_positive(int), default=1, help="support samples per class")
    parser.add_argument("--query", type=_positive(int), default=75, help="queries per task in all")
    parser.add_argument(
        "--balance",
        choices=list(BALANCES),
        default="balanced",
        help="queries per class: equal, or drawn from a Dirichlet (--alpha)",
    )
    parser.add_argument(
        "--alpha",
        type=_positive(float),
        default=2.0,
        help="Dirichlet concentration of the unbalanced query counts",
    )


def _add_executor(
    parser: argparse.ArgumentParser, choices: list[str], what: str, local_workers: str
) -> None:
    """``--executor`` (``choices``, the first the default), ``--workers`` and
    ``--address``: where the work of a subcommand runs (:mod:`probfsl.sweeps.executors`)."""
    parser.add_argument("--executor", choices=choices, default=choices[0], help=what)
    parser.add_argument(
        "--workers",
        type=_positive(int),
        default=None,
        help=f"{local_workers}; ray without --address: the local cluster's CPUs",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="with --executor ray: 'auto' (this machine's cluster) or ray://host:port "
        "(default: $RAY_ADDRESS, else a local cluster started for the command)",
    )


def _add_zero_shot_range(parser: argparse.ArgumentParser) -> None:
    """``--min-classes`` and ``--max-classes`` of zero-shot tasks."""
    parser.add_argument(
        "--min-classes", type=_positive(int), default=3, help="zero-shot: fewest classes"
    )
    parser.add_argument(
        "--max-classes", type=_positive(int), default=10, help="zero-shot: most classes"
    )


def _methods_epilog() -> str:
    """Per method: its named presets and its ``--param`` keys (the estimator's
    hyperparameters), from :data:`probfsl.method_table.METHOD_TABLE`."""
    lines = ["methods, their presets and --param keys:"]
    for name, info in METHODS.items():
        row = METHOD_TABLE[name]
        lines.append(f"  {name}: {info.description}")
        if row["presets"]:
            lines.append(f"    presets: {', '.join(row['presets'])}")
        lines.append(f"    params: {', '.join(row['params'])}")
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    """What can be checked of a command's arguments before torch or any method loads:
    the files named exist, ``--param`` keys and ``--preset`` names are the method's,
    ``--engine`` is given to a method with two engines. The same checks (and messages)
    run again where the work starts, for callers that skip the command line."""
    from pathlib import Path

    from probfsl.methods import check_param_keys, check_preset_name, methods_with_engines

    feature_files = _as_list(getattr(args, "features", None))
    if args.command == "merge":
        feature_files += args.files
    for path in feature_files:
        if not Path(path).is_file():
            raise ValueError(f"feature file not found: {path}")
    if args.command == "extract":
        for folder in (args.images, args.base_dir):
            path = Path(folder) if folder else None
            if path and not (path.is_dir() or path.is_file()):
                raise ValueError(f"images must be a folder or a .zip archive, got {folder}")
    task_file = getattr(args, "task_file", None)
    if task_file and not Path(task_file).is_file():
        raise ValueError(f"--task-file: file not found: {task_file}")
    method = getattr(args, "method", None)
    if method is None:
        return
    check_param_keys(method, parse_params(args.param))
    preset = getattr(args, "preset", None)
    if preset is not None and not getattr(args, "zero_shot", False):
        check_preset_name(method, preset)
    engine = getattr(args, "engine", None)
    if engine is not None and method not in methods_with_engines():
        raise ValueError(
            f"--engine: {method} has one engine; methods with two: {methods_with_engines()}"
        )


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _torch_version() -> str:
    """torch's version from its metadata (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _sweep_address_needs_ray(args: argparse.Namespace) -> str | None:
    """``probfsl sweep --address`` is a Ray cluster's: without ``--executor ray`` it is a
    usage error rather than ignored."""
    if getattr(args, "command", None) == "sweep" and args.address is not None:
        if args.executor != "ray":
            return f"sweep: --address {args.address} needs --executor ray (got {args.executor})"
    return None


def build_parser(parser_class: type[_Parser] = _Parser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="probfsl", description="Bayesian few-shot learning on pre-extracted features."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"probfsl {probfsl.__version__} (torch {_torch_version()})",
    )
    parser.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        help="torch CPU threads (1 is often fastest on a busy machine)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("datasets", help="list the built-in data sets")

    demo = sub.add_parser("demo", help="every method on built-in Omniglot, 1/5-shot, (un)balanced")
    demo.add_argument("--tasks", type=_positive(int), default=None, help="tasks per setting")
    _add_device_dtype(demo)
    demo.add_argument("--out", metavar="FILE", help="write the results as .json or .csv")

    run = sub.add_parser(
        "run", help="evaluate one method on few-shot tasks", epilog=_methods_epilog
    )
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
    run.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)
    _add_task_shape(run)
    run.add_argument("--tasks", type=_positive(int), default=1000, help="tasks to evaluate")
    run.add_argument(
        "--open-queries",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="open-set tasks: N open queries per task from other novel classes (as many "
        "open classes as --way where the data hold them; 75 in the literature), scored "
        "by the method's P(none of the classes): closed accuracy, AUROC, AUPR, precision "
        "at 90%% recall, ECE-open, beside nearest centroid with k-NN distance and max "
        "softmax (0: closed tasks)",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of the tasks (task i: seed, i)")
    _add_device_dtype(run)
    run.add_argument(
        "--batch-size",
        type=_positive(int),
        default=None,
        help="tasks made and scored at once; memory grows with it, not with --tasks "
        "(default 1000; on the CPU 100 for gp-tree, 200 for em-dirichlet)",
    )
    run.add_argument(
        "--task-file",
        metavar="PATH",
        help="explicit task file (.npz of row indices) instead of sampling; it sets way, "
        "shot and queries, is checked once before the run (with progress) and is made "
        "into tasks a batch at a time; one with an 'open_classes' field holds open-set "
        "tasks (queries labelled `way` are open) and is scored as --open-queries is",
    )
    run.add_argument(
        "--preset",
        metavar="NAME",
        help="a published setting of the method; 'auto': hyperparameters tuned on "
        "base-class episodes of the run's setting (cached; the default of every tunable "
        f"method when the data have base classes and no --param is given); '{DEFAULTS}': "
        "the method's own defaults",
    )
    run.add_argument(
        "--episodes",
        type=_positive(int),
        default=None,
        help="base-class episodes (zero-shot: tasks) per candidate with --preset auto "
        "(default 300; gp-tree 100)",
    )
    run.add_argument(
        "--param",
        action="append",
        metavar="KEY=VALUE",
        help="a hyperparameter of the method (repeatable), e.g. whitening=global",
    )
    run.add_argument(
        "--engine",
        choices=list(ENGINES),
        default=None,
        help="the methods of the papers: their hand-written updates (default) or the "
        "updates derived by variational message passing from their Pyro declaration",
    )
    run.add_argument(
        "--calibrate",
        choices=list(CALIBRATIONS),
        default=None,
        help="temper the query probabilities by one temperature fitted on base-class "
        "episodes (accuracy unchanged; in open-set tasks the known classes' columns, "
        "P(open) as it is); default: temperature with --preset auto, else none",
    )
    run.add_argument(
        "--zero-shot",
        action="store_true",
        help="zero-shot tasks (em-dirichlet): 3-10 classes from all classes, "
        "probabilities from the class embeddings",
    )
    _add_zero_shot_range(run)
    run.add_argument("--out", metavar="FILE", help="write the result as .json or .csv")

    tune = sub.add_parser(
        "tune", help="choose a method's hyperparameters on episodes of the base classes"
    )
    tune.add_argument(
        "--method",
        required=True,
        choices=list(METHODS),
        metavar="NAME",
        help=f"one of: {', '.join(METHODS)} (all but nearest-centroid)",
    )
    tsource = tune.add_mutually_exclusive_group(required=True)
    tsource.add_argument(
        "--dataset",
        choices=list(DATASETS),
        metavar="NAME",
        help=f"built-in data set: {', '.join(DATASETS)}",
    )
    tsource.add_argument("--features", metavar="PATH", help=".npz with features, labels, split")
    tune.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)
    _add_task_shape(tune)
    tune.add_argument(
        "--episodes",
        type=_positive(int),
        default=None,
        help="base-class episodes (zero-shot: tasks) per candidate (default 300; gp-tree 100)",
    )
    tune.add_argument(
        "--open-queries",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="tune for open-set tasks: N open queries per base episode from other base "
        "classes, candidates ranked by the accuracy of the known-class queries, the frame "
        "of P(open) by the open queries' AUROC (0: closed)",
    )
    tune.add_argument(
        "--criterion",
        choices=["accuracy", "objective"],
        default="accuracy",
        help="rank candidates by base-episode accuracy or by the ELBO / log evidence",
    )
    tune.add_argument(
        "--zero-shot",
        action="store_true",
        help="tune for zero-shot tasks (em-dirichlet) drawn from the base classes only",
    )
    _add_zero_shot_range(tune)
    tune.add_argument(
        "--param", action="append", metavar="KEY=VALUE", help="a fixed hyperparameter (repeatable)"
    )
    tune.add_argument("--seed", type=int, default=0, help="seed of the base-class episodes")
    _add_device_dtype(tune)
    tune.add_argument("--out", metavar="FILE", help="write the candidates as .json or .csv")

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
    select.add_argument(
        "--criterion",
        choices=list(SELECT_CRITERIA),
        default="episodes",
        help="episodes (default): mean evidence of the query labels given the support on "
        "few-shot episodes of the base classes; all-rows: summed evidence of all labelled "
        "rows as one problem (Kim et al. 2016, section 3.4)",
    )
    select.add_argument(
        "--way", type=_positive(int), default=5, help="classes per episode (default 5)"
    )
    select.add_argument(
        "--shot", type=_positive(int), default=5, help="support samples per class (default 5)"
    )
    select.add_argument(
        "--query",
        type=_positive(int),
        default=75,
        help="queries per episode in all, divisible by --way (default 75)",
    )
    select.add_argument(
        "--episodes",
        type=_positive(int),
        default=500,
        help="episodes, the same rows for every file (default 500)",
    )
    select.add_argument("--seed", type=int, default=0, help="seed of the episodes (default 0)")
    select.add_argument(
        "--split",
        default=None,
        help="draw the episodes from (all-rows: use) only the rows of this split "
        "(default: the base classes, or all labelled rows if there are none)",
    )
    select.add_argument("--allow-pickle", action="store_true", help=ALLOW_PICKLE_HELP)
    _add_device_dtype(
        select, "float64", "float64 by default: the evidence sums a log term per sample"
    )

    extract = sub.add_parser(
        "extract", help="features of a folder or zip of images (one subfolder per class)"
    )
    extract.add_argument("images", metavar="IMAGES", help="folder or .zip of class subfolders")
    extract.add_argument(
        "--backbone",
        default="efficientnet-lite0",
        choices=["efficientnet-lite0", "efficientnet-lite1"],
        help="the pretrained network (weights from its installed package)",
    )
    extract.add_argument(
        "--out", required=True, metavar="FILE.npz", help="the feature file to write"
    )
    extract.add_argument(
        "--image-size",
        type=_positive(int),
        default=None,
        help="resize images to this size (default: the backbone's own)",
    )
    extract.add_argument(
        "--batch-size", type=_positive(int), default=64, help="images per forward pass"
    )
    extract.add_argument(
        "--split",
        choices=["novel", "base"],
        default="novel",
        help="mark the classes of IMAGES as novel (default) or base classes",
    )
    extract.add_argument(
        "--base-dir",
        metavar="BASE_IMAGES",
        help="also extract this folder or .zip as the base classes, into the same file",
    )
    _add_executor(
        extract,
        ["here", "local", "ray"],
        "here: this process; local: worker processes; ray: a Ray cluster (shards of images, "
        "each sent to a worker)",
        "local: worker processes (default: the cores)",
    )

    sweep = sub.add_parser(
        "sweep",
        help="many runs from one YAML file (data x methods x settings x seeds), resumable",
        description="Run every cell of SWEEP.yaml (each one 'probfsl run') that the results "
        "folder does not hold yet; rows are stored as cells end, so a sweep run again "
        "resumes where it stopped. The file's format: docs/sweeps.md.",
    )
    sweep.add_argument("config", metavar="SWEEP.yaml", help="the sweep's description")
    sweep.add_argument(
        "--results",
        metavar="DIR",
        help="the results store, a folder (default: SWEEP-results in the current folder)",
    )
    _add_executor(
        sweep,
        ["local", "ray"],
        "local: worker processes on this machine (no server); ray: a Ray cluster "
        '(pip install -c constraints.txt -e ".[distributed]" from a clone of probfsl)',
        "local: worker processes (default: cores / resources.cpus, or the GPUs' slots)",
    )
    sweep.add_argument(
        "--retry-failed", action="store_true", help="run the stored failed cells again"
    )
    sweep.add_argument(
        "--dry-run", action="store_true", help="list the cells and which are stored; run none"
    )
    sweep.add_argument(
        "--report", metavar="DIR", help="then write the report (tables, figures) into DIR"
    )
    parser.checks.append(_sweep_address_needs_ray)

    report = sub.add_parser(
        "report", help="tables (Markdown, HTML) and figures from a sweep's results"
    )
    report.add_argument(
        "results", metavar="RESULTS", help="a sweep's results folder, or its .parquet / .csv"
    )
    report.add_argument(
        "--out", metavar="DIR", help="folder of the report (default: RESULTS/report)"
    )
    report.add_argument("--title", default="probfsl sweep report", help="the report's title")
    report.add_argument(
        "--code-version",
        metavar="VERSION",
        help="report the rows of this code version (default: the installed code's version "
        "where the results hold it, else that of the most recently written rows); rows of "
        "two versions are never pooled",
    )
    report.add_argument(
        "--prune",
        action="store_true",
        help="first remove from the results folder the rows of every other code version and "
        "the damaged row files (says how many)",
    )

    cache = sub.add_parser(
        "cache",
        help="list the tuning cache (--preset auto's choices, fitted temperatures), or clear it",
    )
    cache.add_argument(
        "--clear", action="store_true", help="remove every entry of the user's cache"
    )

    merge = sub.add_parser(
        "merge",
        help="one feature file from several (e.g. a base and a novel extraction); "
        "the classes of different files stay distinct",
    )
    merge.add_argument("files", nargs="+", metavar="FILE.npz")
    merge.add_argument(
        "--out", required=True, metavar="FILE.npz", help="the merged feature file to write"
    )
    return parser


def cmd_datasets(args: argparse.Namespace) -> int:
    """``probfsl datasets``: the built-in data sets, read without torch."""
    from probfsl.data.builtin import dataset_summary
    from probfsl.evaluation.tables import text_table

    rows = [dataset_summary(name) for name in DATASETS]
    print(text_table(rows, ["name", "dim", "base", "novel", "samples", "description"]))
    return 0


def _log_to_stderr() -> None:
    """The library's notes (the ``probfsl`` logger, INFO and up) as one line each on
    stderr, like the command's own notes; once per process."""
    import logging

    class Stderr(logging.StreamHandler):
        """Writes to the ``sys.stderr`` of the moment (not the one at creation)."""

        _probfsl_cli = True

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value) -> None:
            pass

    logger = logging.getLogger("probfsl")
    if not any(getattr(h, "_probfsl_cli", False) for h in logger.handlers):
        handler = Stderr()
        handler.setFormatter(logging.Formatter("probfsl: note: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        check_arguments(args)
        commands = import_module(COMMAND_MODULES.get(args.command, "probfsl.commands"))
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        return getattr(commands, f"cmd_{args.command}")(args)
    except KeyboardInterrupt:
        print("probfsl: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as err:
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"probfsl: error: {message}", file=sys.stderr)
        return 2
    except Exception as err:
        torch = sys.modules.get("torch")
        if isinstance(err, MemoryError) or (torch and isinstance(err, torch.OutOfMemoryError)):
            print("probfsl: error: out of memory: try a smaller --batch-size", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
