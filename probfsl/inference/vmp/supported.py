"""The supported forms in words, formed from the family records.

Every refusal (:mod:`~probfsl.inference.vmp.checks`) points to the list in
:data:`~probfsl.inference.vmp.checks.DOCS`; :data:`SUPPORTED` holds the same list in
words. It imports the family modules to complete the registry, so it sits above them and
nothing below imports it.
"""

from __future__ import annotations

from probfsl.inference.vmp import families  # noqa: F401  (registers every family)
from probfsl.inference.vmp.family import REGISTRY


def supported() -> str:
    """The supported forms in words (:data:`SUPPORTED`), from the family records: each
    family's :attr:`~probfsl.inference.vmp.family.Family.forms`, in the registry's order
    (a phrase a subclass shares with its parent once), then the families that may take
    fixed parameters (every one that may be latent) and those that may be point
    estimates."""
    phrases = list(dict.fromkeys(p for record in REGISTRY.values() for p in record.forms))
    fixed = [name for name, record in REGISTRY.items() if not record.observed_only]
    points = [name for name, record in REGISTRY.items() if record.can_be_point()]
    phrases.append(f"{_listed(fixed, 'and')} with fixed parameters")
    phrases.append(
        "pyro.param sites inside the tasks plate (point estimates) in place of a "
        f"{_listed(points, 'or')} site"
    )
    return "; ".join(phrases)


def _listed(names: list[str], last: str) -> str:
    """``a, b and c``."""
    return f" {last} ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


#: the supported forms in words (listed in :data:`~probfsl.inference.vmp.checks.DOCS`)
SUPPORTED: str = supported()
