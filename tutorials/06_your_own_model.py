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
# Every method in probfsl is a Pyro model paired with a closed-form engine. This
# tutorial writes a new pair from scratch and lets probfsl's conformance checks
# judge it, the same checks every built-in engine passes.
#
# The model: the class proportions of a batch of few-shot tasks. Each task t has
# labels y_tn in {0..K-1} and proportions π_t ~ Dirichlet(α0·1_K), y_tn ~ Categorical(π_t).
# The posterior is exact, Dirichlet(α0 + counts), so the ELBO of that posterior is
# the log evidence, a Dirichlet-multinomial probability.

# %%
import math
from dataclasses import dataclass, replace
from functools import partial

import matplotlib.pyplot as plt
import pyro
import pyro.distributions as dist
import torch

from probfsl.diagnostics import draws_from_guide, summary, to_datatree
from probfsl.inference.base import Engine, run
from probfsl.testing import ConformanceCase, check_engine

# %% [markdown]
# ## The Pyro model
#
# Data carry a leading task dimension; a `tasks` plate makes the tasks independent.


# %%
def proportions_model(y: torch.Tensor, n_classes: int = 5, alpha0: float = 2.0) -> None:
    """pi_t ~ Dirichlet(alpha0 1_K); y_tn ~ Categorical(pi_t)."""
    concentration = torch.full((n_classes,), alpha0, dtype=torch.get_default_dtype())
    with pyro.plate("tasks", y.shape[0], dim=-1):
        pi = pyro.sample("pi", dist.Dirichlet(concentration))
        pyro.sample("y", dist.Categorical(pi.unsqueeze(-2)).to_event(1), obs=y)


# %% [markdown]
# ## The engine
#
# `init` builds the state, `step` applies the closed-form update, the state carries
# the objective (the analytic ELBO, one value per task), and `guide` returns a Pyro
# guide with the model's signature that samples `pi` from q.


# %%
@dataclass
class ProportionsState:
    y: torch.Tensor
    concentration: torch.Tensor  # [T, K] of q(pi)
    objective: torch.Tensor  # [T]


class ProportionsPosterior(Engine):
    """q(pi_t) = Dirichlet(alpha0 + counts_t), the exact posterior."""

    def __init__(self, n_classes: int = 5, alpha0: float = 2.0) -> None:
        self.n_classes, self.alpha0 = n_classes, alpha0

    def init(self, y: torch.Tensor) -> ProportionsState:
        conc = torch.full((y.shape[0], self.n_classes), self.alpha0)
        state = ProportionsState(y, conc, conc.new_zeros(y.shape[0]))
        return replace(state, objective=self.elbo(state))

    def step(self, state: ProportionsState) -> ProportionsState:
        counts = torch.nn.functional.one_hot(state.y, self.n_classes).sum(1)
        new = replace(state, concentration=self.alpha0 + counts.to(state.concentration))
        return replace(new, objective=self.elbo(new))

    def elbo(self, s: ProportionsState) -> torch.Tensor:
        """E_q[ln p(y | pi) + ln p(pi)] + H[q]."""
        a = s.concentration
        e_log_pi = torch.special.digamma(a) - torch.special.digamma(a.sum(-1, keepdim=True))
        counts = torch.nn.functional.one_hot(s.y, self.n_classes).sum(1).to(a)
        k, a0 = self.n_classes, self.alpha0
        log_prior = math.lgamma(k * a0) - k * math.lgamma(a0) + ((a0 - 1) * e_log_pi).sum(-1)
        entropy = -(
            torch.lgamma(a.sum(-1)) - torch.lgamma(a).sum(-1) + ((a - 1) * e_log_pi).sum(-1)
        )
        return (counts * e_log_pi).sum(-1) + log_prior + entropy

    def guide(self, state: ProportionsState):
        def guide(y, *args, **kwargs):
            with pyro.plate("tasks", y.shape[0], dim=-1):
                pyro.sample("pi", dist.Dirichlet(state.concentration))

        return guide


# %% [markdown]
# ## The exact answer
#
# The log evidence of a label sequence under the Dirichlet-categorical model is
# ln Γ(Kα0) − ln Γ(Kα0 + N) + Σ_k [ln Γ(α0 + n_k) − ln Γ(α0)].

# %%
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(0)
true_pi = torch.distributions.Dirichlet(torch.full((5,), 2.0)).sample((6,))
y = torch.multinomial(true_pi, 40, replacement=True, generator=g)
counts = torch.nn.functional.one_hot(y, 5).sum(1).double()
log_evidence = (
    math.lgamma(10.0) - math.lgamma(50.0) + (torch.lgamma(2.0 + counts) - math.lgamma(2.0)).sum(-1)
)

# %% [markdown]
# ## The conformance check
#
# `check_engine` runs the engine and asserts: the ELBO never decreases; the batch
# equals one task at a time; float32 agrees with float64; the ELBO equals the exact
# log evidence; and Pyro's own `Trace_ELBO` of (model, guide) agrees with the
# analytic ELBO within Monte Carlo error. It raises `AssertionError` otherwise.

# %%
case = ConformanceCase(
    make_engine=ProportionsPosterior,
    model=partial(proportions_model, n_classes=5, alpha0=2.0),
    data=(y,),
    n_steps=2,
    exact_log_evidence=log_evidence,
)
check_engine(case)
print("conformance: passed")

# %% [markdown]
# A deliberately wrong update (forgetting the prior) is caught:


# %%
class Forgetful(ProportionsPosterior):
    def step(self, state):
        counts = torch.nn.functional.one_hot(state.y, self.n_classes).sum(1)
        new = replace(state, concentration=1.0 + counts.to(state.concentration))
        return replace(new, objective=self.elbo(new))


try:
    check_engine(replace(case, make_engine=Forgetful))
    raise RuntimeError("the broken engine should have failed")
except AssertionError as err:
    print("broken engine rejected:", str(err).splitlines()[0][:100])

# %% [markdown]
# ## Inspecting the posterior with ArviZ
#
# Draws from the engine's guide become an `xarray.DataTree`; `summary` gives means,
# intervals, ESS and R-hat.

# %%
engine = ProportionsPosterior()
state, trace = run(engine, engine.init(y), 1)
draws = draws_from_guide(engine.guide(state), (y,), ["pi"], num_samples=400, num_chains=2)
tree = to_datatree(draws, dims={"pi": ["task", "class"]})
print(summary(tree).head(5))

# %%
fig, axes = plt.subplots(1, 3, figsize=(10, 3), sharey=True)
for t, ax in enumerate(axes):
    pi = tree["posterior"]["pi"].isel(task=t).values.reshape(-1, 5)
    ax.violinplot(pi, showmeans=True)
    ax.scatter(range(1, 6), true_pi[t], color="black", marker="x", label="true π")
    ax.set_title(f"task {t}: q(π) from 40 labels")
    ax.set_xlabel("class")
axes[0].set_ylabel("proportion")
axes[0].legend()
fig.tight_layout()
plt.show()
