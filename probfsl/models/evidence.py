"""Bayesian evidence LS-SVM: linear probes regularised and backbones ranked by the evidence.

Kim, Jang, Han, Choi, "Learning to Select Pre-Trained Deep Representations with
Bayesian Evidence Framework", CVPR 2016 (spec ``evidence.md``). The mathematics
(one eigendecomposition, Algorithm 1-2 with Aitken's step, safeguards) lives in
:mod:`probfsl.inference.evidence`.

Generative model, one problem per target column (one-vs-rest 0/1 targets, no bias):

    alpha, beta ~ flat (type-II maximum likelihood: point estimates)
    w ~ Normal(0, alpha^-1 I_D)
    y ~ Normal(X w, beta^-1 I_N)

* :func:`evidence_model`: the Pyro model; with the engine's guide (point masses on
  alpha, beta and the exact posterior on w) Pyro's ``Trace_ELBO`` is the log evidence.
* :class:`EvidenceLSSVM`: ``fit(X, y)`` / ``predict`` / ``predict_proba`` /
  ``log_evidence_`` with per-class lambda; also a batched few-shot classifier
  (``predict_proba(episodes)``) for ``probfsl run --method evidence-lssvm``.
* :func:`rank_backbones`, :func:`greedy_ensemble` (paper §3.4) and :func:`select_main`
  (``probfsl select --features A.npz B.npz ...``).
* :func:`evidence_datatree` / :func:`plot_evidence`: posterior of w and the evidence
  curve over lambda per class, as an ArviZ DataTree and a plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.data.tasks import Episodes
from probfsl.inference.evidence import (
    EvidenceResult,
    Spectrum,
    evidence_curve,
    maximize_evidence,
    maximize_shared_evidence,
    posterior_covariance,
    posterior_mean,
    spectrum,
    spectrum_from_gram,
)
from probfsl.models.base import FewShotClassifier, check_base, check_episodes

SCORES = ("sum", "mean_per_sample")


def evidence_model(
    x: torch.Tensor,
    y: torch.Tensor,
    alpha: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> None:
    """Bayesian linear regression for a batch of problems ``x [T, N, D]``, ``y [T, N]``.

    ``w ~ Normal(0, alpha^-1 I)``, ``y ~ Normal(X w, beta^-1 I)`` (paper eq. 3-5).
    Without ``alpha``/``beta`` they are sample sites with a flat improper prior on the
    positive reals (type-II ML = MAP under that prior); pass them to sample from the
    prior predictive.
    """
    n_problems, _, d = x.shape
    with pyro.plate("problems", n_problems, dim=-1):
        if alpha is None:
            alpha = pyro.sample(
                "alpha", dist.ImproperUniform(constraints.positive, (n_problems,), ())
            )
        if beta is None:
            beta = pyro.sample(
                "beta", dist.ImproperUniform(constraints.positive, (n_problems,), ())
            )
        alpha, beta = torch.as_tensor(alpha).to(x), torch.as_tensor(beta).to(x)
        scale = alpha.rsqrt().unsqueeze(-1)
        w = pyro.sample(
            "w",
            dist.Normal(torch.zeros_like(scale), scale).expand(scale.shape[:-1] + (d,)).to_event(1),
        )
        mean = (x @ w.unsqueeze(-1)).squeeze(-1)
        noise = beta.rsqrt().unsqueeze(-1).expand_as(mean)
        pyro.sample("y", dist.Normal(mean, noise).to_event(1), obs=y)


# ---------------------------------------------------------------------------------------
# Input checks


def _as_tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    arr = np.asarray(x)
    if arr.dtype.kind == "f" and arr.dtype != np.float64:
        arr = arr.astype(np.float32)
    out = torch.from_numpy(np.ascontiguousarray(arr))
    return out if dtype is None else out.to(dtype)


def _check_features(x: torch.Tensor, name: str = "features") -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be [N, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if x.shape[0] < 2:
        raise ValueError(f"{name}: need at least two samples, got a single sample")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contain NaN or inf")
    if bool((x == x[:1]).all()):
        raise ValueError(f"{name} are constant: every sample has the same feature vector")


def _targets(labels: Any, n: int) -> tuple[torch.Tensor, np.ndarray]:
    """One-vs-rest 0/1 targets ``[N, K]`` from labels ``[N]`` (or an indicator ``[N, K]``)."""
    lab = _as_tensor(labels)
    if lab.ndim == 2:
        if lab.shape[0] != n:
            raise ValueError(f"labels must have {n} rows, got {lab.shape[0]}")
        if not bool(((lab == 0) | (lab == 1)).all()):
            raise ValueError("an indicator label matrix must hold only 0 and 1")
        if lab.shape[1] < 2:
            raise ValueError(f"labels: need at least two classes, got {lab.shape[1]}")
        return lab.to(torch.float64), np.arange(lab.shape[1])
    if lab.ndim != 1 or lab.shape[0] != n:
        raise ValueError(f"labels must be [N={n}], got shape {tuple(lab.shape)}")
    if lab.is_floating_point():
        raise ValueError(f"labels must be integers, got {lab.dtype}")
    classes, inverse = torch.unique(lab, return_inverse=True)
    if classes.numel() < 2:
        raise ValueError(f"labels: need at least two classes, got {classes.numel()}")
    y = torch.nn.functional.one_hot(inverse, classes.numel()).to(torch.float64)
    return y, classes.numpy()


def _prepare(x: torch.Tensor, normalize: bool, mean: torch.Tensor | None) -> torch.Tensor:
    if mean is not None:
        x = x - mean.to(x)
    return torch.nn.functional.normalize(x, dim=-1) if normalize else x


# ---------------------------------------------------------------------------------------
# Estimator


class EvidenceLSSVM(FewShotClassifier):
    """One-vs-rest Bayesian LS-SVM with per-class lambda set by evidence maximisation.

    Args:
        normalize: L2-normalise every feature vector (the paper's Theorem 1 assumption).
        center: for few-shot episodes, centre features on the base-class mean
            (needs :meth:`fit_base`); ``fit`` also centres when a base mean was fitted.
        fit_intercept: centre X and y (N -> N - 1); the paper has no bias (default).
        paper_exact: Algorithm 1 exactly as published (lambda_init, absolute eps), no
            safeguards; otherwise the spec's safeguards (grid start, clamps, ...).
        accelerate: Aitken's delta-squared step (Algorithm 1) or the plain map.
        lam_init: initial lambda of the paper-exact mode.
        temperature: probabilities are ``softmax(temperature * scores)`` (a calibration
            convention; the argmax is the paper's decision rule).
        score: ``"sum"`` (paper eq. 13) or ``"mean_per_sample"`` (LogME) for
            ``total_log_evidence_``.
        lambda_mode: ``"shared"`` (default: one lambda maximising the summed evidence
            sum_k F_k; each class keeps its beta_k) or ``"per_class"`` (the paper: one
            lambda per one-vs-rest target; use it with ``paper_exact=True`` to reproduce
            the paper). On Omniglot per-class lambdas spread over 100x and put the class
            scores on different scales: linear-probe accuracy 64 % (per class) vs 72 %
            (shared), and in 1-shot tasks, where no class has a finite maximiser, 45 % vs
            76 % (see ``benchmarks/bench_evidence.py``).
        dtype: computation dtype (float64 recommended for the eigendecomposition).

    Fitted attributes (``fit``): ``classes_``, ``coef_ [K, D]``, ``lambda_``, ``alpha_``,
    ``beta_``, ``log_evidence_ [K]``, ``total_log_evidence_``, ``at_boundary_``,
    ``n_iter_``, ``spectrum_``. After ``predict_proba(episodes)``: ``lambda_``,
    ``log_evidence_`` and ``at_boundary_`` are ``[T, K]`` for that batch.
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

    @property
    def needs_base(self) -> bool:
        return self.center

    def _check_params(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if self.lambda_mode not in ("per_class", "shared"):
            raise ValueError(
                f"lambda_mode must be 'per_class' or 'shared', got {self.lambda_mode!r}"
            )
        if not self.lam_init > 0:
            raise ValueError(f"lam_init must be positive, got {self.lam_init}")

    def _solve(self, sp: Spectrum, warn: bool = True) -> EvidenceResult:
        if self.lambda_mode == "shared":
            return maximize_shared_evidence(sp)
        return maximize_evidence(
            sp,
            lam_init=self.lam_init,
            accelerate=self.accelerate,
            paper_exact=self.paper_exact,
            warn=warn,
        )

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        features = _as_tensor(features)
        check_base(features, _as_tensor(labels))
        self.base_mean_ = features.to(self.dtype).mean(0)
        return self

    # -- single problem (scikit-learn style) ------------------------------------------

    def fit(self, features: Any, labels: Any) -> Self:
        """Fit K one-vs-rest evidence-maximised ridge regressions on ``features [N, D]``.

        ``labels``: integer class labels ``[N]`` or a 0/1 indicator matrix ``[N, K]``
        (multi-label).
        """
        self._check_params()
        x = _as_tensor(features)
        _check_features(x)
        y, classes = _targets(labels, x.shape[0])
        x = _prepare(x.to(self.dtype), self.normalize, getattr(self, "base_mean_", None))
        sp = spectrum(x, y.to(self.dtype), self.fit_intercept)
        res = self._solve(sp)
        self.classes_ = classes
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
            self.intercept_ = torch.zeros(len(classes), dtype=self.dtype)
        return self

    def decision_function(self, features: Any) -> torch.Tensor:
        """Regression scores ``x^T w_k (+ b_k)``, ``[M, K]``."""
        if not hasattr(self, "coef_"):
            raise ValueError("EvidenceLSSVM is not fitted: call fit first")
        x = _as_tensor(features)
        if x.ndim != 2 or x.shape[1] != self.coef_.shape[1]:
            raise ValueError(f"features must be [M, {self.coef_.shape[1]}], got {tuple(x.shape)}")
        x = _prepare(x.to(self.dtype), self.normalize, getattr(self, "base_mean_", None))
        return x @ self.coef_.mT + self.intercept_

    def predict_proba(self, data: Any) -> torch.Tensor:
        """``[M, K]`` for features, ``[T, Q, K]`` for :class:`Episodes` (few-shot path)."""
        if isinstance(data, Episodes):
            return self._episodes_proba(data)
        return torch.softmax(self.temperature * self.decision_function(data), -1)

    def predict(self, data: Any) -> Any:
        """Class labels for features (from ``classes_``), task-local labels for episodes."""
        if isinstance(data, Episodes):
            return self._episodes_proba(data).argmax(-1)
        return self.classes_[self.decision_function(data).argmax(-1).numpy()]

    # -- few-shot episodes --------------------------------------------------------------

    def _episodes_proba(self, episodes: Episodes) -> torch.Tensor:
        self._check_params()
        check_episodes(episodes)
        mean = getattr(self, "base_mean_", None) if self.center else None
        if self.center and mean is None:
            raise ValueError("center=True needs base features: call fit_base first")
        in_dtype = episodes.support.dtype
        support = _prepare(episodes.support.to(self.dtype), self.normalize, mean)
        query = _prepare(episodes.query.to(self.dtype), self.normalize, mean)
        y = torch.nn.functional.one_hot(episodes.support_labels, episodes.way).to(self.dtype)
        sp = spectrum(support, y, self.fit_intercept)
        res = self._solve(sp, warn=False)  # one-shot classes have no finite maximiser
        self.lambda_, self.log_evidence_, self.at_boundary_ = (
            res.lam,
            res.log_evidence,
            res.at_boundary,
        )
        w = posterior_mean(sp, res.lam)  # [T, D, K]
        scores = query @ w
        if self.fit_intercept:
            scores = scores + y.mean(-2, keepdim=True) - support.mean(-2, keepdim=True) @ w
        return torch.softmax(self.temperature * scores, -1).to(in_dtype)


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
    tensors = [_as_tensor(s) for s in sets]
    for name, t in zip(names, tensors, strict=True):
        _check_features(t, f"feature set {name!r}")
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
    y, _ = _targets(labels, tensors[0].shape[0])
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
    y, _ = _targets(labels, tensors[0].shape[0])
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
        model = EvidenceLSSVM(normalize=False, center=False, dtype=dtype).fit(concat, labels)
    return EnsembleResult(selected, order, accepted, trace, best, model)


def select_main(paths: Sequence[str | Path], split: str | None = None) -> int:
    """``probfsl select --features A.npz B.npz ...``: print the evidence ranking.

    Uses the labelled rows (of ``split`` when given) of every file; the files must hold
    the same rows with the same labels. Prints one line per file, best first, with the
    log evidence per sample and summed; the last line names the best file. Returns 0.
    """
    from probfsl.data.loaders import load_features

    if len(paths) < 1:
        raise ValueError("select needs at least one feature file")
    sets = [load_features(p) for p in paths]
    first = sets[0]
    for p, fs in zip(paths, sets, strict=True):
        if fs.features.shape[0] != first.features.shape[0]:
            raise ValueError(
                f"feature files have different row counts: {paths[0]} has "
                f"{first.features.shape[0]}, {p} has {fs.features.shape[0]}"
            )
        if not np.array_equal(fs.labels, first.labels):
            raise ValueError(f"{p} and {paths[0]} have different labels: not the same samples")
    rows = first.labels >= 0
    if split is not None:
        rows &= first.split == split
    labels = first.labels[rows]
    ranking = rank_backbones(
        {str(p): fs.features[rows] for p, fs in zip(paths, sets, strict=True)}, labels
    )
    n, k = int(rows.sum()), len(np.unique(labels))
    print(f"evidence ranking on {n} samples, {k} classes (log evidence per sample, summed):")
    for i, b in enumerate(ranking, 1):
        flag = f"  [{b.at_boundary} classes at a lambda bound]" if b.at_boundary else ""
        print(f"{i}. {b.name}  {b.per_sample:.6f}  ({b.log_evidence:.3f}, D={b.dim}){flag}")
    print(f"best: {ranking[0].name}")
    return 0


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
        raise ValueError("evidence_datatree needs an EvidenceLSSVM fitted with fit(X, y)")
    sp = model.spectrum_
    d = min(sp.dim, max_dim)
    cov = posterior_covariance(sp, model.alpha_, model.beta_)  # [K, D, D]
    mean = model.coef_  # [K, D]
    gen = torch.Generator().manual_seed(seed)
    chol = torch.linalg.cholesky(cov[:, :d, :d])
    eps = torch.randn(n_draws, *mean[:, :d].shape, dtype=mean.dtype, generator=gen)
    draws = mean[:, :d] + (chol @ eps.unsqueeze(-1)).squeeze(-1)
    classes = [str(c) for c in model.classes_]
    tree = to_datatree(
        {"w": draws.unsqueeze(0).numpy()},
        dims={"w": ["class", "feature"]},
        coords={"class": classes, "feature": np.arange(d)},
    )
    if lambdas is None:
        scale = float(sp.mean_s)
        lambdas = scale * torch.logspace(-6, 6, 121, dtype=sp.s.dtype)
    curve = evidence_curve(sp, lambdas.to(sp.s.dtype))  # [K, G]
    tree["posterior_summary"] = xr.DataTree(
        xr.Dataset(
            {
                "w_mean": (("class", "feature"), mean.numpy()),
                "w_sd": (("class", "feature"), cov.diagonal(dim1=-2, dim2=-1).sqrt().numpy()),
                "w_cov_trace": (("class",), cov.diagonal(dim1=-2, dim2=-1).sum(-1).numpy()),
            },
            coords={"class": classes, "feature": np.arange(sp.dim)},
        )
    )
    tree["evidence_curve"] = xr.DataTree(
        xr.Dataset(
            {
                "log_evidence": (("class", "lam"), curve.numpy()),
                "lambda_hat": (("class",), model.lambda_.numpy()),
                "log_evidence_hat": (("class",), model.log_evidence_.numpy()),
                "at_boundary": (("class",), model.at_boundary_.numpy()),
            },
            coords={"class": classes, "lam": lambdas.numpy()},
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
    "EvidenceLSSVM",
    "backbone_evidence",
    "evidence_datatree",
    "evidence_model",
    "greedy_ensemble",
    "plot_evidence",
    "rank_backbones",
    "select_main",
]
