"""Open-set posteriors: the background module and every method's ``predict_proba_open``."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import multivariate_normal

from probfsl.data import load_dataset, sample_episodes
from probfsl.data.tasks import Episodes
from probfsl.inference.background import (
    TwoCovarianceReading,
    attach_open,
    fit_background,
    gaussian_log_density,
    open_fraction_prior,
    open_log_ratio,
    open_posterior,
    open_responsibility,
    reread_open,
    two_covariance_log_liks,
)
from probfsl.inference.vb_mixture_open import open_columns
from probfsl.methods import METHODS, build_estimator
from probfsl.models.nearest_centroid import NearestCentroid

WAY, SHOT, PER_CLASS = 5, 1, 3
DTYPES = (torch.float32, torch.float64)

#: small settings for the slow methods
FAST = {"gp-tree": {"n_chains": 2, "n_sweeps": 2}, "em-dirichlet": {"n_iter": 5}}


@pytest.fixture(scope="module")
def omniglot():
    return load_dataset("omniglot")


def open_episodes(fs, n_tasks: int, n_open_classes: int = 2, seed: int = 0) -> Episodes:
    """Tasks of WAY known novel classes and ``n_open_classes`` others whose queries
    (labelled WAY) come last."""
    novel = fs.rows("novel")
    labels = fs.labels[novel]
    classes = np.unique(labels)
    sup, qry, qlab, cls = [], [], [], []
    for t in range(n_tasks):
        rng = np.random.default_rng([seed, t])
        chosen = rng.choice(classes, WAY + n_open_classes, replace=False)
        s_rows, q_rows, q_lab = [], [], []
        for k, c in enumerate(chosen):
            take = SHOT + PER_CLASS if k < WAY else PER_CLASS
            rows = rng.choice(novel[labels == c], take, replace=False)
            if k < WAY:
                s_rows.append(rows[:SHOT])
                rows = rows[SHOT:]
            q_rows.append(rows)
            q_lab += [min(k, WAY)] * PER_CLASS
        sup.append(np.stack(s_rows, 1).reshape(-1))
        qry.append(np.concatenate(q_rows))
        qlab.append(q_lab)
        cls.append(chosen[:WAY])
    feats = torch.as_tensor(fs.features, dtype=torch.float32)
    sup, qry = torch.as_tensor(np.stack(sup)), torch.as_tensor(np.stack(qry))
    return Episodes(
        feats[sup],
        torch.arange(WAY).repeat(SHOT).expand(n_tasks, -1),
        feats[qry],
        torch.as_tensor(np.array(qlab)),
        torch.as_tensor(np.stack(cls)),
        sup,
        qry,
    )


# ------------------------------------------------------------------ background module
@pytest.mark.parametrize("per_task", [False, True])
def test_gaussian_log_density_matches_scipy(per_task):
    gen = torch.Generator().manual_seed(0)
    t, q, d = 3, 4, 5
    x = torch.randn(t, q, d, generator=gen, dtype=torch.float64)
    a = torch.randn(t if per_task else 1, d, d, generator=gen, dtype=torch.float64)
    cov = a @ a.transpose(1, 2) + torch.eye(d, dtype=torch.float64)
    mean = torch.randn(t if per_task else 1, d, generator=gen, dtype=torch.float64)
    chol = torch.linalg.cholesky(cov)
    got = gaussian_log_density(x, mean if per_task else mean[0], chol if per_task else chol[0])
    for i in range(t):
        j = i if per_task else 0
        want = multivariate_normal(mean[j].numpy(), cov[j].numpy()).logpdf(x[i].numpy())
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-10)
    got32 = gaussian_log_density(
        x.float(), (mean if per_task else mean[0]).float(), (chol if per_task else chol[0]).float()
    )
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), got, rtol=1e-4, atol=1e-4)


def test_fit_background_statistics():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    labels = torch.arange(4).repeat_interleave(10)
    stats = fit_background(x, labels, shrinkage=0.0)
    means = torch.stack([x[labels == c].mean(0) for c in range(4)])
    torch.testing.assert_close(stats.mean, means.mean(0))
    resid = x - means[labels]
    torch.testing.assert_close(stats.within, resid.T @ resid / 40, atol=1e-12, rtol=0)
    spread = means - means.mean(0)
    torch.testing.assert_close(stats.between, spread.T @ spread / 4)
    stats32 = fit_background(x.float(), labels, shrinkage=0.0)
    assert stats32.total.dtype == torch.float32
    torch.testing.assert_close(stats32.total.double(), stats.total, atol=1e-5, rtol=1e-5)


def test_open_posterior_is_enumeration_over_z():
    """P(z | x) of the tiny mixture (π_0, (1 - π_0)/K ...) by enumerating z."""
    class_ll = torch.tensor([[[-1.0, -3.0, -0.5]]], dtype=torch.float64)
    bg_ll = torch.tensor([[-2.0]], dtype=torch.float64)
    pi0 = 0.3
    got = open_posterior(class_ll, bg_ll, pi0)
    joint = [(1 - pi0) / 3 * np.exp(v) for v in class_ll[0, 0].tolist()]
    joint.append(pi0 * np.exp(bg_ll.item()))
    np.testing.assert_allclose(got[0, 0].numpy(), np.array(joint) / sum(joint), rtol=1e-12)
    with pytest.raises(ValueError, match="open_prior"):
        open_posterior(class_ll, bg_ll, 1.0)


def test_two_covariance_log_liks_match_brute_force():
    gen = torch.Generator().manual_seed(2)
    d, k = 3, 2
    base = torch.randn(60, d, generator=gen, dtype=torch.float64)
    labels = torch.arange(6).repeat_interleave(10)
    base = base + 2 * torch.randn(6, d, generator=gen, dtype=torch.float64)[labels]
    stats = fit_background(base, labels)
    support = torch.randn(1, 4, d, generator=gen, dtype=torch.float64)
    support_labels = torch.tensor([[0, 1, 0, 1]])
    query = torch.randn(1, 3, d, generator=gen, dtype=torch.float64)
    class_ll, bg_ll = two_covariance_log_liks(support, support_labels, query, k, stats)
    w, b, m = stats.within.numpy(), stats.between.numpy(), stats.mean.numpy()
    for c in range(k):
        rows = support[0, support_labels[0] == c].numpy()
        n = len(rows)
        post_cov = np.linalg.inv(np.linalg.inv(b) + n * np.linalg.inv(w))
        post_mean = m + post_cov @ np.linalg.inv(w) @ (rows - m).sum(0)
        want = multivariate_normal(post_mean, w + post_cov).logpdf(query[0].numpy())
        np.testing.assert_allclose(class_ll[0, :, c].numpy(), want, rtol=1e-9)
    want = multivariate_normal(m, w + b).logpdf(query[0].numpy())
    np.testing.assert_allclose(bg_ll[0].numpy(), want, rtol=1e-9)


def test_reading_query_weights_count_as_support():
    """One-hot query weights in :meth:`TwoCovarianceReading.class_log_lik` are those rows
    added to the support; ``open_log_odds`` is ln p_0 - ln((1/K) Σ_k p_k)."""
    gen = torch.Generator().manual_seed(4)
    d, k = 3, 2
    base = torch.randn(60, d, generator=gen, dtype=torch.float64)
    labels = torch.arange(6).repeat_interleave(10)
    stats = fit_background(
        base + torch.randn(6, d, generator=gen, dtype=torch.float64)[labels], labels
    )
    support = torch.randn(2, 2, d, generator=gen, dtype=torch.float64)
    support_labels = torch.tensor([[0, 1], [1, 0]])
    query = torch.randn(2, 3, d, generator=gen, dtype=torch.float64)
    reading = TwoCovarianceReading(support, support_labels, query, k, stats)
    weights = torch.zeros(2, 3, k, dtype=torch.float64)
    weights[:, 0, 1] = 1.0
    grown = torch.cat([support, query[:, :1]], 1)
    grown_labels = torch.cat([support_labels, torch.ones(2, 1, dtype=torch.long)], 1)
    want, bg = two_covariance_log_liks(grown, grown_labels, query, k, stats)
    torch.testing.assert_close(reading.class_log_lik(weights), want)
    closed = torch.logsumexp(reading.class_log_lik(), -1) - np.log(k)
    torch.testing.assert_close(reading.open_log_odds(), bg - closed)


def test_open_responsibility_is_the_mean_field_update():
    """o_q0 = σ(E ln π_0 - E ln(1 - π_0) + log-odds), q(π_0) the Beta posterior of the
    previous o_q0 (digamma expectations)."""
    gen = torch.Generator().manual_seed(1)
    odds = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    previous = torch.rand(2, 7, generator=gen, dtype=torch.float64)
    a_open, a_closed = open_fraction_prior(0.3)
    a = a_open + previous.sum(-1)
    b = a_closed + (1 - previous).sum(-1)
    shift = torch.digamma(a) - torch.digamma(b)
    want = torch.sigmoid(odds + shift.unsqueeze(-1))
    torch.testing.assert_close(open_responsibility(odds, previous, 0.3), want)


def test_reread_open_keeps_the_class_shares():
    """reread_open: o_q0 is one more open_responsibility update; the closed columns keep
    their shares and take 1 - o_q0, which stays positive in float32 where o_q0 rounds to
    1 (so the known classes' argmax survives a query read as surely open)."""
    gen = torch.Generator().manual_seed(2)
    proba = torch.softmax(torch.randn(2, 7, 4, generator=gen), -1)
    odds = 5 * torch.randn(2, 7, generator=gen)
    odds[0, 0] = 60.0  # σ(60) == 1 in float32
    share, logit = reread_open(proba, odds, 0.3)
    torch.testing.assert_close(logit, open_log_ratio(odds, proba[..., -1], 0.3))
    got = open_columns(share, logit)
    torch.testing.assert_close(got[..., -1], open_responsibility(odds, proba[..., -1], 0.3))
    torch.testing.assert_close(share.sum(-1), torch.ones(2, 7))
    odds[0, 1] = 400.0  # 1 - o_q0 == 0 in float32: the shares are kept all the same
    share, logit = reread_open(proba, odds, 0.3)
    assert logit[0, 1] > 390 and share[0, 1].sum() == pytest.approx(1.0)
    share = proba[..., :-1] / proba[..., :-1].sum(-1, keepdim=True)
    torch.testing.assert_close(got[..., :-1] / got[..., :-1].sum(-1, keepdim=True), share)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 7))
    assert got[0, 0, -1] == 1 and (got[0, 0, :-1] > 0).all()
    assert torch.equal(got[..., :-1].argmax(-1), proba[..., :-1].argmax(-1))


def test_soft_kmeans_open_keeps_the_argmax_of_surely_open_queries():
    """soft k-means with the background: a query whose P(open) rounds to 1 in float32
    keeps positive class columns, so its known-class argmax is soft k-means' (the closed
    accuracy counts it) rather than class 0."""
    from probfsl.inference.soft_kmeans import soft_kmeans_gram_open

    gen = torch.Generator().manual_seed(3)
    x = torch.nn.functional.normalize(torch.randn(2, 9, 5, generator=gen), dim=-1)
    labels = torch.tensor([[0, 1, 2]] * 2)
    odds = torch.full((2, 6), 60.0)
    p = soft_kmeans_gram_open(x @ x.transpose(1, 2), labels, 3, None, 0.5, 10.0, 3, odds)
    known = p[:, 3:, :3]
    assert (known > 0).all()
    near = (x[:, 3:] @ x[:, :3].transpose(1, 2)).argmax(-1)  # one pass from the support
    one = soft_kmeans_gram_open(x @ x.transpose(1, 2), labels, 3, None, 0.5, 10.0, 1, odds)
    assert torch.equal(one[:, 3:, :3].argmax(-1), near)


def test_attach_open_rows_sum_to_one():
    proba = torch.softmax(torch.randn(2, 3, 4), -1)
    p_open = torch.rand(2, 3)
    out = attach_open(proba, p_open)
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))
    assert torch.equal(out[..., :4].argmax(-1), proba.argmax(-1))


# ------------------------------------------------------------------ every method
@pytest.fixture(scope="module")
def fitted(omniglot):
    return {
        name: build_estimator(name, **FAST.get(name, {})).fit_featureset(omniglot)
        for name in METHODS
    }


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_shape_sum_dtype(name, fitted, omniglot):
    est = fitted[name]
    episodes = open_episodes(omniglot, 3)
    for dtype in (torch.float32, torch.float64):
        ep = episodes.to(dtype=dtype)
        p = est.predict_proba_open(ep)
        assert p.shape == (3, ep.n_query, WAY + 1)
        assert p.dtype == dtype and p.device == ep.query.device
        assert bool(torch.isfinite(p).all()) and bool((p >= 0).all())
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p[..., 0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(METHODS))
def test_closed_argmax_agrees_without_open_queries(name, fitted, omniglot):
    est = fitted[name]
    episodes = open_episodes(omniglot, 6, n_open_classes=0)
    closed = est.predict_proba(episodes).argmax(-1)
    open_ = est.predict_proba_open(episodes)[..., :WAY].argmax(-1)
    agree = (closed == open_).double().mean().item()
    assert agree >= (1.0 if not est.transductive else 0.85), agree


@pytest.mark.parametrize("name", list(METHODS))
def test_needs_base_classes(name):
    est = build_estimator(name)
    fs = load_dataset("omniglot")
    episodes = open_episodes(fs, 1)
    with pytest.raises(ValueError, match="base"):
        est.predict_proba_open(episodes)


@pytest.mark.parametrize("name", [m for m in METHODS if not m.startswith("bavardage")])
def test_one_base_class_gives_no_background(name):
    """One base class has no spread of class means (between-class covariance zero): a new
    class's predictive would be the base mean's and P(open) the prior for every query, so
    no background is stored and predict_proba_open says why; the closed set still runs."""
    from tests.synthetic import make_featureset

    one = make_featureset(n_base=1)
    episodes = sample_episodes(one, 2, way=3, shot=1, n_query=9, n_open=6, seed=0)
    est = build_estimator(name, **FAST.get(name, {})).fit_featureset(one)
    assert not hasattr(est, "background_mean_")
    with pytest.raises(ValueError, match="needs base classes \\(at least 2\\)"):
        est.predict_proba_open(episodes)
    assert est.predict_proba(episodes).shape == (2, 15, 3)
    est.fit_featureset(make_featureset(n_base=2))  # two are enough
    p = est.predict_proba_open(episodes)
    assert bool(torch.isfinite(p).all()) and float(p[..., -1].std()) > 1e-3


@pytest.mark.parametrize(
    "name", ["nearest-centroid", "soft-kmeans", "bavardage", "bavardage-gamma", "vmp-gmm", "slem"]
)
def test_batched_equals_one_at_a_time(name, fitted, omniglot):
    est = fitted[name]
    episodes = open_episodes(omniglot, 3).to(dtype=torch.float64)
    batched = est.predict_proba_open(episodes)
    single = torch.cat([est.predict_proba_open(episodes[t]) for t in range(3)])
    torch.testing.assert_close(batched, single, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("name", ["nearest-centroid", "evidence-lssvm", "slem"])
def test_outlier_posterior_monotone_in_distance(name, fitted, omniglot):
    """A query moved away from every class along the base mean's complement grows more open."""
    est = fitted[name]
    episodes = open_episodes(omniglot, 1).to(dtype=torch.float64)
    support = episodes.support[0]
    direction = torch.randn(support.shape[-1], generator=torch.Generator().manual_seed(3))
    direction = direction.to(support) / direction.norm()
    base = support.mean(0)
    steps = torch.linspace(0, 3, 7, dtype=support.dtype)
    scale = support.norm(dim=-1).mean()
    query = (base + scale * steps[:, None] * direction).unsqueeze(0)
    ep = Episodes(
        episodes.support,
        episodes.support_labels,
        query,
        torch.zeros(1, len(steps), dtype=torch.long),
        episodes.classes,
        episodes.support_index,
        torch.zeros(1, len(steps), dtype=torch.long),
    )
    p_open = est.predict_proba_open(ep)[0, :, -1]
    assert bool((p_open[1:] >= p_open[:-1] - 1e-9).all()), p_open


def test_inductive_open_column_is_the_formula(fitted, omniglot):
    """nearest centroid's last column is the two-covariance posterior of "open", its
    log-odds scaled and shifted as held-out base classes ask, the known columns its own
    probabilities times 1 - P(open)."""
    est: NearestCentroid = fitted["nearest-centroid"]
    episodes = open_episodes(omniglot, 2).to(dtype=torch.float64)
    got = est.predict_proba_open(episodes)
    from probfsl.data.preprocess import center_and_normalize

    s = center_and_normalize(episodes.support, est.base_mean_)
    q = center_and_normalize(episodes.query, est.base_mean_)
    stats = est.background_stats(q)
    class_ll, bg_ll = two_covariance_log_liks(s, episodes.support_labels, q, WAY, stats)
    scale, shift = est.background_odds_scale_, est.background_odds_shift_
    assert 0 < scale < 1  # 64-d Gaussians are over-confident on held-out classes
    for t, i in itertools.product(range(2), range(3)):
        closed = float(np.log(np.exp(class_ll[t, i].numpy()).mean()))
        odds = scale * (float(bg_ll[t, i]) - closed) + shift  # prior odds 0.5 / 0.5 = 1
        want = torch.tensor(1 / (1 + np.exp(-odds)), dtype=torch.float64)
        torch.testing.assert_close(got[t, i, -1], want)
    proba = est.predict_proba(episodes)
    torch.testing.assert_close(got[..., :WAY], proba * (1 - got[..., -1:]))


def test_open_queries_get_more_background(fitted, omniglot):
    """On average, open queries get a larger last column than closed ones (soft k-means,
    BAVARDAGE, nearest centroid)."""
    episodes = open_episodes(omniglot, 20, n_open_classes=5)
    is_open = episodes.query_labels == WAY
    for name in ("nearest-centroid", "soft-kmeans", "bavardage"):
        p = fitted[name].predict_proba_open(episodes)[..., -1]
        assert p[is_open].mean() > p[~is_open].mean(), name


def synthetic_open_tasks(
    n_tasks: int = 20, dim: int = 32, seed: int = 0, noise: float = 0.9, open_per_class: int = 10
):
    """Base classes and tasks of Gaussian classes: ``(base features, base labels, tasks with
    open queries, the same tasks without them)``; the open queries (labelled WAY, last,
    ``open_per_class`` from each of 5 other classes) come from classes far from the known
    ones in the full space."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n_classes, per_class):
        means = torch.randn(n_classes, dim, generator=gen, dtype=torch.float64)
        spread = torch.randn(n_classes, per_class, dim, generator=gen, dtype=torch.float64)
        return means.unsqueeze(1) + noise * spread

    base = draw(40, 20)
    base_labels = torch.arange(40).repeat_interleave(20)
    shot, per_class, n_open = 1, 10, 5
    known = draw(n_tasks * WAY, shot + per_class).reshape(n_tasks, WAY, shot + per_class, dim)
    other = draw(n_tasks * n_open, open_per_class).reshape(n_tasks, n_open * open_per_class, dim)
    support = known[:, :, :shot].transpose(1, 2).reshape(n_tasks, shot * WAY, dim)
    closed = known[:, :, shot:].reshape(n_tasks, WAY * per_class, dim)
    support_labels = torch.arange(WAY).repeat(shot).expand(n_tasks, -1)
    closed_labels = torch.arange(WAY).repeat_interleave(per_class).expand(n_tasks, -1)
    open_labels = torch.full((n_tasks, n_open * open_per_class), WAY)

    def make(query, labels):
        zeros = torch.zeros(labels.shape, dtype=torch.long)
        return Episodes(
            support,
            support_labels,
            query,
            labels,
            torch.arange(WAY).expand(n_tasks, -1),
            torch.zeros(support_labels.shape, dtype=torch.long),
            zeros,
        )

    with_open = make(torch.cat([closed, other], 1), torch.cat([closed_labels, open_labels], 1))
    return base.reshape(-1, dim), base_labels, with_open, make(closed, closed_labels)


@pytest.mark.parametrize("name", ["bavardage", "bavardage-gamma", "soft-kmeans", "vmp-gmm"])
def test_open_queries_leave_closed_accuracy(name):
    """With as many open queries as closed ones, the closed-set accuracy of the known
    columns stays close to the accuracy on the same tasks without them, and the last
    column separates open from closed queries."""
    base, base_labels, with_open, closed = synthetic_open_tasks()
    est = build_estimator(name).fit_base(base, base_labels)
    n_closed = closed.n_query
    labels = closed.query_labels
    p_open = est.predict_proba_open(with_open)
    acc_open = (p_open[:, :n_closed, :WAY].argmax(-1) == labels).double().mean().item()
    acc_closed = (est.predict_proba(closed).argmax(-1) == labels).double().mean().item()
    assert acc_open >= acc_closed - 0.03, (acc_open, acc_closed)
    score = p_open[..., -1]
    assert score[:, n_closed:].mean() > score[:, :n_closed].mean() + 0.3


def test_bavardage_gamma_weights_open_queries_in_its_fit():
    """bavardage-gamma's fit weights every query by its closed share: with as many open
    queries (from far-away classes) as closed ones, its closed-set accuracy stays within 2
    points of the accuracy without them and above the inductive reading's (the mixture
    fitted on every query, whose argmax the inductive known columns keep)."""
    base, base_labels, with_open, closed = synthetic_open_tasks()
    est = build_estimator("bavardage-gamma").fit_base(base, base_labels)
    n_closed, labels = closed.n_query, closed.query_labels

    def accuracy(proba):
        return (proba[:, :n_closed, :WAY].argmax(-1) == labels).double().mean().item()

    transductive = accuracy(est.predict_proba_open(with_open))
    without = accuracy(est.predict_proba(closed))
    inductive = accuracy(est.predict_proba(with_open))
    assert transductive >= without - 0.02, (transductive, without)
    assert transductive > inductive, (transductive, inductive)
    assert est.elbo_trace_.shape == (est.n_vb + 1, len(closed))


def test_em_dirichlet_open_column_is_inductive(fitted, omniglot):
    """EM-Dirichlet's last column is the two-covariance enumeration of the centred,
    normalised embeddings; its known columns are its closed-set assignments times
    1 - P(open)."""
    est = fitted["em-dirichlet"]
    episodes = open_episodes(omniglot, 2).to(dtype=torch.float64)
    got = est.predict_proba_open(episodes)
    from probfsl.data.preprocess import center_and_normalize

    s = center_and_normalize(episodes.support, est.base_mean_)
    q = center_and_normalize(episodes.query, est.base_mean_)
    class_ll, bg_ll = two_covariance_log_liks(
        s, episodes.support_labels, q, WAY, est.background_stats(q)
    )
    scale, shift = est.background_odds_scale_, est.background_odds_shift_
    torch.testing.assert_close(
        got[..., -1], open_posterior(class_ll, bg_ll, 0.5, scale, shift)[..., -1]
    )
    proba = est.predict_proba(episodes)
    torch.testing.assert_close(got[..., :WAY], proba * (1 - got[..., -1:]))


def test_bavardage_gamma_keeps_the_class_order_of_surely_open_queries(omniglot):
    """On the built-in float32 features some closed queries get P(open) = 1 exactly; their
    class columns stay positive (1 - o_q0 as σ(-logit)), so the closed accuracy reads
    their class rather than class 0 (30 tasks at 1 and 5 shots: 2 and 3 such queries
    had all-zero class columns with 1 - o_q0)."""
    est = build_estimator("bavardage-gamma").fit_featureset(omniglot)
    for shot in (1, 5):
        ep = sample_episodes(omniglot, 30, WAY, shot, 15, n_open=75, seed=0)
        p = est.predict_proba_open(ep)
        assert p.dtype == torch.float32
        known = p[..., :-1][~ep.open_mask]
        assert (known.amax(-1) > 0).all()


def _wide_open_set(seed: int = 0):
    """512-d features of 36 well-separated classes (24 base), on which the transductive
    contrast reaches log-odds of ±200."""
    from probfsl.data.loaders import from_arrays

    rng = np.random.default_rng(seed)
    means = rng.normal(size=(36, 512)) * 0.8
    x = np.concatenate([m + 0.5 * rng.normal(size=(12, 512)) for m in means])
    y = np.repeat(np.arange(36), 12)
    return from_arrays(
        {"features": x, "labels": y, "split": np.where(y < 24, "base", "novel")}, "wide"
    )


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("soft-kmeans", {}),
        ("bavardage", {}),
        ("bavardage", {"n_free": 2, "mode": "bavardage", "n_vb": 3}),
        ("vmp-gmm", {}),
        ("bavardage-gamma", {}),
    ],
)
@pytest.mark.parametrize("frame", ["base", "queries"])
def test_small_open_scales_agree_in_float32_and_float64(name, params, frame):
    """A transductive P(open) is scaled on its log-odds, which run to hundreds on wide
    features: read off float32 probabilities they stop near ±87 (1 - P(open) rounds to 0),
    and a scale of 0.02 then gives σ(±1.7) where float64 gives σ(±4). The methods pass the
    exact log-odds of their last reading, so float32 agrees with float64."""
    fs = _wide_open_set()
    episodes = sample_episodes(fs, 4, WAY, 1, 25, seed=0, n_open=25)
    # one fit (its held-out choices are discrete and may differ between fits in the two
    # dtypes), the tasks in either dtype
    est = build_estimator(name, open_frame=frame, **params).fit_featureset(fs, torch.float64)
    if name == "bavardage-gamma":  # no hyperparameter: its class attributes
        est.open_scale, est.open_shift = 0.02, 0.0
    else:
        est.set_params(open_scale=0.02, open_shift=0.0)
    log_odds = est.inferred_open_log_odds(episodes.to(dtype=torch.float64))
    assert (log_odds.abs() > 100).double().mean() > 0.3  # beyond float32's P(open)
    got = {dtype: est.predict_proba_open(episodes.to(dtype=dtype)) for dtype in DTYPES}
    assert got[torch.float32].dtype == torch.float32
    # the known columns keep a share where 1 - P(open) as inferred rounds to 0, and the
    # argmax of the shares inferred
    assert (got[torch.float32][..., :-1].sum(-1) > 0).all()
    for dtype in DTYPES:
        known, _ = est.inferred_open(episodes.to(dtype=dtype))
        assert torch.equal(got[dtype][..., :-1].argmax(-1), known.argmax(-1))
    p32, p64 = got[torch.float32][..., -1].double(), got[torch.float64][..., -1]
    torch.testing.assert_close(p32, p64, atol=2e-3, rtol=0)


def test_free_components_log_odds_are_those_of_their_sum():
    """ln(o_q0 + Σ_free o_qj) - ln Σ_known o_qk by brute force in float64, and finite where
    o_q0 rounds to 1."""
    from probfsl.inference.vb_mixture_open import with_free_components

    gen = torch.Generator().manual_seed(4)
    logit = 8 * torch.randn(3, 7, generator=gen, dtype=torch.float64)
    closed = torch.softmax(torch.randn(3, 7, 5, generator=gen, dtype=torch.float64), -1)
    closed = closed * torch.sigmoid(-logit).unsqueeze(-1)  # the closed columns after o_q0
    o0 = torch.sigmoid(logit)
    want = (o0 + closed[..., 3:].sum(-1)).log() - closed[..., :3].sum(-1).log()
    torch.testing.assert_close(with_free_components(logit, closed, 3), want)
    far = with_free_components(torch.full((1, 1), 300.0), torch.full((1, 1, 5), 0.2), 3)
    assert far.item() == pytest.approx(300.0 + math.log(5 / 3))
