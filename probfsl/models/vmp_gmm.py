"""``vmp-gmm``: BAVARDAGE's mixture with a per-class diagonal Gamma precision, by VMP.

The future work stated by Hu, Pateux & Gripon (AISTATS 2023, §6): the VB Gaussian mixture
of BAVARDAGE (Dirichlet weights, Normal centroids, support labels observed) with a
precision learned per class instead of one fixed T_vb. Here each class k has a diagonal
precision τ_k ~ Π_d Gamma(a_0, a_0 v_d) (prior mean 1/v_d, v_d the base classes' average
within-class variance of feature d), μ_k | τ_k ~ N(0, (β_0 τ_k)⁻¹), and the model is
declared in Pyro (:func:`vmp_gmm_model`); every update, the ELBO and the guide are derived
by :class:`probfsl.inference.VMP` (Winn & Bishop 2005; Bishop, PRML §10.2). Features are
centred on the base mean and L2-normalised (as soft k-means); the queries' responsibilities
start from soft k-means seeded by the support (BAVARDAGE's initialiser, in
:meth:`SeededVMP.init`), and the sweeps run through the shared loop
:func:`probfsl.inference.base.run` (``VMP.fit``).

Open-set recognition (:meth:`VMPGaussianMixture.predict_proba_open`) can declare the
background, a broad density of "some other class" learnt from the base classes, as one
more component of the same Pyro mixture (:func:`vmp_gmm_components_model`, one prior
row per component), so that VMP derives its inference too.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Self

import pyro
import pyro.distributions as dist
import torch
from pyro.ops.indexing import Vindex

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.background import TwoCovarianceReading, open_log_ratio
from probfsl.inference.soft_kmeans import soft_kmeans_gram, soft_kmeans_gram_open
from probfsl.inference.vb_mixture_open import OPEN_FRAMES
from probfsl.inference.vmp import VMP, VMPState
from probfsl.inference.vmp.plan_cache import kept_plans
from probfsl.models.base import (
    BACKGROUND,
    OPEN_NEIGHBOURS,
    OPEN_PRIOR,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.schema import FEATURE_BOUND, Choice, EstimatorSchema, Group, Int, Real, Tensor
from probfsl.validation import check_base, check_episodes


def vmp_gmm_model(
    x: torch.Tensor,
    labels: torch.Tensor,
    observed: torch.Tensor,
    way: int,
    prior_rate: torch.Tensor,
    alpha0: float = 2.0,
    beta0: float = 1.0,
    a0: float = 10.0,
) -> None:
    """x [T, N, D]; labels [T, N] read where ``observed`` [T, N] (the support), else latent."""
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), alpha0)))
        with pyro.plate("classes", way, dim=-1):
            rate = prior_rate.to(x)
            tau = pyro.sample("tau", dist.Gamma(x.new_full((d,), a0), rate).to_event(1))
            mu = pyro.sample("mu", dist.Normal(x.new_zeros(d), (beta0 * tau).rsqrt()).to_event(1))
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            loc = Vindex(mu.unsqueeze(-3))[..., z, :]
            precision = Vindex(tau.unsqueeze(-3))[..., z, :]
            pyro.sample("x", dist.Normal(loc, precision.rsqrt()).to_event(1), obs=x)


class ComponentPriors(NamedTuple):
    """The prior hyperparameters of :func:`vmp_gmm_components_model`, one row per mixture
    component (C rows): π ~ Dirichlet(``concentration`` [C]), τ_c ~ Π_d Gamma(``shape``
    [C, D], ``rate`` [C, D]) and μ_c | τ_c ~ N(``loc`` [C, D], (``strength`` [C, D] τ_c)⁻¹)."""

    concentration: torch.Tensor
    shape: torch.Tensor
    rate: torch.Tensor
    loc: torch.Tensor
    strength: torch.Tensor

    def append(self, other: ComponentPriors) -> ComponentPriors:
        """These components followed by ``other``'s (rows concatenated)."""
        return ComponentPriors(*(torch.cat([a, b.to(a)]) for a, b in zip(self, other, strict=True)))


def vmp_gmm_components_model(
    x: torch.Tensor, labels: torch.Tensor, observed: torch.Tensor, priors: ComponentPriors
) -> None:
    """:func:`vmp_gmm_model` with one prior row per component (:class:`ComponentPriors`).

    With the K class rows of :meth:`VMPGaussianMixture.component_priors` it is
    :func:`vmp_gmm_model`; appending the background's row
    (:meth:`VMPGaussianMixture.background_prior`: a broad Gaussian learnt from the base
    classes, its Dirichlet weight from ``open_prior``) makes it the declared open-set
    model of :meth:`VMPGaussianMixture.predict_proba_open`: the support is labelled in
    0..K-1, the queries' z ranges over the K + 1 components, and q(z_q = K) is the
    posterior probability of "none of these classes". Every update is derived by
    :class:`~probfsl.inference.VMP` (Winn & Bishop 2005).
    """
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(priors.concentration.to(x).unsqueeze(0)))
        with pyro.plate("classes", priors.concentration.shape[0], dim=-1):
            strength = priors.strength.to(x)
            tau = pyro.sample("tau", dist.Gamma(priors.shape.to(x), priors.rate.to(x)).to_event(1))
            mu = pyro.sample(
                "mu", dist.Normal(priors.loc.to(x), (strength * tau).rsqrt()).to_event(1)
            )
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            loc = Vindex(mu.unsqueeze(-3))[..., z, :]
            precision = Vindex(tau.unsqueeze(-3))[..., z, :]
            pyro.sample("x", dist.Normal(loc, precision.rsqrt()).to_event(1), obs=x)


def vmp_gmm_full_model(
    x: torch.Tensor,
    labels: torch.Tensor,
    observed: torch.Tensor,
    way: int,
    prior_scale: torch.Tensor,
    nu0: float,
    alpha0: float = 2.0,
    beta0: float = 1.0,
) -> None:
    """The same mixture with a full precision per class: Λ_k ~ Wishart(ν_0, W_0) and
    μ_k | Λ_k ~ N(0, (β_0 Λ_k)⁻¹) (Normal-Wishart, PRML §10.2)."""
    t, n, d = x.shape
    with pyro.plate("tasks", t, dim=-2):
        pi = pyro.sample("pi", dist.Dirichlet(x.new_full((1, way), alpha0)))
        with pyro.plate("classes", way, dim=-1):
            scale = prior_scale.to(x)
            lam = pyro.sample("lam", dist.Wishart(x.new_tensor(nu0), covariance_matrix=scale))
            mu = pyro.sample(
                "mu", dist.MultivariateNormal(x.new_zeros(d), precision_matrix=beta0 * lam)
            )
        with pyro.plate("points", n, dim=-1):
            z = pyro.sample("z", dist.Categorical(pi), obs=labels, obs_mask=observed)
            loc = Vindex(mu.unsqueeze(-3))[..., z, :]
            precision = Vindex(lam.unsqueeze(-4))[..., z, :, :]
            pyro.sample("x", dist.MultivariateNormal(loc, precision_matrix=precision), obs=x)


class SeededVMP(VMP):
    """:class:`~probfsl.inference.VMP` on :func:`vmp_gmm_model` (or the full model) whose
    ``init(x, labels, observed)`` starts q(z) from soft k-means seeded by the support, the
    first ``n_support`` points of every task (BAVARDAGE's initialiser, Hu et al. §4.2).

    Args:
        model: the mixture, with every argument but the data bound.
        way: number of classes.
        n_support: support points per task (their labels are ``labels[:, :n_support]``).
        temperature, n_kmeans: soft k-means.
        **kwargs: :class:`~probfsl.inference.VMP`'s (``max_iter``, ``tol``, ...).
    """

    def __init__(
        self,
        model: Any,
        way: int,
        n_support: int,
        temperature: float = 10.0,
        n_kmeans: int = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.way, self.n_support = int(way), int(n_support)
        self.temperature, self.n_kmeans = temperature, int(n_kmeans)

    def init(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        observed: torch.Tensor,
        init_resp: dict | None = None,
    ) -> VMPState:
        """Soft k-means responsibilities [T, N, K] (support rows one-hot), then ``VMP.init``."""
        if init_resp is None:
            support = labels[:, : self.n_support]
            resp = soft_kmeans_gram(
                x @ x.transpose(1, 2), support, self.way, self.temperature, self.n_kmeans
            )
            init_resp = {"z": resp}
        return super().init(x, labels, observed, init_resp=init_resp)


class VMPGaussianMixture(OpenSetBackground, FewShotClassifier):
    """Transductive VB mixture with per-class diagonal Gamma precisions (module docstring).

    Args:
        alpha0: Dirichlet concentration of the class proportions.
        beta0: prior strength of the centroids, μ_k ~ N(0, (β_0 τ_k)⁻¹).
        a0: Gamma shape of each precision (its prior weight, in pseudo-observations / 2).
        temperature, n_kmeans: the soft k-means initialiser.
        max_iter, tol: VMP sweeps and per-task relative ELBO tolerance.
        precision: ``"diagonal"`` (Gamma per class and feature) or ``"full"`` (Wishart per
            class, ν_0 = D − 1 + 2 a_0 so that D = 1 is the Gamma case, E Λ_k = diag(1/v));
            the full model's Pyro trace holds a D x D matrix per point, so tasks are
            processed ``chunk`` at a time.
        chunk: tasks per batch with ``precision="full"``.
        open_prior: prior mean of the open fraction in :meth:`predict_proba_open`.
        open_model: how :meth:`predict_proba_open` reads "none of these classes" with
            ``precision="diagonal"``: ``"nested"`` (hand-written updates, the open
            decision from the two-covariance contrast of the base classes) or
            ``"declared"`` (the background as one more component of the Pyro model,
            :func:`vmp_gmm_components_model`, every update derived by VMP).
        background_weight: pseudo-observations of the declared background's prior
            (:meth:`background_prior`).
        open_scale, open_shift: a and b of P'(open) = σ(a logit P(open) + b), the
            calibration of :meth:`predict_proba_open`'s last column (``preset="auto"``
            learns a); ``None`` (the defaults): as held-out base classes ask
            (:meth:`~probfsl.models.base.OpenSetBackground.open_calibration`).
        open_frame: the frame of the open contrast of :meth:`predict_proba_open`:
            ``"queries"`` (the task re-centred on its queries' mean and normalised again,
            and, after the iterations, the background's mean inferred from the queries
            for the last reading of P(open),
            :meth:`~probfsl.models.base.OpenSetBackground.final_open`; transductive) or
            ``"base"`` (centred on the base mean only;
            :class:`~probfsl.inference.background.TwoCovarianceReading`,
            ``query_centring``). Default ``"queries"``, the higher AUROC where about
            half the queries are open, as ``open_prior`` = 1/2 assumes; with a tenth
            open, ``"base"`` ranks better, and ``preset="auto"`` chooses between them on
            base episodes with the run's open queries (docs/methods/open-set.md); not read
            with ``precision="full"``.
        open_neighbours: k, the nearest queries each query's P(open) log-odds are
            averaged with (:meth:`~probfsl.models.base.OpenSetBackground.tempered_open`);
            default 0, none.
    """

    transductive = True
    needs_base = True
    call_diagnostics = ("episode_objective_",)
    schema = EstimatorSchema(
        params={
            "alpha0": Real(positive=True),
            "beta0": Real(positive=True),
            "a0": Real(positive=True),
            "temperature": Real(positive=True),
            "n_kmeans": Int(low=1),
            "max_iter": Int(low=1),
            "tol": Real(nonnegative=True),
            "precision": Choice(("diagonal", "full")),
            "chunk": Int(low=1),
            "open_prior": OPEN_PRIOR,
            "open_model": Choice(("nested", "declared")),
            "background_weight": Real(positive=True),
            "open_scale": Real(positive=True, optional=True),
            "open_shift": Real(optional=True),
            "open_frame": Choice(OPEN_FRAMES),
            "open_neighbours": OPEN_NEIGHBOURS,
        },
        # the base mean [D] and the average within-class variance of each normalised
        # feature [D] (floored at 1e-8)
        fitted=(
            Group(
                "fit_base",
                {
                    "base_mean_": Tensor("D", bound=FEATURE_BOUND),
                    "within_var_": Tensor("D", bound=FEATURE_BOUND, positive=True),
                },
            ),
            BACKGROUND,
        ),
    )

    def __init__(
        self,
        alpha0: float = 2.0,
        beta0: float = 1.0,
        a0: float = 10.0,
        temperature: float = 10.0,
        n_kmeans: int = 5,
        max_iter: int = 30,
        tol: float = 1e-6,
        precision: str = "diagonal",
        chunk: int = 50,
        open_prior: float = 0.5,
        open_model: str = "nested",
        background_weight: float = 10.0,
        open_scale: float | None = None,
        open_shift: float | None = None,
        open_frame: str = "queries",
        open_neighbours: int = 0,
    ) -> None:
        self.alpha0, self.beta0, self.a0 = alpha0, beta0, a0
        self.temperature, self.n_kmeans = temperature, n_kmeans
        self.max_iter, self.tol = max_iter, tol
        self.precision, self.chunk = precision, chunk
        self.open_prior, self.open_model = open_prior, open_model
        self.background_weight = background_weight
        self.open_scale = open_scale
        self.open_shift = open_shift
        self.open_frame = open_frame
        self.open_neighbours = open_neighbours

    def fit_base(self, features: Any, labels: Any) -> Self:
        """Base mean and the average within-class variance of each normalised feature."""
        self._check_params()
        features, labels = check_base(features, labels)
        self.base_mean_ = features.mean(0)
        x = center_and_normalize(features, self.base_mean_)
        classes, inverse = labels.unique(return_inverse=True)
        counts = torch.bincount(inverse, minlength=len(classes)).to(x)
        means = x.new_zeros(len(classes), x.shape[1]).index_add_(0, inverse, x)
        means = means / counts.unsqueeze(-1)
        self.within_var_ = (x - means[inverse]).square().mean(0).clamp_min(1e-8)
        self.fit_background(x, labels)
        return self

    def engine(self, way: int, n_support: int) -> SeededVMP:
        """The VMP engine of this estimator for ``way`` classes and ``n_support`` support
        points per task; its data are :meth:`engine_data`'s (x, labels, observed)."""
        if getattr(self, "base_mean_", None) is None:
            raise ValueError("vmp-gmm needs base features: call fit_base first")
        if self.precision == "full":
            d = self.within_var_.shape[0]
            nu0 = d - 1 + 2 * self.a0
            model = partial(
                vmp_gmm_full_model,
                way=way,
                prior_scale=torch.diag(1 / (nu0 * self.within_var_)),
                nu0=nu0,
                alpha0=self.alpha0,
                beta0=self.beta0,
            )
        else:
            model = partial(
                vmp_gmm_model,
                way=way,
                prior_rate=self.a0 * self.within_var_,
                alpha0=self.alpha0,
                beta0=self.beta0,
                a0=self.a0,
            )
        return SeededVMP(
            model,
            way,
            n_support,
            self.temperature,
            int(self.n_kmeans),
            max_iter=int(self.max_iter),
            tol=self.tol,
            warn=False,  # max_iter is this estimator's budget of sweeps
            # the model uses x as the observation of site "x" alone (its dtype aside); the
            # full model's is a MultivariateNormal, which Plan.observe does not take
            plans=kept_plans(self, "closed", {0: "x"}) if self.precision == "diagonal" else None,
        )

    def component_priors(self, way: int) -> ComponentPriors:
        """The K class rows of :func:`vmp_gmm_model`'s priors: concentration α_0,
        τ_k ~ Π_d Gamma(a_0, a_0 v_d), μ_k | τ_k ~ N(0, (β_0 τ_k)⁻¹)."""
        if getattr(self, "within_var_", None) is None:
            raise ValueError("vmp-gmm needs base features: call fit_base first")
        v = self.within_var_
        d = v.shape[0]
        return ComponentPriors(
            v.new_full((way,), self.alpha0),
            v.new_full((way, d), self.a0),
            (self.a0 * v).expand(way, d),
            v.new_zeros(way, d),
            v.new_full((way, d), self.beta0),
        )

    def background_prior(self, way: int) -> ComponentPriors:
        """The background's prior row: a new class's predictive under the base classes'
        two-covariance model, N(m, diag(v_tot)) per feature (m the mean of the base class
        means, v_tot,d the within- plus between-class variance of feature d, in the
        normalised space of the classes; :func:`~probfsl.inference.background.fit_background`),
        with the weight of w = ``background_weight`` pseudo-observations: τ_K ~ Π_d Gamma(w,
        w v_tot,d) and μ_K | τ_K ~ N(m, (w τ_K)⁻¹) (a large w holds it there; a small one
        lets each task's open queries move it). Its Dirichlet concentration
        K α_0 p / (1 - p) gives the open fraction π_K ~ Beta(K α_0 p / (1 - p), K α_0) the
        prior mean p = ``open_prior`` and leaves the classes' proportions given "known"
        their Dirichlet(α_0, ..., α_0) (the aggregation property)."""
        stats = self.background_stats(self.within_var_)
        total = torch.diagonal(stats.total).clamp_min(1e-8)
        w = float(self.background_weight)
        return ComponentPriors(
            total.new_full((1,), way * self.alpha0 * self.open_prior / (1 - self.open_prior)),
            torch.full_like(total, w).unsqueeze(0),
            (w * total).unsqueeze(0),
            stats.mean.unsqueeze(0),
            torch.full_like(total, w).unsqueeze(0),
        )

    def open_priors(self, way: int) -> ComponentPriors:
        """The declared open model's K + 1 prior rows: the closed model's
        (:meth:`component_priors`) and the background's (:meth:`background_prior`)."""
        return self.component_priors(way).append(self.background_prior(way))

    def open_engine(self, way: int) -> VMP:
        """The VMP engine of the declared open model, :func:`vmp_gmm_components_model`
        with :meth:`open_priors`; its data and start are :meth:`open_data`'s."""
        model = partial(vmp_gmm_components_model, priors=self.open_priors(way))
        plans = kept_plans(self, "open", {0: "x"})
        return VMP(model, max_iter=int(self.max_iter), tol=self.tol, warn=False, plans=plans)

    def open_data(self, episodes: Episodes) -> tuple[tuple, dict]:
        """The declared open model's data, :meth:`engine_data`'s (x, labels, observed),
        and its start {"z": [T, N, K + 1]}: soft k-means seeded by the support with the
        queries' background responsibility read from the two-covariance contrast of the
        base classes (:func:`soft_kmeans_gram_open` with ``open_log_odds``, the start of
        the nested model too)."""
        x, labels, observed = self.engine_data(episodes)
        n_s, way = episodes.support.shape[1], episodes.way
        reading = self._open_reading(x, episodes)
        resp = soft_kmeans_gram_open(
            x @ x.transpose(1, 2),
            labels[:, :n_s],
            way,
            None,
            self.open_prior,
            self.temperature,
            int(self.n_kmeans),
            open_log_odds=reading.open_log_odds(),
        )
        return (x, labels, observed), {"z": resp}

    def _open_reading(self, x: torch.Tensor, episodes: Episodes) -> TwoCovarianceReading:
        """The two-covariance reading of the normalised points ``x`` [T, N, D] (support
        first) whose :meth:`~probfsl.inference.background.TwoCovarianceReading.open_log_odds`
        is the open contrast, in the frame ``open_frame`` names (``"queries"``: re-centred
        on the queries' mean and normalised again, with the blends chosen for that frame)."""
        n_s = episodes.support.shape[1]
        return self.open_reading(
            x[:, :n_s], episodes.support_labels, x[:, n_s:], episodes.way, self.in_queries_frame
        )

    def engine_data(self, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's data: normalised points x [T, N, D] (support first), labels [T, N]
        (zeros for the queries) and ``observed`` [T, N] (True on the support)."""
        if getattr(self, "base_mean_", None) is None:
            raise ValueError("vmp-gmm needs base features: call fit_base first")
        x = center_and_normalize(episodes.points(), self.base_mean_.to(episodes.support))
        t, n_s = x.shape[0], episodes.support.shape[1]
        labels = torch.zeros(t, x.shape[1], dtype=torch.long, device=x.device)
        labels[:, :n_s] = episodes.support_labels
        observed = torch.zeros(t, x.shape[1], dtype=torch.bool, device=x.device)
        observed[:, :n_s] = True
        return x, labels, observed

    def _state(self, episodes: Episodes) -> VMPState:
        data = self.engine_data(episodes)
        state, _ = self.engine(episodes.way, episodes.support.shape[1]).fit(*data)
        return state

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        self._check_params()
        mean = getattr(self, "base_mean_", None)
        check_episodes(episodes, dim=None if mean is None else mean.shape[0])
        n_s = episodes.support.shape[1]
        if self.precision == "diagonal":
            state = self._state(episodes)
            self.episode_objective_ = state.objective
            return state.q["z"][0][:, n_s:]
        probs, elbo = [], []
        for start in range(0, len(episodes), int(self.chunk)):
            state = self._state(episodes[start : start + int(self.chunk)])
            probs.append(state.q["z"][0][:, n_s:])
            elbo.append(state.objective)
        self.episode_objective_ = torch.cat(elbo)
        return torch.cat(probs)

    @property
    def infers_open_fraction(self) -> bool:
        """True but with ``precision="full"``, whose P(open) is the inductive posterior."""
        return self.precision != "full"

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K+1]``: the mixture with a background component, the background last,
        its log-odds scaled by ``open_scale`` and moved by ``open_shift``
        (:meth:`~probfsl.models.base.OpenSetBackground.tempered_open`).

        ``precision="diagonal"``, ``open_model="declared"``: the posterior q(z) of the
        queries in :func:`vmp_gmm_components_model` with the K class rows and the
        background's row (:meth:`open_priors`), fitted by the VMP engine derived from it
        (:meth:`open_engine`) for ``max_iter`` sweeps from :meth:`open_data`'s start.

        ``precision="diagonal"``, ``open_model="nested"`` (default): the same model
        (Dirichlet weights, per-class diagonal Gamma precision, Normal centroids) with one
        more component read in the nested form, by hand-written mean-field updates:
        q(μ_k, τ_k) Normal-Gamma from the support and the queries weighted by
        their class responsibilities, q(π) Dirichlet, q(π_0) Beta (prior mean
        ``open_prior``); a query's background responsibility is σ(E ln π_0 - E ln(1 - π_0)
        + ln p_0(x) - ln p_closed(x)), the two-covariance contrast of the base classes in
        the full feature space, and its class responsibilities (1 - o_q0) times the
        mixture's among the classes. ``max_iter`` sweeps from soft k-means with the same
        background. ``precision="full"``: :meth:`predict_proba` times 1 - P(open) and
        P(open) last, the inductive two-covariance posterior
        (:meth:`~probfsl.models.base.OpenSetBackground.inductive_open`); ``open_model`` is
        not read.
        """
        return self.tempered_open(episodes)

    def inferred_open(self, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """The known classes' shares [T, Q, K] and the log-odds of P(open) [T, Q] as
        inferred, before ``open_scale`` and ``open_shift``: the nested model's last reading
        (:meth:`final_open`), the natural parameters of q(z) in the declared model
        (:meth:`VMP.natural <probfsl.inference.vmp.engine.VMP.natural>`), or
        ``precision="full"``'s inductive reading
        (:meth:`~probfsl.models.base.OpenSetBackground.inductive_open_log_odds`)."""
        if self.precision != "diagonal":
            proba = self.predict_proba(episodes)
            mean = self.base_mean_ if getattr(self, "center", True) else None
            support = center_and_normalize(episodes.support, mean)
            query = center_and_normalize(episodes.query, mean)
            # in the base frame, whatever open_frame (which names the nested reading's)
            return proba, self.inductive_open_log_odds(episodes, support, query, False).to(proba)
        self._check_params()
        if getattr(self, "base_mean_", None) is None:
            raise ValueError("vmp-gmm needs base features: call fit_base first")
        check_episodes(episodes, dim=self.base_mean_.shape[0])
        if self.open_model == "declared":
            data, start = self.open_data(episodes)
            engine = self.open_engine(episodes.way)
            state, _ = engine.fit(*data, init_resp=start)
            self.episode_objective_ = state.objective
            # q(z) of the queries from its natural parameters (z is updated last in every
            # sweep, so their softmax is q(z)): exact log-odds where P(open) rounds to 1
            eta = engine.natural(state, "z")[0][:, episodes.support.shape[1] :]
            return eta[..., :-1].softmax(-1), eta[..., -1] - eta[..., :-1].logsumexp(-1)
        x, _, _ = self.engine_data(episodes)
        way, n_s = episodes.way, episodes.support.shape[1]
        reading = self._open_reading(x, episodes)
        odds = reading.open_log_odds()
        resp = soft_kmeans_gram_open(
            x @ x.transpose(1, 2),
            episodes.support_labels,
            way,
            None,
            self.open_prior,
            self.temperature,
            int(self.n_kmeans),
            open_log_odds=odds,
        )
        support_resp = resp[:, :n_s, :way]
        q_resp, open_resp = resp[:, n_s:, :way], resp[:, n_s:, way]
        rate0 = (self.a0 * self.within_var_).to(x)
        d, x_sq = x.shape[-1], x.square()
        digamma = torch.digamma
        for _ in range(int(self.max_iter)):
            r = torch.cat([support_resp, q_resp], 1)  # [T, N, K]
            counts = r.sum(1)  # [T, K]
            s1 = r.transpose(1, 2) @ x  # [T, K, D]
            s2 = r.transpose(1, 2) @ x_sq
            beta = self.beta0 + counts
            mean = s1 / beta.unsqueeze(-1)
            shape = self.a0 + 0.5 * counts  # [T, K]
            rate = rate0 + 0.5 * (s2 - s1 * mean).clamp_min(0)  # [T, K, D]
            prec = shape.unsqueeze(-1) / rate
            alpha = self.alpha0 + counts
            xq, xq_sq = x[:, n_s:], x_sq[:, n_s:]
            maha = xq_sq @ prec.transpose(1, 2) - 2 * xq @ (prec * mean).transpose(1, 2)
            maha = maha + (prec * mean.square()).sum(-1).unsqueeze(1)  # [T, Q, K]
            log_lik = (
                0.5 * (d * digamma(shape) - rate.log().sum(-1) - d / beta).unsqueeze(1) - 0.5 * maha
            )
            log_pi = digamma(alpha) - digamma(alpha.sum(-1, keepdim=True))
            classes = torch.softmax(log_lik + log_pi.unsqueeze(1), -1)
            logit = open_log_ratio(odds, open_resp, self.open_prior)
            open_resp = torch.sigmoid(logit)
            q_resp = classes * torch.sigmoid(-logit).unsqueeze(-1)  # exact near o_q0 = 1
        proba = torch.cat([q_resp, open_resp.unsqueeze(-1)], -1)
        return self.final_open(reading, proba)  # the task's own background, read last
