"""scikit-learn classifiers for every few-shot method of the registry.

One classifier per method of :data:`probfsl.methods.METHODS`, each a
:class:`sklearn.base.ClassifierMixin` and :class:`sklearn.base.BaseEstimator` that wraps
the method's estimator for **one few-shot task**:

* ``fit(X, y)`` takes the task's *support set*, its labelled examples (labels of the
  types scikit-learn's classifiers take: strings, integers, pandas categories, ...); the
  task's classes are the distinct values of ``y`` (``classes_``), with as many or as few
  examples of each as the method allows (one shot is fine);
* ``predict(X)`` / ``predict_proba(X)`` classify the task's *queries*; transductive
  methods (soft k-means, BAVARDAGE, BAVARDAGE-Gamma, vmp-gmm, EM-Dirichlet) use all the
  rows of ``X`` together, as the unlabelled queries of that one task, so predicting rows
  one at a time or in chunks gives other results than predicting them at once;
* ``score`` is :class:`~sklearn.base.ClassifierMixin`'s accuracy, so the classifiers work
  in a :class:`~sklearn.pipeline.Pipeline`, :func:`~sklearn.model_selection.cross_val_score`
  and :class:`~sklearn.model_selection.GridSearchCV`.

The hyperparameters are those of the wrapped estimator, under the same names and with
the same defaults (but for two of EvidenceLSSVM's: ``score`` is ``evidence_score``,
``dtype`` is spelled ``"float64"`` or ``"float32"``), plus ``base_features`` and
``base_labels``: the labelled *base classes* a method takes its statistics from (a
centring mean, a within-class scatter, negatives). Give them at construction or with
:meth:`FewShotTaskClassifier.fit_base`; both store them as parameters, so
:func:`sklearn.base.clone` and grid searches keep them. Without base classes the support
set stands in for them.

:func:`expected_failed_checks` lists the checks of
:func:`sklearn.utils.estimator_checks.check_estimator` that cannot apply to a few-shot
classifier, each with its reason; every other check passes.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

import numpy as np
import torch

try:
    from sklearn.base import BaseEstimator, ClassifierMixin
    from sklearn.utils import Tags
    from sklearn.utils.multiclass import check_classification_targets
    from sklearn.utils.validation import check_array, check_is_fitted, column_or_1d, validate_data
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "probfsl.sklearn needs scikit-learn 1.6 or newer: pip install 'scikit-learn>=1.6'"
    ) from err

from probfsl.methods import method_info
from probfsl.models.base import FewShotClassifier, episodes_from_arrays
from probfsl.validation import check_flag

__all__ = [
    "CLASSIFIERS",
    "FewShotBavardage",
    "FewShotBavardageGamma",
    "FewShotEMDirichlet",
    "FewShotEvidenceLSSVM",
    "FewShotGPTree",
    "FewShotNearestCentroid",
    "FewShotSLEM",
    "FewShotSoftKMeans",
    "FewShotTaskClassifier",
    "FewShotVMPGaussianMixture",
    "expected_failed_checks",
]

#: the floating-point dtypes kept as given (any other numeric input becomes float64)
_FLOAT_DTYPES = [np.float64, np.float32]
#: parameters of every classifier that are not the wrapped estimator's hyperparameters
_BASE_PARAMS = ("base_features", "base_labels")


def _store(estimator: BaseEstimator, arguments: dict[str, Any]) -> None:
    """scikit-learn's ``__init__`` convention: each argument stored under its own name."""
    for name, value in arguments.items():
        if name not in ("self", "__class__"):
            setattr(estimator, name, value)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor, sharing memory unless it is read-only (then copied)."""
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)


class FewShotTaskClassifier(ClassifierMixin, BaseEstimator):
    """A scikit-learn classifier for one few-shot task: ``fit`` on the support set,
    ``predict`` the queries. The subclasses name the method (``method``); their
    ``__init__`` arguments are the method estimator's hyperparameters plus
    ``base_features`` and ``base_labels``.

    Attributes:
        classes_: after ``fit``, the task's classes, sorted (the columns of
            :meth:`predict_proba`).
        n_features_in_: the width of the features; ``feature_names_in_`` too when ``X``
            was a DataFrame with string column names.
        estimator_: the fitted method estimator
            (:class:`~probfsl.models.base.FewShotClassifier`), with its base statistics.
        support_: the support features ``[n, D]`` (float32 or float64, as given).
        support_labels_: the support labels as positions in ``classes_`` ``[n]``.
    """

    #: the registry name of the wrapped method (:data:`probfsl.methods.METHODS`)
    method: ClassVar[str]

    @classmethod
    def estimator_class(cls) -> type[FewShotClassifier]:
        """The wrapped method's estimator class."""
        return method_info(cls.method).load()

    @property
    def transductive(self) -> bool:
        """Whether the method classifies the queries of :meth:`predict` jointly."""
        return bool(self.estimator_class().transductive)

    def _hyperparameters(self) -> dict[str, Any]:
        """The wrapped estimator's hyperparameters, as its ``__init__`` takes them."""
        params = self.get_params(deep=False)
        return {k: v for k, v in params.items() if k not in _BASE_PARAMS}

    def _make_estimator(self) -> FewShotClassifier:
        """A new wrapped estimator with this classifier's hyperparameters, checked."""
        return self.estimator_class()(**self._hyperparameters()).check_params()

    # -- base classes -------------------------------------------------------------------
    def fit_base(self, X: Any, y: Any) -> Self:
        """Give the base classes: features ``X`` [N, D] and their labels ``y`` [N] (of
        any type; at least two classes for BAVARDAGE and BAVARDAGE-Gamma).

        They are checked, then stored as the ``base_features`` and ``base_labels``
        parameters (so :func:`~sklearn.base.clone` and grid searches keep them); the
        method's base statistics are computed from them by each :meth:`fit`. Returns
        ``self``. Base features do not pass through the earlier steps of a
        :class:`~sklearn.pipeline.Pipeline`: transform them as the support will be.
        """
        X, y = self._check_base(X, y)
        return self.set_params(base_features=X, base_labels=y)

    def _check_base(self, X: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
        """Base features [N, D] (float32/float64 kept, finite) and labels [N], checked."""
        if y is None:
            raise ValueError("base_features are given without base_labels: give both")
        X = check_array(X, dtype=_FLOAT_DTYPES, input_name="base_features")
        y = column_or_1d(y)
        if y.shape[0] != X.shape[0]:
            raise ValueError(
                f"base_labels has {y.shape[0]} labels for {X.shape[0]} base_features rows"
            )
        return X, y

    def _base_arrays(self, X: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The base features and integer labels: the parameters when given, else the
        support (``X``, ``codes``) standing in for the base classes."""
        if self.base_features is None:
            if self.base_labels is not None:
                raise ValueError("base_labels are given without base_features: give both")
            return X, codes
        base, labels = self._check_base(self.base_features, self.base_labels)
        if base.shape[1] != X.shape[1]:
            raise ValueError(
                f"X has {X.shape[1]} features, but the base features have {base.shape[1]}"
            )
        return base, np.unique(labels, return_inverse=True)[1]

    # -- the task -----------------------------------------------------------------------
    def fit(self, X: Any, y: Any) -> Self:
        """Take the support set of a task: features ``X`` [n, D] and labels ``y`` [n].

        The task's classes are the distinct values of ``y`` (at least two); the method's
        base statistics are computed from the base classes (the support when none were
        given). Returns ``self``.
        """
        X, y = validate_data(self, X, y, dtype=_FLOAT_DTYPES)
        check_classification_targets(y)
        classes, codes = np.unique(y, return_inverse=True)
        if len(classes) < 2:
            raise ValueError(
                f"a few-shot task needs at least 2 classes in y, got {len(classes)} class"
            )
        estimator = self._make_estimator()
        if estimator.needs_base:
            base, labels = self._base_arrays(X, codes)
            try:
                estimator.fit_base(_tensor(base), torch.from_numpy(labels.astype(np.int64)))
            except ValueError as err:
                if base is not X:
                    raise
                raise ValueError(
                    f"{err} (no base classes were given, so the support set stood in for "
                    "them: give base_features and base_labels, or call fit_base)"
                ) from err
        self.classes_ = classes
        self.estimator_ = estimator
        self.support_ = X
        self.support_labels_ = codes.astype(np.int64)
        return self

    def predict_proba(self, X: Any, open_set: bool = False) -> np.ndarray:
        """Class probabilities ``[Q, K]`` of the queries ``X`` [Q, D] of the task
        (columns in ``classes_`` order), in the support's dtype. Transductive methods
        classify the rows of ``X`` jointly, as one task's queries.

        ``open_set=True``: the queries may belong to none of the task's classes; the
        probabilities are ``[Q, K + 1]``, the last column P(none of these classes), the
        method's open-set posterior (its background learnt from the base classes, so
        ``base_features`` with at least two classes are needed)."""
        check_flag("open_set", open_set)
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=_FLOAT_DTYPES)
        support = _tensor(self.support_)
        query = _tensor(X).to(support.dtype)
        episodes, _, _ = episodes_from_arrays(support, self.support_labels_, query)
        if open_set:
            if self.base_features is None:
                raise ValueError(
                    "open_set=True weighs each query against a background learnt from the "
                    "base classes: give base_features and base_labels, or call fit_base"
                )
            proba = self.estimator_.predict_proba_open(episodes)[0]
        else:
            proba = self.estimator_.predict_proba(episodes)[0]
        return proba.detach().cpu().numpy()

    def predict(self, X: Any) -> np.ndarray:
        """The class (a value of ``classes_``) of each query of ``X`` [Q, D]: the
        argmax of :meth:`predict_proba`."""
        proba = self.predict_proba(X)
        return self.classes_[proba.argmax(1)]

    def __sklearn_tags__(self) -> Tags:
        """scikit-learn's tags: dense finite float input, multiclass, deterministic."""
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.input_tags.sparse = False
        tags.classifier_tags.multi_class = True
        tags.classifier_tags.multi_label = False
        tags.target_tags.required = True
        tags.requires_fit = True
        tags.non_deterministic = False  # every random draw is seeded
        return tags


class FewShotNearestCentroid(FewShotTaskClassifier):
    """Nearest class mean with cosine similarity, on features centred on the base mean
    (SimpleShot: Wang, Chao, Weinberger & van der Maaten, 2019); inductive.

    Hyperparameters: those of :class:`~probfsl.models.nearest_centroid.NearestCentroid`,
    plus ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`).
    """

    method = "nearest-centroid"

    def __init__(
        self,
        *,
        center: bool = True,
        prototype: str = "mean",
        temperature: float = 10.0,
        open_prior: float = 0.5,
        open_frame: str = "base",
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotSoftKMeans(FewShotTaskClassifier):
    """Transductive soft k-means seeded by the support means (the initialiser of
    BAVARDAGE: Hu, Pateux & Gripon, AISTATS 2023).

    Hyperparameters: those of :class:`~probfsl.models.soft_kmeans.SoftKMeans`, plus
    ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`).
    """

    method = "soft-kmeans"

    def __init__(
        self,
        *,
        temperature: float = 10.0,
        n_iter: int = 5,
        center: bool = True,
        open_prior: float = 0.5,
        open_scale: float | None = None,
        open_shift: float | None = None,
        open_frame: str = "queries",
        open_neighbours: int = 0,
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotBavardage(FewShotTaskClassifier):
    """BAVARDAGE, a transductive variational Bayesian Gaussian mixture in an adaptive
    PLDA subspace (Hu, Pateux & Gripon, "Adaptive Dimension Reduction and Variational
    Inference for Transductive Few-Shot Classification", AISTATS 2023).

    Hyperparameters: those of :class:`~probfsl.models.bavardage.Bavardage`, plus
    ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`): the
    within-class scatter of the base classes (at least two) sets the whitening.
    """

    method = "bavardage"

    def __init__(
        self,
        *,
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
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotBavardageGamma(FewShotTaskClassifier):
    """BAVARDAGE with a per-class diagonal Gamma precision, derived by variational
    message passing (after Hu, Pateux & Gripon, AISTATS 2023, and Winn & Bishop, JMLR
    2005); transductive.

    Hyperparameters: those of :class:`~probfsl.models.bavardage_gamma.BavardageGamma`,
    plus ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`).
    """

    method = "bavardage-gamma"

    def __init__(
        self,
        *,
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
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotVMPGaussianMixture(FewShotTaskClassifier):
    """A transductive variational Bayesian Gaussian mixture with a per-class diagonal
    Gamma precision, inference derived by variational message passing (Winn & Bishop,
    "Variational Message Passing", JMLR 2005).

    Hyperparameters: those of :class:`~probfsl.models.vmp_gmm.VMPGaussianMixture`, plus
    ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`).
    """

    method = "vmp-gmm"

    def __init__(
        self,
        *,
        alpha0: float = 2.0,
        beta0: float = 1.0,
        a0: float = 10.0,
        temperature: float = 10.0,
        n_kmeans: int = 5,
        max_iter: int = 30,
        tol: float = 1e-06,
        precision: str = "diagonal",
        chunk: int = 50,
        open_prior: float = 0.5,
        open_model: str = "nested",
        background_weight: float = 10.0,
        open_scale: float | None = None,
        open_shift: float | None = None,
        open_frame: str = "queries",
        open_neighbours: int = 0,
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotGPTree(FewShotTaskClassifier):
    """Pólya-Gamma Gaussian-process classifiers in a tree of the classes (Achituve,
    Navon, Yemini, Chechik & Fetaya, "GP-Tree", ICML 2021); inductive, Gibbs sampling
    with the random streams seeded by ``seed``.

    Hyperparameters: those of :class:`~probfsl.models.gp_tree.few_shot.GPTreeFewShot`,
    plus ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`).
    """

    method = "gp-tree"

    def __init__(
        self,
        *,
        n_chains: int = 20,
        n_sweeps: int = 10,
        outputscale: float = 8.0,
        lengthscale: float = 1.0,
        center: bool = True,
        pg_sampler: str = "torch",
        seed: int = 0,
        max_nodes: int = 2000,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotEvidenceLSSVM(FewShotTaskClassifier):
    """One-vs-rest Bayesian linear regression with its penalty chosen by the evidence
    (Kim, Jang, Han & Choi, "Learning to Select Pre-Trained Deep Representations with
    Bayesian Evidence Framework", CVPR 2016); inductive.

    Hyperparameters: those of :class:`~probfsl.models.evidence.EvidenceLSSVM`, plus
    ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`). Two are
    renamed: the estimator's ``score`` (how ``total_log_evidence_`` sums the evidence) is
    ``evidence_score`` here, since ``score`` is scikit-learn's accuracy method, and the
    computation dtype ``dtype`` is spelled ``"float64"`` (default) or ``"float32"``.
    """

    method = "evidence-lssvm"

    def __init__(
        self,
        *,
        normalize: bool = True,
        center: bool = True,
        fit_intercept: bool = False,
        paper_exact: bool = False,
        accelerate: bool = True,
        lam_init: float = 1.0,
        temperature: float = 10.0,
        evidence_score: str = "sum",
        lambda_mode: str = "shared",
        dtype: str = "float64",
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())

    def _hyperparameters(self) -> dict[str, Any]:
        params = super()._hyperparameters()
        params["score"] = params.pop("evidence_score")
        dtype = params["dtype"]
        if isinstance(dtype, str):
            if dtype not in ("float32", "float64"):
                raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
            params["dtype"] = getattr(torch, dtype)
        return params


class FewShotSLEM(FewShotTaskClassifier):
    """Square-loss exemplar machines, one per class against the base set as negatives
    (Rezende, Zepeda, Ponce, Bach & Pérez, "Kernel Square-Loss Exemplar Machines for
    Image Retrieval", CVPR 2017); inductive.

    Hyperparameters: those of :class:`~probfsl.models.slem.SLEM`, plus
    ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`): without base
    classes, the support set is the set of negatives.
    """

    method = "slem"

    def __init__(
        self,
        *,
        lam: float | None = None,
        rel_lam: float = 10.0,
        normalize: bool = True,
        temperature: float = 1.0,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


class FewShotEMDirichlet(FewShotTaskClassifier):
    """EM-Dirichlet, a transductive Dirichlet mixture on the class-probability vectors
    of the samples (Martin, Huang, Shakeri, Pesquet & Ben Ayed, "Transductive Zero-Shot
    and Few-Shot CLIP", CVPR 2024). Features become probability vectors by a softmax of
    ``temperature`` times their cosines with the support means (centred on the base mean),
    so any real features are accepted.

    Hyperparameters: those of :class:`~probfsl.models.em_dirichlet.EMDirichlet`, plus
    ``base_features``/``base_labels`` (see :class:`FewShotTaskClassifier`).
    """

    method = "em-dirichlet"

    def __init__(
        self,
        *,
        hard: bool = False,
        lambda_coef: float | None = None,
        k_eff: int = 5,
        temperature: float = 30.0,
        n_iter: int | None = None,
        tol: float | None = None,
        center: bool = True,
        mm_max_iter: int | None = None,
        mm_tol: float | None = None,
        mm_check_every: int | None = None,
        matching: str = "hungarian",
        solver: str | None = None,
        compiled: bool | None = None,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
        base_features: Any = None,
        base_labels: Any = None,
    ) -> None:
        _store(self, locals())


#: the classifier of each registered method, by its registry name
CLASSIFIERS: dict[str, type[FewShotTaskClassifier]] = {
    cls.method: cls
    for cls in (
        FewShotNearestCentroid,
        FewShotSoftKMeans,
        FewShotBavardage,
        FewShotBavardageGamma,
        FewShotVMPGaussianMixture,
        FewShotGPTree,
        FewShotEvidenceLSSVM,
        FewShotSLEM,
        FewShotEMDirichlet,
    )
}


def expected_failed_checks(estimator: BaseEstimator) -> dict[str, str]:
    """The checks of :func:`sklearn.utils.estimator_checks.check_estimator` that cannot
    pass for ``estimator``, each with the reason (empty for any other estimator); for
    ``expected_failed_checks=`` of :func:`~sklearn.utils.estimator_checks.check_estimator`
    and :func:`~sklearn.utils.estimator_checks.parametrize_with_checks`."""
    failures: dict[str, str] = {}
    if not isinstance(estimator, FewShotTaskClassifier):
        return failures
    if estimator.transductive:
        failures["check_methods_subset_invariance"] = (
            "transductive: the rows given to predict are the unlabelled queries of one "
            "task and are classified jointly, so a subset of them is another task"
        )
    if "max_iter" in estimator.get_params():
        failures["check_non_transformer_estimators_n_iter"] = (
            "max_iter bounds the iterations of each prediction (the queries are the data "
            "the mixture is fitted to); fit only stores the support, so no n_iter_ exists"
        )
    return failures
