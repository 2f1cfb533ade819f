"""Free components of the transductive open-set mixtures (soft k-means and BAVARDAGE's
VB), and the open-set search on base-class episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probfsl import tuning
from probfsl.data import load_dataset, sample_episodes
from probfsl.inference.soft_kmeans import soft_kmeans_gram_open
from probfsl.inference.vb_mixture import BavardageVB
from probfsl.inference.vb_mixture_open import BavardageOpenVB, OpenBackground
from probfsl.methods import build_estimator
from probfsl.tuning import OPEN_SEARCH_SPACES, _best_row, _row, tune

WAY, SHOT, QUERY = 3, 2, 12
#: log-odds at which the background's responsibility underflows to 0 in float64
NO_BACKGROUND = -1e4


def _task(n_tasks: int = 4, dim: int = 6, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    support = torch.randn(n_tasks, WAY * SHOT, dim, generator=gen, dtype=dtype)
    query = torch.randn(n_tasks, QUERY, dim, generator=gen, dtype=dtype)
    labels = torch.arange(WAY).repeat(SHOT).expand(n_tasks, -1)
    odds = torch.randn(n_tasks, QUERY, generator=gen, dtype=dtype)
    return support, labels, query, odds


def _reference_soft_kmeans(x, labels, way, n_free, odds, temperature, n_iter):
    """Soft k-means with K labelled classes and J free clusters, written with explicit
    centroids (one task, no Gram matrix), the background's weight zero: the free cluster
    j starts at the query of rank j by ``odds``."""
    n_s = labels.shape[0]
    q = x.shape[0] - n_s
    seeds = torch.argsort(odds, descending=True)[:n_free]
    weights = torch.zeros(x.shape[0], way + n_free, dtype=x.dtype)
    weights[torch.arange(n_s), labels] = 1.0
    weights[n_s + seeds, way + torch.arange(n_free)] = 1.0
    for _ in range(n_iter):
        centroids = (weights / weights.sum(0)).T @ x
        dist = ((x[:, None] - centroids[None]) ** 2).sum(-1)
        p = torch.softmax(-temperature * dist, -1)
        p[:n_s] = 0.0
        p[torch.arange(n_s), labels] = 1.0
        weights = p
    assert q == odds.shape[0]
    return p


# ------------------------------------------------------------------ soft k-means
def test_soft_kmeans_free_components_without_background_are_soft_kmeans():
    """With the background's weight at zero, soft k-means with J free components is
    soft k-means over K + J clusters whose J free ones start at the queries ranked most
    open (brute force, explicit centroids)."""
    support, labels, query, odds = _task()
    x = torch.cat([support, query], 1)
    n_free = 2
    got = soft_kmeans_gram_open(
        x @ x.transpose(1, 2),
        labels,
        WAY,
        None,
        temperature=3.0,
        n_iter=4,
        open_log_odds=odds + NO_BACKGROUND,
        n_free=n_free,
    )
    assert got.shape == (4, WAY * SHOT + QUERY, WAY + n_free + 1)
    torch.testing.assert_close(got[..., -1], torch.zeros_like(got[..., -1]))
    for t in range(4):
        want = _reference_soft_kmeans(x[t], labels[t], WAY, n_free, odds[t], 3.0, 4)
        torch.testing.assert_close(got[t, :, :-1], want)


def test_soft_kmeans_without_free_components_is_unchanged():
    """n_free=0 gives the K + 1 columns of the background model, rows summing to one."""
    support, labels, query, odds = _task()
    x = torch.cat([support, query], 1)
    gram = x @ x.transpose(1, 2)
    p = soft_kmeans_gram_open(gram, labels, WAY, None, open_log_odds=odds)
    assert p.shape[-1] == WAY + 1
    torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_free": -1}, "non-negative"),
        ({"n_free": 1.5}, "non-negative"),
        ({"n_free": QUERY + 1}, "cannot exceed"),
        ({"n_free": 2, "without_odds": True}, "open_log_odds"),
    ],
)
def test_soft_kmeans_free_components_bad_input(kwargs, message):
    support, labels, query, odds = _task()
    x = torch.cat([support, query], 1)
    gram = x @ x.transpose(1, 2)
    without = kwargs.pop("without_odds", False)
    background = torch.zeros(x.shape[:2], dtype=x.dtype)
    with pytest.raises(ValueError, match=message):
        soft_kmeans_gram_open(
            gram, labels, WAY, background, open_log_odds=None if without else odds, **kwargs
        )


# ------------------------------------------------------------------ VB engine
def _engines(n_free: int, odds: torch.Tensor, balanced: bool):
    background = OpenBackground(torch.zeros_like(odds), None, odds.shape[-1], open_log_odds=odds)
    kw = dict(tau=2.0, alpha0=2.0, beta0=5.0, balanced=balanced, projection="identity")
    return BavardageOpenVB(WAY, background, 0.5, n_free, **kw), kw


@pytest.mark.parametrize("balanced", [False, True])
def test_open_vb_without_background_is_the_closed_model_with_k_plus_j(balanced):
    """With the background's weight at zero, the open engine with J free components runs
    BAVARDAGE's closed VB with K + J components (the J without support): the same query
    responsibilities after every iteration."""
    from probfsl.inference.vb_mixture import fit_bavardage_vb

    support, labels, query, odds = _task()
    n_free = 2
    x = torch.cat([support, query], 1)
    init = soft_kmeans_gram_open(
        x @ x.transpose(1, 2),
        labels,
        WAY,
        None,
        open_log_odds=odds + NO_BACKGROUND,
        n_free=n_free,
    )
    engine, kw = _engines(n_free, odds + NO_BACKGROUND, balanced)
    state, _ = fit_bavardage_vb(engine, support, labels, query, init, 4)
    closed = BavardageVB(WAY + n_free, **kw)
    closed._check = lambda *args: None  # the free components have no support rows
    want, _ = fit_bavardage_vb(closed, support, labels, query, init[..., :-1], 4)
    torch.testing.assert_close(state.query_resp, want.query_resp)
    torch.testing.assert_close(state.open_resp, torch.zeros_like(state.open_resp))
    # P(none of the K classes) is the free components' mass here
    proba = state.open_proba
    assert proba.shape == (4, QUERY, WAY + 1)
    torch.testing.assert_close(proba[..., -1], want.query_resp[..., WAY:].sum(-1))


def test_open_vb_free_components_rows_and_batching():
    """Rows of open_proba sum to one; batched tasks equal tasks run one at a time."""
    from probfsl.inference.vb_mixture import fit_bavardage_vb

    support, labels, query, odds = _task()
    n_free = 2
    x = torch.cat([support, query], 1)
    init = soft_kmeans_gram_open(
        x @ x.transpose(1, 2), labels, WAY, None, open_log_odds=odds, n_free=n_free
    )
    engine, _ = _engines(n_free, odds, False)
    state, _ = fit_bavardage_vb(engine, support, labels, query, init, 3)
    p = state.open_proba
    torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))
    assert state.component_proba.shape == (4, QUERY, WAY + n_free + 1)
    for t in range(4):
        one, _ = _engines(n_free, odds[t : t + 1], False)
        s1, _ = fit_bavardage_vb(
            one, support[t : t + 1], labels[t : t + 1], query[t : t + 1], init[t : t + 1], 3
        )
        torch.testing.assert_close(s1.open_proba, p[t : t + 1])


def test_open_vb_bad_input():
    support, labels, query, odds = _task()
    background = OpenBackground(torch.zeros_like(odds), None, 6, open_log_odds=odds)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="n_free"):
            BavardageOpenVB(WAY, background, n_free=bad)
    no_odds = OpenBackground(torch.zeros_like(odds), None, 6)
    with pytest.raises(ValueError, match="open_log_odds"):
        BavardageOpenVB(WAY, no_odds, n_free=2)
    engine = BavardageOpenVB(WAY, background, n_free=2, projection="identity")
    wrong = torch.full((4, WAY * SHOT + QUERY, WAY + 1), 0.25, dtype=support.dtype)
    with pytest.raises(ValueError, match="K \\+ J \\+ 1"):
        engine.init(support, labels, query, wrong)


# ------------------------------------------------------------------ the estimator
@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


def test_bavardage_free_components_dtype_agreement(omniglot):
    """float32 and float64 give the same open-set probabilities (to float32 precision)."""
    est = build_estimator("bavardage", whitening="global", n_free=3).fit_featureset(omniglot)
    episodes = sample_episodes(omniglot, 3, WAY, SHOT, 9, seed=2, n_open=9)
    p64 = est.predict_proba_open(episodes.to(dtype=torch.float64))
    p32 = est.predict_proba_open(episodes.to(dtype=torch.float32))
    assert p32.dtype == torch.float32 and p64.dtype == torch.float64
    torch.testing.assert_close(p32.double(), p64, atol=2e-3, rtol=0)


def test_bavardage_n_free_zero_is_the_background_model(omniglot):
    """n_free=0 leaves the K + 1 columns of the background alone; free components move
    mass from the classes to the last column, never the rows' sum."""
    episodes = sample_episodes(omniglot, 3, WAY, SHOT, 9, seed=2, n_open=9).to(dtype=torch.float64)
    est0 = build_estimator("bavardage", n_free=0).fit_featureset(omniglot, torch.float64)
    est3 = est0.with_params(n_free=3)
    problem = est0.open_problem(episodes)
    assert problem.resp.shape[-1] == WAY + 1
    assert est3.open_problem(episodes).resp.shape[-1] == WAY + 3 + 1
    for est in (est0, est3):
        p = est.predict_proba_open(episodes)
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]))
    with pytest.raises(ValueError, match="n_free"):
        build_estimator("bavardage", n_free=-1).fit_featureset(omniglot).predict_proba_open(
            episodes
        )


# ------------------------------------------------------------------ the search
def test_row_of_open_set_episodes_scores_the_known_class_queries():
    """Accuracy counts the known-class queries only, the NLL is that of the K + 1
    outcomes, and the AUROC is the open queries' (known answers)."""
    labels = torch.tensor([[0, 1, 0, 2]])  # K = 2 classes; the last query is open
    mask = labels == 2
    proba = torch.tensor(
        [[[0.6, 0.2, 0.2], [0.7, 0.2, 0.1], [0.05, 0.15, 0.8], [0.3, 0.3, 0.4]]],
        dtype=torch.float64,
    )
    row = _row({}, proba, labels, mask)
    # known-class queries 0, 1, 2: right, wrong (argmax 0), wrong (argmax 1)
    assert row["queries"] == 3 and row["errors"] == 2
    assert row["accuracy"] == pytest.approx(100 / 3)
    nll = -np.log([0.6, 0.2, 0.05, 0.4]).mean()
    assert row["nll"] == pytest.approx(nll)
    # the open query's P(open) 0.4 against 0.2, 0.1 and 0.8
    assert row["auroc"] == pytest.approx(100 * 2 / 3)


def test_best_open_row_is_the_most_accurate():
    """Open-set rows rank by the known-class queries' accuracy (AUROC reported only)."""
    rows = [
        {"params": {"a": 1}, "accuracy": 70.0, "ci95": 2.0, "nll": 1.0, "auroc": 60.0},
        {"params": {"a": 2}, "accuracy": 69.0, "ci95": 2.0, "nll": 0.5, "auroc": 65.0},
    ]
    assert _best_row(rows)["params"] == {"a": 1}


def test_tune_with_open_queries(omniglot):
    """The search on base episodes with open queries scores predict_proba_open (rows with
    an AUROC) and tries the open-set hyperparameters at its best candidate."""
    space = {"temperature_vb": [0.3, 1.0]}
    result = tune(
        "bavardage",
        omniglot,
        space,
        way=WAY,
        shot=1,
        n_query=9,
        n_episodes=8,
        refine=False,
        fixed={"whitening": "global", "scale": "relative"},
        open_queries=9,
    )
    assert all("auroc" in row for row in result.trace)
    tried = {row["params"].get("open_frame") for row in result.trace}
    assert set(OPEN_SEARCH_SPACES["bavardage"]["open_frame"]) <= tried
    assert "n_free" not in OPEN_SEARCH_SPACES["bavardage"]  # P(open) of free components
    assert result.best["whitening"] == "global"
    # a value the caller fixes is kept, not searched
    kept = tune(
        "bavardage",
        omniglot,
        {"temperature_vb": [1.0]},
        way=WAY,
        shot=1,
        n_query=9,
        n_episodes=8,
        refine=False,
        fixed={"whitening": "global", "scale": "relative", "open_frame": "queries"},
        open_queries=9,
    )
    assert {row["params"].get("open_frame") for row in kept.trace} == {None}
    assert kept.best["open_frame"] == "queries"
    with pytest.raises(ValueError, match="criterion"):
        tune("bavardage", omniglot, space, n_episodes=8, criterion="objective", open_queries=9)
    with pytest.raises(ValueError, match="open_queries"):
        tune("bavardage", omniglot, space, n_episodes=8, open_queries=-1)


# ------------------------------------------------------------------ P(open)'s temperature
def test_temper_open_scales_and_shifts_the_log_odds_and_keeps_the_known_ratios():
    from probfsl.inference.vb_mixture_open import temper_open

    gen = torch.Generator().manual_seed(3)
    proba = torch.softmax(torch.randn(2, 7, WAY + 1, generator=gen, dtype=torch.float64), -1)
    assert temper_open(proba, 1.0) is proba
    assert temper_open(proba, 1.0, 0.0) is proba
    logit = torch.logit(proba[..., -1])
    ratios = proba[..., :-1] / proba[..., :-1].sum(-1, keepdim=True)
    for scale, shift in ((0.3, 0.0), (1.0, 0.7), (0.3, -1.2)):
        out = temper_open(proba, scale, shift)
        torch.testing.assert_close(out.sum(-1), torch.ones_like(out[..., 0]))
        torch.testing.assert_close(torch.logit(out[..., -1]), scale * logit + shift)
        torch.testing.assert_close(out[..., :-1] / out[..., :-1].sum(-1, keepdim=True), ratios)
        assert torch.equal(out[..., -1].argsort(-1), proba[..., -1].argsort(-1))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            temper_open(proba, bad)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite"):
            temper_open(proba, 1.0, bad)


def test_fit_open_scale_recovers_the_scale_of_the_labels():
    """Labels drawn with P(open) = σ(a0 (l + β)) for log-odds l: the Brier score (a proper
    score) of σ(a (l + β)) is least near a = a0; with a shift b given, of σ(a l + b)."""
    from probfsl.tuning import fit_open_scale

    gen = torch.Generator().manual_seed(0)
    logit = 4 * torch.randn(200, 500, generator=gen, dtype=torch.float64)
    for bias in (0.0, 3.0, -6.0):
        is_open = torch.rand(logit.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(
            0.25 * (logit + bias)
        )
        got = fit_open_scale(logit, is_open, bias)
        assert got == pytest.approx(0.25, rel=0.15), bias
        if bias:  # the bias not taken out: another scale fits the labels best
            assert fit_open_scale(logit, is_open) != got
        assert fit_open_scale(logit, is_open, shift=0.25 * bias) == got
    with pytest.raises(ValueError, match="is_open"):
        fit_open_scale(logit, is_open[:1])
    with pytest.raises(ValueError, match="NaN"):
        fit_open_scale(torch.full_like(logit, float("nan")), is_open)


def test_the_scale_is_learnt_from_log_odds_beyond_single_precision():
    """Transductive log-odds run to hundreds on wide features (the held-out scale a_h was
    0.025 on 2,048-d ones), where a float32 P(open) is 0 or 1: the scale is fitted on the
    log-odds themselves, so float32 log-odds of ±500 give float64's a."""
    from probfsl.tuning import fit_open_scale

    gen = torch.Generator().manual_seed(3)
    logit = 150 * torch.randn(200, 150, generator=gen, dtype=torch.float64)
    truth = torch.sigmoid(0.02 * (logit + 10.0))
    is_open = torch.rand(logit.shape, generator=gen, dtype=torch.float64) < truth
    assert (logit.abs() > 90).double().mean() > 0.4  # beyond what a float32 P(open) holds
    want = fit_open_scale(logit, is_open, 10.0)
    assert want == pytest.approx(0.02, rel=0.3)
    assert fit_open_scale(logit.float(), is_open, 10.0) == want


def test_fit_open_scale_and_shift_recovers_platts_parameters():
    """Labels drawn with P(open) = σ(a0 l + b0): the (a, b) of least Brier score lie near
    (a0, b0), the Brier score returned is that of σ(a l + b), and no point of the
    grid scores lower (brute force)."""
    from probfsl.inference.open_temperature import GRID
    from probfsl.tuning import fit_open_scale_and_shift, open_brier

    gen = torch.Generator().manual_seed(1)
    logit = 4 * torch.randn(300, 150, generator=gen, dtype=torch.float64)
    for a0, b0 in ((0.25, 2.5), (1.0, -1.0), (0.1, 0.0)):
        is_open = torch.rand(logit.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(
            a0 * logit + b0
        )
        a, b, brier = fit_open_scale_and_shift(logit, is_open)
        assert a == pytest.approx(a0, rel=0.3) and b == pytest.approx(b0, abs=0.3), (a0, b0)
        assert brier == pytest.approx(open_brier(logit, is_open, a, b))
        for scale in GRID:
            for shift in (-5.0, -2.5, -1.0, 0.0, 1.0, 2.5, 5.0, b0 - 0.1, b0 + 0.1):
                assert brier <= open_brier(logit, is_open, scale, shift) + 1e-12
    with pytest.raises(ValueError, match="is_open"):
        fit_open_scale_and_shift(logit, is_open[:1])


@pytest.mark.parametrize(("b0", "learns_shift"), [(0.0, False), (3.0, True)])
def test_the_search_learns_a_shift_only_where_the_episodes_clearly_ask(b0, learns_shift):
    """learn_open_calibration keeps the scale with the held-out bias where a shift of its
    own lowers the Brier score little (labels of σ(0.5 (l + β))), and learns (a, b) where
    the posterior is biased beyond it (labels of σ(0.5 l + b0), b0 = 3); a shift given is
    kept, never learnt."""
    from probfsl.tuning import SHIFT_GAIN, learn_open_calibration, open_brier

    gen = torch.Generator().manual_seed(2)
    logit = 3 * torch.randn(300, 150, generator=gen, dtype=torch.float64)
    bias = 0.4
    truth = 0.5 * logit + (b0 if b0 else 0.5 * bias)
    is_open = torch.rand(logit.shape, generator=gen, dtype=torch.float64) < torch.sigmoid(truth)
    params, note = learn_open_calibration(logit, is_open, bias)
    assert ("open_shift" in params) == learns_shift, note
    scale = params["open_scale"]
    held = open_brier(logit, is_open, scale, scale * bias)
    if learns_shift:
        assert params["open_shift"] == pytest.approx(b0, abs=0.3)
        assert open_brier(logit, is_open, scale, params["open_shift"]) < (1 - SHIFT_GAIN) * held
        assert "open_shift" in note
    given, _ = learn_open_calibration(logit, is_open, bias, shift=1.0)
    assert list(given) == ["open_scale"]


def test_auto_preset_with_open_queries_learns_open_scale(omniglot, monkeypatch):
    """preset auto for an open-set run: the search on base episodes with open queries
    says so, and the choice carries the scale of P(open) learnt there (its shift, a times
    the held-out bias, is the estimator's default); a value given is kept."""
    from probfsl.inference.open_temperature import GRID
    from probfsl.tuning import SEARCH_SPACES, auto_preset

    monkeypatch.setitem(SEARCH_SPACES, "soft-kmeans", {"temperature": [10.0]})  # one fit
    choice = auto_preset(
        "soft-kmeans", omniglot, WAY, 1, 9, n_episodes=20, open_queries=9, cache=False
    )
    assert "open queries" in choice.note
    assert all("auroc" in row for row in choice.result.trace)
    assert choice.method is None  # soft k-means runs (not nearest centroid)
    assert choice.params["open_scale"] in GRID and "open_shift" not in choice.params
    for given in ({"open_scale": 1.0}, {"open_scale": 1.0, "open_shift": 0.0}):
        fixed = auto_preset(
            "soft-kmeans",
            omniglot,
            WAY,
            1,
            9,
            n_episodes=20,
            fixed=given,
            open_queries=9,
            cache=False,
        )
        assert all(fixed.params[k] == v for k, v in given.items())
        assert fixed.params.keys() <= {"temperature", "open_frame", *given}


def test_auto_preset_with_few_base_classes_searches_fewer_known_classes(monkeypatch):
    """With 10 base classes, 5 play novel ones in the search: 5-way base episodes leave
    no class for open queries, so the search runs on 3-way ones with 2 open classes (and
    learns open_scale there) instead of on closed episodes; the note says so, and the
    cache tells the two apart."""
    from probfsl.inference.open_temperature import GRID
    from probfsl.tuning import SEARCH_SPACES, auto_preset
    from tests.conftest import make_featureset

    monkeypatch.setitem(SEARCH_SPACES, "soft-kmeans", {"temperature": [10.0]})
    fs = make_featureset(n_base=10, n_novel=8, per_class=40, dim=16, spread=1.5)
    seen = []
    real = tuning.tune

    def spy(*args, **kwargs):
        seen.append((args[3:6], kwargs["open_queries"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning, "tune", spy)
    choice = auto_preset("soft-kmeans", fs, 5, 1, 75, n_episodes=10, open_queries=75)
    assert seen == [((3, 1, 45), 45)]
    assert "cannot hold 75 open queries" in choice.note and "3-way 1-shot 45-query" in choice.note
    assert choice.params["open_scale"] in GRID
    again = auto_preset("soft-kmeans", fs, 5, 1, 75, n_episodes=10, open_queries=75)
    assert again.params == choice.params and len(seen) == 1  # read from the cache


def test_cli_tune_with_open_queries(capsys, monkeypatch):
    """``probfsl tune --open-queries N`` searches on base episodes with open queries: the
    trace has the AUROC column, the note says so, and the choice carries open_scale."""
    from probfsl.cli import main
    from probfsl.tuning import SEARCH_SPACES

    monkeypatch.setitem(SEARCH_SPACES, "soft-kmeans", {"temperature": [3.0, 10.0]})
    argv = ["tune", "--method", "soft-kmeans", "--dataset", "omniglot", "--episodes", "20"]
    assert main([*argv, "--open-queries", "15", "--query", "15"]) == 0
    captured = capsys.readouterr()
    assert "auroc" in captured.out and "open_scale" in captured.out
    assert "15 open queries" in captured.err
    with pytest.raises(SystemExit):  # argparse refuses it
        main([*argv, "--open-queries", "-1"])
