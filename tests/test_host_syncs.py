"""The host-synchronisation counter counts what it should."""

import pytest
import torch

from probfsl.host_syncs import SYNC_METHODS, HostSyncCounter


def test_counts_each_kind_of_host_copy():
    x = torch.arange(6.0)
    with HostSyncCounter() as counter:
        if x.sum() > 0:  # __bool__
            pass
        x[0].item()
        x.tolist()
        float(x[1])
        x.cpu()
        x.numpy()
        y = torch.exp(x) + 1  # torch calls, no sync
    assert counter.syncs["__bool__"] == 1
    assert counter.syncs["item"] == 1 and counter.syncs["tolist"] == 1
    assert counter.syncs["__float__"] == 1 and counter.syncs["cpu"] == 1
    assert counter.syncs["numpy"] == 1
    assert counter.total == 6 and set(counter.syncs) <= set(SYNC_METHODS)
    assert counter.torch_calls >= 3  # sum, exp, add (plus comparisons and indexing)
    assert torch.equal(y, torch.exp(x) + 1)


def test_counts_do_not_grow_with_the_number_of_tasks_for_nearest_centroid():
    from probfsl.data import load_dataset, sample_episodes
    from probfsl.models.nearest_centroid import NearestCentroid

    fs = load_dataset("omniglot")
    model = NearestCentroid().fit_featureset(fs)
    counts = []
    for n_tasks in (5, 50):
        episodes = sample_episodes(fs, n_tasks, seed=0)
        with HostSyncCounter() as counter:
            model.predict_proba(episodes)
        counts.append((counter.total, counter.torch_calls))
    assert counts[0] == counts[1]
    assert counts[0][0] <= 50


def test_the_background_predictive_makes_no_host_synchronisation():
    """The open-set building blocks (two-covariance reading, enumeration, the nested
    mixture's background responsibility) are torch calls only."""
    from probfsl.inference.background import (
        TwoCovarianceReading,
        attach_open,
        fit_background,
        open_posterior,
        open_responsibility,
    )

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(60, 8, generator=gen, dtype=torch.float64)
    base_labels = torch.arange(6).repeat_interleave(10)
    support = torch.randn(3, 6, 8, generator=gen, dtype=torch.float64)
    labels = torch.arange(3).repeat(2).expand(3, -1)
    query = torch.randn(3, 10, 8, generator=gen, dtype=torch.float64)
    stats = fit_background(base, base_labels)
    with HostSyncCounter() as counter:
        reading = TwoCovarianceReading(support, labels, query, 3, stats)
        class_ll, background_ll = reading.class_log_lik(), reading.background_log_lik()
        p_open = open_posterior(class_ll, background_ll, 0.5)[..., -1]
        odds = reading.open_log_odds(torch.softmax(class_ll, -1))
        o = open_responsibility(odds, p_open, 0.5)
        attach_open(torch.softmax(class_ll, -1), o)
    assert counter.total == 0, dict(counter.syncs)


@pytest.mark.parametrize(
    "name, short, long",
    [
        ("soft-kmeans", {"n_iter": 2}, {"n_iter": 6}),
        ("bavardage", {"n_km": 2, "n_vb": 2}, {"n_km": 6, "n_vb": 6}),
        ("vmp-gmm", {"n_kmeans": 2, "max_iter": 2}, {"n_kmeans": 6, "max_iter": 6}),
    ],
)
def test_open_set_iterations_make_no_host_synchronisation(name, short, long):
    """``predict_proba_open`` makes as many host synchronisations with 6 iterations of its
    mixture with the background as with 2: none inside the iterations.

    (bavardage-gamma is held to the per-call bound of tests/test_estimator_device.py only:
    each of its VMP blocks checks the new rows and the starting responsibilities on the
    host, as its closed-set path does.)"""
    from probfsl import make_estimator
    from probfsl.data import load_dataset, sample_episodes

    fs = load_dataset("omniglot")
    base = fs.base(torch.float32)
    episodes = sample_episodes(fs, 2, way=3, shot=2, n_query=9, seed=1, n_open=6)
    counts = []
    for params in (short, long):
        model = make_estimator(name, **params).fit_base(*base)
        model.predict_proba_open(episodes)  # one-time caches
        with HostSyncCounter() as counter:
            model.predict_proba_open(episodes)
        counts.append(counter.total)
    assert counts[0] == counts[1], f"{name}: {counts} host syncs with {short} and {long}"
