"""GP-Tree robustness to bad input and device correctness.

Tree building terminates on degenerate means; a task's probabilities do not depend on
its batch; ``center=False`` is honoured; degenerate but valid tasks give proper
probabilities; bad input is refused before any computation; no tensor is created on the
default device instead of the data's.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import probfsl
from probfsl.data.builtin import load_dataset
from probfsl.data.tasks import Episodes, sample_episodes
from probfsl.inference import gp_tree_nodes as gpn
from probfsl.inference.polya_gamma import CounterRNG, pg_mean, pg_var, sample_pg_torch
from probfsl.models.gp_tree import GPTree, GPTreeFewShot, build_tree, two_means_split
from probfsl.testing import audit_devices
from tests.synthetic import episodes_from_tensors

warnings.filterwarnings("ignore", message=".*torch.jit.*")

D64 = torch.float64


def _blobs(n_classes=4, n_per=5, D=6, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_classes, D)) * 2.5
    X = np.concatenate([c + rng.normal(size=(n_per, D)) for c in centres]) * scale
    return X, np.repeat(np.arange(n_classes), n_per)


def _check_tree(tree, C):
    assert len(tree.nodes) == C - 1
    for node in tree.nodes:
        assert node.left and node.right
        assert set(node.left) | set(node.right) == set(node.classes)
    node_idx, _ = tree.paths()
    assert (node_idx[:, 0] == 0).all()  # every class is below the root


# ------------------------------------------------------------------- 1. tree terminates


@pytest.mark.parametrize(
    "case",
    ["identical", "identical-many", "D=1", "D=1-signs", "duplicates", "two", "many", "zero"],
)
def test_build_tree_terminates_on_degenerate_means(case):
    rng = np.random.default_rng(0)
    means = {
        "identical": np.ones((11, 4)),
        "identical-many": np.full((40, 3), 0.5),
        "D=1": np.abs(rng.normal(size=(15, 1))) + 0.1,  # all normalise to +1
        "D=1-signs": rng.normal(size=(15, 1)),  # ±1 only
        "duplicates": np.repeat(rng.normal(size=(4, 5)), 4, axis=0),  # 16 classes, 4 values
        "two": np.ones((2, 3)),
        "many": rng.normal(size=(60, 8)),
        "zero": np.zeros((12, 4)),
    }[case]
    C = len(means)
    tree = build_tree(means, list(range(C)))
    _check_tree(tree, C)


def test_two_means_split_never_leaves_a_side_empty():
    same = np.tile([[0.6, 0.8]], (13, 1))
    right = two_means_split(same)
    assert right.tolist() == [False] * 6 + [True] * 7  # by index, first half left
    with pytest.raises(ValueError, match="class_means"):
        build_tree(np.ones((3, 2)), [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        build_tree(np.full((3, 2), np.nan), [0, 1, 2])


def test_eleven_way_task_with_identical_support_points():
    """The reported hang: an 11-way task whose support points are all the same."""
    support = torch.ones(2, 22, 4, dtype=D64)
    labels = torch.arange(11).repeat(2).expand(2, 22).clone()
    query = torch.randn(2, 5, 4, dtype=D64, generator=torch.Generator().manual_seed(0))
    clf = GPTreeFewShot(n_chains=2, n_sweeps=2, center=False)
    proba = clf.predict_proba(episodes_from_tensors(support, labels, query))
    assert proba.shape == (2, 5, 11) and torch.isfinite(proba).all()
    torch.testing.assert_close(proba.sum(-1), torch.ones(2, 5, dtype=D64))


# -------------------------------------------------------------- 2. batch composition


@pytest.fixture(scope="module")
def omniglot():
    fs = load_dataset("omniglot")
    return fs, sample_episodes(fs, n_tasks=40, way=5, shot=2, n_query=10, seed=3)


def test_few_shot_results_do_not_depend_on_the_batch(omniglot):
    fs, eps = omniglot
    clf = GPTreeFewShot(n_chains=4, n_sweeps=3, seed=11).fit_base(*fs.base())
    full = clf.predict_proba(eps)
    for a, b in [(0, 10), (10, 20), (33, 40)]:  # alone = inside the 40-task batch
        assert torch.equal(clf.predict_proba(eps[a:b]), full[a:b])
    # reversed task order and tiny sampler batches (max_nodes) change nothing either
    rev = torch.arange(39, -1, -1)
    rev_eps = Episodes(**{k: v[rev] for k, v in vars(eps).items()})
    assert torch.equal(clf.predict_proba(rev_eps), full[rev])
    small = GPTreeFewShot(n_chains=4, n_sweeps=3, seed=11, max_nodes=3).fit_base(*fs.base())
    assert torch.equal(small.predict_proba(eps), full)
    # the seed matters
    other = GPTreeFewShot(n_chains=4, n_sweeps=3, seed=12).fit_base(*fs.base())
    assert not torch.equal(other.predict_proba(eps[:5]), full[:5])


def test_keyed_gibbs_nodes_are_independent_of_their_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 4, dtype=D64, generator=g)
    y = (torch.rand(3, 6, generator=g, dtype=D64) > 0.5).to(D64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    keys = torch.tensor([5, 17, 99])
    eng = gpn.GibbsNodes(n_chains=3)
    batch = eng.fit(x, y, mask, 4, keys=keys)
    for v in range(3):
        one = eng.fit(x[v : v + 1], y[v : v + 1], mask[v : v + 1], 4, keys=keys[v : v + 1])
        torch.testing.assert_close(one.omega[0], batch.omega[v], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(one.f[0], batch.f[v], rtol=1e-12, atol=1e-12)


def test_keyed_gibbs_reproduces_the_exact_posterior_predictive():
    """With per-node counter streams the sampler still targets p(f | y): 2-point toy
    against a grid-quadrature posterior (as the generator-driven test does)."""
    x = torch.tensor([[[1.0, 0.2], [0.3, 1.0]]], dtype=D64).expand(2, 2, 2)
    y = torch.tensor([[1.0, 0.0]], dtype=D64).expand(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    xs = torch.tensor([[0.8, 0.6]], dtype=D64)
    eng = gpn.GibbsNodes(n_chains=2000, outputscale=4.0)
    st = eng.fit(x, y, mask, n_sweeps=15, keys=torch.tensor([1, 2]))
    p = gpn.gibbs_predict(st, xs)[:, 0]
    K = st.K[0]
    grid = torch.linspace(-10, 10, 401, dtype=D64)
    f = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)
    logpost = torch.distributions.MultivariateNormal(torch.zeros(2, dtype=D64), K).log_prob(f)
    logpost = logpost + torch.nn.functional.logsigmoid(f[:, 0])
    logpost = logpost + torch.nn.functional.logsigmoid(-f[:, 1])
    wts = torch.softmax(logpost, 0)
    xn, xsn = gpn.normalize(x[0]), gpn.normalize(xs)
    one = torch.ones(1, dtype=D64)
    ks = gpn.rbf_kernel(xn[None], xsn[None], 4 * one, one)[0, :, 0]
    a = torch.linalg.solve(K, ks)
    ref = (wts * gpn.gauss_hermite_sigmoid(f @ a, (4.0 - ks @ a).expand(len(f)))).sum()
    assert (p - ref).abs().max() < 0.01
    assert p[0] != p[1]  # two keys, two independent sets of chains


def test_counter_rng_streams_and_moments():
    with pytest.raises(TypeError, match="keys"):
        CounterRNG([1, 2])
    with pytest.raises(ValueError, match="keys"):
        CounterRNG(torch.ones(2, 2, dtype=torch.long))
    rng = CounterRNG(torch.tensor([1, 2, 3]))
    alone = CounterRNG(torch.tensor([2]))
    for dtype in (torch.float32, D64):
        u = rng.uniform((3, 1000), dtype)
        assert u.dtype == dtype and torch.equal(u[1:2], alone.uniform((1, 1000), dtype))
        assert ((u > 0) & (u < 1)).all()
    n = 200_000
    big = CounterRNG(torch.tensor([7]))
    u = big.uniform((1, n), D64)
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    z = big.normal((1, n), D64)
    assert abs(z.mean().item()) < 5 / math.sqrt(n) and abs(z.var().item() - 1) < 0.02
    for a in (0.4, 1.0, 3.0, 60.0):  # Gamma(a): mean a, variance a
        draws = big.standard_gamma(torch.full((1, n), a, dtype=D64))
        assert (draws > 0).all()
        assert abs(draws.mean().item() - a) < 5 * math.sqrt(a / n)
        assert abs(draws.var().item() - a) < 0.04 * a


@pytest.mark.parametrize("c", [0.0, 1.5, 8.0])
def test_pg_draws_from_counter_streams_have_the_pg_moments(c):
    n = 100_000
    ct = torch.full((1, n), c, dtype=D64)
    w = sample_pg_torch(ct, generator=CounterRNG(torch.tensor([3])))
    mean, var = pg_mean(ct[0, :1]).item(), pg_var(ct[0, :1]).item()
    assert (w > 0).all()
    assert abs(w.mean().item() - mean) < 5 * math.sqrt(var / n)
    assert abs(w.var().item() - var) < 0.04 * var


# ---------------------------------------------------------------------- 3. center=False


def test_center_false_is_honoured(omniglot):
    fs, eps = omniglot
    eps = eps[:6]
    plain = GPTreeFewShot(n_chains=3, n_sweeps=2, center=False)
    assert not plain.needs_base
    p_plain = plain.predict_proba(eps)  # no fit_base needed
    feats, labels = fs.base()
    zero_mean = GPTreeFewShot(n_chains=3, n_sweeps=2, center=True).fit_base(feats, labels)
    zero_mean.base_mean_ = torch.zeros_like(zero_mean.base_mean_)  # centring = identity
    assert torch.equal(zero_mean.predict_proba(eps), p_plain)
    # (the built-in features are PCA scores, centred already: shift the base to see it)
    centred = GPTreeFewShot(n_chains=3, n_sweeps=2, center=True).fit_base(feats + 1.0, labels)
    assert not torch.allclose(centred.predict_proba(eps), p_plain)
    with pytest.raises(ValueError, match="fit_base"):
        GPTreeFewShot(center=True).predict_proba(eps)


# ------------------------------------------------------------------ 4. degenerate tasks


def _degenerate_support(case: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    T, K, shot, D = 3, 5, 2, 6
    labels = torch.arange(K).repeat(shot).expand(T, K * shot).clone()
    support = torch.randn(T, K * shot, D, generator=g, dtype=D64)
    query = torch.randn(T, 7, D, generator=g, dtype=D64)
    if case == "identical":
        support = torch.ones_like(support)
    elif case == "D=1":
        support, query = support[..., :1], query[..., :1]
    elif case == "huge":
        support, query = support * 1e6, query * 1e6
    elif case == "tiny":
        support, query = support * 1e-6, query * 1e-6
    elif case == "1-shot":
        labels, support = labels[:, :K], support[:, :K]
    return support.to(dtype), labels, query.to(dtype)


CASES = ["identical", "D=1", "huge", "tiny", "1-shot"]


@pytest.mark.parametrize("dtype", [torch.float32, D64])
@pytest.mark.parametrize("case", CASES)
def test_few_shot_degenerate_tasks_give_probabilities(case, dtype):
    support, labels, query = _degenerate_support(case, dtype)
    clf = GPTreeFewShot(n_chains=3, n_sweeps=3, center=False)
    proba = clf.predict_proba(episodes_from_tensors(support, labels, query))
    assert proba.dtype == dtype and torch.isfinite(proba).all()
    assert ((proba >= 0) & (proba <= 1)).all()
    torch.testing.assert_close(proba.sum(-1), torch.ones(proba.shape[:2], dtype=dtype))


@pytest.mark.parametrize("inference", ["gibbs", "vi"])
@pytest.mark.parametrize("case", CASES)
def test_gp_tree_degenerate_data_give_probabilities(case, inference):
    support, labels, query = _degenerate_support(case, D64)
    X, y, Xq = support[0].numpy(), labels[0].numpy(), query[0].numpy()
    model = GPTree(inference=inference, n_chains=3, n_sweeps=3, vi_iter=2, n_inducing=2)
    proba = model.fit(X, y).predict_proba(Xq)
    assert torch.isfinite(proba).all() and proba.shape == (7, 5)
    torch.testing.assert_close(proba.sum(-1), torch.ones(7, dtype=proba.dtype))
    if inference == "vi":
        assert np.isfinite(model.elbo_trace_).all()
    # a novel stage on the same kind of data
    Xn = np.concatenate([X[:2], X[:2]]) * 0.5 + 0.1 if case != "identical" else X[:4]
    model.partial_fit(Xn, np.array([5, 5, 6, 6]))
    proba = model.predict_proba(Xq)
    assert torch.isfinite(proba).all() and proba.shape == (7, 7)
    torch.testing.assert_close(proba.sum(-1), torch.ones(7, dtype=proba.dtype))


def test_dtypes_of_the_results():
    X, y = _blobs()
    model = GPTree(inference="gibbs", n_chains=2, n_sweeps=2, n_inducing=2).fit(X, y)
    assert model.inducing_.dtype == D64  # computes in float64 by default (documented)
    p32 = model.predict_proba(X.astype(np.float32))
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32, model.predict_proba(X).float())
    own = GPTree(inference="gibbs", n_chains=2, n_sweeps=2, n_inducing=2, dtype=None)
    own.fit(X.astype(np.float32), y)
    assert own.inducing_.dtype == torch.float32
    assert own.predict_proba(X.astype(np.float32)).dtype == torch.float32


# ------------------------------------------------------------------------ 5. bad input


def test_gp_tree_rejects_bad_data():
    X, y = _blobs()
    model = GPTree(inference="gibbs", n_chains=2, n_sweeps=1, n_inducing=2)
    bad = [
        ((X.tolist(), y), TypeError, "X"),
        ((X.astype(np.int64), y), TypeError, "X"),
        ((X[0], y), ValueError, "X"),
        ((X[:0], y[:0]), ValueError, "X"),
        ((np.where(X > 2, np.inf, X), y), ValueError, "X"),
        ((X, y[:-1]), ValueError, "y"),
        ((X, y + 0.5), ValueError, "y"),
        ((X, -y), ValueError, "y"),
        ((X, y.astype(str)), TypeError, "y"),
        ((X, np.stack([y, y], 1)), ValueError, "y"),
    ]
    for args, err, name in bad:
        with pytest.raises(err, match=name):
            model.fit(*args)
    assert not hasattr(model, "stage_")  # nothing was fitted
    model.fit(torch.as_tensor(X), torch.as_tensor(y))
    with pytest.raises(ValueError, match="features"):
        model.predict_proba(X[:, :3])
    with pytest.raises(TypeError, match="X"):
        model.predict(X.tolist())
    with pytest.raises(ValueError, match="X"):
        model.predict(X * np.nan)
    with pytest.raises(ValueError, match="features"):
        model.partial_fit(X[:4, :2], np.array([7, 7, 8, 8]))
    with pytest.raises(ValueError, match="y"):
        model.partial_fit(X[:4], np.array([7, 7, -8, 8]))
    with pytest.raises(TypeError, match="classes"):
        model.partial_fit(X[:4], np.array([7, 7, 8, 8]), classes=7)
    with pytest.raises(ValueError, match="not fitted"):
        GPTree().predict_proba(X)


@pytest.mark.parametrize(
    ("kwargs", "err", "name"),
    [
        (dict(n_chains=0), ValueError, "n_chains"),
        (dict(n_chains=2.5), ValueError, "n_chains"),
        (dict(n_sweeps=-1), ValueError, "n_sweeps"),
        (dict(gibbs_outputscale=0.0), ValueError, "gibbs_outputscale"),
        (dict(gibbs_lengthscale=float("nan")), ValueError, "gibbs_lengthscale"),
        (dict(vi_outputscale="big"), TypeError, "vi_outputscale"),
        (dict(vi_lengthscale=1e-2), ValueError, "vi_lengthscale"),
        (dict(n_inducing=0), ValueError, "n_inducing"),
        (dict(vi_iter=-2), ValueError, "vi_iter"),
        (dict(vi_lr=-0.1), ValueError, "vi_lr"),
        (dict(natural_lr=1.5), ValueError, "natural_lr"),
        (dict(pg_sampler="devroye"), ValueError, "pg_sampler"),
        (dict(kmeans_n_init=0), ValueError, "kmeans_n_init"),
        (dict(seed=None), TypeError, "seed"),
        (dict(dtype=torch.int64), TypeError, "dtype"),
        (dict(record="yes"), TypeError, "record"),
        (dict(inference="ep"), ValueError, "inference"),
    ],
)
def test_gp_tree_rejects_bad_hyperparameters(kwargs, err, name):
    model = GPTree(**kwargs)  # __init__ only stores (scikit-learn's convention)
    assert model.get_params()[name] is kwargs[name]
    with pytest.raises(err, match=name):
        model.check_params()
    X, y = torch.randn(12, 3), torch.arange(12) % 3
    with pytest.raises(err, match=name):
        model.fit(X, y)
    assert not hasattr(model, "stage_")


@pytest.mark.parametrize(
    ("kwargs", "err", "name"),
    [
        (dict(n_chains=0), ValueError, "n_chains"),
        (dict(n_sweeps="1"), TypeError, "n_sweeps"),
        (dict(outputscale=-8.0), ValueError, "outputscale"),
        (dict(lengthscale=float("inf")), ValueError, "lengthscale"),
        (dict(center="no"), TypeError, "center"),
        (dict(pg_sampler="fast"), ValueError, "pg_sampler"),
        (dict(max_nodes=0), ValueError, "max_nodes"),
        (dict(seed=1.5), ValueError, "seed"),
        (dict(seed=-1), ValueError, "seed"),
    ],
)
def test_few_shot_rejects_bad_hyperparameters(kwargs, err, name, omniglot):
    clf = GPTreeFewShot(**kwargs)
    with pytest.raises(err, match=name):
        clf.check_params()
    fs, eps = omniglot
    with pytest.raises(err, match=name):
        clf.fit_base(*fs.base())
    with pytest.raises(err, match=name):
        clf.predict_proba(eps[:2])


def test_few_shot_rejects_bad_data(omniglot):
    fs, eps = omniglot
    feats, labels = fs.base()
    clf = GPTreeFewShot(n_chains=2, n_sweeps=1)
    with pytest.raises(ValueError, match="NaN"):
        clf.fit_base(feats * np.nan, labels)
    with pytest.raises(TypeError):
        clf.fit_base(feats.tolist(), labels)
    clf.fit_base(feats.numpy(), labels.numpy())  # NumPy input is fine
    assert isinstance(clf.base_mean_, torch.Tensor)
    eps = eps[:3]
    with pytest.raises(TypeError, match="episodes"):
        clf.predict_proba(eps.support)
    with pytest.raises(ValueError, match="width"):
        clf.predict_proba(
            episodes_from_tensors(eps.support[..., :5], eps.support_labels, eps.query[..., :5])
        )
    with pytest.raises(ValueError, match="support_labels"):
        clf.predict_proba(
            Episodes(**{**vars(eps), "support_labels": eps.support_labels.clone().fill_(9)})
        )
    with pytest.raises(ValueError, match="NaN"):
        clf.predict_proba(Episodes(**{**vars(eps), "query": eps.query * np.nan}))


# -------------------------------------------------------------- 6. device correctness


class _FactoryAudit(TorchFunctionMode):
    """Records every tensor factory called from probfsl's code without ``device=``.

    For the VI fit, which cannot run under :func:`probfsl.testing.audit_devices` (its
    ``torch.optim.Adam`` keeps its step counters as CPU scalars on the default device, by
    design): a factory without ``device=`` would put its tensor on the default device
    rather than the data's (on a GPU: the "Expected all tensors to be on the same device"
    crash seen on a GPU).
    """

    FACTORIES = {
        torch.tensor,
        torch.as_tensor,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.empty,
        torch.eye,
        torch.arange,
        torch.linspace,
        torch.randn,
        torch.rand,
        torch.randint,
    }
    PKG = os.path.dirname(probfsl.__file__)
    #: torch's own files (not gpytorch's, even where torch lives in a folder named torch)
    TORCH = os.path.dirname(torch.__file__) + os.sep

    def __init__(self):
        super().__init__()
        self.no_device: list[str] = []

    def _caller(self) -> str | None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(self.TORCH):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.PKG):
            return None
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and "device" not in kwargs:
            where = self._caller()
            if where is not None:
                self.no_device.append(f"{where} {func.__name__}")
        return func(*args, **kwargs)


def _audit_factories(fn):
    audit = _FactoryAudit()
    with audit:
        out = fn()
    assert not audit.no_device, f"factories without device=: {sorted(set(audit.no_device))}"
    return out


def test_few_shot_creates_every_tensor_on_the_data_device(omniglot):
    fs, eps = omniglot
    eps = eps[:4]
    clf = GPTreeFewShot(n_chains=2, n_sweeps=2).fit_base(*fs.base())
    proba = audit_devices(lambda: clf.predict_proba(eps))
    assert proba.device.type == "cpu" and torch.isfinite(proba).all()
    plain = GPTreeFewShot(n_chains=2, n_sweeps=2, center=False)
    assert audit_devices(lambda: plain.predict_proba(eps)).device.type == "cpu"


@pytest.mark.parametrize("inference", ["gibbs", "vi"])
def test_gp_tree_creates_every_tensor_on_the_data_device(inference):
    X, y = _blobs(n_classes=4, n_per=4)
    X, y = torch.as_tensor(X), torch.as_tensor(y)
    model = GPTree(inference=inference, n_chains=2, n_sweeps=2, vi_iter=2, n_inducing=2)
    if inference == "gibbs":
        audit_devices(lambda: model.fit(X, y))
    else:  # Adam's CPU step counters: audited for factories without device= only
        _audit_factories(lambda: model.fit(X, y))
    Xn, yn = X[:4] + 0.3, torch.tensor([7, 7, 8, 8])
    audit_devices(lambda: model.partial_fit(Xn, yn))
    proba = audit_devices(lambda: model.predict_proba(X))
    assert proba.device.type == "cpu" and torch.isfinite(proba).all()
    audit_devices(lambda: model.predict(X))


def test_few_shot_node_batches_change_neither_results_nor_host_syncs(omniglot):
    """``max_nodes`` batches the nodes for memory: the probabilities do not depend on it,
    and the host synchronisations per call stay the same however many batches there are
    (the factorisations are checked once, after the loop)."""
    from probfsl.host_syncs import HostSyncCounter

    fs, eps = omniglot
    one = GPTreeFewShot(n_chains=2, n_sweeps=2).fit_base(*fs.base())
    many = GPTreeFewShot(n_chains=2, n_sweeps=2, max_nodes=3).fit_base(*fs.base())
    torch.testing.assert_close(many.predict_proba(eps[:6]), one.predict_proba(eps[:6]))
    counts = []
    for n_tasks in (2, 6):
        with HostSyncCounter() as counter:
            many.predict_proba(eps[:n_tasks])
        counts.append(counter.total)
    assert counts[0] == counts[1] <= 50, counts


def test_gp_tree_clone_and_set_params():
    from sklearn.base import clone

    model = GPTree(n_chains=3, vi_iter=1)
    assert clone(model).get_params() == model.get_params()
    with pytest.raises(ValueError, match="n_sweeps"):
        model.set_params(n_sweeps=0)
    assert model.n_sweeps == 10 and model.set_params(n_sweeps=2).n_sweeps == 2
