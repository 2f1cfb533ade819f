"""The bad-input battery through the Python API.

Three parts, so that no fix can regress:

1. bad input, for every registered method (``probfsl.methods.METHODS`` built with
   ``make_estimator``): each case must raise ``ValueError`` (``TypeError`` for a wrong
   type) whose message names the argument, before any computation;
2. degenerate but valid tasks (identical points, D = 1, huge and tiny scales, 1-shot,
   2-way, many-way, one query, float64), for every method: finite probabilities whose
   rows sum to one, no exception;
3. random tasks (100,000 by default, ``PROBFSL_BATTERY_TASKS`` to change) over the fast
   methods with those degenerate shapes mixed in: no NaN, rows summing to one.

The command-line cases are in ``tests/test_cli.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from probfsl import make_estimator
from probfsl.data import (
    Episodes,
    FeatureSet,
    episodes_from_indices,
    load_task_file,
    sample_episodes,
    sample_task_indices,
    sample_zero_shot_tasks,
    save_task_file,
)
from probfsl.methods import METHODS
from tests.synthetic import episodes_from_tensors, gaussian_base

ALL = list(METHODS)
#: settings that keep the slow samplers to a fraction of a second per call; validation
#: does not depend on them
QUICK = {
    "gp-tree": dict(n_chains=2, n_sweeps=2),
    "em-dirichlet": dict(n_iter=5, mm_max_iter=20, mm_check_every=1),
}
#: methods whose output is a Monte Carlo estimate (float32 and float64 draw differently)
STOCHASTIC = ("gp-tree",)


def cases(methods, names):
    """pytest params for every (method, case) pair."""
    return [pytest.param(m, c, id=f"{m}-{c}") for m in methods for c in names]


# ---------------------------------------------------------------------- data
def base_data(dim: int):
    """Base features [200, dim] (float32): 8 classes of 25 points."""
    return gaussian_base(dim, n_classes=8, per_class=25)


KINDS = ("normal", "identical", "huge", "tiny", "zeros", "duplicate")


def make_tasks(
    n_tasks: int,
    way: int = 5,
    shot: int = 1,
    n_query: int = 10,
    dim: int = 8,
    dtype: torch.dtype = torch.float32,
    kinds: np.ndarray | str = "normal",
    seed: int = 0,
) -> Episodes:
    """Gaussian tasks (shot-major support); ``kinds`` makes task t degenerate:

    ``identical`` every point the same vector, ``zeros`` every point zero, ``huge`` /
    ``tiny`` the whole task scaled by 1e15 / 1e-15, ``duplicate`` each support point
    repeated in the query and the first two classes sharing one support point.
    """
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    n = way * shot
    means = 3 * torch.randn(n_tasks, way, dim, generator=g, dtype=f64)
    s_lab = torch.arange(way).repeat(shot).expand(n_tasks, n)
    q_lab = torch.randint(0, way, (n_tasks, n_query), generator=g)
    support = means.gather(1, s_lab[..., None].expand(-1, -1, dim))
    support = support + torch.randn(n_tasks, n, dim, generator=g, dtype=f64)
    query = means.gather(1, q_lab[..., None].expand(-1, -1, dim))
    query = query + torch.randn(n_tasks, n_query, dim, generator=g, dtype=f64)
    kinds = np.broadcast_to(np.asarray(kinds), (n_tasks,))
    for kind in set(kinds.tolist()) - {"normal"}:
        t = torch.as_tensor(np.flatnonzero(kinds == kind))
        if kind == "identical":
            point = torch.randn(t.numel(), 1, dim, generator=g, dtype=f64)
            support[t], query[t] = point.expand(-1, n, -1), point.expand(-1, n_query, -1)
        elif kind == "zeros":
            support[t], query[t] = 0.0, 0.0
        elif kind in ("huge", "tiny"):
            scale = 1e15 if kind == "huge" else 1e-15
            support[t], query[t] = support[t] * scale, query[t] * scale
        elif kind == "duplicate":
            support[t, 1] = support[t, 0]
            m = min(n, n_query)
            query[t, :m] = support[t, :m]
    return episodes_from_tensors(
        support.to(dtype), s_lab, query.to(dtype), way=way, query_labels=q_lab
    )


def fitted(method: str, dim: int = 8, **params):
    """``make_estimator(method)`` with the quick settings, fitted on base data ``dim`` wide."""
    est = make_estimator(method, **{**QUICK.get(method, {}), **params})
    return est.fit_base(*base_data(dim))


def assert_probabilities(proba: torch.Tensor, ep: Episodes, what: str = "") -> None:
    """Finite ``[T, Q, K]`` probabilities in the episodes' dtype whose rows sum to one."""
    assert proba.shape == (ep.n_tasks, ep.n_query, ep.way), what
    assert proba.dtype == ep.support.dtype, what
    bad = ~torch.isfinite(proba).all(-1).all(-1)
    assert not bad.any(), f"{what}: non-finite probabilities in tasks {bad.nonzero()[:5].ravel()}"
    assert (proba >= 0).all(), what
    err = (proba.double().sum(-1) - 1).abs().amax(-1)
    assert (err < 1e-4).all(), f"{what}: rows sum to 1 +- {err.max():.2e}"


@pytest.fixture(scope="module")
def estimators():
    """One fitted estimator per method (8-wide base features), shared by the cases."""
    return {m: fitted(m) for m in ALL}


# ---------------------------------------------------------------------- 1. bad episodes
def _nan(x: torch.Tensor, value: float = math.nan) -> torch.Tensor:
    x = x.clone()
    x[-1, -1, -1] = value
    return x


def _without_last_class(ep: Episodes) -> Episodes:
    labels = ep.support_labels.clone()
    labels[labels == ep.way - 1] = 0
    return dataclasses.replace(ep, support_labels=labels)


def _one_way(ep: Episodes) -> Episodes:
    keep = ep.support_labels[0] == 0
    return dataclasses.replace(
        ep,
        support=ep.support[:, keep],
        support_labels=ep.support_labels[:, keep],
        support_index=ep.support_index[:, keep],
        query_labels=torch.zeros_like(ep.query_labels),
        classes=ep.classes[:, :1],
    )


def _no_support(ep: Episodes) -> Episodes:
    return dataclasses.replace(
        ep,
        support=ep.support[:, :0],
        support_labels=ep.support_labels[:, :0],
        support_index=ep.support_index[:, :0],
    )


def _no_query(ep: Episodes) -> Episodes:
    return dataclasses.replace(
        ep,
        query=ep.query[:, :0],
        query_labels=ep.query_labels[:, :0],
        query_index=ep.query_index[:, :0],
    )


BAD_EPISODES = {
    # name: (make the bad batch from a good one, error, message pattern)
    "nan-support": (
        lambda ep: dataclasses.replace(ep, support=_nan(ep.support)),
        ValueError,
        "support contains NaN or inf",
    ),
    "inf-query": (
        lambda ep: dataclasses.replace(ep, query=_nan(ep.query, math.inf)),
        ValueError,
        "query contains NaN or inf",
    ),
    "empty-query": (_no_query, ValueError, "query is empty"),
    "shot-0": (_no_support, ValueError, "support is empty"),
    "way-1": (_one_way, ValueError, r"at least 2 classes \(way >= 2\)"),
    "class-without-support": (
        _without_last_class,
        ValueError,
        "every class needs at least one support sample",
    ),
    "labels-out-of-range": (
        lambda ep: dataclasses.replace(ep, support_labels=ep.support_labels + ep.way),
        ValueError,
        "support_labels must lie in",
    ),
    "support-query-width": (
        lambda ep: dataclasses.replace(ep, query=ep.query[..., :-1]),
        ValueError,
        "support .* and query .* disagree in tasks or width",
    ),
    "base-width": (
        lambda ep: dataclasses.replace(
            ep,
            support=torch.cat([ep.support, ep.support[..., :1]], -1),
            query=torch.cat([ep.query, ep.query[..., :1]], -1),
        ),
        ValueError,
        "feature width 9 but the base features have width 8",
    ),
    "float64-support-float32-query": (
        lambda ep: dataclasses.replace(ep, support=ep.support.double()),
        TypeError,
        r"Episodes.support \(torch.float64\) and Episodes.query \(torch.float32\)",
    ),
    "float16": (
        lambda ep: dataclasses.replace(ep, support=ep.support.half(), query=ep.query.half()),
        TypeError,
        "Episodes.support must be float32 or float64, got torch.float16",
    ),
    "integer-features": (
        lambda ep: dataclasses.replace(ep, support=ep.support.long(), query=ep.query.long()),
        TypeError,
        "Episodes.support must be float32 or float64, got torch.int64",
    ),
    "float-labels": (
        lambda ep: dataclasses.replace(ep, support_labels=ep.support_labels.float()),
        TypeError,
        "Episodes.support_labels must be an integer tensor",
    ),
    "list-query": (
        lambda ep: dataclasses.replace(ep, query=ep.query.tolist()),
        TypeError,
        "Episodes.query must be a torch.Tensor or numpy.ndarray, got list",
    ),
    "not-episodes": (
        lambda ep: {"support": ep.support, "query": ep.query},
        TypeError,
        "episodes must be an Episodes batch, got dict",
    ),
}


@pytest.mark.parametrize("method, case", cases(ALL, BAD_EPISODES))
def test_bad_episodes_are_refused_with_a_named_error(estimators, method, case):
    make_bad, error, message = BAD_EPISODES[case]
    ep = make_tasks(3, way=4, shot=2, n_query=6, dim=8)
    with pytest.raises(error, match=message):
        estimators[method].predict_proba(make_bad(ep))


VALID_VARIANTS = {
    # numpy arrays in Episodes are converted to tensors (no copy)
    "numpy-episodes": lambda ep: Episodes(
        **{f.name: getattr(ep, f.name).numpy() for f in dataclasses.fields(ep)}
    ),
    "int32-labels": lambda ep: dataclasses.replace(
        ep, support_labels=ep.support_labels.int(), classes=ep.classes.int()
    ),
    "float64": lambda ep: ep.to(dtype=torch.float64),
}  # int16/int32 task files: test_task_files_of_narrow_integers


@pytest.mark.parametrize("method, case", cases(ALL, VALID_VARIANTS))
def test_accepted_variants_give_the_same_probabilities(estimators, method, case):
    ep = make_tasks(3, way=4, shot=2, n_query=6, dim=8)
    est = estimators[method]
    ref = est.predict_proba(ep)
    variant = VALID_VARIANTS[case](ep)
    proba = est.predict_proba(variant)
    assert_probabilities(proba, variant, case)
    if not (method in STOCHASTIC and case == "float64"):
        torch.testing.assert_close(proba.to(ref), ref, atol=2e-4, rtol=0)


# ---------------------------------------------------------------------- 1. bad base features
BAD_BASE = {
    "none": (lambda x, y: (None, y), (TypeError, ValueError), "base features"),
    "nan": (lambda x, y: (_nan(x[None])[0], y), ValueError, "base features contains NaN"),
    "1-d": (lambda x, y: (x[:, 0], y), ValueError, "base features must have 2 dimensions"),
    "integer-features": (
        lambda x, y: (x.long(), y),
        TypeError,
        "base features must be float32 or float64",
    ),
    "float16": (lambda x, y: (x.half(), y), TypeError, "base features must be float32"),
    "labels-length": (lambda x, y: (x, y[:-1]), ValueError, "base labels must have 200 entries"),
    "string-labels": (
        lambda x, y: (x, np.array([f"c{v}" for v in y.tolist()])),
        TypeError,
        "base labels must hold integer class labels",
    ),
    "fractional-labels": (
        lambda x, y: (x, y.double() + 0.5),
        ValueError,
        "base labels must hold whole-number class labels",
    ),
    "list-features": (lambda x, y: (x.tolist(), y), TypeError, "base features must be"),
}


@pytest.mark.parametrize("method, case", cases(ALL, BAD_BASE))
def test_bad_base_features_are_refused(method, case):
    make_bad, error, message = BAD_BASE[case]
    est = make_estimator(method, **QUICK.get(method, {}))
    with pytest.raises(error, match=message):
        est.fit_base(*make_bad(*base_data(8)))


@pytest.mark.parametrize("method, case", cases(ALL, ["numpy-base"]))
def test_base_features_as_numpy_arrays(method, case):
    """``fit_base`` takes NumPy arrays (int32 labels too) and learns the same statistics."""
    x, y = base_data(8)
    ep = make_tasks(3, way=4, shot=2, n_query=6, dim=8)
    ref = fitted(method).predict_proba(ep)
    est = make_estimator(method, **QUICK.get(method, {}))
    est.fit_base(x.numpy(), y.numpy().astype(np.int32))
    torch.testing.assert_close(est.predict_proba(ep), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ALL)
def test_predicting_before_fit_base_says_so(method):
    est = make_estimator(method, **QUICK.get(method, {}))
    if not est.needs_base:
        pytest.skip(f"{method} does not need base features")
    with pytest.raises(ValueError, match="fit_base"):
        est.predict_proba(make_tasks(2, dim=8))


# ---------------------------------------------------------------------- 1. hyperparameters
BAD_PARAMS = {
    "nearest-centroid": [
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("temperature", "abc"),
        ("prototype", "median"),
        ("center", "no"),
    ],
    "soft-kmeans": [
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("temperature", "abc"),
        ("n_iter", 0),
        ("n_iter", 2.5),
    ],
    "bavardage": [
        ("temperature_km", math.nan),
        ("temperature_vb", -1.0),
        ("temperature_km", "abc"),
        ("s_max", math.nan),
        ("n_vb", 0),
        ("alpha0", -1.0),
        ("whitening", "pca"),
    ],
    "gp-tree": [
        ("n_chains", 0),
        ("n_sweeps", -1),
        ("outputscale", math.nan),
        ("lengthscale", -1.0),
        ("pg_sampler", "nope"),
    ],
    "evidence-lssvm": [
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("lam_init", -1.0),
        ("score", "nope"),
    ],
    "slem": [
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("rel_lam", math.nan),
        ("lam", -1.0),
    ],
    "em-dirichlet": [
        ("temperature", math.nan),
        ("temperature", -1.0),
        ("temperature", "abc"),
        ("n_iter", 0),
        ("matching", "nope"),
    ],
}


@pytest.mark.parametrize(
    "method, key, value",
    [
        pytest.param(m, k, v, id=f"{m}-{k}={v!r}")
        for m, items in BAD_PARAMS.items()
        for k, v in items
    ],
)
def test_bad_hyperparameters_are_refused_before_any_output(method, key, value):
    """A bad value is a ``ValueError``/``TypeError`` naming the hyperparameter, at
    construction, ``fit_base`` or ``predict_proba``: never NaN or an inverted ranking."""
    with pytest.raises((ValueError, TypeError), match=key):
        est = make_estimator(method, **{**QUICK.get(method, {}), key: value})
        est.fit_base(*base_data(8))
        est.predict_proba(make_tasks(2, dim=8))


def _float_hyperparameters() -> list[tuple[str, str]]:
    """(method, name) of every ``__init__`` parameter whose default is a float."""
    import inspect

    out = []
    for method, info in METHODS.items():
        for name, param in inspect.signature(info.load().__init__).parameters.items():
            if isinstance(param.default, float):
                out.append((method, name))
    return out


@pytest.mark.parametrize(
    "method, key",
    [pytest.param(m, k, id=f"{m}-{k}=nan") for m, k in _float_hyperparameters()],
)
def test_nan_is_refused_for_every_float_hyperparameter(method, key):
    with pytest.raises((ValueError, TypeError), match=key):
        est = make_estimator(method, **{**QUICK.get(method, {}), key: math.nan})
        est.fit_base(*base_data(8))
        est.predict_proba(make_tasks(2, dim=8))


def test_unknown_method_and_hyperparameter_are_value_errors():
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        make_estimator("nope")
    for method in ALL:
        with pytest.raises(ValueError, match="unknown hyperparameter"):
            make_estimator(method, warp_drive=1)


# ---------------------------------------------------------------------- 2. degenerate tasks
DEGENERATE = {
    # name: make_tasks arguments
    "identical-points": dict(kinds="identical"),
    "all-zero": dict(kinds="zeros"),
    "huge-scale": dict(kinds="huge"),
    "tiny-scale": dict(kinds="tiny"),
    "duplicate-points": dict(kinds="duplicate"),
    "d-1": dict(dim=1),
    "d-1-identical": dict(dim=1, kinds="identical"),
    "2-way-1-shot": dict(way=2, shot=1),
    "one-query": dict(n_query=1),
    "20-way": dict(way=20, shot=1, n_query=20),
    "11-way-identical": dict(way=11, shot=1, kinds="identical"),
    "11-way-d-1": dict(way=11, shot=2, dim=1),
    "float64-huge": dict(kinds="huge", dtype=torch.float64),
    "float64-identical": dict(kinds="identical", dtype=torch.float64),
}


@pytest.mark.parametrize("method, case", cases(ALL, DEGENERATE))
def test_degenerate_but_valid_tasks_give_probabilities(method, case):
    kwargs = {"way": 5, "shot": 2, "n_query": 10, "dim": 8, **DEGENERATE[case]}
    ep = make_tasks(4, **kwargs, seed=1)
    est = fitted(method, dim=kwargs["dim"])
    assert_probabilities(est.predict_proba(ep), ep, f"{method} {case}")


# ---------------------------------------------------------------------- method-specific cases
def test_gp_tree_tree_building_terminates_when_class_means_coincide():
    from probfsl.models.gp_tree import build_tree

    for k in (2, 11, 30):
        tree = build_tree(np.ones((k, 4)), list(range(k)))
        assert tree is not None
    build_tree(np.ones((12, 1)), list(range(12)))  # D = 1


@pytest.mark.parametrize("method", ["gp-tree"])
def test_gp_tree_respects_center_false(method):
    est = make_estimator(method, center=False, **QUICK[method])
    ep = make_tasks(2, way=3, shot=1, n_query=6, dim=4)
    assert_probabilities(est.predict_proba(ep), ep, "gp-tree center=False without fit_base")


def test_gp_tree_labels_do_not_depend_on_the_batch():
    est = fitted("gp-tree", dim=8)
    ep = make_tasks(12, way=5, shot=1, n_query=10, dim=8, seed=3)
    alone = est.predict_proba(ep[:4]).argmax(-1)
    inside = est.predict_proba(ep).argmax(-1)[:4]
    assert torch.equal(alone, inside)


@pytest.mark.slow
def test_evidence_one_shot_labels_agree_across_dtypes():
    est = fitted("evidence-lssvm", dim=8)
    ep = make_tasks(200, way=5, shot=1, n_query=15, dim=8, seed=4)
    p32 = est.predict_proba(ep)
    p64 = est.predict_proba(ep.to(dtype=torch.float64))
    # the model computes in float64 either way: only true near-ties may flip
    assert (p32.argmax(-1) == p64.argmax(-1)).float().mean() >= 0.998
    # not uniform: the 1-shot limit is the nearest class mean, with a visible margin
    assert (p64.amax(-1) - p64.amin(-1)).mean() > 1e-3


def test_evidence_lssvm_on_integer_features():
    """Integer features: a clear TypeError, or float probabilities (never integer zeros)."""
    from probfsl.models.evidence import EvidenceLSSVM

    x, y = base_data(8)
    est = EvidenceLSSVM(center=False)
    try:
        est.fit_probe(x.round().long(), y)
        proba = est.predict_proba(x.round().long())
    except (TypeError, ValueError) as err:
        assert "features" in str(err)
        return
    assert proba.is_floating_point() and torch.isfinite(proba).all()
    torch.testing.assert_close(proba.sum(-1), torch.ones(len(y), dtype=proba.dtype))


@pytest.mark.parametrize(
    "probs, error, message",
    [
        pytest.param(lambda p: p.half(), (TypeError, ValueError), "probs", id="float16"),
        (lambda p: _nan(p), ValueError, "NaN"),
        (lambda p: p * 2, ValueError, "sum"),
        (lambda p: -p, ValueError, "negative"),
        (lambda p: p.numpy(), (TypeError, ValueError), "probs"),
    ],
)
def test_em_dirichlet_zero_shot_bad_probabilities(probs, error, message):
    torch.manual_seed(0)
    p = torch.distributions.Dirichlet(torch.ones(6)).sample((2, 20))
    with pytest.raises(error, match=message):
        make_estimator("em-dirichlet", **QUICK["em-dirichlet"]).predict_zero_shot(probs(p))


# ---------------------------------------------------------------------- data entry points
@pytest.fixture(scope="module")
def featureset():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 12)
    features = 3 * rng.standard_normal((10, 6))[labels] + rng.standard_normal((120, 6))
    return FeatureSet(
        features.astype(np.float32),
        labels,
        [f"c{c}" for c in range(10)],
        np.where(labels < 4, "base", "novel"),
    )


SAMPLER_CASES = {
    "shot=0": (dict(shot=0), ValueError, "shot must be at least 1"),
    "way=1": (dict(way=1), ValueError, "way must be at least 2"),
    "query=0": (dict(n_query=0), ValueError, "n_query must be at least 1"),
    "tasks=0": (dict(n_tasks=0), ValueError, "n_tasks must be at least 1"),
    "way=2.5": (dict(way=2.5), ValueError, "way must be a whole number"),
    "shot='1'": (dict(shot="1"), TypeError, "shot must be an integer"),
    "alpha=-1": (dict(balance="dirichlet", alpha=-1.0), ValueError, "alpha must be positive"),
    "alpha=nan": (dict(balance="dirichlet", alpha=math.nan), ValueError, "alpha must be finite"),
    "way>classes": (dict(way=7), ValueError, "only 6 novel classes"),
    "balance": (dict(balance="skewed"), ValueError, "balance must be one of"),
    "dtype": (dict(dtype=torch.float16), TypeError, "dtype must be torch.float32"),
}


@pytest.mark.parametrize("case", SAMPLER_CASES)
def test_bad_sampler_arguments(featureset, case):
    kwargs, error, message = SAMPLER_CASES[case]
    with pytest.raises(error, match=message):
        sample_episodes(featureset, **{"n_tasks": 2, "way": 3, "shot": 1, "n_query": 6, **kwargs})


def test_bad_zero_shot_sampler_arguments(featureset):
    for kwargs, message in [
        (dict(n_tasks=0), "n_tasks must be at least 1"),
        (dict(n_query=0), "n_query must be at least 1"),
        (dict(min_classes=1), "min_classes must be at least 2"),
        (dict(max_classes=99), "max_classes"),
    ]:
        with pytest.raises(ValueError, match=message):
            sample_zero_shot_tasks(featureset, **{"n_tasks": 2, "n_query": 10, **kwargs})


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint16])
def test_task_files_of_narrow_integers(tmp_path, featureset, dtype):
    idx = sample_task_indices(featureset, 3, way=3, shot=1, n_query=6)
    path = save_task_file(tmp_path / "t.npz", {k: v.astype(dtype) for k, v in idx.items()})
    ep = episodes_from_indices(featureset, load_task_file(path))
    ref = episodes_from_indices(featureset, idx)
    assert torch.equal(ep.query, ref.query) and ep.query_index.dtype == torch.long
    proba = fitted("nearest-centroid", dim=6).predict_proba(ep)
    assert_probabilities(proba, ep, "int16 task file")


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda i: dict(i, query=i["query"] * 1.0), TypeError, "'query' must hold integer"),
        (lambda i: dict(i, query=i["query"] + 10_000), ValueError, "'query' must hold row"),
        (lambda i: dict(i, support=-i["support"] - 1), ValueError, "'support' must hold row"),
    ],
)
def test_bad_task_indices(featureset, change, error, message):
    idx = sample_task_indices(featureset, 3, way=3, shot=1, n_query=6)
    with pytest.raises(error, match=message):
        episodes_from_indices(featureset, change(idx))


@pytest.mark.parametrize(
    "labels, error, message",
    [
        (np.r_[0.5, 1.5, 1.0, 0.0], ValueError, "whole-number"),
        (np.array(["a", "b", "a", "b"]), TypeError, "integer class labels"),
        (np.array([0, 1, -2, 1]), ValueError, "'labels' must be >= 0"),
        (np.array([0, 1, 0]), ValueError, "one entry per feature row"),
    ],
)
def test_bad_featureset_labels(labels, error, message):
    with pytest.raises(error, match=message):
        FeatureSet(np.zeros((4, 2)), labels, ["a", "b"], np.full(4, "novel"))


def test_pickles_need_allow_pickle(tmp_path):
    import pickle

    from probfsl.data import load_pickle

    with open(tmp_path / "x.pkl", "wb") as fh:
        pickle.dump({"a": np.zeros((2, 3)), "b": np.ones((2, 3))}, fh)
    with pytest.raises(ValueError, match="allow_pickle"):
        load_pickle(tmp_path / "x.pkl")
    assert load_pickle(tmp_path / "x.pkl", allow_pickle=True).features.shape == (4, 3)


@pytest.mark.parametrize(
    "call, error, message",
    [
        pytest.param(lambda fs: _tune("nope", fs), ValueError, "'nope'", id="tune-unknown"),
        pytest.param(lambda fs: _tune(fs=fs, way=1), ValueError, "way must be", id="tune-way-1"),
        pytest.param(lambda fs: _tune(fs=fs, shot=0), ValueError, "shot must", id="tune-shot-0"),
        pytest.param(
            lambda fs: _tune(fs=fs, criterion="nope"), ValueError, "criterion", id="tune-criterion"
        ),
        pytest.param(
            lambda fs: _tune(fs=fs, balance="dirichlet", alpha=math.nan),
            ValueError,
            "alpha must be finite",
            id="tune-alpha-nan",
        ),
        pytest.param(
            lambda fs: _tune(fs=fs, n_episodes=0),
            ValueError,
            "n_episodes",
            id="tune-n_episodes-0",
        ),
        pytest.param(
            lambda fs: _tune(fs={"features": fs.features}),
            TypeError,
            "fs must be a FeatureSet",
            id="tune-not-a-featureset",
        ),
        pytest.param(
            lambda fs: _select({"a": np.full((10, 3), np.nan)}, np.arange(10) % 2),
            ValueError,
            "NaN or inf",
            id="select-nan",
        ),
        pytest.param(
            lambda fs: _select({"a": np.random.default_rng(0).random((10, 3))}, np.arange(9) % 2),
            ValueError,
            "labels",
            id="select-labels-length",
        ),
        pytest.param(
            lambda fs: _select(
                {"a": np.random.default_rng(0).random((10, 3))}, np.array(["a", "b"] * 5)
            ),
            TypeError,
            "labels",
            id="select-string-labels",
        ),
        pytest.param(lambda fs: _select({}, np.arange(4)), ValueError, "feature", id="select-none"),
    ],
)
def test_bad_tune_and_select_arguments(featureset, call, error, message):
    with pytest.raises(error, match=message):
        call(featureset)


def _tune(method: str = "soft-kmeans", fs=None, **kwargs):
    from probfsl.tuning import tune

    return tune(method, fs, **{"n_episodes": 5, "n_query": 6, "way": 3, **kwargs})


def _select(feature_sets, labels):
    from probfsl.models.evidence import rank_backbones

    return rank_backbones(feature_sets, labels)


# ---------------------------------------------------------------------- 3. random tasks
N_RANDOM = int(os.environ.get("PROBFSL_BATTERY_TASKS", "100000"))
#: share of the random tasks per fast method (their speed per task differs ~10x)
RANDOM_SHARE = {
    "nearest-centroid": 0.25,
    "soft-kmeans": 0.2,
    "slem": 0.25,
    "bavardage": 0.15,
    "evidence-lssvm": 0.15,
}
BATCH = 1000


def _shapes(rng: np.random.Generator, n_batches: int):
    """Random task shapes; a third of the tasks of each batch degenerate."""
    for b in range(n_batches):
        way = int(rng.choice([2, 3, 5, 10, 20]))
        shot = int(rng.choice([1, 1, 2, 5]))
        n_query = int(rng.choice([1, 5, 15, 30]))
        dim = int(rng.choice([1, 2, 8, 32]))
        dtype = (torch.float32, torch.float64)[b % 2]
        kinds = rng.choice(KINDS, size=BATCH, p=[0.66, 0.07, 0.07, 0.07, 0.06, 0.07])
        yield dict(way=way, shot=shot, n_query=n_query, dim=dim, dtype=dtype, kinds=kinds)


@pytest.mark.parametrize("method, case", cases(RANDOM_SHARE, ["random"]))
@pytest.mark.slow
def test_random_tasks_never_give_nan(method, case):
    torch.manual_seed(0)
    rng = np.random.default_rng(list(RANDOM_SHARE).index(method))
    n_batches = max(1, round(N_RANDOM * RANDOM_SHARE[method] / BATCH))
    models = {}
    for b, shape in enumerate(_shapes(rng, n_batches)):
        dim = shape["dim"]
        if dim not in models:
            models[dim] = fitted(method, dim=dim)
        ep = make_tasks(BATCH, **shape, seed=b)
        proba = models[dim].predict_proba(ep)
        what = {k: v for k, v in shape.items() if k != "kinds"}
        assert_probabilities(proba, ep, f"{method} batch {b} {what}")


@pytest.mark.slow
def test_random_simplex_tasks_em_dirichlet():
    """EM-Dirichlet on probability vectors (its own input), one-hot and uniform rows
    mixed in: finite assignments summing to one."""
    est = make_estimator("em-dirichlet", **QUICK["em-dirichlet"])
    g = torch.Generator().manual_seed(0)
    for k, n_query, shot in ((2, 10, 1), (5, 30, 1), (10, 20, 2)):
        t = 200
        conc = torch.full((k,), 0.5)
        query = torch.distributions.Dirichlet(conc).sample((t, n_query))
        support = torch.distributions.Dirichlet(conc).sample((t, k * shot))
        query[: t // 4] = 1.0 / k  # uniform rows
        query[t // 4 : t // 2] = torch.nn.functional.one_hot(
            torch.randint(0, k, (t // 4, n_query), generator=g), k
        ).float()
        labels = torch.arange(k).repeat(shot).expand(t, -1)
        r = est.fit_probabilities(query, support, labels).query_r
        assert torch.isfinite(r).all()
        torch.testing.assert_close(r.sum(-1), torch.ones(t, n_query), atol=1e-4, rtol=0)
