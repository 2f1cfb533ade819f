import numpy as np
import pytest
import torch

from probfsl.data import FeatureSet
from probfsl.methods import METHODS, MethodInfo
from probfsl.models.base import FewShotClassifier
from probfsl.tuning import base_episode_split, tune
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
