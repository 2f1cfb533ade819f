"""Count the host synchronisations and torch calls a computation makes.

On a GPU, ``Tensor.item()``, ``Tensor.tolist()``, ``bool(tensor)`` (an ``if`` on a
tensor, a convergence test written on the host), ``float()``/``int()`` of a tensor,
``.cpu()``, ``.numpy()`` and ``nonzero`` copy values to the CPU and stall the device until every
queued kernel has run. The counts are the same on the CPU, where nothing stalls, so
they can be measured and tested without a GPU: :class:`HostSyncCounter` is a
:class:`torch.overrides.TorchFunctionMode` that counts every torch function called (a
proxy for kernel launches) and, by name, the calls that copy to the host.
``.to("cpu")`` is counted as a torch call only.
"""

from __future__ import annotations

from collections import Counter

from torch.overrides import TorchFunctionMode

#: the Tensor methods that copy values to the host (``nonzero``: its output's shape
#: depends on the values, so the host waits for them)
SYNC_METHODS = ("__bool__", "item", "tolist", "__float__", "__int__", "cpu", "numpy", "nonzero")


class HostSyncCounter(TorchFunctionMode):
    """Context manager: ``syncs`` (a Counter per method name), ``total`` and ``torch_calls``.

    ``with HostSyncCounter() as counter: model.predict_proba(episodes)``, then
    ``counter.total`` host synchronisations and ``counter.torch_calls`` torch calls.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.torch_calls = 0

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.torch_calls += 1
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))
