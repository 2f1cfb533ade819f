import logging

import numpy as np
import pytest
import torch

from probfsl import methods, tuning
from probfsl.data import FeatureSet, sample_episodes
from probfsl.data.base_episodes import (
    base_episode_shape,
    base_episode_split,
    hardest_episode_shape,
    open_base_episode_shape,
)
from probfsl.data.tasks import BALANCES
from probfsl.methods import METHODS, MethodInfo
from probfsl.models.base import FewShotClassifier
from probfsl.tuning import (
    FALLBACK_PRESETS,
    SEARCH_SPACES,
    AutoPreset,
    auto_preset,
    auto_preset_zero_shot,
    make_estimator,
    tune,
    tune_zero_shot,
)
from tests.conftest import make_featureset


def _shuffled_novel(fs: FeatureSet, seed: int) -> FeatureSet:
    """The same data with the novel rows' labels (and features) scrambled."""
    rng = np.random.default_rng(seed)
    labels, features = fs.labels.copy(), fs.features.copy()
    novel = np.flatnonzero(fs.split == "novel")
    labels[novel] = rng.permutation(labels[novel])
    features[novel] = rng.standard_normal(features[novel].shape)
    return FeatureSet(features, labels, fs.class_names, fs.split, name=fs.name)


def test_tuning_never_reads_novel_classes():
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    space = {"temperature": [0.1, 1.0, 10.0]}
    a = tune("soft-kmeans", fs, space, shot=1, n_query=20, n_episodes=30, seed=0)
    b = tune("soft-kmeans", _shuffled_novel(fs, 1), space, shot=1, n_query=20, n_episodes=30)
    assert a.best == b.best
    assert [r["accuracy"] for r in a.trace] == [r["accuracy"] for r in b.trace]


def test_base_episode_split_keeps_novel_rows_out():
    fs = make_featureset(n_base=8, n_novel=4)
    view = base_episode_split(fs, seed=0)
    assert set(view.split[fs.split == "novel"]) == {"held_out"}
    pseudo = view.classes_in("novel")
    assert len(pseudo) == 4 and set(pseudo) <= set(fs.classes_in("base"))
    assert not set(pseudo) & set(view.classes_in("base"))
    with pytest.raises(ValueError, match="at least 4 base classes"):
        base_episode_split(make_featureset(n_base=3, n_novel=4))


def test_tuning_is_deterministic_with_a_seed():
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    space = {"temperature": [0.3, 3.0, 30.0]}
    runs = [tune("soft-kmeans", fs, space, n_query=20, n_episodes=20, seed=5) for _ in range(2)]
    assert runs[0].best == runs[1].best
    assert [r["accuracy"] for r in runs[0].trace] == [r["accuracy"] for r in runs[1].trace]


class Noisy(FewShotClassifier):
    """Knows the query labels but answers wrongly on a fraction ``flip`` of the queries,
    so its best setting is known: the smallest ``flip``."""

    def __init__(self, flip: float = 0.5) -> None:
        self.flip = flip

    def predict_proba(self, episodes):
        labels = episodes.query_labels.clone()
        n_wrong = round(self.flip * labels.shape[1])
        labels[:, :n_wrong] = (labels[:, :n_wrong] + 1) % episodes.way
        return torch.nn.functional.one_hot(labels, episodes.way).float()


def test_tuning_finds_a_known_best_setting(monkeypatch):
    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    result = tune("noisy", fs, {"flip": [0.8, 0.4, 0.1, 0.6]}, n_query=20, n_episodes=10)
    assert result.best == {"flip": 0.1}
    # the refinement tried the geometric midpoint towards the neighbour 0.4
    assert {"flip": 0.2} in [r["params"] for r in result.trace]
    assert max(r["accuracy"] for r in result.trace) == pytest.approx(90.0)


class TwoKnobs(Noisy):
    """:class:`Noisy` with a second hyperparameter that changes nothing."""

    def __init__(self, flip: float = 0.5, knob: float = 1.0) -> None:
        super().__init__(flip)
        self.knob = knob


def test_a_fixed_hyperparameter_stays_as_given_and_the_rest_is_searched(monkeypatch):
    """A hyperparameter the user fixes is never searched over, even where the method's
    search space holds it: every candidate, the choice and the cache key keep the user's
    value (the search would have chosen flip 0.1 here); every one fixed leaves one
    candidate; a space that also lists a fixed one is a ValueError."""
    monkeypatch.setitem(METHODS, "knobs", MethodInfo("knobs", "tests.test_tuning:TwoKnobs", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "knobs", {"flip": [0.8, 0.1], "knob": [1.0, 2.0]})
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    fixed = {"flip": 0.8}
    choice = auto_preset("knobs", fs, 4, 1, 20, n_episodes=10, fixed=fixed, cache=False)
    assert {r["params"].get("flip") for r in choice.result.trace} == {None}
    assert {r["params"]["knob"] for r in choice.result.trace} >= {1.0, 2.0}
    assert choice.result.best["flip"] == 0.8
    if choice.method is None:
        assert choice.params["flip"] == 0.8
    assert tuning.search_space("knobs", fixed) == {"knob": [1.0, 2.0]}
    every = {"flip": 0.4, "knob": 2.0}
    result = tune("knobs", fs, None, 4, 1, 20, n_episodes=10, fixed=every)
    assert [r["params"] for r in result.trace] == [{}] and result.best == every
    with pytest.raises(ValueError, match="flip: both fixed and in the search space"):
        tune("knobs", fs, {"flip": [0.1]}, 4, 1, 20, n_episodes=10, fixed=fixed)


def test_bad_criterion_and_unknown_method():
    fs = make_featureset(n_base=8, n_novel=4)
    with pytest.raises(ValueError, match="criterion"):
        tune("soft-kmeans", fs, {"temperature": [1.0]}, criterion="loss")
    with pytest.raises(ValueError, match="no search space"):
        tune("nearest-centroid", fs)


def test_auto_preset_tunes_per_task_shape_on_base_features_only():
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    auto = make_estimator("soft-kmeans", preset="auto")
    assert isinstance(auto, AutoPreset) and auto.transductive
    auto.n_episodes = 30
    auto.fit_base(*fs.base())
    episodes = sample_episodes(fs, 4, way=5, shot=1, n_query=20, seed=3)
    proba = auto.predict_proba(episodes)
    ((shape, result),) = auto.tuning_.items()
    assert shape == (5, 1, 20)
    # the same search run directly on the base classes, and the chosen model's predictions
    base_only = FeatureSet(
        fs.features[fs.split == "base"].astype(np.float64),
        fs.labels[fs.split == "base"],
        [str(c) for c in range(12)],
        np.full(12 * 25, "base"),
    )
    direct = tune(
        "soft-kmeans", base_only, None, shot=1, n_query=20, n_episodes=30, balance="dirichlet"
    )
    assert result.best == direct.best
    chosen = make_estimator("soft-kmeans", **result.best).fit_featureset(fs)
    torch.testing.assert_close(proba, chosen.predict_proba(episodes))
    assert set(result.best) == {"temperature"}
    with pytest.raises(ValueError, match="no search space"):
        make_estimator("nearest-centroid", preset="auto")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        make_estimator("soft-kmeans", preset="auto", warp=9)


def test_the_registry_builds_no_auto_preset_and_tuning_builds_the_rest():
    """registry -> tuning, one direction: ``preset="auto"`` is tuning's; every other
    preset is the registry's, unchanged."""
    with pytest.raises(ValueError, match="probfsl.make_estimator"):
        methods.build_estimator("soft-kmeans", preset="auto")
    a = make_estimator("bavardage", "mini-balanced", n_vb=3)
    b = methods.build_estimator("bavardage", "mini-balanced", n_vb=3)
    assert type(a) is type(b) and a.get_params() == b.get_params()


class Recorder(Noisy):
    """:class:`Noisy` that records the dtype and device of the tasks and base features."""

    seen: list = []

    def fit_base(self, features, labels):
        Recorder.seen.append(("fit", features.dtype, features.device.type))
        return self

    needs_base = True

    def predict_proba(self, episodes):
        Recorder.seen.append(("predict", episodes.support.dtype, episodes.support.device.type))
        return super().predict_proba(episodes).to(episodes.support.dtype)


class _ThisRecorder(MethodInfo):
    """The registry entry of :class:`Recorder` as defined in this very module (the test
    reads its class attribute)."""

    def load(self):
        return Recorder


def test_tuning_runs_in_the_dtype_and_on_the_device_given(monkeypatch):
    monkeypatch.setitem(METHODS, "rec", _ThisRecorder("rec", "", "toy"))
    monkeypatch.setattr(Recorder, "seen", [])
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    space = {"flip": [0.8, 0.1]}
    f64 = tune("rec", fs, space, n_query=20, n_episodes=5, dtype=torch.float64, device="cpu")
    assert set(Recorder.seen) == {("fit", torch.float64, "cpu"), ("predict", torch.float64, "cpu")}
    Recorder.seen.clear()
    f32 = tune("rec", fs, space, n_query=20, n_episodes=5)  # default: float32 on the CPU
    assert set(Recorder.seen) == {("fit", torch.float32, "cpu"), ("predict", torch.float32, "cpu")}
    assert f64.best == f32.best == {"flip": 0.1}
    with pytest.raises(ValueError, match="'warp-drive' is not a device"):
        tune("rec", fs, space, device="warp-drive")
    with pytest.raises(TypeError, match="dtype"):
        tune("rec", fs, space, dtype=torch.int64)


def test_auto_preset_follows_the_tasks_dtype_and_keeps_its_choice(monkeypatch):
    monkeypatch.setitem(METHODS, "rec", _ThisRecorder("rec", "", "toy"))
    # flip=0 is perfect, as nearest centroid is on these well separated classes
    monkeypatch.setitem(SEARCH_SPACES, "rec", {"flip": [0.8, 0.0]})
    monkeypatch.setattr(Recorder, "seen", [])
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    auto = make_estimator("rec", preset="auto")
    auto.n_episodes = 5
    auto.fit_base(*fs.base())
    episodes = sample_episodes(fs, 3, way=5, shot=1, n_query=20, seed=3)
    p32 = auto.predict_proba(episodes)
    p64 = auto.predict_proba(episodes.to(dtype=torch.float64))
    assert p32.dtype == torch.float32 and p64.dtype == torch.float64
    assert len(auto.choices_) == 1 and len(auto.estimators_) == 2  # one search, two fits
    assert ("fit", torch.float64, "cpu") in Recorder.seen
    torch.testing.assert_close(p64.float(), p32)


def test_auto_preset_searches_in_prepare_so_evaluation_times_it_apart(monkeypatch):
    monkeypatch.setitem(METHODS, "rec", _ThisRecorder("rec", "", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "rec", {"flip": [0.8, 0.0]})
    monkeypatch.setattr(Recorder, "seen", [])
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    auto = make_estimator("rec", preset="auto")
    auto.n_episodes = 5
    auto.fit_base(*fs.base())
    episodes = sample_episodes(fs, 3, way=5, shot=1, n_query=20, seed=3)
    auto.prepare(episodes[:1])
    assert list(auto.choices_) == [(5, 1, 20)] and len(auto.estimators_) == 1
    searched = list(Recorder.seen)
    auto.predict_proba(episodes)  # no second search, no second fit
    assert len(auto.choices_) == 1 and len(auto.estimators_) == 1
    assert [s for s in Recorder.seen if s[0] == "fit"] == [s for s in searched if s[0] == "fit"]


class NoisyZeroShot:
    """Zero-shot toy: argmax of the probabilities, wrong on a fraction ``flip`` of queries."""

    def __init__(self, flip: float = 0.5, temperature: float = 30.0) -> None:
        self.flip, self.temperature = flip, temperature

    def predict_zero_shot(self, probs):
        pred = probs.argmax(-1)
        n_wrong = round(self.flip * pred.shape[1])
        pred[:, :n_wrong] = (pred[:, :n_wrong] + 1) % probs.shape[-1]
        return pred


def _with_class_embeddings(fs: FeatureSet) -> FeatureSet:
    means = np.stack([fs.features[fs.labels == c].mean(0) for c in range(len(fs.class_names))])
    return FeatureSet(fs.features, fs.labels, fs.class_names, fs.split, means, fs.name)


def test_zero_shot_tuning_uses_base_classes_only_and_finds_the_known_best(monkeypatch):
    monkeypatch.setitem(
        METHODS, "noisy-zs", MethodInfo("noisy-zs", "tests.test_tuning:NoisyZeroShot", "toy")
    )
    fs = _with_class_embeddings(make_featureset(n_base=8, n_novel=6, per_class=25))
    space = {"flip": [0.8, 0.4, 0.1]}
    a = tune_zero_shot("noisy-zs", fs, space, 2, 5, n_query=20, n_tasks=20)
    scrambled = _shuffled_novel(fs, 2)
    scrambled.class_features = fs.class_features
    b = tune_zero_shot("noisy-zs", scrambled, space, 2, 5, n_query=20, n_tasks=20)
    assert a.best == b.best == {"flip": 0.1}
    assert [r["accuracy"] for r in a.trace] == [r["accuracy"] for r in b.trace]


@pytest.mark.parametrize("method", sorted(SEARCH_SPACES))
@pytest.mark.slow
def test_auto_falls_back_when_base_classes_cannot_form_the_episodes(method, monkeypatch):
    """5 base classes, 5-way tasks: half of the base classes (2) play novel classes, so the
    search runs on 2-way base episodes; 3 base classes: no search, a documented fallback."""
    fixed = {}
    if method == "em-dirichlet":  # about 1 s per candidate on these tasks: fewer, shorter runs
        monkeypatch.setitem(SEARCH_SPACES, method, {"n_iter": [1, 2]})
        fixed = {"n_iter": 2}
    if method == "bavardage-gamma":  # VMP derives its plan per call: 2 of the 50 candidates
        space = {**SEARCH_SPACES[method], "temperature_vb": [0.1, 1.0], "s_max": [1.0]}
        monkeypatch.setitem(SEARCH_SPACES, method, {**space, "balanced": [False]})
    fs = make_featureset(n_base=5, n_novel=6, per_class=12, dim=4)
    episodes = sample_episodes(fs, 3, way=5, shot=1, n_query=15, seed=1)
    choice = auto_preset(method, fs, way=5, shot=1, n_query=15, n_episodes=3, fixed=fixed)
    assert choice.result is not None
    assert "tuned on 2-way 1-shot 6-query base episodes" in choice.note
    reference = (fixed, FALLBACK_PRESETS.get(method, {}).get("balanced"))
    if choice.method is None:
        assert (choice.params, choice.preset) in ((choice.result.best, None), reference)
    else:  # below nearest centroid on the base episodes: the baseline runs, and it says so
        assert choice.method == "nearest-centroid" and (choice.params, choice.preset) == ({}, None)
        assert "running nearest-centroid" in choice.note
    name = choice.method or method
    model = make_estimator(name, choice.preset, **choice.params).fit_featureset(fs)
    proba = model.predict_proba(episodes)
    assert torch.isfinite(proba).all()
    torch.testing.assert_close(proba.sum(-1), torch.ones(3, 15))

    few = make_featureset(n_base=3, n_novel=6, per_class=12, dim=4)
    for balance in BALANCES:
        choice = auto_preset(method, few, 5, 1, 15, balance, n_episodes=3, fixed=fixed)
        assert choice.result is None and choice.params == fixed
        assert choice.preset == FALLBACK_PRESETS.get(method, {}).get(balance)
        assert "3 base classes" in choice.note and "using" in choice.note
    # the Python estimator takes the same fallback
    auto = make_estimator(method, preset="auto", **fixed)
    auto.n_episodes = 3
    proba = auto.fit_base(*few.base()).predict_proba(episodes)
    assert torch.isfinite(proba).all() and auto.tuning_[(5, 1, 15)] is None


def test_base_episode_shape_keeps_the_target_when_it_fits_and_shrinks_otherwise():
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    assert base_episode_shape(fs, 5, 1, 75) == (5, 1, 75)
    assert base_episode_shape(fs, 5, 5, 75, "dirichlet") == (5, 5, 75)
    assert base_episode_shape(fs, 5, 5, 150) == (5, 5, 100)  # 30 queries per class > 25 - 5
    small = make_featureset(n_base=8, n_novel=6, per_class=4)
    assert base_episode_shape(small, 5, 5, 75) == (4, 3, 4)  # 4 play novel, 4 samples each
    assert base_episode_shape(small, 5, 5, 75, "dirichlet") == (4, 3, 4)
    assert base_episode_shape(make_featureset(n_base=3), 5, 1, 75) is None
    one = make_featureset(n_base=6, n_novel=6, per_class=1)
    assert base_episode_shape(one, 5, 1, 75) is None
    # every shape it returns can be sampled
    for f in (fs, small):
        for balance in BALANCES:
            w, s, q = base_episode_shape(f, 5, 5, 75, balance)
            sample_episodes(base_episode_split(f), 5, w, s, q, balance)


def test_open_base_episode_shape_makes_room_for_open_classes():
    """Open-set base episodes keep the asked shape where the pseudo-novel classes hold it;
    else fewer known classes leave two open ones (queries scaled alike), then fewer
    queries, and None where not even that fits. Every shape returned can be sampled."""
    many = make_featureset(n_base=20, n_novel=6, per_class=40)
    view = base_episode_split(many)  # 10 pseudo-novel classes: 5 known + 5 open
    assert open_base_episode_shape(view, (5, 1, 75), 75) == ((5, 1, 75), 75)
    ten = base_episode_split(make_featureset(n_base=10, n_novel=6, per_class=40))
    assert open_base_episode_shape(ten, (5, 1, 75), 75) == ((3, 1, 45), 45)
    assert open_base_episode_shape(ten, (5, 5, 50), 25) == ((3, 5, 30), 15)
    # 6 pseudo-novel classes of 25: 5 known + 1 open, which holds 75 // 4 open queries
    six = base_episode_split(make_featureset(n_base=12, n_novel=6, per_class=25))
    assert open_base_episode_shape(six, (5, 1, 75), 75) == ((5, 1, 15), 18)
    assert open_base_episode_shape(six, (5, 1, 75), 75, "dirichlet") == ((5, 1, 15), 18)
    three = base_episode_split(make_featureset(n_base=6, n_novel=6, per_class=40))
    assert open_base_episode_shape(three, (3, 1, 30), 30) == ((2, 1, 20), 20)
    two = base_episode_split(make_featureset(n_base=4, n_novel=6, per_class=40))
    assert open_base_episode_shape(two, (2, 1, 20), 20) is None
    for v in (view, ten, six, three):
        for balance in BALANCES:
            found = open_base_episode_shape(v, (5, 1, 75), 75, balance)
            (w, s, q), n_open = found
            episodes = sample_episodes(v, 4, w, s, q, balance, n_open=n_open)
            assert episodes.open_mask.sum(1).eq(n_open).all() and w <= 5


def test_zero_shot_auto_shrinks_or_falls_back(monkeypatch):
    monkeypatch.setitem(
        METHODS, "noisy-zs", MethodInfo("noisy-zs", "tests.test_tuning:NoisyZeroShot", "toy")
    )
    monkeypatch.setitem(SEARCH_SPACES, "noisy-zs", {"flip": [0.8, 0.1]})
    fs = _with_class_embeddings(make_featureset(n_base=3, n_novel=6, per_class=10))
    choice = auto_preset_zero_shot("noisy-zs", fs, 3, 10, n_query=75, n_tasks=5)
    assert choice.params == {"flip": 0.1} and "3-3 classes and 30 queries" in choice.note
    one = _with_class_embeddings(make_featureset(n_base=1, n_novel=6, per_class=10))
    choice = auto_preset_zero_shot("noisy-zs", one, 3, 10, n_query=20, n_tasks=5)
    assert choice.result is None and choice.params == {} and "1 base classes" in choice.note


def test_auto_on_smaller_episodes_keeps_the_defaults_unless_clearly_beaten(monkeypatch):
    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    # the toy itself at its default (50%) is the baseline here: nearest centroid would
    # beat every candidate on these classes
    monkeypatch.setattr(tuning, "BASELINE", "noisy")
    fs = make_featureset(n_base=5, n_novel=6, per_class=12, dim=4)
    # flip=0.1 is right on 90% of the queries, the default flip=0.5 on 50%: the search wins
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.8, 0.1]})
    choice = auto_preset("noisy", fs, 5, 1, 15, n_episodes=10)
    assert choice.params == {"flip": 0.1} and "tuned on 2-way" in choice.note
    # candidates no better than the default: the default is kept, and said so
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.5, 0.8]})
    choice = auto_preset("noisy", fs, 5, 1, 15, n_episodes=10)
    assert choice.params == {} and choice.preset is None and choice.result is not None
    assert "no candidate beat the method's defaults there (50.0%)" in choice.note
    # on the target shape itself the search's best is taken as before
    big = make_featureset(n_base=12, n_novel=6, per_class=25)
    choice = auto_preset("noisy", big, 5, 1, 15, n_episodes=10)
    assert choice.params == {"flip": 0.5} and choice.note == ""


def test_auto_runs_nearest_centroid_where_the_method_scores_below_it(monkeypatch, caplog):
    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.8, 0.4]})
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    choice = auto_preset("noisy", fs, 4, 1, 20, n_episodes=10)
    # nearest centroid is about 100% on these classes; the toy's best is 60%
    assert choice.method == "nearest-centroid" and choice.params == {}
    assert choice.baseline_accuracy > 95
    assert "below nearest-centroid" in choice.note and "60.0%" in choice.note
    auto = make_estimator("noisy", preset="auto")
    auto.n_episodes = 10
    auto.fit_base(*fs.base())
    episodes = sample_episodes(fs, 4, way=4, shot=1, n_query=20, seed=1)
    expected = methods.build_estimator("nearest-centroid").fit_featureset(fs).predict(episodes)
    with caplog.at_level(logging.INFO, logger="probfsl.tuning"):
        assert torch.equal(auto.predict(episodes), expected)
    assert "preset auto, noisy 4-way 1-shot: nearest-centroid" in caplog.text  # said so
    # a method at least as good as the baseline keeps its own choice
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.8, 0.0]})
    kept = auto_preset("noisy", fs, 4, 1, 20, n_episodes=10)
    assert kept.method is None and kept.params == {"flip": 0.0}


def test_auto_choices_are_cached_per_data_and_setting(monkeypatch, tuning_cache_dir):
    monkeypatch.setitem(METHODS, "rec", _ThisRecorder("rec", "", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "rec", {"flip": [0.8, 0.0]})
    monkeypatch.setattr(Recorder, "seen", [])
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    first = auto_preset("rec", fs, 5, 1, 20, n_episodes=5)
    assert Recorder.seen and list(tuning_cache_dir.rglob("*.json"))
    Recorder.seen.clear()
    again = auto_preset("rec", fs, 5, 1, 20, n_episodes=5)
    assert Recorder.seen == []  # read back, nothing fitted
    assert again.params == first.params and again.result.trace == first.result.trace
    # another setting, other data or no cache: a new search
    auto_preset("rec", fs, 5, 2, 20, n_episodes=5)
    assert Recorder.seen
    Recorder.seen.clear()
    other = make_featureset(n_base=12, n_novel=4, per_class=25, seed=1)
    auto_preset("rec", other, 5, 1, 20, n_episodes=5)
    assert Recorder.seen
    Recorder.seen.clear()
    auto_preset("rec", fs, 5, 1, 20, n_episodes=5, cache=False)
    assert Recorder.seen
    # a damaged entry is searched again, and rewritten
    for entry in tuning_cache_dir.rglob("*.json"):
        entry.write_text("{not json")
    Recorder.seen.clear()
    assert auto_preset("rec", fs, 5, 1, 20, n_episodes=5).params == first.params
    assert Recorder.seen
    # PROBFSL_CACHE_DIR=off: nothing written
    monkeypatch.setenv("PROBFSL_CACHE_DIR", "off")
    for entry in tuning_cache_dir.rglob("*.json"):
        entry.unlink()
    auto_preset("rec", fs, 5, 1, 20, n_episodes=5)
    assert not list(tuning_cache_dir.rglob("*.json"))


def test_a_method_without_a_knob_is_still_held_against_nearest_centroid(monkeypatch):
    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {})  # its defaults are the one candidate
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    choice = auto_preset("noisy", fs, 4, 1, 20, n_episodes=10)
    assert [row["params"] for row in choice.result.trace] == [{}]
    assert choice.method == "nearest-centroid" and "scored 50.0%" in choice.note
    assert SEARCH_SPACES["evidence-lssvm"] == {}


@pytest.mark.parametrize(
    "space", [{}, {"rel_lam": []}, {"rel_lam": 1.0}, {"rel_lam": "abc"}, [("rel_lam", [1.0])]]
)
def test_a_bad_search_space_is_a_value_error_naming_it(space):
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    with pytest.raises(ValueError, match="space"):
        tune("slem", fs, space, n_episodes=5)


class WayDependent(FewShotClassifier):
    """Perfect on 2-way tasks, wrong on 80% of the queries of wider ones (GP-Tree's class
    tree is one node at 2 ways)."""

    def __init__(self, flip: float = 0.8) -> None:
        self.flip = flip

    def predict_proba(self, episodes):
        labels = episodes.query_labels.clone()
        if episodes.way > 2:
            n_wrong = round(self.flip * labels.shape[1])
            labels[:, :n_wrong] = (labels[:, :n_wrong] + 1) % episodes.way
        return torch.nn.functional.one_hot(labels, episodes.way).float()


def test_auto_on_fewer_ways_is_held_against_nearest_centroid_at_the_target_way(monkeypatch):
    info = MethodInfo("waydep", "tests.test_tuning:WayDependent", "toy", way_dependent=True)
    monkeypatch.setitem(METHODS, "waydep", info)
    monkeypatch.setitem(SEARCH_SPACES, "waydep", {"flip": [0.8, 0.9]})
    fs = make_featureset(n_base=5, n_novel=6, per_class=12, dim=4)  # 2-way base episodes
    choice = auto_preset("waydep", fs, 5, 1, 15, n_episodes=10)
    assert "tuned on 2-way" in choice.note
    assert choice.method == "nearest-centroid", choice.note
    assert "5-way 1-shot episodes of all 5 base classes" in choice.note
    # a method not declared way-dependent is checked at the target way too
    monkeypatch.setitem(METHODS, "waydep", MethodInfo("waydep", info.target, "toy"))
    other = auto_preset("waydep", fs, 5, 1, 15, n_episodes=10, cache=False)
    assert other.method == "nearest-centroid", other.note
    assert "5-way 1-shot episodes of all 5 base classes" in other.note


def test_the_target_way_check_draws_classes_for_any_method(monkeypatch):
    """With enough base classes, the check at the target way lets draws of base classes
    play the novel classes, the rest the base classes: a non-GP method is held to it."""
    monkeypatch.setitem(
        METHODS, "waydep", MethodInfo("waydep", "tests.test_tuning:WayDependent", "toy")
    )
    monkeypatch.setitem(SEARCH_SPACES, "waydep", {"flip": [0.8, 0.9]})
    fs = make_featureset(n_base=7, n_novel=6, per_class=12, dim=4, spread=1.5)
    assert base_episode_shape(fs, 4, 1, 20)[0] == 3  # 3 of the 7 play novel classes
    choice = auto_preset("waydep", fs, 4, 1, 20, n_episodes=10)
    assert choice.method == "nearest-centroid", choice.note
    assert "4-way 1-shot episodes of 10 draws of the 7 base classes" in choice.note


class NeedsTwoBaseClasses(WayDependent):
    """:class:`WayDependent` whose fit needs two base classes (BAVARDAGE's projection)."""

    needs_base = True

    def __init__(self, flip: float = 0.0) -> None:
        super().__init__(flip)

    def fit_base(self, features, labels):
        from probfsl.validation import check_base

        check_base(features, labels, min_classes=2)
        return self


def test_a_method_learning_from_base_classes_is_checked_on_classes_it_has_not_seen(monkeypatch):
    """4 base classes and 3-way tasks: 3 base classes playing novel ones leave one for the
    statistics. A method that learns more than a centre from the base classes is never
    scored on the classes it was fitted on (that flatters a projection); where it cannot
    fit on one class, nothing checks it at the target way and nearest centroid runs."""
    target = "tests.test_tuning:NeedsTwoBaseClasses"
    monkeypatch.setitem(SEARCH_SPACES, "proj", {"flip": [0.0, 0.1]})
    fs = make_featureset(n_base=4, n_novel=4, per_class=8, dim=4, spread=1.5)
    monkeypatch.setitem(METHODS, "proj", MethodInfo("proj", target, "toy", base_statistics=True))
    choice = auto_preset("proj", fs, 3, 1, 15, n_episodes=10, cache=False)
    assert choice.method == "nearest-centroid", choice.note
    assert "could not be checked at 3 ways on base classes it was not fitted on" in choice.note
    # a method that only centres on the base classes is checked on all of them
    monkeypatch.setitem(METHODS, "proj", MethodInfo("proj", target, "toy"))
    kept = auto_preset("proj", fs, 3, 1, 15, n_episodes=10, cache=False)
    assert kept.method is None, kept.note
    # one that fits on one base class is checked on the other three as novel classes
    info = MethodInfo("waydep", "tests.test_tuning:WayDependent", "toy", base_statistics=True)
    monkeypatch.setitem(METHODS, "waydep", info)
    monkeypatch.setitem(SEARCH_SPACES, "waydep", {"flip": [0.8, 0.9]})
    held_out = auto_preset("waydep", fs, 3, 1, 15, n_episodes=10, cache=False)
    assert held_out.method == "nearest-centroid", held_out.note
    assert "3-way 1-shot episodes of 4 draws of the 4 base classes (the other one" in held_out.note


def test_the_methods_learning_base_statistics_are_declared():
    learners = {name for name, info in METHODS.items() if info.base_statistics}
    assert learners == {"bavardage", "bavardage-gamma", "vmp-gmm"}


class Overconfident(FewShotClassifier):
    """Nearest centroid's decisions with its probabilities sharpened: as accurate, with a
    much higher NLL wherever it errs."""

    needs_base = True

    def __init__(self, power: float = 30.0) -> None:
        self.power = power

    def fit_base(self, features, labels):
        self.nc_ = methods.build_estimator("nearest-centroid").fit_base(features, labels)
        return self

    def predict_proba(self, episodes):
        sharp = self.nc_.predict_proba(episodes) ** self.power
        return sharp / sharp.sum(-1, keepdim=True)


def test_on_few_base_classes_a_method_no_more_accurate_needs_the_lower_nll(monkeypatch):
    """Below MIN_CLASSES base classes no temperature is fitted, so the probabilities are
    used as they come: a method that is not clearly more accurate than nearest centroid
    and has a higher query NLL runs nearest centroid. With enough base classes (and a
    temperature to fix the spread) accuracy decides."""
    from probfsl.temperature import MIN_CLASSES

    info = MethodInfo("sharp", "tests.test_tuning:Overconfident", "toy")
    monkeypatch.setitem(METHODS, "sharp", info)
    monkeypatch.setitem(SEARCH_SPACES, "sharp", {"power": [30.0, 50.0]})
    few = make_featureset(n_base=8, n_novel=4, per_class=12, dim=4, spread=1.0)
    assert 8 < MIN_CLASSES
    choice = auto_preset("sharp", few, 4, 1, 20, n_episodes=40, cache=False)
    assert choice.method == "nearest-centroid", choice.note
    assert "of higher NLL" in choice.note
    many = make_featureset(n_base=MIN_CLASSES + 2, n_novel=4, per_class=12, dim=4, spread=1.0)
    kept = auto_preset("sharp", many, 4, 1, 20, n_episodes=40, cache=False)
    assert kept.method is None, kept.note


def _separable(n_base: int = 6) -> FeatureSet:
    return make_featureset(n_base=n_base, n_novel=4, per_class=8, dim=4, spread=60.0)


def test_separable_base_episodes_search_on_harder_ones_by_nll():
    fs = _separable()
    choice = auto_preset("soft-kmeans", fs, 3, 1, 15, n_episodes=20)
    assert "could not separate the candidates" in choice.note, choice.note
    # as many ways as leave 2 base classes for the statistics, every query the classes hold
    assert "4-way 1-shot 28-query episodes of 10 draws of the 6 base classes" in choice.note
    assert choice.result.criterion == "nll among the most accurate"
    assert all("nll" in row and "errors" in row for row in choice.result.trace)
    # many base classes: at most HARDER_MAX_WAY ways (398-way episodes once took 7.6 GB),
    # or the tasks' way where that is more
    many = _separable(n_base=40)
    choice = auto_preset("soft-kmeans", many, 3, 1, 15, n_episodes=20)
    assert f"{tuning.HARDER_MAX_WAY}-way 1-shot" in choice.note, choice.note
    assert hardest_episode_shape(many, 1, max_way=25) == (25, 1, 25 * 7)
    assert hardest_episode_shape(many, 1) == (38, 1, 38 * 7)


def test_ranking_by_nll_among_the_most_accurate():
    rows = [
        {"params": {"a": 1}, "accuracy": 90.0, "ci95": 2.0, "nll": 0.5},
        {"params": {"a": 2}, "accuracy": 89.0, "ci95": 2.0, "nll": 0.3},
        {"params": {"a": 3}, "accuracy": 80.0, "ci95": 2.0, "nll": 0.1},
    ]
    assert tuning._nll_best_row(rows)["params"] == {"a": 2}  # 3 is clearly less accurate
    assert tuning._best_row(rows)["params"] == {"a": 1}
    tie = [{**rows[0], "nll": 0.9}, {**rows[0], "params": {"a": 4}}]
    assert tuning._best_row(tie)["params"] == {"a": 4}  # equal accuracy: the lower NLL
    assert tuning._prefer(rows[1], rows[0]) and not tuning._prefer(rows[2], rows[0])


def test_a_search_that_loses_everywhere_stops_early_and_runs_the_baseline(monkeypatch):
    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.8, 0.6]})
    scored = []
    real = tuning._score
    monkeypatch.setattr(tuning, "_score", lambda *a: scored.append(a[1]) or real(*a))
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    choice = auto_preset("noisy", fs, 4, 1, 20, n_episodes=200)
    assert choice.method == "nearest-centroid" and choice.result is None
    assert "search stopped" in choice.note and "the first 20 4-way 1-shot" in choice.note
    assert scored == []  # no candidate was scored on the 200 episodes


def test_the_method_that_ran_is_exposed(monkeypatch):
    from probfsl.evaluation import evaluate

    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.8, 0.4]})
    fs = make_featureset(n_base=12, n_novel=4, per_class=25)
    auto = make_estimator("noisy", preset="auto")
    auto.n_episodes = 10
    auto.fit_featureset(fs)
    assert auto.method_run_ is None
    result = evaluate(auto, sample_episodes(fs, 4, way=4, shot=1, n_query=20, seed=1))
    assert auto.methods_run_ == {(4, 1, 20): "nearest-centroid"}
    assert auto.method_run_ == result.method_run == "nearest-centroid"
    assert result.summary()["method_run"] == "nearest-centroid" and "(ran " in str(result)


def test_the_result_file_and_table_name_the_method_that_ran(monkeypatch, tmp_path, capsys):
    import json

    from probfsl import cli
    from probfsl.method_table import METHOD_TABLE

    monkeypatch.setitem(METHODS, "noisy", MethodInfo("noisy", "tests.test_tuning:Noisy", "toy"))
    monkeypatch.setitem(SEARCH_SPACES, "noisy", {"flip": [0.8, 0.4]})
    monkeypatch.setitem(
        METHOD_TABLE, "noisy", {"params": ("flip",), "presets": (), "tunable": True}
    )
    fs = make_featureset(n_base=12, n_novel=6, per_class=25)
    path, out = tmp_path / "features.npz", tmp_path / "result.json"
    np.savez(path, features=fs.features, labels=fs.labels, split=fs.split)
    argv = ["run", "--method", "noisy", "--features", str(path), "--way", "4", "--query", "20"]
    assert cli.main([*argv, "--tasks", "5", "--episodes", "10", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["method"] == "noisy" and row["method_run"] == "nearest-centroid"
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[:2] == ["method", "method_run"]


@pytest.mark.parametrize("method", sorted(SEARCH_SPACES))
def test_every_search_space_holds_hyperparameters_of_its_method(method):
    """A key the estimator does not take would fail only when the search first runs on a
    user's data; every grid value also passes the estimator's own checks."""
    space = {**SEARCH_SPACES[method], **tuning.OPEN_SEARCH_SPACES.get(method, {})}
    params = make_estimator(method).get_params()
    assert set(space) <= set(params), set(space) - set(params)
    for candidate in tuning._grid(space):
        make_estimator(method, **candidate)


def test_the_derived_mixtures_search_what_their_closed_form_relatives_search():
    """bavardage-gamma shares BAVARDAGE's preprocessing and its T_vb (the Gamma prior's
    mean); vmp-gmm starts from soft k-means, whose temperature it searches."""
    assert SEARCH_SPACES["bavardage-gamma"] == SEARCH_SPACES["bavardage"]
    assert SEARCH_SPACES["vmp-gmm"] == SEARCH_SPACES["soft-kmeans"]
