"""The few-shot open-set recognition protocol: open queries in the sampled tasks, the
metrics of probfsl.evaluation.open_set (against scikit-learn), ``probfsl run
--open-queries`` and the sweep grid's ``open`` axis."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import rankdata
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

from probfsl.cli import main
from probfsl.data import (
    episodes_from_indices,
    iter_episodes,
    load_dataset,
    load_task_file,
    sample_episodes,
    sample_task_indices,
    save_task_file,
)
from probfsl.data.preprocess import center_and_normalize
from probfsl.data.task_files import TaskFile
from probfsl.data.tasks import Episodes
from probfsl.evaluation.open_set import (
    KNNDistanceBaseline,
    MaxSoftmaxBaseline,
    auroc,
    average_precision,
    average_ranks,
    evaluate_open_set,
    open_ece,
    open_set_baselines,
    open_set_per_task,
    open_set_scores,
    precision_at_recall,
)
from probfsl.models.nearest_centroid import NearestCentroid
from probfsl.sweeps.cell import run_cell
from probfsl.sweeps.config import config_from_dict
from probfsl.sweeps.report import open_set_table, write_report

# --- a stub open-set posterior (until every method has its own) --------------------------


def _stub_proba_open(self, episodes: Episodes) -> torch.Tensor:
    """Nearest centroid's probabilities times P(known), P(open) rising with the distance
    of the query to its nearest support sample: a posterior over K + 1 columns."""
    mean = self.checked_centring_mean(episodes)
    support = center_and_normalize(episodes.support, mean)
    query = center_and_normalize(episodes.query, mean)
    nearest = torch.cdist(query, support).min(-1).values
    p_open = torch.sigmoid(8 * (nearest - 0.8)).unsqueeze(-1)
    return torch.cat([self.predict_proba(episodes) * (1 - p_open), p_open], -1)


@pytest.fixture
def open_posterior(monkeypatch):
    """Nearest centroid with ``predict_proba_open``: its own where it has one, else the
    stub above."""
    if not hasattr(NearestCentroid, "predict_proba_open"):
        monkeypatch.setattr(NearestCentroid, "predict_proba_open", _stub_proba_open, raising=False)
    return NearestCentroid


class _Oracle:
    """Knows which queries are open: a perfect posterior."""

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        return torch.nn.functional.one_hot(episodes.query_labels, episodes.way + 1).float()


class _Coin:
    """Scores at random: AUROC about one half."""

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        shape = (episodes.n_tasks, episodes.n_query, episodes.way + 1)
        return torch.softmax(torch.randn(shape, generator=g), -1)


# --- sampling ----------------------------------------------------------------------------


@pytest.mark.parametrize("balance", ["balanced", "dirichlet"])
def test_open_queries_come_from_other_classes_of_the_split(synthetic, balance):
    ep = sample_episodes(
        synthetic, 12, way=3, shot=2, n_query=12, n_open=12, balance=balance, seed=3
    )
    assert ep.query.shape == (12, 24, 5) and ep.classes.shape == (12, 3)
    assert ep.open_mask.dtype == torch.bool and ep.open_mask.shape == (12, 24)
    assert torch.equal(ep.open_mask, ep.query_labels == 3)
    assert torch.equal(ep.open_mask.sum(1), torch.full((12,), 12))
    labels = torch.as_tensor(synthetic.labels)
    novel = set(synthetic.classes_in("novel").tolist())
    feats = torch.as_tensor(synthetic.features)
    assert torch.equal(ep.query, feats[ep.query_index])
    for t in range(12):
        known = set(ep.classes[t].tolist())
        open_rows = ep.query_index[t][ep.open_mask[t]]
        closed_rows = ep.query_index[t][~ep.open_mask[t]]
        open_labels = labels[open_rows].tolist()
        assert not set(open_labels) & known and set(open_labels) <= novel
        assert len(set(open_labels)) <= 3  # open_way: as many as the known classes
        closed = ep.classes[t][ep.query_labels[t][~ep.open_mask[t]]]
        assert torch.equal(labels[closed_rows], closed)
        rows = torch.cat([ep.support_index[t], ep.query_index[t]])
        assert rows.unique().numel() == rows.numel(), "support and queries overlap"
        if balance == "balanced":
            assert sorted(np.bincount(open_labels)[np.bincount(open_labels) > 0]) == [4, 4, 4]


def test_open_tasks_are_seeded_and_keep_the_closed_task(synthetic):
    args = dict(way=3, shot=2, n_query=12, balance="dirichlet", seed=5)
    first = sample_task_indices(synthetic, 6, n_open=9, **args)
    again = sample_task_indices(synthetic, 6, n_open=9, **args)
    later = sample_task_indices(synthetic, 2, n_open=9, start=4, **args)
    closed = sample_task_indices(synthetic, 6, **args)
    for key in first:
        assert np.array_equal(first[key], again[key])
        assert np.array_equal(first[key][4:], later[key])
    assert np.array_equal(first["support"], closed["support"])
    assert np.array_equal(first["classes"], closed["classes"])
    for t in range(6):
        known = first["query"][t][first["query_labels"][t] < 3]
        assert sorted(known) == sorted(closed["query"][t])
    other_seed = sample_task_indices(synthetic, 6, n_open=9, **{**args, "seed": 6})
    assert not np.array_equal(first["query"], other_seed["query"])


def test_dirichlet_open_counts_vary_and_balanced_spread_evenly(synthetic):
    labels = synthetic.labels
    idx = sample_task_indices(
        synthetic, 40, way=3, shot=1, n_query=15, balance="dirichlet", n_open=15, seed=0
    )
    spreads = set()
    for t in range(40):
        open_rows = idx["query"][t][idx["query_labels"][t] == 3]
        counts = np.unique(labels[open_rows], return_counts=True)[1]
        assert counts.sum() == 15 and set(labels[open_rows]) <= set(idx["open_classes"][t])
        spreads.add(tuple(sorted(counts)))
    assert len(spreads) > 5, "Dirichlet open counts should differ between tasks"
    # balanced with a remainder: 14 over 3 open classes is 5, 5, 4
    idx = sample_task_indices(synthetic, 5, way=3, shot=1, n_query=15, n_open=14, seed=0)
    for t in range(5):
        open_rows = idx["query"][t][idx["query_labels"][t] == 3]
        assert sorted(np.unique(labels[open_rows], return_counts=True)[1]) == [4, 5, 5]


def test_open_way_defaults_to_the_classes_left(synthetic):
    # 8 novel classes: 6-way tasks leave 2 open classes
    idx = sample_task_indices(synthetic, 4, way=6, shot=1, n_query=12, n_open=10, seed=0)
    assert idx["open_classes"].shape == (4, 2)
    idx = sample_task_indices(synthetic, 4, way=3, shot=1, n_query=12, n_open=10, open_way=5)
    assert idx["open_classes"].shape == (4, 5)
    for t in range(4):
        assert not set(idx["open_classes"][t]) & set(idx["classes"][t])
    closed = sample_episodes(synthetic, 3, way=3, shot=1, n_query=12)
    assert not closed.open_mask.any()


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(n_open=-1), "n_open"),
        (dict(way=8, n_query=8, n_open=5), "all taken by 8-way tasks"),
        (dict(n_open=6, open_way=6), "open_way=6 open classes asked"),
        (dict(n_open=31 * 3), "need up to 31 samples per class.*use at most 90 open queries"),
        (dict(n_open=91, balance="dirichlet"), "cannot be drawn from 3 open classes"),
        (dict(n_open=0, open_way=2), "needs open queries"),
        (dict(n_open=5, open_way=0), "open_way"),
    ],
)
def test_bad_open_settings_are_value_errors_before_any_work(synthetic, kwargs, problem):
    args = {"way": 3, "shot": 1, "n_query": 9, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=problem):
        sample_task_indices(synthetic, 2, **args)
    with pytest.raises(ValueError, match=problem):
        # a huge batch: refused before anything is drawn or allocated
        sample_episodes(synthetic, 10**9, max_bytes=2**62, **args)


# --- open-set tasks fixed in advance (task indices and task files) -------------------------


def _same_episodes(a: Episodes, b: Episodes) -> None:
    for name in ("support", "support_labels", "query", "query_labels", "classes"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.open_mask, b.open_mask) and a.open_mask.any()


def test_open_task_files_round_trip_to_the_sampled_tasks(synthetic, tmp_path):
    """Open-set task indices written to a task file come back as the same open-set
    tasks, by every reader: the file, the loaded dict and the batches."""
    setting = {"way": 3, "shot": 2, "n_query": 9, "seed": 4, "n_open": 6}
    idx = sample_task_indices(synthetic, 7, **setting)
    sampled = sample_episodes(synthetic, 7, **setting)
    path = save_task_file(tmp_path / "open.npz", idx)
    task_file = TaskFile(path)
    assert task_file.is_open and task_file.open_way == 3
    assert task_file.shape == (3, 2, 15) and task_file.n_open == 6
    _same_episodes(task_file.episodes(synthetic), sampled)
    loaded = load_task_file(path)
    np.testing.assert_array_equal(loaded["open_classes"], idx["open_classes"])
    _same_episodes(episodes_from_indices(synthetic, loaded), sampled)
    batches = list(iter_episodes(synthetic, path, batch_size=3))
    assert [len(b) for b in batches] == [3, 3, 1]
    for batch, start in zip(batches, (0, 3, 6), strict=True):
        _same_episodes(batch, sampled[start : start + len(batch)])
    closed = TaskFile(save_task_file(tmp_path / "closed.npz", sample_task_indices(synthetic, 2)))
    assert not closed.is_open and closed.open_way == 0 and closed.n_open == 0


def _open_indices(fs, n_tasks=4):
    return sample_task_indices(fs, n_tasks, way=3, shot=1, n_query=9, seed=0, n_open=6)


def _row_of_class(fs, label, avoid=()):
    return int(next(r for r in np.flatnonzero(fs.labels == label) if r not in avoid))


@pytest.mark.parametrize(
    "change, problem",
    [
        ("drop_open_classes", "open classes, a field 'open_classes'"),
        ("no_open_query", "task 1 has no open query"),
        ("no_closed_query", "task 1 has no closed query"),
        ("label_above_open", "must lie in 0..3 (the tasks are 3-way, 3 an open query)"),
        ("open_classes_1d", "'open_classes' must be"),
        ("open_classes_empty", "names no open class"),
        ("open_of_a_known_class", "task 2 has an open query of one of its known classes"),
        ("open_of_another_class", "task 2 has an open query of a class not in its"),
        ("known_open_class", "task 0 names an open class that is one of its known classes"),
    ],
)
def test_bad_open_task_indices_are_refused_naming_the_task(synthetic, tmp_path, change, problem):
    """Every reader refuses malformed open-set tasks with the same message, the task
    file before any batch is made."""
    idx = {k: v.copy() for k, v in _open_indices(synthetic).items()}
    is_open = idx["query_labels"] == 3
    if change == "drop_open_classes":
        del idx["open_classes"]
    elif change == "no_open_query":
        idx["query_labels"][1, is_open[1]] = 0
    elif change == "no_closed_query":
        idx["query_labels"][1] = 3
    elif change == "label_above_open":
        idx["query_labels"][0, 0] = 4
    elif change == "open_classes_1d":
        idx["open_classes"] = idx["open_classes"][:, 0]
    elif change == "open_classes_empty":
        idx["open_classes"] = idx["open_classes"][:, :0]
    elif change == "open_of_a_known_class":
        j = int(np.flatnonzero(is_open[2])[0])
        idx["query"][2, j] = _row_of_class(synthetic, idx["classes"][2, 0], idx["support"][2])
    elif change == "open_of_another_class":
        others = set(np.unique(synthetic.labels[synthetic.split == "novel"]).tolist())
        others -= set(idx["classes"][2].tolist()) | set(idx["open_classes"][2].tolist())
        j = int(np.flatnonzero(is_open[2])[0])
        idx["query"][2, j] = _row_of_class(synthetic, min(others))
    elif change == "known_open_class":
        idx["open_classes"][0, -1] = idx["classes"][0, 1]
    with pytest.raises(ValueError, match=re.escape(problem)):
        episodes_from_indices(synthetic, idx)
    with pytest.raises(ValueError, match=re.escape(problem)):
        next(iter_episodes(synthetic, idx))
    path = tmp_path / "bad.npz"
    np.savez(path, **idx)
    with pytest.raises(ValueError, match=re.escape(problem)):
        TaskFile(path).episodes(synthetic)


def test_open_task_files_with_varying_open_counts(synthetic, tmp_path):
    """A task file may hold tasks with different numbers of open queries: each task is
    scored on its own, and the run reports the mean number per task."""
    idx = {k: v.copy() for k, v in _open_indices(synthetic, 6).items()}
    # task t keeps 6 - t open queries; the others become closed queries of class 0
    for t in range(1, 6):
        used = set(idx["support"][t].tolist()) | set(idx["query"][t].tolist())
        rows = [r for r in np.flatnonzero(synthetic.labels == idx["classes"][t, 0])
                if r not in used]  # fmt: skip
        for j, row in zip(np.flatnonzero(idx["query_labels"][t] == 3)[:t], rows, strict=False):
            idx["query"][t, j], idx["query_labels"][t, j] = row, 0
    path = tmp_path / "varying.npz"
    np.savez(path, **idx)
    task_file = TaskFile(path)
    assert task_file.n_open == pytest.approx(np.mean([6 - t for t in range(6)]))
    episodes = task_file.episodes(synthetic)
    assert episodes.open_mask.sum(1).tolist() == [6, 5, 4, 3, 2, 1]
    result = evaluate_open_set(_Oracle(), episodes)
    assert result.metrics["auroc"][0] == pytest.approx(100.0)
    assert result.metrics["accuracy"][0] == pytest.approx(100.0)
    assert result.metrics["ece_open"][0] == pytest.approx(0.0)
    # the closed-set calibration too, each task on its own closed queries
    coin = evaluate_open_set(_Coin(), episodes).metrics
    proba = _Coin().predict_proba_open(episodes)[..., :-1]
    nll = []
    for t in range(6):
        closed = ~episodes.open_mask[t]
        p = proba[t, closed] / proba[t, closed].sum(-1, keepdim=True)
        nll.append(-p.gather(-1, episodes.query_labels[t, closed, None]).log().mean())
    assert coin["nll"][0] == pytest.approx(float(torch.stack(nll).mean()), rel=1e-6)


def test_probfsl_run_open_task_file_scores_the_sampled_run(tmp_path, capsys, open_posterior):
    """``probfsl run --task-file`` with open-set tasks gives the row of ``--open-queries``
    on the same tasks, whatever tasks the file holds; ``--open-queries`` beside it is
    refused."""
    fs = load_dataset("omniglot")
    idx = sample_task_indices(fs, 30, way=5, shot=1, n_query=75, seed=3, n_open=75)
    path = save_task_file(tmp_path / "open.npz", idx)
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot"]
    sampled, fixed = tmp_path / "sampled.json", tmp_path / "fixed.json"
    assert main([*argv, "--open-queries", "75", "--tasks", "30", "--seed", "3",
                 "--out", str(sampled)]) == 0  # fmt: skip
    assert main([*argv, "--task-file", str(path), "--out", str(fixed)]) == 0
    a, b = json.loads(sampled.read_text()), json.loads(fixed.read_text())
    assert b["balance"] == "file" and a["balance"] == "balanced"
    for key in ("accuracy", "auroc", "aupr", "prec_at_90_recall", "ece_open", "knn_auroc",
                "msp_auroc", "query", "open_queries", "open_way", "tasks"):  # fmt: skip
        assert a[key] == b[key], key
    capsys.readouterr()
    assert main([*argv, "--task-file", str(path), "--open-queries", "75"]) == 2
    assert "a task file fixes its tasks" in capsys.readouterr().err


def test_open_task_files_need_base_classes(tmp_path, capsys):
    """An open-set task file is scored by the method's open-set posterior: data with too
    few base classes for its background are refused before any task is scored."""
    from tests.synthetic import make_featureset

    fs = make_featureset(n_base=1)
    data = tmp_path / "few_base.npz"
    np.savez(data, features=fs.features, labels=fs.labels, split=fs.split)
    idx = sample_task_indices(fs, 3, way=3, shot=1, n_query=9, seed=0, n_open=6)
    path = save_task_file(tmp_path / "open.npz", idx)
    argv = ["run", "--method", "nearest-centroid", "--features", str(data)]
    assert main([*argv, "--task-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--task-file {path} (open-set tasks): P(none of these classes)" in err
    assert "needs at least 2; few_base has 1" in err


# --- metrics --------------------------------------------------------------------------------


def _random_scores(ties: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (60, 50)
    scores = (
        torch.randint(0, 7, shape, generator=g).double()
        if ties
        else torch.randn(shape, generator=g)
    )
    positive = torch.rand(shape, generator=g) < 0.4
    positive[:, 0], positive[:, 1] = True, False
    return scores, positive


def _sklearn_p_at_90(y: np.ndarray, s: np.ndarray) -> float:
    precision, recall, _ = precision_recall_curve(y, s)
    return precision[np.flatnonzero(recall[:-1] >= 0.9).max()]


@pytest.mark.parametrize("ties", [False, True])
def test_rank_metrics_match_sklearn(ties):
    scores, positive = _random_scores(ties)
    y, s = positive.numpy(), scores.numpy()
    expected_ranks = np.stack([rankdata(row) for row in s])
    np.testing.assert_allclose(average_ranks(scores).numpy(), expected_ranks)
    np.testing.assert_allclose(
        auroc(scores, positive).numpy(),
        [roc_auc_score(a, b) for a, b in zip(y, s, strict=True)],
        atol=1e-12,
    )
    np.testing.assert_allclose(
        average_precision(scores, positive).numpy(),
        [average_precision_score(a, b) for a, b in zip(y, s, strict=True)],
        atol=1e-12,
    )
    np.testing.assert_allclose(
        precision_at_recall(scores, positive).numpy(),
        [_sklearn_p_at_90(a, b) for a, b in zip(y, s, strict=True)],
        atol=1e-12,
    )


def test_metrics_are_nan_without_positives_and_check_their_input():
    scores = torch.tensor([[0.1, 0.2, 0.3], [0.2, 0.2, 0.2]])  # all tied: AUROC 1/2
    positive = torch.tensor([[False, False, False], [True, False, True]])
    assert torch.isnan(auroc(scores, positive)[0]) and auroc(scores, positive)[1] == 0.5
    assert torch.isnan(average_precision(scores, positive)[0])
    assert torch.isnan(precision_at_recall(scores, positive)[0])
    with pytest.raises(ValueError, match="finite"):
        auroc(torch.tensor([[0.1, float("nan")]]), torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        auroc(scores, positive[:, :2])


def test_open_ece_by_hand():
    p = torch.tensor([[0.05, 0.05, 0.95, 0.95, 0.5, 0.5]])
    y = torch.tensor([[False, True, True, True, False, False]])
    # bins: {0.05, 0.05}: |1 - 0.1| = 0.9; {0.95, 0.95}: |2 - 1.9| = 0.1; {0.5, 0.5}: 1.0
    assert open_ece(p, y, n_bins=10).item() == pytest.approx((0.9 + 0.1 + 1.0) / 6)
    assert open_ece(y.double(), y).item() == 0


def test_per_task_scores_use_closed_queries_for_accuracy():
    # 2 known classes; queries: closed 0, closed 1, open, open
    proba = torch.tensor([[[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.5, 0.1, 0.4]]])
    labels = torch.tensor([[0, 1, 2, 2]])
    scores = open_set_scores(proba, labels)
    assert scores["accuracy"].item() == 0.5  # the open queries are not counted
    assert scores["auroc"].item() == 1.0 and scores["aupr"].item() == 1.0
    assert scores["prec_at_90_recall"].item() == 1.0
    assert {"ece_open", "ece", "nll", "brier"} <= set(scores)
    with pytest.raises(ValueError, match="closed and open queries"):
        open_set_per_task(proba[..., :2], proba[..., 2], torch.tensor([[0, 1, 0, 1]]))


@pytest.mark.parametrize("labels", [[[0, 1, 3, 2]], [[0, -1, 2, 2]]])
def test_labels_outside_the_task_are_value_errors(labels):
    """A label above K (an index error deep in the closed-set calibration) or below 0
    (silently scored as a wrong closed query) is refused, naming the range."""
    proba = torch.tensor([[[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.5, 0.1, 0.4]]])
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.2 for 2 known classes"):
        open_set_scores(proba, torch.tensor(labels))


def test_open_ece_refuses_scores_that_are_not_probabilities():
    """A distance or a logit is not P(open): its values were clamped into the end bins
    and scored as if they were probabilities."""
    y = torch.tensor([[True, False, True]])
    with pytest.raises(ValueError, match=r"p_open must be probabilities in \[0, 1\]"):
        open_ece(torch.tensor([[2.0, -1.0, 0.5]]), y)
    assert open_ece(torch.tensor([[1.0, 0.0, 1.0]]), y).item() == 0


# --- evaluation with estimators and baselines ------------------------------------------------


@pytest.fixture
def open_episodes(synthetic):
    return sample_episodes(synthetic, 30, way=3, shot=2, n_query=12, n_open=12, seed=0)


def test_evaluate_open_set_oracle_coin_and_wrong_shapes(open_episodes):
    perfect = evaluate_open_set(_Oracle(), open_episodes, batch_size=7)
    assert perfect.n_tasks == 30
    for name in ("accuracy", "auroc", "aupr", "prec_at_90_recall"):
        assert perfect.metrics[name] == (100.0, 0.0)
    assert perfect.metrics["ece_open"] == (0.0, 0.0)
    coin = evaluate_open_set(_Coin(), open_episodes)
    mean, ci = coin.metrics["auroc"]
    assert abs(mean - 50) < 3 * ci + 1
    summary = coin.summary()
    assert {"accuracy", "ci95", "auroc", "auroc_ci95", "ece_open_ci95"} <= set(summary)
    assert "auroc" in str(coin)

    class Wrong:
        def predict_proba_open(self, episodes):
            return torch.ones(episodes.n_tasks, episodes.n_query, episodes.way) / episodes.way

    with pytest.raises(ValueError, match=r"\[T, Q, K\+1\]"):
        evaluate_open_set(Wrong(), open_episodes)
    with pytest.raises(ValueError, match="no open-set posterior"):
        evaluate_open_set(object(), open_episodes)


def test_a_wrapper_without_an_open_posterior_is_refused_before_any_work(synthetic):
    """Every estimator inherits a ``predict_proba_open`` that only raises: a wrapper says
    for itself whether it has its own (temperature scaling: only for open-set tasks,
    ``n_open``, of an estimator that has one), before it is fitted or run."""
    from probfsl.evaluation.open_set import OpenPosterior, has_open_posterior
    from probfsl.temperature import TemperatureScaled

    assert has_open_posterior(NearestCentroid()) and has_open_posterior(_Oracle())
    tempered = TemperatureScaled(NearestCentroid())
    assert not has_open_posterior(tempered) and not has_open_posterior(object())
    assert has_open_posterior(TemperatureScaled(NearestCentroid(), n_open=6))
    assert not has_open_posterior(TemperatureScaled(object(), n_open=6))
    with pytest.raises(ValueError, match="has no open-set posterior"):
        OpenPosterior(tempered)
    with pytest.raises(ValueError, match="n_open=6: object has no open-set posterior"):
        TemperatureScaled(object(), n_open=6).fit_featureset(synthetic)


def test_temperature_tempers_the_known_columns_of_open_set_tasks(synthetic):
    """In open-set tasks the temperature applies to the known classes given "known":
    P(open) and each query's known mass are the wrapped estimator's, the known columns
    are its renormalised ones tempered by the τ fitted on base episodes with as many open
    queries (closed queries only), and the argmax stays. Where the base classes cannot
    hold the open queries, τ comes from closed episodes and the note says so."""
    from probfsl.evaluation.calibration import apply_temperature, fit_temperature
    from probfsl.models.soft_kmeans import SoftKMeans
    from probfsl.temperature import TemperatureScaled
    from tests.conftest import make_featureset

    fs = make_featureset(n_base=24, n_novel=8, per_class=30, dim=6, spread=1.5)
    tasks = sample_episodes(fs, 20, way=3, shot=1, n_query=9, seed=2, n_open=6)
    scaled = TemperatureScaled(SoftKMeans(), n_episodes=60, n_open=6).fit_featureset(
        fs, torch.float64
    )
    tempered = scaled.predict_proba_open(tasks.to(dtype=torch.float64))
    tau = scaled.temperature_[(3, 1, 9)]
    assert tau != pytest.approx(1.0) and (3, 1, 9) not in scaled.notes_
    plain = scaled.estimator_.predict_proba_open(tasks.to(dtype=torch.float64))
    torch.testing.assert_close(tempered[..., -1], plain[..., -1])
    torch.testing.assert_close(tempered[..., :-1].sum(-1), plain[..., :-1].sum(-1))
    known = plain[..., :-1] / plain[..., :-1].sum(-1, keepdim=True)
    given_known = tempered[..., :-1] / tempered[..., :-1].sum(-1, keepdim=True)
    torch.testing.assert_close(given_known, apply_temperature(known, tau))
    assert torch.equal(tempered[..., :-1].argmax(-1), plain[..., :-1].argmax(-1))
    # τ is the NLL-optimal one of the closed queries of open base episodes
    from probfsl.data.base_episodes import base_episode_split

    view = base_episode_split(fs)
    base = sample_episodes(view, 60, 3, 1, 9, "dirichlet", 2.0, 0, dtype=torch.float64, n_open=6)
    model = SoftKMeans().fit_featureset(view, torch.float64)
    p = model.predict_proba_open(base)[..., :-1]
    closed = ~base.open_mask
    p = (p / p.sum(-1, keepdim=True))[closed].view(60, 9, 3)
    assert tau == pytest.approx(fit_temperature(p, base.query_labels[closed].view(60, 9)))
    # 300 open queries a task: more than the other base classes hold, so closed episodes
    crowded = TemperatureScaled(SoftKMeans(), n_episodes=60, n_open=300).fit_featureset(fs)
    assert crowded.fit_shape(3, 1, 9, torch.float64) != 1.0
    assert "cannot hold 300 open queries" in crowded.notes_[(3, 1, 9)]
    with pytest.raises(ValueError, match="set n_open"):
        TemperatureScaled(SoftKMeans()).fit_featureset(fs).predict_proba_open(tasks)


def test_baselines_detect_open_queries(synthetic, open_episodes, open_posterior):
    classifier = open_posterior().fit_featureset(synthetic)
    baselines = open_set_baselines(classifier)
    assert isinstance(baselines["knn"], KNNDistanceBaseline)
    assert isinstance(baselines["msp"], MaxSoftmaxBaseline)
    assert baselines["knn"].neighbours(open_episodes) == 3  # 2 shots: the 5-shot default
    one_shot = sample_episodes(synthetic, 4, way=3, shot=1, n_query=12, n_open=6)
    assert baselines["knn"].neighbours(one_shot) == 1
    knn = evaluate_open_set(baselines["knn"], open_episodes)
    msp = evaluate_open_set(baselines["msp"], open_episodes)
    assert knn.metrics["accuracy"] == msp.metrics["accuracy"]  # nearest centroid's argmax
    assert "ece_open" not in knn.metrics  # a distance is not a probability
    assert knn.metrics["auroc"][0] > 75  # well-separated synthetic classes
    method = evaluate_open_set(classifier, open_episodes)
    assert method.metrics["auroc"][0] > 60 and "ece_open" in method.metrics
    with pytest.raises(ValueError, match="k must be"):
        KNNDistanceBaseline(classifier, k=0)


# --- the command line and sweeps ------------------------------------------------------------


def test_probfsl_run_open_queries_end_to_end(tmp_path, capsys, open_posterior):
    out = tmp_path / "open.json"
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot"]
    status = main([*argv, "--open-queries", "75", "--tasks", "40", "--out", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "75 closed + 75 open queries (5 open classes)" in printed
    assert "1-NN distance" in printed and "max softmax" in printed
    row = json.loads(out.read_text())
    assert row["open_queries"] == 75 and row["open_way"] == 5 and row["knn_k"] == 1
    for key in ("auroc", "aupr", "prec_at_90_recall", "knn_auroc", "msp_auroc"):
        assert 0 <= row[key] <= 100 and row[f"{key}_ci95"] > 0
    assert 0 <= row["ece_open"] <= 1 and row["tasks"] == 40
    assert row["accuracy"] == row["baseline_accuracy"]  # the same argmax on the same tasks
    assert row["open_note"] == ""  # P(open) chosen on held-out base classes
    assert "P(open)" not in capsys.readouterr().err
    # the closed-set run of the same seed has the same support and closed queries
    closed = tmp_path / "closed.json"
    assert main([*argv, "--tasks", "40", "--out", str(closed)]) == 0
    assert json.loads(closed.read_text())["accuracy"] == pytest.approx(row["accuracy"])


def test_with_open_fraction_sets_the_prior_of_inductive_posteriors():
    from probfsl.running import with_open_fraction

    params, message = with_open_fraction("nearest-centroid", {"center": True}, 15, 60)
    assert params == {"center": True, "open_prior": pytest.approx(0.2)}
    assert "open_prior 0.2" in message and "15 of 75 queries" in message
    # tasks with as many open queries as closed: the default prior, nothing added
    assert with_open_fraction("slem", {}, 75, 75) == ({}, None)
    assert with_open_fraction("slem", {}, 0, 75) == ({}, None)  # closed tasks
    given = {"open_prior": 0.5}
    assert with_open_fraction("gp-tree", given, 15, 60) == (given, None)
    # nearly only open queries: at most the bound the hyperparameter accepts
    assert with_open_fraction("evidence-lssvm", {}, 1000, 5)[0]["open_prior"] == 0.99
    # the transductive mixtures infer the open fraction of each task
    for method in ("soft-kmeans", "bavardage", "bavardage-gamma", "vmp-gmm"):
        assert with_open_fraction(method, {}, 15, 60) == ({}, None)
    # vmp-gmm's full-covariance P(open) is the inductive posterior
    full = with_open_fraction("vmp-gmm", {"precision": "full"}, 15, 60)[0]
    assert full["open_prior"] == pytest.approx(0.2)


@pytest.mark.parametrize("method", ["nearest-centroid", "slem", "soft-kmeans"])
def test_probfsl_run_takes_its_open_fraction_as_the_prior(method, tmp_path, capsys, monkeypatch):
    """An inductive P(open)'s prior open fraction is the run's (15 open of 75 queries),
    for the search's candidates and the method that runs, unless ``--param`` gives one;
    a transductive mixture keeps its prior mean."""
    from probfsl.tuning import SEARCH_SPACES

    monkeypatch.setitem(SEARCH_SPACES, "soft-kmeans", {"temperature": [10.0]})
    monkeypatch.setitem(SEARCH_SPACES, "slem", {"rel_lam": [1.0]})
    argv = ["run", "--method", method, "--dataset", "omniglot", "--tasks", "8", "--query", "60"]
    inductive = method != "soft-kmeans"
    rows = {}
    for name, extra in (("run", []), ("given", ["--param", "open_prior=0.5"])):
        out = tmp_path / f"{name}.json"
        assert main([*argv, "--open-queries", "15", *extra, "--out", str(out)]) == 0
        rows[name] = json.loads(out.read_text())
        err = capsys.readouterr().err
        assert ("open fraction of the run's tasks" in err) == (name == "run" and inductive)
    assert rows["given"]["params"]["open_prior"] == 0.5
    if inductive:
        assert rows["run"]["params"]["open_prior"] == pytest.approx(0.2)
        assert rows["run"]["ece_open"] != pytest.approx(rows["given"]["ece_open"])
    else:
        assert "open_prior" not in rows["run"]["params"]
    if method == "nearest-centroid":  # the prior moves P(open) alone
        assert rows["run"]["accuracy"] == rows["given"]["accuracy"]
    if method == "slem":  # probfsl tune searches as probfsl run does
        tune = ["tune", "--method", method, "--dataset", "omniglot", "--episodes", "5"]
        assert main([*tune, "--query", "60", "--open-queries", "15"]) == 0
        printed = capsys.readouterr()
        assert "open fraction of the run's tasks" in printed.err
        assert "'open_prior': 0.2" in printed.out


def test_the_baseline_a_search_falls_back_to_takes_the_run_fraction(tmp_path, capsys, monkeypatch):
    """soft-kmeans keeps its prior mean, but where its search runs nearest centroid
    instead (a temperature that cannot beat it), nearest centroid's P(open) reads the
    run's open fraction, and the run says so."""
    from probfsl.tuning import SEARCH_SPACES

    monkeypatch.setitem(SEARCH_SPACES, "soft-kmeans", {"temperature": [1e-8]})
    out = tmp_path / "run.json"
    argv = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "8"]
    assert main([*argv, "--query", "60", "--open-queries", "15", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["method_run"] == "nearest-centroid"
    assert row["params"] == {"open_prior": pytest.approx(0.2)}
    assert "nearest-centroid: open_prior 0.2, the open fraction" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--open-queries", "-1"], "must be an integer >= 0"),
        (["--open-queries", "2.5"], "--open-queries: must be an integer >= 0, got '2.5'"),
        (["--open-queries", "many"], "--open-queries: must be an integer >= 0, got 'many'"),
        (["--open-queries", "75", "--zero-shot"], "applies to few-shot runs"),
        (["--open-queries", "3000"], "open queries"),
        (["--open-queries", "75", "--way", "106", "--query", "106"], "all taken"),
    ],
)
def test_probfsl_run_open_queries_errors(capsys, extra, problem):
    argv = ["run", "--method", "nearest-centroid", "--dataset", "omniglot", "--tasks", "5"]
    try:
        status = main([*argv, *extra])
    except SystemExit as stop:
        status = stop.code
    assert status == 2
    assert problem in capsys.readouterr().err


def test_probfsl_run_open_queries_tempers_the_known_columns_by_default(tmp_path, monkeypatch):
    """With ``--preset auto`` (the default) an open-set run tempers the known classes'
    columns as a closed run tempers its probabilities; ``--calibrate none`` does not, and
    P(open) is the same either way."""
    from probfsl.tuning import SEARCH_SPACES

    monkeypatch.setitem(SEARCH_SPACES, "soft-kmeans", {"temperature": [10.0]})
    argv = ["run", "--method", "soft-kmeans", "--dataset", "omniglot", "--tasks", "10"]
    argv += ["--query", "15", "--open-queries", "15"]
    rows = {}
    for calibrate in ("default", "none"):
        out = tmp_path / f"{calibrate}.json"
        extra = [] if calibrate == "default" else ["--calibrate", "none"]
        assert main([*argv, *extra, "--out", str(out)]) == 0
        rows[calibrate] = json.loads(out.read_text())
    tempered, plain = rows["default"], rows["none"]
    assert tempered["calibrate"] == "temperature" and plain["calibrate"] == "none"
    assert tempered["temperature"] != pytest.approx(1.0)
    assert tempered["nll"] != plain["nll"] and tempered["accuracy"] == plain["accuracy"]
    for key in ("auroc", "ece_open"):
        assert tempered[key] == pytest.approx(plain[key])


@pytest.mark.parametrize("method", ["nearest-centroid", "soft-kmeans"])
def test_a_run_on_too_few_base_classes_to_hold_out_says_p_open_was_not_tuned(
    method, tmp_path, capsys
):
    """The note reaches the run through the wrappers (soft-kmeans: its search's choice
    under the temperature)."""
    from tests.synthetic import make_featureset

    fs = make_featureset(n_base=4)  # folds of one or two classes
    path = tmp_path / "four_base.npz"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    out = tmp_path / "open.json"
    argv = ["run", "--method", method, "--features", str(path), "--way", "3"]
    argv += ["--query", "9", "--tasks", "5", "--open-queries", "6", "--out", str(out)]
    assert main(argv) == 0
    note = json.loads(out.read_text())["open_note"]
    assert "too few to hold some out" in note
    assert f"probfsl: note: {note}" in capsys.readouterr().err


@pytest.mark.parametrize("n_base", [0, 1])
def test_open_queries_without_two_base_classes_are_refused_before_any_work(
    tmp_path, capsys, n_base
):
    """P(open)'s background is learnt from the spread of the base classes' means: data
    with fewer than two base classes are refused by probfsl run and by a sweep's checks,
    before any task is scored (it failed at the first batch, or gave the prior for every
    query with one base class)."""
    from tests.synthetic import make_featureset

    fs = make_featureset(n_base=n_base)
    path = tmp_path / "few_base.npz"
    split = np.where(fs.split == "base", "base", "novel")
    np.savez(path, features=fs.features, labels=fs.labels, split=split)
    argv = ["run", "--method", "nearest-centroid", "--features", str(path), "--way", "3"]
    argv += ["--query", "9", "--tasks", "5", "--open-queries", "6"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"needs at least 2; few_base has {n_base} (split 'base')" in err
    raw = {
        "data": {"few": {"features": str(path)}},
        "methods": ["nearest-centroid"],
        "grid": {"way": 3, "query": 9, "open": [0, 6]},
        "run": {"tasks": 5},
    }
    with pytest.raises(ValueError, match="grid.open = 6,.*needs at least 2"):
        config_from_dict(raw)


def test_sweep_open_axis_cells_rows_and_report(tmp_path, open_posterior):
    raw = {
        "data": {"omni": {"dataset": "omniglot"}},
        "methods": ["nearest-centroid"],
        "grid": {"open": [0, 75]},
        "run": {"tasks": 12, "device": "cpu"},
    }
    cells = config_from_dict(raw).cells()
    assert [c.open_queries for c in cells] == [0, 75]
    assert "--open-queries" not in cells[0].argv()
    assert "--open-queries" in cells[1].argv() and "open 75" in cells[1].describe()
    assert cells[0].key("v", "d") != cells[1].key("v", "d")
    with pytest.raises(ValueError, match="grid.open"):
        config_from_dict({**raw, "grid": {"open": [-1]}})
    with pytest.raises(ValueError, match="grid.open = 5000"):
        config_from_dict({**raw, "grid": {"open": [5000]}})
    rows = []
    for cell in cells:
        row = run_cell(cell, "cpu")
        assert row["status"] == "ok", row.get("error")
        rows.append({**cell.fields(), **row, "code_version": "test"})
    table = pd.DataFrame(rows)
    text = open_set_table(table)
    assert "AUROC" in text and "k-NN distance" in text and "max softmax" in text
    assert text.count("| omni |") == 3  # the method and the two baselines, open cells only
    assert "not tuned" not in text  # Omniglot's base classes are enough to hold out
    untuned = table.assign(open_note=["", "P(open): the base classes are too few"])
    assert "nearest-centroid (P(open) not tuned: too few" in open_set_table(untuned)
    paths = write_report(table, tmp_path / "report", code_version="test")
    assert "## Open-set recognition" in paths["markdown"].read_text()


def test_failed_open_cells_are_named_with_their_open_queries():
    """probfsl sweep lists failed and lost cells by the name the cell gives itself: an
    open-set cell's ``open N`` was left out, so it read as its closed twin."""
    import math

    from probfsl.sweeps.command import _describe

    raw = {
        "data": {"omni": {"dataset": "omniglot"}},
        "methods": ["nearest-centroid"],
        "grid": {"open": [0, 75]},
    }
    for cell in config_from_dict(raw).cells():
        row = {**cell.fields(), "error": "RuntimeError: lost"}
        assert _describe(row) == cell.describe()
    assert "open" not in _describe({**row, "open_queries": math.nan})  # a row without it
    row.pop("open_queries")
    assert "open" not in _describe(row)


def _open_row(method: str, method_run: str) -> dict:
    """A results row of an open-set run, as ``probfsl run --out`` writes it."""
    row = {"method": method, "method_run": method_run, "baseline": "nearest-centroid"}
    row.update(way=5, shot=1, query=75, balance="balanced", tasks=20, seed=0)
    row.update(open_queries=75, open_way=5, knn_k=1)
    for metric in ("accuracy", "baseline_accuracy", "ece_open", "ece", "nll", "brier"):
        row[metric] = 0.5
    row["ci95"] = row["baseline_ci95"] = row["ece_open_ci95"] = 0.1
    for name in ("auroc", "aupr", "prec_at_90_recall"):
        for prefix in ("", "knn_", "msp_"):
            row[prefix + name], row[f"{prefix}{name}_ci95"] = 60.0, 1.0
    return row


def test_open_set_tables_say_where_the_search_ran_nearest_centroid():
    """Where --preset auto ran nearest centroid, the open-set numbers are its: the run's
    table and the sweep report's open-set and calibration tables say so, as the
    accuracy table does, rather than naming them after the method asked for."""
    from probfsl.commands import open_set_table as run_table
    from probfsl.sweeps.report import calibration_table, method_table

    assert "soft-kmeans (P(open))" in run_table(_open_row("soft-kmeans", "soft-kmeans"))
    printed = run_table(_open_row("bavardage-gamma", "nearest-centroid"))
    assert "bavardage-gamma (ran nearest-centroid, P(open))" in printed
    row = _open_row("bavardage-gamma", "nearest-centroid")
    row.update(status="ok", data="d", label="bavardage-gamma", zero_shot=False, alpha=2.0)
    table = pd.DataFrame([row])
    for make in (open_set_table, calibration_table, method_table):
        assert "(ran nearest-centroid)" in make(table), make.__name__


def test_omniglot_paper_setting_shapes():
    fs = load_dataset("omniglot")
    ep = sample_episodes(fs, 3, way=5, shot=5, n_query=75, n_open=75, seed=0)
    assert ep.query.shape == (3, 150, 64) and int(ep.open_mask.sum()) == 225
    counts = torch.stack([torch.bincount(ep.query_labels[t], minlength=6) for t in range(3)])
    assert torch.equal(counts, torch.tensor([[15] * 5 + [75]] * 3))
