import numpy as np
import pytest

from probfsl.data import FeatureSet


def make_featureset(
    n_base=6, n_novel=8, per_class=30, dim=5, spread=4.0, seed=0, name="synthetic"
) -> FeatureSet:
    """Gaussian classes around random centres: the first ``n_base`` are base classes."""
    rng = np.random.default_rng(seed)
    n_classes = n_base + n_novel
    centres = spread * rng.standard_normal((n_classes, dim))
    labels = np.repeat(np.arange(n_classes), per_class)
    features = centres[labels] + rng.standard_normal((labels.size, dim))
    split = np.where(labels < n_base, "base", "novel")
    return FeatureSet(
        features=features.astype(np.float32),
        labels=labels,
        class_names=[f"class{c}" for c in range(n_classes)],
        split=split,
        name=name,
    )


@pytest.fixture
def synthetic():
    return make_featureset()


@pytest.fixture(autouse=True)
def tuning_cache_dir(tmp_path, monkeypatch):
    """Each test gets an empty tuning cache of its own (never the user's)."""
    folder = tmp_path / "probfsl-cache"
    monkeypatch.setenv("PROBFSL_CACHE_DIR", str(folder))
    return folder
