import dataclasses

import numpy as np
import pytest
import torch

from probfsl.data import (
    episodes_from_indices,
    load_task_file,
    sample_episodes,
    sample_task_indices,
    sample_zero_shot_tasks,
    save_task_file,
)
from probfsl.data.tasks import dirichlet_query_counts
from tests.conftest import make_featureset


@pytest.mark.parametrize("balance", ["balanced", "dirichlet"])
def test_shapes_layout_and_novel_only(synthetic, balance):
    ep = sample_episodes(synthetic, 7, way=4, shot=3, n_query=20, balance=balance, seed=1)
    assert ep.support.shape == (7, 12, 5) and ep.query.shape == (7, 20, 5)
    assert ep.way == 4 and ep.shot == 3 and ep.n_query == 20 and len(ep) == 7
    # shot-major support labels
    assert torch.equal(ep.support_labels[0], torch.arange(4).repeat(3))
    labels = torch.as_tensor(synthetic.labels)
    for t in range(7):
        assert torch.equal(labels[ep.support_index[t]], ep.classes[t][ep.support_labels[t]])
        assert torch.equal(labels[ep.query_index[t]], ep.classes[t][ep.query_labels[t]])
        rows = torch.cat([ep.support_index[t], ep.query_index[t]])
        assert rows.unique().numel() == rows.numel(), "support and queries overlap"
        assert set(ep.classes[t].tolist()) <= set(synthetic.classes_in("novel").tolist())
        assert ep.classes[t].unique().numel() == 4
    feats = torch.as_tensor(synthetic.features)
    assert torch.equal(ep.query, feats[ep.query_index])


def test_balanced_counts(synthetic):
    ep = sample_episodes(synthetic, 5, way=5, shot=1, n_query=75, seed=0)
    counts = torch.stack([(ep.query_labels == k).sum(1) for k in range(5)], 1)
    assert (counts == 15).all()


def test_same_seed_same_tasks_and_prefix_property(synthetic):
    a = sample_episodes(synthetic, 10, balance="dirichlet", seed=3)
    b = sample_episodes(synthetic, 4, balance="dirichlet", seed=3)
    c = sample_episodes(synthetic, 3, balance="dirichlet", seed=3, start=7)
    assert torch.equal(a.query_index[:4], b.query_index)
    assert torch.equal(a.query_index[7:], c.query_index)
    d = sample_episodes(synthetic, 10, balance="dirichlet", seed=4)
    assert not torch.equal(a.query_index, d.query_index)


def test_dirichlet_counts_follow_dirichlet_two():
    """Uncapped counts/Q have the moments of Dirichlet(2 * 1_5): mean 1/5, var 0.16/11."""
    fs = make_featureset(n_base=1, n_novel=5, per_class=200)
    ep = sample_episodes(fs, 4000, way=5, shot=1, n_query=75, balance="dirichlet", seed=0)
    counts = torch.stack([(ep.query_labels == k).sum(1) for k in range(5)], 1)
    assert (counts.sum(1) == 75).all()
    frac = counts.double() / 75
    np.testing.assert_allclose(frac.mean(0).numpy(), 0.2, atol=0.01)
    var_expected = 0.2 * 0.8 / (5 * 2 + 1) + 1 / (12 * 75**2)  # + rounding noise
    np.testing.assert_allclose(frac.var(0).numpy(), var_expected, rtol=0.1)
    # alpha = 20 gives much less imbalance than alpha = 2
    ep20 = sample_episodes(fs, 500, n_query=75, balance="dirichlet", alpha=20, seed=0)
    frac20 = torch.stack([(ep20.query_labels == k).sum(1) for k in range(5)], 1).double() / 75
    assert frac20.var(0).mean() < frac.var(0).mean() / 5


def test_dirichlet_rounding_and_capping_rules():
    rng = np.random.default_rng(0)
    for _ in range(500):
        room = rng.integers(5, 40, size=5)
        if room.sum() < 75:  # the sampler redraws such tasks
            continue
        counts = dirichlet_query_counts(rng, 5, 75, 2.0, room)
        assert counts.sum() == 75 and (counts <= room).all() and (counts >= 0).all()
    # without capping, counts are within one of the target Q p
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    counts = dirichlet_query_counts(rng_a, 5, 75, 2.0, np.full(5, 1000))
    target = 75 * rng_b.dirichlet(np.full(5, 2.0))
    assert np.abs(counts - target).max() < 1


def test_capping_moves_surplus_to_the_class_furthest_below_target():
    class FixedRng:
        def dirichlet(self, alpha):
            return np.array([0.8, 0.15, 0.05])

    counts = dirichlet_query_counts(FixedRng(), 3, 20, 2.0, np.array([10, 10, 10]))
    # targets 16, 3, 1 -> capped 10; surplus 6 goes to the class furthest below target
    assert counts.tolist() == [10, 6, 4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(way=9), "only 8 novel classes"),
        (dict(shot=25, n_query=30, way=5), "need 31 samples per class"),
        (dict(n_query=74), "divisible by way"),
        (dict(way=1), "at least 2"),
        (dict(shot=0), "at least 1"),
        (dict(balance="skewed"), "balance must be one of"),
        (dict(balance="dirichlet", alpha=0), "alpha must be positive"),
        (dict(balance="dirichlet", shot=30), "need more than 30 samples"),
        (dict(balance="dirichlet", shot=20, n_query=75), "cannot be drawn"),
    ],
)
def test_impossible_tasks_name_the_numbers(synthetic, kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_task_indices(synthetic, 3, **kwargs)


def test_task_file_roundtrip(tmp_path, synthetic):
    idx = sample_task_indices(synthetic, 6, way=3, shot=2, n_query=9, seed=2)
    save_task_file(tmp_path / "tasks.npz", idx)
    ep = episodes_from_indices(synthetic, load_task_file(tmp_path / "tasks.npz"))
    ref = sample_episodes(synthetic, 6, way=3, shot=2, n_query=9, seed=2)
    assert torch.equal(ep.query, ref.query) and torch.equal(ep.classes, ref.classes)
    bad = dict(idx, query=idx["query"] + 10_000)
    with pytest.raises(ValueError, match="'query' must be"):
        episodes_from_indices(synthetic, bad)


def test_episode_slicing_and_casting(synthetic):
    ep = sample_episodes(synthetic, 5, seed=0)
    one = ep[2]
    assert len(one) == 1 and torch.equal(one.query[0], ep.query[2])
    assert ep.to(dtype=torch.float64).query.dtype == torch.float64
    assert ep.to(dtype=torch.float64).query_labels.dtype == torch.long


def test_zero_shot_tasks(synthetic):
    zs = sample_zero_shot_tasks(synthetic, 50, min_classes=3, max_classes=6, n_query=40, seed=0)
    assert zs.query_index.shape == (50, 40) and zs.classes.shape == (50, 6)
    assert set(zs.n_classes.tolist()) <= set(range(3, 7)) and len(set(zs.n_classes.tolist())) > 1
    for t in range(50):
        present = zs.classes[t][: zs.n_classes[t]]
        assert (zs.classes[t][zs.n_classes[t] :] == -1).all()
        assert set(zs.query_labels[t].tolist()) <= set(present.tolist())
        assert zs.query_index[t].unique().numel() == 40
    with pytest.raises(ValueError, match="min_classes"):
        sample_zero_shot_tasks(synthetic, 2, min_classes=3, max_classes=99)


def test_points_is_a_view_of_one_buffer_and_survives_slicing_and_casting(synthetic):
    ep = sample_episodes(synthetic, 6, way=3, shot=2, n_query=9, seed=1)
    for batch in (ep, ep[2:5], ep[4], ep.to(dtype=torch.float64)):
        points = batch.points()
        assert points.data_ptr() == batch.support.data_ptr()  # no copy
        assert torch.equal(points, torch.cat([batch.support, batch.query], 1))
    # support and query from separate buffers: a concatenated copy, same values
    apart = dataclasses.replace(ep, support=ep.support.clone(), query=ep.query.clone())
    assert apart.points().data_ptr() != apart.support.data_ptr()
    assert torch.equal(apart.points(), ep.points())
