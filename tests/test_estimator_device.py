"""Every registered method on every available device, at estimator level.

For each method of :data:`probfsl.methods.METHODS`, through ``fit_base`` (base
statistics; ``fit`` is the same on every estimator) and ``predict_proba``:

* **device follows the data**: on the CPU, with ``meta`` as torch's default device
  (:func:`probfsl.testing.audit_devices`), so that any tensor created without
  ``device=`` is caught; on CUDA when there is one, with the labels of the CPU run;
* **host synchronisations** per ``predict_proba`` call (counted by
  :class:`probfsl.host_syncs.HostSyncCounter`, on the CPU where they cost nothing):
  the same on T and on 3T tasks, and at most :data:`MAX_SYNCS`;
* **dtype follows the data**: float32 tasks give float32 probabilities, float64 tasks
  float64 (a method that computes in another dtype must still answer in the input's).

The same checks hold the open-set paths (``predict_proba_open`` on tasks with open
queries, :data:`OPEN_NAMES`): the mixtures with the background component and the
background predictive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields, replace

import pytest
import torch

from probfsl import make_estimator
from probfsl.data import load_dataset, sample_episodes
from probfsl.host_syncs import HostSyncCounter
from probfsl.methods import METHODS
from probfsl.models.base import FewShotClassifier
from probfsl.testing import audit_devices

#: small settings for the slow methods (the checks test devices, not accuracy)
SMALL = {
    "gp-tree": {"n_chains": 2, "n_sweeps": 2},
    "em-dirichlet": {"n_iter": 5},
}
#: host synchronisations allowed per predict_proba call (flat in the number of tasks)
MAX_SYNCS = 50
#: tasks in the smaller batch; the larger one has 3 times as many
T = 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: every method, and the derived engine of each method that has one ("name+derived")
NAMES = sorted(METHODS) + [
    f"{m}+derived" for m in ("bavardage", "em-dirichlet", "evidence-lssvm", "gp-tree", "slem")
]
#: the same, with EM-Dirichlet's cases (its MM loop is the slow one) marked slow
CASES = [
    pytest.param(n, marks=pytest.mark.slow) if n.startswith("em-dirichlet") else n for n in NAMES
]


#: open-set cases with other parameters: vmp-gmm with the background declared in its model,
#: nearest centroid's contrast in the queries' frame
OPEN_VARIANTS = {
    "vmp-gmm/declared": ("vmp-gmm", {"open_model": "declared"}),
    "nearest-centroid/queries": ("nearest-centroid", {"open_frame": "queries"}),
}


def _built(case: str) -> FewShotClassifier:
    """The estimator of a case of :data:`NAMES` (or :data:`OPEN_VARIANTS`) at its small
    settings."""
    case, extra = OPEN_VARIANTS.get(case, (case, {}))
    name, _, engine = case.partition("+")
    params = dict(SMALL.get(name, {}), **({"engine": engine} if engine else {}), **extra)
    return make_estimator(name, **params)


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


def _episodes(fs, n_tasks: int, dtype: torch.dtype, device: str = "cpu"):
    return sample_episodes(
        fs, n_tasks, way=3, shot=2, n_query=9, seed=1, dtype=dtype, device=device
    )


def _fitted(name: str, fs, dtype: torch.dtype, device: str = "cpu") -> FewShotClassifier:
    return _built(name).fit_base(*fs.base(dtype, device))


@pytest.mark.parametrize("name", CASES)
def test_fit_and_predict_create_every_tensor_on_the_data_device(name, omniglot):
    """CPU data, ``meta`` default device: a tensor made without ``device=`` is caught."""
    base = omniglot.base(torch.float64)
    episodes = _episodes(omniglot, T, torch.float64)

    def fit_predict():
        model = _built(name).fit_base(*base)
        return model.predict_proba(episodes)

    proba = audit_devices(fit_predict)
    assert proba.device.type == "cpu" and proba.shape == (T, 9, 3)
    assert torch.isfinite(proba).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("name", CASES)
def test_cuda_run_gives_the_cpu_labels(name, omniglot):
    cpu = _fitted(name, omniglot, torch.float64).predict_proba(
        _episodes(omniglot, T, torch.float64)
    )
    gpu = _fitted(name, omniglot, torch.float64, "cuda").predict_proba(
        _episodes(omniglot, T, torch.float64, "cuda")
    )
    assert gpu.device.type == "cuda"
    agree = (gpu.argmax(-1).cpu() == cpu.argmax(-1)).double().mean()
    assert agree >= 0.95, f"{name}: {agree:.1%} of the labels agree"


def _repeated(episodes, k: int):
    """``episodes`` with every task ``k`` times (field by field, along the tasks axis)."""
    return replace(
        episodes,
        **{f.name: getattr(episodes, f.name).repeat_interleave(k, 0) for f in fields(episodes)},
    )


@pytest.mark.parametrize("name", CASES)
def test_host_syncs_per_call_do_not_grow_with_the_tasks(name, omniglot):
    model = _fitted(name, omniglot, torch.float32)
    model.predict_proba(_episodes(omniglot, T, torch.float32))  # one-time caches
    counts = []
    small = _episodes(omniglot, T, torch.float32)
    # the larger batch repeats the smaller one's tasks: a loop that runs until its slowest
    # task converges takes the same number of steps on both
    for episodes in (small, _repeated(small, 3)):
        model.__dict__.pop("_plan_caches", None)  # each call derives its plan (VMP engines)
        with HostSyncCounter() as counter:
            model.predict_proba(episodes)
        counts.append(counter.total)
    assert counts[0] == counts[1], f"{name}: {counts} host syncs on {T} and {3 * T} tasks"
    assert counts[0] <= MAX_SYNCS, f"{name}: {counts[0]} host syncs per call"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_output_dtype_follows_the_input(name, device, omniglot):
    for dtype in (torch.float32, torch.float64):
        model = _fitted(name, omniglot, dtype, device)
        proba = model.predict_proba(_episodes(omniglot, T, dtype, device))
        assert proba.dtype == dtype and proba.device.type == device, (
            f"{name}: {dtype} tasks on {device} gave {proba.dtype} on {proba.device}"
        )


def _tensors(value) -> list[torch.Tensor]:
    """The tensors inside a fitted value (tensors, dataclasses, containers)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_fit_featureset_fits_on_the_device_given(name, device, omniglot):
    """``fit_featureset(fs, dtype, device)``: every fitted tensor lives on ``device``."""
    model = _built(name)
    model.fit_featureset(omniglot, torch.float64, device)
    fitted = _tensors(model.fitted_state())
    assert fitted, f"{name}: no fitted tensor"
    assert {t.device.type for t in fitted} == {device}
    proba = model.predict_proba(_episodes(omniglot, T, torch.float64, device))
    assert proba.device.type == device
    with pytest.raises(ValueError, match="'warp-drive' is not a device"):
        _built(name).fit_featureset(omniglot, device="warp-drive")


# ------------------------------------------------------------------ open-set paths
#: the methods whose ``predict_proba_open`` iterates (their mixture with the background
#: component) and nearest centroid, whose open column is the background predictive alone
OPEN_NAMES = [
    "bavardage",
    "bavardage-gamma",
    "nearest-centroid",
    "nearest-centroid/queries",
    "soft-kmeans",
    "vmp-gmm",
    "vmp-gmm/declared",
]
#: open queries per task (3 open classes beside the 3 known ones)
N_OPEN = 6


def _open_episodes(fs, n_tasks: int, dtype: torch.dtype, device: str = "cpu"):
    return sample_episodes(
        fs, n_tasks, way=3, shot=2, n_query=9, seed=1, dtype=dtype, device=device, n_open=N_OPEN
    )


@pytest.mark.parametrize("name", OPEN_NAMES)
def test_open_fit_and_predict_create_every_tensor_on_the_data_device(name, omniglot):
    """``predict_proba_open`` with ``meta`` as the default device (CPU data)."""
    base = omniglot.base(torch.float64)
    episodes = _open_episodes(omniglot, T, torch.float64)

    def fit_predict():
        model = _built(name).fit_base(*base)
        return model.predict_proba_open(episodes)

    proba = audit_devices(fit_predict)
    assert proba.device.type == "cpu" and proba.shape == (T, 9 + N_OPEN, 4)
    assert torch.isfinite(proba).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("name", OPEN_NAMES)
def test_open_cuda_run_gives_the_cpu_labels(name, omniglot):
    cpu = _fitted(name, omniglot, torch.float64).predict_proba_open(
        _open_episodes(omniglot, T, torch.float64)
    )
    gpu = _fitted(name, omniglot, torch.float64, "cuda").predict_proba_open(
        _open_episodes(omniglot, T, torch.float64, "cuda")
    )
    assert gpu.device.type == "cuda"
    agree = (gpu.argmax(-1).cpu() == cpu.argmax(-1)).double().mean()
    assert agree >= 0.95, f"{name}: {agree:.1%} of the labels agree"
    torch.testing.assert_close(gpu[..., -1].cpu(), cpu[..., -1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", OPEN_NAMES)
def test_open_host_syncs_per_call_do_not_grow_with_the_tasks(name, omniglot):
    model = _fitted(name, omniglot, torch.float32)
    small = _open_episodes(omniglot, T, torch.float32)
    model.predict_proba_open(small)  # one-time caches
    counts = []
    for episodes in (small, _repeated(small, 3)):
        model.__dict__.pop("_plan_caches", None)  # each call derives its plan (VMP engines)
        with HostSyncCounter() as counter:
            model.predict_proba_open(episodes)
        counts.append(counter.total)
    assert counts[0] == counts[1], f"{name}: {counts} host syncs on {T} and {3 * T} tasks"
    assert counts[0] <= MAX_SYNCS, f"{name}: {counts[0]} host syncs per call"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPEN_NAMES)
def test_open_output_dtype_follows_the_input(name, device, omniglot):
    for dtype in (torch.float32, torch.float64):
        model = _fitted(name, omniglot, dtype, device)
        proba = model.predict_proba_open(_open_episodes(omniglot, T, dtype, device))
        assert proba.dtype == dtype and proba.device.type == device, (
            f"{name}: {dtype} tasks on {device} gave {proba.dtype} on {proba.device}"
        )
        # float32 base statistics, float64 tasks (and back): the background follows the tasks
        other = torch.float64 if dtype == torch.float32 else torch.float32
        proba = model.predict_proba_open(_open_episodes(omniglot, T, other, device))
        assert proba.dtype == other, f"{name}: {other} tasks gave {proba.dtype}"
