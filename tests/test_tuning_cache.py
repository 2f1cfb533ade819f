"""The shipped ``preset="auto"`` choices of the built-in data are current and honest."""

import json

import pytest
import torch

import probfsl
from probfsl import tuning, tuning_cache
from probfsl.data import load_dataset
from probfsl.tuning import BASELINE, SEARCH_SPACES, auto_preset, auto_preset_zero_shot

BUILTIN = ("omniglot", "wordnet")


@pytest.fixture(scope="module")
def prints():
    return {tuning_cache.fingerprint(load_dataset(name)): name for name in BUILTIN}


def test_shipped_entries_are_for_this_version_and_these_data(prints):
    entries = tuning_cache.shipped_entries()
    assert entries, "no shipped entries: run tools/ship_auto_cache.py"
    for entry in entries:
        key = json.loads(entry.read_text())["key"]
        where = f"{entry.name}: rerun tools/ship_auto_cache.py"
        assert key["probfsl"] == probfsl.__version__, where
        assert key["data"] in prints, where
        assert key["space"] == json.loads(json.dumps(SEARCH_SPACES[key["method"]])), where
        assert entry.name == tuning_cache.entry_name(key), where
        if key["kind"] == "few-shot":
            assert key["baseline"] == BASELINE, where


def test_the_demo_and_default_runs_on_builtin_data_need_no_search(monkeypatch):
    def no_search(*args, **kwargs):
        raise AssertionError("a search ran: the shipped entry is missing")

    monkeypatch.setattr(tuning, "tune", no_search)
    monkeypatch.setattr(tuning, "tune_zero_shot", no_search)
    for name in BUILTIN:
        fs = load_dataset(name)
        for method in SEARCH_SPACES:
            for shot in (1, 5):
                for balance in ("balanced", "dirichlet"):
                    auto_preset(method, fs, 5, shot, 75, balance)
    auto_preset_zero_shot("em-dirichlet", load_dataset("wordnet"))


def test_a_shipped_choice_is_what_the_search_finds():
    fs = load_dataset("wordnet")
    shipped = auto_preset("slem", fs, 5, 5, 75, "dirichlet")
    searched = auto_preset("slem", fs, 5, 5, 75, "dirichlet", cache=False)
    assert shipped.params == searched.params and shipped.method == searched.method
    for a, b in zip(shipped.result.trace, searched.result.trace, strict=True):
        assert a["params"] == b["params"] and a["accuracy"] == pytest.approx(b["accuracy"])


def test_fingerprint_follows_the_data():
    fs = load_dataset("wordnet")
    before = tuning_cache.fingerprint(fs)
    fs.labels = fs.labels.copy()
    fs.labels[0] = (fs.labels[0] + 1) % fs.n_classes
    assert tuning_cache.fingerprint(fs) != before


def test_the_fitted_temperature_is_read_back_on_a_second_run(monkeypatch, tuning_cache_dir):
    from probfsl import temperature
    from probfsl.models.soft_kmeans import SoftKMeans
    from probfsl.temperature import TemperatureScaled
    from tests.conftest import make_featureset

    fits = []
    real = temperature.fit_base_temperature
    monkeypatch.setattr(temperature, "fit_base_temperature", lambda *a: fits.append(a) or real(*a))
    fs = make_featureset(n_base=12, n_novel=4, per_class=20, spread=1.0)
    first = TemperatureScaled(SoftKMeans(), n_episodes=40).fit_featureset(fs)
    tau = first.fit_shape(5, 1, 30, torch.float32)
    assert len(fits) == 1 and tau != 1.0
    second = TemperatureScaled(SoftKMeans(), n_episodes=40).fit_featureset(fs)
    assert second.fit_shape(5, 1, 30, torch.float64) == tau and len(fits) == 1
    # other hyperparameters: another temperature
    TemperatureScaled(SoftKMeans(temperature=3.0), n_episodes=40).fit_featureset(fs).fit_shape(
        5, 1, 30, torch.float32
    )
    assert len(fits) == 2


def test_no_temperature_from_base_episodes_without_errors():
    from probfsl.models.soft_kmeans import SoftKMeans
    from probfsl.temperature import TemperatureScaled
    from tests.conftest import make_featureset

    fs = make_featureset(n_base=12, n_novel=4, per_class=8, dim=4, spread=60.0)
    scaled = TemperatureScaled(SoftKMeans(), n_episodes=50).fit_featureset(fs)
    assert scaled.fit_shape(3, 1, 15, torch.float32) == 1.0
    assert "not fitted" in scaled.notes_[(3, 1, 15)]
    assert "misclassified queries of 750" in scaled.notes_[(3, 1, 15)]


def test_the_cache_keeps_the_most_recently_used_entries(monkeypatch, tuning_cache_dir, capsys):
    import os
    from types import SimpleNamespace

    monkeypatch.setenv("PROBFSL_CACHE_MAX_ENTRIES", "3")
    keys = [{"kind": "few-shot", "method": f"m{i}", "shape": [5, 1, 75]} for i in range(5)]
    for i, key in enumerate(keys[:3]):
        tuning_cache.store(key, {"i": i})
        os.utime(tuning_cache_dir / "auto" / tuning_cache.entry_name(key), (i, i))
    assert tuning_cache.load(keys[0]) == {"i": 0}  # read: now the most recently used
    tuning_cache.store(keys[3], {"i": 3})
    assert tuning_cache.load(keys[1]) is None  # the least recently used went
    assert all(tuning_cache.load(k) is not None for k in (keys[0], keys[2], keys[3]))
    assert len(list((tuning_cache_dir / "auto").glob("*.json"))) == 3
    assert tuning_cache.cmd_cache(SimpleNamespace(clear=False)) == 0
    out = capsys.readouterr().out
    assert "3 entries" in out and "at most 3" in out and "m0" in out
    tuning_cache.cmd_cache(SimpleNamespace(clear=True))
    assert "removed 3 entries" in capsys.readouterr().out
    assert tuning_cache.entries() == []


def test_the_key_holds_alpha_only_for_dirichlet_episodes(monkeypatch, tuning_cache_dir):
    from tests.conftest import make_featureset

    monkeypatch.setitem(SEARCH_SPACES, "slem", {"rel_lam": [1.0]})
    fs = make_featureset(n_base=8, n_novel=4, per_class=12)
    auto_preset("slem", fs, 4, 1, 20, "balanced", 2.0, n_episodes=5)
    auto_preset("slem", fs, 4, 1, 20, "balanced", 5.0, n_episodes=5)
    assert len(tuning_cache.entries()) == 1
    auto_preset("slem", fs, 4, 1, 20, "dirichlet", 2.0, n_episodes=5)
    auto_preset("slem", fs, 4, 1, 20, "dirichlet", 5.0, n_episodes=5)
    assert len(tuning_cache.entries()) == 3
