"""Saved estimators are checked against the declaration of their class (probfsl.schema).

A forger can recompute a file's checksum, so every file is also checked against its
class's ``schema``: each forgery below carries a valid checksum (recomputed with the
function estimator_io uses) and must be refused with a ValueError naming the file and
the attribute or hyperparameter, before anything is computed. The declarations
themselves are checked against what fitting really produces, so they cannot drift from
the code."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from probfsl import make_estimator
from probfsl.estimator_io import checksum, encode
from probfsl.methods import METHODS, method_info
from probfsl.models.base import FewShotClassifier, episodes_from_arrays
from probfsl.models.gp_tree.estimator import GPTree
from probfsl.schema import TAG, EstimatorSchema, Items, Maybe, Record

NAMES = sorted(METHODS)
DIM = 8
#: small settings for the slow methods (the tests are about files, not accuracy)
SMALL = {"gp-tree": {"n_chains": 2, "n_sweeps": 2}, "em-dirichlet": {"n_iter": 3}}


@pytest.fixture(scope="module")
def data():
    """Base features [60, 8] of 4 classes (float64, away from 0) and a batch of two
    3-way 2-shot tasks."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 4
    x = torch.randn(60, DIM, generator=gen, dtype=torch.float64) + 2 * labels[:, None]
    support = x[:6].reshape(1, 6, DIM).repeat(2, 1, 1) + 0.1
    support_labels = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    query = x[6:12].reshape(1, 6, DIM).repeat(2, 1, 1) - 0.1
    episodes, _, _ = episodes_from_arrays(support, support_labels, query)
    return (x, labels), episodes


def fit(name: str, base: tuple[torch.Tensor, torch.Tensor], **params: Any) -> FewShotClassifier:
    """Method ``name`` fitted on ``base`` with every optional fit of its class, so that
    its saved state holds every group of its declaration."""
    est = make_estimator(name, **{**SMALL.get(name, {}), **params}).fit_base(*base)
    if name == "evidence-lssvm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit_probe(*base)  # the single-problem LS-SVM, beside the base mean
    if name == "em-dirichlet":
        x, y = base
        est.set_class_features(torch.stack([x[y == c].mean(0) for c in range(4)]))
    return est


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory) -> dict[str, tuple[Path, FewShotClassifier]]:
    base, episodes = data
    folder = tmp_path_factory.mktemp("saved")
    out = {}
    for name in NAMES:
        est = fit(name, base)
        est.save(folder / f"{name}.pt")
        out[name] = folder / f"{name}.pt", est
    return out


# ------------------------------------------------------------------------ helpers
def raw(path: Path) -> dict:
    """A saved file's payload as stored (encoded)."""
    return torch.load(path, weights_only=True)


def forge(path: Path, out: Path, edit: Callable[[dict], None]) -> Path:
    """``path``'s payload edited by ``edit`` and saved to ``out`` with its checksum
    recomputed by the function the loader uses (a careful forger)."""
    payload = raw(path)
    edit(payload)
    payload["checksum"] = checksum(payload)
    torch.save(payload, out)
    return out


def refused(path: Path, *words: str) -> str:
    """The loader's message for ``path``: a ValueError naming the file and ``words``."""
    with pytest.raises(ValueError) as err:
        FewShotClassifier.load(path)
    message = str(err.value)
    assert str(path) in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def edit_leaf(state: dict, where: tuple, change: Callable[[Any], Any]) -> None:
    """Replace the encoded value at ``where`` (attribute, then dataclass fields or tuple
    positions) by ``change(value)``."""
    *parents, last = where
    holder = state
    for key in parents:
        holder = holder[key]
    if isinstance(holder, tuple):  # tuples are immutable: rebuild the parent's entry
        raise TypeError("edit the tuple's parent")
    holder[last] = change(holder[last])


def predictions(est: FewShotClassifier, episodes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return est.predict(episodes)


def same(a: Any, b: Any) -> bool:
    """Deep equality of fitted values (tensors exactly, dataclasses field by field)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("name", NAMES)
def test_round_trip(name, saved, data):
    path, est = saved[name]
    back = FewShotClassifier.load(path)
    assert type(back) is type(est)
    assert back.get_params() == est.get_params()
    state, loaded = est.fitted_state(), back.fitted_state()
    assert loaded.keys() == state.keys()
    assert all(same(loaded[k], state[k]) for k in state)
    _, episodes = data
    assert torch.equal(predictions(back, episodes), predictions(est, episodes))


@pytest.mark.parametrize("name", NAMES)
def test_an_unfitted_estimator_round_trips(name, tmp_path):
    est = make_estimator(name)
    est.save(tmp_path / "new.pt")
    back = FewShotClassifier.load(tmp_path / "new.pt")
    assert type(back) is type(est) and back.fitted_state() == {}


# ------------------------------------------------------------------------ forged tensors
@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_a_fitted_tensor_of_another_dtype_is_refused(name, dtype, saved, tmp_path):
    path, _ = saved[name]
    forged = forge(
        path,
        tmp_path / "dtype.pt",
        lambda p: edit_leaf(p["state"], ("base_mean_",), lambda t: t.to(dtype)),
    )
    got = f"got {str(dtype).removeprefix('torch.')} of shape [{DIM}]"
    message = refused(forged, "base_mean_ should be a float", "tensor of shape [D]", got)
    assert "(D = " not in message  # base_mean_ is the first to say what D is


@pytest.mark.parametrize("name", ["slem", "bavardage"])
def test_a_dataclass_field_of_another_dtype_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    where = {"slem": ("factor_", "chol"), "bavardage": ("whitening_", "rotation")}[name]
    forged = forge(
        path,
        tmp_path / "field.pt",
        lambda p: edit_leaf(p["state"], where, lambda t: t.float()),
    )
    refused(forged, f"{'.'.join(where)} should be a float64 tensor of shape [D, D] (D = 8)")


@pytest.mark.parametrize("name", NAMES)
def test_an_extra_leading_axis_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    forged = forge(
        path,
        tmp_path / "axis.pt",
        lambda p: edit_leaf(p["state"], ("base_mean_",), lambda t: torch.stack([t, t])),
    )
    refused(forged, "base_mean_ should be", "of shape [D]", f"got float64 of shape [2, {DIM}]")


#: an attribute (path) that shares the dimension D with base_mean_, per method; the
#: methods that keep only base_mean_ have no second one
SECOND_D = {
    "bavardage": ("scatter_",),
    "bavardage-gamma": ("scatter_eigen_",),
    "vmp-gmm": ("within_var_",),
    "evidence-lssvm": ("coef_",),
    "slem": ("factor_", "mu"),
    "em-dirichlet": ("class_features_",),
    # the open-set background (fit_base) shares D with base_mean_
    "nearest-centroid": ("background_mean_",),
    "soft-kmeans": ("background_mean_",),
    "gp-tree": ("background_mean_",),
}


@pytest.mark.parametrize("name", sorted(SECOND_D))
def test_attributes_that_disagree_on_a_dimension_are_refused(name, saved, tmp_path):
    path, _ = saved[name]
    where = SECOND_D[name]

    def narrower(value: Any) -> Any:
        if isinstance(value, tuple):  # an eigendecomposition: narrow its eigenvalues
            return (value[0][:-1], value[1])
        return value[..., :-1]

    forged = forge(path, tmp_path / "dim.pt", lambda p: edit_leaf(p["state"], where, narrower))
    label = where[0] + ("[0]" if name == "bavardage-gamma" else "")
    label += "".join(f".{k}" for k in where[1:])
    refused(forged, f"{label} should be", f"D = {DIM}")


def test_the_methods_without_a_second_d_keep_only_the_base_mean(saved):
    for name in set(NAMES) - set(SECOND_D):
        assert list(saved[name][1].fitted_state()) == ["base_mean_"], name
    for name in ("nearest-centroid", "soft-kmeans", "gp-tree"):
        assert set(saved[name][1].fitted_state()) == {
            "base_mean_",
            "background_mean_",
            "background_within_",
            "background_between_",
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
        }, name


@pytest.mark.parametrize("name", NAMES)
def test_a_base_mean_scaled_by_1e30_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    forged = forge(
        path,
        tmp_path / "huge.pt",
        lambda p: edit_leaf(p["state"], ("base_mean_",), lambda t: t * 1e30),
    )
    refused(forged, "base_mean_ should be", "at most 1e+15 in magnitude")


def test_a_dataclass_of_another_class_is_refused(saved, tmp_path):
    path, _ = saved["slem"]

    def relabel(payload: dict) -> None:
        payload["state"]["factor_"]["class"] = "probfsl.inference.plda:GlobalWhitening"

    refused(forge(path, tmp_path / "record.pt", relabel), "factor_ should be a NegativeFactor")

    def drop_field(payload: dict) -> None:
        del payload["state"]["factor_"]["chol"]

    refused(forge(path, tmp_path / "field.pt", drop_field), "factor_.chol is missing")

    def dual_without_xc(payload: dict) -> None:
        payload["state"]["factor_"]["mode"] = "dual"

    refused(forge(path, tmp_path / "mode.pt", dual_without_xc), "factor_.xc should be")


# ------------------------------------------------------------------------ attributes
@pytest.mark.parametrize("name", NAMES)
def test_an_extra_attribute_is_refused(name, saved, tmp_path):
    path, _ = saved[name]

    def add(payload: dict) -> None:
        payload["state"]["bogus_"] = torch.zeros(DIM, dtype=torch.float64)

    refused(forge(path, tmp_path / "extra.pt", add), "bogus_ is not a fitted attribute")


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_attribute_is_refused_or_the_estimator_is_unfitted(name, saved, data, tmp_path):
    """Dropping base_mean_ breaks fit_base's group where it holds more; where it is the
    group's only attribute the file is that of an estimator saved without fit_base,
    which loads and says at prediction what is missing (never an AttributeError)."""
    path, est = saved[name]
    group = next(g for g in est.schema.fitted if "base_mean_" in g.attributes)

    def drop(payload: dict) -> None:
        del payload["state"]["base_mean_"]

    forged = forge(path, tmp_path / "missing.pt", drop)
    if len(group.required()) > 1:
        refused(forged, "base_mean_ is missing", f"fit_base sets {', '.join(group.required())}")
        other = group.required()[-1]

        def drop_other(payload: dict) -> None:
            del payload["state"][other]

        refused(forge(path, tmp_path / "other.pt", drop_other), f"{other} is missing")
        return
    back = FewShotClassifier.load(forged)
    assert "base_mean_" not in back.fitted_state()
    _, episodes = data
    if name == "em-dirichlet":  # its class features stand in for the support means
        assert predictions(back, episodes).shape == (2, 6)
    else:
        with pytest.raises(ValueError, match="fit_base"):
            predictions(back, episodes)


@pytest.mark.parametrize("name", NAMES)
def test_a_file_relabelled_as_another_estimator_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    other = "nearest-centroid" if name == "slem" else "slem"
    cls = method_info(other).load()

    def relabel(payload: dict, params: bool) -> None:
        payload["class"] = f"{cls.__module__}:{cls.__qualname__}"
        if params:  # the forger also gives the other class's hyperparameters
            payload["params"] = encode(make_estimator(other).get_params(), "params")

    message = refused(forge(path, tmp_path / "a.pt", lambda p: relabel(p, False)))
    assert f"of {cls.__name__}" in message
    message = refused(forge(path, tmp_path / "b.pt", lambda p: relabel(p, True)))
    names = set(saved[name][1].fitted_state()) | set(cls.schema.attributes())
    assert any(a in message for a in names), message


def test_a_slem_file_relabelled_as_nearest_centroid_names_its_attributes(saved, tmp_path):
    path, _ = saved["slem"]

    def relabel(payload: dict) -> None:
        payload["class"] = "probfsl.models.nearest_centroid:NearestCentroid"
        payload["params"] = encode(make_estimator("nearest-centroid").get_params(), "params")

    refused(forge(path, tmp_path / "nc.pt", relabel), "factor_ is not a fitted attribute")


# ------------------------------------------------------------------------ hyperparameters
#: an out-of-range value of one hyperparameter per method
OUT_OF_RANGE = {
    "nearest-centroid": ("temperature", -1.0),
    "soft-kmeans": ("n_iter", 0),
    "bavardage": ("temperature_vb", -1.0),
    "bavardage-gamma": ("a0", -1.0),
    "vmp-gmm": ("tol", -1e-6),
    "gp-tree": ("seed", -1),
    "evidence-lssvm": ("lambda_mode", "global"),
    "slem": ("rel_lam", -1),
    "em-dirichlet": ("k_eff", 0),
}
#: a hyperparameter that takes a real number, per method
REAL = {
    "nearest-centroid": "temperature",
    "soft-kmeans": "temperature",
    "bavardage": "temperature_km",
    "bavardage-gamma": "temperature_vb",
    "vmp-gmm": "alpha0",
    "gp-tree": "outputscale",
    "evidence-lssvm": "lam_init",
    "slem": "rel_lam",
    "em-dirichlet": "temperature",
}
#: a hyperparameter that takes an integer, per method that has one
INTEGER = {
    "soft-kmeans": "n_iter",
    "bavardage": "n_km",
    "bavardage-gamma": "n_vb",
    "vmp-gmm": "max_iter",
    "gp-tree": "n_sweeps",
    "em-dirichlet": "k_eff",
}


def with_param(path: Path, out: Path, key: str, value: Any) -> Path:
    def edit(payload: dict) -> None:
        payload["params"][key] = value

    return forge(path, out, edit)


@pytest.mark.parametrize("name", NAMES)
def test_a_hyperparameter_out_of_range_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    key, value = OUT_OF_RANGE[name]
    refused(with_param(path, tmp_path / "range.pt", key, value), f"hyperparameter {key}")
    # the same declaration refuses it at construction (check_params)
    with pytest.raises(ValueError, match=key):
        make_estimator(name, **{key: value})


@pytest.mark.parametrize("name", NAMES)
def test_a_string_for_a_real_hyperparameter_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    key = REAL[name]
    forged = with_param(path, tmp_path / "str.pt", key, "hot")
    refused(forged, f"hyperparameter {key} should be a finite real number", "'hot' (str)")
    with pytest.raises(TypeError, match=key):
        make_estimator(name, **{key: "hot"})


@pytest.mark.parametrize("name", sorted(INTEGER))
def test_a_bool_for_an_integer_hyperparameter_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    key = INTEGER[name]
    forged = with_param(path, tmp_path / "bool.pt", key, True)
    refused(forged, f"hyperparameter {key} should be an integer", "True (bool)")
    with pytest.raises(TypeError, match=key):
        make_estimator(name, **{key: True})


def test_the_integer_table_covers_every_method_with_an_integer_hyperparameter():
    from probfsl.schema import Int

    with_int = {n for n in NAMES if any(isinstance(p, Int) for p in _schema(n).params.values())}
    assert with_int == set(INTEGER)


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_or_container_hyperparameter_is_refused(name, saved, tmp_path):
    path, _ = saved[name]
    key = REAL[name]

    def drop(payload: dict) -> None:
        del payload["params"][key]

    refused(forge(path, tmp_path / "drop.pt", drop), f"hyperparameter {key} of", "is missing")
    forged = with_param(path, tmp_path / "list.pt", key, [1.0])
    refused(forged, f"hyperparameter {key} should be", "got a list")


def test_a_dataclass_as_a_hyperparameter_is_refused_unbuilt(saved, tmp_path):
    path, _ = saved["slem"]
    tagged = {TAG: "dataclass", "class": "probfsl.methods:MethodInfo", "name": "x"}
    refused(with_param(path, tmp_path / "dc.pt", "temperature", tagged), "temperature")


# ------------------------------------------------------------------------ saving
def test_save_checks_the_state_against_the_declaration(data, tmp_path):
    base, _ = data
    est = fit("slem", base)
    est.base_mean_ = est.base_mean_[None]
    with pytest.raises(ValueError, match=r"cannot save SLEM to .*base_mean_ should be"):
        est.save(tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()


# ------------------------------------------------------------------------ declarations
def _schema(name: str) -> EstimatorSchema:
    schema = method_info(name).load().schema
    assert isinstance(schema, EstimatorSchema), name
    return schema


@pytest.mark.parametrize("cls", [*(method_info(n).load() for n in NAMES), GPTree])
def test_the_declared_hyperparameters_are_the_constructor_arguments(cls):
    declared = list(cls.schema.params)
    arguments = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert sorted(declared) == sorted(arguments)
    cls().check_params()  # the defaults are valid


def _records(spec: Any) -> list[Record]:
    if isinstance(spec, Record):
        inner = [*spec.fields.values()] + [
            v for var in spec.variants.values() for v in var.values()
        ]
        return [spec, *(r for s in inner for r in _records(s))]
    if isinstance(spec, Items):
        return [r for s in spec.items for r in _records(s)]
    if isinstance(spec, Maybe) and spec.inner is not None:
        return _records(spec.inner)
    return []


@pytest.mark.parametrize("name", NAMES)
def test_declared_records_have_the_fields_of_their_dataclass(name):
    for group in _schema(name).fitted:
        for spec in group.attributes.values():
            for record in _records(spec):
                fields = {f.name for f in dataclasses.fields(record.cls)}
                assert record.field_names() == fields, record.cls


#: fits that together produce every fitted attribute a method can save
VARIANTS: dict[str, list[dict]] = {
    "slem": [{}, {"engine": "derived"}, {"rows": 5}],  # 5 rows < 8 features: dual factor
    "bavardage": [{}, {"s_max": None, "scale": "relative"}, {"s_max": float("inf")}],
    "evidence-lssvm": [{}, {"fit_intercept": True, "lambda_mode": "per_class"}, {"rows": 6}],
}


@pytest.mark.parametrize("name", NAMES)
def test_declarations_cover_exactly_what_fitting_produces(name, data, tmp_path):
    """Every attribute that fitting sets is declared, in the form declared (saving checks
    it), and every declared attribute is set by some fit: declarations cannot drift."""
    (x, y), episodes = data
    produced: set[str] = set()
    for variant in VARIANTS.get(name, [{}]):
        params = dict(variant)
        rows = params.pop("rows", len(x))
        est = fit(name, (x[:rows], y[:rows]), **params)
        predictions(est, episodes)  # per-call diagnostics are not part of the state
        est.save(tmp_path / "variant.pt")  # checked against the declaration
        back = FewShotClassifier.load(tmp_path / "variant.pt")
        assert back.fitted_state().keys() == est.fitted_state().keys()
        produced |= set(est.fitted_state())
    assert produced == set(_schema(name).attributes())


def test_a_file_saved_under_a_renamed_module_still_loads(tmp_path):
    """GP-Tree's package was ``probfsl.models.gptree``; files naming it still load."""
    import json

    from probfsl.models.gp_tree.few_shot import GPTreeFewShot
    from probfsl.schema import current_module, saveable_class

    assert current_module("probfsl.models.gptree.few_shot") == "probfsl.models.gp_tree.few_shot"
    assert current_module("probfsl.models.gptreex") == "probfsl.models.gptreex"
    assert saveable_class("probfsl.models.gptree.few_shot:GPTreeFewShot") is GPTreeFewShot
    assert json.dumps(current_module("probfsl.models.slem")) == '"probfsl.models.slem"'
