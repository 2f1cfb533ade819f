"""One estimator check suite for every registered method, after
scikit-learn's ``check_estimator``: probfsl.testing's checks (fit == fit_base,
get/set_params, fit_predict on plain arrays for one task or a batch, predict_proba leaves
the fitted state alone, relabelling permutes the columns, save -> load), one test id per
(estimator, check) pair through ``parametrize_with_checks``; and here, save -> load in a
fresh process predicts the same labels, and saved files are checked, not trusted."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from probfsl import make_estimator, tuning
from probfsl.estimator_io import checksum
from probfsl.methods import METHODS
from probfsl.models.base import FewShotClassifier
from probfsl.testing import (
    check_fit_is_fit_base,
    check_fit_predict_on_arrays,
    check_predict_proba_keeps_fitted_state,
    check_save_load_roundtrip,
    estimator_check_data,
    parametrize_with_checks,
)

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
    """Omniglot's base classes and 3 small tasks, those of probfsl.testing's checks."""
    return estimator_check_data()


def fitted(name: str, base) -> FewShotClassifier:
    return make_estimator(name, **SMALL.get(name, {})).fit_base(*base)


ESTIMATORS = [make_estimator(name, **SMALL.get(name, {})) for name in NAMES]


def test_every_registered_method_is_checked():
    assert set(CHANGE) == set(METHODS)
    assert {type(est) for est in ESTIMATORS} == {METHODS[name].load() for name in NAMES}


#: the checks that fit and predict, slow for EM-Dirichlet (its MM loop): left out of
#: make test-quick for it, run by make test
SLOW_CHECKS = {
    "EMDirichlet": (
        check_fit_is_fit_base,
        check_fit_predict_on_arrays,
        check_predict_proba_keeps_fitted_state,
        check_save_load_roundtrip,
    ),
}


def _marks(estimator, check):
    return pytest.mark.slow if check in SLOW_CHECKS.get(type(estimator).__name__, ()) else None


@parametrize_with_checks(ESTIMATORS, marks=_marks)
def test_estimator(estimator, check):
    """probfsl.testing's estimator checks, one test id per (estimator, check) pair."""
    check(estimator)


@pytest.mark.parametrize("name", NAMES)
def test_set_params_changes_one_value(name):
    est = make_estimator(name, **SMALL.get(name, {}))
    params = est.get_params()
    key, value = CHANGE[name]
    assert value != params[key]
    assert est.set_params(**{key: value}).get_params() == {**params, key: value}
    with pytest.raises(ValueError, match="unknown hyperparameter.*accepted"):
        est.set_params(not_a_parameter=1)
    assert est.get_params() == {**params, key: value}


def test_parametrize_with_checks_names_every_pair():
    from probfsl.models.slem import SLEM
    from probfsl.testing import checks_of, estimator_checks

    ids = [test_id for test_id, _, _ in checks_of([SLEM(), SLEM(temperature=5.0)])]
    assert "SLEM()-check_save_load_roundtrip" in ids
    assert "SLEM(temperature=5.0)-check_fit_is_fit_base" in ids
    assert len(ids) == len(set(ids)) == 2 * len(estimator_checks(SLEM()))
    with pytest.raises(TypeError, match="FewShotClassifier"):
        parametrize_with_checks([object()])


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
@pytest.mark.slow
def test_save_load_in_fresh_process(name, saved):
    folder, expected, loaded, refused = saved
    assert name not in refused, refused.get(name)
    assert loaded[name] == expected[name].tolist()
    est = FewShotClassifier.load(folder / f"{name}.pt")
    assert type(est) is METHODS[name].load()


@pytest.mark.slow
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
    est = EvidenceLSSVM().fit_probe(x, y)
    est.save(tmp_path / "ev.pt")
    back = EvidenceLSSVM.load(tmp_path / "ev.pt")
    assert np.array_equal(back.predict(x), est.predict(x))
    assert torch.equal(back.predict(torch.as_tensor(x)), est.predict(torch.as_tensor(x)))
    assert torch.equal(back.coef_, est.coef_)


def test_auto_preset_is_saved_before_fitting(tmp_path):
    """``preset="auto"`` saves like every estimator (fitted: tests/test_one_task_api.py)."""
    auto = tuning.make_estimator("bavardage", preset="auto", n_vb=3)
    auto.save(tmp_path / "auto.pt")
    back = tuning.AutoPreset.load(tmp_path / "auto.pt")
    assert back.get_params() == auto.get_params() and back.fitted_state() == {}


def _forged(payload: dict, **changes) -> dict:
    """``payload`` with ``changes`` and a checksum that matches them (a careful forger)."""
    out = {**payload, **changes}
    out["checksum"] = checksum(out)
    return out


@pytest.mark.slow
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
