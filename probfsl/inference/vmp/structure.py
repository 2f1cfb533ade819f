"""The structure check: a model whose sites change with its latent values is refused
(docs/design/vmp.md §6.4).

Reads the model and the user's arguments off a
:class:`~probfsl.inference.vmp.context.CompileContext` and the first trace; traces the
model again with other draws of its latent sites and with every site at each end of its
support, and returns those runs for the branch check
(:func:`~probfsl.inference.vmp.branches.check`) that holds the finished plan to them.
"""

from __future__ import annotations

from dataclasses import replace

import pyro
import torch
from pyro.poutine.trace_struct import Trace

from probfsl.inference.vmp.context import CompileContext
from probfsl.inference.vmp.layout import TASKS
from probfsl.inference.vmp.tracing import first_task, trace_drawn

#: the seeds of the extra runs: streams other than the first run's (0), then each end of
#: every support (:func:`~probfsl.inference.vmp.branches.extreme`)
PROBES = ((1, None), (3, None), (4, "high"), (5, "low"))


def _shape_of(run: Trace) -> list[tuple]:
    """The sample sites of a run: name, distribution and the shape of the value."""
    return [
        (n, type(s["fn"]).__name__, tuple(s["value"].shape))
        for n, s in run.nodes.items()
        if s["type"] == "sample"
    ]


def _tasks_sizes(run: Trace) -> set[int]:
    """The sizes of the ``tasks`` plate at the sample sites of a run."""
    return {
        f.size
        for s in run.nodes.values()
        if s["type"] == "sample"
        for f in s["cond_indep_stack"]
        if f.name == TASKS
    }


def check_structure(ctx: CompileContext, trace: Trace) -> tuple[list[Trace], bool]:
    """``ValueError`` when the model's structure (its sites, their distributions and
    shapes) changes with the values of its latent sites: Python control flow on a
    latent value, which message passing cannot follow. Checked by tracing the model
    again with other draws of its latent sites and with every site at each end of its
    support (:func:`~probfsl.inference.vmp.branches.extreme`), on the first task alone
    (the arguments sliced to it) where the model runs on it (``trace``: the first run,
    on every task). Returns the runs (the base run first, then those at the extremes)
    and whether they hold the first task alone, for
    :func:`~probfsl.inference.vmp.branches.check`."""
    args, kwargs = ctx.args, ctx.kwargs
    device = next((v.device for v in (*args, *kwargs.values()) if torch.is_tensor(v)), None)
    cuda = [device] if device is not None and device.type == "cuda" else []
    # the user's random streams are left as they were (the CPU's and the data's GPU's)
    with torch.random.fork_rng(devices=cuda), pyro.validation_enabled(False):
        one = first_task(args, kwargs)
        one_task = False
        if one is not None:
            try:
                alone = trace_drawn(replace(ctx, args=one[0], kwargs=one[1]))
            except Exception:  # the model needs every task: check on all of them
                alone = None
            # a tasks plate whose size does not follow the data's leading axis (a size
            # fixed in the model, the tasks on another axis) still spans every task
            if alone is not None and _tasks_sizes(alone) == {1}:
                trace, one_task = alone, True
                ctx = replace(ctx, args=one[0], kwargs=one[1])
        first = _shape_of(trace)
        runs = [trace]
        for seed, pattern in PROBES:
            torch.random.default_generator.manual_seed(seed)
            for d in cuda:
                with torch.cuda.device(d):
                    torch.cuda.manual_seed(seed)
            try:
                run = trace_drawn(ctx, seed=seed, pattern=pattern)
            except Exception:
                if pattern is None:
                    raise
                continue  # the model fails at these extremes: they prove nothing
            if _shape_of(run) != first:
                raise ValueError(
                    "VMP cannot follow this model: its sites change with the values of "
                    "its latent sites (Python control flow on a latent value)"
                )
            if pattern is not None:  # random draws seldom cross a branch the ends miss
                runs.append(run)
        return runs, one_task
