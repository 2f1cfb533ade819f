"""The contract every closed-form inference engine honours.

An engine pairs with a Pyro model (in :mod:`probfsl.models`) that takes the data
tensors as positional arguments, each with a leading task dimension ``T``. The
engine is

* ``init(*data) -> state``: initial variational factors (or point estimates);
* ``step(state) -> state``: one sweep of closed-form updates;
* ``guide(state)``: a Pyro guide with the model's signature that samples the
  model's latent sites from the factors held in ``state``.

Every state carries ``objective``, a ``[T]`` tensor: the analytic ELBO (engines
with ``maximize = True``) or the objective minimised by a majorize-minimize scheme
(``maximize = False``). Traces therefore come free (:func:`run`). The shared
conformance checks in :mod:`probfsl.testing` hold an engine to this contract:
Pyro's ``Trace_ELBO`` of (model, guide) agrees with the analytic objective, the
objective is monotone, batched results equal one-task-at-a-time results and
float32 agrees with float64.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch


class EngineState(Protocol):
    """What every engine state exposes: the per-task objective after the last update."""

    objective: torch.Tensor


class Engine(ABC):
    """A closed-form inference engine over a batch of tasks (see the module docstring)."""

    #: True when ``objective`` is an ELBO to maximise; False for an MM objective to minimise.
    maximize: bool = True

    @abstractmethod
    def init(self, *data: torch.Tensor) -> Any:
        """Initial state for a batch of tasks; every tensor has a leading task dimension."""

    @abstractmethod
    def step(self, state: Any) -> Any:
        """One sweep of closed-form updates; returns the new state with its objective."""

    @abstractmethod
    def guide(self, state: Any) -> Callable[..., None]:
        """A Pyro guide, with the model's signature, built from the factors in ``state``."""


def run(
    engine: Engine,
    state: Any,
    n_steps: int,
    tol: float | None = None,
) -> tuple[Any, torch.Tensor]:
    """Apply ``engine.step`` up to ``n_steps`` times and record the objective.

    With ``tol`` the loop stops once every task's objective changed by less than
    ``tol`` (relative) in the last step: convergence is judged per task, and the
    loop ends when all tasks have converged.

    Returns the final state and the ``[steps + 1, T]`` trace (the initial objective first).
    """
    trace = [state.objective]
    for _ in range(n_steps):
        state = engine.step(state)
        trace.append(state.objective)
        if tol is not None:
            prev, cur = trace[-2], trace[-1]
            if bool(((cur - prev).abs() <= tol * prev.abs().clamp_min(1.0)).all()):
                break
    return state, torch.stack(trace)
