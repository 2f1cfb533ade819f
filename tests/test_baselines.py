import numpy as np
import pytest
import torch

from probfsl.data import load_dataset, sample_episodes
from probfsl.evaluation import evaluate
from probfsl.inference.soft_kmeans import soft_kmeans
from probfsl.models.nearest_centroid import NearestCentroid
from probfsl.models.soft_kmeans import SoftKMeans


def _soft_kmeans_reference(support, labels, query, way, temperature, n_iter):
    """One task, written loop by loop from docs/design/bavardage.md §3.4, in numpy."""
    x = np.concatenate([support, query])
    ns = len(support)
    c = np.stack([support[labels == k].mean(0) for k in range(way)])
    for _ in range(n_iter):
        d2 = np.array([[np.sum((xi - ck) ** 2) for ck in c] for xi in x])
        logits = -temperature * d2
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[:ns] = np.eye(way)[labels]
        c = (p.T @ x) / p.sum(0)[:, None]
    return p


def test_soft_kmeans_matches_a_loop_reference(synthetic):
    ep = sample_episodes(synthetic, 4, way=3, shot=2, n_query=12, seed=0, dtype=torch.float64)
    p = soft_kmeans(ep.support / 5, ep.support_labels, ep.query / 5, 3, 3.0, 4)
    for t in range(4):
        ref = _soft_kmeans_reference(
            ep.support[t].numpy() / 5,
            ep.support_labels[t].numpy(),
            ep.query[t].numpy() / 5,
            3,
            3.0,
            4,
        )
        np.testing.assert_allclose(p[t].numpy(), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("estimator", [NearestCentroid(), SoftKMeans()])
def test_batched_single_and_dtype_agree(synthetic, estimator):
    estimator.fit_base(*synthetic.base(torch.float64))
    ep = sample_episodes(synthetic, 6, way=4, shot=2, n_query=20, seed=0, dtype=torch.float64)
    batched = estimator.predict_proba(ep)
    singles = torch.cat([estimator.predict_proba(ep[t]) for t in range(6)])
    torch.testing.assert_close(batched, singles)
    p32 = estimator.predict_proba(ep.to(dtype=torch.float32))
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), batched, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched.sum(-1), torch.ones(6, 20, dtype=torch.float64))


def test_well_separated_classes_are_solved(synthetic):
    """Classes 4 units apart with unit noise in 5-d: both baselines are nearly perfect."""
    for est in (NearestCentroid(), SoftKMeans()):
        est.fit_base(*synthetic.base())
        res = evaluate(est, sample_episodes(synthetic, 50, way=4, shot=5, n_query=40, seed=0))
        assert res.accuracy > 95


def test_permuting_queries_permutes_predictions(synthetic):
    est = SoftKMeans().fit_base(*synthetic.base())
    ep = sample_episodes(synthetic, 3, way=4, shot=1, n_query=20, seed=0)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    shuffled = type(ep)(**{**vars(ep), "query": ep.query[:, perm]})
    torch.testing.assert_close(est.predict_proba(shuffled), est.predict_proba(ep)[:, perm])


def test_centring_needs_base(synthetic):
    ep = sample_episodes(synthetic, 2, seed=0)
    with pytest.raises(ValueError, match="fit_base"):
        NearestCentroid().predict_proba(ep)
    assert NearestCentroid(center=False).predict_proba(ep).shape == (2, 75, 5)


def test_bad_episode_input(synthetic):
    est = NearestCentroid().fit_base(*synthetic.base())
    ep = sample_episodes(synthetic, 2, seed=0)
    bad = type(ep)(**{**vars(ep), "query": ep.query.clone()})
    bad.query[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        est.predict_proba(bad)
    wide = type(ep)(**{**vars(ep), "query": torch.zeros(2, 75, 9)})
    with pytest.raises(ValueError, match="disagree"):
        est.predict_proba(wide)
    with pytest.raises(ValueError, match="base labels"):
        NearestCentroid().fit_base(torch.zeros(4, 3), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("shot, reference, ci", [(1, 74.4, 0.9), (5, 85.0, 0.7)])
def test_omniglot_nearest_centroid_reference(shot, reference, ci):
    """The dataset README's references: PCA-64, 500 episodes, 74.4 ± 0.9 % and 85.0 ± 0.7 %."""
    fs = load_dataset("omniglot")
    est = NearestCentroid().fit_base(*fs.base())
    res = evaluate(est, sample_episodes(fs, 500, shot=shot, seed=0))
    assert abs(res.accuracy - reference) < res.ci95 + ci
    assert 0.3 < res.ci95 < 1.5


def test_nearest_centroid_prototype_variants(synthetic):
    ep = sample_episodes(synthetic, 4, way=4, shot=3, n_query=20, seed=0)
    base = synthetic.base()
    mean = NearestCentroid(prototype="mean", temperature=1.0).fit_base(*base)
    cos = NearestCentroid(prototype="normalized", temperature=1.0).fit_base(*base)
    # in 1-shot the two prototypes coincide (unit-norm support rows)
    one = sample_episodes(synthetic, 4, way=4, shot=1, n_query=20, seed=0)
    torch.testing.assert_close(mean.predict_proba(one), cos.predict_proba(one))
    # "normalized" scores are cosines: invariant to rescaling a prototype
    assert not torch.allclose(mean.predict_proba(ep), cos.predict_proba(ep))
    with pytest.raises(ValueError, match="prototype"):
        NearestCentroid(prototype="median").check_params()
