"""The background reading's isotropic blends and its transductive frame: the blend against
its dense formula, the isotropic limit against its closed form, the queries' frame
against the reading of features centred by hand, batched against one task at a time,
float32 against float64, the held-out choice of the blends against brute force, and the
fallbacks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import MultivariateNormal

from probfsl import make_estimator
from probfsl.inference.background import (
    BackgroundStats,
    TwoCovarianceReading,
    centre_on_queries,
    fit_background,
    open_responsibility,
    two_covariance_log_liks,
)
from probfsl.inference.open_temperature import (
    GRID,
    MIX_GRID,
    TASKS,
    UNSPLIT_READING,
    fit_scale,
    fit_shift,
    held_out_open_log_odds,
    scale_and_log_loss,
    select_open_reading,
    select_open_readings,
)
from probfsl.models.base import FewShotClassifier, held_out_background_choices


def _base(n_classes=8, per_class=12, dim=4, seed=0, dtype=torch.float64):
    """Gaussian classes with anisotropic within- and between-class covariances."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.3, 2.0, dim, dtype=dtype)
    means = torch.randn(n_classes, dim, generator=g, dtype=dtype) * scales.flip(0) * 2
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    x = means[labels] + torch.randn(len(labels), dim, generator=g, dtype=dtype) * scales
    return x, labels


def _task(n_tasks=3, dim=4, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    support = torch.randn(n_tasks, 4, dim, generator=g, dtype=dtype)
    labels = torch.tensor([0, 1, 0, 1]).expand(n_tasks, -1)
    query = torch.randn(n_tasks, 5, dim, generator=g, dtype=dtype)
    return support, labels, query


# --------------------------------------------------------------------- the blends
@pytest.mark.parametrize("mix", [0.0, 0.3, 1.0])
def test_blend_is_the_dense_formula_and_keeps_the_trace(mix):
    x, labels = _base()
    stats = fit_background(x, labels, 1e-2)
    blended = stats.blended(mix, 1 - mix)
    d = x.shape[1]
    for cov, got, a in (
        (stats.within, blended.within, mix),
        (stats.between, blended.between, 1 - mix),
    ):
        want = (1 - a) * cov + a * torch.trace(cov) / d * torch.eye(d, dtype=cov.dtype)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.trace(got), torch.trace(cov))
    torch.testing.assert_close(blended.mean, stats.mean)
    if mix == 1.0:  # isotropic within-class covariance
        torch.testing.assert_close(
            blended.within, blended.within.diagonal().mean() * torch.eye(d, dtype=x.dtype)
        )


@pytest.mark.parametrize("shrinkage", [0.0, 1e-3, 0.3])
def test_fit_background_blends_are_the_blend_of_the_shrunk_covariances(shrinkage):
    x, labels = _base(seed=3)
    direct = fit_background(x, labels, shrinkage, 0.6, 0.9)
    later = fit_background(x, labels, shrinkage).blended(0.6, 0.9)
    for got, want in zip(direct, later, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(
        fit_background(x, labels, shrinkage, 0.0, 0.0),
        fit_background(x, labels, shrinkage),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mixes_outside_the_unit_interval_are_refused():
    x, labels = _base()
    stats = fit_background(x, labels)
    with pytest.raises(ValueError, match="within_mix"):
        fit_background(x, labels, 1e-3, 1.5)
    with pytest.raises(ValueError, match="between_mix"):
        stats.blended(0.0, -0.1)
    with pytest.raises(ValueError, match="mix_grid"):
        select_open_reading(x, labels, 1e-3, mix_grid=(0.0, 2.0))


def test_the_isotropic_limit_is_the_closed_form_of_distances():
    """With W = w I and B = b I, class k's predictive is N(m + ρ_k (x̄_k - m), (w + ρ_k w / n_k) I),
    ρ_k = n_k b / (w + n_k b), and the background N(m, (w + b) I)."""
    x, labels = _base(seed=5)
    stats = fit_background(x, labels, 1e-3).blended(1.0, 1.0)
    w, b, m = stats.within[0, 0], stats.between[0, 0], stats.mean
    support, support_labels, query = _task()
    reading = TwoCovarianceReading(support, support_labels, query, 2, stats)
    d = x.shape[1]
    eye = torch.eye(d, dtype=x.dtype)
    for t in range(support.shape[0]):
        columns = []
        for k in range(2):
            rows = support[t, support_labels[t] == k]
            n = rows.shape[0]
            rho = n * b / (w + n * b)
            mean = m + rho * (rows.mean(0) - m)
            columns.append(MultivariateNormal(mean, (w + rho * w / n) * eye).log_prob(query[t]))
        class_ll = torch.stack(columns, -1)
        bg = MultivariateNormal(m, (w + b) * eye).log_prob(query[t])
        torch.testing.assert_close(reading.class_log_lik()[t], class_ll)
        want = bg - (torch.logsumexp(class_ll, -1) - math.log(2))
        torch.testing.assert_close(reading.open_log_odds()[t], want)


# ------------------------------------------------------------- the queries' frame
def test_query_centring_is_the_reading_of_features_centred_by_hand():
    x, labels = _base()
    stats = fit_background(x, labels).blended(0.3, 0.6)
    support, support_labels, query = _task()
    centre = query.mean(1, keepdim=True)
    s = (support - centre) / (support - centre).norm(dim=-1, keepdim=True)
    q = (query - centre) / (query - centre).norm(dim=-1, keepdim=True)
    want = two_covariance_log_liks(s, support_labels, q, 2, stats)
    got = two_covariance_log_liks(support, support_labels, query, 2, stats, query_centring=True)
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_)
    # brute force: the dense Gaussian predictives of the two-covariance model
    wc, bc, m = stats.within, stats.between, stats.mean
    for t in range(support.shape[0]):
        for k in range(2):
            rows = s[t, support_labels[t] == k]
            post_cov = torch.linalg.inv(torch.linalg.inv(bc) + rows.shape[0] * torch.linalg.inv(wc))
            post_mean = m + post_cov @ torch.linalg.solve(wc, (rows - m).sum(0))
            dense = MultivariateNormal(post_mean, wc + post_cov).log_prob(q[t])
            torch.testing.assert_close(got[0][t, :, k], dense)
        torch.testing.assert_close(got[1][t], MultivariateNormal(m, wc + bc).log_prob(q[t]))


def test_the_queries_frame_forgets_where_the_task_lies():
    """A shift of a task's every feature leaves its reading in the queries' frame alone."""
    x, labels = _base()
    stats = fit_background(x, labels)
    support, support_labels, query = _task()
    shift = torch.tensor([3.0, -1.0, 0.5, 2.0], dtype=x.dtype)
    plain = TwoCovarianceReading(support, support_labels, query, 2, stats, query_centring=True)
    moved = TwoCovarianceReading(
        support + shift, support_labels, query + shift, 2, stats, query_centring=True
    )
    torch.testing.assert_close(moved.open_log_odds(), plain.open_log_odds())
    assert not torch.allclose(
        TwoCovarianceReading(
            support + shift, support_labels, query + shift, 2, stats
        ).open_log_odds(),
        TwoCovarianceReading(support, support_labels, query, 2, stats).open_log_odds(),
    )


def test_batched_is_one_task_at_a_time_and_float32_is_float64():
    x, labels = _base()
    stats = fit_background(x, labels).blended(0.6, 0.3)
    support, support_labels, query = _task(n_tasks=4)
    batched = TwoCovarianceReading(support, support_labels, query, 2, stats, True).open_log_odds()
    for t in range(4):
        one = TwoCovarianceReading(
            support[t : t + 1], support_labels[t : t + 1], query[t : t + 1], 2, stats, True
        ).open_log_odds()
        torch.testing.assert_close(batched[t : t + 1], one)
    single = TwoCovarianceReading(
        support.float(), support_labels, query.float(), 2, stats, True
    ).open_log_odds()
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), batched, rtol=1e-4, atol=1e-3)


def test_a_query_at_the_queries_mean_stays_finite():
    """One query per task is its own mean: it becomes the zero row, read as any point."""
    x, labels = _base()
    stats = fit_background(x, labels)
    support, support_labels, query = _task()
    s, q = centre_on_queries(support, query[:, :1])
    assert torch.equal(q, torch.zeros_like(q))
    odds = TwoCovarianceReading(support, support_labels, query[:, :1], 2, stats, True)
    assert torch.isfinite(odds.open_log_odds()).all()
    torch.testing.assert_close(s.norm(dim=-1), torch.ones(s.shape[:2], dtype=s.dtype))


def test_a_shared_basis_reads_as_a_fresh_one():
    x, labels = _base()
    stats = fit_background(x, labels).blended(0.3, 0.3)
    support, support_labels, query = _task()
    first = TwoCovarianceReading(support, support_labels, query, 2, stats)
    again = TwoCovarianceReading(
        support[:, :2], support_labels[:, :2], query, 2, stats, basis=first.basis
    )
    fresh = TwoCovarianceReading(support[:, :2], support_labels[:, :2], query, 2, stats)
    torch.testing.assert_close(again.open_log_odds(), fresh.open_log_odds())


def test_the_inferred_background_is_the_dense_conjugate_predictive():
    """infer_background_mean: m_0 ~ N(m, B), the queries N(m_0, W + B) weighted by their
    open posterior o_q under the base-class background; the background becomes the
    predictive N(E m_0, W + B + Cov m_0), dense Gaussians against the basis."""
    x, labels = _base()
    stats = fit_background(x, labels).blended(0.3, 0.6)
    support, support_labels, query = _task()
    plain = TwoCovarianceReading(support, support_labels, query, 2, stats, True)
    odds = plain.open_log_odds()
    reading = TwoCovarianceReading(support, support_labels, query, 2, stats, True)
    assert reading.infer_background_mean(0.5, 0.3) is reading
    weight = open_responsibility(0.5 * odds, torch.full_like(odds, 0.3), 0.3)
    _, q = centre_on_queries(support, query)
    wc, bc, m = stats.within, stats.between, stats.mean
    total_inv = torch.linalg.inv(wc + bc)
    for t in range(query.shape[0]):
        precision = torch.linalg.inv(bc) + weight[t].sum() * total_inv
        cov = torch.linalg.inv(precision)
        mean = m + cov @ total_inv @ (weight[t].unsqueeze(-1) * (q[t] - m)).sum(0)
        want = MultivariateNormal(mean, wc + bc + cov).log_prob(q[t])
        torch.testing.assert_close(reading.background_log_lik()[t], want)
    torch.testing.assert_close(reading.class_log_lik(), plain.class_log_lik())
    with pytest.raises(RuntimeError, match="inferred already"):
        reading.infer_background_mean(0.5, 0.3)


# ------------------------------------------------------- the held-out choice of the blends
def _many_classes(dtype=torch.float64):
    return _base(n_classes=30, per_class=12, dim=6, seed=2, dtype=dtype)


@pytest.mark.parametrize("query_centring", [False, True])
def test_the_choice_is_the_smallest_held_out_log_loss_of_the_grid(query_centring):
    x, labels = _many_classes()
    grid = (0.0, 0.5, 1.0)
    got = select_open_reading(x, labels, 1e-3, query_centring, grid, tasks=8)
    losses = {}
    for a in grid:
        for b in grid:
            odds, is_open = held_out_open_log_odds(x, labels, 1e-3, 0, a, b, 8, query_centring)
            losses[a, b] = scale_and_log_loss(odds, is_open)
    best = min(losses, key=lambda pair: losses[pair][1])
    assert (got.within_mix, got.between_mix) == best
    assert got.odds_scale == losses[best][0]
    assert math.isclose(got.log_loss, losses[best][1], rel_tol=1e-12)


def test_a_grid_of_zero_is_the_temperature_of_the_unblended_background():
    x, labels = _many_classes()
    got = select_open_reading(x, labels, 1e-3, mix_grid=(0.0,), tasks=TASKS)
    assert (got.within_mix, got.between_mix) == (0.0, 0.0)
    assert got.odds_scale == fit_scale(*held_out_open_log_odds(x, labels, 1e-3))


def test_the_choice_in_float32_is_the_choice_in_float64():
    x, labels = _many_classes()
    high = select_open_reading(x, labels, 1e-3, tasks=8)
    low = select_open_reading(x.float(), labels, 1e-3, tasks=8)
    assert (low.within_mix, low.between_mix, low.odds_scale) == (
        high.within_mix,
        high.between_mix,
        high.odds_scale,
    )
    assert high.within_mix in MIX_GRID and high.between_mix in MIX_GRID


def test_classes_that_cannot_be_split_get_the_fixed_reading_in_both_frames():
    x, labels = _base(n_classes=4, per_class=6, dim=3)  # folds of one or two classes
    for got in select_open_readings(x, labels, 1e-3, (False, True)):
        assert got == UNSPLIT_READING
        assert (got.within_mix, got.between_mix, got.odds_scale, got.odds_shift) == (
            0.5,
            1.0,
            1.0,
            0.0,
        )
        assert got.log_loss == math.inf


@pytest.mark.parametrize("n_classes, held_out", [(5, False), (30, True)])
def test_an_estimator_says_when_its_background_was_not_chosen_on_held_out_classes(
    n_classes, held_out, tmp_path
):
    x, labels = _base(n_classes=n_classes, per_class=12, dim=6, seed=2)
    est = make_estimator("nearest-centroid").fit_base(x, labels)
    note = est.open_background_note()
    assert est.background_held_out_ is held_out
    assert (note is None) is held_out
    if not held_out:
        assert "too few" in note
        raw = BackgroundStats(est.background_mean_, est.background_within_, est.background_between_)
        want = raw.blended(0.5, 1.0)  # the reading a user is told about
        for query_centring in (False, True):
            for got, w in zip(est.background_stats(x, query_centring), want, strict=True):
                torch.testing.assert_close(got, w)
    path = tmp_path / "nc.pt"
    est.save(path)
    loaded = FewShotClassifier.load(path)
    assert loaded.background_held_out_ is held_out
    assert loaded.open_background_note() == note
    del est.background_held_out_  # as a file saved before the flag: no note
    est.save(path)
    assert FewShotClassifier.load(path).open_background_note() is None


# ------------------------------------------------------------------ the estimator
def test_an_estimator_keeps_its_blends_and_older_files_read_them_as_none(tmp_path):
    x, labels = _many_classes(torch.float32)
    est = make_estimator("nearest-centroid").fit_base(x, labels)
    # chosen when first needed (here: saving), the numbers of choosing at once
    assert not hasattr(est, "background_within_mix_")
    kept = est._background_base  # the preprocessed base features, kept until then
    state = est.fitted_state()
    _, inductive, query = held_out_background_choices(kept.features, kept.labels)
    assert state["background_within_mix_"] == inductive.within_mix
    assert state["background_query_odds_scale_"] == query.odds_scale
    for frame in ("background_", "background_query_"):
        assert getattr(est, frame + "within_mix_") in MIX_GRID
        assert getattr(est, frame + "between_mix_") in MIX_GRID
    raw = BackgroundStats(est.background_mean_, est.background_within_, est.background_between_)
    for query_centring, frame in ((False, "background_"), (True, "background_query_")):
        want = raw.blended(
            getattr(est, frame + "within_mix_"), getattr(est, frame + "between_mix_")
        )
        for got, w in zip(est.background_stats(x, query_centring), want, strict=True):
            torch.testing.assert_close(got, w)
    path = tmp_path / "nc.pt"
    est.save(path)
    loaded = FewShotClassifier.load(path)
    for name in ("within_mix_", "between_mix_", "query_within_mix_", "query_between_mix_"):
        assert getattr(loaded, "background_" + name) == getattr(est, "background_" + name)
    assert loaded.background_query_odds_scale_ == est.background_query_odds_scale_
    for name in ("within_mix_", "between_mix_", "query_within_mix_", "query_between_mix_"):
        delattr(est, "background_" + name)  # as a file saved before the blends were chosen
    del est.background_query_odds_scale_
    est.save(path)
    old = FewShotClassifier.load(path)
    for got, w in zip(old.background_stats(x), raw, strict=True):
        torch.testing.assert_close(got, w)


def _count_selections(monkeypatch) -> list:
    """The calls of ``select_open_readings`` from now on (each still computes)."""
    import probfsl.inference.open_temperature as open_temperature

    calls = []
    select = open_temperature.select_open_readings

    def counted(*args, **kwargs):
        calls.append(args)
        return select(*args, **kwargs)

    monkeypatch.setattr(open_temperature, "select_open_readings", counted)
    return calls


def test_the_held_out_choices_are_computed_once_per_base_classes(monkeypatch):
    """A search fits many estimators on the same base classes: the choices are the ones
    computed afresh, and computed once; other base classes are computed again."""
    from probfsl.models import base

    x, labels = _many_classes()
    base._BACKGROUND_CHOICES.clear()
    fresh = base.held_out_background_choices(x, labels)
    calls = _count_selections(monkeypatch)
    assert base.held_out_background_choices(x.clone(), labels.clone()) == fresh
    assert calls == []
    moved = x.clone()
    moved[0, 0] += 1.0  # other data: chosen again (both frames in one call)
    base.held_out_background_choices(moved, labels)
    assert len(calls) == 1
    base.held_out_background_choices(x.float(), labels)  # another dtype: chosen again
    assert len(calls) == 2


def test_the_held_out_choices_are_read_back_from_the_disk_cache(monkeypatch, tuning_cache_dir):
    """Another process (here: an emptied memory) reads the choices of the same base
    classes from the disk cache, exactly; another λ has choices of its own; a damaged
    entry is computed again; without a cache they are computed every time."""
    import json

    from probfsl.models import base

    x, labels = _many_classes()
    base._BACKGROUND_CHOICES.clear()
    fresh = base.held_out_background_choices(x, labels)
    [entry] = (tuning_cache_dir / "auto").glob("*.json")
    calls = _count_selections(monkeypatch)
    base._BACKGROUND_CHOICES.clear()
    assert base.held_out_background_choices(x.clone(), labels.clone()) == fresh
    assert calls == []
    base._BACKGROUND_CHOICES.clear()
    other = base.held_out_background_choices(x, labels, shrinkage=fresh[0] * 3)
    assert len(calls) == 1 and other[0] == fresh[0] * 3
    assert len(list((tuning_cache_dir / "auto").glob("*.json"))) == 2
    stored = json.loads(entry.read_text())
    stored["value"]["readings"] = [{"within_mix": "?"}]
    entry.write_text(json.dumps(stored))
    base._BACKGROUND_CHOICES.clear()
    assert base.held_out_background_choices(x, labels) == fresh
    assert len(calls) == 2
    monkeypatch.setenv("PROBFSL_CACHE_DIR", "off")
    base._BACKGROUND_CHOICES.clear()
    assert base.held_out_background_choices(x, labels) == fresh
    assert len(calls) == 3


def test_the_fallback_of_too_few_classes_is_neither_stored_nor_read_back(tuning_cache_dir):
    """Base classes too few to hold out get UNSPLIT_READING, computed at once and not
    stored; a fallback an older version stored (other blends, an infinite loss) is not
    read back as if it had been chosen."""
    import json

    from probfsl.models import base

    x, labels = _many_classes()
    few = labels < 4  # four classes: folds of one or two
    base._BACKGROUND_CHOICES.clear()
    shrinkage, *readings = base.held_out_background_choices(x[few], labels[few])
    assert readings == [UNSPLIT_READING, UNSPLIT_READING]
    assert not list((tuning_cache_dir / "auto").glob("*.json"))
    base.held_out_background_choices(x, labels)  # chosen on held-out classes: stored
    [entry] = (tuning_cache_dir / "auto").glob("*.json")
    stored = json.loads(entry.read_text())
    for reading in stored["value"]["readings"]:
        reading.update(within_mix=0.0, between_mix=0.0, log_loss=math.inf)
    entry.write_text(json.dumps(stored))
    base._BACKGROUND_CHOICES.clear()
    again = base.held_out_background_choices(x, labels)
    assert all(math.isfinite(r.log_loss) for r in again[1:])


# ------------------------------------------------------------ the held-out log-odds
@pytest.mark.parametrize("mixes", [(0.0, 0.0), (0.3, 0.6), (0.6, 1.0), (1.0, 0.3), (1.0, 1.0)])
@pytest.mark.parametrize("shot", [1, 3])
@pytest.mark.parametrize("n_classes, dim", [(8, 6), (3, 7)])
def test_the_low_rank_odds_are_the_reading_of_the_blended_statistics(mixes, shot, n_classes, dim):
    """BlendedOdds reads tasks at any blend, in the base frame and the queries' frame, as
    TwoCovarianceReading reads them under the blended statistics, with more classes than
    dimensions (a square factor) and fewer (a factor of rank C, the between-class
    covariance mostly the shrinkage's multiple of I)."""
    from probfsl.inference.blended_odds import BlendedOdds, HeldTasks, between_factor

    x, labels = _base(n_classes=n_classes, dim=dim)
    stats = fit_background(x, labels, 1e-2)
    odds = BlendedOdds(stats, between_factor(x, labels), 1e-2)
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(12, dim, generator=g, dtype=torch.float64)
    support = torch.randint(12, (4, 2 * shot), generator=g)
    query = torch.randint(12, (4, 5), generator=g)
    task_labels = torch.arange(2).repeat_interleave(shot).expand(4, -1)
    projected = odds.project(rows), odds.project(stats.mean)
    for frame in (False, True):
        s, q = rows[support], rows[query]
        norms = None
        if frame:
            centre = q.mean(-2, keepdim=True)
            norms = ((s - centre).norm(dim=-1).reciprocal(), (q - centre).norm(dim=-1).reciprocal())
            s, q = centre_on_queries(s, q)
        tasks = HeldTasks(*projected, support, query, norms)
        got = odds.open_log_odds(tasks, task_labels, 2, shot, *mixes)
        reading = TwoCovarianceReading(s, task_labels, q, 2, stats.blended(*mixes))
        torch.testing.assert_close(got, reading.open_log_odds(), rtol=1e-9, atol=1e-9)


def test_the_low_rank_odds_follow_the_statistics_dtype_and_agree_across_dtypes():
    """In float32 the held-out odds stay float32 and within rounding of float64's."""
    from probfsl.inference.open_temperature import held_out_open_log_odds

    x, labels = _base(n_classes=24, per_class=12, dim=20, seed=2)
    x = x - x.mean(0)
    high, opened = held_out_open_log_odds(x, labels, 1e-2, 0, 0.6, 0.3, 4, True)
    low, opened32 = held_out_open_log_odds(x.float(), labels, 1e-2, 0, 0.6, 0.3, 4, True)
    assert high.dtype == torch.float64 and low.dtype == torch.float32
    assert torch.equal(opened, opened32) and high.numel() > 0
    torch.testing.assert_close(low.double(), high, rtol=1e-4, atol=1e-3)


def test_the_between_factor_is_the_unshrunk_between_class_covariance():
    from probfsl.inference.blended_odds import between_factor

    x, labels = _base(n_classes=5, dim=7)
    factor = between_factor(x, labels)
    assert factor.shape == (7, 5)
    torch.testing.assert_close(factor @ factor.T, fit_background(x, labels, 0.0).between)


@pytest.mark.parametrize("mixes", [(0.0, 0.0), (0.6, 0.3), (1.0, 0.9), (0.3, 1.0)])
@pytest.mark.parametrize("n_classes, dim", [(30, 6), (24, 20)])
def test_held_out_odds_from_the_projected_rows_are_the_readings_of_the_episodes(
    mixes, n_classes, dim
):
    """The held-out episodes are read off each fold's rows projected once; their log-odds
    are those of a reading built from the episodes' own features, the blended statistics
    and, in the queries' frame, the features re-centred by hand (more classes than
    dimensions, and fewer)."""
    from probfsl.inference.open_temperature import _held_out_episodes, _open_log_odds

    x, labels = _base(n_classes=n_classes, per_class=12, dim=dim, seed=2)
    x = x - x.mean(0)
    episodes = _held_out_episodes(x, labels, 1e-2, 0, 4)
    assert episodes
    got = _open_log_odds(episodes, [mixes], (False, True))[mixes]
    for frame, (odds, is_open) in zip((False, True), got, strict=True):
        want, opened = [], []
        for batch in episodes:
            support, query = batch.rows[batch.support], batch.rows[batch.query]
            if frame:
                support, query = centre_on_queries(support, query)
            stats = batch.background.stats.blended(*mixes)
            reading = TwoCovarianceReading(support, batch.support_labels, query, batch.way, stats)
            want.append(reading.open_log_odds().reshape(-1))
            opened.append(batch.open_mask.reshape(-1))
        torch.testing.assert_close(odds, torch.cat(want), rtol=1e-9, atol=1e-9)
        assert torch.equal(is_open, torch.cat(opened))


def test_the_frames_chosen_together_are_the_frames_chosen_alone():
    """select_open_readings shares the episodes and one basis per fold and blend between
    the two frames; each frame's choice is the one select_open_reading makes alone."""
    from probfsl.inference.open_temperature import select_open_readings

    x, labels = _many_classes()
    x = x - x.mean(0)
    together = select_open_readings(x, labels, 1e-2, (False, True))
    alone = [select_open_reading(x, labels, 1e-2, frame) for frame in (False, True)]
    for a, b in zip(together, alone, strict=True):
        assert a[:3] == b[:3] and math.isclose(a.log_loss, b.log_loss, rel_tol=1e-12)


def test_the_reading_basis_is_computed_once_for_the_same_statistics(monkeypatch):
    """Two estimators fitted on the same base classes share the D x D factorisation of
    their reading (a search scores many); other statistics get their own."""
    import probfsl.inference.background as background
    from probfsl.models import base

    x, labels = _many_classes()
    calls = []
    diagonalise = background.two_covariance_basis
    monkeypatch.setattr(
        background, "two_covariance_basis", lambda s: calls.append(1) or diagonalise(s)
    )
    base._READING_BASES.clear()
    support, task_labels, query = _task(dim=x.shape[1])
    readings = []
    for _ in range(2):
        est = make_estimator("nearest-centroid").fit_base(x, labels)
        readings.append(est.open_reading(support, task_labels, query, 2))
    assert len(calls) == 1
    assert torch.equal(readings[0].open_log_odds(), readings[1].open_log_odds())
    moved = x.clone()
    moved[0] += 1.0
    est = make_estimator("nearest-centroid").fit_base(moved, labels)
    est.open_reading(support, task_labels, query, 2)
    assert len(calls) == 2


def test_on_separated_classes_float32_chooses_float64s_reading():
    """Held-out classes so far apart that the mean log loss of the best readings is below
    float32's smallest normal number: compared in the log domain, float32 chooses
    float64's blends and scale (the grid's largest, the maximum-likelihood scale on
    separated labels) and finds its shift."""
    x, labels = _base(n_classes=30, per_class=12, dim=64, seed=2)
    high = select_open_reading(x, labels, 1e-3, tasks=8)
    low = select_open_reading(x.float(), labels, 1e-3, tasks=8)
    assert 0 < high.log_loss < torch.finfo(torch.float32).tiny
    assert (low.within_mix, low.between_mix, low.odds_scale) == (
        high.within_mix,
        high.between_mix,
        high.odds_scale,
    )
    assert high.odds_scale == max(GRID)
    assert math.isclose(low.odds_shift, high.odds_shift, abs_tol=1e-3)
    assert math.isclose(low.log_loss, high.log_loss, rel_tol=1e-2)


def test_the_shift_of_separated_labels_is_the_root_found_in_the_log_domain():
    """Where every loss term underflows, the shift is still the root of the log loss's
    derivative, ln Σ_closed σ(z) = ln Σ_open σ(-z): for closed odds -400..-300 and open
    ones 296..396 (as many, spaced alike) it is 2, in float64 and in float32."""
    odds = torch.cat([torch.linspace(-400, -300, 50), torch.linspace(296, 396, 50)]).double()
    is_open = torch.arange(100) >= 50
    assert math.isclose(fit_shift(odds, is_open, 1.0), 2.0, abs_tol=1e-9)
    assert math.isclose(fit_shift(odds.float(), is_open, 1.0), 2.0, abs_tol=1e-4)


def test_the_shifts_bisection_stays_on_the_device():
    """The bisection of :func:`fit_shift` reads no value on the host inside its loop: its
    host synchronisations do not grow with the number of steps."""
    from probfsl.host_syncs import HostSyncCounter

    g = torch.Generator().manual_seed(5)
    odds = 3 * torch.randn(400, generator=g, dtype=torch.float64)
    is_open = torch.rand(400, generator=g, dtype=torch.float64) < torch.sigmoid(odds)
    counts = []
    for steps in (4, 64):
        with HostSyncCounter() as counter:
            fit_shift(odds, is_open, 0.5, steps=steps)
        counts.append(counter.total)
    assert counts[0] == counts[1] <= 3
