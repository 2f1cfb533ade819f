"""A derived plan kept for new data of the same shapes (:class:`PlanCache`): a fit on a
kept plan is the fit on a fresh one, and anything besides the named observations that
changes derives a new plan."""

from __future__ import annotations

import copy
import pickle
from functools import partial

import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.inference.vmp import VMP
from probfsl.inference.vmp.plan_cache import PlanCache
from probfsl.methods import build_estimator
from probfsl.models.vmp_gmm import vmp_gmm_full_model, vmp_gmm_model

WAY, N, D = 3, 12, 4


def data(seed: int, n_tasks: int = 2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tasks, N, D, generator=gen, dtype=dtype)
    labels = torch.zeros(n_tasks, N, dtype=torch.long)
    labels[:, :WAY] = torch.arange(WAY)
    observed = torch.zeros(n_tasks, N, dtype=torch.bool)
    observed[:, :WAY] = True
    return x, labels, observed


def model(rate: float = 0.5):
    return partial(vmp_gmm_model, way=WAY, prior_rate=torch.full((D,), rate, dtype=torch.float64))


def fit(vmp: VMP, args):
    state, _ = vmp.fit(*args)
    return state.q["z"][0], state.objective


def test_a_kept_plan_fits_new_data_as_a_fresh_one():
    plans = PlanCache({0: "x"})
    for seed in range(3):
        args = data(seed)
        kept = fit(VMP(model(), max_iter=20, tol=0.0, plans=plans), args)
        fresh = fit(VMP(model(), max_iter=20, tol=0.0), args)
        for a, b in zip(kept, fresh, strict=True):
            assert torch.equal(a, b)
    assert (plans.hits, plans.misses) == (2, 1)


@pytest.mark.parametrize(
    "change",
    ["labels", "observed", "prior", "tasks", "dtype", "order"],
)
def test_anything_else_that_changes_derives_a_new_plan(change):
    plans = PlanCache({0: "x"})
    VMP(model(), max_iter=5, plans=plans).compile(*data(0))
    x, labels, observed = data(1)
    m, order = model(), None
    if change == "labels":
        labels = labels.clone()
        labels[:, 0] = 1
    elif change == "observed":
        observed = observed.clone()
        observed[:, WAY] = True
    elif change == "prior":
        m = model(rate=0.7)
    elif change == "tasks":
        x, labels, observed = data(1, n_tasks=3)
    elif change == "dtype":
        x = x.float()
    elif change == "order":
        order = ["mu", "tau", "pi", "z"]
    args = (x, labels, observed)
    kept = fit(VMP(m, max_iter=10, tol=0.0, order=order, plans=plans), args)
    fresh = fit(VMP(m, max_iter=10, tol=0.0, order=order), args)
    assert (plans.hits, plans.misses) == (0, 2)
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)


def test_an_argument_changed_in_place_derives_a_new_plan():
    """The kept arguments are copies: labels changed in place and passed again are new
    labels, not the same tensor."""
    plans = PlanCache({0: "x"})
    x, labels, observed = data(0)
    VMP(model(), plans=plans).compile(x, labels, observed)
    labels[:, 0] = 1
    kept = fit(VMP(model(), max_iter=10, tol=0.0, plans=plans), (x, labels, observed))
    fresh = fit(VMP(model(), max_iter=10, tol=0.0), (x, labels, observed))
    assert (plans.hits, plans.misses) == (0, 2)
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)


def test_large_observations_are_not_kept():
    plans = PlanCache({0: "x"}, max_bytes=N * D * 8 - 1)  # one float64 task is too many
    for seed in range(2):
        VMP(model(), plans=plans).compile(*data(seed, n_tasks=1))
    assert (plans.hits, plans.misses) == (0, 2)


def test_an_observation_of_another_family_is_refused():
    """Plan.observe takes Normal observations only: a cache that names a multivariate
    Normal's refuses to substitute it rather than fit the old data."""
    full = partial(vmp_gmm_full_model, way=WAY, prior_scale=torch.eye(D), nu0=D + 1.0)
    plans = PlanCache({0: "x"})
    VMP(full, plans=plans).compile(*data(0))
    with pytest.raises(ValueError, match="not an observed Normal site"):
        VMP(full, plans=plans).compile(*data(1))


def test_copies_start_empty():
    plans = PlanCache({0: "x"}, max_bytes=123)
    VMP(model(), plans=plans).compile(*data(0))
    for other in (copy.copy(plans), copy.deepcopy(plans), pickle.loads(pickle.dumps(plans))):
        assert other._kept is None and (other.hits, other.misses) == (0, 0)
        assert other.observations == {0: "x"} and other.max_bytes == 123


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("vmp-gmm", {}),
        ("vmp-gmm", {"open_model": "declared"}),
        ("bavardage-gamma", {}),
        ("bavardage", {"engine": "derived"}),
    ],
)
def test_estimators_predict_as_fresh_ones_across_calls(name, params):
    """The estimators that derive their engines keep their plans across predict calls; each
    call gives what a fresh estimator gives on the same tasks, closed and open."""
    fs = load_dataset("omniglot")
    est = build_estimator(name, **params).fit_featureset(fs)
    for seed in range(3):
        episodes = sample_episodes(fs, 2, 5, 1, 10, n_open=5, seed=seed, dtype=torch.float64)
        fresh = build_estimator(name, **params).fit_featureset(fs)
        assert torch.equal(est.predict_proba(episodes), fresh.predict_proba(episodes))
        assert torch.equal(est.predict_proba_open(episodes), fresh.predict_proba_open(episodes))
    caches = est._plan_caches
    assert caches["derived" if name == "bavardage" else "closed"].hits == 2
    if name == "bavardage-gamma" or name == "vmp-gmm" and params:
        assert caches["open"].hits == 2


def test_a_kept_plan_is_device_correct_with_a_fixed_number_of_host_syncs():
    """The kept plan's path makes every tensor on the data's device (``meta`` as torch's
    default device) and synchronises with the host as often on 2 tasks as on 6, and no
    more often than deriving the plan."""
    from probfsl.host_syncs import HostSyncCounter
    from probfsl.testing import audit_devices

    fs = load_dataset("omniglot")
    est = build_estimator("vmp-gmm").fit_featureset(fs)
    counts = {}
    for n_tasks in (2, 6):
        episodes = sample_episodes(fs, n_tasks, 5, 1, 10, seed=n_tasks)
        with HostSyncCounter() as derived:
            est.predict_proba(episodes)
        with HostSyncCounter() as kept:
            proba = audit_devices(lambda episodes=episodes: est.predict_proba(episodes))
        assert torch.isfinite(proba).all()
        assert kept.total <= derived.total
        counts[n_tasks] = kept.total
    assert counts[2] == counts[6]
    assert est._plan_caches["closed"].hits == 2
