"""P(open) averaged over each query's nearest queries in the task.

The open queries of a task come from a few classes of their own, so a query's nearest
neighbours among the task's queries share its open/closed status more often than not (the
cluster assumption of transductive learning). One step of label propagation (Zhou et al.,
"Learning with Local and Global Consistency", NIPS 2004) on the log-odds of P(open),

    ℓ'_q = (ℓ_q + (1/k) Σ_{j ∈ N_k(q)} ℓ_j) / 2,     ℓ_q = logit P(open | x_q),

with N_k(q) the k other queries nearest to q by cosine similarity in the task's own frame
(the queries re-centred on their mean and L2-normalised, as transductive few-shot methods
centre a task on its features; Boudiaf, Bennequin et al., "Model-Agnostic Few-Shot
Open-Set Recognition", 2022), lets each query's neighbours vote on its open/closed status
beside its own evidence. Shifting every ℓ_q by c shifts every ℓ'_q by c, so a bias of the
log-odds (and its correction, ``open_shift``) keeps its meaning. The known columns keep
their ratios (the known-class argmax).
"""

from __future__ import annotations

import torch

__all__ = ["neighbour_averaged_log_odds", "query_neighbours"]


def query_neighbours(query: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, Q, k]``: for every query of ``query`` [T, Q, D], the positions of the ``k``
    other queries of its task with the highest cosine similarity, the queries re-centred
    on their task's mean and L2-normalised (``k`` at most Q - 1)."""
    centred = query - query.mean(-2, keepdim=True)
    unit = torch.nn.functional.normalize(centred, dim=-1)
    similarity = unit @ unit.transpose(-1, -2)
    similarity.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))  # not its own neighbour
    return similarity.topk(k, dim=-1).indices


def neighbour_averaged_log_odds(
    log_odds: torch.Tensor, query: torch.Tensor, k: int
) -> torch.Tensor:
    """ℓ'_q = (ℓ_q + mean of ℓ over q's ``k`` nearest queries) / 2 (module docstring), for
    ``log_odds`` [T, Q] of the queries ``query`` [T, Q, D]; ``log_odds`` itself where a
    task has a single query or ``k`` is 0."""
    if log_odds.shape != query.shape[:-1]:
        raise ValueError(
            f"log_odds {tuple(log_odds.shape)} and query {tuple(query.shape)} disagree"
        )
    k = min(int(k), query.shape[-2] - 1)
    if k < 1:
        return log_odds
    index = query_neighbours(query.to(log_odds), k)  # [T, Q, k]
    q = log_odds.shape[-1]
    neighbours = torch.gather(log_odds.unsqueeze(-2).expand(*log_odds.shape[:-1], q, q), -1, index)
    return 0.5 * (log_odds + neighbours.mean(-1))
