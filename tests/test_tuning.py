import numpy as np
import pytest
import torch

from probfsl.data import FeatureSet, sample_episodes
from probfsl.methods import METHODS, MethodInfo, make_estimator
from probfsl.models.base import FewShotClassifier
from probfsl.tuning import AutoPreset, base_episode_split, tune, tune_zero_shot
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
