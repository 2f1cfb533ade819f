"""The registry of few-shot methods available to the command line and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from probfsl.models.base import FewShotClassifier


@dataclass(frozen=True)
class MethodInfo:
    """A registered method: where its estimator lives and how to describe it."""

    name: str
    target: str  # "module:Class"
    description: str
    demo_tasks: int = 500  # tasks per setting in ``probfsl demo`` (keeps it under a minute)

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
    ]
}


def method_info(name: str) -> MethodInfo:
    """The registry entry of ``name``; a ``ValueError`` listing the choices otherwise."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]


def make_estimator(name: str, **params) -> FewShotClassifier:
    """A new estimator of method ``name`` with hyperparameters ``params``."""
    return method_info(name).load()(**params)
