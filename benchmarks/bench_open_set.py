"""Few-shot open-set recognition on the built-in data or your own: every method against OSTIM.

The protocol of Boudiaf, Bennequin, Tami, Toubhans, Piantanida, Hudelot & Ben Ayed,
"Model-Agnostic Few-Shot Open-Set Recognition" (2022), on the built-in Omniglot and
WordNet sets (``--datasets``) and on feature files (``--features PATH``, any file
``probfsl run --features`` reads; a cell is named by the file's stem, or by ``NAME=PATH``);
``--swap-splits`` runs each set with its base and novel classes exchanged instead, a
check on classes that neither the defaults nor the searches were ever chosen on: 5-way
1- and 5-shot tasks from the novel classes, 15 closed queries per known class and 75
open queries (15 from each of 5 other novel classes), the same seeded tasks for every
scorer (``sample_episodes(fs, T, 5, shot, 75, n_open=75, seed=SEED)``). Scored on them:

* **OSTIM**, the paper's transductive method, run by its authors' code: the class file
  ``src/all_in_one/ostim.py`` of a local clone of the public repository
  (``--ostim-repo PATH``; ``git clone https://github.com/ebennequin/few-shot-open-set``)
  is imported on its own (the package's ``__init__`` pulls in every other method), with
  ``easyfsl``'s ``compute_prototypes`` replaced by a per-class mean when ``easyfsl`` is
  not installed. Its hyperparameters are the clone's ``configs/detectors.yaml`` defaults
  for the shot, and its feature transform the one of the clone's ``run_ostim`` recipe
  (``Trivial``: the raw features; OSTIM centres them on the task's mean itself,
  ``mu_init: mean``). Its outlier score is the softmax mass of its extra logit, so it
  has an ECE-open too. Without ``--ostim-repo`` its rows are left out.
* **Nearest centroid + k-NN distance** and **nearest centroid + max softmax**
  (:func:`probfsl.evaluation.open_set.open_set_baselines`): outlier scores that are not
  probabilities (no ECE-open).
* **Every probfsl method at the defaults a user gets from** ``probfsl run`` through
  ``predict_proba_open`` (the last column: P(none of the K classes)); a method without
  an open-set posterior is listed as skipped with its message. Where the method has a
  search space and the data have base classes, that is ``--preset auto``: the choice of
  :func:`probfsl.running.auto_choice` (the function ``probfsl run`` calls) on base-class
  episodes of the cell's setting, with the open queries for the open-set row
  (``probfsl run --open-queries 75``: base episodes with 75 open queries from other
  base classes) and without them for the closed-only column (``probfsl run``); the
  choice is named in the row's *defaults* column and may be nearest centroid where the
  search found the method below it. Other methods run at their constructor defaults.
  For each, the closed-set accuracy of ``predict_proba`` on the same tasks *without* the
  open queries (``n_open=0``, same seed: the same support and closed queries) shows
  what the open queries cost. ``--constructor-defaults`` adds a row per tuned method at
  its raw constructor defaults (what ``make_estimator(method)`` builds).

Metrics (:mod:`probfsl.evaluation.open_set`): closed accuracy, AUROC, AUPR, precision at
90% recall of the open queries, ECE-open (15 bins), each the mean over tasks ± 95% CI.
Methods in :data:`SLOW` run on the first ``tasks / divisor`` of the same tasks.
``--variant METHOD:KEY=VALUE[,KEY=VALUE]`` (repeatable) adds a row of a method with other
parameters, e.g. ``--variant vmp-gmm:open_model=declared``.

    python benchmarks/bench_open_set.py --ostim-repo ~/few-shot-open-set [--quick] [--tasks 500]
    python benchmarks/bench_open_set.py --datasets --features mine.npz --out results/mine
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, load_features, sample_episodes
from probfsl.evaluation.calibration import mean_ci
from probfsl.evaluation.open_set import (
    OpenSetOutputs,
    evaluate_open_set,
    open_set_baselines,
)
from probfsl.methods import METHODS
from probfsl.running import auto_by_default, auto_choice
from probfsl.tuning import SEARCH_SEED

HERE = Path(__file__).resolve().parent
DATASETS = ("omniglot", "wordnet")
WAY, PER_CLASS, N_OPEN = 5, 15, 75
#: tasks are divided by this for methods that fit a per-task model in a Python loop
SLOW = {"em-dirichlet": 5}
#: the metrics of the table, in order
COLUMNS = ("accuracy", "auroc", "aupr", "prec_at_90_recall", "ece_open")


# --- OSTIM from a clone of the reference repository --------------------------------------


def _compute_prototypes(support_features: torch.Tensor, support_labels: torch.Tensor):
    """Per-class mean of the support features, classes 0..K-1 in order (what
    ``easyfsl.utils.compute_prototypes`` returns)."""
    n_way = int(support_labels.max()) + 1
    return torch.stack([support_features[support_labels == k].mean(0) for k in range(n_way)])


def load_ostim(repo: Path) -> tuple[type, dict, str]:
    """``(OSTIM class, {shot: hyperparameters}, how it was imported)`` from a clone."""
    folder = repo / "src" / "all_in_one"
    config = repo / "configs" / "detectors.yaml"
    if not (folder / "ostim.py").is_file() or not config.is_file():
        raise SystemExit(
            f"--ostim-repo {repo}: no src/all_in_one/ostim.py or configs/detectors.yaml "
            "(clone https://github.com/ebennequin/few-shot-open-set)"
        )
    how = "reference class file imported"
    try:
        import easyfsl.utils  # noqa: F401
    except ImportError:
        easyfsl = types.ModuleType("easyfsl")
        utils = types.ModuleType("easyfsl.utils")
        utils.compute_prototypes = _compute_prototypes
        easyfsl.utils = utils
        sys.modules.setdefault("easyfsl", easyfsl)
        sys.modules.setdefault("easyfsl.utils", utils)
        how += "; easyfsl not installed: compute_prototypes stubbed as the per-class mean"
    package = types.ModuleType("_ostim_reference")
    package.__path__ = [str(folder)]
    sys.modules["_ostim_reference"] = package
    module = None
    for name in ("abstract", "ostim"):
        spec = importlib.util.spec_from_file_location(
            f"_ostim_reference.{name}", folder / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    import yaml

    defaults = yaml.safe_load(config.read_text())["feature_detectors"]["OSTIM"]["default"]
    return module.OSTIM, {int(k): dict(v) for k, v in defaults.items()}, how


class OSTIMScorer:
    """OSTIM per task on the raw features (its own task-mean centring), as an open-set
    scorer for :func:`probfsl.evaluation.open_set.evaluate_open_set`."""

    def __init__(self, ostim_class: type, params: dict, train_mean: torch.Tensor) -> None:
        self.ostim_class, self.params, self.train_mean = ostim_class, params, train_mean

    def open_set_outputs(self, episodes) -> OpenSetOutputs:
        closed, outlier = [], []
        for t in range(len(episodes)):
            task = episodes[t : t + 1]
            # a fresh instance per task, as the reference's loop leaves no state behind
            method = self.ostim_class(**self.params)
            _, probas_q, scores = method(
                support_features=task.support[0].float().cpu(),
                query_features=task.query[0].float().cpu(),
                support_labels=task.support_labels[0].long().cpu(),
                query_labels=task.query_labels[0].long().cpu(),
                outliers=task.open_mask[0].long().cpu(),
                intra_task_metrics=defaultdict(lambda: defaultdict(list)),
                train_mean=self.train_mean.clone(),
            )
            closed.append(probas_q)
            outlier.append(scores)
        scores = torch.stack(outlier)
        return OpenSetOutputs(torch.stack(closed), scores, scores)


# --- the runs ------------------------------------------------------------------------------


def closed_accuracy(estimator, episodes, batch: int) -> tuple[float, float]:
    """Accuracy (%) ± 95% CI of ``predict_proba`` on closed tasks."""
    per_task = []
    for a in range(0, len(episodes), batch):
        part = episodes[a : a + batch]
        proba = estimator.predict_proba(part)
        per_task.append((proba.argmax(-1) == part.query_labels).double().mean(-1).numpy())
    mean, ci = mean_ci(np.concatenate(per_task))
    return 100 * mean, 100 * ci


def row_of(result, **fields) -> dict:
    row = dict(fields, tasks=result.n_tasks, tasks_per_second=result.tasks_per_second)
    for name in COLUMNS:
        if name in result.metrics:
            row[name], row[f"{name}_ci95"] = result.metrics[name]
    return row


def run_cell(fs, data: str, shot: int, args, ostim) -> list[dict]:
    n = args.tasks
    open_tasks = sample_episodes(fs, n, WAY, shot, WAY * PER_CLASS, n_open=N_OPEN, seed=args.seed)
    closed_tasks = sample_episodes(fs, n, WAY, shot, WAY * PER_CLASS, seed=args.seed)
    assert torch.equal(open_tasks.support, closed_tasks.support)
    cell = dict(data=data, shot=shot)
    rows = []

    def report(row: dict) -> None:
        rows.append(row)
        if "skipped" in row:
            print(f"{data:8} {shot}-shot {row['method']:28} skipped: {row['skipped']}", flush=True)
            return
        text = "  ".join(f"{k} {row[k]:.2f}±{row[k + '_ci95']:.2f}" for k in COLUMNS if k in row)
        closed = row.get("closed_only_accuracy")
        extra = f"  no-open acc {closed:.2f}" if closed is not None else ""
        if "auto" in row.get("defaults", ""):
            extra += f"  [{row['defaults']}]"
        print(f"{data:8} {shot}-shot {row['method']:28} {text}{extra}", flush=True)

    if ostim is not None:
        ostim_class, config, _ = ostim
        if shot in config:
            train_mean = torch.as_tensor(fs.features[fs.split == "base"].mean(0)).float()
            scorer = OSTIMScorer(ostim_class, config[shot], train_mean)
            n_ostim = max(10, n // args.ostim_divisor)
            result = evaluate_open_set(scorer, open_tasks[:n_ostim], batch_size=args.batch)
            report(row_of(result, **cell, method="OSTIM (reference code)", kind="reference"))
        else:
            report(dict(cell, method="OSTIM (reference code)", skipped=f"no {shot}-shot config"))

    centroid = make_estimator("nearest-centroid").fit_featureset(fs)
    baselines = open_set_baselines(centroid)
    for key, label in (
        ("knn", "nearest centroid + k-NN distance"),
        ("msp", "nearest centroid + max softmax"),
    ):
        result = evaluate_open_set(baselines[key], open_tasks, batch_size=args.batch)
        row = row_of(result, **cell, method=label, kind="baseline")
        row.pop("ece_open", None), row.pop("ece_open_ci95", None)
        report(row)

    runs = []
    for method in args.methods:
        if auto_by_default(method, fs):
            runs.append((method, method, None))
            if args.constructor_defaults:
                runs.append((f"{method} (constructor defaults)", method, {}))
        else:
            runs.append((method, method, {}))
    runs += [(label, method, params) for label, (method, params) in args.variants.items()]
    for label, method, params in runs:
        m = max(10, n // SLOW.get(method, 1))
        tic = time.perf_counter()
        if params is None:  # probfsl run's default: --preset auto, as running.py chooses
            (closed_model, open_model), defaults = user_defaults(method, fs, shot)
        else:
            closed_model = open_model = make_estimator(method, **params)
            defaults = "constructor" + "".join(f", {k}={v}" for k, v in params.items())
        open_model.fit_featureset(fs)
        try:
            result = evaluate_open_set(open_model, open_tasks[:m], batch_size=args.batch)
        except (ValueError, NotImplementedError, AttributeError) as error:
            report(dict(cell, method=label, kind="probfsl", skipped=str(error).split("\n")[0]))
            continue
        row = row_of(result, **cell, method=label, kind="probfsl", defaults=defaults)
        if closed_model is not open_model:
            closed_model.fit_featureset(fs)
        row["closed_only_accuracy"], row["closed_only_ci95"] = closed_accuracy(
            closed_model, closed_tasks[:m], args.batch
        )
        row["seconds"] = time.perf_counter() - tic
        report(row)
    return rows


def user_defaults(method: str, fs, shot: int) -> tuple[tuple, str]:
    """``((closed-task estimator, open-set estimator), description)`` at the defaults of
    ``probfsl run`` where it tunes (``--preset auto``): :func:`probfsl.running.auto_choice`
    on base-class episodes of the cell's setting (the search's own seed, float32 on the
    CPU), without and with the open queries. Searches are cached on disk
    (:mod:`probfsl.tuning_cache`), as for ``probfsl run``."""
    models, described = [], []
    for n_open in (0, N_OPEN):
        choice = auto_choice(
            method, fs, {}, torch.device("cpu"), torch.float32, False,
            way=WAY, shot=shot, query=WAY * PER_CLASS, seed=SEARCH_SEED, open_queries=n_open,
        )  # fmt: skip
        ran = choice.method_run(method)
        models.append(make_estimator(ran, choice.preset, **choice.params))
        what = ran if ran != method else ""
        if choice.preset:
            what += f" preset {choice.preset}"
        what += " " + ", ".join(f"{k}={_short(v)}" for k, v in choice.params.items())
        described.append(f"{'open' if n_open else 'closed'}: {what.strip() or 'defaults'}")
    return tuple(models), "auto (" + "; ".join(described) + ")"


def _short(value):
    return f"{value:.3g}" if isinstance(value, float) else value


def parse_variant(text: str) -> tuple[str, tuple[str, dict]]:
    """``"METHOD:KEY=VALUE,..."`` as (row label, (METHOD, parameters)); each value is
    read as a Python literal where it is one (numbers), else kept as a string."""
    import ast

    method, _, rest = text.partition(":")
    if method not in METHODS or not rest:
        raise SystemExit(f"--variant {text!r}: expected METHOD:KEY=VALUE[,KEY=VALUE]")
    params = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not (key and eq and value):
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    make_estimator(method, **params)  # a bad parameter fails here, before any run
    return f"{method} ({rest})", (method, params)


def feature_file(text: str):
    """The feature set of ``"[NAME=]PATH"``, named NAME (else the file's stem); it must
    have base classes (the background and the searches are fitted on them)."""
    named = "=" in text and not Path(text).expanduser().is_file()
    name, path = text.split("=", 1) if named else ("", text)
    path = Path(path).expanduser()
    if not path.is_file():
        raise SystemExit(f"--features {text!r}: no such file")
    fs = load_features(path, name=name or path.stem)
    if fs.classes_in("base").size == 0:
        raise SystemExit(f"--features {text!r}: no base classes (a `split` field)")
    return fs


def swapped(fs):
    """``fs`` with its base and novel rows exchanged (other rows untouched)."""
    split = np.where(fs.split == "base", "novel", np.where(fs.split == "novel", "base", fs.split))
    return dataclasses.replace(fs, split=split, name=f"{fs.name}-swapped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ostim-repo",
        type=Path,
        default=None,
        help="a local clone of github.com/ebennequin/few-shot-open-set",
    )
    parser.add_argument("--quick", action="store_true", help="100 tasks a cell")
    parser.add_argument("--tasks", type=int, default=500, help="tasks per data set and shot")
    parser.add_argument(
        "--datasets",
        nargs="*",
        default=list(DATASETS),
        choices=DATASETS,
        help="built-in data sets (none: `--datasets` alone, with --features)",
    )
    parser.add_argument(
        "--features",
        nargs="+",
        default=[],
        metavar="[NAME=]PATH",
        help="feature files with base and novel classes (.npz, .pt), as probfsl run reads them",
    )
    parser.add_argument("--shots", nargs="+", type=int, default=[1, 5])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--ostim-divisor", type=int, default=1, help="OSTIM runs on the first tasks/divisor tasks"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="METHOD:KEY=VALUE[,KEY=VALUE]",
        help="one more row: METHOD with these parameters (repeatable), e.g. "
        "vmp-gmm:open_model=declared",
    )
    parser.add_argument(
        "--constructor-defaults",
        action="store_true",
        help="also a row per tuned method at its raw constructor defaults",
    )
    parser.add_argument(
        "--swap-splits",
        action="store_true",
        help="exchange each set's base and novel classes (a check on classes no default "
        "was chosen on)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=100, help="tasks per predict call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "open_set")
    args = parser.parse_args()
    if args.quick:
        args.tasks = 100
    args.variants = dict(parse_variant(text) for text in args.variant)
    sets = [load_dataset(name) for name in args.datasets]
    sets += [feature_file(text) for text in args.features]
    if not sets:
        raise SystemExit("nothing to run: give --datasets or --features")
    if args.swap_splits:
        sets = [swapped(fs) for fs in sets]
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("probfsl").setLevel(logging.WARNING)
    ostim = load_ostim(args.ostim_repo.expanduser().resolve()) if args.ostim_repo else None
    rows, tic = [], time.perf_counter()
    for fs in sets:
        for shot in args.shots:
            rows.extend(run_cell(fs, fs.name, shot, args, ostim))
    write(rows, args, ostim, time.perf_counter() - tic)


def _pm(row: dict, name: str, digits: int = 2) -> str:
    if name not in row:
        return "N/A"
    return f"{row[name]:.{digits}f} ± {row[name + '_ci95']:.{digits}f}"


def write(rows: list[dict], args, ostim, seconds: float) -> None:
    """``OUT.json`` (every row) and ``OUT.md`` (a table per data set and shot)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "tasks": args.tasks,
        "way": WAY,
        "closed_queries_per_class": PER_CLASS,
        "open_queries": N_OPEN,
        "seed": args.seed,
        "slow_divisors": SLOW,
        "ostim": None if ostim is None else {"how": ostim[2], "config": ostim[1]},
        "ostim_divisor": args.ostim_divisor,
        "seconds": round(seconds, 1),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
    }
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1, default=str)
    )
    lines = [
        "# Few-shot open-set recognition (5-way, 15 closed queries a class + 75 open queries)",
        "",
        f"Novel classes, {args.tasks} seeded tasks a cell (seed "
        f"{args.seed}), the same tasks for every row (a row with fewer tasks ran on the "
        "first ones). Mean over tasks ± 95% CI; accuracy, AUROC, AUPR and precision at "
        "90% recall of the open queries (P@90R) in %. *Closed only*: the method's accuracy "
        "on the same tasks without the open queries. ECE-open: the calibration of "
        "P(open) (15 bins); N/A where the outlier score is not a probability.",
        "",
        "Each method runs at the defaults a user gets from `probfsl run`: `--preset auto` "
        "where the method has a search space (hyperparameters tuned on base-class "
        "episodes of the cell's setting by `probfsl.running.auto_choice`; with 75 open "
        "queries from other base classes for the open-set columns, as `probfsl run "
        "--open-queries 75` does, without them for *closed only*), else the constructor "
        "defaults. The choices are listed under each table.",
        "",
    ]
    for data in dict.fromkeys(r["data"] for r in rows):
        for shot in dict.fromkeys(r["shot"] for r in rows if r["data"] == data):
            lines += [
                f"## {data}, {shot}-shot",
                "",
                "| method | tasks | closed only | closed acc. | AUROC | AUPR | P@90R | "
                "ECE-open | tasks/s |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                if r["data"] != data or r["shot"] != shot:
                    continue
                if "skipped" in r:
                    lines.append(f"| {r['method']} | skipped: {r['skipped']} ||||||||")
                    continue
                closed = (
                    f"{r['closed_only_accuracy']:.2f} ± {r['closed_only_ci95']:.2f}"
                    if "closed_only_accuracy" in r
                    else "—"
                )
                lines.append(
                    f"| {r['method']} | {r['tasks']} | {closed} | {_pm(r, 'accuracy')} | "
                    f"{_pm(r, 'auroc')} | {_pm(r, 'aupr')} | {_pm(r, 'prec_at_90_recall')} | "
                    f"{_pm(r, 'ece_open', 3)} | {r['tasks_per_second']:.3g} |"
                )
            lines.append("")
            for r in rows:
                if r["data"] == data and r["shot"] == shot and "auto" in r.get("defaults", ""):
                    lines.append(f"- {r['method']}: {r['defaults']}")
            lines.append("")
    if ostim is not None:
        shots = ", ".join(
            f"{shot}-shot: " + ", ".join(f"{k}={v}" for k, v in params.items())
            for shot, params in ostim[1].items()
        )
        lines += [
            f"OSTIM: the reference code ({ostim[2]}), its `configs/detectors.yaml` "
            f"defaults ({shots}) on the raw features (the `run_ostim` recipe's transform).",
            "",
        ]
    else:
        lines += ["OSTIM: not run (no `--ostim-repo`).", ""]
    lines.append(
        f"{len(rows)} rows in {seconds / 60:.1f} min on {args.threads} thread(s); methods "
        f"run on fewer tasks: {', '.join(f'{k} (tasks/{v})' for k, v in SLOW.items())}."
    )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
