"""Unit tests of the shared input checks (probfsl.validation)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from probfsl.data import sample_episodes
from probfsl.validation import (
    as_float_tensor,
    as_index_array,
    as_label_array,
    as_label_tensor,
    check_base,
    check_choice,
    check_count,
    check_episodes,
    check_finite,
    check_flag,
    check_float_dtype,
    check_hyperparameter,
    check_task_tensors,
)


# ---------------------------------------------------------------------- float tensors
def test_as_float_tensor_keeps_valid_tensors_and_numpy_dtype():
    x = torch.randn(3, 2)
    assert as_float_tensor(x, "x") is x
    y = as_float_tensor(np.ones((2, 2)), "y", ndim=2)
    assert y.dtype == torch.float64  # float64 stays float64
    assert as_float_tensor(np.ones((2, 2), np.float32), "y").dtype == torch.float32


@pytest.mark.parametrize(
    "value, error, message",
    [
        (np.ones((2, 2), np.int64), TypeError, "x must hold floating-point"),
        (torch.ones(2, 2, dtype=torch.int32), TypeError, "x must be float32 or float64"),
        (torch.ones(2, 2, dtype=torch.float16), TypeError, "float16"),
        (torch.ones(2, 2, dtype=torch.bfloat16), TypeError, "bfloat16"),
        ([[1.0, 2.0]], TypeError, "x must be a torch.Tensor or numpy.ndarray, got list"),
        ("abc", TypeError, "got str"),
        (torch.ones(2), ValueError, "x must have 2 dimensions"),
        (torch.ones(0, 3), ValueError, "x is empty"),
        (torch.tensor([[1.0, math.nan]]), ValueError, "x contains NaN or inf"),
        (torch.tensor([[1.0, -math.inf]]), ValueError, "x contains NaN or inf"),
    ],
)
def test_as_float_tensor_rejects(value, error, message):
    with pytest.raises(error, match=message):
        as_float_tensor(value, "x", ndim=2)


def test_check_finite_accepts_finite_values_whose_sum_overflows():
    big = torch.full((4,), 3e38, dtype=torch.float32)
    assert not torch.isfinite(big.sum())
    check_finite(big, "big")  # every entry is finite
    big[2] = math.inf
    with pytest.raises(ValueError, match="big contains NaN or inf"):
        check_finite(big, "big")


def test_check_float_dtype():
    assert check_float_dtype("dtype", torch.float64) is torch.float64
    for bad in (torch.float16, torch.int64, "float32", np.float32):
        with pytest.raises(TypeError, match="dtype must be torch.float32 or torch.float64"):
            check_float_dtype("dtype", bad)


# ---------------------------------------------------------------------- labels
@pytest.mark.parametrize(
    "labels",
    [
        np.array([0, 1, 2], np.int16),
        np.array([0, 1, 2], np.uint8),
        np.array([0.0, 1.0, 2.0]),
        [0, 1, 2],
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([0.0, 1.0, 2.0]),
    ],
)
def test_labels_of_any_integer_width_or_whole_floats(labels):
    arr = as_label_array(labels, "y", n=3)
    assert arr.dtype == np.int64 and arr.tolist() == [0, 1, 2]
    t = as_label_tensor(labels, "y", n=3)
    assert t.dtype == torch.long and t.tolist() == [0, 1, 2]


@pytest.mark.parametrize("convert", [as_label_array, as_label_tensor])
@pytest.mark.parametrize(
    "labels, error, message",
    [
        (np.array([0.5, 1.5, 2.0]), ValueError, "y must hold whole-number class labels"),
        (torch.tensor([0.5, 1.0, 2.0]), ValueError, "whole-number"),
        (np.array([0.0, math.nan, 1.0]), ValueError, "y contains NaN or inf"),
        (np.array(["a", "b", "c"]), TypeError, "y must hold integer class labels"),
        (np.array([True, False, True]), TypeError, "integer class labels"),
        (torch.tensor([True, False, True]), TypeError, "integer class labels"),
        ({"a": 1}, TypeError, "got dict"),
        (np.arange(4), ValueError, "y must have 3 entries"),
    ],
)
def test_labels_rejected(convert, labels, error, message):
    with pytest.raises(error, match=message):
        convert(labels, "y", n=3)


def test_label_tensor_follows_device_argument():
    assert as_label_tensor(np.arange(3), "y", device=torch.device("cpu")).device.type == "cpu"


# ---------------------------------------------------------------------- indices
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint16, np.int64])
def test_index_arrays_of_any_integer_width_become_int64(dtype):
    idx = as_index_array(np.array([[0, 4], [2, 3]], dtype), "rows", n_rows=5, ndim=2)
    assert idx.dtype == np.int64 and idx.tolist() == [[0, 4], [2, 3]]
    assert as_index_array(torch.tensor([1, 2], dtype=torch.int32), "rows", 5).dtype == np.int64


@pytest.mark.parametrize(
    "value, error, message",
    [
        (np.array([[0.0, 1.0]]), TypeError, "rows must hold integer row indices"),
        (np.array([[True, False]]), TypeError, "integer row indices"),
        (np.array([["0", "1"]]), TypeError, "integer row indices"),
        ("0,1", TypeError, "rows must be an integer array"),
        (np.array([[0, 5]]), ValueError, r"rows must hold row indices in 0..4"),
        (np.array([[-1, 0]]), ValueError, r"in 0..4"),
        (np.array([0, 1]), ValueError, "rows must have 2 dimensions"),
        (np.zeros((2, 0), np.int64), ValueError, "rows is empty"),
    ],
)
def test_index_arrays_rejected(value, error, message):
    with pytest.raises(error, match=message):
        as_index_array(value, "rows", n_rows=5, ndim=2)


# ---------------------------------------------------------------------- hyperparameters
def test_check_hyperparameter_accepts_and_returns():
    assert check_hyperparameter("t", 2.5, positive=True) == 2.5
    assert check_hyperparameter("t", np.float32(0.5), positive=True) == 0.5
    n = check_hyperparameter("n", 5.0, integer=True, low=1)
    assert n == 5 and isinstance(n, int)
    assert isinstance(check_hyperparameter("n", np.int64(3), integer=True), int)
    assert check_hyperparameter("s", None, positive=True, optional=True) is None
    assert check_hyperparameter("p", 0.0, nonnegative=True) == 0.0
    assert check_hyperparameter("p", 1.0, low=0, high=1) == 1.0


@pytest.mark.parametrize(
    "value, kwargs, error, message",
    [
        ("abc", {}, TypeError, "temperature must be a real number, got 'abc'"),
        (None, {}, TypeError, "got None"),
        (True, {}, TypeError, "got True"),
        (torch.tensor(1.0), {}, TypeError, "Tensor"),
        (math.nan, {}, ValueError, "temperature must be finite, got nan"),
        (math.inf, {}, ValueError, "must be finite"),
        (-1.0, {"positive": True}, ValueError, "temperature must be positive, got -1.0"),
        (0.0, {"positive": True}, ValueError, "must be positive"),
        (-0.1, {"nonnegative": True}, ValueError, "must be non-negative"),
        (2.5, {"integer": True}, ValueError, "temperature must be a whole number, got 2.5"),
        ("3", {"integer": True}, TypeError, "temperature must be an integer"),
        (0, {"integer": True, "low": 1}, ValueError, "temperature must be at least 1, got 0"),
        (2.0, {"high": 1.0}, ValueError, "temperature must be at most 1.0"),
    ],
)
def test_check_hyperparameter_rejects(value, kwargs, error, message):
    with pytest.raises(error, match=message):
        check_hyperparameter("temperature", value, **kwargs)


def test_check_count_flag_and_choice():
    assert check_count("way", 5, low=2) == 5
    with pytest.raises(ValueError, match="way must be at least 2, got 1"):
        check_count("way", 1, low=2)
    with pytest.raises(ValueError, match="shot must be a whole number"):
        check_count("shot", 1.5)
    assert check_flag("center", np.bool_(True)) is True
    with pytest.raises(TypeError, match="center must be True or False, got 'no'"):
        check_flag("center", "no")
    assert check_choice("balance", "dirichlet", ("balanced", "dirichlet")) == "dirichlet"
    with pytest.raises(ValueError, match=r"balance must be one of \['balanced', 'dirichlet'\]"):
        check_choice("balance", "skewed", ("balanced", "dirichlet"))


# ---------------------------------------------------------------------- base features
def test_check_base_converts_numpy_and_labels():
    feats, labels = check_base(np.ones((4, 3), np.float32), np.array([0, 1, 0, 1], np.int32))
    assert isinstance(feats, torch.Tensor) and feats.dtype == torch.float32
    assert labels.dtype == torch.long
    x = torch.randn(4, 3, dtype=torch.float64)
    assert check_base(x, torch.tensor([0, 1, 0, 1]))[0] is x


@pytest.mark.parametrize(
    "features, labels, error, message",
    [
        (None, np.zeros(3, int), TypeError, "base features must be a tensor or array"),
        (np.ones((3, 2), int), np.zeros(3, int), TypeError, "base features must hold floating"),
        (np.ones(3), np.zeros(3, int), ValueError, "base features must have 2 dimensions"),
        (np.ones((3, 2)), np.zeros(4, int), ValueError, "base labels must have 3 entries"),
        (np.ones((3, 2)), np.array(["a", "b", "c"]), TypeError, "base labels must hold integer"),
        (np.ones((3, 2)), np.array([0.5, 1.0, 1.0]), ValueError, "base labels must hold whole"),
        (np.full((3, 2), np.nan), np.zeros(3, int), ValueError, "base features contains NaN"),
        (np.ones((3, 2)), np.zeros(3, int), ValueError, "at least 2 classes, got 1"),
    ],
)
def test_check_base_rejects(features, labels, error, message):
    with pytest.raises(error, match=message):
        check_base(features, labels, min_classes=2)


# ---------------------------------------------------------------------- task tensors
def _task(t=2, way=3, shot=2, q=6, d=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    support = torch.randn(t, way * shot, d, generator=g, dtype=dtype)
    labels = torch.arange(way).repeat(shot).expand(t, -1)
    query = torch.randn(t, q, d, generator=g, dtype=dtype)
    return support, labels, query, way


def test_check_task_tensors_accepts_a_consistent_batch():
    check_task_tensors(*_task())
    check_task_tensors(*_task(dtype=torch.float64))
    s, y, q, way = _task()
    check_task_tensors(s[:, :0], y[:, :0], q, way, partial_support=True)  # zero-shot


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda s, y, q, w: (s.numpy(), y, q, w), TypeError, "support must be a torch.Tensor"),
        (lambda s, y, q, w: (s, y.tolist(), q, w), TypeError, "support_labels must be a torch"),
        (lambda s, y, q, w: (s.half(), y, q, w), TypeError, "support must be float32"),
        (lambda s, y, q, w: (s.double(), y, q, w), TypeError, "differ in dtype"),
        (lambda s, y, q, w: (s, y, q[0], w), ValueError, r"query must be \[T, n, D\]"),
        (lambda s, y, q, w: (s, y, q[..., :3], w), ValueError, "disagree in tasks or width"),
        (lambda s, y, q, w: (s, y, q[:1], w), ValueError, "disagree"),
        (lambda s, y, q, w: (s, y, q[:, :0], w), ValueError, "query is empty"),
        (lambda s, y, q, w: (s[:, :0], y[:, :0], q, w), ValueError, "support is empty"),
        (lambda s, y, q, w: (s, y[:, :-1], q, w), ValueError, "support_labels must be"),
        (lambda s, y, q, w: (s, y.float(), q, w), TypeError, "support_labels must be an integer"),
        (lambda s, y, q, w: (s, y, q, 1), ValueError, "at least 2 classes"),
        (lambda s, y, q, w: (s, y + 1, q, w), ValueError, r"support_labels must lie in 0..2"),
        (lambda s, y, q, w: (s, y % 2, q, w), ValueError, "task 0 has none for class 2"),
        (lambda s, y, q, w: (s * math.nan, y, q, w), ValueError, "support contains NaN"),
        (lambda s, y, q, w: (s, y, q / 0.0, w), ValueError, "query contains NaN or inf"),
    ],
)
def test_check_task_tensors_rejects(change, error, message):
    with pytest.raises(error, match=message):
        check_task_tensors(*change(*_task()))


def test_check_episodes_names_the_base_width(synthetic):
    ep = sample_episodes(synthetic, 2, way=3, shot=1, n_query=9, seed=0)
    check_episodes(ep, dim=5)
    with pytest.raises(ValueError, match="feature width 5 but the base features have width 7"):
        check_episodes(ep, dim=7)
    with pytest.raises(TypeError, match="episodes must be an Episodes batch, got dict"):
        check_episodes({"support": ep.support})


def test_the_one_task_api_takes_what_a_user_has():
    from probfsl import make_estimator
    from probfsl.data import load_dataset
    from probfsl.validation import as_user_array

    fs = load_dataset("omniglot")
    novel = fs.rows("novel")
    classes = np.unique(fs.labels[novel])[:3]
    rows = [novel[fs.labels[novel] == c] for c in classes]
    support = np.concatenate([fs.features[r[:2]] for r in rows])
    query = np.concatenate([fs.features[r[2:6]] for r in rows])
    labels = np.repeat(classes, 2)
    model = make_estimator("nearest-centroid").fit_featureset(fs)
    expected = model.fit_predict(support, labels, query)
    assert isinstance(expected, np.ndarray) and set(expected) <= set(classes)
    # float16 (how the data are stored), integers and bools: float32, same answer
    half = model.fit_predict(support.astype(np.float16), labels, query.astype(np.float16))
    assert np.array_equal(
        half,
        model.fit_predict(
            support.astype(np.float16).astype(np.float32),
            labels,
            query.astype(np.float16).astype(np.float32),
        ),
    )
    assert as_user_array(np.ones((2, 3), np.int64), "x").dtype == np.float32
    assert as_user_array(np.full((2, 3), 2**30, np.int64), "x").dtype == np.float64
    assert as_user_array(np.ones((2, 3), bool), "x").dtype == np.float32
    assert as_user_array(np.ones(3, np.int64), "y", features=False).dtype == np.int64
    # the engines keep their strict contract
    tasks = sample_episodes(fs, 2, 5, 1, 10)
    with pytest.raises(TypeError, match="float16"):
        model.predict_proba(dataclasses.replace(tasks, support=tasks.support.half()))
    pd = pytest.importorskip("pandas")
    frame = model.fit_predict(pd.DataFrame(support), pd.Series(labels), pd.DataFrame(query))
    assert isinstance(frame, np.ndarray) and np.array_equal(frame, expected)
    column = model.fit_predict(
        pd.DataFrame({"x": list(support)}), labels, pd.DataFrame({"x": list(query)})
    )
    assert np.array_equal(column, expected)


def test_fit_predict_reports_the_label_shape_it_was_given():
    from probfsl import make_estimator

    support = np.random.default_rng(0).random((10, 4)).astype(np.float32)
    labels = np.repeat(np.arange(5), 2)
    model = make_estimator("nearest-centroid", center=False)
    with pytest.raises(ValueError, match=r"must be \[10\].*got shape \(10, 1\)"):
        model.fit_predict(support, labels[:, None], support[:3])
