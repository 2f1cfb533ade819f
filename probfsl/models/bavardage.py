"""BAVARDAGE: a variational Bayesian Gaussian mixture in an adaptive PLDA subspace.

Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational Inference for
Transductive Few-Shot Classification" (AISTATS 2023); design:
docs/design/bavardage.md, which follows the authors' code (``yhu01/BAVARDAGE``) where it and
the paper differ.

The generative story (design §2; paper eq. 2), in the reduced space u ∈ R^d, d = K - 1:

    π ~ Dirichlet(α_o 1_K)                    (balanced variant: π = 1/K fixed)
    μ_k ~ Normal(0, (β_o τ)^{-1} I_d),        k = 1..K
    z_n ~ Categorical(π),                     n ∈ queries
    u_n ~ Normal(μ_{z_n}, τ^{-1} I_d),        n ∈ support (z_n = y_n observed) ∪ queries

with τ = T_vb fixed (:func:`bavardage_model`). What production runs: u = x P_b, x the
whitened rows of the task and P_b the adaptive PLDA projection onto the span of the
shrunk soft centroids (design §3.5), recomputed from the responsibilities at the start of
every VB iteration b. P_b is a fixed, non-random input of block b (a deterministic
function of the data and of the previous responsibilities), so the model of block b is
the mixture above with data u = x P_b, and each VB state is a mean-field posterior of
it. The closed-form engine is :class:`probfsl.inference.vb_mixture.BavardageVB` (its
docstring states the guarantees: coordinate ascent within a block, Pyro's
``Trace_ELBO`` equal to the analytic ELBO given P_b; no monotonicity across projection
updates); the whitening and the projection live in :mod:`probfsl.inference.plda`, the
Gram-matrix fast path in :mod:`probfsl.inference.gram`.

:class:`Bavardage` is the estimator: MESV preprocessing (design §3.1), soft k-means
initialisation (§3.4), then n_vb x (PLDA projection, M step, E step) (§3.8).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import NamedTuple, Self

import pyro
import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.derived.bavardage import ENGINES, OBSERVED_ROWS
from probfsl.derived.bavardage import bavardage_model as bavardage_model  # its declaration
from probfsl.inference.background import TwoCovarianceReading
from probfsl.inference.class_stats import class_means
from probfsl.inference.gram import centred_rows, task_grams
from probfsl.inference.plda import (
    GlobalWhitening,
    global_whitening,
    task_span_whitening,
    within_class_scatter,
)
from probfsl.inference.soft_kmeans import (
    soft_kmeans_gram,
    soft_kmeans_gram_open,
)
from probfsl.inference.vb_mixture import BavardageVB, VBMixtureState, fit_bavardage_vb
from probfsl.inference.vb_mixture_open import (
    OPEN_FRAMES,
    BavardageOpenVB,
    OpenBackground,
    with_free_components,
)
from probfsl.inference.vmp.plan_cache import kept_plans
from probfsl.models.base import (
    BACKGROUND,
    ENGINE,
    OPEN_NEIGHBOURS,
    OPEN_PRIOR,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.schema import (
    FEATURE_BOUND,
    Choice,
    EstimatorSchema,
    Flag,
    Group,
    Int,
    Items,
    Real,
    Record,
    Tensor,
)
from probfsl.validation import (
    as_float_tensor,
    as_label_tensor,
    check_base,
    check_episodes,
    check_hyperparameter,
)

#: Published hyperparameters (design §4; paper §4 and Appendix 6.3). α_o = 2, β_o = 10,
#: γ = 10, 5 soft k-means and 5 VB iterations everywhere; FC100 and CIFAR-FS use mini's.
PRESETS: dict[str, dict] = {
    "mini-balanced": dict(temperature_km=10.0, temperature_vb=50.0, s_max=2.0, balanced=True),
    "mini-unbalanced": dict(temperature_km=50.0, temperature_vb=50.0, s_max=1.0, balanced=False),
    "tiered-balanced": dict(temperature_km=10.0, temperature_vb=100.0, s_max=2.0, balanced=True),
    "tiered-unbalanced": dict(
        temperature_km=100.0, temperature_vb=100.0, s_max=1.0, balanced=False
    ),
    "cub": dict(temperature_km=10.0, temperature_vb=4.0, s_max=5.0),
}

#: Where the published values were tuned: (images per base class, feature dimension):
#: mini-ImageNet 600 (WRN-28-10, 640-d), tiered-ImageNet 448,695 / 351 (WRN, 640-d), CUB
#: about 60 (ResNet-18, 512-d); these are the factors of design §3.2.
PUBLISHED_SCALE: dict[str, tuple[float, int]] = {
    "mini": (600.0, 640),
    "tiered": (1278.0, 640),
    "cub": (60.0, 512),
}

#: Assumed mean squared distance of a unit-norm base feature to its class mean (w of
#: :meth:`Bavardage.fit_base`); it is 0.40-0.47 on the shipped and shared feature sets.
ASSUMED_WITHIN = 0.45


def relative_values(name: str) -> dict:
    """A published preset re-expressed in the units of ``scale="relative"``.

    With the code's S_w (design §3.2), S_w ~ n Sigma_w for n images per base class and
    Sigma_w the per-image within-class covariance of the unit-norm features, whose trace
    is w. So the code's whitened within-class variance is ~1/n per direction and the
    relative precision is T_vb / n; the whitening scale of an average direction is
    sqrt(D / tr S_w) ~ sqrt(D / (n w)) and the relative clamp is s_max / that scale.
    w is not published: :data:`ASSUMED_WITHIN`.
    """
    n, dim = PUBLISHED_SCALE[name.split("-")[0]]
    values = PRESETS[name]
    return {
        **values,
        "temperature_vb": round(values["temperature_vb"] / n, 4),
        "s_max": round(values["s_max"] * (n * ASSUMED_WITHIN / dim) ** 0.5, 3),
        "scale": "relative",
    }


PRESETS.update({f"{name}-relative": relative_values(name) for name in list(PRESETS)})
SCALES = ("code", "relative")

WHITENINGS = ("task_span", "global")
MODES = ("bavardage", "vb", "soft_kmeans")

#: the whitening clamp: positive, inf or None (no clamping)
S_MAX = Real(positive=True, infinite=True, optional=True)

#: what ``fit_base`` sets, always in float64 (D the width of the base features): the base
#: mean, S_w [D, D], its inverse and eigendecomposition, the mean squared distance to the
#: class means, the clamp and precision in the code's units and the global whitening
BASE_STATISTICS = Group(
    "fit_base",
    {
        "base_mean_": Tensor("D", bound=FEATURE_BOUND),
        "scatter_": Tensor("D", "D", bound=FEATURE_BOUND),
        "precision_": Tensor("D", "D"),
        "scatter_eigen_": Items(Tensor("D", bound=FEATURE_BOUND), Tensor("D", "D")),
        "within_": Real(positive=True),
        "s_max_": S_MAX,
        "temperature_vb_": Real(positive=True),
        "whitening_": Record(
            GlobalWhitening,
            {
                "rotation": Tensor("D", "D"),
                "scales": Tensor("D", nonnegative=True),
                "s_max": S_MAX,
            },
        ),
    },
    dtype=torch.float64,
)


class OpenProblem(NamedTuple):
    """The open-set VB problem of a batch (:meth:`Bavardage.open_problem`).

    Attributes:
        engine: the open-set engine (None with ``mode="soft_kmeans"``, which runs none).
        support, support_labels, query: the rows the engine's projection acts on.
        resp: soft k-means with the background and J free components,
            ``[T, N, K + J + 1]`` (the classes, the free components, the background last;
            a query's first K + J columns sum to 1 - o_q0).
        open_log_odds: ln p_0(x_q) - ln p_closed(x_q) of the queries, ``[T, Q]``.
        reading: the two-covariance reading the contrast came from, for the last reading
            of P(open) (:meth:`~probfsl.models.base.OpenSetBackground.final_open`).
    """

    engine: BavardageOpenVB | None
    support: torch.Tensor | None
    support_labels: torch.Tensor
    query: torch.Tensor | None
    resp: torch.Tensor
    open_log_odds: torch.Tensor
    reading: TwoCovarianceReading | None = None


#: the Gram matrices K of distinct whitening scales kept for a search's batch (one per
#: s_max of the default search space)
SCALED_GRAMS_KEPT = 5


def _unit_rows(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reciprocal norms [T, N] of the rows whose Gram matrices are ``gram`` [T, N, N]
    (floored as :func:`torch.nn.functional.normalize` floors the norm) and their outer
    products [T, N, N]: MESV's "E" (unit rows) applied to Gram matrices."""
    inv_norm = gram.diagonal(dim1=1, dim2=2).sqrt().clamp_min(1e-12).reciprocal()
    return inv_norm, inv_norm.unsqueeze(-1) * inv_norm.unsqueeze(1)


class Bavardage(OpenSetBackground, FewShotClassifier):
    """BAVARDAGE transductive few-shot classifier (Hu, Pateux & Gripon, AISTATS 2023).

    Defaults are the reference code's command-line defaults (= the CUB setting, design §4
    and §9) with the unbalanced (Dirichlet) model; :data:`PRESETS` and
    :meth:`from_preset` give the published settings.

    Args:
        temperature_km: T_km, inverse temperature of the soft k-means initialisation.
        temperature_vb: T_vb = τ, the fixed precision of the mixture components.
        s_max: upper bound of the whitening scales (eq. 7); None for no clamping.
        alpha0: α_o of the Dirichlet prior on π (set it to the benchmark's α*).
        beta0: β_o of the prior on the centroids.
        gamma: shrinkage γ of the centroids defining the projection (default β_o).
        n_km: soft k-means passes. n_vb: VB iterations (PLDA, M, E).
        balanced: π fixed uniform (the code's balanced mode, for balanced benchmarks).
        count_support: the paper's α update α_o + N_k (the code's is α_o + N_k - L).
        whitening: ``"task_span"`` (the code's per-task whitening, default) or
            ``"global"`` (the paper's one D x D eigendecomposition: identical results when
            s_max does not clamp, much faster).
        mode: ``"bavardage"`` (full method), ``"vb"`` (ablation: VB in the full
            preprocessed feature space, no PLDA) or ``"soft_kmeans"`` (ablation: the
            initialisation only).
        scatter: S_w normalisation, ``"code"`` (default) or ``"paper"`` (eq. 6).
        scale: the units of ``s_max`` and ``temperature_vb``. ``"code"`` (default): those
            of the reference code, in which the published values were tuned; they depend
            on the images per base class and the feature dimension (design §3.2, §3.10
            item 3). ``"relative"``: units that mean the same on any data. The clamp is
            s_max times the whitening scale of an average direction, sqrt(D / tr S_w),
            and the precision is T_vb times the whitened within-class precision
            tr S_w / w, with w = tr Sigma_w the mean squared distance of a base feature
            to its class mean (so T_vb = 1 matches the spread of a base class). The ``*-relative``
            presets map the published values (:func:`relative_values`).
        trace_elbo: keep the ELBO after every VB iteration in ``elbo_trace_`` (a
            diagnostic that costs nothing: the VB loop computes it anyway; the final ELBO
            is always in ``state_.objective``).
        engine: ``"handwritten"`` (the closed-form VB updates of
            :mod:`probfsl.inference.vb_mixture`) or ``"derived"`` (the same loop with the
            updates that VMP derives from :func:`bavardage_model`,
            :mod:`probfsl.derived.bavardage`).
        open_prior: prior mean of the open fraction π_0 (:meth:`predict_proba_open`).
        n_free: free components J of the open-set mixture (:meth:`predict_proba_open`;
            at most the queries of a task are used); 0 (the default) for the background
            alone. At these defaults, on the built-in sets, three free components gathered
            closed queries as well as open ones and cost 2 to 5 points of closed accuracy
            with open queries at 1 and 5 shots on WordNet and at 1 shot on Omniglot;
            ``preset="auto"`` tries 0 and 3 (docs/methods/open-set.md).
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
            ``query_centring``). Default ``"base"``: the queries' frame raised the AUROC
            on the built-in sets, but on synthetic Gaussian tasks the closed-set accuracy
            with open queries fell in it (97.0% to 93.8%); ``preset="auto"`` chooses
            between the two on base-class episodes with open queries
            (docs/methods/open-set.md).
        open_neighbours: k, the nearest queries each query's P(open) log-odds are
            averaged with (:meth:`~probfsl.models.base.OpenSetBackground.tempered_open`);
            default 0, none.

    Open set (:meth:`predict_proba_open`): the mixture gains a background component,
    inside the soft k-means initialisation and every VB iteration, with its weight π_0
    inferred per task (:mod:`probfsl.inference.vb_mixture_open`; always the
    hand-written updates). A query's background-vs-classes split is taken in the full
    centred, normalised feature space: the base classes' two-covariance predictive of a
    new class against the known classes' predictives given the support
    (:class:`~probfsl.inference.background.TwoCovarianceReading`); among the classes,
    BAVARDAGE's own (projected) responsibilities, times 1 - o_q0, so that a query's
    background share pulls neither the centroids nor the projection. Beside the K
    classes, ``n_free`` free components (no support, means drawn from the prior of every
    component, started at the queries the odds rank most open, in soft k-means and in VB)
    give the open queries clusters of their own, so that a query the odds leave "closed"
    need not be shared among the known classes; P(open) is the mass of the background
    and the free components.

    Fitted attributes: ``base_mean_``, ``scatter_``, ``precision_``, ``whitening_``,
    ``s_max_`` and ``temperature_vb_`` (the values used, in the code's units),
    (a :class:`~probfsl.inference.plda.GlobalWhitening`), and after ``predict_proba``
    the last batch's ``state_`` (variational factors; ``state_.objective`` is the final
    ELBO), ``init_resp_`` and, with ``trace_elbo``, ``elbo_trace_`` ([n_vb + 1, T]: the
    ELBO after each M step and after the final E step, each under that iteration's
    projection; None otherwise).
    """

    transductive = True
    needs_base = True
    call_diagnostics = ("init_resp_", "state_", "elbo_trace_")
    schema = EstimatorSchema(
        params={
            "temperature_km": Real(positive=True),
            "temperature_vb": Real(positive=True),
            "s_max": S_MAX,
            "alpha0": Real(positive=True),
            "beta0": Real(positive=True),
            "gamma": Real(nonnegative=True, optional=True),
            "n_km": Int(low=1),
            "n_vb": Int(low=1),
            "balanced": Flag(),
            "count_support": Flag(),
            "whitening": Choice(WHITENINGS),
            "mode": Choice(MODES),
            "scatter": Choice(("code", "paper")),
            "scale": Choice(SCALES),
            "trace_elbo": Flag(),
            "engine": ENGINE,
            "open_prior": OPEN_PRIOR,
            "n_free": Int(low=0),
            "open_scale": Real(positive=True, optional=True),
            "open_shift": Real(optional=True),
            "open_frame": Choice(OPEN_FRAMES),
            "open_neighbours": OPEN_NEIGHBOURS,
        },
        fitted=(BASE_STATISTICS, BACKGROUND),
    )

    def __init__(
        self,
        temperature_km: float = 10.0,
        temperature_vb: float = 4.0,
        s_max: float | None = 5.0,
        alpha0: float = 2.0,
        beta0: float = 10.0,
        gamma: float | None = None,
        n_km: int = 5,
        n_vb: int = 5,
        balanced: bool = False,
        count_support: bool = False,
        whitening: str = "task_span",
        mode: str = "bavardage",
        scatter: str = "code",
        scale: str = "code",
        trace_elbo: bool = False,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        n_free: int = 0,
        open_scale: float | None = None,
        open_shift: float | None = None,
        open_frame: str = "base",
        open_neighbours: int = 0,
    ) -> None:
        self.temperature_km = temperature_km
        self.temperature_vb = temperature_vb
        self.s_max = s_max
        self.alpha0 = alpha0
        self.beta0 = beta0
        self.gamma = gamma
        self.n_km = n_km
        self.n_vb = n_vb
        self.balanced = balanced
        self.count_support = count_support
        self.whitening = whitening
        self.mode = mode
        self.scatter = scatter
        self.scale = scale
        self.trace_elbo = trace_elbo
        self.engine = engine
        self.open_prior = open_prior
        self.n_free = n_free
        self.open_scale = open_scale
        self.open_shift = open_shift
        self.open_frame = open_frame
        self.open_neighbours = open_neighbours

    @classmethod
    def from_preset(cls, name: str, **overrides) -> Bavardage:
        """An estimator with the published setting ``name`` (see :data:`PRESETS`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    # ------------------------------------------------------------------ base statistics
    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        """Base mean (M), then S_w of the centred, L2-normalised base features (design §3.2).

        The statistics are computed and stored in float64 (a deliberate upcast: S_w is
        inverted and eigendecomposed once) and cast to each batch's dtype and device.
        ``features`` and ``labels`` may be tensors or NumPy arrays.
        """
        self._check_params()
        if features is None:
            raise TypeError("base features are missing: BAVARDAGE needs labelled base features")
        check_base(features, labels, min_classes=2)
        features = as_float_tensor(features, "base features", ndim=2)
        labels = as_label_tensor(labels, "base labels", n=features.shape[0])
        x = features.detach().to(torch.float64)
        self.base_mean_ = x.mean(0)
        x = x - self.base_mean_
        # exact power-of-two row scaling first: normalize's 1e-12 norm floor would leave
        # rows of tiny features (norm < 1e-12) unnormalised and S_w scale-dependent
        x = torch.ldexp(x, -torch.frexp(x.abs().amax(-1, keepdim=True)).exponent.clamp(-100, 100))
        x = center_and_normalize(x)
        labels = labels.to(x.device)
        self.scatter_ = within_class_scatter(x, labels, normalization=self.scatter)
        chol = torch.linalg.cholesky(self.scatter_)
        self.precision_ = torch.cholesky_inverse(chol)
        self.scatter_eigen_ = torch.linalg.eigh(self.scatter_)
        onehot = torch.nn.functional.one_hot(labels.unique(return_inverse=True)[1]).to(x)
        means = class_means(x.unsqueeze(0), onehot.unsqueeze(0)).squeeze(0)
        # floored so that scale="relative" stays finite when every base class is one point
        within = float((x - onehot @ means).square().sum(-1).mean())
        self.within_ = max(within, torch.finfo(torch.float64).eps)
        self.fit_background(x, labels)
        self._search_cache = None  # shared by with_params copies (see _rotated_grams)
        self._apply_hyperparameters()
        return self

    def _apply_hyperparameters(self) -> None:
        """Set s_max_, temperature_vb_ (code units) and whitening_ from the base statistics."""
        self.s_max_, self.temperature_vb_ = self.s_max, self.temperature_vb
        if self.scale == "relative":
            trace = float(self.scatter_.trace())
            self.temperature_vb_ = self.temperature_vb * trace / self.within_
            if self.s_max is not None:
                self.s_max_ = self.s_max * (self.scatter_.shape[0] / trace) ** 0.5
        self.whitening_ = global_whitening(self.scatter_, self.s_max_, self.scatter_eigen_)

    def _batch_cache(self, episodes: Episodes) -> dict | None:
        """The search's cache of ``episodes`` (shared by :meth:`with_params` copies; emptied
        when the batch changes), or ``None`` outside a search."""
        cache = getattr(self, "_search_cache", None)
        if cache is None:
            return None
        # the cache holds the batch's tensors, so identity means the same (unmodified) data
        if cache.get("support") is not episodes.support or cache.get("query") is not episodes.query:
            cache.clear()
            cache.update(support=episodes.support, query=episodes.query)
        return cache

    def _rotated_grams(
        self, episodes: Episodes, mean: torch.Tensor, metric: GlobalWhitening
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """E and K = Z diag(s^2) Z^T from the rotated rows Z = (x - m) R, which do not depend
        on s_max: kept for the last batch so that candidates of a search share them, with
        K for the last few whitening scales s (one per s_max of the search; the candidates
        that differ in T_vb or the Dirichlet weights alone reuse it: K costs T N^2 D)."""
        cache = self._batch_cache(episodes)
        if "rotated" not in cache:
            centred, gram = centred_rows(episodes.points(), mean)
            cache.update(gram=gram, rotated=centred @ metric.rotation, scaled=[])
        scales, kept = metric.scales, cache["scaled"]
        for known, k in kept:
            if known.shape == scales.shape and torch.equal(known, scales):
                return cache["gram"], k
        z = cache["rotated"]
        k = (z * scales.square()) @ z.transpose(1, 2)
        kept.append((scales, k))
        if len(kept) > SCALED_GRAMS_KEPT:
            kept.pop(0)
        return cache["gram"], k

    def _open_inputs(self, episodes: Episodes) -> tuple:
        """``(xn, gram, reading, odds)`` of :meth:`open_problem`, which no hyperparameter
        but ``open_frame`` changes: the centred, normalised rows [T, N, D] (``None`` where
        they were kept by a search, which needs them no further), their Gram matrices, the
        two-covariance reading in the estimator's frame (a fresh copy: the last reading of
        P(open) changes its background) and its contrast ln p_0 - ln p_closed [T, Q]. In a
        search the last three are kept for the batch and each frame, so its candidates
        read them once (at D = 2,048 most of a candidate's time otherwise)."""
        n_s, way = episodes.support.shape[1], episodes.way
        cache = self._batch_cache(episodes)
        frame = self.in_queries_frame
        kept = None if cache is None else cache.setdefault("open", {}).get(frame)
        xn = None
        if kept is None:
            xn = center_and_normalize(episodes.points(), self.base_mean_.to(episodes.support))
            reading = self.open_reading(
                xn[:, :n_s], episodes.support_labels, xn[:, n_s:], way, frame
            )
            # full-space background vs classes, [T, Q]
            kept = xn @ xn.transpose(1, 2), reading, reading.open_log_odds()
            if cache is not None:
                cache["open"][frame] = kept
        gram, reading, odds = kept
        return xn, gram, reading.copy(), odds

    def with_params(self, **params) -> Self:
        """A copy with hyperparameters ``params`` that shares the fitted base statistics.

        The base mean, S_w and its eigendecomposition do not depend on the hyperparameters
        (``scatter`` aside), so a search over candidates (:mod:`probfsl.tuning`) fits them once;
        in global whitening the copies also share the last batch's rows rotated into the
        eigenbasis of S_w, so that each further candidate costs an N x N product per task.
        """
        unknown = sorted(set(params) - set(inspect.signature(type(self)).parameters))
        if unknown:
            raise ValueError(f"unknown hyperparameter(s) {unknown}")
        if "scatter" in params and params["scatter"] != self.scatter:
            raise ValueError("with_params cannot change scatter: call fit_base again")
        if getattr(self, "_search_cache", None) is None:
            self._search_cache = {}
        new = copy.copy(self)
        new.__dict__.pop("_plan_caches", None)  # bavardage-gamma's derived plans: its own
        for key, value in params.items():
            setattr(new, key, value)
        new._check_params()
        if getattr(self, "base_mean_", None) is not None:
            new._apply_hyperparameters()
        return new

    @property
    def episode_objective_(self) -> torch.Tensor:
        """Per-task ELBO [T] of the last :meth:`predict_proba` (design §3.9), for model selection.

        ELBOs under different T_vb or s_max are of different data (u changes with the
        whitening); :mod:`probfsl.tuning` reports how well this ranks candidates.
        """
        if getattr(self, "state_", None) is None:
            raise ValueError("no ELBO: call predict_proba first (and mode != 'soft_kmeans')")
        return self.state_.objective

    @property
    def clamped_fraction_(self) -> float:
        """Fraction of the global whitening scales clamped at s_max (diagnostic)."""
        self._require_base()
        return self.whitening_.clamped_fraction

    def _require_base(self) -> None:
        if getattr(self, "base_mean_", None) is None:
            raise ValueError(
                "base features missing: call fit_base(features, labels) before predicting"
            )

    # ------------------------------------------------------------------ prediction
    def _engine(self, way: int, metric: GlobalWhitening | None, projection: str) -> BavardageVB:
        return BavardageVB(
            way,
            tau=self.temperature_vb_,
            alpha0=self.alpha0,
            beta0=self.beta0,
            gamma=self.gamma,
            balanced=self.balanced,
            count_support=self.count_support,
            projection=projection,
            metric=metric,
        )

    def _prepare(
        self, episodes: Episodes
    ) -> tuple[torch.Tensor, BavardageVB | None, tuple[torch.Tensor, ...] | None]:
        """Everything before the VB loop: ``(resp, engine, data)`` with ``resp`` the soft
        k-means responsibilities [T, N, K] and ``data`` the engine's inputs (both None in
        mode ``"soft_kmeans"``)."""
        self._check_params()
        self._require_base()
        check_episodes(episodes, dim=self.base_mean_.shape[0])
        way, n_s = episodes.way, episodes.support.shape[1]
        labels = episodes.support_labels
        # MESV "M": centre on the base mean; "E" (unit rows) is applied to the Gram matrices:
        # soft k-means, the global whitening (metric G = W W^T) and the centroid projection
        # only need inner products between a task's points (design §8).
        mean = self.base_mean_.to(episodes.support)
        global_mode = self.mode == "bavardage" and self.whitening == "global"
        metric = self.whitening_.to(mean) if global_mode else None
        grams = None
        if global_mode and getattr(self, "_search_cache", None) is not None:
            grams = self._rotated_grams(episodes, mean, metric)
        elif self.mode == "soft_kmeans" or (global_mode and metric.low_rank() is not None):
            grams = task_grams(episodes.points(), mean, metric)
        if grams is None:
            x, gram = centred_rows(episodes.points(), mean)  # MESV 'M'; 'E' is applied below
            k = metric.gram(x, euclidean=gram) if global_mode else None
        else:
            gram, k = grams
        inv_norm, outer = _unit_rows(gram)
        resp = soft_kmeans_gram(gram * outer, labels, way, self.temperature_km, int(self.n_km))
        if self.mode == "soft_kmeans":
            return resp, None, None
        if global_mode:
            k = k * outer  # not in place: a search's candidates share K (_rotated_grams)
            support, query = k[:, :n_s], k[:, n_s:]
            engine = self._engine(way, None, "adaptive_gram")
        else:
            x = x.mul_(inv_norm.unsqueeze(-1))
            if self.mode == "vb":
                engine = self._engine(way, None, "identity")
            else:
                x = task_span_whitening(x, self.precision_.to(x), self.s_max_)
                engine = self._engine(way, None, "adaptive")
            support, query = x[:, :n_s], x[:, n_s:]
        return resp, engine, (support, labels, query, resp)

    def vb_problem(self, episodes: Episodes) -> tuple[BavardageVB, tuple[torch.Tensor, ...]]:
        """The VB engine and its data for a batch, as :meth:`predict_proba` runs them.

        ``data = (support, support_labels, query, resp)``: the rows the projection acts on
        (whitened rows, or whitened Gram rows with ``whitening="global"``) and the soft
        k-means responsibilities; ``fit_bavardage_vb(engine, *data, n_vb)`` is the VB loop.
        For conformance tests and diagnostics of the production configuration.
        """
        _, engine, data = self._prepare(episodes)
        if engine is None:
            raise ValueError("mode='soft_kmeans' runs no VB engine")
        return engine, data

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Query responsibilities o [T, Q, K] after soft k-means and n_vb VB iterations."""
        resp, engine, data = self._prepare(episodes)
        self.init_resp_ = resp
        if engine is None:
            self.state_, self.elbo_trace_ = None, None
            return resp[:, episodes.support.shape[1] :]
        fit = ENGINES[self.engine]  # probfsl.derived.bavardage: "handwritten" or "derived"
        kept = {}  # the derived engine keeps its plan across calls
        if self.engine == "derived":
            kept["plans"] = kept_plans(self, "derived", OBSERVED_ROWS)
        state, info = fit(engine, *data, n_iter=int(self.n_vb), **kept)
        self.state_ = state
        self.elbo_trace_ = info.trace if self.trace_elbo else None
        return state.query_resp

    def open_problem(self, episodes: Episodes, n_free: int | None = None) -> OpenProblem:
        """Everything before the open-set VB loop of :meth:`predict_proba_open` (class
        docstring), for this estimator and the methods that extend its mixture.

        The full-space contrast ln p_0(x) - ln p_closed(x) of the queries (the
        two-covariance reading of the centred, normalised features), soft k-means with
        the background component from it and ``n_free`` free components (default the
        estimator's ``n_free``, at most the queries per task), and the open-set engine
        with the rows it acts on (the global whitening's Gram rows; the normalised rows
        with ``mode="vb"``). ``resp`` is then ``[T, N, K + J + 1]``.
        """
        self._check_params()
        self._require_base()
        check_episodes(episodes, dim=self.base_mean_.shape[0])
        way, n_s = episodes.way, episodes.support.shape[1]
        n_free = int(self.n_free if n_free is None else n_free)
        n_free = min(n_free, episodes.query.shape[1])
        xn, gram, reading, odds = self._open_inputs(episodes)
        resp = soft_kmeans_gram_open(
            gram,
            episodes.support_labels,
            way,
            None,
            self.open_prior,
            self.temperature_km,
            int(self.n_km),
            open_log_odds=odds,
            n_free=n_free,
        )
        labels = episodes.support_labels
        if self.mode == "soft_kmeans":
            return OpenProblem(None, None, labels, None, resp, odds, reading)
        mean = self.base_mean_.to(episodes.support)
        if self.mode == "vb":  # VB in the normalised feature space
            if xn is None:
                xn = center_and_normalize(episodes.points(), mean)
            rows, projection = xn, "identity"
        elif getattr(self, "_search_cache", None) is not None:  # in a search: from the
            # rotated rows its candidates share (_rotated_grams), as predict_proba does
            centred_gram, k = self._rotated_grams(episodes, mean, self.whitening_.to(mean))
            rows, projection = k * _unit_rows(centred_gram)[1], "adaptive_gram"
        else:  # the global whitening W (task_span's when s_max does not clamp)
            rows, projection = self.whitening_.to(xn).gram(xn, euclidean=gram), "adaptive_gram"
        closed = self._engine(way, None, projection)  # the estimator's settings
        background = OpenBackground(
            reading.background_log_lik(), None, episodes.support.shape[-1], open_log_odds=odds
        )
        open_engine = BavardageOpenVB(
            way,
            background,
            self.open_prior,
            n_free,
            tau=closed.tau,
            alpha0=closed.alpha0,
            beta0=closed.beta0,
            gamma=closed.gamma,
            balanced=closed.balanced,
            count_support=closed.count_support,
            projection=projection,
        )
        return OpenProblem(open_engine, rows[:, :n_s], labels, rows[:, n_s:], resp, odds, reading)

    @property
    def infers_open_fraction(self) -> bool:
        """True: q(π_0) per task, ``open_prior`` its prior mean."""
        return True

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """Open-set responsibilities ``[T, Q, K+1]`` (P(none of the K classes) last): soft
        k-means and n_vb VB iterations of the mixture with the background component and
        ``n_free`` free components (class docstring;
        :class:`~probfsl.inference.vb_mixture_open.BavardageOpenVB`); the last column is
        the background's and the free components' mass."""
        return self.tempered_open(episodes)

    def inferred_open(self, episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """The known classes' shares [T, Q, K] and the log-odds of P(open) [T, Q] as
        inferred, before ``open_scale`` and ``open_shift``: the background's last reading
        (:meth:`final_open`), with the free components' mass added to P(open)."""
        problem = self.open_problem(episodes)
        if problem.engine is None:
            resp = problem.resp[:, episodes.support.shape[1] :]
        else:
            state, _ = fit_bavardage_vb(
                problem.engine,
                problem.support,
                problem.support_labels,
                problem.query,
                problem.resp,
                int(self.n_vb),
            )
            resp = state.component_proba
        # K classes, J free components, the background; P(open) read last (queries' frame)
        shares, log_odds = self.final_open(problem.reading, resp)
        if shares.shape[-1] > episodes.way:  # free components: P(open) = o_q0 + their mass
            log_odds = with_free_components(log_odds, shares, episodes.way)
        return shares[..., : episodes.way], log_odds

    # ------------------------------------------------------------------ diagnostics
    def posterior_draws(
        self, n_draws: int = 200, seed: int = 0, tasks: slice | None = None
    ) -> dict[str, torch.Tensor]:
        """Draws ``[1, n_draws, T, ...]`` of ``pi``, ``mu`` and ``z`` from the last batch's
        variational posterior (design §2), through the engine's Pyro guide.

        The guide (:meth:`~probfsl.inference.vb_mixture.BavardageVB.guide`) runs once,
        vectorised over a ``draws`` plate. The random streams of the CPU and of the
        state's device are forked and seeded with ``seed``: the draws neither consume
        nor depend on the global streams.
        """
        state: VBMixtureState | None = getattr(self, "state_", None)
        if state is None:
            raise ValueError("no variational posterior: call predict_proba (mode != soft_kmeans)")
        check_hyperparameter("n_draws", n_draws, integer=True, low=1)
        if tasks is not None:
            state = _select_tasks(state, tasks)
        guide = self._engine(state.mean.shape[1], None, "identity").guide(state)
        with _seeded_rng(state.mean.device, seed), pyro.plate("draws", n_draws, dim=-3):
            trace = pyro.poutine.trace(guide).get_trace()
        sites = ("pi", "mu", "z") if state.alpha is not None else ("mu", "z")
        draws = {name: trace.nodes[name]["value"].detach() for name in sites}
        if "pi" in draws:
            draws["pi"] = draws["pi"].squeeze(-2)  # the guide's pi has a singleton class dim
        return {name: value.unsqueeze(0) for name, value in draws.items()}

    def to_datatree(self, n_draws: int = 200, seed: int = 0, tasks: slice | None = None):
        """Per-task posteriors of π, the centroids μ and the query labels z as a DataTree.

        The ELBO trace of the fit is in ``elbo_trace_`` (``trace_elbo=True``); R-hat is
        meaningless for these
        independent draws from closed-form factors (design §2).
        """
        from probfsl.diagnostics.arviz import to_datatree

        draws = self.posterior_draws(n_draws, seed, tasks)
        dims = {
            "pi": ["task", "cls"],
            "mu": ["task", "cls", "component"],
            "z": ["task", "query"],
        }
        return to_datatree(
            draws,
            dims={k: v for k, v in dims.items() if k in draws},
            attrs={
                "method": "BAVARDAGE",
                "tau": self.temperature_vb_,
                "elbo_final_mean": float(self.state_.objective.mean()),
            },
        )


def _select_tasks(state: VBMixtureState, tasks: slice) -> VBMixtureState:
    """The state of the tasks ``tasks`` (every tensor field indexed on its task dimension)."""
    chosen = {
        f.name: getattr(state, f.name)[tasks]
        for f in fields(state)
        if isinstance(getattr(state, f.name), torch.Tensor)
    }
    return replace(state, **chosen)


@contextlib.contextmanager
def _seeded_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Fork the random streams of the CPU and of ``device`` and seed both with ``seed``.

    ``torch.random.fork_rng(devices=[])`` alone would protect the CPU stream only: draws
    on a CUDA device would consume the global CUDA stream and depend on it. Here the
    device's own generator is saved, seeded and restored (and no other device's).
    """
    accelerator = [device] if device.type != "cpu" else []
    # device_type only with a device: torch <= 2.11 rejects None (torch.device(None))
    device_type = {"device_type": device.type} if accelerator else {}
    with torch.random.fork_rng(devices=accelerator, **device_type):
        torch.random.default_generator.manual_seed(seed)
        if accelerator:
            module = torch.get_device_module(device.type)
            with module.device(device):
                module.manual_seed(seed)
        yield
