"""The one-task API on plain arrays, for every registered method: ``fit_predict_proba``
(probabilities in the caller's class order), labels of any sortable type, one
``make_estimator``, ``fit`` = the base classes everywhere (EvidenceLSSVM included), and
``preset="auto"`` saved and loaded without a new search."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import probfsl
from probfsl import methods, tuning
from probfsl.data.tasks import sample_episodes
from probfsl.methods import METHODS, build_estimator
from probfsl.models.base import FewShotClassifier, TaskProbabilities, encode_task_labels
from probfsl.models.evidence import EvidenceLSSVM
from tests.conftest import make_featureset

#: small settings for the slow methods (the tests check the interface, not accuracy)
SMALL = {
    "gp-tree": {"n_chains": 2, "n_sweeps": 2},
    "em-dirichlet": {"n_iter": 5},
    "vmp-gmm": {"max_iter": 10},
}
NAMES = sorted(METHODS)
WAY, SHOT, PER_QUERY = 3, 2, 4
NAMES_A = np.array(["cat", "dog", "emu"])  # class c of the task is NAMES_A[c]
#: methods whose probabilities change with the order of the support rows or classes
ORDER_DEPENDENT = {
    "gp-tree": "its Gibbs draws follow the order of the rows and of the class tree",
    "bavardage-gamma": "its probabilities change when the classes are listed in another order",
}


def _features(name: str, x: np.ndarray) -> np.ndarray:
    """EM-Dirichlet models probability vectors: its features are a softmax."""
    if name != "em-dirichlet":
        return x
    z = 2.0 * x
    z = np.exp(z - z.max(1, keepdims=True))
    return (z / z.sum(1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def task():
    """Base classes and one 3-way 2-shot task of novel classes (class index per row)."""
    fs = make_featureset(n_base=6, n_novel=4, per_class=20, dim=8, spread=3.0, seed=2)
    base_x, base_y = fs.base()
    x, y = fs.novel()
    x, y = x.numpy(), y.numpy()
    classes = np.unique(y)[:WAY]
    rows = [np.flatnonzero(y == c) for c in classes]
    support = np.concatenate([r[:SHOT] for r in rows])
    query = np.concatenate([r[SHOT : SHOT + PER_QUERY] for r in rows])
    index = np.repeat(np.arange(WAY), SHOT)  # class-major: any order of the rows works
    return (base_x.numpy(), base_y.numpy()), x[support], index, x[query]


def _fitted(name: str, base) -> FewShotClassifier:
    x, y = base
    return probfsl.make_estimator(name, **SMALL.get(name, {})).fit(_features(name, x), y)


@pytest.mark.parametrize("name", NAMES)
def test_fit_predict_proba_follows_the_callers_classes(name, task):
    base, support, index, query = task
    est = _fitted(name, base)
    support, query = _features(name, support), _features(name, query)

    out = est.fit_predict_proba(support, NAMES_A[index], query)
    assert isinstance(out, TaskProbabilities)
    classes, proba = out  # unpacks as a pair
    assert isinstance(proba, np.ndarray) and proba.shape == (WAY * PER_QUERY, WAY)
    assert list(classes) == ["cat", "dog", "emu"]  # sorted distinct support labels
    np.testing.assert_allclose(proba.sum(1), 1.0, atol=1e-5)
    # the argmax, in label values, is fit_predict's answer (string labels round-trip)
    labels = est.fit_predict(support, NAMES_A[index], query)
    assert labels.dtype.kind == "U" and set(labels) <= set(NAMES_A)
    np.testing.assert_array_equal(classes[proba.argmax(1)], labels)
    np.testing.assert_array_equal(out.labels(), labels)

    # the support in another order, each class renamed so that the sorted order changes:
    # the columns follow the names, so each named class keeps its probabilities (methods
    # whose results depend on the order of the rows or classes get the same task, only
    # under new names, sorted in the same order)
    names_b = np.array(["zebra", "ant", "moose"])  # class c is names_b[c]
    perm = np.random.default_rng(0).permutation(len(index))
    if name in ORDER_DEPENDENT:
        names_b, perm = np.array(["ant", "moose", "zebra"]), np.arange(len(index))
    classes_b, proba_b = est.fit_predict_proba(support[perm], names_b[index[perm]], query)
    assert list(classes_b) == ["ant", "moose", "zebra"]
    for c in range(WAY):
        a_col = list(classes).index(NAMES_A[c])
        b_col = list(classes_b).index(names_b[c])
        np.testing.assert_allclose(proba_b[:, b_col], proba[:, a_col], atol=1e-4)

    # integer labels of any values give the same columns, in increasing label order
    values = np.array([30, 10, 20])  # class c is values[c]
    if name in ORDER_DEPENDENT:
        values = np.array([10, 20, 30])
    int_classes, int_proba = est.fit_predict_proba(support, values[index], query)
    np.testing.assert_array_equal(int_classes, [10, 20, 30])
    for c in range(WAY):
        col = list(int_classes).index(values[c])
        np.testing.assert_allclose(int_proba[:, col], proba[:, c], atol=1e-4)


@pytest.mark.parametrize("name", ["nearest-centroid", "soft-kmeans", "slem"])
def test_labels_of_any_type(name, task):
    base, support, index, query = task
    est = _fitted(name, base)
    reference = est.fit_predict_proba(support, NAMES_A[index], query)
    for labels in (
        pd.Categorical(NAMES_A[index]),
        pd.Series(NAMES_A[index], dtype="category"),
        pd.Series(NAMES_A[index]),
        list(NAMES_A[index]),
        NAMES_A[index].astype(object),
    ):
        classes, proba = est.fit_predict_proba(support, labels, query)
        assert list(classes) == list(reference.classes)
        np.testing.assert_array_equal(proba, reference.proba)
        predicted = est.fit_predict(support, labels, query)
        assert all(isinstance(v, str) for v in predicted)
        np.testing.assert_array_equal(predicted, reference.labels())
    # booleans (2 classes) and mixed objects that compare with each other
    two = index < 1
    classes, _ = est.fit_predict_proba(support, two, query)
    assert list(classes) == [False, True]
    assert est.fit_predict(support, two, query).dtype == bool
    tuples = np.empty(len(index), dtype=object)
    tuples[:] = [("c", int(i)) for i in index]
    assert est.fit_predict(support, tuples, query)[0] in {("c", 0), ("c", 1), ("c", 2)}
    # tensors in, tensors out (integer labels); string labels come back as NumPy
    t_classes, t_proba = est.fit_predict_proba(
        torch.from_numpy(support), torch.from_numpy(index), torch.from_numpy(query)
    )
    assert isinstance(t_proba, torch.Tensor) and torch.equal(t_classes, torch.arange(WAY))
    torch.testing.assert_close(t_proba, torch.from_numpy(reference.proba))
    s_classes, s_proba = est.fit_predict_proba(
        torch.from_numpy(support), NAMES_A[index], torch.from_numpy(query)
    )
    assert isinstance(s_proba, torch.Tensor) and list(s_classes) == list(NAMES_A)


def test_integer_labels_work_as_before(task):
    base, support, index, query = task
    est = _fitted("nearest-centroid", base)
    values = np.array([7, 3, 5])
    predicted = est.fit_predict(support, values[index], query)
    assert predicted.dtype == np.int64 and set(predicted) <= {3, 5, 7}
    # the batch form and whole-number floats are unchanged
    batch = est.fit_predict(support[None], values[index][None], query[None])
    np.testing.assert_array_equal(batch[0], predicted)
    np.testing.assert_array_equal(est.fit_predict(support, values[index] * 1.0, query), predicted)
    with pytest.raises(ValueError, match="whole-number"):
        est.fit_predict(support, index + 0.5, query)
    # a batch of string labels: each task's classes, [T, K]
    labels = np.stack([NAMES_A[index], NAMES_A[::-1][index]])
    classes, proba = est.fit_predict_proba(np.stack([support] * 2), labels, np.stack([query] * 2))
    assert classes.shape == (2, WAY) and proba.shape == (2, WAY * PER_QUERY, WAY)
    np.testing.assert_allclose(proba[0], proba[1][:, ::-1], atol=1e-6)


def test_bad_labels_are_named(task):
    base, support, index, query = task
    est = _fitted("nearest-centroid", base)
    mixed = np.array(["a", 1, "b", 2, "a", 1], dtype=object)
    with pytest.raises(TypeError, match="sort against each other"):
        est.fit_predict(support, mixed, query)
    with pytest.raises(TypeError, match="None"):
        est.fit_predict(support, np.array(["a", None, "b"] * 2, dtype=object), query)
    with pytest.raises(ValueError, match="support_labels"):
        est.fit_predict_proba(support, NAMES_A[index][:-1], query)
    two_tasks = np.stack([NAMES_A[index], np.where(index == 0, "cat", "dog")])
    with pytest.raises(ValueError, match="same number of distinct"):
        est.fit_predict(np.stack([support] * 2), two_tasks, np.stack([query] * 2))
    assert encode_task_labels(torch.tensor([1, 2]))[1] is None


def test_one_make_estimator_with_the_constructor_defaults():
    assert probfsl.make_estimator is tuning.make_estimator
    assert not hasattr(methods, "make_estimator")  # the registry's builder: build_estimator
    for name in NAMES:
        est = probfsl.make_estimator(name)
        cls = METHODS[name].load()
        assert type(est) is cls and est.get_params() == cls().get_params()
        assert probfsl.make_estimator(name, "defaults").get_params() == cls().get_params()
    assert isinstance(probfsl.make_estimator("soft-kmeans", preset="auto"), tuning.AutoPreset)
    with pytest.raises(ValueError, match="probfsl.make_estimator"):
        build_estimator("soft-kmeans", preset="auto")
    with pytest.raises(ValueError, match="unknown method"):
        probfsl.make_estimator("nope")


def test_evidence_lssvm_fit_learns_the_base_classes(task):
    base, support, index, query = task
    est = EvidenceLSSVM().fit(*base)  # = fit_base, as on every estimator
    ref = EvidenceLSSVM().fit_base(*base)
    # the base statistics: the mean it centres on and the background density of the
    # open-set posterior, nothing of a trained probe
    assert est.fitted_state().keys() == {
        "base_mean_",
        "background_mean_",
        "background_between_",
        "background_within_",
        "background_shrinkage_",
        "background_odds_scale_",
        "background_odds_shift_",
        "background_within_mix_",
        "background_between_mix_",
        "background_query_within_mix_",
        "background_query_between_mix_",
        "background_query_odds_scale_",
        "background_query_odds_shift_",
        "background_held_out_",
    }
    torch.testing.assert_close(est.base_mean_, ref.base_mean_)
    assert not hasattr(est, "coef_")
    labels = est.fit_predict(support, NAMES_A[index], query)
    np.testing.assert_array_equal(labels, ref.fit_predict(support, NAMES_A[index], query))
    # the single-problem LS-SVM has its own name
    probe = EvidenceLSSVM(center=False).fit_probe(support, index)
    assert probe.coef_.shape == (WAY, support.shape[1])
    assert probe.predict(query).shape == (len(query),)
    with pytest.raises(ValueError, match="fit_probe"):
        EvidenceLSSVM().decision_function(query)


def test_auto_preset_saves_its_choices_and_loads_without_a_search(task, tmp_path):
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    auto = probfsl.make_estimator("soft-kmeans", preset="auto", n_iter=3)
    auto.set_params(n_episodes=30).fit(*fs.base())
    episodes = sample_episodes(fs, 4, way=5, shot=1, n_query=20, seed=3)
    proba = auto.predict_proba(episodes)
    proba64 = auto.predict_proba(episodes.to(dtype=torch.float64))
    support, labels, query = episodes.support[0], episodes.support_labels[0], episodes.query[0]
    names = np.array(list("vwxyz"))[labels.numpy()]
    one = auto.fit_predict_proba(support.numpy(), names, query.numpy())
    auto.save(tmp_path / "auto.pt")

    back = tuning.AutoPreset.load(tmp_path / "auto.pt")
    assert back.get_params() == auto.get_params()
    assert back.choices_.keys() == auto.choices_.keys() == {(5, 1, 20)}
    assert back.choices_[(5, 1, 20)].params == auto.choices_[(5, 1, 20)].params
    assert back.method_run_ == auto.method_run_
    calls = []
    original = tuning.auto_preset
    tuning.auto_preset = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a saved shape: no search, no warning
            assert torch.equal(back.predict_proba(episodes), proba)
            assert torch.equal(back.predict_proba(episodes.to(dtype=torch.float64)), proba64)
            again = back.fit_predict_proba(support.numpy(), names, query.numpy())
        assert calls == []
        np.testing.assert_array_equal(again.proba, one.proba)
        # a new task shape is tuned for on the saved base features, and says so
        other = sample_episodes(fs, 2, way=3, shot=1, n_query=9, seed=4)
        with pytest.warns(UserWarning, match=r"3-way 1-shot task of 9 queries is new"):
            back.predict_proba(other)
        assert len(calls) == 1
    finally:
        tuning.auto_preset = original
    # the generic loader reads it too; a file of another class is refused
    assert isinstance(FewShotClassifier.load(tmp_path / "auto.pt"), tuning.AutoPreset)
    with pytest.raises(ValueError, match="not a SoftKMeans"):
        METHODS["soft-kmeans"].load().load(tmp_path / "auto.pt")


def _save_auto_state(auto, state: dict, path: Path) -> None:
    """Write an AutoPreset file of ``auto``'s hyperparameters with the encoded ``state``
    (as ``save`` would, checksum included, without its checks of the state)."""
    from probfsl.estimator_io import FORMAT, checksum, encode

    payload = {
        "format": FORMAT,
        "class": "probfsl.tuning:AutoPreset",
        "params": encode(auto.get_params(), "params"),
        "state": state,
    }
    payload["checksum"] = checksum(payload)
    torch.save(payload, path)


def test_auto_preset_open_set_choice_is_the_open_search_and_is_saved(tmp_path):
    """predict_proba_open of preset="auto" tunes as ``probfsl run --open-queries`` does
    (base episodes with open queries, in the method's prior open fraction of the task's
    queries), keeps that choice apart from the closed one, saves it and loads it without
    a search; a file written before open-set choices existed still loads."""
    from probfsl.estimator_io import encode

    fs = make_featureset(n_base=14, n_novel=8, per_class=25)
    auto = probfsl.make_estimator("soft-kmeans", preset="auto").set_params(n_episodes=20)
    auto.set_params(balance="balanced").fit(*fs.base())
    episodes = sample_episodes(fs, 4, way=3, shot=1, n_query=9, seed=3, n_open=9, open_way=3)
    assert episodes.n_query == 18 and auto.open_split(3, 18) == (9, 9)
    proba = auto.predict_proba_open(episodes)
    assert proba.shape == (4, 18, 4)
    torch.testing.assert_close(proba.sum(-1), torch.ones(4, 18))
    assert set(auto.choices_) == {(3, 1, 9, 9)}  # the closed choice is not made
    expected = tuning.auto_preset(
        "soft-kmeans", auto.base_, 3, 1, 9, balance="balanced", n_episodes=20, open_queries=9
    )
    assert auto.choices_[(3, 1, 9, 9)].params == expected.params
    assert "open_scale" in expected.params  # learnt by the open search only
    closed = auto.predict_proba(episodes)
    assert set(auto.choices_) == {(3, 1, 9, 9), (3, 1, 18)}
    assert "open_scale" not in auto.choices_[(3, 1, 18)].params
    auto.save(tmp_path / "auto.pt")

    back = tuning.AutoPreset.load(tmp_path / "auto.pt")
    assert back.choices_.keys() == auto.choices_.keys()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # saved choices: no search, no warning
        assert torch.equal(back.predict_proba_open(episodes), proba)
        assert torch.equal(back.predict_proba(episodes), closed)
    # the open fraction follows open_prior; too few queries for it is a ValueError
    assert auto.set_params(fixed={"open_prior": 0.2}).open_split(3, 18) == (15, 3)
    with pytest.raises(ValueError, match="too few"):
        auto.open_split(3, 3)

    # a file of the format before open-set choices (no n_open) loads as before
    state = {k: encode(v, k) for k, v in back.fitted_state().items()}
    state["resolved_"] = [r for r in state["resolved_"] if r["n_open"] == 0]
    for record in state["resolved_"]:
        del record["n_open"]
    _save_auto_state(back, state, tmp_path / "old.pt")
    old = tuning.AutoPreset.load(tmp_path / "old.pt")
    assert set(old.choices_) == {(3, 1, 18)}
    assert torch.equal(old.predict_proba(episodes), closed)


def test_auto_preset_file_is_checked(tmp_path):
    """The estimator saved inside an AutoPreset is checked against its own declaration."""
    from probfsl.estimator_io import encode

    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    auto = probfsl.make_estimator("soft-kmeans", preset="auto").set_params(n_episodes=30)
    auto.fit(*fs.base()).predict_proba(sample_episodes(fs, 2, way=5, shot=1, n_query=20))
    state = {k: encode(v, k) for k, v in auto.fitted_state().items()}
    inner = state["resolved_"][0]["fitted"][0]["estimator"]
    inner["state"]["base_mean_"] = torch.full((5,), float("nan"))  # not finite
    _save_auto_state(auto, state, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"resolved_\[0\]\.fitted\[0\]\.estimator.*base_mean_"):
        tuning.AutoPreset.load(tmp_path / "bad.pt")


def _readme_python_blocks() -> list[str]:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "README's Python section: the one-task block, then auto"
    return blocks


def test_readme_one_task_example_runs(capsys):
    """README's first Python block (one task, string labels, probabilities) as written."""
    exec(compile(_readme_python_blocks()[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "['cat' 'dog' 'emu'] (15, 3)" in printed


@pytest.mark.slow
def test_readme_auto_example_runs(tmp_path, monkeypatch):
    """Both README Python blocks in turn (the second tunes, then saves, in a scratch
    folder); the saved estimator loads and predicts as it did."""
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in _readme_python_blocks():
        exec(compile(block, "README.md", "exec"), scope)
    back = FewShotClassifier.load(tmp_path / "bavardage-auto.pt")
    tasks = scope["tasks"][:5]
    assert torch.equal(back.predict_proba(tasks), scope["auto"].predict_proba(tasks))
