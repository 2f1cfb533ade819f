"""A derived plan kept for new data of the same shapes.

Deriving a plan (:class:`~probfsl.inference.vmp.compiler.Compiler`) runs the model
several times: Pyro's provenance tracking, the verifying runs, the runs at each end of
the latent supports. On a batch of one task this is most of a call (vmp-gmm on a 5-way
1-shot Omniglot task: about 90 of 130 ms on one thread), and an estimator that predicts
task after task derives the same plan every time. :class:`PlanCache` keeps the last plan
and gives it the new observations (:meth:`~probfsl.inference.vmp.layout.Plan.observe`)
where nothing else changed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from probfsl.inference.vmp.layout import Plan

__all__ = ["PlanCache", "kept_plans"]

#: plans whose observations hold more bytes are not kept: the compile of such a batch is a
#: small part of its work, and the plan holds its data (one 5-way task of 155 rows in 2,048
#: dimensions holds 2.5 MiB in float64)
MAX_BYTES = 4 * 2**20


class PlanCache:
    """The last plan :meth:`VMP.compile <probfsl.inference.vmp.engine.VMP.compile>`
    derived for a model, reused for new data of the same shapes.

    Args:
        observations: the model's arguments (by position, or by name for keyword
            arguments) that are the observations of a Normal site, mapped to that site's
            name. The model must use such an argument as that observation and as nothing
            else (its dtype and device aside): only those change from call to call.
        max_bytes: a plan whose observations hold more bytes is not kept.

    The plan is reused where the model (a :func:`functools.partial`'s function,
    arguments and keywords; any other callable by identity), the update order and every
    other argument equal those it was derived for (tensors by dtype, shape, device and
    value), and the observations have the same dtype, shape and device; anything else
    derives a new plan. ``hits`` and ``misses`` count the two. A copy or a pickled cache
    starts empty.
    """

    def __init__(self, observations: dict[int | str, str], max_bytes: int = MAX_BYTES) -> None:
        self.observations = dict(observations)
        self.max_bytes = int(max_bytes)
        self.hits = self.misses = 0
        self._kept: tuple | None = None  # (model, order, args, kwargs, plan)

    def __getstate__(self) -> dict:
        return {"observations": self.observations, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def reuse(
        self, model: Callable[..., Any], order: list[str] | None, args: tuple, kwargs: dict
    ) -> Plan | None:
        """The kept plan with these observations, or ``None`` (then :meth:`keep` the new
        plan)."""
        kept = self._kept
        if kept is None or not (
            _same(kept[0], model)
            and kept[1] == order
            and len(kept[2]) == len(args)
            and kept[3].keys() == kwargs.keys()
            and all(self._matches(k, a, b) for k, a, b in _named(kept[2], kept[3], args, kwargs))
        ):
            self.misses += 1
            return None
        self.hits += 1
        values = {site: _argument(args, kwargs, k) for k, site in self.observations.items()}
        return kept[4].observe(**values)

    def keep(
        self,
        model: Callable[..., Any],
        order: list[str] | None,
        args: tuple,
        kwargs: dict,
        plan: Plan,
    ) -> None:
        """Keep ``plan``, derived for these arguments, unless its observations are larger
        than ``max_bytes`` (then forget the one kept)."""
        size = sum(
            t.numel() * t.element_size()
            for t in (_argument(args, kwargs, k) for k in self.observations)
            if isinstance(t, torch.Tensor)
        )
        if size > self.max_bytes:
            self._kept = None
            return
        # a copy of what is compared by value: a tensor changed in place after this call
        # must not compare equal to itself
        args = tuple(a if i in self.observations else _snapshot(a) for i, a in enumerate(args))
        kwargs = {k: v if k in self.observations else _snapshot(v) for k, v in kwargs.items()}
        self._kept = (_snapshot(model), order, args, kwargs, plan)

    def _matches(self, key: int | str, kept: Any, new: Any) -> bool:
        return _same_layout(kept, new) if key in self.observations else _same(kept, new)


def _named(args_a: tuple, kwargs_a: dict, args_b: tuple, kwargs_b: dict):
    """(key, a, b) for every positional and keyword argument of two calls alike in form."""
    yield from ((i, a, b) for i, (a, b) in enumerate(zip(args_a, args_b, strict=True)))
    yield from ((k, kwargs_a[k], kwargs_b[k]) for k in kwargs_a)


def _argument(args: tuple, kwargs: dict, key: int | str) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


def _same_layout(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are tensors of the same dtype, shape and device."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
    )


def _same(a: Any, b: Any) -> bool:
    """Whether two model arguments (or models) are equal: tensors by dtype, shape, device
    and value, containers element by element, partials by function, arguments and
    keywords, anything else by identity or ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _same_layout(a, b) and torch.equal(a, b)
    if a is b:
        return True
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return _same(a.func, b.func) and _same(a.args, b.args) and _same(a.keywords, b.keywords)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float, str, bool, type(None))) and isinstance(
        b, (int, float, str, bool, type(None))
    ):
        return type(a) is type(b) and a == b
    return False


def _snapshot(a: Any) -> Any:
    """``a`` with every tensor in it copied (through partials and containers)."""
    if isinstance(a, torch.Tensor):
        return a.detach().clone()
    if isinstance(a, functools.partial):
        return functools.partial(a.func, *_snapshot(a.args), **_snapshot(a.keywords))
    if isinstance(a, tuple):
        items = [_snapshot(x) for x in a]
        return type(a)(*items) if hasattr(a, "_fields") else tuple(items)  # a NamedTuple's
    if isinstance(a, list):
        return [_snapshot(x) for x in a]
    if isinstance(a, dict):
        return {k: _snapshot(v) for k, v in a.items()}
    return a


def kept_plans(owner: object, role: str, observations: dict[int | str, str]) -> PlanCache:
    """The :class:`PlanCache` named ``role`` that ``owner`` (an estimator) keeps across
    its calls, made on first use with ``observations``. It is not part of a saved
    estimator (a private attribute)."""
    caches = owner.__dict__.setdefault("_plan_caches", {})
    if role not in caches:
        caches[role] = PlanCache(observations)
    return caches[role]
