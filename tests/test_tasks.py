import dataclasses

import numpy as np
import pytest
import torch

from probfsl.data import (
    FeatureSet,
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
    with pytest.raises(ValueError, match="'query' must hold row indices in 0..419"):
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


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(shot=0), ValueError, "shot must be at least 1, got 0"),
        (dict(way=1), ValueError, "way must be at least 2, got 1"),
        (dict(n_query=0), ValueError, "n_query must be at least 1, got 0"),
        (dict(n_tasks=0), ValueError, "n_tasks must be at least 1, got 0"),
        (dict(shot=1.5), ValueError, "shot must be a whole number"),
        (dict(way="5"), TypeError, "way must be an integer"),
        (dict(n_query=None), TypeError, "n_query must be an integer"),
        (dict(balance="dirichlet", alpha=-1.0), ValueError, "alpha must be positive"),
        (dict(balance="dirichlet", alpha=float("nan")), ValueError, "alpha must be finite"),
        (dict(seed=-1), ValueError, "seed must be at least 0"),
        (dict(balance=None), ValueError, "balance must be one of"),
    ],
)
def test_sampler_arguments_checked_before_sampling(synthetic, kwargs, error, message):
    args = dict(n_tasks=3, way=5, shot=1, n_query=15, balance="balanced")
    args.update(kwargs)
    with pytest.raises(error, match=message):
        sample_task_indices(synthetic, **args)
    with pytest.raises(error, match=message):
        sample_episodes(synthetic, **args)


def test_whole_number_float_counts_are_accepted(synthetic):
    a = sample_task_indices(synthetic, 3.0, way=5.0, shot=1.0, n_query=15.0, seed=0)
    b = sample_task_indices(synthetic, 3, way=5, shot=1, n_query=15, seed=0)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(n_tasks=0), ValueError, "n_tasks must be at least 1"),
        (dict(n_query=0), ValueError, "n_query must be at least 1"),
        (dict(min_classes=1), ValueError, "min_classes must be at least 2"),
        (dict(max_classes=2.5), ValueError, "max_classes must be a whole number"),
        (dict(n_query="40"), TypeError, "n_query must be an integer"),
    ],
)
def test_zero_shot_sampler_arguments(synthetic, kwargs, error, message):
    args = dict(n_tasks=2, min_classes=3, max_classes=6, n_query=40)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        sample_zero_shot_tasks(synthetic, **args)


def test_samplers_need_a_featureset_and_a_float_dtype(synthetic):
    with pytest.raises(TypeError, match="fs must be a FeatureSet, got dict"):
        sample_episodes({"features": synthetic.features}, 2)
    with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
        sample_episodes(synthetic, 2, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint16])
def test_task_indices_of_any_integer_width(synthetic, dtype):
    idx = sample_task_indices(synthetic, 4, way=3, shot=2, n_query=9, seed=1)
    narrow = {k: v.astype(dtype) for k, v in idx.items()}
    ep = episodes_from_indices(synthetic, narrow)
    ref = episodes_from_indices(synthetic, idx)
    assert torch.equal(ep.query, ref.query) and ep.support_index.dtype == torch.long
    assert torch.equal(ep.classes, ref.classes)


def test_classes_come_from_the_first_support_row_of_each_class(synthetic):
    """Without 'classes', a task file need not be shot-major."""
    idx = sample_task_indices(synthetic, 3, way=3, shot=2, n_query=9, seed=4)
    order = np.array([5, 0, 3, 1, 4, 2])  # labels become 2, 0, 0, 1, 1, 2
    shuffled = dict(idx, support=idx["support"][:, order])
    shuffled["support_labels"] = idx["support_labels"][:, order]
    del shuffled["classes"]
    ep = episodes_from_indices(synthetic, shuffled)
    assert torch.equal(ep.classes, torch.as_tensor(idx["classes"]))


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda i: dict(i, query=i["query"].astype(float)), TypeError, "'query' must hold integer"),
        (lambda i: dict(i, support=i["support"] - 1000), ValueError, "'support' must hold row"),
        (lambda i: dict(i, query=i["query"][0]), ValueError, "'query' must have 2 dimensions"),
        (lambda i: {k: v for k, v in i.items() if k != "query"}, ValueError, "missing field"),
        (lambda i: dict(i, support_labels=i["support_labels"] * 0), ValueError, "way=1"),
        (lambda i: dict(i, query_labels=i["query_labels"] + 5), ValueError, "'query_labels' must"),
        (lambda i: dict(i, query_labels=i["query_labels"][:, 1:]), ValueError, "shape of 'query'"),
        (lambda i: dict(i, classes=i["classes"][:, :2]), ValueError, "'classes' must be"),
        (lambda i: dict(i, query=i["query"][:2]), ValueError, "different numbers of tasks"),
        (lambda i: list(i.values()), TypeError, "task indices must be a dict"),
        (lambda i: {k: v[:0] for k, v in i.items()}, ValueError, "hold no tasks"),
        (
            lambda i: dict(i, support_labels=np.minimum(i["support_labels"], [[3], [1], [3]])),
            ValueError,
            "task 1 has no support sample of class 2",
        ),
    ],
)
def test_bad_task_indices(synthetic, change, error, message):
    idx = sample_task_indices(synthetic, 3, way=3, shot=2, n_query=9, seed=1)
    with pytest.raises(error, match=message):
        episodes_from_indices(synthetic, change(idx))


def test_task_files_are_written_atomically_and_read_as_int64(tmp_path, synthetic, monkeypatch):
    idx = sample_task_indices(synthetic, 3, way=3, shot=2, n_query=9, seed=1)
    path = save_task_file(tmp_path / "tasks", {k: v.astype(np.int16) for k, v in idx.items()})
    assert path.name == "tasks.npz"  # numpy's habit kept
    loaded = load_task_file(path)
    assert all(loaded[k].dtype == np.int64 and np.array_equal(loaded[k], idx[k]) for k in idx)
    # a failure while writing leaves the existing file as it was, and no temporary file
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        save_task_file(path, idx)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    # bad indices are refused before anything is written
    with pytest.raises(TypeError, match="'support' must hold integer"):
        save_task_file(tmp_path / "bad.npz", dict(idx, support=idx["support"] * 1.0))
    assert not (tmp_path / "bad.npz").exists()


def test_bad_task_files(tmp_path):
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04junk")
    for name in ("none.npz", "empty.npz", "junk.npz"):
        with pytest.raises(ValueError, match=f"{name}: not a readable task file"):
            load_task_file(tmp_path / name)
    np.savez(tmp_path / "partial.npz", support=np.zeros((1, 2), int))
    with pytest.raises(ValueError, match="no field 'support_labels'"):
        load_task_file(tmp_path / "partial.npz")
    z = np.zeros((1, 2))
    np.savez(tmp_path / "float.npz", support=z, support_labels=z, query=z, query_labels=z)
    for error in (TypeError, ValueError):  # both: every task-file problem is a ValueError
        with pytest.raises(error, match="float.npz: task file field 'support' must hold integ"):
            load_task_file(tmp_path / "float.npz")


# ---------------------------------------------------------------------- Episodes and FeatureSet
def test_episodes_accept_numpy_and_int32_labels(synthetic):
    ep = sample_episodes(synthetic, 2, way=3, shot=1, n_query=9, seed=0)
    as_numpy = {f.name: getattr(ep, f.name).numpy() for f in dataclasses.fields(ep)}
    as_numpy["support_labels"] = as_numpy["support_labels"].astype(np.int32)
    converted = type(ep)(**as_numpy)
    assert isinstance(converted.support, torch.Tensor)
    assert converted.support_labels.dtype == torch.long
    assert torch.equal(converted.query, ep.query)
    int32 = dataclasses.replace(ep, support_labels=ep.support_labels.int())
    assert int32.support_labels.dtype == torch.long


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda ep: dict(support=ep.support.double()), TypeError, "must have one dtype"),
        (lambda ep: dict(query=ep.query.half(), support=ep.support.half()), TypeError, "float16"),
        (lambda ep: dict(query=ep.query.tolist()), TypeError, "Episodes.query must be a torch"),
        (lambda ep: dict(support_labels=ep.support_labels.float()), TypeError, "integer tensor"),
        (lambda ep: dict(query=ep.query[0]), ValueError, r"Episodes.query must be \[T, n, D\]"),
        (lambda ep: dict(classes=ep.classes[0]), ValueError, r"classes must be \[T, way\]"),
    ],
)
def test_bad_episodes(synthetic, change, error, message):
    ep = sample_episodes(synthetic, 2, way=3, shot=1, n_query=9, seed=0)
    with pytest.raises(error, match=message):
        dataclasses.replace(ep, **change(ep))
    with pytest.raises(TypeError, match="dtype must be"):
        ep.to(dtype=torch.float16)
    with pytest.raises(IndexError, match="task 2 out of range"):
        ep[2]
    assert torch.equal(ep[-1].query, ep[1:].query)


def test_featureset_labels_are_never_truncated():
    fs = make_featureset(n_base=1, n_novel=2, per_class=4)
    with pytest.raises(ValueError, match="'labels' must hold whole-number class labels"):
        FeatureSet(fs.features, fs.labels + 0.5, fs.class_names, fs.split)
    with pytest.raises(TypeError, match="'labels' must hold integer class labels"):
        FeatureSet(fs.features, fs.labels.astype(str), fs.class_names, fs.split)
    whole = FeatureSet(fs.features, fs.labels.astype(float), fs.class_names, fs.split)
    assert whole.labels.dtype == np.int64 and np.array_equal(whole.labels, fs.labels)
    with pytest.raises(TypeError, match="'features' must be real numbers"):
        FeatureSet(fs.features.astype(str), fs.labels, fs.class_names, fs.split)
    with pytest.raises(ValueError, match="'features' is empty"):
        FeatureSet(fs.features[:, :0], fs.labels, fs.class_names, fs.split)
    with pytest.raises(TypeError, match="'split' must hold strings"):
        FeatureSet(fs.features, fs.labels, fs.class_names, fs.labels)
    with pytest.raises(TypeError, match="dtype must be"):
        fs.base(torch.int64)
