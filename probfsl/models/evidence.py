"""Bayesian evidence LS-SVM: linear probes regularised and backbones ranked by the evidence.

Kim, Jang, Han, Choi, "Learning to Select Pre-Trained Deep Representations with
Bayesian Evidence Framework", CVPR 2016 (docs/design/evidence.md). The mathematics
(one eigendecomposition, Algorithm 1-2 with Aitken's step, safeguards) lives in
:mod:`probfsl.inference.evidence`.

Generative model, one problem per target column (one-vs-rest 0/1 targets, no bias):

    alpha, beta ~ flat (type-II maximum likelihood: point estimates)
    w ~ Normal(0, alpha^-1 I_D)
    y ~ Normal(X w, beta^-1 I_N)

* the method's one Pyro declaration, for both engines:
  :func:`~probfsl.derived.evidence.rotated_evidence_model`, this regression in the
  coordinates of the support's Gram eigendecomposition (the same evidence), with one
  lambda = alpha_k / beta_k per problem (a task: the estimator's default, shared by its
  targets; or one per class, the paper); with the exact posterior at an engine's lambda
  and beta as guide, Pyro's ``Trace_ELBO`` is the log evidence.
* :class:`EvidenceLSSVM`: ``fit_probe(X, y)`` / ``predict`` / ``predict_proba`` /
  ``log_evidence_`` with a shared (default; the engine, driven by
  :func:`~probfsl.inference.base.run`) or per-class lambda; also a batched few-shot classifier
  (``predict_proba(episodes)``) for ``probfsl run --method evidence-lssvm``.
* :func:`rank_backbones`, :func:`greedy_ensemble` (paper §3.4); ``probfsl select
  --features A.npz B.npz ...`` ranks feature files with :mod:`probfsl.selection`.
* :func:`evidence_datatree` / :func:`plot_evidence`: posterior of w and the evidence
  curve over lambda per class, as an ArviZ DataTree and a plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import torch

from probfsl.data.episodes import OPEN_FIELD
from probfsl.data.tasks import Episodes, check_task_indices
from probfsl.derived.evidence import ENGINES
from probfsl.inference.evidence import (
    EvidenceResult,
    Spectrum,
    conditional_log_evidence,
    evidence_curve,
    maximize_evidence,
    maximize_shared_evidence,
    pool_spectra,
    posterior_covariance,
    posterior_mean,
    solve_evidence,
    spectrum,
    spectrum_from_gram,
)
from probfsl.inference.vb_mixture_open import OPEN_FRAMES
from probfsl.models.base import (
    BACKGROUND,
    ENGINE,
    OPEN_PRIOR,
    FewShotClassifier,
    OpenSetBackground,
)
from probfsl.schema import (
    FEATURE_BOUND,
    Array,
    Choice,
    Dim,
    EstimatorSchema,
    Flag,
    FloatDType,
    Group,
    Int,
    Real,
    Record,
    Tensor,
)
from probfsl.validation import (
    as_float_tensor,
    as_label_tensor,
    check_base,
    check_episodes,
    check_float_dtype,
)

SCORES = ("sum", "mean_per_sample")

#: the per-class results of :meth:`EvidenceLSSVM.fit_probe`, ``[K]`` each (lambda and alpha
#: may be very large where the evidence has no finite maximiser)
_PER_CLASS = {
    "lam": Tensor("K", nonnegative=True),
    "alpha": Tensor("K", nonnegative=True),
    "beta": Tensor("K", nonnegative=True),
    "log_evidence": Tensor("K"),
    "n_iter": Tensor("K", kind="int"),
    "converged": Tensor("K", kind="bool"),
    "at_boundary": Tensor("K", kind="bool"),
    "degenerate": Tensor("K", kind="bool"),
}

#: what :meth:`EvidenceLSSVM.fit_probe` sets: N samples of width D, K targets; the spectrum
#: has R eigenvalues (R = D in the primal mode, the N x N Gram's in the dual mode)
SINGLE_PROBLEM = Group(
    "fit_probe",
    {
        "classes_": Array("K", kind="int"),
        "spectrum_": Record(
            Spectrum,
            {
                "mode": Choice(("dual", "primal")),
                "s": Tensor("R", nonnegative=True),
                "c": Tensor("R", "K", nonnegative=True),
                "e0": Tensor("K", nonnegative=True),
                "yy": Tensor("K", nonnegative=True),
                "n": Int(low=1),
                "dim": Dim("D"),
                "basis": Tensor("D", "R"),
                "proj": Tensor("R", "K"),
            },
            by="mode",
            variants={
                "dual": {},
                "primal": {
                    "s": Tensor("D", nonnegative=True),
                    "c": Tensor("D", "K", nonnegative=True),
                    "basis": Tensor("D", "D"),
                    "proj": Tensor("D", "K"),
                },
            },
        ),
        "result_": Record(EvidenceResult, _PER_CLASS),
        "lambda_": _PER_CLASS["lam"],
        "alpha_": _PER_CLASS["alpha"],
        "beta_": _PER_CLASS["beta"],
        "log_evidence_": _PER_CLASS["log_evidence"],
        "at_boundary_": _PER_CLASS["at_boundary"],
        "n_iter_": _PER_CLASS["n_iter"],
        "total_log_evidence_": Real(),
        "coef_": Tensor("K", "D"),
        "intercept_": Tensor("K"),
    },
)


# ---------------------------------------------------------------------------------------
# Input checks


def _features(x: Any, name: str = "features") -> torch.Tensor:
    """``x`` [N, D] as a checked float32/float64 tensor (NumPy arrays converted; integer,
    float16 or list input is a ``TypeError``; NaN, a single sample or constant rows are a
    ``ValueError``)."""
    x = as_float_tensor(x, name, ndim=2)
    if x.shape[0] < 2:
        raise ValueError(f"{name}: need at least two samples, got a single sample")
    if bool((x == x[:1]).all()):
        raise ValueError(f"{name} are constant: every sample has the same feature vector")
    return x


def _targets(labels: Any, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One-vs-rest 0/1 targets ``[N, K]`` (float64, on ``device``) and the class values
    ``[K]`` from labels ``[N]`` (or an indicator ``[N, K]``)."""
    shape = getattr(labels, "shape", None)
    if shape is None:
        shape = np.shape(labels)
    if len(shape) == 2:
        lab = as_label_tensor(labels, "labels", n=n, device=device)
        if not bool(((lab == 0) | (lab == 1)).all()):
            raise ValueError("an indicator label matrix must hold only 0 and 1")
        if lab.shape[1] < 2:
            raise ValueError(f"labels: need at least two classes, got {lab.shape[1]}")
        return lab.to(torch.float64), torch.arange(lab.shape[1], device=device)
    if len(shape) != 1 or shape[0] != n:
        raise ValueError(f"labels must be [N={n}], got shape {tuple(shape)}")
    lab = as_label_tensor(labels, "labels", n=n, device=device)
    classes, inverse = torch.unique(lab, return_inverse=True)
    if classes.numel() < 2:
        raise ValueError(f"labels: need at least two classes, got {classes.numel()}")
    y = torch.nn.functional.one_hot(inverse, classes.numel()).to(torch.float64)
    return y, classes


def _prepare(x: torch.Tensor, normalize: bool, mean: torch.Tensor | None) -> torch.Tensor:
    if mean is not None:
        x = x - mean.to(x)
    return torch.nn.functional.normalize(x, dim=-1) if normalize else x


# ---------------------------------------------------------------------------------------
# Estimator


class EvidenceLSSVM(OpenSetBackground, FewShotClassifier):
    """One-vs-rest Bayesian LS-SVM with per-class lambda set by evidence maximisation.

    Args:
        normalize: L2-normalise every feature vector (the paper's Theorem 1 assumption).
        center: for few-shot episodes, centre features on the base-class mean
            (needs :meth:`fit_base`); ``fit_probe`` also centres when a base mean was
            fitted.
        fit_intercept: centre X and y (N -> N - 1); the paper has no bias (default).
        paper_exact: Algorithm 1 exactly as published (lambda_init, absolute eps), no
            safeguards; otherwise probfsl's safeguards (design §4: grid start, clamps, ...).
        accelerate: Aitken's delta-squared step (Algorithm 1) or the plain map.
        lam_init: initial lambda of the paper-exact mode (positive).
        temperature: probabilities are ``softmax(temperature * scores)`` (a calibration
            convention; the argmax is the paper's decision rule); positive and finite.
        score: ``"sum"`` (paper eq. 13) or ``"mean_per_sample"`` (LogME) for
            ``total_log_evidence_``.
        lambda_mode: ``"shared"`` (default: one lambda maximising the summed evidence
            sum_k F_k; each class keeps its beta_k) or ``"per_class"`` (the paper: one
            lambda per one-vs-rest target; use it with ``paper_exact=True`` to reproduce
            the paper). On Omniglot per-class lambdas spread over 100x and put the class
            scores on different scales: linear-probe accuracy 64 % (per class) vs 72 %
            (shared), and in 1-shot tasks, where no class has a finite maximiser, 45 % vs
            76 % (see ``benchmarks/bench_evidence.py``).
        dtype: computation dtype, float32 or float64 (``compute_dtype_``, which the
            command line records next to the data's dtype). float64 (default) is an
            explicit upcast: inputs of either dtype are computed in it, and probabilities
            are returned in the input's dtype and on its device. Why: in float32 the
            eigendecomposition and the flat evidence near its 1-shot supremum decide the
            grid argmax, and with it whether a task is scored by the lambda -> infinity
            limit below, differently: computing in float32 changed the labels of 1 of
            1,500 queries of 100 built-in Omniglot 5-way 1-shot tasks (probabilities of
            that task off by up to 0.8), against 0 of 1,500 at 5 shots (max probability
            difference 5e-3); with the float64 upcast float32 and float64 inputs give the
            same labels (300 built-in Omniglot and WordNet 5-way tasks, 1 and 5 shots:
            4,500 of 4,500 queries agree).
        engine: ``"handwritten"`` (default: :mod:`probfsl.inference.evidence`) or
            ``"derived"``: the episodes' evidence maximised by variational message passing
            derived from the Pyro declaration of the regression
            (:func:`probfsl.derived.evidence.derived_proba`; ``fit_intercept=False`` and
            ``paper_exact=False`` only; ``fit_probe`` on features stays hand-written).

    **1-shot tasks: the nearest class mean.** With one support sample per class (more
    generally when N <= D and each one-vs-rest target can be interpolated), the profile
    evidence F(lambda) of Kim et al. (CVPR 2016, eq. 17) increases towards its supremum
    as lambda -> infinity: there is no finite maximiser, the grid start is at the upper
    end of its span and lambda ends there or beyond (``last_at_boundary_``,
    ``last_at_limit_``). There the posterior mean m(lambda) = (X^T X + lambda I)^-1 X^T y
    tends to X^T y / lambda, so every score x^T m tends to 0 and softmax(temperature *
    score) becomes uniform (max - min about 1e-6 on Omniglot). The argmax then hinges on
    differences of about 1e-8 that float32 output (grid 1.5e-8 at 0.2) rounds away, and
    labels flipped between float32 and float64 runs (115 of 15,000 queries of 200
    built-in Omniglot 5-way 1-shot tasks). The decision in
    that limit is the limit of the ranking: scores proportional to lambda m(lambda) ->
    X^T y_k = sum of the support rows of class k, i.e. the nearest class mean by inner
    product with the (normalised, centred) class sum (SimpleShot's rule). For tasks
    whose shared lambda (all classes, per-class mode) is at the upper boundary, the
    estimator therefore scores with that limit, x^T X^T y_k / mean(s) (mean(s) = the
    mean non-zero eigenvalue of X X^T, ~1 for unit rows: scores ~ cosines), computed
    without lambda: the probabilities are the nearest-class-mean softmax at
    ``temperature`` instead of a uniform vector, and float32 and float64 inputs give the
    same labels up to true ties (200 tasks: 15,000 of 15,000 agree). With
    ``fit_intercept`` the limit is the class frequency and is not substituted.
    ``fit_probe``/``decision_function`` keep the exact posterior mean (``coef_``).

    **Two kinds of fitting.** As on every estimator, ``fit(features, labels)`` is
    ``fit_base``: the base-class mean that few-shot tasks are centred on (also
    ``fit_featureset``). ``fit_probe(features, labels)`` fits one LS-SVM on the rows it is
    given (a linear probe, scikit-learn style, below), which ``predict``,
    ``predict_proba`` and ``decision_function`` on feature rows then use; it centres on
    the base mean when one was fitted.

    Fitted attributes (``fit_probe``): ``classes_`` (NumPy), ``coef_ [K, D]``, ``lambda_``,
    ``alpha_``, ``beta_``, ``log_evidence_ [K]``, ``total_log_evidence_``,
    ``at_boundary_``, ``n_iter_``, ``spectrum_``. ``predict_proba(episodes)`` never
    changes them; it leaves per-task diagnostics of its last batch in
    ``last_lambda_``, ``last_log_evidence_``, ``last_at_boundary_`` ([T, K]) and
    ``last_at_limit_`` ([T], tasks scored by the nearest-class-mean limit).
    """

    def __init__(
        self,
        normalize: bool = True,
        center: bool = True,
        fit_intercept: bool = False,
        paper_exact: bool = False,
        accelerate: bool = True,
        lam_init: float = 1.0,
        temperature: float = 10.0,
        score: str = "sum",
        lambda_mode: str = "shared",
        dtype: torch.dtype = torch.float64,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
    ) -> None:
        self.normalize = normalize
        self.center = center
        self.fit_intercept = fit_intercept
        self.paper_exact = paper_exact
        self.accelerate = accelerate
        self.lam_init = lam_init
        self.temperature = temperature
        self.score = score
        self.lambda_mode = lambda_mode
        self.dtype = dtype
        self.engine = engine
        self.open_prior = open_prior
        self.open_frame = open_frame

    call_diagnostics = ("last_lambda_", "last_log_evidence_", "last_at_boundary_", "last_at_limit_")
    schema = EstimatorSchema(
        params={
            "normalize": Flag(),
            "center": Flag(),
            "fit_intercept": Flag(),
            "paper_exact": Flag(),
            "accelerate": Flag(),
            "lam_init": Real(positive=True),
            "temperature": Real(positive=True),
            "score": Choice(SCORES),
            "lambda_mode": Choice(("per_class", "shared")),
            "dtype": FloatDType(),
            "engine": ENGINE,
            "open_prior": OPEN_PRIOR,
            "open_frame": Choice(OPEN_FRAMES),
        },
        # fit_base's base mean [D] (for centring) and fit's single problem, each optional
        fitted=(
            Group("fit_base", {"base_mean_": Tensor("D", bound=FEATURE_BOUND)}),
            BACKGROUND,
            SINGLE_PROBLEM,
        ),
    )

    @property
    def needs_base(self) -> bool:
        return self.center

    def setting_note(self, way: int, shot: int) -> str:
        """At one shot the evidence has no finite maximiser (Kim et al., CVPR 2016, eq. 17
        increases towards lambda -> infinity when each target can be interpolated), so
        every task is scored by that limit: the nearest class mean."""
        if shot == 1 and not self.fit_intercept:
            return (
                "evidence-lssvm at 1 shot: the evidence grows without bound in lambda, so "
                "every task takes the lambda -> infinity limit, whose rule is nearest "
                "centroid's (the same labels)"
            )
        return ""

    def _solve(self, sp: Spectrum, warn: bool = True) -> EvidenceResult:
        return solve_evidence(
            sp, self.lambda_mode, self.lam_init, self.accelerate, self.paper_exact, warn
        )

    def fit_base(self, features: Any, labels: Any) -> Self:
        """Store the base-class mean (in ``dtype``, on the features' device) for centring."""
        self._check_params()
        check_base(features, labels)
        features = as_float_tensor(features, "base features", ndim=2)
        self.base_mean_ = features.to(self.dtype).mean(0)
        x = _prepare(
            features.to(self.dtype), self.normalize, self.base_mean_ if self.center else None
        )
        self.fit_background(x, torch.as_tensor(labels, device=x.device))
        return self

    # -- single problem (scikit-learn style) ------------------------------------------

    def fit_probe(self, features: Any, labels: Any) -> Self:
        """Fit K one-vs-rest evidence-maximised ridge regressions on ``features [N, D]``
        (the single-problem LS-SVM; ``fit`` is ``fit_base``, as on every estimator).

        ``features``: a float32/float64 tensor or NumPy array. ``labels``: integer class
        labels ``[N]`` or a 0/1 indicator matrix ``[N, K]`` (multi-label). Sets the
        attributes of the class docstring's "Fitted attributes"; returns ``self``.
        """
        self._check_params()
        x = _features(features)
        y, classes = _targets(labels, x.shape[0], x.device)
        x = _prepare(x.to(self.dtype), self.normalize, getattr(self, "base_mean_", None))
        sp = spectrum(x, y.to(self.dtype), self.fit_intercept)
        res = self._solve(sp)
        self.classes_ = classes.cpu().numpy()  # public NumPy attribute (scikit-learn habit)
        self.spectrum_ = sp
        self.result_ = res
        self.lambda_, self.alpha_, self.beta_ = res.lam, res.alpha, res.beta
        self.log_evidence_ = res.log_evidence
        self.at_boundary_, self.n_iter_ = res.at_boundary, res.n_iter
        total = res.log_evidence.sum()
        self.total_log_evidence_ = float(total / sp.n if self.score != "sum" else total)
        self.coef_ = posterior_mean(sp, res.lam).mT  # [K, D]
        if self.fit_intercept:
            xm = x.mean(0)
            self.intercept_ = y.to(self.dtype).mean(0) - self.coef_ @ xm
        else:
            self.intercept_ = x.new_zeros(len(classes))
        return self

    def decision_function(self, features: Any) -> torch.Tensor:
        """Regression scores ``x^T w_k (+ b_k)``, ``[M, K]`` (in ``dtype``, on the fitted
        model's device)."""
        if not hasattr(self, "coef_"):
            raise ValueError("EvidenceLSSVM has no probe: call fit_probe(features, labels) first")
        x = as_float_tensor(features, "features", ndim=2)
        if x.shape[1] != self.coef_.shape[1]:
            raise ValueError(f"features must be [M, {self.coef_.shape[1]}], got {tuple(x.shape)}")
        x = x.to(device=self.coef_.device, dtype=self.dtype)
        x = _prepare(x, self.normalize, getattr(self, "base_mean_", None))
        return x @ self.coef_.mT + self.intercept_

    def predict_proba(self, data: Any) -> torch.Tensor | np.ndarray:
        """Class probabilities, of the type given: ``[M, K]`` for features (a NumPy array
        in, a NumPy array out; a tensor in, a tensor on the fitted model's device out),
        ``[T, Q, K]`` tensors for :class:`Episodes`. Computed in ``compute_dtype_``,
        returned in the dtype of the input. Never changes the fitted state (episodes
        leave only the ``call_diagnostics``)."""
        if isinstance(data, (torch.Tensor, np.ndarray)):
            self._check_params()
            scores = self.decision_function(data)
            in_dtype = torch.float64 if data.dtype in (np.float64, torch.float64) else torch.float32
            proba = torch.softmax(self.temperature * scores, -1).to(in_dtype)
            return proba.cpu().numpy() if isinstance(data, np.ndarray) else proba
        return self._episodes_proba(data)

    def predict(self, data: Any) -> torch.Tensor | np.ndarray:
        """Labels, of the type given: for the rows of features the values of ``classes_``
        (a NumPy array in, a NumPy array out; a tensor in, a tensor on the input's device
        out), for :class:`Episodes` task-local labels ``[T, Q]`` (a tensor, like every
        estimator's ``predict(episodes)``)."""
        if isinstance(data, np.ndarray):
            return self.classes_[self.decision_function(data).argmax(-1).cpu().numpy()]
        if isinstance(data, torch.Tensor):
            index = self.decision_function(data).argmax(-1)
            return torch.as_tensor(self.classes_, device=index.device)[index].to(data.device)
        return self._episodes_proba(data).argmax(-1)

    @property
    def compute_dtype_(self) -> torch.dtype:
        """The dtype every computation runs in: ``dtype`` (default float64), whatever the
        input's dtype. An explicit upcast: see the class docstring for why."""
        return self.dtype

    # -- few-shot episodes --------------------------------------------------------------

    def _episodes_proba(self, episodes: Episodes) -> torch.Tensor:
        """Per-task evidence fits on the support; query probabilities ``[T, Q, K]`` in the
        episodes' dtype and device (computed in ``dtype``; see the class docstring for
        tasks at the lambda limit)."""
        self._check_params()
        mean = getattr(self, "base_mean_", None) if self.center else None
        if self.center and mean is None:
            check_episodes(episodes)
            raise ValueError("center=True needs base features: call fit_base first")
        check_episodes(episodes, dim=None if mean is None else mean.shape[0])
        in_dtype = episodes.support.dtype
        support = _prepare(episodes.support.to(self.dtype), self.normalize, mean)
        query = _prepare(episodes.query.to(self.dtype), self.normalize, mean)
        engine = ENGINES[self.engine]  # probfsl.derived.evidence: "handwritten" or "derived"
        fit = engine(support, query, episodes.support_labels, episodes.way, self)
        self.last_lambda_, self.last_log_evidence_ = fit.lam, fit.log_evidence
        self.last_at_boundary_, self.last_at_limit_ = fit.at_boundary, fit.at_limit
        return torch.softmax(self.temperature * fit.scores, -1).to(in_dtype)

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K+1]``: :meth:`predict_proba` times 1 - P(open), and P(open) last.

        P(open) is the inductive outlier posterior of the two-covariance Gaussian reading
        of the (centred, normalised) features of the regressions, with prior ``open_prior``
        (:meth:`~probfsl.models.base.OpenSetBackground.inductive_open`).
        It is read in the frame ``open_frame``: ``"base"``, or ``"queries"``, re-centred on
        the task's query mean (as :class:`~probfsl.models.nearest_centroid.NearestCentroid`).
        """
        proba = self.predict_proba(episodes)
        mean = getattr(self, "base_mean_", None) if self.center else None
        support = _prepare(episodes.support.to(self.dtype), self.normalize, mean)
        query = _prepare(episodes.query.to(self.dtype), self.normalize, mean)
        return self.inductive_open(episodes, proba, support, query)


# ---------------------------------------------------------------------------------------
# Backbone selection


@dataclass
class BackboneScore:
    """One backbone's evidence: summed log evidence and per sample, per class values."""

    name: str
    index: int
    log_evidence: float
    per_sample: float
    per_class: np.ndarray
    dim: int
    at_boundary: int


def _feature_list(
    feature_sets: Sequence[Any] | Mapping[str, Any],
) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(feature_sets, Mapping):
        names, sets = [str(k) for k in feature_sets], list(feature_sets.values())
    else:
        sets = list(feature_sets)
        names = [str(i) for i in range(len(sets))]
    if not sets:
        raise ValueError("feature_sets must hold at least one feature matrix")
    tensors = [_features(s, f"feature set {name!r}") for name, s in zip(names, sets, strict=True)]
    if len({t.device for t in tensors}) > 1:
        raise ValueError("feature sets must be on one device")
    rows = {t.shape[0] for t in tensors}
    if len(rows) > 1:
        raise ValueError(
            "feature sets have different row counts "
            f"({', '.join(f'{n}: {t.shape[0]}' for n, t in zip(names, tensors, strict=True))}): "
            "the evidence compares backbones on the same samples"
        )
    return names, tensors


def _stack_padded(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``[M, N, max D]``: zero columns leave the evidence unchanged (zero eigenvalues)."""
    width = max(t.shape[1] for t in tensors)
    return torch.stack(
        [torch.nn.functional.pad(t.to(dtype), (0, width - t.shape[1])) for t in tensors]
    )


def backbone_evidence(
    feature_sets: Sequence[Any] | Mapping[str, Any],
    labels: Any,
    normalize: bool = True,
    fit_intercept: bool = False,
    dtype: torch.dtype = torch.float64,
    warn: bool = False,
) -> tuple[list[str], EvidenceResult, Spectrum]:
    """Per-(backbone, class) evidence in one batched decomposition ``[M, K]``."""
    names, tensors = _feature_list(feature_sets)
    y, _ = _targets(labels, tensors[0].shape[0], tensors[0].device)
    x = _stack_padded([_prepare(t.to(dtype), normalize, None) for t in tensors], dtype)
    sp = spectrum(x, y.to(dtype).expand(len(tensors), *y.shape), fit_intercept)
    return names, maximize_evidence(sp, warn=warn), sp


def rank_backbones(
    feature_sets: Sequence[Any] | Mapping[str, Any],
    labels: Any,
    normalize: bool = True,
    fit_intercept: bool = False,
    dtype: torch.dtype = torch.float64,
) -> list[BackboneScore]:
    """Backbones ordered by summed log evidence (eq. 13), best first.

    ``feature_sets``: a sequence or a ``{name: [N, D_m]}`` mapping of feature matrices
    of the same N samples (widths may differ); ``labels [N]`` (or an ``[N, K]``
    indicator). All backbones are solved in one batched call.
    """
    names, res, sp = backbone_evidence(feature_sets, labels, normalize, fit_intercept, dtype)
    _, tensors = _feature_list(feature_sets)
    scores = [
        BackboneScore(
            name=names[m],
            index=m,
            log_evidence=float(res.log_evidence[m].sum()),
            per_sample=float(res.log_evidence[m].sum() / sp.n),
            per_class=res.log_evidence[m].cpu().numpy(),
            dim=int(tensors[m].shape[1]),
            at_boundary=int(res.at_boundary[m].sum()),
        )
        for m in range(len(names))
    ]
    return sorted(scores, key=lambda b: -b.log_evidence)


@dataclass
class EpisodeScore:
    """One backbone's few-shot evidence on a set of labelled episodes.

    ``score`` is the mean over episodes of the conditional log evidence of the query
    targets given the support, ``log p(y_q | y_s, X)``, per query (nats, summed over the
    ``way`` one-vs-rest targets); ``per_episode [T]`` holds each episode's value and
    ``ci95`` the half-width of the 95 % interval of the mean. ``diff_to_best`` and
    ``diff_ci95`` are the paired difference to the best backbone on the same episodes
    (0 for the best). ``lam`` (``lambda = alpha / beta``, in units of the mean non-zero
    eigenvalue of the episodes' Gram matrices) and ``beta`` (per target) are the
    hyperparameters shared by all episodes, set by maximising the evidence of every
    episode row; ``log_evidence`` is that maximised evidence per row; ``at_boundary``
    says lambda ended at a bound of its search (no finite maximiser).
    """

    name: str
    index: int
    score: float
    ci95: float
    per_episode: np.ndarray
    lam: float
    beta: np.ndarray
    log_evidence: float
    dim: int
    at_boundary: bool
    diff_to_best: float = 0.0
    diff_ci95: float = 0.0


def _episode_grams(x: torch.Tensor, rows: torch.Tensor, max_elements: int = 2**23) -> torch.Tensor:
    """Gram matrices ``[T, N, N]`` of the rows ``rows [T, N]`` of ``x [R, D]``, gathered
    in batches of episodes of at most ``max_elements`` feature entries each."""
    n_tasks, n = rows.shape
    step = max(1, max_elements // (n * x.shape[1]))
    grams = []
    for start in range(0, n_tasks, step):
        block = x[rows[start : start + step]]  # [t, N, D]
        grams.append(block @ block.mT)
    return torch.cat(grams)


def episode_evidence(
    feature_sets: Sequence[Any] | Mapping[str, Any],
    indices: Mapping[str, Any],
    normalize: bool = True,
    center: bool = True,
    dtype: torch.dtype = torch.float64,
    progress: bool = False,
) -> list[EpisodeScore]:
    """The few-shot evidence of each backbone on the same labelled episodes (input order).

    ``feature_sets``: a sequence or ``{name: [R, D_m]}`` mapping of feature matrices of
    the same R samples; ``indices``: episodes as rows of those matrices, the
    ``support``, ``support_labels``, ``query``, ``query_labels`` arrays of
    :func:`probfsl.data.tasks.sample_task_indices` (``[T, way * shot]``, ``[T, Q]``).
    With ``center`` each feature matrix is centred on its mean row (over all R rows:
    pass the rows the episodes are drawn from, e.g. the base classes) and then, with
    ``normalize``, L2-normalised: the preprocessing of the few-shot methods
    (``center=True``: the base-class mean). Without centring, a feature set that is
    already centred (a PCA projection) is compared with uncentred ones on unequal
    terms: on six Omniglot backbones the rank correlation of the 5-shot score with
    nearest-centroid 5-shot accuracy is 0.83 with centring and 0.71 without
    (``benchmarks/results/select.md``).

    The model is the Bayesian linear regression of Kim et al. (CVPR 2016, eq. 3-5) on
    one-vs-rest 0/1 targets, fitted per episode, with hyperparameters shared by the
    episodes of a backbone: ``w_tk ~ Normal(0, (lambda beta_k)^-1 I)``,
    ``y_tk ~ Normal(X_t w_tk, beta_k^-1 I)``. Stacked, the episodes are one regression
    with a block-diagonal Gram matrix
    (:func:`~probfsl.inference.evidence.pool_spectra`), whose evidence over all support
    and query rows sets ``lambda`` and ``beta_k`` (eq. 17, the fixed point of Algorithm
    2 behind :func:`~probfsl.inference.evidence.maximize_shared_evidence`). Each
    episode is then scored by the conditional evidence of its query targets given its
    support, ``log p(y_q | y_s, X) = log p(y_s, y_q | X) - log p(y_s | X)``
    (:func:`~probfsl.inference.evidence.conditional_log_evidence`): how well the
    regression fitted on the support predicts the queries, the few-shot question,
    as a density over the targets (comparable across feature widths). On six Omniglot
    backbones its rank correlation with 5-shot nearest-centroid accuracy was 0.83 on
    5-shot episodes (it put a 64-d PCA projection below two 1280-d backbones of lower
    accuracy) and 1.00 on 1-shot episodes, against 0.60 for the whole-data evidence of
    :func:`rank_backbones` (``benchmarks/results/select.md``).

    Why the hyperparameters are shared and set on all rows: set per episode on the
    support alone, lambda has no finite maximiser in 1-shot episodes (one positive per
    target, eq. 17 rises as lambda -> infinity) and the predictive ignores the features;
    with N_support <= D the maximiser may instead sit at lambda -> 0 (exact
    interpolation) and the predictive collapses (log evidence of about -9e6 per query
    on Omniglot PCA-64, 5-shot). All episodes are computed in batches (one Gram matrix
    and one eigendecomposition per episode, no loop over episodes), in ``dtype``
    (float64 by default) on the features' device. ``progress`` shows the backbones done
    (:func:`probfsl.progress.progress`).
    """
    from probfsl.progress import progress as progress_display

    check_float_dtype("dtype", dtype)
    names, tensors = _feature_list(feature_sets)
    device = tensors[0].device
    idx = check_task_indices(dict(indices), tensors[0].shape[0])
    if OPEN_FIELD in idx:
        raise ValueError(
            "episodes: open-set tasks (an 'open_classes' field): the episode evidence scores "
            "closed tasks; drop their open queries or sample them without n_open"
        )
    support, query = idx["support"], idx["query"]
    way = int(idx["support_labels"].max()) + 1
    present = (idx["support_labels"][:, None, :] == np.arange(way)[None, :, None]).any(-1)
    if not present.all():
        raise ValueError("episodes: every class 0..way-1 needs a support sample in each episode")
    n_support = support.shape[1]
    rows = torch.as_tensor(np.concatenate([support, query], 1), device=device)
    labels = torch.as_tensor(
        np.concatenate([idx["support_labels"], idx["query_labels"]], 1), device=device
    )
    y = torch.nn.functional.one_hot(labels, way).to(dtype)  # [T, N, K]
    y_support = y[:, :n_support].contiguous()
    scores = []
    bar = progress_display(len(names), "select", "backbones", progress)
    for m, (name, t) in enumerate(zip(names, tensors, strict=True)):
        bar.update()
        x = t.to(dtype)
        x = _prepare(x, normalize, x.mean(0) if center else None)
        gram = _episode_grams(x, rows)
        joint = spectrum_from_gram(gram, y, x.shape[1])
        part = spectrum_from_gram(
            gram[:, :n_support, :n_support].contiguous(), y_support, x.shape[1]
        )
        pooled = pool_spectra(joint)
        res = maximize_shared_evidence(pooled)
        cond = conditional_log_evidence(joint, part, res.alpha, res.beta)  # [T, K]
        per_episode = (cond.sum(-1) / query.shape[1]).cpu().numpy()
        scale = float(pooled.mean_s)
        scores.append(
            EpisodeScore(
                name=name,
                index=m,
                score=float(per_episode.mean()),
                ci95=_ci95(per_episode),
                per_episode=per_episode,
                lam=float(res.lam[0]) / scale,
                beta=res.beta.cpu().numpy(),
                log_evidence=float(res.log_evidence.sum()) / (rows.numel()),
                dim=int(t.shape[1]),
                at_boundary=bool(res.at_boundary.any()),
            )
        )
    bar.close()
    return scores


def _ci95(values: np.ndarray) -> float:
    if values.size < 2:
        return float("nan")
    return float(1.96 * values.std(ddof=1) / np.sqrt(values.size))


def rank_backbones_on_episodes(
    feature_sets: Sequence[Any] | Mapping[str, Any],
    indices: Mapping[str, Any],
    normalize: bool = True,
    center: bool = True,
    dtype: torch.dtype = torch.float64,
    progress: bool = False,
) -> list[EpisodeScore]:
    """Backbones ordered by their few-shot evidence (:func:`episode_evidence`), best first,
    with the paired difference of each to the best on the same episodes; ``progress`` as
    in :func:`episode_evidence`."""
    scores = episode_evidence(feature_sets, indices, normalize, center, dtype, progress)
    scores = sorted(scores, key=lambda b: -b.score)
    best = scores[0].per_episode
    for b in scores:
        diff = b.per_episode - best
        b.diff_to_best = float(diff.mean())
        b.diff_ci95 = 0.0 if b is scores[0] else _ci95(diff)
    return scores


@dataclass
class EnsembleResult:
    """Greedy evidence ensemble (paper §3.4)."""

    selected: list[str]
    order: list[str]
    accepted: list[bool]
    trace: list[float]
    log_evidence: float
    model: EvidenceLSSVM | None


def greedy_ensemble(
    feature_sets: Sequence[Any] | Mapping[str, Any],
    labels: Any,
    normalize: bool = True,
    fit_model: bool = True,
    dtype: torch.dtype = torch.float64,
) -> EnsembleResult:
    """Concatenate backbones in order of evidence, keeping each only if L* increases.

    One pass, M - 1 trials; each trial is one N x N eigendecomposition of the summed
    Grams of the selected backbones (``X_S X_S^T = sum_m X_m X_m^T``). With
    ``fit_model`` the returned :class:`EvidenceLSSVM` is fitted on the concatenation.
    """
    names, tensors = _feature_list(feature_sets)
    y, _ = _targets(labels, tensors[0].shape[0], tensors[0].device)
    y = y.to(dtype)
    prepared = [_prepare(t.to(dtype), normalize, None) for t in tensors]
    ranking = rank_backbones(dict(zip(names, prepared, strict=True)), labels, False, False, dtype)
    grams = {b.name: prepared[b.index] @ prepared[b.index].mT for b in ranking}
    order = [b.name for b in ranking]
    selected, accepted, trace = [order[0]], [True], [ranking[0].log_evidence]
    gram, dims, best = grams[order[0]], ranking[0].dim, ranking[0].log_evidence
    for b in ranking[1:]:
        trial = gram + grams[b.name]
        sp = spectrum_from_gram(trial, y, dims + b.dim)
        value = float(maximize_evidence(sp, warn=False).log_evidence.sum())
        trace.append(value)
        keep = value > best
        accepted.append(keep)
        if keep:
            selected.append(b.name)
            gram, dims, best = trial, dims + b.dim, value
    model = None
    if fit_model:
        concat = torch.cat([prepared[names.index(n)] for n in selected], 1)
        model = EvidenceLSSVM(normalize=False, center=False, dtype=dtype)
        model.fit_probe(concat, labels)
    return EnsembleResult(selected, order, accepted, trace, best, model)


# ---------------------------------------------------------------------------------------
# Diagnostics


def evidence_datatree(
    model: EvidenceLSSVM,
    n_draws: int = 200,
    lambdas: torch.Tensor | None = None,
    max_dim: int = 256,
    seed: int = 0,
):
    """Posterior of w and the evidence curve over lambda per class, as an ArviZ DataTree.

    Groups: ``posterior`` (draws of ``w [class, feature]`` from the exact Gaussian
    posterior, one chain; only the first ``max_dim`` features), ``posterior_summary``
    (mean, standard deviation and trace of the covariance of w per class) and
    ``evidence_curve`` (log evidence over a lambda grid per class, with the chosen
    lambda).
    """
    import xarray as xr

    from probfsl.diagnostics.arviz import to_datatree

    if not hasattr(model, "spectrum_") or model.lambda_.ndim != 1:
        raise ValueError("evidence_datatree needs an EvidenceLSSVM fitted with fit_probe(X, y)")
    sp = model.spectrum_
    d = min(sp.dim, max_dim)
    cov = posterior_covariance(sp, model.alpha_, model.beta_)  # [K, D, D]
    mean = model.coef_  # [K, D]
    gen = torch.Generator().manual_seed(seed)  # CPU draws: the same for every device
    chol = torch.linalg.cholesky(cov[:, :d, :d])
    eps = torch.randn(n_draws, *mean[:, :d].shape, dtype=mean.dtype, generator=gen, device="cpu")
    draws = mean[:, :d] + (chol @ eps.to(mean.device).unsqueeze(-1)).squeeze(-1)

    def as_numpy(t: torch.Tensor) -> np.ndarray:  # the DataTree is NumPy: the outer boundary
        return t.detach().cpu().numpy()

    classes = [str(c) for c in model.classes_]
    tree = to_datatree(
        {"w": as_numpy(draws.unsqueeze(0))},
        dims={"w": ["class", "feature"]},
        coords={"class": classes, "feature": np.arange(d)},
    )
    if lambdas is None:
        scale = float(sp.mean_s)
        lambdas = scale * torch.logspace(-6, 6, 121, dtype=sp.s.dtype, device=sp.s.device)
    curve = evidence_curve(sp, lambdas.to(sp.s.dtype))  # [K, G]
    tree["posterior_summary"] = xr.DataTree(
        xr.Dataset(
            {
                "w_mean": (("class", "feature"), as_numpy(mean)),
                "w_sd": (("class", "feature"), as_numpy(cov.diagonal(dim1=-2, dim2=-1).sqrt())),
                "w_cov_trace": (("class",), as_numpy(cov.diagonal(dim1=-2, dim2=-1).sum(-1))),
            },
            coords={"class": classes, "feature": np.arange(sp.dim)},
        )
    )
    tree["evidence_curve"] = xr.DataTree(
        xr.Dataset(
            {
                "log_evidence": (("class", "lam"), as_numpy(curve)),
                "lambda_hat": (("class",), as_numpy(model.lambda_)),
                "log_evidence_hat": (("class",), as_numpy(model.log_evidence_)),
                "at_boundary": (("class",), as_numpy(model.at_boundary_)),
            },
            coords={"class": classes, "lam": as_numpy(lambdas)},
        )
    )
    return tree


def plot_evidence(tree: Any, classes: Sequence[str] | None = None, ax: Any = None) -> Any:
    """Plot the evidence curves of a :func:`evidence_datatree` with the chosen lambdas."""
    import matplotlib.pyplot as plt

    ds = tree["evidence_curve"].to_dataset()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    names = list(ds["class"].values) if classes is None else list(classes)
    for c in names:
        row = ds.sel({"class": c})
        (line,) = ax.plot(ds["lam"].values, row["log_evidence"].values, label=str(c))
        ax.plot(
            float(row["lambda_hat"]), float(row["log_evidence_hat"]), "o", color=line.get_color()
        )
    ax.set_xscale("log")
    ax.set_xlabel("lambda = alpha / beta")
    ax.set_ylabel("profile log evidence F(lambda)")
    if len(names) <= 12:
        ax.legend(fontsize="small")
    return ax


__all__ = [
    "BackboneScore",
    "EnsembleResult",
    "EpisodeScore",
    "EvidenceLSSVM",
    "backbone_evidence",
    "episode_evidence",
    "evidence_datatree",
    "greedy_ensemble",
    "plot_evidence",
    "rank_backbones",
    "rank_backbones_on_episodes",
]
