"""The evaluation protocol and result tables."""

from probfsl.evaluation.protocol import EvalResult, accuracy_ci, evaluate, score_batches
from probfsl.evaluation.tables import markdown_table, text_table, write_results
from probfsl.evaluation.zero_shot import evaluate_zero_shot

__all__ = [
    "EvalResult",
    "accuracy_ci",
    "evaluate",
    "evaluate_zero_shot",
    "score_batches",
    "markdown_table",
    "text_table",
    "write_results",
]
