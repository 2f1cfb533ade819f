# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 06 — Declaring your own model
#
# Write a Pyro model of conjugate-exponential sites, and probfsl derives its batched
# closed-form inference: `probfsl.inference.VMP` reads the model with `pyro.poutine.trace`
# and builds the mean-field updates, the analytic ELBO and a Pyro guide by variational
# message passing (Winn & Bishop, JMLR 2005; Bishop, PRML §10.2). The same engine runs
# one task or thousands at once.
#
# The model: BAVARDAGE's transductive Gaussian mixture on few-shot tasks. Each task has
# class proportions π ~ Dirichlet(2), class centroids μ_k ~ N(0, I), a label z_n per point
# (observed for the support, latent for the queries, one site with Pyro's `obs_mask`) and
# features x_n ~ N(μ_{z_n}, diag(τ_{z_n})⁻¹) with a fixed precision τ (300: about the
# within-class precision of these L2-normalised 64-d features).

# %%
import time

import matplotlib.pyplot as plt
import pyro
import pyro.distributions as dist
import torch
from pyro.ops.indexing import Vindex

from probfsl.data import load_dataset, sample_episodes
from probfsl.data.preprocess import center_and_normalize
from probfsl.diagnostics import draws_from_guide, summary, to_datatree
from probfsl.inference import VMP

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)


def select(table, z):
    """Row z_n of a per-class table [T, K, D] for every point: [T, N, D]."""
    return Vindex(table.unsqueeze(-3))[..., z, :]


# %% [markdown]
# ## The model


# %%
def mixture(x, labels, observed, way=5, tau0=300.0):
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), 2.0)))
        with pyro.plate("classes", way, dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(d), 1.0).to_event(1))
            tau = x.new_full((t, way, d), tau0)  # a fixed precision
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            pyro.sample("x", dist.Normal(select(mu, z), select(tau, z).rsqrt()).to_event(1), obs=x)


# %% [markdown]
# ## A batch of tasks
#
# 100 Omniglot tasks, 5-way 1-shot, 75 queries, on the built-in 64-d features, centred on
# the base-class mean and L2-normalised. Support rows come first; their labels are observed.

# %%
fs = load_dataset("omniglot")
tasks = sample_episodes(fs, 100, way=5, shot=1, n_query=75, balance="dirichlet", seed=0)
x = center_and_normalize(tasks.points().double(), fs.base(torch.float64)[0].mean(0))
t, n, n_s = x.shape[0], x.shape[1], tasks.support.shape[1]
labels = torch.zeros(t, n, dtype=torch.long)
labels[:, :n_s] = tasks.support_labels
observed = torch.zeros(t, n, dtype=torch.bool)
observed[:, :n_s] = True
print(x.shape, "support rows per task:", n_s)

# %% [markdown]
# ## Fit
#
# `VMP(model)` derives the engine; `fit` runs sweeps (through probfsl's one loop,
# `probfsl.inference.base.run`) until every task's ELBO has converged: a converged task is
# frozen while the others go on. It returns the state and a `RunInfo` (the ELBO trace and
# the sweeps each task took). The state holds the factors (`state.q`), the ELBO per task
# (`state.objective`) and `vmp.posterior(state)` gives them as distributions.

# %%
vmp = VMP(mixture, max_iter=50, tol=1e-8)
tic = time.perf_counter()
state, info = vmp.fit(x, labels, observed)
sweeps = info.n_steps.double()
print(f"{t} tasks in {time.perf_counter() - tic:.1f} s, {sweeps.median():.0f} sweeps per task")
print(f"(at most {sweeps.max():.0f}); all converged: {bool(info.converged.all())}")
post = vmp.posterior(state)
print({name: type(d).__name__ for name, d in post.items()})
query_probs = post["z"].probs[:, n_s:]
acc = (query_probs.argmax(-1) == tasks.query_labels).double().mean()
print(f"query accuracy {100 * acc:.2f}%, mean ELBO {state.objective.mean():.1f}")

# %% [markdown]
# ## The posterior in ArviZ
#
# The derived guide is a real Pyro guide: its draws become an `xarray.DataTree`, and
# `summary` gives means, intervals, ESS and R-hat. Below, q(π) of three tasks against
# their true proportions of queries.

# %%
few = slice(0, 3)
small = (x[few], labels[few], observed[few])
state3, _ = vmp.fit(*small)
draws = draws_from_guide(vmp.guide(state3), small, ["pi"], num_samples=300, num_chains=2)
tree = to_datatree(draws, dims={"pi": ["task", "extra", "class"]})
print(summary(tree).head(5))

# %%
true_pi = torch.nn.functional.one_hot(tasks.query_labels[few], 5).double().mean(1)
fig, axes = plt.subplots(1, 3, figsize=(10, 3), sharey=True)
for i, ax in enumerate(axes):
    pi = tree["posterior"]["pi"].isel(task=i).values.reshape(-1, 5)
    ax.violinplot(pi, showmeans=True)
    ax.scatter(range(1, 6), true_pi[i], color="black", marker="x", label="query proportions")
    ax.set_title(f"task {i}: q(π)")
    ax.set_xlabel("class")
axes[0].set_ylabel("proportion")
axes[0].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Change one line: a Gamma precision per class
#
# Replace the fixed τ by a per-class diagonal precision with a Gamma prior (the future work
# of the BAVARDAGE paper). Nothing else changes: VMP derives the new q(τ) updates, the
# messages from x to τ and the new ELBO terms.


# %%
def mixture_gamma(x, labels, observed, way=5, tau0=300.0):
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), 2.0)))
        with pyro.plate("classes", way, dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(d), 1.0).to_event(1))
            tau = pyro.sample("tau", dist.Gamma(x.new_full((d,), 10.0), 10.0 / tau0).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            pyro.sample("x", dist.Normal(select(mu, z), select(tau, z).rsqrt()).to_event(1), obs=x)


vmp_gamma = VMP(mixture_gamma, max_iter=50, tol=1e-8)
state_g, _ = vmp_gamma.fit(x, labels, observed)
post_g = vmp_gamma.posterior(state_g)
acc_g = (post_g["z"].probs[:, n_s:].argmax(-1) == tasks.query_labels).double().mean()
print(f"Gamma precision: accuracy {100 * acc_g:.2f}% (fixed: {100 * acc:.2f}%)")
print("posterior mean precision, task 0, class 0, first dims:", post_g["tau"].mean[0, 0, :4])

# %% [markdown]
# ## The conformance check
#
# `probfsl.testing.check_engine` holds the derived engine to the contract every engine
# passes: the ELBO never decreases; the batch equals one task at a time; float32 agrees
# with float64; every tensor stays on the data's device; a step never synchronises with
# the host; Pyro's own `Trace_ELBO` of (model, derived guide) agrees with the analytic
# ELBO within Monte Carlo error.

# %%
from probfsl.testing import ConformanceCase, check_engine  # noqa: E402

case = ConformanceCase(
    make_engine=lambda: VMP(mixture_gamma, tol=0),
    model=mixture_gamma,
    data=tuple(d[:3, :20] for d in (x, labels, observed)),
    n_steps=10,
    particles=100,
    repeats=5,
)
check_engine(case)
print("conformance: passed")

# %% [markdown]
# A model outside the conjugate-exponential family is refused before any computation,
# with the site, its distribution and its parent named:


# %%
def lognormal_precision(x, labels, observed, way=5):
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        with pyro.plate("classes", way, dim=-1):
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(d), 1.0).to_event(1))
            tau = pyro.sample("tau", dist.LogNormal(x.new_zeros(d), 1.0).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample(
                "z", dist.Categorical(x.new_full((way,), 0.2)), obs=labels, obs_mask=observed
            )
            pyro.sample("x", dist.Normal(select(mu, z), select(tau, z).rsqrt()).to_event(1), obs=x)


try:
    VMP(lognormal_precision).init(*small)
except ValueError as err:
    print(str(err)[:160], "...")

# %% [markdown]
# ## The old path: writing an engine by hand
#
# An engine is any `probfsl.inference.base.Engine`: `init(*data) -> state`,
# `step(state) -> (state, info)` with `state.objective` the ELBO per task (and `info` an
# `Info` reporting it), and `guide(state)`; `probfsl.inference.base.run` drives the steps.
# Here the exact posterior of the class proportions of labelled tasks,
# q(π) = Dirichlet(α0 + counts), whose ELBO is the log evidence, with its terms from the
# exponential-family blocks of `probfsl.inference.expfam`; `check_engine` judges it the
# same way (including the exact log evidence).

# %%
import math  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

from probfsl.inference import expfam  # noqa: E402
from probfsl.inference.base import Engine, Info  # noqa: E402


def proportions_model(y, n_classes=5, alpha0=2.0):
    with pyro.plate("tasks", y.shape[0], dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(torch.full((n_classes,), alpha0, device=y.device)))
        pyro.sample("y", dist.Categorical(pi.unsqueeze(-2)).to_event(1), obs=y)


@dataclass
class ProportionsState:
    y: torch.Tensor
    concentration: torch.Tensor
    objective: torch.Tensor


class ProportionsPosterior(Engine):
    def __init__(self, n_classes=5, alpha0=2.0):
        self.n_classes, self.alpha0 = n_classes, alpha0

    def init(self, y):
        conc = torch.full((y.shape[0], self.n_classes), self.alpha0, device=y.device)
        return self.step(ProportionsState(y, conc, conc[:, 0]))[0]

    def step(self, s):
        counts = torch.nn.functional.one_hot(s.y, self.n_classes).sum(1).to(s.concentration)
        q = expfam.Dirichlet(self.alpha0 + counts)
        prior = expfam.Dirichlet(torch.full_like(q.concentration, self.alpha0))
        elbo = (counts * q.expected_stats()[0]).sum(-1) - q.kl(prior)  # E ln p(y|π) - KL
        return replace(s, concentration=q.concentration, objective=elbo), Info(elbo)

    def guide(self, s):
        def guide(y, *args, **kwargs):
            with pyro.plate("tasks", y.shape[0], dim=-1):
                pyro.sample("pi", dist.Dirichlet(s.concentration))

        return guide


y = tasks.query_labels[:6]
counts = torch.nn.functional.one_hot(y, 5).sum(1).double()
log_evidence = (
    math.lgamma(10.0)
    - math.lgamma(10.0 + y.shape[1])
    + (torch.lgamma(2.0 + counts) - math.lgamma(2.0)).sum(-1)
)
for name, make in [("hand-written", ProportionsPosterior), ("VMP", lambda: VMP(proportions_model))]:
    check_engine(
        ConformanceCase(make, proportions_model, (y,), n_steps=2, exact_log_evidence=log_evidence)
    )
    print(f"{name}: conformance passed, ELBO = log evidence")
