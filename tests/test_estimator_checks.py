"""One estimator check suite for every registered method, after
scikit-learn's ``check_estimator``: fit == fit_base, get/set_params, fit_predict on plain
arrays for one task or a batch, predict_proba leaves the fitted state alone, and save ->
load in a fresh process predicts the same labels."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from probfsl import tuning
from probfsl.data import load_dataset
from probfsl.data.tasks import sample_episodes
from probfsl.estimator_io import checksum
from probfsl.methods import METHODS, make_estimator, method_info
from probfsl.models.base import FewShotClassifier

#: small settings for the slow methods (the checks test the interface, not accuracy)
SMALL = {
    "gp-tree": {"n_chains": 2, "n_sweeps": 2},
    "em-dirichlet": {"n_iter": 5},
}
#: a changed hyperparameter value per method for the set_params round trip
CHANGE = {
    "nearest-centroid": ("center", False),
    "soft-kmeans": ("n_iter", 3),
    "bavardage": ("n_vb", 3),
    "bavardage-gamma": ("a0", 3.0),
    "vmp-gmm": ("max_iter", 10),
    "gp-tree": ("seed", 3),
    "evidence-lssvm": ("temperature", 5.0),
    "slem": ("temperature", 5.0),
    "em-dirichlet": ("n_iter", 3),
}
NAMES = sorted(METHODS)


@pytest.fixture(scope="module")
def data():
    fs = load_dataset("omniglot")
    base = fs.base(torch.float64)
    episodes = sample_episodes(fs, 3, way=3, shot=2, n_query=9, seed=1, dtype=torch.float64)
    return base, episodes


def fitted(name: str, base) -> FewShotClassifier:
    return make_estimator(name, **SMALL.get(name, {})).fit_base(*base)


def same(a, b) -> bool:
    """Deep equality of fitted values (tensors exactly, dataclasses field by field)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_every_registered_method_is_checked():
    assert set(CHANGE) == set(METHODS)


@pytest.mark.parametrize("name", NAMES)
def test_fit_is_fit_base(name, data):
    base, episodes = data
    if name == "evidence-lssvm":
        pytest.skip("EvidenceLSSVM.fit is its single-problem LS-SVM; fit_base is the base entry")
    a = make_estimator(name, **SMALL.get(name, {})).fit(*base)
    b = fitted(name, base)
    assert isinstance(a, FewShotClassifier)
    assert same(a.fitted_state(), b.fitted_state())
    assert torch.equal(a.predict(episodes), b.predict(episodes))


@pytest.mark.parametrize("name", NAMES)
def test_get_set_params_round_trip(name):
    est = make_estimator(name, **SMALL.get(name, {}))
    params = est.get_params()
    assert type(est)(**params).get_params() == params
    assert est.set_params(**params) is est and est.get_params() == params
    key, value = CHANGE[name]
    assert est.set_params(**{key: value}).get_params() == {**params, key: value}
    with pytest.raises(ValueError, match="unknown hyperparameter.*accepted"):
        est.set_params(not_a_parameter=1)
    assert est.get_params() == {**params, key: value}


@pytest.mark.parametrize("name", NAMES)
def test_init_only_stores(name):
    """No logic in __init__: any value is stored as given, and refused by check_params
    (and by set_params, which then leaves the estimator as it was)."""
    cls = method_info(name).load()
    junk = {k: object() for k in inspect.signature(cls).parameters}
    est = cls(**junk)
    assert all(est.get_params()[k] is v for k, v in junk.items())
    with pytest.raises((TypeError, ValueError)):
        est.check_params()
    good = make_estimator(name, **SMALL.get(name, {}))
    before = good.get_params()
    for key in before:
        with pytest.raises((TypeError, ValueError), match=key):
            good.set_params(**{key: object()})
        assert good.get_params() == before


@pytest.mark.parametrize("name", NAMES)
def test_scikit_learn_clone(name, data):
    from sklearn.base import clone

    est = fitted(name, data[0])
    assert set(est.get_params(deep=False)) == set(inspect.signature(type(est)).parameters)
    copy_ = clone(est)  # checks that __init__ stores each hyperparameter as given
    assert type(copy_) is type(est) and copy_.get_params() == est.get_params()
    assert not copy_.fitted_state()  # a clone is unfitted


@pytest.mark.parametrize("name", NAMES)
def test_fit_predict_on_numpy_arrays(name, data):
    base, episodes = data
    est = fitted(name, base)
    expected = est.predict(episodes)  # [T, Q] task-local
    # a user's labels: any integers; fit_predict numbers each task's classes by sorted
    # value, so an increasing map keeps the task-local numbering (GP-Tree's trees and
    # random streams depend on it) and the results must agree exactly
    values = 7 * torch.arange(episodes.way) + 100
    t = 1
    labels = values[episodes.support_labels[t]].numpy()
    got = est.fit_predict(episodes.support[t].numpy(), labels, episodes.query[t].numpy())
    assert isinstance(got, np.ndarray) and got.shape == (episodes.n_query,)
    assert np.array_equal(got, values[expected[t]].numpy())
    # the batch in one call equals one task at a time, as tensors
    batch = est.fit_predict(episodes.support, values[episodes.support_labels], episodes.query)
    assert isinstance(batch, torch.Tensor) and torch.equal(batch, values[expected])
    assert np.array_equal(batch[t].numpy(), got)
    single = [
        est.fit_predict(episodes.support[i], episodes.support_labels[i], episodes.query[i])
        for i in range(episodes.n_tasks)
    ]
    assert torch.equal(torch.stack(single), expected)
    # an Episodes batch is predict's (task-local labels), not fit_predict's
    with pytest.raises(TypeError, match="predict"):
        est.fit_predict(episodes, None, None)


@pytest.mark.parametrize("name", NAMES)
def test_fit_predict_bad_input(name, data):
    base, episodes = data
    est = fitted(name, base)
    s, q = episodes.support[0].numpy(), episodes.query[0].numpy()
    y = episodes.support_labels[0].numpy()
    with pytest.raises(ValueError, match="support_labels"):
        est.fit_predict(s, y[:-1], q)
    with pytest.raises(ValueError, match="query"):
        est.fit_predict(s, y, q[:, :-1])
    with pytest.raises(TypeError, match="support"):
        est.fit_predict(s.astype(np.int64), y, q)
    two = episodes.support_labels.clone()
    two[0] = 0
    two[0, 0] = 1  # task 0 has 2 classes, the others 3
    with pytest.raises(ValueError, match="same number of distinct"):
        est.fit_predict(episodes.support, two, episodes.query)
    if est.needs_base:
        with pytest.raises(ValueError, match="fit_base"):
            make_estimator(name, **SMALL.get(name, {})).fit_predict(s, y, q)


@pytest.mark.parametrize("name", NAMES)
def test_predict_proba_keeps_fitted_state(name, data):
    base, episodes = data
    est = fitted(name, base)
    before = copy.deepcopy({k: v for k, v in vars(est).items() if not k.startswith("_")})
    first = est.predict_proba(episodes)
    second = est.predict_proba(episodes[1:])
    after = {k: v for k, v in vars(est).items() if not k.startswith("_")}
    assert same({k: after[k] for k in before}, before)
    assert set(after) - set(before) <= set(est.call_diagnostics)
    assert torch.allclose(est.predict_proba(episodes)[1:], second, atol=1e-12)
    assert torch.equal(est.predict_proba(episodes), first)


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """Each method fitted, saved, then loaded and run in one fresh Python process."""
    base, episodes = data
    folder = tmp_path_factory.mktemp("estimators")
    torch.save(
        {"support": episodes.support, "labels": episodes.support_labels, "query": episodes.query},
        folder / "task.pt",
    )
    expected, refused = {}, {}
    for name in NAMES:
        est = fitted(name, base)
        est.predict(episodes)  # per-call diagnostics must not be needed (nor saved)
        try:
            est.save(folder / f"{name}.pt")
        except TypeError as err:
            refused[name] = str(err)
            continue
        expected[name] = est.fit_predict(episodes.support, episodes.support_labels, episodes.query)
    code = (
        "import json, sys, torch\n"
        "from probfsl.methods import METHODS\n"
        "from probfsl.models.base import FewShotClassifier\n"
        "folder = sys.argv[1]\n"
        "t = torch.load(folder + '/task.pt', weights_only=True)\n"
        "out = {}\n"
        "for name in sys.argv[2:]:\n"
        "    est = FewShotClassifier.load(folder + '/' + name + '.pt')\n"
        "    assert type(est) is METHODS[name].load()\n"
        "    out[name] = est.fit_predict(t['support'], t['labels'], t['query']).tolist()\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(folder), *expected],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    return folder, expected, loaded, refused


@pytest.mark.parametrize("name", NAMES)
def test_save_load_in_fresh_process(name, saved):
    folder, expected, loaded, refused = saved
    assert name not in refused, refused.get(name)
    assert loaded[name] == expected[name].tolist()
    est = FewShotClassifier.load(folder / f"{name}.pt")
    assert type(est) is METHODS[name].load()


def test_load_refuses_other_classes(saved, tmp_path):
    folder, *_ = saved
    other = next(n for n in NAMES if n != "slem")
    with pytest.raises(ValueError, match="not a SLEM"):
        METHODS["slem"].load().load(folder / f"{other}.pt")
    payload = torch.load(folder / "slem.pt", weights_only=True)
    payload["class"] = "collections:OrderedDict"
    torch.save(payload, tmp_path / "edited.pt")
    with pytest.raises(ValueError, match="checksum does not match"):
        FewShotClassifier.load(tmp_path / "edited.pt")
    payload["checksum"] = checksum(payload)  # a forger who also fixes the checksum
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not an estimator of probfsl.models"):
        FewShotClassifier.load(tmp_path / "bad.pt")
    payload["class"] = "probfsl.models.base:BaseMeanCentering"  # in models/, not an estimator
    payload["checksum"] = checksum(payload)
    torch.save(payload, tmp_path / "mixin.pt")
    with pytest.raises(ValueError, match="not an estimator of probfsl.models"):
        FewShotClassifier.load(tmp_path / "mixin.pt")
    torch.save({"format": 1, "class": "x"}, tmp_path / "x.pt")
    with pytest.raises(ValueError):
        FewShotClassifier.load(tmp_path / "x.pt")


def test_save_refuses_what_it_cannot_store(data, tmp_path):
    base, _ = data
    est = fitted("nearest-centroid", base)
    est.extra_ = object()
    with pytest.raises(TypeError, match="cannot save extra_"):
        est.save(tmp_path / "nc.pt")
    assert not (tmp_path / "nc.pt").exists()


def test_episodes_from_arrays_numbers_classes_by_sorted_value():
    from probfsl.models.base import episodes_from_arrays

    support = torch.randn(2, 4, 3, dtype=torch.float64)
    labels = torch.tensor([[5, 2, 5, 9], [0, 3, 3, 1]])
    episodes, classes, single = episodes_from_arrays(support, labels, support[:, :2])
    assert not single and episodes.way == 3
    assert classes.tolist() == [[2, 5, 9], [0, 1, 3]]
    assert episodes.support_labels.tolist() == [[1, 0, 1, 2], [0, 2, 2, 1]]
    assert episodes.query.dtype == torch.float64


def test_evidence_single_problem_fit_saves(tmp_path):
    from probfsl.models.evidence import EvidenceLSSVM

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 5)), rng.integers(0, 3, 40) * 2 + 1
    est = EvidenceLSSVM().fit(x, y)
    est.save(tmp_path / "ev.pt")
    back = EvidenceLSSVM.load(tmp_path / "ev.pt")
    assert np.array_equal(back.predict(x), est.predict(x))
    assert torch.equal(back.predict(torch.as_tensor(x)), est.predict(torch.as_tensor(x)))
    assert torch.equal(back.coef_, est.coef_)


def test_auto_preset_is_not_saved(tmp_path):
    with pytest.raises(TypeError, match="cannot save a AutoPreset"):
        tuning.make_estimator("bavardage", preset="auto").save(tmp_path / "auto.pt")


def _forged(payload: dict, **changes) -> dict:
    """``payload`` with ``changes`` and a checksum that matches them (a careful forger)."""
    out = {**payload, **changes}
    out["checksum"] = checksum(out)
    return out


def test_saved_files_are_checked_not_trusted(saved, tmp_path):
    folder, *_ = saved
    good = folder / "slem.pt"
    payload = torch.load(good, weights_only=True)
    raw = good.read_bytes()
    state = payload["state"]
    tensor_key = next(k for k, v in state.items() if isinstance(v, torch.Tensor))
    nan_state = {**state, tensor_key: torch.full_like(state[tensor_key], float("nan"))}
    cases = {
        "empty": (b"", "the file is empty"),
        "truncated": (raw[: len(raw) // 2], "truncated or damaged"),
        "text": (b"not a torch file at all\n", "truncated or damaged"),
        "nan-unsigned": ({**payload, "state": nan_state}, "checksum does not match"),
        "nan-signed": (_forged(payload, state=nan_state), "NaN or infinite"),
        "missing-key": ({k: v for k, v in payload.items() if k != "state"}, "missing keys"),
        "extra-key": ({**payload, "note": 1}, "unexpected keys"),
        "old-format": (_forged(payload, format=1), "format 1"),
        "unknown-param": (
            _forged(payload, params={**payload["params"], "warp": 9}),
            "not a hyperparameter of SLEM",
        ),
        "method-as-param": (
            _forged(payload, params={**payload["params"], "predict_proba": 1}),
            "not a hyperparameter",
        ),
        "method-as-state": (
            _forged(payload, state={**state, "predict_": 1, "fit_base": 2}),
            "not a fitted attribute name",
        ),
        "half-precision": (
            _forged(payload, state={**state, tensor_key: state[tensor_key].half()}),
            "should be a float32 or float64 tensor.*got float16",
        ),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.pt"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        with pytest.raises(ValueError, match=message) as err:
            FewShotClassifier.load(path)
        assert str(path) in str(err.value), name  # the file is named
        assert "weights_only" not in str(err.value), name  # never the unsafe advice
    # a payload with arbitrary objects: refused without torch's advice
    import fractions

    torch.save({"format": 2, "x": fractions.Fraction(1, 3)}, tmp_path / "objects.pt")
    with pytest.raises(ValueError, match="not tensors or plain values") as err:
        FewShotClassifier.load(tmp_path / "objects.pt")
    assert "weights_only" not in str(err.value)
    with pytest.raises(ValueError, match="no such file"):
        FewShotClassifier.load(tmp_path / "missing.pt")
