"""probfsl.sklearn: one scikit-learn classifier per registered method, run through
scikit-learn's own estimator checks and used as scikit-learn users use classifiers
(string labels, Pipeline, cross_val_score, GridSearchCV)."""

from __future__ import annotations

import inspect
import pickle

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

import probfsl.sklearn as psk
from probfsl import make_estimator
from probfsl.data import load_dataset
from probfsl.methods import METHODS
from probfsl.sklearn import CLASSIFIERS, expected_failed_checks

#: small iteration counts for the slow methods (the checks test the interface)
SMALL = {
    "gp-tree": {"n_chains": 2, "n_sweeps": 2},
    "em-dirichlet": {"n_iter": 5, "mm_max_iter": 10},
    "vmp-gmm": {"max_iter": 10},
}
NAMES = sorted(METHODS)
TRANSDUCTIVE = {"soft-kmeans", "bavardage", "bavardage-gamma", "vmp-gmm", "em-dirichlet"}


def small(name: str, **params):
    return CLASSIFIERS[name](**SMALL.get(name, {}), **params)


@parametrize_with_checks(
    [small(name) for name in NAMES],
    expected_failed_checks=expected_failed_checks,
    xfail_strict=True,  # a listed check that passes is an error: the list stays honest
)
@pytest.mark.slow
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)


def test_one_classifier_per_registered_method():
    assert set(CLASSIFIERS) == set(METHODS)
    for name, cls in CLASSIFIERS.items():
        assert cls.__name__ in psk.__all__
        assert cls.method == name and cls.estimator_class() is METHODS[name].load()
        assert cls().transductive == (name in TRANSDUCTIVE)


@pytest.mark.parametrize("name", NAMES)
def test_hyperparameters_mirror_the_estimator(name):
    """Same names and defaults as the wrapped estimator (two of EvidenceLSSVM's renamed),
    plus the base classes; the wrapped estimator is built with them."""
    ours = inspect.signature(CLASSIFIERS[name]).parameters
    theirs = inspect.signature(METHODS[name].load()).parameters
    renamed = {"evidence_score": "score"} if name == "evidence-lssvm" else {}
    assert list(ours)[-2:] == ["base_features", "base_labels"]
    assert [renamed.get(p, p) for p in list(ours)[:-2]] == list(theirs)
    for p in list(ours)[:-2]:
        default = theirs[renamed.get(p, p)].default
        if p == "dtype":
            assert getattr(torch, ours[p].default) is default
        else:
            assert ours[p].default == default
    est = small(name)._make_estimator()
    assert est.get_params() == make_estimator(name, **SMALL.get(name, {})).get_params()


def test_evidence_renamed_hyperparameters_reach_the_estimator():
    est = CLASSIFIERS["evidence-lssvm"](evidence_score="mean_per_sample", dtype="float32")
    wrapped = est._make_estimator()
    assert wrapped.score == "mean_per_sample" and wrapped.dtype is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        CLASSIFIERS["evidence-lssvm"](dtype="float16")._make_estimator()


def test_expected_failures_are_few_and_explained():
    assert expected_failed_checks(LogisticRegression()) == {}
    for name in NAMES:
        failures = expected_failed_checks(small(name))
        assert ("check_methods_subset_invariance" in failures) == (name in TRANSDUCTIVE)
        assert set(failures) <= {
            "check_methods_subset_invariance",
            "check_non_transformer_estimators_n_iter",
        }
        assert all(len(reason) > 40 for reason in failures.values())


# -- one few-shot task from the built-in Omniglot features ---------------------------------


@pytest.fixture(scope="module")
def omniglot():
    fs = load_dataset("omniglot")
    base_x, base_y = (t.numpy() for t in fs.base())
    x, y = (t.numpy() for t in fs.novel())
    return base_x, base_y, x, y


@pytest.fixture(scope="module")
def task(omniglot):
    """3-way task with string labels: unbalanced support (1, 2 and 4 shots), 10 queries
    per class."""
    _, _, x, y = omniglot
    names = np.array(["cat", "dog", "emu"])
    rows = [np.flatnonzero(y == c) for c in np.unique(y)[[3, 8, 20]]]
    shots = (1, 2, 4)
    support = np.concatenate([r[:s] for r, s in zip(rows, shots, strict=True)])
    support_y = np.repeat(names, shots)
    query = np.concatenate([r[5:15] for r in rows])
    return x[support], support_y, x[query], np.repeat(names, 10)


@pytest.mark.parametrize("name", NAMES)
def test_string_labels_and_the_wrapped_estimator_agree(name, omniglot, task):
    """Predictions are the wrapped estimator's on the same task, in the user's labels,
    with the base classes given at construction."""
    base_x, base_y, _, _ = omniglot
    xs, ys, xq, yq = task
    clf = small(name, base_features=base_x, base_labels=base_y).fit(xs, ys)
    assert list(clf.classes_) == ["cat", "dog", "emu"] and clf.n_features_in_ == xs.shape[1]
    pred = clf.predict(xq)
    assert pred.dtype == ys.dtype and set(pred) <= set(ys)
    wrapped = make_estimator(name, **SMALL.get(name, {})).fit_base(base_x, base_y)
    codes = np.searchsorted(clf.classes_, ys)
    assert np.array_equal(pred, clf.classes_[wrapped.fit_predict(xs, codes, xq)])
    proba = clf.predict_proba(xq)
    assert proba.shape == (len(xq), 3) and np.allclose(proba.sum(1), 1)
    assert np.array_equal(clf.classes_[proba.argmax(1)], pred)
    assert clf.score(xq, yq) == np.mean(pred == yq)
    assert clf.score(xq, yq) > 0.5  # far above chance (1/3) on this task


@pytest.mark.parametrize("name", NAMES)
def test_open_set_probabilities_are_the_methods_open_posterior(name, omniglot, task):
    """``predict_proba(X, open_set=True)``: K + 1 columns, the K in ``classes_`` order and
    P(none of these classes) last, as the wrapped estimator's ``fit_predict_proba(...,
    open_set=True)`` gives them on the same task with integer labels; queries of other
    classes get the higher P(open) on average."""
    base_x, base_y, x, y = omniglot
    xs, ys, xq, _ = task
    others = np.concatenate([np.flatnonzero(y == c)[:10] for c in np.unique(y)[[30, 40, 50]]])
    queries = np.concatenate([xq, x[others]])
    clf = small(name, base_features=base_x, base_labels=base_y).fit(xs, ys)
    proba = clf.predict_proba(queries, open_set=True)
    assert proba.shape == (len(queries), 4) and np.allclose(proba.sum(1), 1)
    assert (proba >= 0).all() and (proba <= 1).all()
    wrapped = make_estimator(name, **SMALL.get(name, {})).fit_base(base_x, base_y)
    codes = np.searchsorted(clf.classes_, ys)
    classes, expected = wrapped.fit_predict_proba(xs, codes, queries, open_set=True)
    assert list(classes) == [0, 1, 2]
    np.testing.assert_allclose(proba, expected, rtol=1e-5, atol=1e-6)
    assert proba[len(xq) :, -1].mean() > proba[: len(xq), -1].mean()
    assert clf.predict_proba(queries).shape == (len(queries), 3)  # closed by default
    with pytest.raises(TypeError, match="open_set must be True or False"):
        clf.predict_proba(queries, open_set="yes")
    no_base = small(name).fit(xs, ys)
    with pytest.raises(ValueError, match="give base_features and base_labels"):
        no_base.predict_proba(queries, open_set=True)


@pytest.mark.parametrize("kind", ["ints", "objects", "categorical", "series"])
def test_any_hashable_labels(kind, task):
    """Integers, Python objects, pandas categories: classes_ sorted, predictions in them."""
    xs, ys, xq, _ = task
    values = {"ints": [-5, 7, 100], "objects": ["a", "b", "c"]}.get(kind, ["cat", "dog", "emu"])
    mapping = dict(zip(["cat", "dog", "emu"], values, strict=True))
    y = [mapping[v] for v in ys]
    if kind == "ints":
        y = np.array(y, dtype=np.int16)
    elif kind == "objects":
        y = np.array(y, dtype=object)
    elif kind == "categorical":
        y = pd.Categorical(y, categories=["emu", "dog", "cat"])
    else:
        y = pd.Series(y, dtype="category")
    reference = CLASSIFIERS["soft-kmeans"]().fit(xs, ys).predict(xq)
    clf = CLASSIFIERS["soft-kmeans"]().fit(xs, y)
    assert list(clf.classes_) == values
    assert list(clf.predict(xq)) == [mapping[v] for v in reference]


def test_fit_predict_with_string_labels_at_one_shot(task):
    xs, ys, xq, _ = task
    one = [0, 1, 3]  # one shot of each class
    pred = CLASSIFIERS["nearest-centroid"]().fit(xs[one], ys[one]).predict(xq)
    assert set(pred) <= {"cat", "dog", "emu"} and len(pred) == len(xq)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_dtype_is_kept(dtype, task):
    xs, ys, xq, _ = task
    clf = CLASSIFIERS["soft-kmeans"]().fit(xs.astype(dtype), ys)
    assert clf.support_.dtype == dtype
    assert clf.predict_proba(xq.astype(dtype)).dtype == dtype


def test_integer_features_become_float64(task):
    xs, ys, xq, _ = task
    clf = CLASSIFIERS["nearest-centroid"]().fit((100 * xs).astype(np.int64), ys)
    assert clf.support_.dtype == np.float64
    assert clf.predict((100 * xq).astype(np.int32)).shape == (len(xq),)


def test_transductive_methods_classify_the_queries_jointly(task):
    """predict(X) is one task: a transductive method's answer for a query depends on the
    other queries; an inductive method's does not."""
    xs, ys, xq, _ = task
    for name, joint in (("soft-kmeans", True), ("nearest-centroid", False)):
        clf = CLASSIFIERS[name]().fit(xs, ys)
        together = clf.predict_proba(xq)
        alone = np.concatenate([clf.predict_proba(xq[i : i + 1]) for i in range(len(xq))])
        assert np.allclose(together, alone, atol=1e-6) != joint


def test_fit_base_sets_parameters_that_clone_keeps(omniglot, task):
    base_x, base_y, _, _ = omniglot
    xs, ys, xq, _ = task
    names = np.array([f"base{c}" for c in base_y])  # base labels of any hashable type
    clf = CLASSIFIERS["slem"]()
    assert clf.fit_base(base_x, names) is clf
    assert clf.get_params()["base_features"] is not None
    copy = clone(clf)
    assert copy.base_features is not None and np.array_equal(copy.base_labels, names)
    given = CLASSIFIERS["slem"](base_features=base_x, base_labels=base_y).fit(xs, ys)
    fitted = copy.fit(xs, ys)
    assert np.array_equal(fitted.predict_proba(xq), given.predict_proba(xq))
    # the base classes matter: without them the support stands in (another model)
    alone = CLASSIFIERS["slem"]().fit(xs, ys)
    assert not np.allclose(alone.predict_proba(xq), given.predict_proba(xq))
    restored = pickle.loads(pickle.dumps(given))
    assert np.array_equal(restored.predict_proba(xq), given.predict_proba(xq))


def test_bad_input_is_a_clear_error(omniglot, task):
    base_x, base_y, _, _ = omniglot
    xs, ys, xq, _ = task
    with pytest.raises(ValueError, match="at least 2 classes"):
        CLASSIFIERS["nearest-centroid"]().fit(xs, np.full(len(ys), "cat"))
    with pytest.raises(ValueError, match="base features have 64"):
        CLASSIFIERS["nearest-centroid"](base_features=base_x, base_labels=base_y).fit(
            xs[:, :10], ys
        )
    with pytest.raises(ValueError, match="without base_features"):
        CLASSIFIERS["nearest-centroid"](base_labels=base_y).fit(xs, ys)
    with pytest.raises(ValueError, match="without base_labels"):
        CLASSIFIERS["nearest-centroid"]().fit_base(base_x, None)
    with pytest.raises(ValueError, match="base_labels has"):
        CLASSIFIERS["nearest-centroid"]().fit_base(base_x, base_y[:-1])
    with pytest.raises(ValueError, match="Unknown label type"):
        CLASSIFIERS["nearest-centroid"]().fit(xs, np.linspace(0, 1, len(ys)))
    # a 1-shot support cannot give BAVARDAGE a within-class scatter: the error says why
    one = [0, 1, 3]
    with pytest.raises(ValueError, match="support set stood in.*base_features"):
        CLASSIFIERS["bavardage"]().fit(xs[one], ys[one])
    CLASSIFIERS["bavardage"](base_features=base_x, base_labels=base_y).fit(xs[one], ys[one])
    # a bad hyperparameter is refused by the method's own check, at fit
    with pytest.raises(ValueError, match="temperature"):
        CLASSIFIERS["nearest-centroid"](temperature=-1.0).fit(xs, ys)
    fitted = CLASSIFIERS["nearest-centroid"]().fit(xs, ys)
    with pytest.raises(ValueError, match="features"):
        fitted.predict(xq[:, :10])


# -- scikit-learn's model selection ---------------------------------------------------------


@pytest.fixture(scope="module")
def labelled(omniglot):
    """4 novel classes, 20 examples each, with string labels."""
    _, _, x, y = omniglot
    keep = np.isin(y, np.unique(y)[[1, 5, 9, 13]])
    return x[keep], np.array([f"char{c}" for c in y[keep]])


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_cross_val_score(name, labelled):
    x, y = labelled
    pipe = make_pipeline(StandardScaler(), small(name))
    scores = cross_val_score(pipe, x, y, cv=4)
    assert scores.shape == (4,) and np.all((scores >= 0) & (scores <= 1))
    assert scores.mean() > 0.5  # 4-way, chance is 0.25


def test_grid_search_over_hyperparameters(labelled):
    x, y = labelled
    pipe = make_pipeline(StandardScaler(), CLASSIFIERS["soft-kmeans"]())
    grid = {"fewshotsoftkmeans__temperature": [1.0, 10.0], "fewshotsoftkmeans__n_iter": [1, 5]}
    search = GridSearchCV(pipe, grid, cv=3).fit(x, y)
    results = search.cv_results_
    assert len(results["params"]) == 4 and np.isfinite(results["mean_test_score"]).all()
    best = results["params"][int(np.argmax(results["mean_test_score"]))]
    assert search.best_params_ == best
    final = search.best_estimator_[-1]
    assert {
        f"fewshotsoftkmeans__{k}": v
        for k, v in final.get_params().items()
        if k in ("temperature", "n_iter")
    } == best
    assert search.best_score_ > 0.5
    assert set(search.predict(x)) <= set(y) and search.score(x, y) > 0.5


def test_grid_search_with_base_classes(omniglot, labelled):
    """Base classes given at construction survive the clones of a grid search; a
    preprocessing fitted on the base classes is applied to base, support and queries."""
    base_x, base_y, _, _ = omniglot
    x, y = labelled
    scaler = StandardScaler().fit(base_x)
    clf = CLASSIFIERS["bavardage"](base_features=scaler.transform(base_x), base_labels=base_y)
    pipe = make_pipeline(FunctionTransformer(scaler.transform), clf)
    search = GridSearchCV(pipe, {"fewshotbavardage__temperature_vb": [1.0, 4.0]}, cv=3)
    search.fit(x, y)
    final = search.best_estimator_[-1]
    assert final.base_features is not None and final.estimator_.scatter_.shape == (64, 64)
    assert search.best_score_ > 0.5
