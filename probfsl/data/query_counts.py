"""Per-class query counts of the unbalanced few-shot protocol (Veilleux et al. 2021).

Used for the closed queries of a task (:func:`probfsl.data.tasks.sample_task_indices`,
``balance="dirichlet"``) and for its open queries (:mod:`probfsl.data.open_set`).
"""

from __future__ import annotations

import numpy as np


def dirichlet_query_counts(
    rng: np.random.Generator, way: int, n_query: int, alpha: float, room: np.ndarray
) -> np.ndarray:
    """Per-class query counts of the unbalanced protocol (Veilleux et al. 2021).

    p ~ Dirichlet(alpha * 1_K); counts = round(Q p); while the counts do not sum to Q,
    the entry whose fractional part of Q p is closest to 1/2 is floored (sum too large)
    or ceiled (too small). Counts above ``room`` (samples left in the class) are capped
    and the surplus goes, one query at a time, to the class with room that is furthest
    below its target Q p_k.
    """
    target = n_query * rng.dirichlet(np.full(way, float(alpha)))
    counts = np.floor(target + 0.5).astype(np.int64)
    frac = target - np.floor(target)
    while counts.sum() != n_query:
        too_many = counts.sum() > n_query
        # floor only entries that were rounded up, ceil only those rounded down
        movable = counts > np.floor(target) if too_many else counts < np.ceil(target)
        k = np.flatnonzero(movable)[np.argmin(np.abs(frac[movable] - 0.5))]
        counts[k] += -1 if too_many else 1
    over = np.maximum(counts - room, 0)
    counts -= over
    for _ in range(int(over.sum())):
        open_ = np.flatnonzero(counts < room)
        k = open_[np.argmax(target[open_] - counts[open_])]
        counts[k] += 1
    return counts
