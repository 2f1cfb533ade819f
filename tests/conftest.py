import pytest

from tests.synthetic import make_featureset

__all__ = ["make_featureset"]  # kept importable from here (tests.conftest)


@pytest.fixture
def synthetic():
    return make_featureset()


@pytest.fixture(autouse=True)
def tuning_cache_dir(tmp_path, monkeypatch):
    """Each test gets an empty tuning cache of its own (never the user's)."""
    folder = tmp_path / "probfsl-cache"
    monkeypatch.setenv("PROBFSL_CACHE_DIR", str(folder))
    return folder
