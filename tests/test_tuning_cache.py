"""The shipped ``preset="auto"`` choices of the built-in data are current and honest."""

import json

import pytest

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
