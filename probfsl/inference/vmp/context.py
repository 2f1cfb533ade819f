"""What every pass of the VMP compiler reads: one frozen :class:`CompileContext`.

The compiler (:mod:`~probfsl.inference.vmp.compiler`) builds the context in stages, each
a new copy (:func:`dataclasses.replace`): the model and the user's arguments first
(tracing, docs/design/vmp.md §6.1), the lifted model and the point estimates' initial
values (§6.2), then, once the sites are read (§6.3), the plan being built and the values
of the first run that parent discovery and the parameter maps compare against (§6.5,
§6.6). The readers take the context instead of long argument lists and never import the
compiler. The context's fields are never reassigned; :attr:`CompileContext.runs` is the
one cache it carries (each probe run of the model, traced once and shared by every
parameter), and the plan's own lists grow as the passes fill them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from probfsl.inference.vmp.layout import Plan


@dataclass(frozen=True)
class CompileContext:
    """One compilation of a model for given data (the module docstring).

    ``model`` is the model as traced (its ``pyro.param`` sites lifted, once §6.2 ran);
    ``args`` and ``kwargs`` the user's data; ``dtype`` the data's floating dtype (every
    parameter is read in it; ``None`` where the data hold none); ``points`` the initial
    value of each ``pyro.param`` site by name. From parent discovery on: ``plan`` the plan
    being built; ``base_values`` each latent site's value in the first run (by its Pyro
    name, the layout ``poutine.condition`` takes); ``base_params`` every site's parameters
    in that run (canonical layout, plain tensors); ``forms`` the precisions and rates of
    that run with their form c · Π τ (:mod:`~probfsl.inference.vmp.monomials`), by (site,
    parameter); ``probes`` a random value of every latent site (canonical layout), at
    which each parameter map is verified; ``runs`` the parameters of every site in each
    probe run of the model, by the run's kind (``"verify"``: every latent site at its
    probe value)."""

    model: Callable[..., Any]
    args: tuple
    kwargs: dict
    dtype: torch.dtype | None = None
    points: dict[str, torch.Tensor] = field(default_factory=dict)
    plan: Plan | None = None
    base_values: dict[str, torch.Tensor] = field(default_factory=dict)
    base_params: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    forms: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    probes: dict[str, torch.Tensor] = field(default_factory=dict)
    runs: dict[Any, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)
    #: the parameters the first run's check passed, kept alive here, so that later runs
    #: skip the same memory (:func:`~probfsl.inference.vmp.checks.check_parameters`)
    checked: list[torch.Tensor] = field(default_factory=list)
