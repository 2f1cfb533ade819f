"""Conformance checks that every closed-form engine must pass.

The oracle is Pyro itself: for an engine and its Pyro model,

1. Pyro's ``Trace_ELBO`` of (model, engine.guide(state)) agrees with the engine's
   analytic objective, within Monte Carlo error (:func:`assert_elbo_matches_pyro`);
2. the objective is monotone over the engine's steps (:func:`assert_monotone`);
3. running the whole batch equals running each task alone (:func:`assert_batch_invariant`);
4. float32 agrees with float64 (:func:`assert_dtype_agreement`);
5. where the guide is the exact posterior, the ELBO equals the exact log evidence;
6. every tensor the engine makes lives on the data's device: on CUDA when there is
   one, and on the CPU by running with ``meta`` as the default device, where any
   tensor created without ``device=`` is caught (:func:`assert_device_follows`);
7. ``step`` never synchronises with the host, counted by
   :class:`probfsl.host_syncs.HostSyncCounter` (:func:`assert_no_host_syncs`).

:func:`check_engine` runs them all on a :class:`ConformanceCase`. Tests of every
engine reuse it, the way scikit-learn's estimator checks are shared.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyro
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from probfsl.host_syncs import HostSyncCounter
from probfsl.inference.base import Engine, RunInfo, run


@dataclass
class ConformanceCase:
    """An engine, its Pyro model and a small batch of float64 data.

    Attributes:
        make_engine: builds a fresh engine.
        model: the Pyro model, called as ``model(*data)``.
        data: tensors with a leading task dimension (floating ones in float64).
        n_steps: number of engine steps to run.
        outputs: what must agree across batching and dtypes; default the objective.
        pyro_elbo: the per-task value Pyro's ELBO estimates; default the objective
            (negated for engines with ``maximize = False``).
        exact_log_evidence: per-task log evidence, when the guide is the exact posterior.
        max_plate_nesting: passed to ``Trace_ELBO``.
        particles: particles per Pyro ELBO estimate; ``repeats`` estimates are averaged.
        monotone_tol: allowed violation of monotonicity per step.
        rtol_float32: relative tolerance of the float32 against float64 comparison.
        step_syncs: host synchronisations allowed per ``step`` (0 unless the engine
            documents why it needs one).
    """

    make_engine: Callable[[], Engine]
    model: Callable[..., Any]
    data: tuple[torch.Tensor, ...]
    n_steps: int = 20
    outputs: Callable[[Any], torch.Tensor] | None = None
    pyro_elbo: Callable[[Any], torch.Tensor] | None = None
    exact_log_evidence: torch.Tensor | None = None
    max_plate_nesting: int = 2
    particles: int = 500
    repeats: int = 10
    monotone_tol: float = 1e-9
    rtol_float32: float = 1e-3
    vectorize_particles: bool = True
    step_syncs: int = 0
    extra: dict = field(default_factory=dict)


def fit(case: ConformanceCase, data: tuple[torch.Tensor, ...]) -> tuple[Any, RunInfo]:
    """Run a fresh engine of ``case`` for ``n_steps`` on ``data``."""
    engine = case.make_engine()
    return run(engine, engine.init(*data), case.n_steps)


def _outputs(case: ConformanceCase, state: Any) -> torch.Tensor:
    return state.objective if case.outputs is None else case.outputs(state)


def _elbo_of(case: ConformanceCase, engine: Engine, state: Any) -> torch.Tensor:
    if case.pyro_elbo is not None:
        return case.pyro_elbo(state)
    return state.objective if engine.maximize else -state.objective


def pyro_elbo_estimate(
    model: Callable[..., Any],
    guide: Callable[..., Any],
    data: tuple[torch.Tensor, ...],
    particles: int = 500,
    repeats: int = 10,
    max_plate_nesting: int = 2,
    vectorize_particles: bool = True,
) -> tuple[float, float]:
    """Pyro's ``Trace_ELBO`` (as an ELBO, not a loss): mean and Monte Carlo standard error."""
    elbo = pyro.infer.Trace_ELBO(
        num_particles=particles,
        vectorize_particles=vectorize_particles,
        max_plate_nesting=max_plate_nesting,
    )
    with torch.no_grad():
        values = torch.tensor([-elbo.loss(model, guide, *data) for _ in range(repeats)])
    return values.mean().item(), (values.std() / repeats**0.5).item()


def assert_elbo_matches_pyro(case: ConformanceCase, n_sigma: float = 5.0) -> None:
    """Pyro's ELBO of (model, guide) equals the engine's analytic ELBO within MC error
    (with the engine's point estimates, if it has any, as the model's ``pyro.param``
    values)."""
    pyro.set_rng_seed(0)
    engine = case.make_engine()
    state, _ = run(engine, engine.init(*case.data), case.n_steps)
    analytic = _elbo_of(case, engine, state).sum().item()
    points = engine.point_estimates(state) if hasattr(engine, "point_estimates") else {}
    with pyro.get_param_store().scope():  # the model's pyro.param sites read the estimates
        for name, value in points.items():
            pyro.param(name, value)
        mean, se = pyro_elbo_estimate(
            case.model,
            engine.guide(state),
            case.data,
            case.particles,
            case.repeats,
            case.max_plate_nesting,
            case.vectorize_particles,
        )
    tol = n_sigma * se + 1e-6 * max(1.0, abs(analytic))
    assert abs(mean - analytic) <= tol, (
        f"Pyro Trace_ELBO {mean:.6f} ± {se:.2e} disagrees with the analytic ELBO {analytic:.6f}"
    )


def assert_monotone(case: ConformanceCase) -> None:
    """The objective never gets worse from one step to the next, in any task."""
    engine = case.make_engine()
    _, info = run(engine, engine.init(*case.data), case.n_steps)
    trace = info.trace
    diff = trace[1:] - trace[:-1]
    worst = (-diff if engine.maximize else diff).max().item()
    scale = trace.abs().max().clamp_min(1.0).item()
    assert worst <= case.monotone_tol * scale, (
        f"objective moved the wrong way by {worst:.3e} "
        f"({'should increase' if engine.maximize else 'should decrease'})"
    )


def assert_batch_invariant(case: ConformanceCase, rtol: float = 1e-7) -> None:
    """The batched run equals one-task-at-a-time runs."""
    state, _ = fit(case, case.data)
    batched = _outputs(case, state)
    singles = torch.cat(
        [
            _outputs(case, fit(case, tuple(d[t : t + 1] for d in case.data))[0])
            for t in range(len(batched))
        ]
    )
    torch.testing.assert_close(batched, singles, rtol=rtol, atol=rtol)


def assert_dtype_agreement(case: ConformanceCase) -> None:
    """float32 results agree with float64 ones to ``rtol_float32``.

    Skipped when no data tensor is floating (then the input has no dtype to follow).
    """
    if not any(d.is_floating_point() for d in case.data):
        return
    state64, _ = fit(case, case.data)
    data32 = tuple(d.float() if d.is_floating_point() else d for d in case.data)
    state32, _ = fit(case, data32)
    out64, out32 = _outputs(case, state64), _outputs(case, state32)
    assert out32.dtype in (torch.float32, torch.long, torch.bool), (
        f"float32 input gave {out32.dtype} output: dtype must follow the input"
    )
    torch.testing.assert_close(
        out32.to(out64.dtype), out64, rtol=case.rtol_float32, atol=case.rtol_float32
    )


def assert_exact_evidence(case: ConformanceCase, rtol: float = 1e-8) -> None:
    """With an exact posterior as guide, the analytic ELBO is the exact log evidence."""
    engine = case.make_engine()
    state, _ = run(engine, engine.init(*case.data), case.n_steps)
    torch.testing.assert_close(
        _elbo_of(case, engine, state), case.exact_log_evidence, rtol=rtol, atol=rtol
    )


class DeviceAudit(TorchFunctionMode):
    """Records the torch calls that return a tensor on the ``meta`` device.

    Used with ``torch.set_default_device("meta")`` and data on the CPU: a tensor
    created without ``device=`` lands on ``meta`` and is recorded with the probfsl
    line that made it (on a GPU it would be the "Expected all tensors to be on the
    same device" crash).
    """

    PACKAGE = os.path.dirname(os.path.abspath(__file__))

    def __init__(self) -> None:
        super().__init__()
        self.on_meta: list[str] = []

    def _caller(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and not frame.f_code.co_filename.startswith(self.PACKAGE):
            frame = frame.f_back
        if frame is None:
            return "?"
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self.on_meta.append(f"{getattr(func, '__name__', func)} at {self._caller()}")
                break
        return out


def audit_devices(fn: Callable[[], Any]) -> Any:
    """Call ``fn`` with ``meta`` as the default device; fail if any tensor landed there."""
    audit = DeviceAudit()
    previous = torch.get_default_device()
    message = "tensors created on the default device instead of the data's"
    torch.set_default_device("meta")
    try:
        with audit:
            out = fn()
    except RuntimeError as err:  # a meta tensor met a CPU one
        if "meta" not in str(err):
            raise
        raise AssertionError(f"{message}: {audit.on_meta[:8]} ({err})") from err
    finally:
        torch.set_default_device(previous)
    assert not audit.on_meta, f"{message}: {audit.on_meta[:8]}"
    return out


def assert_device_follows(case: ConformanceCase) -> None:
    """Every tensor the engine makes lives on the data's device.

    On the CPU the engine runs with ``meta`` as the default device (:func:`audit_devices`);
    when CUDA is available it also runs there and its outputs must match the CPU's.
    """
    state, _ = audit_devices(lambda: fit(case, case.data))
    out = _outputs(case, state)
    assert out.device.type == "cpu", f"outputs on {out.device}, the data is on the CPU"
    if torch.cuda.is_available():
        data = tuple(d.cuda() for d in case.data)
        state_cuda, _ = fit(case, data)
        out_cuda = _outputs(case, state_cuda)
        assert out_cuda.device.type == "cuda", f"outputs on {out_cuda.device}, data on CUDA"
        torch.testing.assert_close(out_cuda.cpu(), out, rtol=1e-6, atol=1e-6)


def assert_no_host_syncs(case: ConformanceCase) -> None:
    """``step`` makes at most ``case.step_syncs`` host synchronisations (none by default).

    Counted by :class:`probfsl.host_syncs.HostSyncCounter` over ``n_steps`` steps after
    ``init``; :func:`probfsl.inference.base.run` adds one per ``check_every`` steps.
    """
    engine = case.make_engine()
    state = engine.init(*case.data)
    with HostSyncCounter() as counter:
        for _ in range(case.n_steps):
            state, _ = engine.step(state)
    allowed = case.step_syncs * case.n_steps
    assert counter.total <= allowed, (
        f"{counter.total} host synchronisations in {case.n_steps} steps "
        f"(allowed {allowed}): {dict(counter.syncs)}"
    )


def check_engine(case: ConformanceCase) -> None:
    """Run every conformance check on ``case``; raises ``AssertionError`` on the first failure."""
    assert_monotone(case)
    assert_batch_invariant(case)
    assert_dtype_agreement(case)
    assert_device_follows(case)
    assert_no_host_syncs(case)
    if case.exact_log_evidence is not None:
        assert_exact_evidence(case)
    assert_elbo_matches_pyro(case)
