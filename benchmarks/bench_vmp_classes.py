"""VMP against BayesPy, one row per model class of the parity catalogue.

    python benchmarks/bench_vmp_classes.py [--quick] [--rounds 3] [--threads 1]

Every row declares one model twice, in Pyro for probfsl's VMP and in BayesPy's nodes,
reusing the twins of the parity tests (``tests/test_vmp_bayespy.py``,
``tests/test_vmp_hmm_categorical.py``, ``tests/test_vmp_multinomial.py``) and the Gaussian
mixture of ``bench_vmp.py bayespy``, with twins of their own for LDA, Bayesian PCA with
ARD and GP regression. Both sides get the same data, the same start (the same
responsibilities where the model has a latent label; Bayesian PCA's W from the same
drawn mean, as its zero start is a saddle; the priors' moments otherwise) and the same
update schedule, and run to a relative change of the bound of 1e-10 (at most
2,000 sweeps). probfsl fits all T tasks at once, a fresh ``VMP`` per round so that its time
includes deriving the plan; BayesPy fits one model per task, on the first B tasks.
Reported per row: the sweeps (probfsl's slowest task), the seconds of each side, the
ratio of the throughputs, (T / probfsl s) / (B / BayesPy s), i.e. BayesPy's time per task
over probfsl's, and the largest relative difference of the converged bounds on the B
shared tasks. Rounds alternate the two sides; the best wall-clock time of each is kept.

Results go to ``benchmarks/results/vmp_classes.md`` and ``vmp_classes.json``
(``--quick``: 100 tasks, 10 in BayesPy, one round; the table is printed and no file
written). BayesPy is a benchmark-only dependency (``pip install bayespy``, the ``bench``
extra).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

# bench_vmp pins every BLAS to --threads before NumPy and PyTorch start
import bench_vmp  # noqa: E402
import numpy as np  # noqa: E402
import pyro  # noqa: E402
import pyro.distributions as dist  # noqa: E402
import torch  # noqa: E402
from pyro.ops.indexing import Vindex  # noqa: E402

from probfsl.inference import VMP  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
F64 = torch.float64
TOL, MAX_ITER = 1e-10, 2000


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _softmax_start(t, n, k, seed=6):
    return torch.softmax(torch.randn(t, n, k, generator=_g(seed), dtype=F64), -1)


@dataclass
class Row:
    """One model class: ``data(T)`` gives the tensors, ``ours(data)`` fits them all at once
    (returns the bounds [T] and the sweeps [T]; ``ours(data, plan_only=True)`` derives the
    plan alone), ``theirs(data, t)`` fits task ``t`` in BayesPy and returns its bound."""

    name: str
    sizes: str
    data: Callable
    ours: Callable
    theirs: Callable


def _vmp(model, data, call=None, plan_only=False, **options):
    """Fit ``data`` with a fresh engine (its plan derived in the call); with ``plan_only``,
    derive the plan alone."""
    args, kwargs = call(data) if call else (data, {})
    engine = VMP(model, tol=TOL, max_iter=MAX_ITER, **options)
    if plan_only:
        return engine.compile(
            *args, **{k: v for k, v in kwargs.items() if k not in ("init_resp", "init")}
        )
    state, info = engine.fit(*args, **kwargs)
    return state.objective, info.n_steps


def _vb(nodes, *schedules):
    """BayesPy's bound: each schedule in ``schedules[:-1]`` once, the last to convergence."""
    from bayespy.inference import VB

    q = VB(*nodes)
    for schedule in schedules[:-1]:
        q.update(*schedule, repeat=1, verbose=False)
    q.update(*schedules[-1], repeat=MAX_ITER, tol=TOL, verbose=False)
    return q.compute_lowerbound()


# --------------------------------------------------------------- Gaussian mixture
def gmm_bayespy(d, t, way=5):
    """``bench_vmp.bayespy_fit``'s model, with its first M step in the order probfsl's
    ``init`` reads the responsibilities (the model's declaration order: π, μ, τ; the
    other way round about a fifth of the tasks reach another fixed point)."""
    import bayespy.nodes as bn

    x, resp = d[0][t].numpy(), d[1][t].numpy()
    n, dim = x.shape
    pi = bn.Dirichlet(np.ones(way))
    z = bn.Categorical(pi, plates=(n,))
    mu = bn.GaussianARD(0, 1.0, shape=(dim,), plates=(way,))
    tau = bn.Gamma(2.0, 0.05, plates=(way, dim))
    obs = bn.Mixture(z, bn.GaussianARD, mu, tau, 1)
    obs.observe(x)
    z.initialize_from_parameters(resp)
    return _vb([obs, pi, mu, tau, z], [pi, mu, tau], [pi, tau, mu, z])


def gmm_row() -> Row:
    return Row(
        "Gaussian mixture (Dirichlet, Normal means, Gamma diagonal precisions)",
        "Omniglot 5-way 1-shot: 80 points, 16 dims, 5 classes",
        bench_vmp.mixture_data,
        lambda d, **kw: _vmp(
            partial(bench_vmp.ard_mixture_model, way=5),
            d,
            lambda d: ((d[0],), {"init_resp": {"z": d[1]}}),
            order=["pi", "tau", "mu", "z"],
            **kw,
        ),
        gmm_bayespy,
    )


# --------------------------------------------------------------- linear regression
def regression_data(t, n=25, p=3):
    x = torch.randn(t, n, p, generator=_g(0), dtype=F64)
    w = torch.randn(t, 1, p, generator=_g(1), dtype=F64)
    return (x * w).sum(-1) + 0.4 * torch.randn(t, n, generator=_g(2), dtype=F64), x


def regression_bayespy(d, t):
    import bayespy.nodes as bn

    y, x = d
    alpha, beta = bn.Gamma(1.0, 1.0), bn.Gamma(1.0, 0.1)
    wn = bn.GaussianARD(0, alpha, shape=(x.shape[-1],))
    yn = bn.GaussianARD(bn.SumMultiply("i,i", x[t].numpy(), wn), beta)
    yn.observe(y[t].numpy())
    return _vb([yn, wn, alpha, beta], [yn, wn, alpha, beta])


def regression_row() -> Row:
    from tests.test_vmp_linear import regression_with_hyperpriors

    return Row(
        "Bayesian linear regression (Gamma hyperpriors on weights and noise)",
        "25 points, 3 inputs",
        regression_data,
        lambda d, **kw: _vmp(regression_with_hyperpriors, d, **kw),
        regression_bayespy,
    )


# --------------------------------------------------------------- Gaussian Markov chain
def chain_bayespy(d, t):
    import bayespy.nodes as bn

    (x,) = d
    tau = bn.Gamma(2.0, 0.5, plates=(1,))
    chain = bn.GaussianMarkovChain(
        np.zeros(1), np.array([[0.25]]), np.array([[1.0]]), tau, n=x.shape[1]
    )
    y = bn.GaussianARD(chain, 1.0, shape=(1,))
    y.observe(x[t].numpy()[:, None])
    return _vb([y, chain, tau], [chain, tau])


def chain_row(steps=12) -> Row:
    from tests.test_vmp_families import random_walk, walk_data

    return Row(
        "Gaussian Markov chain (random walk, Gamma innovation precision)",
        f"{steps} steps",
        lambda t: (walk_data(t=t, n=steps),),
        lambda d, **kw: _vmp(partial(random_walk, tau="gamma"), d, **kw),
        chain_bayespy,
    )


# --------------------------------------------------------------- hidden Markov chains
def gaussian_hmm_bayespy(d, t, k=3):
    import bayespy.nodes as bn
    from bayespy.inference import VB

    (x,) = d
    pi = bn.Dirichlet(np.ones(k))
    a = bn.Dirichlet(np.ones(k), plates=(k,))
    n = x.shape[1]
    # Pyro's DiscreteHMM takes a transition before the first observation: one more state
    z = bn.CategoricalMarkovChain(pi, a, states=n + 1)
    mu = bn.GaussianARD(np.linspace(-2, 2, k), 1.0, plates=(k,))
    tau = bn.Gamma(2.0, 1.0, plates=(k,))
    y = bn.Mixture(z, bn.GaussianARD, mu, tau)
    y.observe(np.r_[0.0, x[t].numpy()], mask=np.r_[False, np.ones(n, bool)])
    q = VB(y, z, mu, tau, a, pi)
    q.update(z, pi, z, a, z, mu, z, tau, repeat=MAX_ITER, tol=TOL, verbose=False)
    return q.compute_lowerbound()


def gaussian_hmm_row(steps=50) -> Row:
    from tests.test_vmp_families import hmm_data, hmm_model

    return Row(
        "HMM, Normal emissions (DiscreteHMM / CategoricalMarkovChain)",
        f"{steps} steps, 3 states",
        lambda t: (hmm_data(t=t, n=steps)[0],),
        lambda d, **kw: _vmp(hmm_model, d, **kw),
        gaussian_hmm_bayespy,
    )


def categorical_hmm_bayespy(d, t):
    import bayespy.nodes as bn
    from bayespy.inference import VB

    from tests.test_vmp_hmm_categorical import EMISSION_PRIOR, STATES

    (x,) = d
    pi = bn.Dirichlet(np.ones(STATES))
    a = bn.Dirichlet(np.ones(STATES), plates=(STATES,))
    n = x.shape[1]
    z = bn.CategoricalMarkovChain(pi, a, states=n + 1)  # the first state unobserved
    b = bn.Dirichlet(np.array(EMISSION_PRIOR), plates=(STATES,))
    y = bn.Mixture(z, bn.Categorical, b)
    y.observe(np.r_[0, x[t].numpy().astype(int)], mask=np.r_[False, np.ones(n, bool)])
    q = VB(y, z, b, a, pi)
    q.update(z, pi, z, a, z, b, repeat=MAX_ITER, tol=TOL, verbose=False)
    return q.compute_lowerbound()


def categorical_hmm_row(steps=40) -> Row:
    from tests.test_vmp_hmm_categorical import categorical_hmm, hmm_labels

    return Row(
        "HMM, Categorical emissions (DiscreteHMM / CategoricalMarkovChain)",
        f"{steps} steps, 2 states, 3 symbols",
        lambda t: (hmm_labels(t=t, n=steps)[0],),
        lambda d, **kw: _vmp(categorical_hmm, d, **kw),
        categorical_hmm_bayespy,
    )


# --------------------------------------------------------------- mixtures of discrete data
def latent_class_data(t, n=40):
    from tests.test_vmp_families import _classes

    x, _ = _classes(t=t, n=n)
    return x, _softmax_start(t, n, 3)


def latent_class_bayespy(d, t, classes=3, categories=4):
    import bayespy.nodes as bn

    x, resp = d
    n, items = x.shape[1:]
    pi = bn.Dirichlet(np.ones(classes))
    zn = bn.Categorical(pi, plates=(n, 1))
    table = bn.Dirichlet(np.ones(categories), plates=(classes, items))
    xn = bn.Mixture(zn, bn.Categorical, table, cluster_plate=-2)
    xn.observe(x[t].numpy())
    zn.initialize_from_parameters(resp[t].numpy()[:, None, :])
    return _vb([xn, pi, table, zn], [pi, table], [pi, table, zn])


def latent_class_row() -> Row:
    from tests.test_vmp_families import latent_class

    return Row(
        "Mixture of Categoricals (latent class analysis)",
        "40 points, 5 items of 4 values, 3 classes",
        latent_class_data,
        lambda d, **kw: _vmp(
            latent_class,
            d,
            lambda d: ((d[0],), {"init_resp": {"z": d[1]}}),
            order=["pi", "theta", "z"],
            **kw,
        ),
        latent_class_bayespy,
    )


def multinomial_data(t, docs=40):
    from tests.test_vmp_multinomial import _clustered

    x, _ = _clustered(tasks=t, docs=docs)
    return x, _softmax_start(t, docs, 3)


def multinomial_bayespy(d, t, n=30, k=3):
    import bayespy.nodes as bn

    x, resp = d
    docs, words = x.shape[1:]
    pi = bn.Dirichlet(np.ones(k))
    z = bn.Categorical(pi, plates=(docs,))
    theta = bn.Dirichlet(np.ones(words), plates=(k,))
    counts = bn.Mixture(z, bn.Multinomial, n, theta)
    counts.observe(x[t].numpy().astype(int))
    z.initialize_from_parameters(resp[t].numpy())
    return _vb([counts, pi, theta, z], [pi, theta], [pi, theta, z])


def multinomial_row() -> Row:
    from tests.test_vmp_multinomial import document_clusters

    return Row(
        "Mixture of Multinomials (document clusters)",
        "40 documents of 30 words, 12 words, 3 clusters",
        multinomial_data,
        lambda d, **kw: _vmp(
            document_clusters,
            d,
            lambda d: ((d[0],), {"init_resp": {"z": d[1]}}),
            order=["pi", "theta", "z"],
            **kw,
        ),
        multinomial_bayespy,
    )


# --------------------------------------------------------------- Bayesian PCA
PCA_RANK = 2


def pca_data(t, n=20, d=4, noise=0.5):
    """Rank-2 data plus noise, and the start of W's mean (one draw, shared by the tasks)."""
    w = torch.randn(t, d, PCA_RANK, generator=_g(0), dtype=F64)
    x = torch.randn(t, n, PCA_RANK, generator=_g(1), dtype=F64)
    y = x @ w.transpose(-1, -2) + noise * torch.randn(t, n, d, generator=_g(2), dtype=F64)
    return y, torch.randn(d, PCA_RANK, generator=_g(3), dtype=F64)


def pca_bayespy(d, t, k=PCA_RANK):
    """``tests.synthetic.bayesian_pca`` in BayesPy (its PCA example's nodes, without the
    rotations). Both sides start W at N(w0, I) (its mean given, its precision the prior's
    at E[α] = 1), α, τ and x at their priors, then update α, τ and x once from W: probfsl's
    ``init`` with ``init={"W": w0}``."""
    import bayespy.nodes as bn

    y, w0 = d
    n, dim = y.shape[1:]
    alpha = bn.Gamma(1e-3, 1e-3, plates=(k,))
    tau = bn.Gamma(1e-3, 1e-3)
    w = bn.GaussianARD(0, alpha, shape=(k,), plates=(dim, 1))
    x = bn.GaussianARD(0, 1, shape=(k,), plates=(1, n))
    obs = bn.GaussianARD(bn.SumMultiply("d,d->", w, x), tau)
    obs.observe(y[t].numpy().T)
    w.initialize_from_parameters(w0.numpy()[:, None, :], np.ones((dim, 1, k)))
    return _vb([obs, w, x, alpha, tau], [alpha, tau, x], [alpha, tau, w, x])


def pca_row() -> Row:
    from tests.synthetic import bayesian_pca

    return Row(
        "Bayesian PCA with ARD (Gamma precisions of W's columns and of the noise)",
        "20 points, 4 dims, 2 components",
        pca_data,
        lambda d, **kw: _vmp(
            partial(bayesian_pca, k=PCA_RANK),
            d,
            lambda d: ((d[0],), {"init": {"W": d[1].expand(len(d[0]), *d[1].shape)}}),
            warn_mean_field=False,
            **kw,
        ),
        pca_bayespy,
    )


# --------------------------------------------------------------- GP regression
def gp_data(t, n=20, lengthscale=1.0, jitter=1e-3):
    """Inputs on [-3, 3], a squared-exponential kernel per task (a jitter of 1e-3 keeps
    its inverse, BayesPy's prior precision, accurate), y = sin(x) + noise of sd 0.3."""
    x = torch.rand(t, n, 1, generator=_g(0), dtype=F64) * 6 - 3
    k = torch.exp(-0.5 * torch.cdist(x, x).square() / lengthscale**2)
    k = k + jitter * torch.eye(n, dtype=F64)
    return torch.sin(x[..., 0]) + 0.3 * torch.randn(t, n, generator=_g(1), dtype=F64), k


def gp_regression(y, k):
    """GP regression with a known kernel and a Gamma noise precision (Rasmussen & Williams,
    2006, §2.2): f ~ N(0, K), y ~ N(f, τ⁻¹ I), τ ~ Gamma(1, 0.1)."""
    t, n = y.shape
    with pyro.plate("tasks", t):
        f = pyro.sample("f", dist.MultivariateNormal(y.new_zeros(n), covariance_matrix=k))
        tau = pyro.sample("tau", dist.Gamma(y.new_tensor(1.0), y.new_tensor(0.1)))
        pyro.sample("y", dist.Normal(f, tau.rsqrt().unsqueeze(-1)).to_event(1), obs=y)


def gp_bayespy(d, t):
    import bayespy.nodes as bn

    y, k = d
    n = y.shape[1]
    f = bn.Gaussian(np.zeros(n), np.linalg.inv(k[t].numpy()))
    tau = bn.Gamma(1.0, 0.1)
    obs = bn.GaussianARD(f, tau, shape=(n,))
    obs.observe(y[t].numpy())
    return _vb([obs, f, tau], [f, tau])


def gp_row() -> Row:
    return Row(
        "GP regression (known kernel, Gamma noise precision)",
        "20 points, squared-exponential kernel",
        gp_data,
        lambda d, **kw: _vmp(gp_regression, d, **kw),
        gp_bayespy,
    )


# --------------------------------------------------------------- LDA
LDA_TOPICS, LDA_VOCABULARY = 3, 12


def lda(w, topics=LDA_TOPICS, vocabulary=LDA_VOCABULARY):
    """Latent Dirichlet allocation (Blei, Ng & Jordan, 2003): topics φ_k ~ Dirichlet(1),
    per document θ_d ~ Dirichlet(1), per word a topic z_dn ~ Categorical(θ_d) and the word
    w_dn ~ Categorical(φ_{z_dn})."""
    t, docs, n = w.shape
    with pyro.plate("tasks", t, dim=-3):
        with pyro.plate("topics", topics, dim=-1):
            phi = pyro.sample("phi", dist.Dirichlet(w.new_ones(vocabulary, dtype=F64)))
        with pyro.plate("docs", docs, dim=-2):
            theta = pyro.sample("theta", dist.Dirichlet(w.new_ones(topics, dtype=F64)))
            with pyro.plate("words", n, dim=-1):
                z = pyro.sample("z", dist.Categorical(theta))
                pyro.sample("w", dist.Categorical(Vindex(phi.unsqueeze(-3))[..., z, :]), obs=w)


def lda_data(t, docs=10, n=20):
    """Words of sparse topics (softmax of 2 × normal noise), documents mixing them."""
    phi = torch.softmax(2 * torch.randn(t, LDA_TOPICS, LDA_VOCABULARY, generator=_g(0)), -1)
    theta = torch.softmax(torch.randn(t, docs, LDA_TOPICS, generator=_g(1)), -1)
    z = torch.multinomial(theta.reshape(-1, LDA_TOPICS), n, True, generator=_g(2))
    z = z.reshape(t, docs, n)
    probs = phi[torch.arange(t)[:, None, None], z]
    w = torch.multinomial(probs.reshape(-1, LDA_VOCABULARY), 1, generator=_g(3))
    return w.reshape(t, docs, n), _softmax_start(t, docs * n, LDA_TOPICS).reshape(
        t, docs, n, LDA_TOPICS
    )


def lda_bayespy(d, t):
    """BayesPy's LDA (its example's nodes: a Mixture of Categoricals over the topics)."""
    import bayespy.nodes as bn

    w, resp = d
    docs, n = w.shape[1:]
    theta = bn.Dirichlet(np.ones(LDA_TOPICS), plates=(docs, 1))
    z = bn.Categorical(theta, plates=(docs, n))
    phi = bn.Dirichlet(np.ones(LDA_VOCABULARY), plates=(LDA_TOPICS,))
    words = bn.Mixture(z, bn.Categorical, phi)
    words.observe(w[t].numpy())
    z.initialize_from_parameters(resp[t].numpy())
    return _vb([words, theta, phi, z], [theta, phi], [theta, phi, z])


def lda_row() -> Row:
    return Row(
        "LDA (per-document topic proportions, a latent topic per word)",
        f"10 documents of 20 words, {LDA_VOCABULARY} words, {LDA_TOPICS} topics",
        lda_data,
        lambda d, **kw: _vmp(
            lda,
            d,
            lambda d: ((d[0],), {"init_resp": {"z": d[1]}}),
            order=["theta", "phi", "z"],
            **kw,
        ),
        lda_bayespy,
    )


ROWS = [
    gmm_row,
    regression_row,
    gp_row,
    pca_row,
    chain_row,
    gaussian_hmm_row,
    categorical_hmm_row,
    latent_class_row,
    multinomial_row,
    lda_row,
]

NOT_COVERED = [
    "Logistic models fitted with Pólya-Gamma variables (Bayesian logistic regression, GP "
    "classification): BayesPy has no node for them, so they have no twin.",
]


def _on(data, device: torch.device):
    """``data`` with every tensor moved to ``device`` (BayesPy keeps the CPU copy)."""
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in data)


def _fit_ours(row: Row, data, device: torch.device):
    """probfsl's fit of every task; on CUDA the clock stops once the device is done."""
    bounds, steps = row.ours(data)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return bounds.cpu(), steps.cpu()


def bench(row: Row, tasks: int, bayespy_tasks: int, rounds: int, device: torch.device) -> dict:
    data = row.data(tasks)
    ours_data = _on(data, device)
    nb = min(bayespy_tasks, tasks)
    ours_s = theirs_s = plan_s = ours_cpu = theirs_cpu = float("inf")
    for _ in range(rounds):
        tic, cpu = time.perf_counter(), time.process_time()
        bounds, steps = _fit_ours(row, ours_data, device)
        ours_s = min(ours_s, time.perf_counter() - tic)
        ours_cpu = min(ours_cpu, time.process_time() - cpu)
        tic = time.perf_counter()
        row.ours(ours_data, plan_only=True)  # the plan derivation alone, for the breakdown
        plan_s = min(plan_s, time.perf_counter() - tic)
        tic, cpu = time.perf_counter(), time.process_time()
        ref = [row.theirs(data, t) for t in range(nb)]
        theirs_s = min(theirs_s, time.perf_counter() - tic)
        theirs_cpu = min(theirs_cpu, time.process_time() - cpu)
    ref = torch.tensor(ref, dtype=F64)
    rel = ((bounds[:nb].double() - ref) / ref).abs()
    return dict(
        model=row.name,
        sizes=row.sizes,
        device=str(device),
        tasks=tasks,
        bayespy_tasks=nb,
        sweeps=int(steps.max()),
        sweeps_median=float(steps.double().median()),
        probfsl_seconds=ours_s,
        probfsl_plan_seconds=plan_s,
        bayespy_seconds=theirs_s,
        ratio=(tasks / ours_s) / (nb / theirs_s),
        probfsl_cpu_seconds=ours_cpu,
        bayespy_cpu_seconds=theirs_cpu,
        ratio_cpu=(tasks / ours_cpu) / (nb / theirs_cpu),
        bound_rel_diff_max=rel.max().item(),
        bound_rel_diff_median=rel.median().item(),
    )


def write(rows: list[dict], args, elapsed: float, load: tuple, stem: str) -> None:
    payload = dict(
        rows=rows,
        tol=TOL,
        max_iter=MAX_ITER,
        rounds=args.rounds,
        quick=args.quick,
        seconds=elapsed,
        not_covered=NOT_COVERED,
        loadavg_before=load[0],
        loadavg_after=load[1],
        machine=bench_vmp.machine(),
    )
    command = "".join(" " + a for a in sys.argv[1:])
    lines = [
        "# VMP against BayesPy, per model class",
        "",
        f"Generated by `python benchmarks/bench_vmp_classes.py{command}`"
        f" in {elapsed / 60:.1f} minutes.",
        "",
        "Both sides: the same data, start and schedule, to a relative change of the bound",
        f"of {TOL:g} (at most {MAX_ITER} sweeps). probfsl fits all T tasks at once (plan",
        "derivation included; in brackets, the derivation alone); BayesPy fits one model per",
        "task, on the first B tasks. Ratio: BayesPy's seconds per task over probfsl's, in",
        "wall-clock and in CPU (process) time. Bound diff: the largest relative difference",
        "of the converged bounds over the B tasks.",
        f"{torch.get_num_threads()} thread(s) for both (PyTorch and NumPy/BLAS), float64;",
        f"probfsl on {rows[0]['device'] if rows else 'cpu'}"
        + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
        + ", BayesPy on the CPU;",
        f"{args.rounds} round(s) alternating the two sides, best wall-clock and best CPU time",
        f"of each. Machine: {os.cpu_count()} cores, load average (1, 5, 15 min) "
        f"{', '.join(f'{v:.2f}' for v in load[0])} before and "
        f"{', '.join(f'{v:.2f}' for v in load[1])} after.",
        "",
        "| model class | sizes per task | T | probfsl s (plan) | sweeps (max) | B | BayesPy s | "
        "ratio (wall) | ratio (CPU) | bound diff (max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['sizes']} | {r['tasks']} | {r['probfsl_seconds']:.2f} "
            f"({r['probfsl_plan_seconds']:.2f}) | "
            f"{r['sweeps']} | {r['bayespy_tasks']} | {r['bayespy_seconds']:.2f} | "
            f"{r['ratio']:.0f}x | {r['ratio_cpu']:.0f}x | {r['bound_rel_diff_max']:.1e} |"
        )
    if NOT_COVERED:
        lines += ["", "Not covered:", ""] + [f"- {n}" for n in NOT_COVERED]
    if args.quick:  # a smoke run: printed, the published results stay
        print("\n".join(lines))
        return
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    import argparse
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tasks and rounds")
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--bayespy-tasks", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="", help="substring of the model names to run")
    parser.add_argument(
        "--device", default="cpu", help="probfsl's device (BayesPy runs on the CPU)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.tasks, args.bayespy_tasks, args.rounds = 100, 10, 1
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # BayesPy's own
    load_before = os.getloadavg()
    start = time.perf_counter()
    rows = []
    for make in ROWS:
        row = make()
        if args.only.lower() not in row.name.lower():
            continue
        try:
            rows.append(bench(row, args.tasks, args.bayespy_tasks, args.rounds, device))
        except Exception as error:  # recorded, the other rows still run
            print(f"{row.name}: failed on {device}: {error!r}", flush=True)
            continue
        print(json.dumps(rows[-1]), flush=True)
    stem = "vmp_classes" if device.type == "cpu" else f"vmp_classes_{device.type}"
    write(rows, args, time.perf_counter() - start, (load_before, os.getloadavg()), stem)


if __name__ == "__main__":
    main()
