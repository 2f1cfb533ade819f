"""The contract every iterative inference engine honours, after BlackJAX's ``base.py``.

An engine pairs with a Pyro model (in :mod:`probfsl.models`) that takes the data
tensors as positional arguments, each with a leading task dimension ``T``. The
engine is

* ``init(*data) -> State``: initial variational factors (or point estimates);
* ``step(State) -> (State, Info)``: one sweep of closed-form updates, and what it
  reports (:class:`Info`: at least the per-task objective after the sweep);
* ``guide(State)``: a Pyro guide with the model's signature that samples the
  model's latent sites from the factors held in the state.

Every state carries ``objective``, a ``[T]`` tensor: the analytic ELBO (engines
with ``maximize = True``) or the objective minimised by a majorize-minimize scheme
(``maximize = False``). :func:`run` is the one loop that drives every engine: it
records the objective trace, judges convergence per task on the device, freezes
the tasks that converged (their state stops changing: :meth:`Engine.keep`) and
synchronises with the host only once every ``check_every`` steps to ask whether
any task is still moving. The shared conformance checks in :mod:`probfsl.testing`
hold an engine to this contract: Pyro's ``Trace_ELBO`` of (model, guide) agrees
with the analytic objective, the objective is monotone, batched results equal
one-task-at-a-time results, float32 agrees with float64, every tensor stays on the
data's device and the loop makes no host synchronisation between checks.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

#: steps between two host checks of "has every task converged?" in :func:`run`
CHECK_EVERY = 5

#: :func:`run` drops converged tasks from the batch once at least this fraction of it has
#: converged: a compaction copies every tensor of the state and starts the engine's caches
#: anew (about one step's work on the whole batch), which a handful of masked tasks do not
#: repay (VMP's mixture benchmark, 1,000 tasks, one CPU thread: 5% less time than
#: compacting at every check that finds a converged task)
COMPACT_FRACTION = 0.2

#: ... and at once, whatever the fraction, in a batch of at most this many tasks: there a
#: compaction costs a few steps' masking (:meth:`Engine.keep`), which the slow tail of a
#: fit (a handful of tasks running hundreds of steps) repays many times over
COMPACT_BELOW = 32


@dataclasses.dataclass(frozen=True)
class Info:
    """What one ``step`` reports. Engines may subclass it to report more.

    Attributes:
        objective: ``[T]`` the objective after the step (as in the returned state).
    """

    objective: torch.Tensor


class RunInfo(NamedTuple):
    """What :func:`run` reports.

    Attributes:
        trace: ``[steps + 1, T]`` objective after ``init`` and after every step (a
            frozen task repeats its last value).
        n_steps: ``[T]`` steps each task took before it converged (or the step budget).
        converged: ``[T]`` whether the task met the tolerance (all False without ``tol``).
    """

    trace: torch.Tensor
    n_steps: torch.Tensor
    converged: torch.Tensor


class Engine(ABC):
    """An iterative inference engine over a batch of tasks (see the module docstring)."""

    #: True when ``objective`` is an ELBO to maximise; False for an MM objective to minimise.
    maximize: bool = True

    @abstractmethod
    def init(self, *data: torch.Tensor) -> Any:
        """Initial state for a batch of tasks; every tensor has a leading task dimension."""

    @abstractmethod
    def step(self, state: Any) -> tuple[Any, Info]:
        """One sweep of closed-form updates: the new state (with its objective) and its Info."""

    @abstractmethod
    def guide(self, state: Any) -> Callable[..., None]:
        """A Pyro guide, with the model's signature, built from the factors in ``state``."""

    #: whether :func:`run` drops converged tasks from the batch at its checks (with
    #: :meth:`take` and :meth:`put`); an engine sets it once those fit its state
    compacts: bool = False

    def take(self, state: Any, index: torch.Tensor) -> Any:
        """The state of the tasks ``index`` (``[k]`` long, on the device) alone.

        The default indexes, like :meth:`keep`, every tensor field whose leading
        dimension is the batch's ``T`` (the length of ``state.objective``); engines whose
        state holds other tensors of that length override it."""
        return _walk(state, lambda t: t.index_select(0, index), len(state.objective))

    def put(self, full: Any, index: torch.Tensor, part: Any) -> Any:
        """``full`` with the tasks ``index`` replaced by the state ``part`` of those tasks
        (the default writes every tensor field :meth:`take` indexes)."""
        n = len(full.objective)
        return _merge(full, part, lambda a, b: a.index_copy(0, index, b), n)

    def put_(self, full: Any, index: torch.Tensor, part: Any) -> Any:
        """:meth:`put` for a ``full`` that no one else holds, so that its tensors may be
        overwritten in place (:func:`run` calls it on the states its own earlier
        :meth:`put` made). The default is :meth:`put`."""
        return self.put(full, index, part)

    def keep(self, frozen: torch.Tensor, old: Any, new: Any) -> Any:
        """``new`` with the tasks where ``frozen`` (``[T]`` bool) restored from ``old``.

        The default selects, in every tensor field of the state (dataclasses, named
        tuples, tuples, lists and dicts are walked) whose leading dimension is ``T``,
        the old rows of the frozen tasks with one ``torch.where``; other fields are
        taken from ``new``. Engines whose state holds tensors with a leading dimension
        that is not the task override it.
        """

        def where(new_t: torch.Tensor, old_t: torch.Tensor) -> torch.Tensor:
            if new_t.shape != old_t.shape:
                return new_t
            return torch.where(frozen.reshape(-1, *[1] * (new_t.dim() - 1)), old_t, new_t)

        return _merge(new, old, where, frozen.shape[0])


def _walk(state: Any, fn: Callable, n: int) -> Any:
    """``state`` with ``fn`` applied to every tensor whose leading dimension is ``n``
    (dataclasses, named tuples, tuples, lists and dicts are walked)."""
    if isinstance(state, torch.Tensor):
        return fn(state) if state.dim() >= 1 and state.shape[0] == n else state
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {
            f.name: _walk(getattr(state, f.name), fn, n)
            for f in dataclasses.fields(state)
            if f.init
        }
        return dataclasses.replace(state, **changes)
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_walk(x, fn, n) for x in state))
    if isinstance(state, (tuple, list)):
        return type(state)(_walk(x, fn, n) for x in state)
    if isinstance(state, dict):
        return {k: _walk(v, fn, n) for k, v in state.items()}
    return state


def _merge(full: Any, part: Any, fn: Callable, n: int) -> Any:
    """``full`` with ``fn(full_tensor, part_tensor)`` for every tensor of ``full`` whose
    leading dimension is ``n`` (the structure walked as in :func:`_walk`)."""
    if isinstance(full, torch.Tensor):
        return fn(full, part) if full.dim() >= 1 and full.shape[0] == n else full
    if dataclasses.is_dataclass(full) and not isinstance(full, type):
        changes = {
            f.name: _merge(getattr(full, f.name), getattr(part, f.name), fn, n)
            for f in dataclasses.fields(full)
            if f.init
        }
        return dataclasses.replace(full, **changes)
    if isinstance(full, tuple) and hasattr(full, "_fields"):
        return type(full)(*(_merge(a, b, fn, n) for a, b in zip(full, part, strict=True)))
    if isinstance(full, (tuple, list)):
        return type(full)(_merge(a, b, fn, n) for a, b in zip(full, part, strict=True))
    if isinstance(full, dict):
        return {k: _merge(v, part[k], fn, n) if k in part else v for k, v in full.items()}
    return full


def converged_tasks(previous: torch.Tensor, current: torch.Tensor, tol: float) -> torch.Tensor:
    """``[T]`` bool, on the device: |current - previous| <= tol * max(|previous|, 1)."""
    return (current - previous).abs() <= tol * previous.abs().clamp_min(1.0)


def check_steps(n_steps: int, check_every: int, check_growth: float = 1.0) -> list[int]:
    """The steps (1-based) after which :func:`run` asks the host whether a task still moves:
    the first after ``check_every`` steps, then gaps growing by ``check_growth`` (rounded,
    at least one step). With ``check_every = 2``: 2, 4, 6, 8, ... for growth 1; 2, 4, 7, 12,
    19, 29, 44, 67, ... for 1.5; 2, 4, 8, 16, 32, ... for 2: about log(n) / log(growth)
    checks instead of n / 2."""
    if check_every < 1 or not check_growth >= 1.0:
        raise ValueError(
            f"check_every must be >= 1 and check_growth >= 1, got {check_every}, {check_growth}"
        )
    out, gap, at = [], float(check_every), check_every
    while at <= n_steps:
        out.append(at)
        at += max(1, int(gap + 0.5))
        gap *= check_growth
    return out


def run(
    engine: Engine,
    state: Any,
    n_steps: int,
    tol: float | None = None,
    check_every: int = CHECK_EVERY,
    check_growth: float = 1.0,
) -> tuple[Any, RunInfo]:
    """Drive ``engine.step`` up to ``n_steps`` times: the one loop of every engine.

    With ``tol``, a task has converged once its objective moved by less than ``tol``
    (relative, :func:`converged_tasks`) in one step; from then on its state is frozen
    (:meth:`Engine.keep`), so the batch gives each task the result it would get alone.
    The test runs on the device after every step; the host asks which tasks are still
    moving only at the steps of :func:`check_steps` (every ``check_every`` steps, or at
    gaps growing by ``check_growth``; one synchronisation each), and the loop ends when
    none is. An engine that ``compacts`` then also drops the converged tasks from the
    batch once they are at least :data:`COMPACT_FRACTION` of it, or at once in a batch of
    at most :data:`COMPACT_BELOW` tasks (:meth:`Engine.take`;
    their final state is written back with :meth:`Engine.put`, into the loop's own copy
    with :meth:`Engine.put_` after the first), so later steps cost only what the moving
    tasks need; until then they are masked (not in the step after a check that found
    every task moving, where the mask would keep nothing). Since converged tasks are
    frozen either way, neither the schedule nor the compaction changes a task's result.
    Without ``tol`` all ``n_steps`` steps run and nothing syncs.

    Returns the final state and a :class:`RunInfo` (trace, steps per task, converged).
    """
    checks = set(check_steps(n_steps, check_every, check_growth)) if tol is not None else set()
    compact = tol is not None and engine.compacts
    full, where = state, None  # the whole batch, and the tasks ``state`` holds (None: all)
    owned = False  # whether ``full`` is a state of the loop's own making (``put_`` applies)
    total = state.objective
    trace = [total]
    device = total.device
    active = torch.ones(total.shape, dtype=torch.bool, device=device)
    steps = torch.zeros(total.shape, dtype=torch.long, device=device)
    all_steps = steps
    still = active
    none_frozen = True  # known on the host: every task of the batch still moves
    for i in range(n_steps):
        new, info = engine.step(state)
        steps = steps + active
        if tol is not None:
            if not none_frozen:  # (after a check that found every task moving, a no-op)
                new = engine.keep(~active, state, new)
            active = active & ~converged_tasks(state.objective, new.objective, tol)
        none_frozen = False
        state = new
        total = state.objective if where is None else total.index_copy(0, where, state.objective)
        trace.append(total)
        if i + 1 not in checks:
            continue
        moving = active.nonzero().squeeze(-1)  # the loop's one synchronisation here
        if moving.numel() == 0:
            break
        none_frozen = moving.numel() == active.numel()
        few = active.numel() <= COMPACT_BELOW and moving.numel() < active.numel()
        if compact and (few or moving.numel() <= (1 - COMPACT_FRACTION) * active.numel()):
            full, all_steps, still = _write_back(
                engine, full, where, state, all_steps, steps, still, active, owned
            )
            owned = where is not None  # ``full`` was made by ``put`` from now on
            where = moving if where is None else where[moving]
            state = engine.take(state, moving)
            steps, active = steps[moving], active[moving]
            none_frozen = True
    if where is None:
        return state, RunInfo(torch.stack(trace), steps, ~active)
    full, all_steps, still = _write_back(
        engine, full, where, state, all_steps, steps, still, active, owned
    )
    return full, RunInfo(torch.stack(trace), all_steps, ~still)


def _write_back(engine, full, where, state, all_steps, steps, still, active, owned):
    """The whole batch's state, steps and activity with the working tasks' written in
    (``owned``: into ``full`` itself, a state an earlier write-back made)."""
    if where is None:
        return state, steps, active
    put = engine.put_ if owned else engine.put
    return (
        put(full, where, state),
        all_steps.index_copy(0, where, steps),
        still.index_copy(0, where, active),
    )
