"""Closed-form inference engines (the contract is :mod:`probfsl.inference.base`).

``probfsl.inference.VMP`` (variational message passing derived from a Pyro model) is
imported on first use, so that ``import probfsl`` stays light.
"""

from typing import Any

__all__ = ["VMP"]


def __getattr__(name: str) -> Any:
    if name == "VMP":
        from probfsl.inference.vmp import VMP

        return VMP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
