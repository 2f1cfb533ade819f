"""The registry of few-shot methods available to the command line and the benchmarks.

Names to estimator classes, their hyperparameters and named presets; it imports only
the estimator interface. Tuning (:mod:`probfsl.tuning`, ``preset="auto"``) is built on
the registry, and the command line on both: registry -> tuning -> cli, one direction.

:func:`build_estimator` builds a registered method with its constructor defaults or a
named preset; the public builder, :func:`probfsl.make_estimator` (defined in
:mod:`probfsl.tuning`), adds ``preset="auto"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING

from probfsl.method_table import METHOD_TABLE

if TYPE_CHECKING:  # the estimators import torch: only when one is built
    from probfsl.models.base import FewShotClassifier


#: the preset name that means the estimator's own constructor defaults (on the command
#: line, where the default is a search on base-class episodes)
DEFAULTS = "defaults"


@dataclass(frozen=True)
class MethodInfo:
    """A registered method: where its estimator lives and how to describe it."""

    name: str
    target: str  # "module:Class"
    description: str
    demo_tasks: int = 500  # tasks per setting in ``probfsl demo`` (keeps it under a minute)
    #: tasks per batch on the CPU when ``--batch-size`` is not given: small for the slow
    #: methods, so that progress shows every few seconds (a GPU takes 1000 at once)
    cpu_batch: int = 1000
    #: whether the model's structure changes with the number of classes of a task (GP-Tree:
    #: its class tree is one node at 2 ways), so that a search on fewer ways than the tasks
    #: must be checked at the tasks' way
    way_dependent: bool = False
    #: whether the method learns more than a centre from the base classes (a projection,
    #: a whitening, class variances), so that scoring it on the classes it was fitted on
    #: flatters it: a check of its choice needs base classes it has not seen
    base_statistics: bool = False

    def load(self) -> type[FewShotClassifier]:
        module, cls = self.target.split(":")
        return getattr(import_module(module), cls)


METHODS: dict[str, MethodInfo] = {
    m.name: m
    for m in [
        MethodInfo(
            "nearest-centroid",
            "probfsl.models.nearest_centroid:NearestCentroid",
            "inductive nearest class mean, cosine, centred on the base mean",
        ),
        MethodInfo(
            "soft-kmeans",
            "probfsl.models.soft_kmeans:SoftKMeans",
            "transductive soft k-means seeded by the support (BAVARDAGE's initialiser)",
        ),
        MethodInfo(
            "bavardage",
            "probfsl.models.bavardage:Bavardage",
            "transductive VB Gaussian mixture with adaptive PLDA (Hu et al., AISTATS 2023)",
            base_statistics=True,
        ),
        MethodInfo(
            "bavardage-gamma",
            "probfsl.models.bavardage_gamma:BavardageGamma",
            "BAVARDAGE with per-class diagonal Gamma precisions, derived by VMP",
            base_statistics=True,
        ),
        MethodInfo(
            "vmp-gmm",
            "probfsl.models.vmp_gmm:VMPGaussianMixture",
            "VB mixture, per-class diagonal Gamma precision, derived by VMP (Winn & Bishop, 2005)",
            base_statistics=True,
        ),
        MethodInfo(
            "gp-tree",
            "probfsl.models.gp_tree.few_shot:GPTreeFewShot",
            "Pólya-Gamma GP classifiers in a class tree (Achituve et al., ICML 2021)",
            demo_tasks=30,
            cpu_batch=100,
            way_dependent=True,
        ),
        MethodInfo(
            "evidence-lssvm",
            "probfsl.models.evidence:EvidenceLSSVM",
            "one-vs-rest Bayesian linear regression, penalty by evidence (Kim et al., CVPR 2016)",
        ),
        MethodInfo(
            "slem",
            "probfsl.models.slem:SLEM",
            "square-loss exemplar machine, one per class against the base set",
        ),
        MethodInfo(
            "em-dirichlet",
            "probfsl.models.em_dirichlet:EMDirichlet",
            "transductive Dirichlet mixture on the probability simplex (Martin et al., CVPR 2024)",
            demo_tasks=40,
            cpu_batch=200,
        ),
    ]
}


def method_info(name: str) -> MethodInfo:
    """The registry entry of ``name``; a ``ValueError`` listing the choices otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


def build_estimator(name: str, preset: str | None = None, **params) -> FewShotClassifier:
    """A new estimator of method ``name`` with hyperparameters ``params``, checked at
    once (:meth:`~probfsl.models.base.Hyperparameters.check_params`): the registry's
    builder, which knows nothing of tuning.

    ``preset=None`` (or :data:`DEFAULTS`) gives the constructor defaults; another
    ``preset`` names a published setting of methods that define ``from_preset``.
    ``preset="auto"`` (hyperparameters tuned on base-class episodes) is a ``ValueError``
    here: it is built one layer up, by :func:`probfsl.make_estimator` (the public
    builder, which calls this one for every other preset).
    """
    cls = method_info(name).load()
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    check_param_keys(name, params, accepted)
    if preset is None or preset == DEFAULTS:
        return _checked(cls(**params))
    if preset == "auto":
        raise ValueError(
            "preset 'auto' tunes the method on base-class episodes: build it with "
            "probfsl.make_estimator(name, preset='auto')"
        )
    if not hasattr(cls, "from_preset"):
        raise ValueError(f"method {name!r} has no presets")
    return _checked(cls.from_preset(preset, **params))


def check_param_keys(name: str, params: dict, accepted: Sequence[str] | None = None) -> None:
    """``ValueError`` for a hyperparameter that method ``name`` does not take; ``accepted``
    defaults to :data:`probfsl.method_table.METHOD_TABLE`'s list (no estimator import)."""
    if accepted is None:
        accepted = METHOD_TABLE[method_info(name).name]["params"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"{name}: unknown hyperparameter(s) {unknown}; accepted: {', '.join(accepted)}"
        )


def check_preset_name(name: str, preset: str | None) -> None:
    """``ValueError`` for a ``preset`` that method ``name`` does not have (``None``,
    :data:`DEFAULTS` and ``"auto"`` for a tunable method are always valid), from
    :data:`probfsl.method_table.METHOD_TABLE` without importing the estimator."""
    row = METHOD_TABLE[method_info(name).name]
    if preset in (None, DEFAULTS) or (preset == "auto" and row["tunable"]):
        return
    if preset == "auto":
        tunable = ", ".join(m for m, r in METHOD_TABLE.items() if r["tunable"])
        raise ValueError(f"no search space for method {name!r}; tunable: {tunable}")
    if not row["presets"]:
        raise ValueError(f"method {name!r} has no presets")
    if preset not in row["presets"]:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(row['presets'])}")


def methods_with_engines() -> list[str]:
    """The methods with a hand-written and a derived engine (an ``engine`` parameter)."""
    return [m for m, row in METHOD_TABLE.items() if "engine" in row["params"]]


def _checked(estimator: FewShotClassifier) -> FewShotClassifier:
    """``estimator`` after its hyperparameter check (a registered class without one, such
    as a duck-typed estimator, is returned as it is)."""
    check = getattr(estimator, "check_params", None)
    if check is not None:
        check()
    return estimator


def parse_params(items: list[str] | None) -> dict:
    """``["key=value", ...]`` from the command line into a dict (values as Python literals)."""
    from ast import literal_eval

    params = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--param expects KEY=VALUE, got {item!r}")
        try:
            params[key] = literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = _float_or_text(value)
    return params


def _float_or_text(value: str) -> float | str:
    """``nan``, ``inf`` and ``-inf`` as floats (so that the estimator's check says they
    are not finite); any other text stays a string."""
    return float(value) if value.strip().lower() in ("nan", "inf", "+inf", "-inf") else value
