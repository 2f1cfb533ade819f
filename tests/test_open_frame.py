"""The frame of the transductive methods' open contrast (``open_frame``): the two-covariance
reading of the task re-centred on its queries' mean (``"queries"``) or on the base mean
only (``"base"``), in soft k-means, BAVARDAGE and vmp-gmm's nested open model."""

from __future__ import annotations

import math

import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.data.preprocess import center_and_normalize
from probfsl.inference.background import TwoCovarianceReading, open_responsibility
from probfsl.methods import build_estimator

WAY, SHOT, QUERY, N_OPEN, TASKS = 3, 2, 9, 9, 4
FRAMES = ("queries", "base")


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


@pytest.fixture(scope="module")
def episodes(omniglot):
    return sample_episodes(omniglot, TASKS, WAY, SHOT, QUERY, seed=3, n_open=N_OPEN).to(
        dtype=torch.float64
    )


def _reading(est, x: torch.Tensor, episodes, frame: str) -> TwoCovarianceReading:
    """The two-covariance reading of the normalised points ``x`` (support first) in the
    frame ``frame``, under the base classes' background."""
    centring = frame == "queries"
    n_s = episodes.support.shape[1]
    stats = est.background_stats(x, query_centring=centring)
    return TwoCovarianceReading(
        x[:, :n_s], episodes.support_labels, x[:, n_s:], WAY, stats, centring
    )


def _reading_odds(est, x: torch.Tensor, episodes, frame: str) -> torch.Tensor:
    """ln p_0(x) - ln p_closed(x) [T, Q] under the base classes' background, the contrast
    the iterations use in either frame."""
    return _reading(est, x, episodes, frame).open_log_odds()


def _read_last(est, x, episodes, frame: str, open_resp: torch.Tensor) -> torch.Tensor:
    """P(open) after the iterations: one more update of q(π_0) and of the open
    responsibilities, under the base classes' background in the base frame and under the
    background inferred from the queries in the queries' frame."""
    reading = _reading(est, x, episodes, frame)
    if frame == "queries":
        reading.infer_background_mean(est.background_query_odds_scale_, est.open_prior)
    return open_responsibility(reading.open_log_odds(), open_resp, est.open_prior)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


@pytest.mark.parametrize("frame", FRAMES)
def test_soft_kmeans_one_pass_is_the_readings_posterior(omniglot, episodes, frame):
    """One pass of soft k-means with the background: P(open) = σ(logit π_0 + ln p_0(x) -
    ln p_closed(x)), the reading's own log-odds in the chosen frame, then (queries' frame)
    read last under the background inferred from the queries."""
    est = build_estimator(
        "soft-kmeans",
        n_iter=1,
        open_prior=0.3,
        open_frame=frame,
        open_scale=1.0,
        open_shift=0.0,
        open_neighbours=0,
    )  # P(open) as inferred
    est.fit_featureset(omniglot, torch.float64)
    x = center_and_normalize(episodes.points(), est.base_mean_.to(episodes.support))
    start = torch.sigmoid(_reading_odds(est, x, episodes, frame) + _logit(0.3))
    want = _read_last(est, x, episodes, frame, start)
    got = est.predict_proba_open(episodes)[..., -1]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("frame", FRAMES)
def test_bavardage_open_contrast_is_the_readings(omniglot, episodes, frame):
    """BAVARDAGE's open problem carries the reading's log-odds in the chosen frame, and in
    ``mode="soft_kmeans"`` with one pass and no free component its P(open) is the
    reading's posterior σ(logit π_0 + log-odds), read last (queries' frame) under the
    background inferred from the queries."""
    est = build_estimator(
        "bavardage",
        whitening="global",
        open_frame=frame,
        n_free=0,
        n_km=1,
        mode="soft_kmeans",
        open_scale=1.0,
        open_shift=0.0,
        open_neighbours=0,
    ).fit_featureset(omniglot, torch.float64)
    x = center_and_normalize(episodes.points(), est.base_mean_.to(episodes.support))
    odds = _reading_odds(est, x, episodes, frame)
    torch.testing.assert_close(est.open_problem(episodes).open_log_odds, odds)
    got = est.predict_proba_open(episodes)[..., -1]
    want = _read_last(est, x, episodes, frame, torch.sigmoid(odds + _logit(est.open_prior)))
    torch.testing.assert_close(got, want)
    vb = est.with_params(mode="bavardage", n_vb=2, n_free=3)
    torch.testing.assert_close(vb.open_problem(episodes).open_log_odds, odds)


@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize("method", ["soft-kmeans", "vmp-gmm", "bavardage", "bavardage-gamma"])
def test_default_open_calibration_is_the_held_out_one(omniglot, episodes, method, frame):
    """Without ``open_scale`` and ``open_shift`` the last column's log-odds are scaled by
    the a and moved by the b that held-out base classes give the contrast in the
    estimator's frame; the known classes keep their ratios (``temper_open``). A given
    ``open_scale`` applies to the log-odds with the held-out bias b / a taken out, unless
    ``open_shift`` is given too."""
    from probfsl.inference.vb_mixture_open import temper_open

    params = {"open_frame": frame, "open_neighbours": 0}  # the calibration alone
    if method != "bavardage-gamma":  # whose P(open) always takes the held-out scale
        params.update(open_scale=None, open_shift=None)
    est = build_estimator(method, **params).fit_featureset(omniglot, torch.float64)
    got = est.predict_proba_open(episodes)
    prefix = "background_query_" if frame == "queries" else "background_"
    a, b = getattr(est, prefix + "odds_scale_"), getattr(est, prefix + "odds_shift_")
    assert a != 1.0 and b != 0.0
    assert est.held_out_calibration() == est.open_calibration() == (a, b)
    if method == "bavardage-gamma":
        est.open_scale, est.open_shift = 1.0, 0.0  # the class attributes, as inferred
    else:
        est.set_params(open_scale=1.0, open_shift=0.0)
    assert est.open_calibration() == (1.0, 0.0)
    inferred = est.predict_proba_open(episodes)
    torch.testing.assert_close(got, temper_open(inferred, a, b))
    if method != "bavardage-gamma":
        est.set_params(open_scale=0.5, open_shift=-0.25)
        torch.testing.assert_close(
            est.predict_proba_open(episodes), temper_open(inferred, 0.5, -0.25)
        )
        est.set_params(open_shift=None)  # the held-out bias, at the scale given
        assert est.open_calibration() == pytest.approx((0.5, 0.5 * b / a))
        est.set_params(open_scale=None, open_shift=-0.25)
        assert est.open_calibration() == (a, -0.25)


@pytest.mark.parametrize("frame", FRAMES)
def test_vmp_gmm_nested_one_sweep_is_one_update_of_the_open_fraction(omniglot, episodes, frame):
    """vmp-gmm's nested model with one soft k-means pass and one sweep: the start is
    σ(logit π_0 + log-odds), and the sweep's P(open) one update of q(π_0) from it
    (:func:`open_responsibility`) with the reading's log-odds in the chosen frame, then
    (queries' frame) one more under the background inferred from the queries."""
    est = build_estimator(
        "vmp-gmm",
        n_kmeans=1,
        max_iter=1,
        open_frame=frame,
        open_scale=1.0,
        open_shift=0.0,
        open_neighbours=0,
    )
    est.fit_featureset(omniglot, torch.float64)
    x, _, _ = est.engine_data(episodes)
    odds = _reading_odds(est, x, episodes, frame)
    start = torch.sigmoid(odds + _logit(est.open_prior))
    want = _read_last(est, x, episodes, frame, open_responsibility(odds, start, est.open_prior))
    torch.testing.assert_close(est.predict_proba_open(episodes)[..., -1], want)


@pytest.mark.parametrize(
    "method, params",
    [
        ("soft-kmeans", {}),
        ("vmp-gmm", {}),
        ("bavardage", {"whitening": "global", "open_frame": "queries", "n_vb": 3}),
        ("bavardage", {"whitening": "global", "open_frame": "queries", "mode": "soft_kmeans"}),
    ],
)
def test_the_inferred_background_reads_p_open_last(omniglot, episodes, monkeypatch, method, params):
    """In the queries' frame the iterations use the base classes' background and only the
    last reading of P(open) the background inferred from the queries: the known columns
    keep the shares among the classes of a run whose reading never infers the mean (the
    base classes' background throughout), P(open) differs, and each row sums to 1."""
    est = build_estimator(method, **params).fit_featureset(omniglot, torch.float64)
    got = est.predict_proba_open(episodes)
    no_mean = lambda self, *args: self  # noqa: E731
    monkeypatch.setattr(TwoCovarianceReading, "infer_background_mean", no_mean)
    plain = est.predict_proba_open(episodes)
    share = got[..., :-1] / got[..., :-1].sum(-1, keepdim=True)
    torch.testing.assert_close(share, plain[..., :-1] / plain[..., :-1].sum(-1, keepdim=True))
    assert (got[..., -1] - plain[..., -1]).abs().max() > 1e-3
    torch.testing.assert_close(got.sum(-1), torch.ones_like(got[..., 0]))


def test_frames_differ(omniglot, episodes):
    """The two frames are two readings: the queries' re-centring moves the log-odds."""
    est = build_estimator("soft-kmeans", n_iter=1).fit_featureset(omniglot, torch.float64)
    x = center_and_normalize(episodes.points(), est.base_mean_.to(episodes.support))
    gap = _reading_odds(est, x, episodes, "queries") - _reading_odds(est, x, episodes, "base")
    assert gap.abs().max() > 1e-3


@pytest.mark.parametrize(
    "method, params",
    [
        ("soft-kmeans", {}),
        ("bavardage", {"whitening": "global"}),
        ("vmp-gmm", {}),
        ("nearest-centroid", {}),
    ],
)
def test_query_frame_batched_and_dtypes(omniglot, episodes, method, params):
    """Each task is read in its own queries' frame: a batch equals its tasks one at a
    time, and float32 agrees with float64."""
    est = build_estimator(method, open_frame="queries", **params)
    est64 = est.fit_featureset(omniglot, torch.float64)
    batch = est64.predict_proba_open(episodes)
    for t in range(TASKS):
        alone = est64.predict_proba_open(episodes[t : t + 1])
        torch.testing.assert_close(alone[0], batch[t])
    est32 = build_estimator(method, open_frame="queries", **params).fit_featureset(omniglot)
    p32 = est32.predict_proba_open(episodes.to(dtype=torch.float32))
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), batch, atol=5e-3, rtol=0)


@pytest.mark.parametrize("frame", FRAMES)
def test_nearest_centroid_p_open_is_the_readings_posterior_in_its_frame(omniglot, episodes, frame):
    """nearest-centroid's P(open) is the two-covariance posterior of its normalised
    features in ``open_frame``, under that frame's held-out scale and shift; its known
    columns are its closed-set probabilities times 1 - P(open) in either frame."""
    est = build_estimator("nearest-centroid", open_frame=frame).fit_featureset(
        omniglot, torch.float64
    )
    got = est.predict_proba_open(episodes)
    x = center_and_normalize(episodes.points(), est.base_mean_.to(episodes.support))
    prefix = "background_query_" if frame == "queries" else "background_"
    scale, shift = getattr(est, prefix + "odds_scale_"), getattr(est, prefix + "odds_shift_")
    log_odds = scale * _reading_odds(est, x, episodes, frame) + shift
    want = torch.sigmoid(log_odds + _logit(est.open_prior))
    torch.testing.assert_close(got[..., -1], want)
    closed = est.predict_proba(episodes)
    torch.testing.assert_close(got[..., :-1], closed * (1 - want).unsqueeze(-1))
    other = "base" if frame == "queries" else "queries"
    est.open_frame = other
    assert (est.predict_proba_open(episodes)[..., -1] - want).abs().max() > 1e-3


#: the inductive methods besides nearest centroid, at small settings
INDUCTIVE = {
    "evidence-lssvm": {},
    "slem": {},
    "gp-tree": {"n_chains": 2, "n_sweeps": 2},
    "em-dirichlet": {"n_iter": 2, "mm_max_iter": 20},
}


@pytest.mark.parametrize("method", sorted(INDUCTIVE))
def test_inductive_methods_read_p_open_in_their_frame(omniglot, episodes, method):
    """An inductive method's ``open_frame`` moves P(open) only: the known columns keep
    its closed-set argmax in both frames, and in the queries' frame each task is read
    in its own (a batch equals its tasks one at a time)."""
    est = build_estimator(method, **INDUCTIVE[method]).fit_featureset(omniglot, torch.float64)
    closed = est.predict_proba(episodes).argmax(-1)
    by_frame = {}
    for frame in FRAMES:
        est.open_frame = frame
        by_frame[frame] = est.predict_proba_open(episodes)
        assert torch.equal(by_frame[frame][..., :-1].argmax(-1), closed)
    gap = by_frame["queries"][..., -1] - by_frame["base"][..., -1]
    assert gap.abs().max() > 1e-3
    est.open_frame = "queries"
    for t in (0, TASKS - 1):
        alone = est.predict_proba_open(episodes[t : t + 1])
        torch.testing.assert_close(alone[0, :, -1], by_frame["queries"][t, :, -1])


@pytest.mark.parametrize(
    "method",
    ["soft-kmeans", "bavardage", "bavardage-gamma", "vmp-gmm", "nearest-centroid", *INDUCTIVE],
)
def test_open_frame_checked(method):
    """An unknown frame is a ValueError before any computation."""
    with pytest.raises(ValueError, match="open_frame"):
        build_estimator(method, open_frame="support")._check_params()


@pytest.mark.parametrize(
    "method, fixed, frame",
    [
        ("soft-kmeans", {}, ["base", "queries"]),
        ("soft-kmeans", {"open_frame": "base"}, "base"),
        ("vmp-gmm", {"open_frame": "queries"}, "queries"),
        ("bavardage", {}, ["base", "queries"]),
        ("bavardage", {"open_frame": "base"}, "base"),
        ("em-dirichlet", {}, "base"),
    ],
)
def test_auto_preset_cache_key_holds_the_frame(omniglot, monkeypatch, method, fixed, frame):
    """The open-set search's cached choice (with its ``open_scale``) is keyed by the frame
    the scale is learnt in: the method's default, the one fixed, or the frames searched."""
    from probfsl import tuning

    seen = {}

    def fake_cached(kind, fs, settings, compute):
        seen.update(settings)
        return None

    monkeypatch.setattr(tuning, "_cached", fake_cached)
    tuning.auto_preset(method, omniglot, WAY, SHOT, QUERY, fixed=fixed, open_queries=N_OPEN)
    assert seen["open_frame"] == frame
    # a searched frame is ranked by AUROC (within the accuracy interval), a key of its own
    searched = isinstance(frame, list)
    assert (seen.get("open_frame_rank") is not None) == searched
    # the queries' frame infers the background's mean for the last reading: scales anew
    want = "inferred, read last" if "queries" in (frame or []) else None
    assert seen.get("open_background_mean") == want
    seen.clear()
    tuning.auto_preset(method, omniglot, WAY, SHOT, QUERY, fixed=fixed)
    assert "open_frame" not in seen  # closed searches keep their cache entries


def _frame_rows(*rows):
    """Trace rows (params, accuracy, its 95% interval, AUROC)."""
    return [
        {"params": params, "accuracy": acc, "ci95": ci, "auroc": auc}
        for params, acc, ci, auc in rows
    ]


def test_the_frame_is_the_higher_auroc_within_the_accuracy_interval():
    """The open-set search takes the most accurate row, then, among the rows that differ
    from it in ``open_frame`` alone and lie within its accuracy interval, the higher AUROC."""
    from probfsl.tuning import _best_row, _frame_row

    defaults = {"open_frame": "queries"}
    rows = _frame_rows(
        ({"t": 1.0}, 80.5, 2.0, 79.0),  # the main search's best, in the default frame
        ({"t": 1.0, "open_frame": "base"}, 79.0, 2.0, 85.0),
        ({"t": 1.0, "open_frame": "queries"}, 80.5, 2.0, 79.0),
        ({"t": 3.0, "open_frame": "base"}, 80.0, 2.0, 99.0),  # other hyperparameters
    )
    top = _best_row(rows)
    assert top is rows[0]
    assert _frame_row(rows, top, defaults) is rows[1]
    # a frame that loses accuracy beyond the interval is not taken for its AUROC
    rows[1]["accuracy"] = 78.0
    assert _frame_row(rows, top, defaults) is top
    # nor is a row of other hyperparameters, however high its AUROC
    rows[1]["accuracy"], rows[1]["auroc"] = 79.0, 70.0
    assert _frame_row(rows, top, defaults) is top
    # a hyperparameter a row does not name is at its default: the main search's best
    # (no max_iter) and the frames tried with max_iter at its default are alike
    rows = _frame_rows(
        ({"t": 1.0}, 80.0, 2.0, 80.0),
        ({"t": 1.0, "max_iter": 30, "open_frame": "base"}, 79.5, 2.0, 85.0),
        ({"t": 1.0, "max_iter": 1, "open_frame": "base"}, 79.5, 2.0, 90.0),
    )
    assert _frame_row(rows, rows[0], defaults) is rows[0]  # max_iter's default unknown
    assert _frame_row(rows, rows[0], {**defaults, "max_iter": 30}) is rows[1]


def test_soft_kmeans_open_search_reads_both_frames(omniglot):
    """soft-kmeans' open-set search tries both frames at its best candidate and keeps the
    one :func:`probfsl.tuning._frame_row` ranks first."""
    from probfsl.tuning import _best_row, _frame_row, tune

    result = tune(
        "soft-kmeans",
        omniglot,
        {"temperature": [5.0]},
        way=WAY,
        shot=1,
        n_query=QUERY,
        n_episodes=8,
        refine=False,
        open_queries=N_OPEN,
    )
    assert {row["params"].get("open_frame") for row in result.trace} == {
        None,
        "base",
        "queries",
    }
    defaults = build_estimator("soft-kmeans").get_params()
    chosen = _frame_row(result.trace, _best_row(result.trace), defaults)
    assert result.best == chosen["params"]


@pytest.mark.parametrize("method", ["bavardage", "bavardage-gamma"])
def test_a_searchs_candidates_share_the_open_inputs_and_predict_as_fresh_estimators(
    omniglot, episodes, method
):
    """In a search (``with_params`` copies) the contrast, the reading and the rows of a
    batch are read once per frame and shared by the candidates; each candidate's open-set
    posterior is that of a fresh estimator with its hyperparameters (to rounding: in a
    search the whitened Gram rows come from the rotated rows the candidates share), also
    after other candidates' last readings, and a new batch replaces what was kept."""
    fixed = dict(whitening="global", open_neighbours=0)
    searched = build_estimator(method, **fixed).fit_featureset(omniglot, torch.float64)
    candidates = [
        dict(open_frame=frame, temperature_vb=t, s_max=s)
        for frame in FRAMES
        for t, s in ((0.3, 0.5), (1.0, 2.0))
    ]
    if method == "bavardage":
        candidates.append(dict(open_frame="queries", mode="vb"))
    fresh = {}
    for params in candidates + candidates[::-1]:  # the second pass reads what was kept
        key = tuple(sorted(params.items()))
        if key not in fresh:
            est = build_estimator(method, **fixed, **params)
            fresh[key] = est.fit_featureset(omniglot, torch.float64).predict_proba_open(episodes)
        got = searched.with_params(**params).predict_proba_open(episodes)
        torch.testing.assert_close(got, fresh[key], rtol=1e-6, atol=1e-9)
    assert set(searched._search_cache["open"]) == {True, False}  # one entry per frame
    other = sample_episodes(omniglot, 2, WAY, SHOT, QUERY, seed=4, n_open=N_OPEN)
    got = searched.with_params(open_frame="base").predict_proba_open(other.to(dtype=torch.float64))
    assert set(searched._search_cache["open"]) == {False}
    est = build_estimator(method, **fixed, open_frame="base")
    want = est.fit_featureset(omniglot, torch.float64).predict_proba_open(
        other.to(dtype=torch.float64)
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
