"""The evaluation protocol and result tables.

The names below are loaded from their modules on first use (PEP 562), so that the
tables (:mod:`probfsl.evaluation.tables`, used by light commands) do not import torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING

#: where each public name lives
_HOMES = {
    "EvalResult": "protocol",
    "accuracy_ci": "protocol",
    "evaluate": "protocol",
    "score_batches": "protocol",
    "markdown_table": "tables",
    "text_table": "tables",
    "write_results": "tables",
    "evaluate_zero_shot": "zero_shot",
    "OpenSetResult": "open_set",
    "evaluate_open_set": "open_set",
}

__all__ = [
    "EvalResult",
    "accuracy_ci",
    "evaluate",
    "evaluate_zero_shot",
    "OpenSetResult",
    "evaluate_open_set",
    "score_batches",
    "markdown_table",
    "text_table",
    "write_results",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'probfsl.evaluation' has no attribute {name!r}")
    value = getattr(import_module(f"probfsl.evaluation.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


if TYPE_CHECKING:
    from probfsl.evaluation.open_set import OpenSetResult, evaluate_open_set
    from probfsl.evaluation.protocol import EvalResult, accuracy_ci, evaluate, score_batches
    from probfsl.evaluation.tables import markdown_table, text_table, write_results
    from probfsl.evaluation.zero_shot import evaluate_zero_shot
