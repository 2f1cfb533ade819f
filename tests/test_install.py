"""What a plain install (core dependencies only) needs, checked against pyproject.toml.

The plain install itself is checked by hand in a fresh virtual environment (README,
"Install"); these tests keep its ingredients from regressing.
"""

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _core() -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}


def test_core_dependencies_bring_the_arviz_stats_functions_the_diagnostics_use():
    core = _core()
    # arviz-stats' summary, rhat and ess on DataTrees live behind its [xarray] extra
    assert "xarray" in core["arviz-stats"].extras
    import arviz_stats

    assert all(hasattr(arviz_stats, f) for f in ("summary", "rhat", "ess"))


def test_plotting_packages_are_an_extra_only():
    core = _core()
    assert not {"arviz-plots", "matplotlib"} & set(core)
    plots = {Requirement(r).name for r in PROJECT["optional-dependencies"]["plots"]}
    assert {"arviz-plots", "matplotlib"} <= plots


def test_installed_versions_meet_the_declared_bounds():
    """The bounds resolve: this environment, installed with constraints.txt, meets them."""
    for name, req in _core().items():
        assert req.specifier.contains(version(name), prereleases=True), (name, version(name))
    # numpy: arviz-stats needs 2, so a lower bound under 2 would promise what cannot install
    assert not _core()["numpy"].specifier.contains("1.26")
    pins = [
        Requirement(line)
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for pin in pins:
        assert pin.specifier.contains(version(pin.name).split("+")[0]), pin


@pytest.mark.slow
def test_import_is_light():
    """``import probfsl`` (and the CLI module) load no ArviZ, matplotlib or GPyTorch."""
    code = (
        "import sys, probfsl, probfsl.cli, probfsl.diagnostics, probfsl.data;"
        "heavy = [m for m in ('arviz_stats', 'arviz_base', 'arviz_plots', 'matplotlib',"
        " 'gpytorch', 'xarray') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_version_is_written_once_and_packaged():
    import probfsl

    # pyproject reads the version from the package: one place to change it
    assert "version" not in PROJECT and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "probfsl.__version__"}
    assert probfsl.__version__ == version("probfsl")


def test_licence_and_type_marker_ship():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "probfsl" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["probfsl"]
