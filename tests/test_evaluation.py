import json

import numpy as np
import pytest
import torch

from probfsl.data import sample_episodes
from probfsl.evaluation import accuracy_ci, evaluate, markdown_table, text_table, write_results
from probfsl.models.base import FewShotClassifier


class Oracle(FewShotClassifier):
    """Knows the answer for even tasks, answers class 0 for odd ones (for testing scoring)."""

    def predict_proba(self, episodes):
        proba = torch.nn.functional.one_hot(episodes.query_labels, episodes.way).float()
        odd = episodes.query_index[:, 0] % 2 == 1
        proba[odd] = torch.nn.functional.one_hot(
            torch.zeros_like(episodes.query_labels[odd]), episodes.way
        ).float()
        return proba


def test_accuracy_ci_formula():
    per_task = np.array([0.5, 0.7, 0.9, 0.6])
    mean, ci = accuracy_ci(per_task)
    assert mean == pytest.approx(67.5)
    assert ci == pytest.approx(100 * 1.96 * per_task.std(ddof=1) / 2)
    with pytest.raises(ValueError):
        accuracy_ci(np.array([]))


def test_evaluate_scores_queries_per_task_in_batches(synthetic):
    ep = sample_episodes(synthetic, 23, seed=0)
    res = evaluate(Oracle(), ep, batch_size=5)
    odd = (ep.query_index[:, 0] % 2 == 1).numpy()
    expected = np.where(odd, (ep.query_labels == 0).double().mean(1).numpy(), 1.0)
    np.testing.assert_allclose(res.per_task_accuracy, expected)
    assert res.n_tasks == 23 and res.accuracy == pytest.approx(100 * expected.mean())
    assert res.seconds > 0 and res.tasks_per_second > 0
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(Oracle(), ep, batch_size=0)


def test_preparation_is_timed_apart_from_the_predictions(synthetic, monkeypatch):
    """A search before the first prediction of a shape (``prepare``) counts as tuning
    time, not in the throughput: a fake clock advanced 10 s by each preparation and 1 s
    by each prediction."""
    import probfsl.evaluation.protocol as protocol

    clock = [0.0]
    monkeypatch.setattr(protocol.time, "perf_counter", lambda: clock[0])
    calls = []

    class Tuned(Oracle):
        def prepare(self, episodes):
            calls.append(("prepare", len(episodes), episodes.way))
            clock[0] += 10.0

        def predict_proba(self, episodes):
            calls.append(("predict", len(episodes), episodes.way))
            clock[0] += 1.0
            return super().predict_proba(episodes)

    ep = sample_episodes(synthetic, 12, seed=0)
    res = evaluate(Tuned(), ep, batch_size=5)
    assert [c[0] for c in calls] == ["prepare", "predict"] * 3
    assert all(c[2] == ep.way for c in calls)
    assert res.tuning_seconds == 30.0 and res.seconds == 3.0
    assert res.tasks_per_second == 4.0
    assert res.summary()["tuning_seconds"] == 30.0
    assert "tuning 30.0 s before" in str(res)


def test_tables_and_files(tmp_path):
    rows = [{"method": "a", "accuracy": 71.234, "ci95": 0.5}, {"method": "b", "accuracy": 9.0}]
    md = markdown_table(rows, ["method", "accuracy", "ci95"])
    assert md.splitlines()[2] == "| a | 71.23 | 0.50 |"
    assert "b" in text_table(rows, ["method", "accuracy"])
    write_results(rows, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())[1]["method"] == "b"
    write_results(rows[:1], tmp_path / "one.json")
    assert json.loads((tmp_path / "one.json").read_text())["method"] == "a"
    write_results(rows, tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().splitlines()[0] == "method,accuracy,ci95"
    with pytest.raises(ValueError, match=".json or .csv"):
        write_results(rows, tmp_path / "r.txt")


def test_write_results_is_atomic_and_checks_the_name_first(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    write_results([{"accuracy": 1.0}], out)
    before = out.read_text()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stopped while writing

    import probfsl.fileio

    monkeypatch.setattr(probfsl.fileio.Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        write_results([{"accuracy": 2.0}], out)
    monkeypatch.undo()
    assert out.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    for bad in ("r.txt", "r", "sub"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match="--out"):
            write_results([{"accuracy": 2.0}], tmp_path / bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "sub"]
    write_results([{"a": 1}, {"a": 2, "b": 3}], tmp_path / "deep" / "R.CSV")
    assert (tmp_path / "deep" / "R.CSV").read_text().splitlines() == ["a,b", "1,", "2,3"]
