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

Every few-shot estimator (a :class:`probfsl.models.base.FewShotClassifier`) has checks of
its own, run by :func:`check_estimator` on small built-in Omniglot tasks
(:func:`estimator_check_data`): ``fit`` equals ``fit_base`` (:func:`check_fit_is_fit_base`);
``get_params``/``set_params`` round-trip and refuse unknown names
(:func:`check_get_set_params`); ``__init__`` only stores its arguments
(:func:`check_init_only_stores`); scikit-learn's ``clone`` gives an unfitted copy
(:func:`check_sklearn_clone`, when scikit-learn is installed); ``fit_predict`` on plain
arrays, one task or a batch, agrees with ``predict`` (:func:`check_fit_predict_on_arrays`)
and refuses bad input (:func:`check_fit_predict_bad_input`); ``predict_proba`` leaves the
fitted state alone (:func:`check_predict_proba_keeps_fitted_state`); and ``save`` then
``load`` gives the same estimator and predictions (:func:`check_save_load_roundtrip`).

In a pytest suite, :func:`parametrize_with_checks` (after scikit-learn's function of that
name) gives each (estimator, check) or (engine case, check) pair a test id of its own, so
that a failure names the check and one check can be run alone with ``-k``::

    from probfsl.models.slem import SLEM
    from probfsl.testing import parametrize_with_checks

    @parametrize_with_checks([SLEM(), SLEM(temperature=5.0)])
    def test_estimator(estimator, check):
        check(estimator)  # ids: SLEM()-check_save_load_roundtrip, ...

    @parametrize_with_checks([my_case])  # ConformanceCase objects
    def test_engine(case, check):
        check(case)  # ids: MyEngine-assert_monotone, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyro
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from probfsl.host_syncs import HostSyncCounter
from probfsl.inference.base import Engine, RunInfo, run

if TYPE_CHECKING:
    from probfsl.models.base import FewShotClassifier


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
        name: the case's name in test ids (:func:`parametrize_with_checks`); default
            the engine's class name.
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
    name: str = ""


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


def engine_checks(case: ConformanceCase) -> list[Callable[[ConformanceCase], None]]:
    """The conformance checks that apply to ``case``, in the order :func:`check_engine`
    runs them (:func:`assert_exact_evidence` only when the case gives the exact evidence)."""
    checks = [
        assert_monotone,
        assert_batch_invariant,
        assert_dtype_agreement,
        assert_device_follows,
        assert_no_host_syncs,
    ]
    if case.exact_log_evidence is not None:
        checks.append(assert_exact_evidence)
    return [*checks, assert_elbo_matches_pyro]


def check_engine(case: ConformanceCase) -> None:
    """Run every conformance check on ``case``; raises ``AssertionError`` on the first failure."""
    for check in engine_checks(case):
        check(case)


# ---------------------------------------------------------------- estimator checks


@functools.cache
def estimator_check_data() -> tuple[tuple[torch.Tensor, torch.Tensor], Any]:
    """The data of the estimator checks: the built-in Omniglot base classes (float64
    features and labels) and 3 tasks of 3 ways, 2 shots and 9 queries (seed 1, float64).

    Made once and shared by every check: the checks never modify it.
    """
    from probfsl.data import load_dataset
    from probfsl.data.tasks import sample_episodes

    fs = load_dataset("omniglot")
    base = fs.base(torch.float64)
    episodes = sample_episodes(fs, 3, way=3, shot=2, n_query=9, seed=1, dtype=torch.float64)
    return base, episodes


def equal_values(a: Any, b: Any) -> bool:
    """Deep equality of fitted values: tensors exactly (dtype, shape and values), arrays,
    dataclasses field by field, lists, tuples and dicts item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            equal_values(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal_values(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal_values(a[k], b[k]) for k in a)
    return a == b


@contextlib.contextmanager
def _raises(kinds: type[BaseException] | tuple[type[BaseException], ...], match: str = ""):
    """``pytest.raises`` without pytest: the block must raise ``kinds`` whose message
    matches the regular expression ``match``."""
    try:
        yield
    except kinds as err:
        assert re.search(match, str(err)), f"{type(err).__name__}({err!s}) does not match {match!r}"
    else:
        raise AssertionError(f"no {kinds} raised (expected one matching {match!r})")


def _unfitted(estimator: FewShotClassifier) -> FewShotClassifier:
    """A new, unfitted estimator with ``estimator``'s hyperparameters."""
    return type(estimator)(**estimator.get_params(deep=False))


def _fitted(estimator: FewShotClassifier) -> FewShotClassifier:
    return _unfitted(estimator).fit_base(*estimator_check_data()[0])


def check_fit_is_fit_base(estimator: FewShotClassifier) -> None:
    """``fit(features, labels)`` is ``fit_base``: the same fitted state and predictions."""
    from probfsl.models.base import FewShotClassifier

    base, episodes = estimator_check_data()
    a = _unfitted(estimator).fit(*base)
    b = _fitted(estimator)
    assert isinstance(a, FewShotClassifier), f"fit returned {type(a).__name__}, not the estimator"
    assert equal_values(a.fitted_state(), b.fitted_state()), "fit and fit_base fit differently"
    assert torch.equal(a.predict(episodes), b.predict(episodes))


def check_get_set_params(estimator: FewShotClassifier) -> None:
    """``get_params`` rebuilds the estimator; ``set_params`` returns it, round-trips, and
    refuses an unknown name with a ``ValueError`` listing the accepted ones (leaving the
    estimator as it was)."""
    est = _unfitted(estimator)
    params = est.get_params()
    assert type(est)(**params).get_params() == params
    assert est.set_params(**params) is est and est.get_params() == params
    with _raises(ValueError, match="unknown hyperparameter.*accepted"):
        est.set_params(not_a_parameter=1)
    assert est.get_params() == params


def check_init_only_stores(estimator: FewShotClassifier) -> None:
    """No logic in ``__init__``: any value is stored as given, and refused by
    ``check_params`` (and by ``set_params``, which then leaves the estimator as it was)."""
    cls = type(estimator)
    junk = {k: object() for k in inspect.signature(cls).parameters}
    est = cls(**junk)
    assert all(est.get_params()[k] is v for k, v in junk.items()), "__init__ changed a value"
    with _raises((TypeError, ValueError)):
        est.check_params()
    good = _unfitted(estimator)
    before = good.get_params()
    for key in before:
        with _raises((TypeError, ValueError), match=key):
            good.set_params(**{key: object()})
        assert good.get_params() == before, f"a refused set_params({key}=...) changed it"


def check_sklearn_clone(estimator: FewShotClassifier) -> None:
    """scikit-learn's ``clone`` of a fitted estimator is an unfitted copy with the same
    hyperparameters (which needs ``__init__`` to store each one as given)."""
    from sklearn.base import clone

    est = _fitted(estimator)
    assert set(est.get_params(deep=False)) == set(inspect.signature(type(est)).parameters)
    copy_ = clone(est)
    assert type(copy_) is type(est) and copy_.get_params() == est.get_params()
    assert not copy_.fitted_state(), "a clone is unfitted"


def check_fit_predict_on_arrays(estimator: FewShotClassifier) -> None:
    """``fit_predict`` on one task of NumPy arrays with arbitrary integer labels, on a
    batch of tensors and task by task agrees with ``predict``; it refuses ``Episodes``."""
    _, episodes = estimator_check_data()
    est = _fitted(estimator)
    expected = est.predict(episodes)  # [T, Q] task-local
    # a user's labels: any integers; fit_predict numbers each task's classes by sorted
    # value, so an increasing map keeps the task-local numbering (and any random stream
    # that depends on it) and the results must agree exactly
    values = 7 * torch.arange(episodes.way) + 100
    t = 1
    labels = values[episodes.support_labels[t]].numpy()
    got = est.fit_predict(episodes.support[t].numpy(), labels, episodes.query[t].numpy())
    assert isinstance(got, np.ndarray) and got.shape == (episodes.n_query,)
    assert np.array_equal(got, values[expected[t]].numpy())
    # the batch in one call equals one task at a time, as tensors
    batch = est.fit_predict(episodes.support, values[episodes.support_labels], episodes.query)
    assert isinstance(batch, torch.Tensor) and torch.equal(batch, values[expected])
    assert np.array_equal(batch[t].numpy(), got)
    single = [
        est.fit_predict(episodes.support[i], episodes.support_labels[i], episodes.query[i])
        for i in range(episodes.n_tasks)
    ]
    assert torch.equal(torch.stack(single), expected)
    # an Episodes batch is predict's (task-local labels), not fit_predict's
    with _raises(TypeError, match="predict"):
        est.fit_predict(episodes, None, None)


def check_fit_predict_bad_input(estimator: FewShotClassifier) -> None:
    """``fit_predict`` refuses mismatched shapes, integer features, tasks with different
    numbers of classes and, for estimators that need base classes, a missing ``fit_base``."""
    _, episodes = estimator_check_data()
    est = _fitted(estimator)
    s, q = episodes.support[0].numpy(), episodes.query[0].numpy()
    y = episodes.support_labels[0].numpy()
    with _raises(ValueError, match="support_labels"):
        est.fit_predict(s, y[:-1], q)
    with _raises(ValueError, match="query"):
        est.fit_predict(s, y, q[:, :-1])
    with _raises(TypeError, match="support"):
        est.fit_predict(s.astype(np.int64), y, q)
    two = episodes.support_labels.clone()
    two[0] = 0
    two[0, 0] = 1  # task 0 has 2 classes, the others 3
    with _raises(ValueError, match="same number of distinct"):
        est.fit_predict(episodes.support, two, episodes.query)
    if est.needs_base:
        with _raises(ValueError, match="fit_base"):
            _unfitted(estimator).fit_predict(s, y, q)


def check_predict_proba_keeps_fitted_state(estimator: FewShotClassifier) -> None:
    """``predict_proba`` changes no fitted attribute (it may add ``call_diagnostics``),
    and a task's probabilities do not depend on the other tasks of its batch."""
    import copy

    _, episodes = estimator_check_data()
    est = _fitted(estimator)
    before = copy.deepcopy({k: v for k, v in vars(est).items() if not k.startswith("_")})
    first = est.predict_proba(episodes)
    second = est.predict_proba(episodes[1:])
    after = {k: v for k, v in vars(est).items() if not k.startswith("_")}
    assert equal_values({k: after[k] for k in before}, before), "predict_proba changed it"
    assert set(after) - set(before) <= set(est.call_diagnostics)
    assert torch.allclose(est.predict_proba(episodes)[1:], second, atol=1e-12)
    assert torch.equal(est.predict_proba(episodes), first)


def check_relabelling_permutes_columns(estimator: FewShotClassifier) -> None:
    """Relabelling the classes of every task (support label k becomes σ(k)) permutes the
    columns of ``predict_proba`` and nothing else: a method may not depend on which class
    is called 0. Exact to 1e-9 in float64 where ``relabelling_exact``; for a Monte Carlo
    method whose random streams follow the labels, relabelling may move the probabilities
    no more than twice as far (mean absolute change) as another ``seed`` does."""
    _, episodes = estimator_check_data()
    est = _fitted(estimator)
    sigma = torch.tensor([2, 0, 1])  # the 3-way tasks of the check data
    relabelled = dataclasses.replace(episodes, support_labels=sigma[episodes.support_labels])
    before, after = est.predict_proba(episodes), est.predict_proba(relabelled)
    if est.relabelling_exact:
        torch.testing.assert_close(after[..., sigma], before, atol=1e-9, rtol=1e-9)
    else:
        seed = est.get_params()["seed"]  # a Monte Carlo estimator takes its seed
        reseeded = _unfitted(estimator).set_params(seed=seed + 1)
        other = reseeded.fit_base(*estimator_check_data()[0]).predict_proba(episodes)
        noise = (other - before).abs().mean()
        moved = (after[..., sigma] - before).abs().mean()
        assert moved <= 2 * noise, f"relabelling moved {moved:.3g}, another seed {noise:.3g}"


def check_save_load_roundtrip(estimator: FewShotClassifier) -> None:
    """``save`` then ``FewShotClassifier.load`` gives the same class, hyperparameters,
    fitted state and predictions (after a ``predict``: its per-call diagnostics are
    neither needed nor saved)."""
    from probfsl.models.base import FewShotClassifier

    _, episodes = estimator_check_data()
    est = _fitted(estimator)
    est.predict(episodes)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "estimator.pt"
        est.save(path)
        back = FewShotClassifier.load(path)
    assert type(back) is type(est), f"loaded a {type(back).__name__}"
    assert back.get_params() == est.get_params()
    assert equal_values(back.fitted_state(), est.fitted_state()), "the fitted state changed"
    task = (episodes.support, episodes.support_labels, episodes.query)
    assert torch.equal(back.fit_predict(*task), est.fit_predict(*task))


def estimator_checks(estimator: FewShotClassifier) -> list[Callable[[Any], None]]:
    """The checks that apply to ``estimator``, in the order :func:`check_estimator` runs
    them (:func:`check_sklearn_clone` only when scikit-learn is installed)."""
    checks: list[Callable[[Any], None]] = [
        check_get_set_params,
        check_init_only_stores,
        check_fit_is_fit_base,
    ]
    if importlib.util.find_spec("sklearn") is not None:
        checks.append(check_sklearn_clone)
    return [
        *checks,
        check_fit_predict_on_arrays,
        check_fit_predict_bad_input,
        check_predict_proba_keeps_fitted_state,
        check_relabelling_permutes_columns,
        check_save_load_roundtrip,
    ]


def check_estimator(estimator: FewShotClassifier) -> None:
    """Run every estimator check on ``estimator`` (which is left unfitted and unchanged:
    each check works on a copy); raises ``AssertionError`` on the first failure."""
    for check in estimator_checks(estimator):
        check(estimator)


# ---------------------------------------------------------------- pytest


def _same_default(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:  # an array or a tensor: shown
        return False


def estimator_id(estimator: FewShotClassifier) -> str:
    """``SLEM()``, ``GPTreeFewShot(n_chains=2, n_sweeps=2)``: the class and the
    hyperparameters that differ from the constructor's defaults."""
    signature = inspect.signature(type(estimator)).parameters
    changed = [
        f"{k}={v!r}"
        for k, v in estimator.get_params(deep=False).items()
        if k not in signature or not _same_default(v, signature[k].default)
    ]
    return f"{type(estimator).__name__}({', '.join(changed)})"


def case_id(case: ConformanceCase) -> str:
    """The case's ``name``, or the class name of the engine it makes."""
    return case.name or type(case.make_engine()).__name__


def _checks_of(obj: Any) -> tuple[str, str, list[Callable[[Any], None]]]:
    from probfsl.models.base import FewShotClassifier

    if isinstance(obj, ConformanceCase):
        return "case", case_id(obj), engine_checks(obj)
    if isinstance(obj, FewShotClassifier):
        return "estimator", estimator_id(obj), estimator_checks(obj)
    raise TypeError(
        f"parametrize_with_checks takes FewShotClassifier estimators or ConformanceCase "
        f"objects, not {type(obj).__name__}"
    )


def checks_of(objects: Iterable[Any]) -> Iterator[tuple[str, Any, Callable[[Any], None]]]:
    """``(test id, object, check)`` for every check of every estimator or engine case
    of ``objects``; the id is ``"<object id>-<check name>"``."""
    for obj in objects:
        _, name, checks = _checks_of(obj)
        for check in checks:
            yield f"{name}-{check.__name__}", obj, check


def parametrize_with_checks(
    objects: Iterable[Any], marks: Callable[[Any, Callable[[Any], None]], Any] | None = None
):
    """A ``pytest.mark.parametrize`` over every (object, check) pair of ``objects``, after
    scikit-learn's ``sklearn.utils.estimator_checks.parametrize_with_checks``.

    ``objects`` are either estimators (:class:`probfsl.models.base.FewShotClassifier`
    instances, checked by :func:`estimator_checks`; the test takes ``estimator, check``)
    or engine cases (:class:`ConformanceCase`, checked by :func:`engine_checks`; the test
    takes ``case, check``). Each pair has its own test id, ``"<object>-<check>"``, e.g.
    ``SLEM()-check_save_load_roundtrip`` or ``NormalGammaVB-assert_monotone``, so that
    ``pytest -k check_save_load_roundtrip`` runs one check on every object::

        @parametrize_with_checks([make_estimator(name) for name in METHODS])
        def test_estimator(estimator, check):
            check(estimator)

    ``marks(object, check)``, when given, returns the pytest marks of a pair (a mark, a
    list of marks, or ``None``), e.g. ``pytest.mark.slow`` for the long ones.

    Estimators are checked on copies (they stay unfitted); build engine cases small, as
    they are made when the tests are collected. Needs pytest.
    """
    import pytest

    objects = list(objects)
    kinds = {_checks_of(obj)[0] for obj in objects}
    if len(kinds) > 1:
        raise TypeError("parametrize_with_checks: estimators and engine cases in one list")
    argnames = f"{kinds.pop() if kinds else 'estimator'}, check"
    params = []
    for test_id, obj, check in checks_of(objects):
        extra = None if marks is None else marks(obj, check)
        extra = () if extra is None else extra
        extra = tuple(extra) if isinstance(extra, (list, tuple)) else (extra,)
        params.append(pytest.param(obj, check, id=test_id, marks=extra))
    return pytest.mark.parametrize(argnames, params)
