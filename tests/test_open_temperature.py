"""The temperature and shift of the inductive open log-odds: their fits recover a known
scale and the log loss's minimum, they leave the ranking of the queries alone, the
held-out episodes are what they claim, and the fallbacks."""

from __future__ import annotations

import math

import torch

from probfsl import make_estimator
from probfsl.evaluation.open_set import auroc
from probfsl.inference.background import open_posterior
from probfsl.inference.background_shrinkage import class_folds
from probfsl.inference.open_temperature import (
    GRID,
    MAX_SHIFT,
    _episodes,
    fit_scale,
    fit_shift,
    held_out_open_log_odds,
    select_open_temperature,
)
from probfsl.models.base import FewShotClassifier, episodes_from_arrays


def _classes(n_classes, per_class, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    means = 2 * torch.randn(n_classes, dim, generator=g, dtype=torch.float64)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    return means[labels] + torch.randn(len(labels), dim, generator=g, dtype=torch.float64), labels


def test_the_fit_recovers_the_scale_that_made_the_labels():
    g = torch.Generator().manual_seed(0)
    odds = 8 * torch.randn(40000, generator=g, dtype=torch.float64)
    for true in (0.1, 0.3, 1.0):
        is_open = torch.rand(40000, generator=g, dtype=torch.float64) < torch.sigmoid(true * odds)
        got = fit_scale(odds, is_open)
        nearest = min(GRID, key=lambda a: abs(math.log(a / true)))
        assert abs(math.log(got / nearest)) <= math.log(GRID[1] / GRID[0]) + 1e-9, (true, got)


def _log_loss(odds, is_open, scale, shift):
    logits = scale * odds + shift + torch.logit(is_open.double().mean())
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, is_open.double()).item()


def test_the_shift_is_the_log_loss_minimum_and_recovers_the_one_that_made_the_labels():
    g = torch.Generator().manual_seed(3)
    odds = 4 * torch.randn(40000, generator=g, dtype=torch.float64)
    for true in (-1.5, 0.0, 2.0):
        is_open = torch.rand(40000, generator=g, dtype=torch.float64) < torch.sigmoid(
            0.5 * odds + true
        )
        got = fit_shift(odds, is_open, 0.5)
        fraction = is_open.double().mean()
        # the first-order condition: the calibrated P(open) averages the open fraction
        mean_p = torch.sigmoid(0.5 * odds + got + torch.logit(fraction)).mean()
        assert abs(mean_p - fraction) < 1e-9
        grid = torch.linspace(-5, 5, 2001).tolist()
        brute = min(grid, key=lambda b: _log_loss(odds, is_open, 0.5, b))
        assert abs(got - brute) <= 0.005 + 1e-9
        # the labels' own intercept is b + logit f (f the open fraction the fit takes out)
        assert abs(got + torch.logit(fraction).item() - true) < 0.1, (true, got)


def test_the_shift_falls_back_to_zero_and_stays_bounded():
    odds = torch.tensor([1.0, -1.0, math.inf, math.nan], dtype=torch.float64)
    assert fit_shift(odds, torch.tensor([True, True, False, False]), 1.0) == 0.0  # one kind
    assert fit_shift(odds[2:], torch.tensor([True, False]), 1.0) == 0.0  # none finite
    # labels that no shift can fit: all open where the odds say closed
    odds = -torch.ones(100, dtype=torch.float64)
    is_open = torch.arange(100) < 99
    assert fit_shift(odds, is_open, 1.0) <= MAX_SHIFT


def test_a_shift_is_a_change_of_the_prior_odds():
    g = torch.Generator().manual_seed(4)
    class_ll = torch.randn(2, 6, 3, generator=g, dtype=torch.float64) * 4
    background_ll = torch.randn(2, 6, generator=g, dtype=torch.float64) * 4
    prior, shift = 0.3, -1.2
    moved = torch.sigmoid(torch.tensor(shift + math.log(prior / (1 - prior)))).item()
    torch.testing.assert_close(
        open_posterior(class_ll, background_ll, prior, 1.0, shift),
        open_posterior(class_ll, background_ll, moved),
    )


def test_scale_one_is_bayes_rule_and_any_scale_keeps_the_ranking():
    g = torch.Generator().manual_seed(1)
    class_ll = torch.randn(3, 7, 4, generator=g, dtype=torch.float64) * 5
    background_ll = torch.randn(3, 7, generator=g, dtype=torch.float64) * 5
    prior = 0.3
    joint = torch.cat(
        [
            (class_ll + math.log((1 - prior) / 4)).exp(),
            (background_ll + math.log(prior)).exp().unsqueeze(-1),
        ],
        -1,
    )
    torch.testing.assert_close(
        open_posterior(class_ll, background_ll, prior), joint / joint.sum(-1, keepdim=True)
    )
    is_open = torch.rand(3, 7, generator=g) < 0.5
    is_open[:, 0], is_open[:, 1] = True, False
    tempered = open_posterior(class_ll, background_ll, prior, 0.2)
    torch.testing.assert_close(tempered.sum(-1), torch.ones(3, 7, dtype=torch.float64))
    plain = open_posterior(class_ll, background_ll, prior)
    torch.testing.assert_close(auroc(tempered[..., -1], is_open), auroc(plain[..., -1], is_open))
    # the known columns keep the classes' order
    assert torch.equal(tempered[..., :-1].argmax(-1), class_ll.argmax(-1))


def test_held_out_episodes_keep_known_and_open_classes_apart():
    _, labels = _classes(12, 20, 3)
    inverse, fold_of, _ = class_folds(labels)
    fold_classes = (fold_of == 0).nonzero().squeeze(1)
    support, query, support_labels, open_mask = _episodes(
        fold_classes, inverse, 5, 1, torch.Generator().manual_seed(0)
    )
    way = int(support_labels.max()) + 1
    assert way == min(5, len(fold_classes) - 1)
    for t in range(support.shape[0]):
        known = inverse[support[t]]
        assert torch.isin(inverse[query[t]], fold_classes).all()
        assert torch.isin(inverse[query[t][~open_mask[t]]], known).all()
        assert not torch.isin(inverse[query[t][open_mask[t]]], known).any()
        assert open_mask[t].sum() == (~open_mask[t]).sum()
        assert len(torch.unique(known)) == way
        for j in range(way):  # a support label names one class
            assert inverse[support[t]][support_labels[t] == j].unique().numel() == 1


def test_too_few_classes_leave_the_odds_alone():
    x, labels = _classes(4, 6, 3)  # folds of one or two classes: no episode
    odds, is_open = held_out_open_log_odds(x, labels, 1e-3)
    assert odds.numel() == 0 and is_open.numel() == 0
    assert select_open_temperature(x, labels, 1e-3) == 1.0


def test_an_estimator_keeps_its_scale_and_shift_and_older_files_read_the_odds_as_they_are(
    tmp_path,
):
    x, labels = _classes(30, 12, 8, seed=2)
    est = make_estimator("nearest-centroid").fit_base(x.float(), labels)
    est.fitted_state()  # the held-out choices are made on first need (here: saving)
    assert est.background_odds_scale_ in GRID
    assert est.background_odds_shift_ != 0.0 and abs(est.background_odds_shift_) <= MAX_SHIFT
    path = tmp_path / "nc.pt"
    est.save(path)
    loaded = FewShotClassifier.load(path)
    assert loaded.background_odds_scale_ == est.background_odds_scale_
    assert loaded.background_odds_shift_ == est.background_odds_shift_
    del est.background_odds_scale_, est.background_odds_shift_  # as a file saved before
    est.save(path)
    loaded = FewShotClassifier.load(path)
    assert not hasattr(loaded, "background_odds_scale_")
    assert not hasattr(loaded, "background_odds_shift_")


def test_the_inductive_reading_adds_the_shift_to_the_scaled_odds():
    x, labels = _classes(30, 12, 8, seed=5)
    est = make_estimator("nearest-centroid").fit_base(x[labels < 20], labels[labels < 20])
    known = torch.nonzero(labels >= 27).squeeze(1)  # three novel classes, 12 rows each
    support = x[known[::12]]
    query = torch.cat([x[known], x[labels == 25]])  # and an open class (float64)
    episodes, _, _ = episodes_from_arrays(support, labels[known[::12]] - 27, query)
    p = est.predict_proba_open(episodes)[..., -1].double()
    est.background_odds_shift_ += 1.5
    shifted = est.predict_proba_open(episodes)[..., -1].double()
    torch.testing.assert_close(torch.logit(shifted) - torch.logit(p), torch.full_like(p, 1.5))


def test_infinite_odds_are_left_out_of_the_fit():
    odds = torch.tensor([math.inf, -math.inf, math.nan, 2.0, -2.0], dtype=torch.float64)
    is_open = torch.tensor([True, False, True, True, False])
    assert fit_scale(odds, is_open) == fit_scale(odds[3:], is_open[3:])
    assert fit_scale(odds[:3], is_open[:3]) == 1.0
