"""EM-Dirichlet inputs, estimator and zero-shot protocol (bad input, API, ArviZ)."""

import numpy as np
import pytest
import torch

from probfsl.data import load_dataset, sample_episodes, sample_zero_shot_tasks
from probfsl.data.simplex import (
    check_probabilities,
    probabilities_from_embeddings,
    probabilities_from_logits,
    zero_shot_probabilities,
)
from probfsl.evaluation.zero_shot import evaluate_zero_shot
from probfsl.host_syncs import HostSyncCounter
from probfsl.inference.dirichlet_mm import EMDirichletEngine
from probfsl.models.em_dirichlet import EMDirichlet
from probfsl.testing import audit_devices

FAST = dict(n_iter=3, mm_max_iter=60)


def _probs(t=2, n=10, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(t, n, k, generator=g, dtype=torch.float64), -1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda p: torch.where(p > 0.5, torch.nan, p), "NaN"),
        (lambda p: p - 0.3, "negative"),
        (lambda p: p * 1.1, "sum to one"),
        (lambda p: p[..., :1] / p[..., :1], "K=2"),
        (lambda p: p[0], "3 dimensions"),
    ],
)
def test_bad_probabilities_raise_naming_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        check_probabilities(bad(_probs()), "query", ndim=3)
    with pytest.raises(ValueError, match="query|probs"):
        EMDirichletEngine().init(bad(_probs()))


def test_bad_embeddings_and_logits_raise():
    emb, cls = torch.randn(2, 5, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="width"):
        probabilities_from_embeddings(emb, torch.randn(4, 7))
    with pytest.raises(ValueError, match="K=2"):
        probabilities_from_embeddings(emb, torch.randn(1, 8))
    with pytest.raises(ValueError, match="class_embeddings contains NaN"):
        probabilities_from_embeddings(emb, torch.full((4, 8), float("nan")))
    with pytest.raises(ValueError, match="temperature"):
        probabilities_from_embeddings(emb, cls, temperature=-1.0)
    with pytest.raises(ValueError, match="logits contains NaN"):
        probabilities_from_logits(torch.tensor([[0.0, float("inf")]]))
    with pytest.raises(ValueError, match="support_labels must lie"):
        EMDirichletEngine().init(_probs(), _probs(n=3), torch.full((2, 3), 4))


def test_input_forms_agree():
    """Embeddings + class embeddings = softmax(T * cosine) = logits form with the same T."""
    g = torch.Generator().manual_seed(1)
    emb, cls = torch.randn(2, 6, 8, generator=g), torch.randn(3, 8, generator=g)
    cos = torch.nn.functional.normalize(emb, dim=-1) @ torch.nn.functional.normalize(cls, dim=-1).T
    from_emb = probabilities_from_embeddings(emb, cls)
    torch.testing.assert_close(from_emb, probabilities_from_logits(cos, temperature=30.0))
    torch.testing.assert_close(from_emb.sum(-1), torch.ones(2, 6))
    assert from_emb.dtype == torch.float32


def test_few_shot_estimator_on_builtin_wordnet():
    fs = load_dataset("wordnet")
    episodes = sample_episodes(fs, 3, way=5, shot=1, n_query=15, seed=0)
    for est in (EMDirichlet(**FAST), EMDirichlet(hard=True, **FAST)):
        assert est.needs_base
        with pytest.raises(ValueError, match="fit_base"):
            est.predict_proba(episodes)
        proba = est.fit_base(*fs.base()).predict_proba(episodes)
        assert proba.shape == (3, 15, 5) and proba.dtype == torch.float32
        torch.testing.assert_close(proba.sum(-1), torch.ones(3, 15))
        assert est.predict(episodes).shape == (3, 15)
    est = EMDirichlet(**FAST).set_class_features(torch.as_tensor(fs.class_features).float())
    support, query = est.episode_probabilities(episodes)
    expected = probabilities_from_embeddings(
        episodes.query, torch.as_tensor(fs.class_features).float()[episodes.classes]
    )
    torch.testing.assert_close(query, expected)
    assert est.predict_proba(episodes).shape == (3, 15, 5)


def test_zero_shot_protocol_and_arviz_export():
    fs = load_dataset("wordnet")
    tasks = sample_zero_shot_tasks(fs, 2, seed=0)
    probs = zero_shot_probabilities(fs, tasks, temperature=30.0)
    assert probs.shape == (2, 75, fs.n_classes)
    est = EMDirichlet(hard=True, **FAST)
    pred = est.predict_zero_shot(probs)
    assert pred.shape == (2, 75)
    for t in range(2):  # injective matching: at most one class per cluster and vice versa
        clusters = est.state_.query_r[t].argmax(-1)
        pairs = set(zip(clusters.tolist(), pred[t].tolist(), strict=True))
        assert len({c for c, _ in pairs}) == len(pairs) == len({k for _, k in pairs})
    res = evaluate_zero_shot(est, probs, tasks.query_labels, batch_size=2)
    manual = (est.predict_zero_shot(probs) == tasks.query_labels).double().mean(-1).numpy()
    np.testing.assert_allclose(res.per_task_accuracy, manual)
    assert res.n_tasks == 2 and res.tasks_per_second > 0
    tree = est.to_datatree()
    assert tree.posterior["alpha"].shape == (1, 1, 2, fs.n_classes, fs.n_classes)
    assert tree.posterior["pi"].shape == (1, 1, 2, fs.n_classes)
    assert tree.sample_stats["objective"].shape == (1, 1, 2, 4)
    trace = tree.sample_stats["objective"].values[0, 0]
    assert (np.diff(trace, axis=-1) <= 1e-3 * np.abs(trace[:, :1])).all()
    with pytest.raises(ValueError, match="lambda_coef"):
        EMDirichlet(lambda_coef=-1.0).predict_zero_shot(probs)


def _syncs(method, *args) -> int:
    with HostSyncCounter() as counter:
        method(*args)
    return counter.total


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.slow
def test_host_synchronisations_do_not_grow_with_tasks_or_iterations(hard):
    """predict_proba and predict_zero_shot synchronise with the host a fixed number of
    times (input checks, the Hungarian matching on the CPU), the same for T and 3T tasks
    and for 2 or 3 outer iterations: the inner MM loop makes none (so the default 20
    outer x 1000 inner iterations make the same count), and at most 50."""
    fs = load_dataset("wordnet")
    episodes = sample_episodes(fs, 6, way=5, shot=5, n_query=15, seed=0)
    probs = zero_shot_probabilities(fs, sample_zero_shot_tasks(fs, 6, seed=0))
    counts = {}
    for n_iter in (2, 3):
        est = EMDirichlet(hard=hard, n_iter=n_iter, mm_max_iter=200).fit_base(*fs.base())
        zero = EMDirichlet(hard=hard, n_iter=n_iter)
        for t in (2, 6):
            counts["few", n_iter, t] = _syncs(est.predict_proba, episodes[:t])
            counts["zero", n_iter, t] = _syncs(zero.predict_zero_shot, probs[:t])
    for mode in ("few", "zero"):
        values = {v for k, v in counts.items() if k[0] == mode}
        assert len(values) == 1 and values.pop() <= 50, counts


@pytest.mark.parametrize("hard", [False, True])
def test_predictions_create_every_tensor_on_the_data_device(hard):
    """predict_proba and predict_zero_shot run with ``meta`` as the default device (data on
    the CPU): a tensor made without ``device=`` anywhere on the path would land there."""
    fs = load_dataset("wordnet")
    episodes = sample_episodes(fs, 2, way=5, shot=5, n_query=15, seed=0)
    probs = zero_shot_probabilities(fs, sample_zero_shot_tasks(fs, 2, seed=0))
    est = EMDirichlet(hard=hard, n_iter=2, mm_max_iter=60).fit_base(*fs.base())
    expected = est.predict_proba(episodes)
    torch.testing.assert_close(audit_devices(lambda: est.predict_proba(episodes)), expected)
    zero = EMDirichlet(hard=hard, n_iter=2)
    audited = audit_devices(lambda: zero.predict_zero_shot(probs))
    assert torch.equal(audited, zero.predict_zero_shot(probs))
