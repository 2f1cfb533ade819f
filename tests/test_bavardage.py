"""BAVARDAGE's PLDA whitening and the estimator: docs/design/bavardage.md §7 (PLDA, invariances,
behaviour)."""

import math

import numpy as np
import pytest
import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.gram import centred_grams
from probfsl.inference.plda import (
    centroid_projection,
    centroid_projection_gram,
    global_whitening,
    shrunk_centroids,
    task_span_whitening,
    within_class_scatter,
)
from probfsl.inference.soft_kmeans import soft_kmeans
from probfsl.inference.vb_mixture import fit_bavardage_vb
from probfsl.models.bavardage import PRESETS, Bavardage
from probfsl.testing import audit_devices

F64 = torch.float64


def _world(dim=24, n_base=12, per_base=15, seed=0, spread=1.0, noise=0.35):
    """A shared anisotropic within-class covariance and a sampler of its classes."""
    g = torch.Generator().manual_seed(seed)
    rot, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=F64))
    scales = noise * torch.logspace(0, -1.2, dim, dtype=F64)
    offset = 3.0 * torch.randn(dim, generator=g, dtype=F64)

    def draw(means, counts):
        rows = [
            m + (torch.randn(c, dim, generator=g, dtype=F64) * scales) @ rot.T
            for m, c in zip(means, counts, strict=True)
        ]
        return torch.cat(rows) + offset

    base_means = spread * torch.randn(n_base, dim, generator=g, dtype=F64)
    base = draw(base_means, [per_base] * n_base)
    labels = torch.arange(n_base).repeat_interleave(per_base)

    def episodes(n_tasks, way=3, shot=1, counts=(6, 2, 4), spread_novel=spread):
        sup, sup_lab, qry, qry_lab = [], [], [], []
        for _ in range(n_tasks):
            means = spread_novel * torch.randn(way, dim, generator=g, dtype=F64)
            s = draw(means, [shot] * way).reshape(way, shot, dim).transpose(0, 1).reshape(-1, dim)
            q = draw(means, counts)
            ql = torch.arange(way).repeat_interleave(torch.tensor(counts))
            perm = torch.randperm(len(ql), generator=g)
            sup.append(s)
            sup_lab.append(torch.arange(way).repeat(shot))
            qry.append(q[perm])
            qry_lab.append(ql[perm])
        t = n_tasks
        return Episodes(
            torch.stack(sup),
            torch.stack(sup_lab),
            torch.stack(qry),
            torch.stack(qry_lab),
            torch.arange(way).expand(t, way),
            torch.zeros(t, way * shot, dtype=torch.long),
            torch.zeros(t, sum(counts), dtype=torch.long),
        )

    return base, labels, episodes


def _with(ep, support=None, query=None, support_labels=None, query_labels=None):
    return Episodes(
        ep.support if support is None else support,
        ep.support_labels if support_labels is None else support_labels,
        ep.query if query is None else query,
        ep.query_labels if query_labels is None else query_labels,
        ep.classes,
        ep.support_index,
        ep.query_index,
    )


# ---------------------------------------------------------------------- S_w and whitening
def test_within_class_scatter_matches_the_code_normalisation():
    base, labels, _ = _world(dim=6, n_base=5, per_base=7)
    scatters = []
    for c in range(5):
        x = base[labels == c]
        xc = x - x.mean(0)
        scatters.append(xc.T @ xc)
    norms = torch.stack([torch.linalg.norm(c) for c in scatters])
    normed = torch.stack([c / n for c, n in zip(scatters, norms, strict=True)])
    expected = normed.mean(0) * norms.mean()
    eye = torch.eye(6, dtype=F64)
    torch.testing.assert_close(within_class_scatter(base, labels), expected + 1e-6 * eye)
    paper = sum(scatters) / len(base) + 1e-6 * eye
    torch.testing.assert_close(within_class_scatter(base, labels, "paper"), paper)


def test_global_whitening_spheres_the_scatter_and_lazy_metric_is_exact():
    base, labels, _ = _world(dim=10)
    s_w = within_class_scatter(base, labels)
    w = global_whitening(s_w).matrix
    torch.testing.assert_close(w.T @ s_w @ w, torch.eye(10, dtype=F64))
    # s_max clamping most scales: the low-rank form of G = W W^T is exact
    scales = global_whitening(s_w).scales.sort().values
    clamped = global_whitening(s_w, s_max=scales[2].item())
    assert clamped.clamped_fraction > 0.5
    v = torch.randn(3, 4, 10, dtype=F64)
    g = clamped.matrix @ clamped.matrix.T
    torch.testing.assert_close(clamped.metric_apply(v), v @ g)


def test_task_span_whitening_reproduces_the_span_metric():
    """Design §7: W = U_t V_e diag(s) satisfies W^T (U_t M_t U_t^T) W = I when unclamped."""
    base, labels, episodes = _world(dim=24)
    precision = torch.linalg.inv(within_class_scatter(base, labels))
    ep = episodes(2)
    x = torch.cat([ep.support, ep.query], 1)  # N = 15 < D = 24
    y, basis = task_span_whitening(x, precision, None, return_basis=True)
    u_t = basis.span
    m_t = torch.linalg.inv(u_t.mT @ precision @ u_t)
    w = u_t @ basis.rotation * basis.scales.unsqueeze(1)
    eye = torch.eye(x.shape[1], dtype=F64).expand(2, -1, -1)
    torch.testing.assert_close(w.mT @ (u_t @ m_t @ u_t.mT) @ w, eye)
    torch.testing.assert_close(y, x @ w)
    # unclamped, whitened inner products are the full-space Mahalanobis ones
    torch.testing.assert_close(y @ y.mT, x @ precision @ x.mT)
    # with q an orthonormal basis of the centroid differences, W q is still orthonormal
    resp = torch.softmax(torch.randn(2, x.shape[1], 3, dtype=F64), -1)
    c = shrunk_centroids(y, resp, 10.0)
    q, _ = torch.linalg.qr((c[:, 1:] - c[:, :1]).mT)
    wq = w @ q
    torch.testing.assert_close(wq.mT @ (u_t @ m_t @ u_t.mT) @ wq, eye[:, :2, :2])


def test_projection_basis_keeps_the_between_class_spectrum_and_is_basis_free():
    """Design §7: q^T Ψ q has Ψ's nonzero spectrum; QR basis and ours give the same geometry."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(2, 20, 9, generator=g, dtype=F64)
    resp = torch.softmax(3 * torch.randn(2, 20, 4, generator=g, dtype=F64), -1)
    c = shrunk_centroids(y, resp, 10.0)
    centred = c - c.mean(1, keepdim=True)
    psi = centred.mT @ centred  # [T, D, D], rank K - 1
    q, _ = torch.linalg.qr((c[:, 1:] - c[:, :1]).mT)
    top = torch.linalg.eigvalsh(psi)[:, -3:]
    torch.testing.assert_close(torch.linalg.eigvalsh(q.mT @ psi @ q), top)
    u = centroid_projection(y, resp, 10.0)
    u_qr = y @ q
    torch.testing.assert_close(u @ u.mT, u_qr @ u_qr.mT)
    # ... and the same as the global-metric (lazy) form on unwhitened rows
    base = torch.randn(60, 9, generator=g, dtype=F64)
    metric = global_whitening(within_class_scatter(base, torch.arange(60) % 6))
    u_lazy = centroid_projection(y, resp, 10.0, metric)
    u_dense = centroid_projection(metric.transform(y), resp, 10.0)
    torch.testing.assert_close(u_lazy @ u_lazy.mT, u_dense @ u_dense.mT)


# ---------------------------------------------------------------------- estimator
def _fit(base, labels, **kw):
    return Bavardage(**kw).fit_base(base, labels)


def test_task_span_and_global_whitening_agree_when_s_max_does_not_clamp():
    base, labels, episodes = _world()
    ep = episodes(4)
    a = _fit(base, labels, s_max=None).predict_proba(ep)
    b = _fit(base, labels, s_max=None, whitening="global").predict_proba(ep)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)
    # N >= D: the span is the whole space and the two are equal even with clamping
    base, labels, episodes = _world(dim=8)
    ep = episodes(3)
    est = _fit(base, labels, s_max=4.0)
    assert 0 < est.clamped_fraction_ < 1
    a = est.predict_proba(ep)
    b = _fit(base, labels, s_max=4.0, whitening="global").predict_proba(ep)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_invariances_of_the_responsibilities():
    """Design §7: orthogonal transform, translation and scaling of base+task; permutations."""
    base, labels, episodes = _world()
    ep = episodes(3)
    kw = dict(temperature_vb=20.0, s_max=2.0)
    ref = _fit(base, labels, **kw).predict_proba(ep)
    g = torch.Generator().manual_seed(7)
    rot, _ = torch.linalg.qr(torch.randn(24, 24, generator=g, dtype=F64))
    shift = torch.randn(24, generator=g, dtype=F64)
    for transform in (lambda x: x @ rot, lambda x: x + shift, lambda x: 3.7 * x):
        est = _fit(transform(base), labels, **kw)
        out = est.predict_proba(_with(ep, transform(ep.support), transform(ep.query)))
        torch.testing.assert_close(out, ref, atol=1e-7, rtol=0)
    est = _fit(base, labels, **kw)
    perm = torch.randperm(ep.n_query, generator=g)
    out = est.predict_proba(_with(ep, query=ep.query[:, perm]))
    torch.testing.assert_close(out, ref[:, perm], atol=1e-9, rtol=0)
    relabel = torch.tensor([2, 0, 1])
    out = est.predict_proba(_with(ep, support_labels=relabel[ep.support_labels]))
    torch.testing.assert_close(out[..., relabel], ref, atol=1e-9, rtol=0)


def test_batched_equals_single_and_float32_agrees():
    base, labels, episodes = _world()
    ep = episodes(4)
    est = _fit(base, labels)
    batched = est.predict_proba(ep)
    singles = torch.cat([est.predict_proba(ep[t]) for t in range(4)])
    torch.testing.assert_close(batched, singles, atol=1e-10, rtol=0)
    p32 = est.predict_proba(ep.to(dtype=torch.float32))
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), batched, atol=2e-3, rtol=0)
    assert (p32.argmax(-1) == batched.argmax(-1)).float().mean() > 0.97


def test_well_separated_clusters_are_recovered_with_exact_query_counts():
    """Design §7: 100% accuracy and α_k - α_o equal to the true query counts."""
    base, labels, episodes = _world(spread=6.0, noise=0.05)
    counts = (9, 0, 5)
    ep = episodes(5, counts=counts, spread_novel=6.0)
    est = _fit(base, labels, temperature_vb=10.0, trace_elbo=True)
    assert (est.predict(ep) == ep.query_labels).all()
    alpha = est.state_.alpha
    torch.testing.assert_close(
        alpha - 2.0, torch.tensor(counts, dtype=F64).expand(5, 3), atol=1e-4, rtol=0
    )
    assert est.elbo_trace_.shape == (est.n_vb + 1, 5)
    assert torch.isfinite(est.elbo_trace_).all()
    # without the trace: the same fit, and the final ELBO alone
    untraced = _fit(base, labels, temperature_vb=10.0)
    torch.testing.assert_close(untraced.predict_proba(ep), est.predict_proba(ep))
    assert untraced.elbo_trace_ is None
    torch.testing.assert_close(untraced.episode_objective_, est.elbo_trace_[-1])


def test_plda_beats_soft_kmeans_on_anisotropic_tasks():
    """Design §7 behaviour: with a strongly anisotropic shared covariance, VB+PLDA wins."""
    base, labels, episodes = _world(dim=16, n_base=20, per_base=20, spread=0.25, noise=1.0)
    ep = episodes(30, way=3, shot=1, counts=(12, 4, 8), spread_novel=0.25)
    bav = _fit(base, labels, temperature_vb=10.0, s_max=None)
    skm = _fit(base, labels, mode="soft_kmeans")
    acc_bav = (bav.predict(ep) == ep.query_labels).double().mean().item()
    acc_skm = (skm.predict(ep) == ep.query_labels).double().mean().item()
    assert acc_bav > acc_skm + 0.05, (acc_bav, acc_skm)


def test_soft_kmeans_mode_is_the_shared_initialiser_and_vb_mode_runs_in_full_space():
    base, labels, episodes = _world()
    ep = episodes(2)
    est = _fit(base, labels, mode="soft_kmeans", temperature_km=7.0)
    mean = base.mean(0)
    expected = soft_kmeans(
        center_and_normalize(ep.support, mean),
        ep.support_labels,
        center_and_normalize(ep.query, mean),
        3,
        7.0,
        5,
    )[:, 3:]
    torch.testing.assert_close(est.predict_proba(ep), expected)
    vb = _fit(base, labels, mode="vb")
    p = vb.predict_proba(ep)
    assert vb.state_.u.shape[-1] == 24 and p.shape == (2, 12, 3)


def test_presets_and_balanced_model():
    published = {"mini-balanced", "mini-unbalanced", "tiered-balanced", "tiered-unbalanced", "cub"}
    assert set(PRESETS) == published | {f"{name}-relative" for name in published}
    # relative presets: T_vb / images per class, s_max * sqrt(n w / D) (design §3.2)
    assert PRESETS["mini-unbalanced-relative"]["temperature_vb"] == round(50 / 600, 4)
    assert PRESETS["cub-relative"]["s_max"] == round(5 * (60 * 0.45 / 512) ** 0.5, 3)
    est = Bavardage.from_preset("tiered-unbalanced")
    assert (est.temperature_km, est.temperature_vb, est.s_max) == (100.0, 100.0, 1.0)
    assert Bavardage.from_preset("cub").get_params()["temperature_vb"] == 4.0
    with pytest.raises(ValueError, match="preset"):
        Bavardage.from_preset("imagenet")
    base, labels, episodes = _world()
    est = Bavardage.from_preset("mini-balanced").fit_base(base, labels)
    p = est.predict_proba(episodes(2))
    assert est.state_.alpha is None
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 12, dtype=F64))


def test_to_datatree_exports_per_task_posteriors():
    pytest.importorskip("arviz_base")
    base, labels, episodes = _world()
    est = _fit(base, labels)
    est.predict_proba(episodes(3))
    tree = est.to_datatree(n_draws=40)
    post = tree["posterior"]
    assert post["pi"].shape == (1, 40, 3, 3)
    assert post["mu"].shape == (1, 40, 3, 3, 2)
    assert post["z"].shape == (1, 40, 3, 12)
    mean_pi = np.asarray(post["pi"].mean(("chain", "draw")))
    alpha = est.state_.alpha.numpy()
    assert np.abs(mean_pi - alpha / alpha.sum(-1, keepdims=True)).max() < 0.1


def test_posterior_draws_come_from_the_guide_and_leave_the_global_streams_alone():
    """Draws of the engine's guide: their moments are those of q(π), q(μ), q(z); the same
    seed gives the same draws; the global random stream is neither consumed nor read."""
    base, labels, episodes = _world()
    est = _fit(base, labels)
    est.predict_proba(episodes(3))
    state = est.state_
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    draws = est.posterior_draws(n_draws=4000, seed=5, tasks=slice(1, 3))
    torch.testing.assert_close(torch.rand(3), expected_next, rtol=0, atol=0)
    assert draws["pi"].shape == (1, 4000, 2, 3) and draws["z"].shape == (1, 4000, 2, 12)
    assert draws["mu"].shape == (1, 4000, 2, 3, 2)
    alpha = state.alpha[1:3]
    torch.testing.assert_close(
        draws["pi"].mean((0, 1)), alpha / alpha.sum(-1, keepdim=True), atol=0.02, rtol=0
    )
    torch.testing.assert_close(draws["mu"].mean((0, 1)), state.mean[1:3], atol=0.03, rtol=0)
    sd = (state.beta[1:3] * est.temperature_vb_).rsqrt()
    torch.testing.assert_close(draws["mu"].std((0, 1)).mean(-1), sd, rtol=0.05, atol=0)
    freq = torch.nn.functional.one_hot(draws["z"], 3).double().mean((0, 1))
    torch.testing.assert_close(freq, state.query_resp[1:3], atol=0.03, rtol=0)
    again = est.posterior_draws(n_draws=4000, seed=5, tasks=slice(1, 3))
    assert all(torch.equal(again[k], draws[k]) for k in draws)
    other = est.posterior_draws(n_draws=4000, seed=6, tasks=slice(1, 3))
    assert not torch.equal(other["mu"], draws["mu"])
    balanced = Bavardage.from_preset("mini-balanced").fit_base(base, labels)
    balanced.predict_proba(episodes(2))
    assert set(balanced.posterior_draws(n_draws=3)) == {"mu", "z"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_posterior_draws_on_cuda_fork_the_cuda_stream():
    base, labels, episodes = _world()
    est = _fit(base.cuda(), labels.cuda())
    est.predict_proba(episodes(2).to(device="cuda"))
    before = torch.cuda.get_rng_state()
    first = est.posterior_draws(n_draws=50, seed=1)
    assert first["mu"].device.type == "cuda"
    assert torch.equal(torch.cuda.get_rng_state(), before)
    torch.cuda.manual_seed(99)  # the draws do not depend on the global CUDA stream
    second = est.posterior_draws(n_draws=50, seed=1)
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("whitening", ["task_span", "global"])
def test_predict_proba_makes_every_tensor_on_the_data_device(whitening):
    """predict_proba with the default device set to meta and the data on the CPU
    (probfsl.testing.audit_devices): a tensor created without device= would be caught."""
    base, labels, episodes = _world()
    est = _fit(base, labels, whitening=whitening, s_max=2.0)
    ep = episodes(3)
    expected = est.predict_proba(ep)
    out = audit_devices(lambda: est.predict_proba(ep))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_bad_input_raises_value_error():
    base, labels, episodes = _world()
    ep = episodes(2)
    with pytest.raises(ValueError, match="fit_base"):
        Bavardage().predict_proba(ep)
    with pytest.raises(ValueError, match="classes"):
        Bavardage().fit_base(base[:15], labels[:15])
    with pytest.raises(TypeError, match="base features"):
        Bavardage().fit_base(None, labels)
    est = _fit(base, labels)
    with pytest.raises(ValueError, match="support_labels"):
        est.predict_proba(_with(ep, support_labels=ep.support_labels + 5))
    with pytest.raises(ValueError, match="width"):
        est.predict_proba(_with(ep, query=ep.query[..., :10], support=ep.support[..., :10]))
    with pytest.raises(ValueError, match="query"):
        est.predict_proba(_with(ep, query=ep.query[..., :10]))
    with pytest.raises(ValueError, match="whitening"):
        Bavardage(whitening="pca").fit_base(base, labels)
    with pytest.raises(ValueError, match="NaN"):
        est.predict_proba(_with(ep, query=ep.query * math.nan))


# ---------------------------------------------------------------------- Gram fast path
def test_whitened_gram_and_gram_projection_equal_the_d_wide_forms():
    base, labels, _ = _world(dim=10)
    s_w = within_class_scatter(base, labels)
    scales = global_whitening(s_w).scales.sort().values
    x = torch.randn(3, 7, 10, dtype=F64)
    resp = torch.softmax(torch.randn(3, 7, 4, dtype=F64), -1)
    for s_max in (None, scales[2].item()):  # full metric, then the low-rank form
        w = global_whitening(s_w, s_max=s_max)
        assert (w.low_rank() is None) == (s_max is None)
        y = w.transform(x)
        torch.testing.assert_close(w.gram(x), y @ y.transpose(1, 2))
        # same projection up to the sign of each eigenvector: compare u u^T
        u = centroid_projection(x, resp, 10.0, metric=w)
        u_gram = centroid_projection_gram(y @ y.transpose(1, 2), resp, 10.0)
        assert u_gram.shape == (3, 7, 3)
        torch.testing.assert_close(u_gram @ u_gram.transpose(1, 2), u @ u.transpose(1, 2))


def _reference_global(est, ep):
    """The D-wide global-whitening pipeline (centred, normalised rows; metric G)."""
    mean = est.base_mean_.to(ep.support)
    s, q = center_and_normalize(ep.support, mean), center_and_normalize(ep.query, mean)
    resp = soft_kmeans(s, ep.support_labels, q, ep.way, est.temperature_km, est.n_km)
    engine = est._engine(ep.way, est.whitening_.to(s), "adaptive")
    state, _ = fit_bavardage_vb(engine, s, ep.support_labels, q, resp, est.n_vb)
    return state.query_resp


@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_gram_fast_path_predicts_as_the_d_wide_pipeline(offset):
    base, labels, episodes = _world()
    ep = episodes(4)
    # a large common offset makes the raw-row Gram expansion lose bits: explicit centring
    ep = _with(ep, support=ep.support + offset, query=ep.query + offset)
    est = _fit(base + offset, labels, s_max=2.0, whitening="global")
    assert est.whitening_.low_rank() is not None
    *_, bad = centred_grams(ep.points(), est.base_mean_, est.whitening_)
    assert bool(bad.all()) == (offset > 0) and bool(bad.any()) == (offset > 0)
    p = est.predict_proba(ep)
    torch.testing.assert_close(p, _reference_global(est, ep), atol=1e-9, rtol=0)
    ep32 = ep.to(dtype=torch.float32)
    p32 = est.predict_proba(ep32)
    torch.testing.assert_close(p32, _reference_global(est, ep32), atol=1e-4, rtol=0)


def test_cheap_finiteness_check_catches_inf_but_not_large_finite_values():
    base, labels, episodes = _world()
    est = _fit(base, labels, whitening="global")
    ep = episodes(2)
    bad = ep.support.clone()
    bad[1, 0, 3] = -math.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        est.predict_proba(_with(ep, support=bad))
    # finite entries whose float32 sum overflows are accepted
    big = ep.to(dtype=torch.float32)
    big = _with(big, query=torch.full_like(big.query, 3e38))
    assert not torch.isfinite(big.query.sum())
    assert torch.isfinite(est.predict_proba(big)).all()  # rows rescaled before their Grams


def test_relative_scale_is_invariant_to_images_per_base_class_and_code_scale_is_not():
    """Duplicating every base image doubles the code's S_w (design §3.2): in relative units
    the clamp and the precision follow it and the responsibilities do not change (up to
    the fixed 1e-6 ridge of S_w, which does not double)."""
    base, labels, episodes = _world()
    twice = torch.cat([base, base]), torch.cat([labels, labels])
    ep = episodes(4, spread_novel=0.3)  # overlapping classes: soft responsibilities
    kw = dict(s_max=0.8, temperature_vb=0.3, scale="relative", whitening="global")
    once_rel, twice_rel = _fit(base, labels, **kw), _fit(*twice, **kw)
    assert 0 < once_rel.clamped_fraction_ < 1
    assert twice_rel.temperature_vb_ == pytest.approx(2 * once_rel.temperature_vb_, rel=1e-4)
    assert twice_rel.s_max_ == pytest.approx(once_rel.s_max_ / 2**0.5, rel=1e-4)
    torch.testing.assert_close(
        once_rel.predict_proba(ep), twice_rel.predict_proba(ep), atol=1e-4, rtol=0
    )
    code = dict(s_max=once_rel.s_max_, temperature_vb=once_rel.temperature_vb_, whitening="global")
    once_code, twice_code = _fit(base, labels, **code), _fit(*twice, **code)
    torch.testing.assert_close(once_code.predict_proba(ep), once_rel.predict_proba(ep))
    assert (once_code.predict_proba(ep) - twice_code.predict_proba(ep)).abs().max() > 1e-3


def test_with_params_reuses_the_base_statistics_and_equals_a_fresh_fit():
    base, labels, episodes = _world()
    ep = episodes(3)
    fitted = _fit(base, labels, whitening="global")
    for params in (dict(s_max=2.0, temperature_vb=9.0), dict(scale="relative", s_max=1.0)):
        copy = fitted.with_params(**params)
        assert copy.scatter_eigen_ is fitted.scatter_eigen_
        fresh = _fit(base, labels, whitening="global", **params)
        torch.testing.assert_close(copy.predict_proba(ep), fresh.predict_proba(ep))
    # a new batch replaces the shared rotated rows (no stale cache)
    other = episodes(2)
    torch.testing.assert_close(
        fitted.with_params(s_max=3.0).predict_proba(other),
        _fit(base, labels, whitening="global", s_max=3.0).predict_proba(other),
    )
    assert fitted.s_max == 5.0  # the original is untouched
    # candidates of one s_max share K; each one's output is still a fresh fit's
    ep = episodes(3)
    for params in (dict(s_max=1.0, temperature_vb=9.0), dict(s_max=1.0, temperature_vb=2.0)):
        torch.testing.assert_close(
            fitted.with_params(**params).predict_proba(ep),
            _fit(base, labels, whitening="global", **params).predict_proba(ep),
        )
    assert len(fitted._search_cache["scaled"]) == 1
    fitted.with_params(s_max=2.0).predict_proba(ep)
    assert len(fitted._search_cache["scaled"]) == 2
    with pytest.raises(ValueError, match="unknown"):
        fitted.with_params(temprature=1.0)
    with pytest.raises(ValueError, match="scatter"):
        fitted.with_params(scatter="paper")
