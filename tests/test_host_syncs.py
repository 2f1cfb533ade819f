"""The host-synchronisation counter counts what it should."""

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
