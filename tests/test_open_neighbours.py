"""P(open) averaged over each query's nearest queries (``open_neighbours``,
:mod:`probfsl.inference.open_neighbours`): the formula against a loop over queries, its
invariances, batching and dtypes, and its place in the transductive methods."""

from __future__ import annotations

import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.evaluation.open_set import auroc
from probfsl.inference.open_neighbours import neighbour_averaged_log_odds, query_neighbours
from probfsl.inference.vb_mixture_open import open_log_odds_of, with_open_log_odds
from probfsl.methods import build_estimator

TRANSDUCTIVE = ("soft-kmeans", "bavardage", "vmp-gmm", "bavardage-gamma")


def _tasks(tasks=3, queries=12, dim=6, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(tasks, queries, dim, generator=gen, dtype=dtype)
    odds = 3 * torch.randn(tasks, queries, generator=gen, dtype=dtype)
    return odds, query


def _by_loops(odds: torch.Tensor, query: torch.Tensor, k: int) -> torch.Tensor:
    """The module docstring's ℓ'_q, one task and one query at a time."""
    out = torch.empty_like(odds)
    for t in range(odds.shape[0]):
        x = query[t] - query[t].mean(0)
        for q in range(odds.shape[1]):
            cosine = [
                float(x[q] @ x[j] / (x[q].norm() * x[j].norm())) if j != q else -2.0
                for j in range(odds.shape[1])
            ]
            nearest = sorted(range(odds.shape[1]), key=lambda j: -cosine[j])[:k]
            out[t, q] = 0.5 * (odds[t, q] + odds[t, nearest].mean())
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_average_is_the_formula_computed_query_by_query(k):
    odds, query = _tasks()
    torch.testing.assert_close(
        neighbour_averaged_log_odds(odds, query, k), _by_loops(odds, query, k)
    )


def test_neighbours_exclude_the_query_itself_and_k_is_capped_by_the_others():
    odds, query = _tasks(queries=4)
    index = query_neighbours(query, 3)
    assert not (index == torch.arange(4).view(1, 4, 1)).any()
    # k of Q - 1 or more: every other query of the task
    others = (odds.sum(-1, keepdim=True) - odds) / 3
    for k in (3, 10):
        torch.testing.assert_close(
            neighbour_averaged_log_odds(odds, query, k), 0.5 * (odds + others)
        )
    single = _tasks(queries=1)
    assert neighbour_averaged_log_odds(*single, 5) is single[0]  # no other query


def test_a_common_shift_of_the_log_odds_shifts_the_average_alike():
    """A bias of the log-odds (and ``open_shift``, which corrects it) keeps its meaning."""
    odds, query = _tasks()
    base = neighbour_averaged_log_odds(odds, query, 5)
    torch.testing.assert_close(neighbour_averaged_log_odds(odds + 1.7, query, 5), base + 1.7)
    # the frame: the queries' own mean and scale do not matter
    torch.testing.assert_close(neighbour_averaged_log_odds(odds, 4 * query + 9, 5), base)


def test_batched_tasks_are_the_tasks_one_at_a_time_and_float32_follows_float64():
    odds, query = _tasks(tasks=5)
    batched = neighbour_averaged_log_odds(odds, query, 4)
    for t in range(5):
        alone = neighbour_averaged_log_odds(odds[t : t + 1], query[t : t + 1], 4)
        torch.testing.assert_close(batched[t : t + 1], alone)
    single = neighbour_averaged_log_odds(odds.float(), query.float(), 4)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), batched, rtol=1e-5, atol=1e-5)


def test_the_device_and_dtype_follow_the_log_odds():
    odds, query = _tasks()
    meta = neighbour_averaged_log_odds(odds.to("meta"), query.to("meta"), 5)
    assert meta.device.type == "meta" and meta.shape == odds.shape
    mixed = neighbour_averaged_log_odds(odds.float(), query, 5)  # float64 rows, float32 odds
    assert mixed.dtype == torch.float32


def _averaged_open(proba: torch.Tensor, query: torch.Tensor, k: int) -> torch.Tensor:
    """``proba`` with its last column's log-odds averaged (the methods' ``tempered_open`` at
    a = 1, b = 0)."""
    return with_open_log_odds(proba, neighbour_averaged_log_odds(open_log_odds_of(proba), query, k))


def test_the_average_makes_no_host_synchronisation():
    """Torch calls only: the neighbours, the gather and the known columns' rescaling."""
    from probfsl.host_syncs import HostSyncCounter

    odds, query = _tasks()
    proba = torch.softmax(torch.cat([odds.unsqueeze(-1), query[..., :3]], -1), -1)
    with HostSyncCounter() as counter:
        _averaged_open(proba, query, 5)
    assert counter.total == 0, dict(counter.syncs)


def test_bad_shapes_are_refused():
    odds, query = _tasks()
    with pytest.raises(ValueError, match="disagree"):
        neighbour_averaged_log_odds(odds[:, :-1], query, 5)


def test_the_known_columns_keep_their_ratios_and_rows_sum_to_one():
    gen = torch.Generator().manual_seed(1)
    proba = torch.softmax(torch.randn(3, 12, 5, generator=gen, dtype=torch.float64), -1)
    _, query = _tasks()
    torch.testing.assert_close(_averaged_open(proba, query, 0), proba)
    got = _averaged_open(proba, query, 5)
    torch.testing.assert_close(got.sum(-1), torch.ones(3, 12, dtype=torch.float64))
    torch.testing.assert_close(
        got[..., :-1] / got[..., :-1].sum(-1, keepdim=True),
        proba[..., :-1] / proba[..., :-1].sum(-1, keepdim=True),
    )
    logit = proba[..., -1].log() - proba[..., :-1].sum(-1).log()
    want = torch.sigmoid(neighbour_averaged_log_odds(logit, query, 5))
    torch.testing.assert_close(got[..., -1], want)


def test_clustered_open_queries_are_ranked_better_after_the_average():
    """The cluster assumption: where the open queries form classes of their own, averaging
    noisy log-odds over a query's nearest queries ranks them better (AUROC)."""
    gen = torch.Generator().manual_seed(5)
    tasks, per_class, dim = 40, 8, 16
    centres = 3 * torch.randn(tasks, 10, dim, generator=gen, dtype=torch.float64)
    label = torch.arange(10).repeat_interleave(per_class)  # classes 5..9 are open
    query = centres[:, label] + torch.randn(tasks, 10 * per_class, dim, generator=gen).double()
    is_open = (label >= 5).expand(tasks, -1)
    odds = 1.0 * is_open + 2 * torch.randn(is_open.shape, generator=gen, dtype=torch.float64)
    before = auroc(odds, is_open).mean()
    after = auroc(neighbour_averaged_log_odds(odds, query, 5), is_open).mean()
    assert before < 0.7 and after > before + 0.1


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


@pytest.mark.parametrize("method", TRANSDUCTIVE)
def test_the_methods_average_before_the_calibration_and_keep_their_argmax(omniglot, method):
    """Each transductive method's last column is its inferred P(open) averaged over the
    ``open_neighbours`` nearest queries, then scaled and shifted; the known-class argmax
    is that without the average."""
    from probfsl.inference.vb_mixture_open import temper_open

    episodes = sample_episodes(omniglot, 3, 3, 2, 9, seed=3, n_open=9).to(dtype=torch.float64)
    est = build_estimator(method, open_neighbours=0).fit_featureset(omniglot, torch.float64)
    a, b = est.open_calibration()
    if method == "bavardage-gamma":
        est.open_scale, est.open_shift = 1.0, 0.0  # its class attributes: as inferred
    else:
        est.set_params(open_scale=1.0, open_shift=0.0)
    inferred = est.predict_proba_open(episodes)
    est.set_params(open_neighbours=5)
    averaged = est.predict_proba_open(episodes)
    torch.testing.assert_close(averaged, _averaged_open(inferred, episodes.query, 5))
    if method == "bavardage-gamma":
        est.open_scale = est.open_shift = None
    else:
        est.set_params(open_scale=None, open_shift=None)
    calibrated = est.predict_proba_open(episodes)
    torch.testing.assert_close(calibrated, temper_open(averaged, a, b))
    assert torch.equal(calibrated[..., :-1].argmax(-1), inferred[..., :-1].argmax(-1))


@pytest.mark.parametrize("method", TRANSDUCTIVE)
def test_the_average_adds_no_host_synchronisation_to_the_methods(omniglot, method):
    from probfsl.host_syncs import HostSyncCounter

    episodes = sample_episodes(omniglot, 2, 3, 2, 9, seed=1, n_open=6)
    counts = []
    for k in (0, 5):
        est = build_estimator(method, open_neighbours=k).fit_featureset(omniglot)
        est.predict_proba_open(episodes)  # one-time caches
        with HostSyncCounter() as counter:
            est.predict_proba_open(episodes)
        counts.append(counter.total)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("value", [-1, 2.5, True, "5"])
def test_a_bad_number_of_neighbours_is_a_clear_error(value):
    with pytest.raises((TypeError, ValueError), match="open_neighbours"):
        build_estimator("soft-kmeans", open_neighbours=value)._check_params()
