"""GP-Tree model: tree, path probabilities, stages, estimators (docs/design/gp-tree.md §6,
items 7–11)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from probfsl.data.builtin import load_dataset
from probfsl.data.tasks import sample_episodes
from probfsl.inference import gp_tree_nodes as gpn
from probfsl.models.gp_tree import (
    GPTree,
    GPTreeFewShot,
    Node,
    Tree,
    build_tree,
    gp_tree_model,
    hard_kmeans,
    inducing_slots,
    node_batch,
    path_probabilities,
    two_means_split,
)
from probfsl.testing import ConformanceCase, check_engine

warnings.filterwarnings("ignore", message=".*torch.jit.*")


def _blobs(n_classes=5, n_per=8, D=6, seed=0, sep=2.5):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_classes, D)) * sep
    X = np.concatenate([c + rng.normal(size=(n_per, D)) for c in centres])
    y = np.repeat(np.arange(n_classes), n_per)
    return X, y


# ------------------------------------------------------------------------------- tree (7)


def test_tree_structure_and_determinism():
    X, y = _blobs(n_classes=23, n_per=3, D=5)
    means = np.stack([X[y == c].mean(0) for c in range(23)])
    tree = build_tree(means, list(range(23)), seed=7)
    assert len(tree.nodes) == 22
    node_idx, go_right = tree.paths()
    leaves = set()
    for c in range(23):  # every class on exactly one root-to-leaf path
        path = [(v, r) for v, r in zip(node_idx[c], go_right[c], strict=True) if v >= 0]
        assert path[0][0] == 0
        for v, r in path:
            assert c in (tree.nodes[v].right if r else tree.nodes[v].left)
        leaves.add(tuple(path))
    assert len(leaves) == 23
    for node in tree.nodes:
        assert set(node.left) | set(node.right) == set(node.classes)
        assert not set(node.left) & set(node.right) and node.left and node.right
    again = build_tree(means, list(range(23)), seed=7)
    assert [n.classes for n in again.nodes] == [n.classes for n in tree.nodes]
    assert [n.right for n in again.nodes] == [n.right for n in tree.nodes]


def test_two_means_enumeration_is_the_kmeans_optimum():
    rng = np.random.default_rng(3)
    for _ in range(5):
        p = rng.normal(size=(7, 4))
        p /= np.linalg.norm(p, axis=1, keepdims=True)
        exact = two_means_split(p, exact_max=10)
        labels, _ = hard_kmeans(p, 2, n_init=50, seed=0)
        lloyd = labels == labels[0]
        # same partition up to the orientation of the clusters
        assert (exact == ~lloyd).all() or (exact == lloyd).all()


def _chain_tree(classes):
    """The stick-breaking tree (Linderman et al. 2015): node i splits {c_i} | {c_{i+1}, ...}."""
    nodes = [
        Node(tuple(classes[i:]), (classes[i],), tuple(classes[i + 1 :]), i, i - 1 if i else None)
        for i in range(len(classes) - 1)
    ]
    return Tree(tuple(classes), nodes)


def test_path_probabilities_sum_to_one_and_stick_breaking():
    tree = _chain_tree([0, 1, 2, 3])
    node_p = torch.rand(3, 11, dtype=torch.float64)
    probs = path_probabilities(tree, node_p)
    torch.testing.assert_close(probs.sum(1), torch.ones(11, dtype=torch.float64))
    # stick breaking (item 10): p(c_i) = (1 − p_i) Π_{j<i} p_j, last class Π_j p_j
    stick = torch.ones(11, dtype=torch.float64)
    for i in range(3):
        torch.testing.assert_close(probs[:, i], stick * (1 - node_p[i]))
        stick = stick * node_p[i]
    torch.testing.assert_close(probs[:, 3], stick)


# ------------------------------------------------------------------------ estimator (7–9)


def test_two_classes_equal_a_binary_pg_gp():
    X, y = _blobs(n_classes=2, n_per=6)
    model = GPTree(inference="gibbs", n_chains=4, n_sweeps=3, seed=5).fit(X, y)
    assert len(model.base_tree_.nodes) == 1
    Xs = torch.as_tensor(_blobs(n_classes=2, n_per=3, seed=9)[0])
    proba = model.predict_proba(Xs)
    node = model.base_groups_[0].state  # the node's data (rows sorted within class)
    eng = gpn.GibbsNodes(
        n_chains=4,
        outputscale=model.gibbs_outputscale,
        lengthscale=model.gibbs_lengthscale,
        generator=torch.Generator().manual_seed(5),
    )
    st = eng.fit(node.x, node.kappa + 0.5, node.mask, 3)
    assert sorted(node.x.shape) == [1, 6, 12] and int((node.kappa > 0).sum()) == 6
    torch.testing.assert_close(proba[:, 1], gpn.gibbs_predict(st, Xs)[0])


@pytest.mark.parametrize("inference", ["vi", "gibbs"])
def test_probabilities_rows_and_accuracy(inference):
    X, y = _blobs(n_classes=5, n_per=10)
    model = GPTree(inference=inference, n_chains=4, n_sweeps=4, vi_iter=5, n_inducing=3)
    model.fit(X, y)
    Xt, yt = _blobs(n_classes=5, n_per=4, seed=0)
    proba = model.predict_proba(Xt)
    assert proba.shape == (20, 5)
    torch.testing.assert_close(proba.sum(1), torch.ones(20, dtype=proba.dtype), atol=1e-6, rtol=0)
    assert ((proba > 0) & (proba < 1)).all()
    assert (model.predict(Xt).numpy() == yt).mean() >= 0.8
    if inference == "vi":
        trace = model.elbo_trace_
        assert trace.shape == (6,) and trace[-1] > trace[0]


def test_relabelling_permutes_columns():
    """Item 9: VI mode is deterministic, so relabelling permutes the columns exactly."""
    X, y = _blobs(n_classes=5, n_per=6, seed=2)
    perm = np.array([3, 0, 4, 1, 2])
    kw = dict(inference="vi", vi_iter=3, n_inducing=2, learn_inducing=False)
    a = GPTree(**kw).fit(X, y)
    b = GPTree(**kw).fit(X, perm[y])
    Xt = _blobs(n_classes=5, n_per=2, seed=8)[0]
    pa, pb = a.predict_proba(Xt), b.predict_proba(Xt)
    torch.testing.assert_close(pb[:, perm], pa, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------- stages (11)


def test_stages_freeze_base_and_ignore_row_order():
    X, y = _blobs(n_classes=7, n_per=6, seed=4)
    base = y < 4
    model = GPTree(inference="vi", vi_iter=2, n_inducing=2, n_chains=3, n_sweeps=2)
    model.fit(X[base], y[base])
    before = [
        [t.clone() for t in (g.state.eta, g.state.prec, g.state.c)] for g in model.base_groups_
    ]
    inducing = model.inducing_.clone()
    stage = ~base
    model.partial_fit(X[stage][:10], y[stage][:10])  # classes 4, 5
    model.partial_fit(X[stage][12:], y[stage][12:])  # class 6
    for g, old in zip(model.base_groups_, before, strict=True):
        for new_t, old_t in zip((g.state.eta, g.state.prec, g.state.c), old, strict=True):
            assert torch.equal(new_t, old_t)
    assert torch.equal(model.inducing_, inducing)
    assert model.classes_ == [0, 1, 2, 3, 4, 5, 6]
    root = model.root_.state
    assert int(root.mask.sum()) == 4 * 2 + 3 * 2  # C_base·m_c + stored novel exemplars
    assert int((root.kappa > 0).sum()) == 3 * 2
    proba = model.predict_proba(X)
    torch.testing.assert_close(proba.sum(1), torch.ones(len(X), dtype=proba.dtype))
    # the same stage with shuffled rows gives the same model
    m1 = GPTree(inference="gibbs", n_inducing=2, n_chains=3, n_sweeps=2).fit(X[base], y[base])
    m2 = GPTree(inference="gibbs", n_inducing=2, n_chains=3, n_sweeps=2).fit(X[base], y[base])
    order = np.random.default_rng(0).permutation(stage.sum())
    m1.partial_fit(X[stage], y[stage])
    m2.partial_fit(X[stage][order], y[stage][order])
    torch.testing.assert_close(m1.predict_proba(X), m2.predict_proba(X))


def test_bad_input():
    X, y = _blobs(n_classes=4, n_per=5)
    model = GPTree(inference="gibbs", n_chains=2, n_sweeps=1, n_inducing=2)
    with pytest.raises(ValueError, match="before partial_fit"):
        model.partial_fit(X, y)
    with pytest.raises(ValueError, match="NaN"):
        model.fit(np.where(y[:, None] == 0, np.nan, X), y)
    with pytest.raises(ValueError, match="at least 2 classes"):
        model.fit(X[y == 0], y[y == 0])
    model.fit(X[y < 2], y[y < 2])
    with pytest.raises(ValueError, match="already seen"):
        model.partial_fit(X[y < 3], y[y < 3])
    with pytest.raises(ValueError, match="features"):
        model.partial_fit(X[y == 2][:, :3], y[y == 2])
    with pytest.raises(ValueError, match="no samples"):
        model.partial_fit(X[y == 2], y[y == 2], classes=[2, 3])
    with pytest.raises(ValueError, match="NaN"):
        model.predict_proba(X * np.nan)
    with pytest.raises(ValueError, match="inference"):
        GPTree(inference="ep").fit(X, y)


# ---------------------------------------------------------------------- Pyro model, ArviZ


def _tree_nodes_of_builtin_classes(n_classes=5, n_per=8):
    """All internal nodes of a GPTree's base tree (its defaults: m_c = 5 k-means exemplars,
    outputscale 128, lengthscale 1, float64) on built-in Omniglot classes, as one batch."""
    feats, labels = load_dataset("omniglot").base()
    keep = torch.isin(labels, torch.unique(labels)[:n_classes])
    X, y = feats[keep], labels[keep]
    first = torch.cat([torch.nonzero(y == c)[:n_per, 0] for c in torch.unique(y)])
    X, y = X[first].double(), y[first]
    model = GPTree(inference="vi", vi_iter=0).fit(X, y)
    by_class = model._by_class(X, y)
    ids = list(range(len(model.base_tree_.nodes)))
    x, yv, mask = node_batch(model.base_tree_, ids, by_class)
    idx, zmask = inducing_slots(model.base_tree_, ids, model.base_classes_, 5, x.device)
    z = model.inducing_.reshape(-1, X.shape[1])[idx]
    V = len(ids)
    s = torch.full((V,), model.vi_outputscale, dtype=x.dtype)
    ls = torch.full((V,), model.vi_lengthscale, dtype=x.dtype)
    return model, (x, yv, mask, z, zmask, s, ls)


@pytest.mark.slow
def test_tree_model_and_vi_engine_conform_in_production_configuration():
    """The tree-level Pyro model (every internal node a row) with VINodes in GPTree's default
    configuration: check_engine (monotone ELBO, batch = one node at a time, float32 ≈
    float64, device follows the data, one documented host sync per step, and Pyro's
    Trace_ELBO of (gp_tree_model, VINodes.guide) = the analytic ELBO, with q(ω) scored by
    the tilted Pólya-Gamma density)."""
    model, data = _tree_nodes_of_builtin_classes()
    assert data[0].shape[0] == 4 and not data[2].all()  # 4 nodes, padded to the root's size
    case = ConformanceCase(
        make_engine=lambda: gpn.VINodes(natural_lr=model.natural_lr, code_elbo=model.code_elbo),
        model=gp_tree_model,
        data=data,
        n_steps=6,
        particles=1000,
        repeats=10,  # the standard error is estimated from the repeats: 4 is too few
        step_syncs=1,
        rtol_float32=1e-4,  # measured: 2e-6 relative
    )
    check_engine(case)


def test_arviz_export_and_rhat_warning():
    X, y = _blobs(n_classes=3, n_per=5, D=4)
    model = GPTree(inference="gibbs", n_chains=4, n_sweeps=6, record=True, n_inducing=2)
    model.fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dt = model.to_datatree(X[:4])
    post = dt.posterior.to_dataset()
    # 6 sweeps: the starting state is dropped by default, so 6 draws remain
    assert post["class_prob"].shape == (4, 6, 4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        shorter = model.to_datatree(X[:4], burn_in=3)
    assert shorter.posterior["class_prob"].shape == (4, 4, 4, 3)
    with pytest.raises(ValueError, match="burn_in"):
        model.to_datatree(X[:4], burn_in=7)
    assert {"f_base0", "f_base1"} <= set(post.data_vars)
    np.testing.assert_allclose(post["class_prob"].values.sum(-1), 1.0, atol=1e-6)
    rhat, ess = model.diagnostics(dt)
    assert np.isfinite(rhat["f_base0"].values).all() and (rhat["f_base0"].values > 0.9).all()
    assert (ess["class_prob"].values > 0).all()
    # chains stuck at different values → R-hat ≫ 1.01 → warning
    from probfsl.diagnostics.arviz import to_datatree

    stuck = to_datatree({"a": np.arange(4)[:, None] + 0.01 * np.random.rand(4, 50)})
    with pytest.warns(RuntimeWarning, match="R-hat"):
        model._warn_rhat(stuck, 1.01)
    with pytest.raises(ValueError, match="record=True"):
        GPTree(inference="gibbs", n_chains=2, n_sweeps=1, n_inducing=2).fit(X, y).to_datatree(X)


# ------------------------------------------------------------------------ few-shot tasks


def test_few_shot_path_on_builtin_omniglot():
    fs = load_dataset("omniglot")
    eps = sample_episodes(fs, n_tasks=12, way=5, shot=5, n_query=15, seed=0)
    clf = GPTreeFewShot(n_chains=6, n_sweeps=4, max_nodes=20).fit_base(*fs.base())
    proba = clf.predict_proba(eps)
    assert proba.shape == (12, 15, 5) and proba.dtype == eps.support.dtype
    torch.testing.assert_close(proba.sum(-1), torch.ones(12, 15), atol=1e-5, rtol=0)
    acc = (proba.argmax(-1) == eps.query_labels).double().mean().item()
    assert acc > 0.6
    with pytest.raises(ValueError, match="fit_base"):
        GPTreeFewShot().predict_proba(eps)
