"""The open-set background shared by the candidates of a search (``shared_backgrounds``).

A search on base-class episodes fits every candidate on the same base classes; the
background statistics (shrinkage chosen on class folds, covariances, held-out choices)
depend only on the preprocessed base features, so inside one search they are fitted once.
These tests hold the shared path to a fresh fit, bit for bit, and check that nothing
fitted on one data set, dtype or block reaches another.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from probfsl import tuning
from probfsl.data import sample_episodes
from probfsl.inference import background_shrinkage
from probfsl.models import base
from probfsl.models.base import shared_backgrounds
from probfsl.tuning import make_estimator
from tests.synthetic import make_featureset

#: what a fitted background holds: the statistics, then the held-out choices
STATS = ("background_shrinkage_", "background_mean_", "background_within_", "background_between_")


def _base_tensors(seed: int = 0, dtype: torch.dtype = torch.float32):
    fs = make_featureset(n_base=12, n_novel=6, per_class=20, dim=6, seed=seed)
    return fs.base(dtype)


def _assert_same_background(got, want) -> None:
    """``got`` and ``want`` hold equal background statistics and held-out choices."""
    for name in STATS:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.device == b.device
            assert torch.equal(a, b), name
        else:
            assert a == b, name
    got._choose_background()
    want._choose_background()
    for name in got._CHOICES:
        assert getattr(got, name) == getattr(want, name), name


@pytest.mark.parametrize(
    "first, second",
    [
        (("soft-kmeans", {"temperature": 3.0}), ("soft-kmeans", {"temperature": 30.0})),
        (("nearest-centroid", {}), ("soft-kmeans", {"temperature": 10.0})),
        (("em-dirichlet", {"n_iter": 2}), ("em-dirichlet", {"n_iter": 5})),
    ],
)
def test_a_shared_background_is_that_of_a_fresh_fit(first, second):
    x, labels = _base_tensors()
    fresh = [make_estimator(name, **params).fit_base(x, labels) for name, params in (first, second)]
    with shared_backgrounds():
        shared = [
            make_estimator(name, **params).fit_base(x.clone(), labels.clone())
            for name, params in (first, second)
        ]
        # the second estimator got the first one's background (the same preprocessing)
        assert shared[1]._background_base is shared[0]._background_base
    for got, want in zip(shared, fresh, strict=True):
        _assert_same_background(got, want)


def test_other_data_dtypes_and_blocks_never_get_a_cached_background(monkeypatch):
    calls = []
    select = background_shrinkage.select_shrinkage
    monkeypatch.setattr(
        background_shrinkage, "select_shrinkage", lambda *a: calls.append(1) or select(*a)
    )
    x, labels = _base_tensors(seed=0)
    other_x, other_labels = _base_tensors(seed=1)  # another data set of the same shape
    with shared_backgrounds():
        first = make_estimator("nearest-centroid").fit_base(x, labels)
        other = make_estimator("nearest-centroid").fit_base(other_x, other_labels)
        wide = make_estimator("nearest-centroid").fit_base(x.double(), labels)
        relabelled = make_estimator("nearest-centroid").fit_base(x, labels.flip(0))
        with shared_backgrounds():  # an inner block uses the outer one's backgrounds
            again = make_estimator("nearest-centroid").fit_base(x, labels)
    assert again._background_base is first._background_base
    assert len(calls) == 4  # one fit per distinct (features, labels, dtype)
    assert not torch.equal(other.background_within_, first.background_within_)
    _assert_same_background(
        other, make_estimator("nearest-centroid").fit_base(other_x, other_labels)
    )
    _assert_same_background(wide, make_estimator("nearest-centroid").fit_base(x.double(), labels))
    _assert_same_background(
        relabelled, make_estimator("nearest-centroid").fit_base(x, labels.flip(0))
    )
    assert wide.background_within_.dtype == torch.float64
    with shared_backgrounds():  # a new block starts empty: fitted again
        later = make_estimator("nearest-centroid").fit_base(x, labels)
    assert later._background_base is not first._background_base
    assert base._SHARED_BACKGROUNDS.get() is None  # nothing outlives the blocks
    outside = [make_estimator("nearest-centroid").fit_base(x, labels) for _ in range(2)]
    assert outside[0]._background_base is not outside[1]._background_base


def test_a_search_shares_the_background_and_chooses_as_without_it(monkeypatch):
    fs = make_featureset(n_base=12, n_novel=6, per_class=20, dim=6)
    calls = []
    select = background_shrinkage.select_shrinkage
    monkeypatch.setattr(
        background_shrinkage, "select_shrinkage", lambda *a: calls.append(1) or select(*a)
    )
    kwargs = {"shot": 1, "n_query": 15, "n_episodes": 20, "open_queries": 10}
    shared = tuning.tune("soft-kmeans", fs, **kwargs)
    n_shared = len(calls)
    assert n_shared == 1  # one base-class view, one preprocessing: one background
    monkeypatch.setattr(tuning, "shared_backgrounds", contextlib.nullcontext)
    alone = tuning.tune("soft-kmeans", fs, **kwargs)
    assert len(calls) - n_shared == len(alone.trace)  # one background per candidate
    assert shared.best == alone.best
    strip = [{k: v for k, v in row.items() if k != "seconds"} for row in shared.trace]
    assert strip == [{k: v for k, v in row.items() if k != "seconds"} for row in alone.trace]


def test_a_shared_reading_is_that_of_a_fresh_reading(monkeypatch):
    from probfsl.inference.background import TwoCovarianceReading

    fs = make_featureset(n_base=12, n_novel=6, per_class=20, dim=6)
    episodes = sample_episodes(fs, 4, way=3, shot=2, n_query=9, seed=1, n_open=6)
    other = sample_episodes(fs, 4, way=3, shot=2, n_query=9, seed=2, n_open=6)
    base_xy = fs.base()
    fresh = make_estimator("soft-kmeans", temperature=3.0).fit_base(*base_xy)
    want = [fresh.predict_proba_open(e) for e in (episodes, episodes, other, episodes)]
    made = []
    init = TwoCovarianceReading.__init__
    monkeypatch.setattr(
        TwoCovarianceReading, "__init__", lambda self, *a: made.append(1) or init(self, *a)
    )
    with shared_backgrounds():
        models = [make_estimator("soft-kmeans", temperature=t).fit_base(*base_xy) for t in (3, 3)]
        got = [models[0].predict_proba_open(episodes), models[1].predict_proba_open(episodes)]
        assert len(made) == 1  # the second candidate read the same tasks: shared
        got.append(models[1].predict_proba_open(other))  # other tasks: read afresh
        got.append(models[0].predict_proba_open(episodes))  # only the last tasks are kept
        assert len(made) == 3
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_copied_reading_keeps_the_base_background():
    from probfsl.inference.background import TwoCovarianceReading, fit_background

    x, labels = _base_tensors(dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    support, query = torch.randn(2, 6, 6, generator=g).double(), torch.randn(2, 8, 6).double()
    support_labels = torch.arange(3).repeat(2).expand(2, -1)
    reading = TwoCovarianceReading(
        support, support_labels, query, 3, fit_background(x, labels), True
    )
    before = reading.background_log_lik()
    copy = reading.copy()
    copy.infer_background_mean(1.0, 0.5)
    assert reading.background_shift is None and torch.equal(reading.background_log_lik(), before)
    assert not torch.equal(copy.background_log_lik(), before)


def test_a_readings_contrast_is_computed_once_and_follows_the_inferred_background():
    """The base-class contrast of a reading is computed once and handed to its copies, the
    same numbers as a fresh reading's; with query weights, or after a copy's background
    is inferred, the contrast is computed afresh and the kept one is unchanged."""
    from probfsl.inference.background import TwoCovarianceReading, fit_background

    x, labels = _base_tensors(dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    support = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    query = torch.randn(2, 8, 6, generator=g, dtype=torch.float64)
    support_labels = torch.arange(3).repeat(2).expand(2, -1)
    stats = fit_background(x, labels)

    def fresh() -> TwoCovarianceReading:
        return TwoCovarianceReading(support, support_labels, query, 3, stats, True)

    reading = fresh()
    odds = reading.open_log_odds()
    assert reading.open_log_odds() is odds and reading.copy().open_log_odds() is odds
    assert torch.equal(odds, fresh().open_log_odds())
    weights = torch.rand(2, 8, 3, generator=g, dtype=torch.float64)
    weighted = reading.open_log_odds(weights)
    assert torch.equal(weighted, fresh().open_log_odds(weights))
    assert not torch.equal(weighted, odds)
    inferred = reading.copy().infer_background_mean(1.0, 0.5)
    assert torch.equal(
        inferred.open_log_odds(), fresh().infer_background_mean(1.0, 0.5).open_log_odds()
    )
    assert not torch.equal(inferred.open_log_odds(), odds)
    assert reading.open_log_odds() is odds and torch.equal(odds, fresh().open_log_odds())
