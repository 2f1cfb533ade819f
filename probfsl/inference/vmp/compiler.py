"""The VMP compiler: a Pyro model and its data read into a
:class:`~probfsl.inference.vmp.layout.Plan` (docs/design/vmp.md §6).

This module holds the orchestration alone (:class:`Compiler`); each pass is a reader of
its own, and every reader takes one frozen
:class:`~probfsl.inference.vmp.context.CompileContext` (the model, the data, and, as the
passes go, the plan being built and the runs that read it):

* :mod:`~probfsl.inference.vmp.tracing`: the first run, every latent site at a value of
  the compiler's own (:func:`~probfsl.inference.vmp.tracing.draw`, away from the edges of
  its support; never a draw from the site's prior, which for a vague Gamma underflows to
  0), ``pyro.param`` sites lifted into sample sites (§6.1, §6.2);
* :mod:`~probfsl.inference.vmp.structure`: other runs, refused where the sites change with
  the latent values (§6.4);
* :mod:`~probfsl.inference.vmp.site_reading`: every site's family, axes, mask and data
  (§6.3);
* :mod:`~probfsl.inference.vmp.parents`: each parameter's parents, by Pyro's provenance
  tracking and one run with every latent site at another value (§6.5);
* :mod:`~probfsl.inference.vmp.parameter_maps` and
  :mod:`~probfsl.inference.vmp.affine_maps`: how a parent enters a parameter, verified on
  those values (a location equals the parent's value, a precision c · parent with c
  fixed, a Categorical's probabilities the Dirichlet parent, a missing parent plate a
  mixture component axis selected by a latent Categorical or a fixed index, an affine or
  bilinear map of Gaussian sites) (§6.6);
* :mod:`~probfsl.inference.vmp.chains`: Gaussian Markov chains (§6.7);
* :mod:`~probfsl.inference.vmp.final_checks`, with
  :func:`~probfsl.inference.vmp.at_prior.check` and
  :func:`~probfsl.inference.vmp.branches.check` (§6.8).

Anything else is refused (:func:`~probfsl.inference.vmp.checks.refuse`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pyro
import torch
from pyro.poutine.trace_struct import Trace

from probfsl.inference.vmp import at_prior, branches
from probfsl.inference.vmp.chains import find_chains
from probfsl.inference.vmp.checks import check_data, check_parameters, data_dtype
from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.final_checks import (
    check_counts,
    check_points_used,
    mark_unit_coefficients,
)
from probfsl.inference.vmp.layout import Plan
from probfsl.inference.vmp.parameter_maps import SCALED
from probfsl.inference.vmp.parents import find_parents, reading_context
from probfsl.inference.vmp.site_reading import (
    latent_order,
    read_sites,
    reference_value,
    sample_sites,
)
from probfsl.inference.vmp.structure import check_structure
from probfsl.inference.vmp.tracing import draw, first_trace, site_parameters

__all__ = ["SCALED", "Compiler", "draw"]


class Compiler:
    """Reads one model's plan for given data (the module docstring); ``order`` is the
    latent sites' update order (default: the model's declaration order)."""

    def __init__(self, model: Callable[..., Any], order: list[str] | None = None) -> None:
        self.model, self.order = model, order

    def compile(self, *args: Any, **kwargs: Any) -> Plan:
        """Read the model's sites, parents and parameter maps (module docstring).

        The model runs with an empty Pyro parameter store (``pyro.param`` sites take the
        initial values the model gives them; the user's store is left as it was)."""
        with pyro.get_param_store().scope():
            return self._compile(args, kwargs)

    def _compile(self, args: tuple, kwargs: dict) -> Plan:
        """The passes in order (docs/design/vmp.md §6)."""
        check_data(args, kwargs)
        ctx, trace = first_trace(CompileContext(self.model, args, kwargs, data_dtype(args, kwargs)))
        nodes = sample_sites(trace)
        ctx.checked.extend(check_parameters(nodes))
        structure = self._check_structure(trace, ctx)
        runs, one_task = ([], False) if structure is None else structure
        ref = reference_value(nodes, trace)
        sites, sizes = read_sites(ctx, trace, nodes)
        latent = latent_order(sites, sizes, self.order)
        plan = Plan(sites, latent, sizes, {n: [] for n in latent}, ref)
        ctx = reading_context(ctx, plan, trace)
        find_parents(ctx)
        check_counts(plan)
        mark_unit_coefficients(plan)
        find_chains(plan)
        at_prior.check(plan)
        with torch.no_grad():
            branches.check(plan, runs, one_task, partial(site_parameters, ctx), ctx.dtype)
        check_points_used(plan, ctx.points)
        return plan

    def _check_structure(self, trace: Trace, ctx: CompileContext) -> tuple[list, bool] | None:
        """The structure check's runs, and whether they hold the first task alone
        (:func:`~probfsl.inference.vmp.structure.check_structure`); a method of its own so
        that a test may leave the check out (``None``: no runs to hold the plan to)."""
        return check_structure(ctx, trace)
