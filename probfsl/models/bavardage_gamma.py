"""``bavardage-gamma``: BAVARDAGE with a per-class diagonal Gamma precision, derived by VMP.

A method none of the papers ran, assembled from existing blocks. BAVARDAGE (Hu, Pateux &
Gripon, "Adaptive Dimension Reduction and Variational Inference for Transductive Few-Shot
Classification", AISTATS 2023) fits a variational Bayesian Gaussian mixture to the rows
u = x P of a task, P its adaptive PLDA projection, with one fixed precision τ = T_vb on
every class and axis; learning the precision is the future work the paper names (§6).
Here each class k has its own diagonal precision

    τ_k ~ Π_d Gamma(a_0, a_0 / T_vb)      (prior mean T_vb, a_0 pseudo-observations / 2)
    μ_k | τ_k ~ Normal(0, (β_0 τ_k)^{-1})
    u_n | z_n ~ Normal(μ_{z_n}, τ_{z_n}^{-1})

and everything else is BAVARDAGE's (:func:`bavardage_gamma_model`: its declaration,
:func:`probfsl.derived.bavardage.bavardage_model` with the fixed τ replaced by the Gamma
site). No update is written by hand: variational message passing (Winn & Bishop,
"Variational Message Passing", JMLR 2005; :class:`probfsl.inference.VMP`) derives the
q(τ_k) factors, their messages and the new ELBO terms, and
:func:`probfsl.derived.bavardage.run_blocks` runs them block by block with BAVARDAGE's
projection updated between blocks (Algorithm 1 of the paper). The preprocessing (MESV,
whitening, soft k-means initialisation) is :class:`~probfsl.models.bavardage.Bavardage`'s
(:meth:`~probfsl.models.bavardage.Bavardage.vb_problem`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pyro
import pyro.distributions as dist
import torch

from probfsl.data.tasks import Episodes
from probfsl.derived.bavardage import OBSERVED_ROWS, run_blocks
from probfsl.inference.background import open_log_ratio
from probfsl.inference.class_stats import one_hot_support
from probfsl.inference.plda import principal_axes
from probfsl.inference.vb_mixture import BavardageVB
from probfsl.inference.vmp import VMP, VMPState
from probfsl.inference.vmp.plan_cache import PlanCache, kept_plans
from probfsl.models.bavardage import Bavardage, _seeded_rng
from probfsl.schema import Real
from probfsl.validation import check_hyperparameter


def bavardage_gamma_model(
    u_support: torch.Tensor,
    support_labels: torch.Tensor,
    u_query: torch.Tensor,
    way: int,
    tau: float = 4.0,
    a0: float = 10.0,
    alpha0: float = 2.0,
    beta0: float = 10.0,
    balanced: bool = False,
) -> None:
    """BAVARDAGE's mixture (:func:`~probfsl.derived.bavardage.bavardage_model`) with a
    per-class diagonal precision τ_k ~ Π_d Gamma(a0, a0 / tau) (module docstring).

    Args:
        u_support: [T, S, d] projected support rows (their classes are observed).
        support_labels: [T, S] task-local labels in 0..K-1.
        u_query: [T, Q, d] projected query rows.
        way: K.
        tau: the prior mean of every precision (BAVARDAGE's fixed T_vb).
        a0: the Gamma shape: the prior's weight, in pseudo-observations / 2.
        alpha0, beta0: the priors' α_o and β_o, as in BAVARDAGE.
        balanced: π fixed uniform, no ``pi`` site.
    """
    ref, d = u_support, u_support.shape[-1]
    with pyro.plate("tasks", u_support.shape[0], dim=-2):
        if balanced:
            pi = ref.new_full((1, way), 1.0 / way)
        else:
            pi = pyro.sample("pi", dist.Dirichlet(ref.new_full((1, way), alpha0)))
        with pyro.plate("classes", way, dim=-1):
            # the change to BAVARDAGE: a Gamma site instead of the fixed τ = T_vb
            prec = pyro.sample("tau", dist.Gamma(ref.new_full((d,), a0), a0 / tau).to_event(1))
            mu = pyro.sample(
                "mu", dist.Normal(ref.new_zeros(d), (beta0 * prec).rsqrt()).to_event(1)
            )
        onehot_s = one_hot_support(support_labels, way, ref.dtype)
        with pyro.plate("support", u_support.shape[1], dim=-1):
            scale = (onehot_s @ prec).rsqrt()
            pyro.sample("u_support", dist.Normal(onehot_s @ mu, scale).to_event(1), obs=u_support)
        with pyro.plate("queries", u_query.shape[1], dim=-1):
            z = pyro.sample("z", dist.Categorical(probs=pi))
            onehot_q = torch.nn.functional.one_hot(z, way).to(ref)
            scale = (onehot_q @ prec).rsqrt()
            pyro.sample("u_query", dist.Normal(onehot_q @ mu, scale).to_event(1), obs=u_query)


def run_open_blocks(
    model: Callable[..., None],
    engine: BavardageVB,
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    resp: torch.Tensor,
    open_log_odds: torch.Tensor,
    open_prior: float,
    n_iter: int = 5,
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    plans: PlanCache | None = None,
) -> tuple[VMPState, torch.Tensor, torch.Tensor]:
    """:func:`~probfsl.derived.bavardage.run_blocks` with the background component of
    the nested open-set mixture (:mod:`probfsl.inference.vb_mixture_open`).

    ``resp`` [T, N, K + 1]: the starting responsibilities, the background last (a query's
    class columns sum to 1 - o_q0); ``open_log_odds`` [T, Q] the queries' full-space
    ln p_0(x) - ln p_closed(x); ``open_prior`` the prior mean of π_0; ``rows(x, resp)``
    the projection (default ``engine.rows``); ``plans`` as in ``run_blocks``. Each block:

    * the projection from the class responsibilities o_qk = (1 - o_q0) r_qk;
    * the factors of every other latent site (q(π), q(τ), q(μ)) started by VMP from r,
      then updated once more from o_qk (a query's background share pulls no class
      statistic: the factor of z is the mean-field posterior of the class given "closed",
      and the updates of its co-parents read it weighted by the closed share);
    * q(z) (the class given "closed", r), then o_q0 after one update of q(π_0)
      (:func:`~probfsl.inference.background.open_log_ratio`).

    Returns the last VMP state (its factor of z holds r, not o_qk), the responsibilities
    [T, N, K + 1] (the support's one-hot, then o_qk and o_q0) and the trace [n_iter + 1,
    T] of the VMP objective after each block's weighted updates and, last, after the final
    update of z (with the weighted z factor it is the class part of the nested model's
    bound, less the open/closed terms: a diagnostic, not a bound to compare across
    methods).
    """
    if n_iter < 1:
        raise ValueError(f"n_iter must be at least 1, got {n_iter}")
    vmp, n_s, way = VMP(model, plans=plans), support.shape[1], engine.way
    x = torch.cat([support, query], 1)
    onehot = one_hot_support(support_labels, way, x.dtype)
    resp = resp.to(x)
    open_resp = resp[:, n_s:, way]
    closed = resp[:, n_s:, :way] + torch.finfo(x.dtype).tiny  # r: a uniform row if o_q0 = 1
    classes = closed / closed.sum(-1, keepdim=True)
    closed_share = closed.sum(-1)
    plan, trace = None, []
    rows = engine.rows if rows is None else rows
    for _ in range(n_iter):
        weighted = classes * closed_share.unsqueeze(-1)
        u = rows(x, torch.cat([onehot, weighted], 1))
        if plan is None:  # derived once; later blocks change the rows only
            plan = vmp.compile(u[:, :n_s], support_labels, u[:, n_s:])
        else:
            plan = plan.observe(u_support=u[:, :n_s], u_query=u[:, n_s:])
        state = vmp.start(plan, init_resp={"z": classes})
        others = [name for name in plan.latent if name != "z"]
        q = dict(state.q, z=(weighted,))
        state = vmp.update(VMPState(plan, q, state.objective), others)
        trace.append(state.objective)
        state = vmp.update(state, ["z"])
        classes = state.q["z"][0]
        logit = open_log_ratio(open_log_odds, open_resp, open_prior)
        # 1 - o_q0 as σ(-logit): exact where o_q0 rounds to 1 (float32), so that the
        # class responsibilities of a surely open query keep their order
        open_resp, closed_share = torch.sigmoid(logit), torch.sigmoid(-logit)
    trace.append(state.objective)
    query_resp = torch.cat([classes * closed_share.unsqueeze(-1), open_resp.unsqueeze(-1)], -1)
    support_resp = torch.cat([onehot, onehot.new_zeros(onehot.shape[:2] + (1,))], -1)
    return state, torch.cat([support_resp, query_resp], 1), torch.stack(trace)


class BavardageGamma(Bavardage):
    """BAVARDAGE's PLDA-projected VB mixture with a learnt per-class diagonal precision
    (module docstring; Hu, Pateux & Gripon, AISTATS 2023; Winn & Bishop, JMLR 2005).

    The estimator is :class:`~probfsl.models.bavardage.Bavardage` (same base statistics,
    preprocessing and projection) whose VB loop runs :func:`bavardage_gamma_model` through
    :func:`~probfsl.derived.bavardage.run_blocks`. It always runs the full method
    (``mode="bavardage"``) with the derived engine, and the support labels are not draws of
    π (``count_support=False``): these are fixed class attributes, not hyperparameters.

    Args:
        temperature_km: T_km of the soft k-means initialisation.
        temperature_vb: T_vb, now the prior mean of every precision.
        s_max: upper bound of the whitening scales; None for no clamping.
        alpha0: α_o of the Dirichlet prior on π.
        beta0: β_o of the prior on the centroids, μ_k ~ N(0, (β_o τ_k)⁻¹).
        a0: the Gamma shape of every precision (a0 → ∞ gives BAVARDAGE back).
        gamma: shrinkage γ of the centroids defining the projection (default β_o).
        n_km: soft k-means passes.
        n_vb: VB blocks (projection, then q(π), q(τ), q(μ), q(z)).
        balanced: π fixed uniform.
        whitening: ``"task_span"`` (default) or ``"global"``.
        scatter: S_w normalisation, ``"code"`` (default) or ``"paper"``.
        scale: the units of ``s_max`` and ``temperature_vb``, ``"code"`` or ``"relative"``.

    Every argument but ``a0`` is :class:`~probfsl.models.bavardage.Bavardage`'s
    (``open_prior``: the prior mean of the open fraction π_0, :meth:`predict_proba_open`;
    ``open_frame``: the frame of its open contrast; ``open_neighbours``: the nearest
    queries its P(open) log-odds are averaged with).

    Open set (:meth:`predict_proba_open`): BAVARDAGE's nested open-set mixture
    (:mod:`probfsl.inference.vb_mixture_open`) with this method's classes. A query is
    first "open" or "closed" (weights π_0 ~ Beta, 1 - π_0), its background
    responsibility o_q0 taken in the full centred, normalised feature space from the base
    classes' two-covariance predictive of a new class against the known classes' given
    the support; then a class given "closed" from :func:`bavardage_gamma_model`. Every
    block weights query q by its closed share 1 - o_q0 in q(π), q(τ_k), q(μ_k) and the
    projection (:func:`run_open_blocks`), so open queries pull neither the centroids nor
    the precisions.

    After :meth:`predict_proba`: ``state_`` (the last block's
    :class:`~probfsl.inference.vmp.VMPState`; ``state_.objective`` the final ELBO [T]),
    ``init_resp_`` (soft k-means) and ``elbo_trace_`` ([n_vb + 1, T], as in BAVARDAGE).
    """

    mode = "bavardage"
    engine = "derived"
    count_support = False
    trace_elbo = True
    n_free = 0  # the open-set model here has the background component alone
    open_scale = open_shift = None  # P(open) calibrated as held-out base classes ask
    #: Bavardage's declaration without the hyperparameters fixed here, with ``a0``
    schema = Bavardage.schema.derive(
        drop=(
            "count_support",
            "mode",
            "trace_elbo",
            "engine",
            "n_free",
            "open_scale",
            "open_shift",
        ),
        params={"a0": Real(positive=True)},
    )

    def __init__(
        self,
        temperature_km: float = 10.0,
        temperature_vb: float = 4.0,
        s_max: float | None = 5.0,
        alpha0: float = 2.0,
        beta0: float = 10.0,
        a0: float = 10.0,
        gamma: float | None = None,
        n_km: int = 5,
        n_vb: int = 5,
        balanced: bool = False,
        whitening: str = "task_span",
        scatter: str = "code",
        scale: str = "code",
        open_prior: float = 0.5,
        open_frame: str = "base",
        open_neighbours: int = 0,
    ) -> None:
        self.temperature_km = temperature_km
        self.temperature_vb = temperature_vb
        self.s_max = s_max
        self.alpha0 = alpha0
        self.beta0 = beta0
        self.a0 = a0
        self.gamma = gamma
        self.n_km = n_km
        self.n_vb = n_vb
        self.balanced = balanced
        self.whitening = whitening
        self.scatter = scatter
        self.scale = scale
        self.open_prior = open_prior
        self.open_frame = open_frame
        self.open_neighbours = open_neighbours

    def declared_model(self, engine: BavardageVB) -> Callable[..., None]:
        """:func:`bavardage_gamma_model` with this estimator's hyperparameters (τ and the
        priors as the BAVARDAGE engine ``engine`` of the batch holds them)."""
        return partial(
            bavardage_gamma_model,
            way=engine.way,
            tau=engine.tau,
            a0=self.a0,
            alpha0=engine.alpha0,
            beta0=engine.beta0,
            balanced=engine.balanced,
        )

    @staticmethod
    def rows(engine: BavardageVB) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """BAVARDAGE's projection (``engine.rows``) in the principal axes of the shrunk
        centroids (:func:`~probfsl.inference.plda.principal_axes`): a precision per axis
        needs a basis that does not depend on the order of the classes."""

        def rows(x: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
            return principal_axes(engine.rows(x, resp), resp, engine.gamma)

        return rows

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Query responsibilities [T, Q, K]: BAVARDAGE's preprocessing, then n_vb blocks
        (projection, q(π), q(τ), q(μ), q(z)) derived from :func:`bavardage_gamma_model`."""
        engine, data = self.vb_problem(episodes)
        self.init_resp_ = data[3]
        model = self.declared_model(engine)
        # the inputs are checked (vb_problem): no need to validate the arguments of every
        # distribution each time VMP traces the model (40 host synchronisations a block)
        with pyro.validation_enabled(False):
            state, resp, trace = run_blocks(
                model,
                engine,
                *data,
                n_iter=int(self.n_vb),
                rows=self.rows(engine),
                plans=kept_plans(self, "closed", OBSERVED_ROWS),
            )
        self.state_, self.elbo_trace_ = state, trace
        return resp[:, episodes.support.shape[1] :]

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """Open-set responsibilities ``[T, Q, K+1]`` (the background last): BAVARDAGE's
        open-set problem (:meth:`~probfsl.models.bavardage.Bavardage.open_problem`: soft
        k-means with the background, the global whitening's rows), then n_vb blocks of
        :func:`run_open_blocks` on :func:`bavardage_gamma_model`: every query weighted by
        its closed share 1 - o_q0 in q(π), q(τ), q(μ) and the projection, o_q0 from the
        full-space two-covariance contrast with π_0 inferred per task (class docstring);
        the last column's log-odds scaled as held-out base classes ask
        (:meth:`~probfsl.models.base.OpenSetBackground.tempered_open`). Sets ``state_``
        and ``elbo_trace_`` as :meth:`predict_proba` does. No free components: this model
        has the background component alone."""
        return self.tempered_open(episodes)

    def inferred_open(self, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """The known classes' shares [T, Q, K] and the log-odds of P(open) [T, Q] of
        :meth:`predict_proba_open` before its scale and shift (the blocks, then P(open)
        read last, :meth:`~probfsl.models.base.OpenSetBackground.final_open`)."""
        problem = self.open_problem(episodes, n_free=0)
        model = self.declared_model(problem.engine)
        with pyro.validation_enabled(False):  # the inputs are checked (open_problem)
            state, resp, trace = run_open_blocks(
                model,
                problem.engine,
                problem.support,
                problem.support_labels,
                problem.query,
                problem.resp,
                problem.open_log_odds,
                self.open_prior,
                n_iter=int(self.n_vb),
                rows=self.rows(problem.engine),
                plans=kept_plans(self, "open", OBSERVED_ROWS),
            )
        self.state_, self.elbo_trace_ = state, trace
        # P(open) read last (in the queries' frame under the task's own background)
        return self.final_open(problem.reading, resp[:, episodes.support.shape[1] :])

    def posterior(self) -> dict[str, torch.distributions.Distribution]:
        """The last batch's factors q(π), q(τ), q(μ), q(z) as batched distributions."""
        if getattr(self, "state_", None) is None:
            raise ValueError("no variational posterior: call predict_proba first")
        return VMP(bavardage_gamma_model).posterior(self.state_)  # q reads the state alone

    def posterior_draws(
        self, n_draws: int = 200, seed: int = 0, tasks: slice | None = None
    ) -> dict[str, torch.Tensor]:
        """Draws ``[1, n_draws, T, ...]`` of every latent site from :meth:`posterior`
        (seeded; the global random streams are neither consumed nor read)."""
        check_hyperparameter("n_draws", n_draws, integer=True, low=1)
        post = self.posterior()
        chosen = slice(None) if tasks is None else tasks
        with _seeded_rng(self.state_.objective.device, seed):
            draws = {name: d.sample((n_draws,)) for name, d in post.items()}
        out = {}
        for name, value in draws.items():
            value = value[:, chosen]
            out[name] = value.squeeze(-2) if name == "pi" else value  # pi: [.., 1, K]
        return {name: value.unsqueeze(0) for name, value in out.items()}

    def to_datatree(self, n_draws: int = 200, seed: int = 0, tasks: slice | None = None):
        """π, the precisions τ, the centroids μ and the query labels z as a DataTree."""
        from probfsl.diagnostics.arviz import to_datatree

        draws = self.posterior_draws(n_draws, seed, tasks)
        dims = {
            "pi": ["task", "cls"],
            "tau": ["task", "cls", "component"],
            "mu": ["task", "cls", "component"],
            "z": ["task", "query"],
        }
        return to_datatree(
            draws,
            dims={k: v for k, v in dims.items() if k in draws},
            attrs={
                "method": "BAVARDAGE with per-class Gamma precisions",
                "tau_prior_mean": self.temperature_vb_,
                "elbo_final_mean": float(self.state_.objective.mean()),
            },
        )
