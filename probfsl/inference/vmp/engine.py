"""The VMP engine: initialise, sweep, freeze converged tasks, report q as distributions.

:class:`VMP` implements the engine contract of :mod:`probfsl.inference.base` (``init``,
``step``, ``keep``; ``fit`` runs the shared loop). The plan comes from
:class:`~probfsl.inference.vmp.compiler.Compiler`, the updates and the bound from
:mod:`probfsl.inference.vmp.messages`.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference.base import Engine, Info, RunInfo, run
from probfsl.inference.vmp import (
    gaussian_chain,
    grouped_plates,
    layout,
    messages,
    moments,
    saddles,
    starts,
)
from probfsl.inference.vmp.compiler import Compiler
from probfsl.inference.vmp.einsum import sweeping
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import Plan
from probfsl.inference.vmp.plan_cache import PlanCache
from probfsl.validation import check_flag, check_hyperparameter


@dataclass
class VMPState:
    """Factors of every latent site (canonical layout, ``tasks`` first) and the ELBO.

    Attributes:
        plan: the structure derived from the model (shared by every state of a fit).
        q: site name -> the factor's parameters: Normal (loc, precision; a joint Normal's
            precision is a matrix over its last event axis), Gamma (shape, rate), Dirichlet
            (concentration,), Beta (concentration1, concentration0), Categorical (probs,),
            MultivariateNormal (loc, precision), Wishart (df, scale), a point estimate
            (value,); a Gaussian chain's name -> (lag-one covariances, ln|Σ|).
        objective: the analytic ELBO [T].
    """

    plan: Plan
    q: dict
    objective: torch.Tensor


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` at the tasks ``index``, its other broadcast axes (stride 0, a Gamma shape
    shared along an event axis) kept broadcast: the elementwise functions of the factor
    then still run on its distinct values (:func:`~probfsl.inference.vmp.moments.compact`)."""
    shape, stride = t.shape, t.stride()
    narrow = [i > 0 and stride[i] == 0 and shape[i] > 1 for i in range(t.dim())]
    if not any(narrow):
        return t.index_select(0, index)
    small = t[tuple(slice(0, 1) if b else slice(None) for b in narrow)]
    return small.index_select(0, index).expand(len(index), *t.shape[1:])


def _pyro_shaped(s: layout.Site, t: torch.Tensor) -> torch.Tensor:
    """A factor's parameter in the model's batch shape (trailing axes kept)."""
    t = layout.uncanon(s, t)
    return t.expand(*s.batch_shape, *t.shape[len(s.batch_shape) :])


class ConvergenceWarning(UserWarning):
    """:meth:`VMP.fit` stopped some tasks at ``max_iter`` sweeps before their bound met
    ``tol`` (``RunInfo.converged`` says which)."""


class MeanFieldWarning(UserWarning):
    """:meth:`VMP.compile` derived a plan that fits latent Gaussian sites coupled in the
    likelihood (combined in one site's location) with separate factors, mean-field
    between them (:meth:`~probfsl.inference.vmp.layout.Plan.mean_field_pairs`;
    :meth:`VMP.describe` lists every factor)."""


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn` that names the first frame outside this
    package (the user's call of ``fit``, ``init``, ``compile`` or ``describe``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(__package__):
        frame, level = frame.f_back, level + 1
    return level


class VMP(Engine):
    """Batched variational message passing for a Pyro model (module docstring).

    Args:
        model: a Pyro model whose data carry a leading task axis inside a ``tasks`` plate.
        max_iter: maximum number of sweeps of :meth:`fit`.
        tol: in :meth:`fit`, a task has converged (and is frozen) once its ELBO changes by
            less than ``tol`` · max(1, |ELBO|) in one sweep; 0 runs all ``max_iter`` sweeps.
        check_every: :meth:`fit` first asks the device whether every task has converged
            after ``check_every`` sweeps (the loop's only host synchronisation) ...
        check_growth: ... and then at gaps growing by this factor
            (:func:`probfsl.inference.base.check_steps`; 1 = every ``check_every``
            sweeps). On an accelerator the defaults are 2 and 1.25 (checks after 2, 4, 7,
            10, 14, 19, 25, 33, ... sweeps): the number of checks is logarithmic in the
            sweeps the slowest task needs, so it does not grow with the batch, while a
            converged task runs at most about a quarter more sweeps (masked) before the
            check that drops it; with 2 (checks after 2, 4, 8, 16, ...) it may run twice
            its sweeps (``vmp-gmm`` on 1,000 Omniglot tasks: 26 host synchronisations and
            0.84 s per call with 1.25, 23 and 1.04 s with 2). On the CPU, where the host
            runs the kernels itself and a check waits for nothing, the defaults are 1 and
            1: every sweep is checked, so the converged tasks leave the batch as soon as
            they are a fifth of it (the mixture of ``benchmarks/bench_vmp.py``, 1,000 tasks
            on one thread: 0.56 s instead of 0.60 s with 2 and 1.25).
        order: the latent sites' update order, any permutation of them (default: the
            model's declaration order, ``pyro.param`` point estimates after every other
            site, as variational EM's M-step follows its E-step, so that the first sweep
            starts from the parameters' initial values). It orders the sweeps only:
            ``init`` always starts the factors in the model's declaration order (each
            after the parents it reads), so every order starts from the same factors.
        seed: seed of the start of latent Categorical sites (responsibilities drawn from
            Dirichlet(1) per entry, shared by the tasks) and of the draws of
            ``init="prior"``.
        init: the default start of :meth:`init` (:mod:`~probfsl.inference.vmp.starts`):
            ``None`` (every factor at its prior, then one update from its children),
            ``"prior"`` (every Normal and MultivariateNormal factor's mean drawn from its
            prior: the way out of a saddle such as Bayesian PCA's W = x = 0), a dict
            site name -> the factor's mean or ``"prior"``, or a :class:`VMPState`.
        warn: whether :meth:`fit` warns (:class:`ConvergenceWarning`) when it stops some
            task at ``max_iter``; an estimator that runs a fixed budget of sweeps by design
            turns it off (``RunInfo.converged`` still says which tasks met ``tol``).
        warn_mean_field: whether :meth:`compile` warns (:class:`MeanFieldWarning`, once
            per plan, naming the sites) when the plan fits latent Gaussian sites that the
            likelihood couples with separate factors (a product of two latent Gaussian
            sites, an affine map of several); an estimator whose model is mean-field by
            design turns it off (:meth:`describe` still lists the pairs).
        plans: a :class:`~probfsl.inference.vmp.plan_cache.PlanCache` that :meth:`compile`
            reuses the last plan from, where only the observations it names changed (an
            estimator keeps one across its predict calls; one task's plan costs more than
            its sweeps). ``None``: every call derives its plan.
    """

    maximize = True

    def __init__(
        self,
        model: Callable[..., Any],
        max_iter: int = 100,
        tol: float = 1e-6,
        check_every: int | None = None,
        order: list[str] | None = None,
        seed: int = 0,
        check_growth: float | None = None,
        init: Any = None,
        warn: bool = True,
        warn_mean_field: bool = True,
        plans: PlanCache | None = None,
    ) -> None:
        if not callable(model):
            raise TypeError(f"model must be callable, got {type(model).__name__}")
        check_hyperparameter("max_iter", max_iter, integer=True, low=1)
        check_hyperparameter("tol", tol, nonnegative=True)
        if check_every is not None:
            check_hyperparameter("check_every", check_every, integer=True, low=1)
            check_every = int(check_every)
        if check_growth is not None:
            check_hyperparameter("check_growth", check_growth, low=1)
            check_growth = float(check_growth)
        check_hyperparameter("seed", seed, integer=True, nonnegative=True)
        self.check_every, self.check_growth = check_every, check_growth
        self.model, self.max_iter, self.tol = model, int(max_iter), float(tol)
        self.order, self.seed = order, seed
        self.init_values = init  # (``init`` is the method)
        self.warn = check_flag("warn", warn)
        self.warn_mean_field = check_flag("warn_mean_field", warn_mean_field)
        self.plans = plans

    def schedule(self, device: torch.device) -> tuple[int, float]:
        """``(check_every, check_growth)`` of :meth:`fit` on ``device``: the ones given,
        else 1 and 1 on the CPU, 2 and 1.25 elsewhere (see the class docstring)."""
        every, growth = (1, 1.0) if device.type == "cpu" else (2, 1.25)
        return (
            every if self.check_every is None else self.check_every,
            growth if self.check_growth is None else self.check_growth,
        )

    @staticmethod
    def _update(plan: Plan, q: dict, name: str, children: bool = True) -> None:
        """Update the factor of site ``name`` in ``q``: a Gaussian chain as a whole, at its
        first site."""
        s = plan.sites[name]
        if s.chain is None:
            q[name] = messages.update(plan, q, name, children)
        elif s.chain[1] == 0:
            q.update(
                gaussian_chain.update(
                    plan, q, s.chain[0], messages.natural, messages.message, children
                )
            )

    def compile(self, *args: Any, **kwargs: Any) -> Plan:
        """Read the model's sites, parents and parameter maps for these data
        (:mod:`~probfsl.inference.vmp.compiler`). With ``warn_mean_field``, a
        :class:`MeanFieldWarning` names the coupled latent sites the plan fits with
        separate factors. With ``plans``, the plan kept there with these observations
        where it applies (:class:`~probfsl.inference.vmp.plan_cache.PlanCache`)."""
        if self.plans is not None:
            plan = self.plans.reuse(self.model, self.order, args, kwargs)
            if plan is not None:
                return plan
        plan = Compiler(self.model, self.order).compile(*args, **kwargs)
        if self.plans is not None:
            self.plans.keep(self.model, self.order, args, kwargs, plan)
        pairs = plan.mean_field_pairs() if self.warn_mean_field else []
        if pairs:
            coupled = "; ".join(f"{a} and {b} (through site {c})" for a, b, c in pairs)
            warnings.warn(
                f"VMP fits coupled latent sites with separate factors, mean-field between "
                f"them: {coupled}. VMP.describe(*data) or Plan.describe() lists every "
                f"factor; VMP(..., warn_mean_field=False) silences this",
                MeanFieldWarning,
                stacklevel=_caller_stacklevel(),
            )
        return plan

    def describe(self, *args: Any, **kwargs: Any) -> str:
        """The plan of these data (:meth:`compile`, without its :class:`MeanFieldWarning`)
        described: every factor, its shape and structure, and the mean-field pairs
        (:meth:`~probfsl.inference.vmp.layout.Plan.describe`)."""
        return Compiler(self.model, self.order).compile(*args, **kwargs).describe()

    def elbo(self, state: VMPState) -> torch.Tensor:
        """The analytic ELBO [T]: Σ_sites E ln p(x | pa) + Σ_latent H[q] (Winn & Bishop §3.3)."""
        with sweeping():
            return messages.elbo(state.plan, state.q)

    def natural(self, state: VMPState, name: str) -> tuple[torch.Tensor, ...]:
        """η of the latent site ``name``: the natural parameters of its next coordinate
        update given the other factors of ``state`` (Winn & Bishop §3.2), in the layout of
        its factor. For a Categorical site these are the unnormalised log-probabilities
        whose softmax over the last axis is q(z), finite where the probabilities
        themselves underflow. Where ``name`` was the last site updated (the model's
        declaration order puts a label after its parameters), its softmax is q(z) as the
        sweep left it."""
        if name not in state.plan.latent or state.plan.sites[name].chain is not None:
            raise ValueError(f"{name!r} is not a latent site of the model outside a chain")
        with torch.inference_mode(), sweeping():
            return tuple(t.clone() for t in messages.natural(state.plan, state.q, name))

    def init(
        self, *args: Any, init_resp: dict | None = None, init: Any = None, **kwargs: Any
    ) -> VMPState:
        """Derive the plan, initialise the factors (module docstring) and compute the ELBO.

        ``init_resp`` maps latent Categorical site names to initial probabilities in the
        site's Pyro shape plus the category axis (observed entries are reset to one-hot).
        ``init`` is a start (:mod:`~probfsl.inference.vmp.starts`; default the engine's):
        ``"prior"``, a dict site name -> mean (a tensor in the site's Pyro shape) or
        ``"prior"``, or a :class:`VMPState` whose factors are taken over.
        """
        return self.start(self.compile(*args, **kwargs), init_resp, init)

    def start(self, plan: Plan, init_resp: dict | None = None, init: Any = None) -> VMPState:
        """:meth:`init` on a plan already derived (:meth:`compile`, or a plan with new
        data, :meth:`~probfsl.inference.vmp.layout.Plan.observe`)."""
        sizes, ref = plan.sizes, plan.ref
        init = self.init_values if init is None else init
        if isinstance(init, VMPState):
            if init_resp:
                raise ValueError("init_resp cannot be given with a VMPState start")
            q = starts.from_state(plan, init)
            with sweeping():
                return VMPState(plan, q, messages.elbo(plan, q))
        given = starts.normalise(plan, init)
        init_resp = dict(init_resp or {})
        for name in list(given):
            if lookup(plan.sites[name].family).labels:
                if name in init_resp:
                    raise ValueError(f"site {name!r} is started by both init and init_resp")
                init_resp[name] = given.pop(name)
        q: dict = {}
        for name in plan.latent:
            s = plan.sites[name]
            if not lookup(s.family).labels:
                continue
            shape = [sizes[d] for d in s.dims] + [s.n_cat]
            if name in init_resp:
                r = torch.as_tensor(init_resp.pop(name), device=ref.device).to(ref)
                need = f"init_resp[{name!r}] must be"
                try:
                    r = layout.canon(s, r.expand(*s.batch_shape, s.n_cat))
                except RuntimeError:
                    raise ValueError(f"{need} of shape {shape}, got {tuple(r.shape)}") from None
                if tuple(r.shape) != tuple(shape) or not bool(torch.isfinite(r).all()):
                    raise ValueError(f"{need} finite with shape {shape}")
                usable = (r >= 0).all(-1) & (r.sum(-1) > 0)
                if s.fixed_mask is not None:  # observed entries are reset to one-hot below
                    usable = usable | s.fixed_mask
                if not bool(usable.all()):
                    raise ValueError(f"{need} >= 0 with a positive sum over the categories")
            else:
                # drawn on the CPU generator (the same numbers on every device), then moved
                g = torch.Generator().manual_seed(self.seed)
                noise = torch.rand(shape[1:], generator=g, dtype=torch.float64, device=g.device)
                r = (-torch.log1p(-noise)).to(ref).expand(shape)  # Dirichlet(1) draws
            r = r / r.sum(-1, keepdim=True)
            if s.fixed_mask is not None:
                r = torch.where(s.fixed_mask.unsqueeze(-1), s.fixed, r)
            q[name] = (r,)
        if init_resp:
            raise ValueError(f"init_resp names no latent Categorical site: {sorted(init_resp)}")
        for name in plan.latent:  # point estimates start at the model's initial values
            s = plan.sites[name]
            if s.point:
                q[name] = (starts.canonical(s, given.pop(name)) if name in given else s.init,)
        # in declaration order, whatever ``order``: each factor after the parents it reads
        latent = set(plan.latent)
        others = [
            n
            for n in plan.sites
            if n in latent and not lookup(plan.sites[n].family).labels and not plan.sites[n].point
        ]
        with sweeping():
            for name in others:  # priors first ...
                self._update(plan, q, name, False)
                s, value = plan.sites[name], given.get(name)
                if isinstance(value, str):
                    q[name] = starts.draw(s, q[name], self.seed)
                elif value is not None:
                    q[name] = starts.with_mean(s, q[name], starts.canonical(s, value))
            for name in others:  # ... then one update from the labels (the given ones kept)
                if name not in given:
                    self._update(plan, q, name, True)
            objective = messages.elbo(plan, q)
        return VMPState(plan, q, objective)

    def step(self, state: VMPState) -> tuple[VMPState, Info]:
        """One sweep: every latent site's coordinate update, in order, then the ELBO.

        No host synchronisation; convergence and freezing are :func:`run`'s (:meth:`keep`).
        """
        new = self.update(state, state.plan.latent)
        return new, Info(new.objective)

    def update(self, state: VMPState, names: list[str]) -> VMPState:
        """The coordinate updates of the latent sites ``names``, in that order, then the
        ELBO: one block of a schedule of one's own (:meth:`step` is the block of every
        latent site)."""
        plan, q = state.plan, dict(state.q)
        unknown = sorted(set(names) - set(plan.latent))
        if unknown:
            raise ValueError(f"not latent sites of the model: {unknown}")
        with sweeping():
            for name in names:
                self._update(plan, q, name)
            objective = messages.elbo(plan, q)
        return VMPState(plan, q, objective)

    compacts = True

    def take(self, state: VMPState, index: torch.Tensor) -> VMPState:
        """The tasks ``index`` alone: their factors, bound and data (:meth:`Plan.take`)."""
        q = {n: tuple(_take_rows(t, index) for t in f) for n, f in state.q.items()}
        plan = state.plan.take(index)
        moments.carry_rows(state.plan, plan, state.q, q, lambda t: _take_rows(t, index))
        return VMPState(plan, q, state.objective.index_select(0, index))

    def put(self, full: VMPState, index: torch.Tensor, part: VMPState) -> VMPState:
        """``full`` with the factors and bound of the tasks ``index`` from ``part``."""
        q = {
            n: tuple(a.index_copy(0, index, b) for a, b in zip(f, part.q[n], strict=True))
            for n, f in full.q.items()
        }
        return VMPState(full.plan, q, full.objective.index_copy(0, index, part.objective))

    def put_(self, full: VMPState, index: torch.Tensor, part: VMPState) -> VMPState:
        """:meth:`put` into ``full`` itself (its factors and bound are overwritten)."""
        for name, factor in full.q.items():
            for a, b in zip(factor, part.q[name], strict=True):
                a.index_copy_(0, index, b)
        full.objective.index_copy_(0, index, part.objective)
        return full

    def keep(self, frozen: torch.Tensor, old: VMPState, new: VMPState) -> VMPState:
        """``new`` with the factors and ELBO of the ``frozen`` tasks ([T] bool) from ``old``.

        Every factor parameter leads with the tasks axis (the canonical layout), so each is
        one ``torch.where``; the plan (data, fixed parameters, caches) is shared by every
        state of a fit and is never touched.
        """

        masks: dict = {}  # the frozen mask viewed for each number of axes, formed once

        def where(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            mask = masks.get(b.dim())
            if mask is None:
                mask = masks[b.dim()] = frozen.reshape(-1, *[1] * (b.dim() - 1))
            return torch.where(mask, a, b)

        q = {
            name: tuple(where(a, b) for a, b in zip(old.q[name], params, strict=True))
            for name, params in new.q.items()
        }
        moments.carry_over(new.plan, where, old.q, new.q, q)
        return VMPState(new.plan, q, where(old.objective, new.objective))

    def fit(
        self,
        *args: Any,
        init_resp: dict | None = None,
        init: Any = None,
        state: VMPState | None = None,
        **kwargs: Any,
    ) -> tuple[VMPState, RunInfo]:
        """``init``, then :func:`probfsl.inference.base.run` for up to ``max_iter`` sweeps.

        With ``tol > 0`` a task has converged once its bound L moved by at most
        ``tol`` · max(1, |L|) in one sweep; it is then frozen (masked: its factors stop
        changing, the batch keeps its size), so every task gets the result it would get
        alone; the loop ends once every task has converged, checked after ``check_every``
        sweeps and then at gaps growing by ``check_growth``. A :class:`ConvergenceWarning`
        (``warnings.warn``, naming how many tasks) follows a fit that stopped some task at
        ``max_iter`` sweeps without meeting ``tol``.

        ``init`` is the start (:meth:`init`); ``state``, given instead of data, continues
        that state's fit (on its own data) for up to ``max_iter`` more sweeps.

        Returns the final state and the :class:`~probfsl.inference.base.RunInfo`: ``trace``
        ``[sweeps + 1, T]`` (the bound after the start and after every sweep, a frozen task
        repeating its last value), ``n_steps`` ``[T]`` (the sweeps each task ran until it
        converged) and ``converged`` ``[T]`` (whether it met ``tol``).
        """
        if state is not None:
            if args or kwargs or init_resp is not None or init is not None:
                raise ValueError(
                    "fit(state=...) continues that state's fit on its own data; give no "
                    "data, init or init_resp with it (init=state starts new data from it)"
                )
        else:
            start = {} if init is None else {"init": init}
            state = self.init(*args, init_resp=init_resp, **start, **kwargs)
        tol = self.tol if self.tol > 0 else None
        every, growth = self.schedule(state.objective.device)
        # the sweeps skip autograd's bookkeeping (a seventh of a small batch's sweep on the
        # CPU); the results leave as ordinary tensors, usable with autograd afterwards
        with torch.inference_mode(), sweeping():
            state, info = run(self, state, self.max_iter, tol, every, growth)
        q = {n: tuple(t.clone() for t in f) for n, f in state.q.items()}
        state = VMPState(state.plan, q, state.objective.clone())
        info = RunInfo(*(t.clone() for t in info))
        if tol is not None and self.warn:
            self._warn_unconverged(info, state.objective.dtype)
        if self.warn:
            for why in saddles.stopped_at_saddles(state.plan, state.q):
                warnings.warn(f"VMP stopped where {why}", ConvergenceWarning, stacklevel=2)
        return state, info

    def _warn_unconverged(self, info: RunInfo, dtype: torch.dtype) -> None:
        """A :class:`ConvergenceWarning` when some task stopped at ``max_iter`` (one host
        synchronisation, after the loop)."""
        stuck = int((~info.converged).sum())
        if not stuck:
            return
        hint = ""
        if self.tol < 1e3 * torch.finfo(dtype).eps:
            hint = (
                f"; tol is near the rounding of the bound in {dtype} (eps "
                f"{torch.finfo(dtype).eps:.1e}), where a sweep's change may never fall below it"
            )
        warnings.warn(
            f"VMP stopped {stuck} of {len(info.converged)} task(s) at max_iter = "
            f"{self.max_iter} sweeps before the bound's change met tol = {self.tol:g} "
            f"(RunInfo.converged says which, RunInfo.trace holds the bound){hint}",
            ConvergenceWarning,
            stacklevel=3,
        )

    def posterior(self, state: VMPState) -> dict[str, torch.distributions.Distribution]:
        """Site name -> the factor q as a batched distribution in the model's shape (point
        estimates are :meth:`point_estimates`)."""
        out = {}
        for name in state.plan.latent:
            s = state.plan.sites[name]
            if s.point:
                continue
            if grouped_plates.grouped_plate(s) is not None:  # joint over a plate axis
                out[name] = grouped_plates.posterior(s, *state.q[name])
                continue
            p = [_pyro_shaped(s, t) for t in state.q[name]]
            record = lookup(s.family)
            if s.joint:  # a joint Normal factor: a MultivariateNormal over its last axis
                d = dist.MultivariateNormal(p[0], precision_matrix=p[1])
            else:
                d = record.posterior(p)
            ev = s.event_dim - (1 if s.joint else record.event_rank)
            out[name] = d.to_event(ev) if ev else d
        return out

    def point_estimates(self, state: VMPState) -> dict[str, torch.Tensor]:
        """``pyro.param`` name -> its estimate, in the shape the model gave it."""
        out = {}
        for name in state.plan.latent:
            s = state.plan.sites[name]
            if s.point:
                out[name] = layout.to_pyro(s, state.q[name][0])
        return out

    def guide(self, state: VMPState) -> Callable[..., None]:
        """A Pyro guide with the model's signature sampling every latent site from q
        (point estimates are not sampled: :meth:`point_estimates`). A Gaussian Markov
        chain is sampled from its joint factor, each step given the one before
        (:func:`~probfsl.inference.vmp.gaussian_chain.conditionals`); :meth:`posterior`
        holds the steps' marginals."""
        post = self.posterior(state)
        plan = state.plan
        steps = {
            m: (pred, *(_pyro_shaped(plan.sites[m], t) for t in abv))
            for m, (pred, *abv) in gaussian_chain.conditionals(plan, state.q).items()
        }
        vectors = {m for m in steps if gaussian_chain.vector(plan, plan.sites[m].chain[0])}
        for m in vectors:  # x_t | x_{t−1} ~ MVN(a + B x_{t−1}, V): V's Cholesky, once
            pred, a, b, v = steps[m]
            steps[m] = (pred, a, b, torch.linalg.cholesky(v))
        # every chain member after its predecessor (each once)
        order = [n for n in post if n not in steps]
        order += [m for members in plan.chains.values() for m in members[1:] if m in steps]

        absent = {n: messages.absent_entries(plan, plan.sites[n]) for n in post}
        masked = {
            n: layout.uncanon(plan.sites[n], ~a).expand(plan.sites[n].batch_shape)
            for n, a in absent.items()
            if a is not None and lookup(plan.sites[n].family).labels
        }

        def guide(*args, **kwargs) -> None:
            frames = {f.name: f for n in plan.latent for f in plan.sites[n].frames}
            plates = {k: pyro.plate(k, f.size, dim=f.dim) for k, f in frames.items()}
            values = {}
            for name in order:
                s = plan.sites[name]
                d = post[name]
                if name in steps:
                    pred, a, b, v = steps[name]
                    if name in vectors:  # v: the Cholesky factor of V
                        loc = a + (b @ values[pred].unsqueeze(-1)).squeeze(-1)
                        step = dist.MultivariateNormal(loc, scale_tril=v)
                        ev = s.event_dim - 1
                        d = step.to_event(ev) if ev else step
                    else:
                        step = dist.Normal(a + b * values[pred], v.sqrt())
                        d = step.to_event(len(d.event_shape)) if d.event_shape else step
                if s.fixed_mask is not None:
                    d = d.mask(layout.uncanon(s, ~s.fixed_mask).expand(s.batch_shape))
                elif name in masked:  # entries the model masks out: not drawn into the ELBO
                    d = d.mask(masked[name])
                with contextlib.ExitStack() as stack:
                    for f in s.frames:
                        stack.enter_context(plates[f.name])
                    values[name] = pyro.sample(s.pyro_name, d)

        return guide
