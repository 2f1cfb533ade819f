"""Square-loss exemplar machines (SLEM) as a retrieval encoder and a few-shot classifier.

Rezende, Zepeda, Ponce, Bach, Pérez, "Kernel Square-Loss Exemplar Machines for Image
Retrieval", CVPR 2017 (docs/design/slem.md). The closed forms are in
:mod:`probfsl.inference.woodbury`.

Probabilistic readings (design §2):

* (a) :func:`slem_model`, the Pyro model whose MAP is SLEM's closed form: SLEM's
  objective J(omega, nu) is the negative log posterior of a Gaussian linear model of the
  +-1 targets (flat prior on the intercept nu, ``omega ~ Normal(0, lambda^-1 I)``, the
  positive with precision theta, each negative with precision 1/n). The posterior is
  Gaussian (conjugate) and its mean is the MAP.
* (b) classes Gaussian with a shared covariance, ``z | c ~ Normal(mu_c, Sigma)``; SLEM's
  direction ``(Sigma_bg + lambda I)^-1 (x0 - mu_bg)`` is the plug-in LDA direction with
  the background covariance shrunk towards lambda I. :class:`SLEM` scores with it.

**Outside the engine contract.** SLEM is a closed form (one factorisation of
``Sigma + lambda I`` in ``fit``, one solve per class mean): there are no iterations, so
there is no :class:`~probfsl.inference.base.Engine`, no :func:`~probfsl.inference.base.run`
and no guide, and the engine checks of :mod:`probfsl.testing` that are about iterations
(monotone objective, Trace_ELBO of a guide, no host synchronisation per step, exact
evidence) do not apply. What applies, and is tested in ``tests/test_slem.py``: the closed
form is the MAP of :func:`slem_model` (zero gradient and a maximum of Pyro's log joint,
float64), it equals the posterior mean of the conjugate Gaussian, batched equals
one-at-a-time, float32 agrees with float64.

* :class:`SLEMEncoder`: ``fit(negatives)`` once, then ``transform(x)`` gives normalised
  exemplar descriptors for cosine retrieval (:func:`slem_similarity`); ``exemplars(x0)``
  gives the full ``(omega, nu)`` by the Woodbury form.
* :class:`SLEM`: few-shot classifier (``probfsl run --method slem``): one SLEM per class
  (class mean as the exemplar) against the base set as negatives; the scores are the
  LDA discriminants with covariance ``Sigma_base + lambda I``.
"""

from __future__ import annotations

import math
from typing import Any, Self

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.derived.slem import ENGINES
from probfsl.inference.class_stats import class_means, one_hot_support
from probfsl.inference.vb_mixture_open import OPEN_FRAMES
from probfsl.inference.woodbury import (
    NegativeFactor,
    default_lambda,
    factor_negatives,
    slem_descriptors,
    slem_similarity,
    slem_woodbury,
)
from probfsl.models.base import (
    BACKGROUND,
    ENGINE,
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
    Maybe,
    Real,
    Record,
    Tensor,
)
from probfsl.validation import as_float_tensor, check_base, check_episodes, check_hyperparameter


def slem_model(
    x0: torch.Tensor,
    negatives: torch.Tensor,
    lam: float | torch.Tensor,
    theta: float = 1.0,
) -> None:
    """Gaussian linear model whose MAP (and posterior mean) is SLEM's ``(omega, nu)``.

    Design §2(a), for exemplars ``x0 [..., P, d]`` (one problem each, plate ``exemplars``)
    against shared negatives ``x_1..x_n`` (``negatives [..., n, d]``), targets +1 / -1::

        nu    ~ flat on R                            (intercept, unpenalised)
        omega ~ Normal(0, lambda^-1 I_d)
        +1    ~ Normal(omega^T x0 + nu, 1 / theta)   (the positive: precision theta)
        -1    ~ Normal(omega^T x_i + nu, n)          (each negative: precision 1/n)

    so ``-log p(omega, nu | data) = J(omega, nu) + const`` with SLEM's objective
    ``J = theta l(1, omega^T x0 + nu) + 1/n sum_i l(-1, omega^T x_i + nu)
    + lambda/2 ||omega||^2``, ``l(y, yhat) = (y - yhat)^2 / 2`` (Rezende et al., CVPR
    2017; :mod:`probfsl.inference.woodbury`). The posterior is Gaussian, so its mean is
    the MAP, :func:`~probfsl.inference.woodbury.slem_woodbury`. The +-1 "observations"
    and the precisions theta and 1/n are design weights, not a generative story of
    labels (design §2: formally exact, artificial).
    """
    lam = torch.as_tensor(lam, dtype=x0.dtype, device=x0.device)
    n, d = negatives.shape[-2], x0.shape[-1]
    batch = x0.shape[:-1]  # [..., P]
    with pyro.plate("exemplars", x0.shape[-2], dim=-1):
        nu = pyro.sample("nu", dist.ImproperUniform(constraints.real, batch, ()))
        scale = lam.rsqrt().unsqueeze(-1).expand(*batch, d)
        omega = pyro.sample("omega", dist.Normal(torch.zeros_like(scale), scale).to_event(1))
        positive = (omega * x0).sum(-1) + nu
        pyro.sample("positive", dist.Normal(positive, theta**-0.5), obs=torch.ones_like(nu))
        scores = (negatives.unsqueeze(-3) @ omega.unsqueeze(-1)).squeeze(-1) + nu.unsqueeze(-1)
        pyro.sample(
            "negatives",
            dist.Normal(scores, math.sqrt(n)).to_event(1),
            obs=-torch.ones_like(scores),
        )


def _tensor(x: Any, name: str = "x") -> torch.Tensor:
    """``x`` as a checked float32/float64 tensor (NumPy converted; ``TypeError`` otherwise)."""
    return as_float_tensor(x, name)


#: the ridge penalty: positive (0 is no ridge, a singular system) or None (relative)
LAM = Real(positive=True, optional=True)
#: the relative ridge penalty used when ``lam`` is None
REL_LAM = Real(positive=True)


def _check_lam(lam: Any, rel_lam: Any) -> None:
    LAM.check("lam", lam)
    REL_LAM.check("rel_lam", rel_lam)


#: a :class:`~probfsl.inference.woodbury.NegativeFactor` of the base features ``[N, D]``
#: (one factor, no batch): ``chol`` is the factor of ``Sigma + lambda I`` ``[D, D]``
#: (primal) or of the N x N dual system with the centred negatives ``xc`` (dual)
NEGATIVE_FACTOR = Record(
    NegativeFactor,
    {
        "mode": Choice(("primal", "dual")),
        "mu": Tensor("D", bound=FEATURE_BOUND),
        "lam": Tensor(positive=True),
        "chol": Tensor("D", "D"),
        "xc": Maybe(),
    },
    by="mode",
    variants={
        "primal": {},
        "dual": {"chol": Tensor("N", "N"), "xc": Tensor("N", "D", bound=FEATURE_BOUND)},
    },
)


class SLEMEncoder:
    """Exemplar descriptors against a fixed negative pool (design §3 "Descriptor and similarity").

    Args:
        lam: ridge penalty; ``None`` gives ``rel_lam * trace(Sigma) / d`` (retrieval default 1e-3).
        theta: weight of the positive (does not change normalised descriptors).
        normalize: L2-normalise the descriptors.
        rel_lam: relative penalty used when ``lam`` is None.
    """

    def __init__(
        self,
        lam: float | None = None,
        theta: float = 1.0,
        normalize: bool = True,
        rel_lam: float = 1e-3,
    ) -> None:
        self.lam = lam
        self.theta = theta
        self.normalize = normalize
        self.rel_lam = rel_lam

    def fit(self, negatives: Any) -> Self:
        """Factorise ``Sigma + lambda I`` of the negatives ``[n, d]`` once."""
        _check_lam(self.lam, self.rel_lam)
        check_hyperparameter("theta", self.theta, positive=True)
        neg = _tensor(negatives, "negatives")
        if neg.ndim != 2:
            raise ValueError(f"negatives must be [n, d], got shape {tuple(neg.shape)}")
        lam = default_lambda(neg, self.rel_lam) if self.lam is None else self.lam
        self.factor_: NegativeFactor = factor_negatives(neg, lam)
        self.lam_ = self.factor_.lam
        return self

    def _factor(self) -> NegativeFactor:
        if not hasattr(self, "factor_"):
            raise ValueError("SLEMEncoder is not fitted: call fit(negatives) first")
        return self.factor_

    def exemplars(self, x0: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(omega [P, d], nu [P])`` of each row of ``x0`` as a positive (Woodbury form)."""
        return slem_woodbury(_tensor(x0, "x0"), self._factor(), self.theta)

    def transform(self, x: Any) -> torch.Tensor:
        """Descriptors ``A^-1 (x - mu)`` (normalised when ``normalize``), ``[P, d]``."""
        return slem_descriptors(_tensor(x, "x"), self._factor(), self.normalize)

    def similarity(self, a: Any, b: Any | None = None) -> torch.Tensor:
        """Cosine similarity of the descriptors of ``a`` and ``b`` (default ``a``)."""
        da = self.transform(a)
        return slem_similarity(da, None if b is None else self.transform(b))


class SLEM(OpenSetBackground, FewShotClassifier):
    """Few-shot SLEM / shrinkage LDA against the base set (design §1, §3 "Several positives").

    For each class c of a task, ``omega_c = A^-1 (xbar_c - mu)`` with the base mean ``mu``
    and ``A = Sigma_base + lambda I``; a query x scores ``omega_c^T (x - (xbar_c + mu)/2)``
    (LDA offsets), and ``predict_proba`` is ``softmax(temperature * score)``, the LDA
    posterior with covariance ``A / temperature``-free scaling at temperature 1.

    ``omega_c`` is the direction of the MAP of :func:`slem_model` with the class mean as
    the exemplar (``omega* = 2 theta / (theta q_c + theta + 1) A^-1 delta_c``, design §3);
    the class-dependent scale and the intercept nu* are replaced by the LDA reading's
    offsets (design §2b, §3 "several positives"), so that the scores of different classes
    are comparable.

    Args:
        lam: ridge penalty; ``None`` gives ``rel_lam * trace(Sigma_base) / d``.
        rel_lam: relative penalty used when ``lam`` is None. The retrieval default of
            design §4, 1e-3, under-regularises few-shot classification; 10 was chosen on base-class
            validation episodes (half the base classes as negatives, 5-way tasks from the
            other half) of Omniglot Lite0-1280 and PCA-64 features (see
            ``benchmarks/bench_evidence.py``).
        normalize: L2-normalise features (after subtracting the base mean) first.
        temperature: multiplies the scores in the softmax.
        engine: ``"handwritten"`` (one Cholesky factor of ``A``, the Woodbury form) or
            ``"derived"`` (the MAP of :func:`slem_model` with one exemplar per class, by
            the updates VMP derives: :mod:`probfsl.derived.slem`; it keeps the
            preprocessed base features as ``negatives_``).
    """

    needs_base = True
    schema = EstimatorSchema(
        params={
            "lam": LAM,
            "rel_lam": REL_LAM,
            "normalize": Flag(),
            "temperature": Real(positive=True),
            "engine": ENGINE,
            "open_prior": OPEN_PRIOR,
            "open_frame": Choice(OPEN_FRAMES),
        },
        fitted=(
            Group(
                "fit_base",
                {
                    "base_mean_": Tensor("D", bound=FEATURE_BOUND),
                    "factor_": NEGATIVE_FACTOR,
                    "lam_": Tensor(positive=True),
                    "negatives_": Tensor("N", "D", bound=FEATURE_BOUND),
                },
                optional=frozenset({"negatives_"}),
            ),
            BACKGROUND,
        ),
    )

    def __init__(
        self,
        lam: float | None = None,
        rel_lam: float = 10.0,
        normalize: bool = True,
        temperature: float = 1.0,
        engine: str = "handwritten",
        open_prior: float = 0.5,
        open_frame: str = "base",
    ) -> None:
        self.lam = lam
        self.rel_lam = rel_lam
        self.normalize = normalize
        self.temperature = temperature
        self.engine = engine
        self.open_prior = open_prior
        self.open_frame = open_frame

    def setting_note(self, way: int, shot: int) -> str:
        """What the engine costs (the derived one: a d x d posterior per class and task)."""
        return ENGINES[self.engine].note

    def _prep(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return center_and_normalize(x, mean) if self.normalize else x - mean.to(x)

    def fit_base(self, features: torch.Tensor, labels: torch.Tensor) -> Self:
        """Base mean (for centring) and the factorisation of ``Sigma_base + lambda I``.

        ``features`` [N, D] and ``labels`` [N]: tensors or NumPy arrays. The factor is kept
        in the features' dtype and cast to each batch's dtype and device.
        """
        self._check_params()
        check_base(features, labels)
        features = as_float_tensor(features, "base features", ndim=2)
        if features.shape[0] < 2:
            raise ValueError("base features: need at least two samples")
        self.base_mean_ = features.mean(0)
        neg = self._prep(features, self.base_mean_)
        lam = default_lambda(neg, self.rel_lam) if self.lam is None else self.lam
        self.fit_background(neg, torch.as_tensor(labels, device=neg.device))
        self.factor_ = factor_negatives(neg, lam)
        self.lam_ = self.factor_.lam
        if ENGINES[self.engine].keeps_negatives:  # the declaration takes them as data
            self.negatives_ = neg
        return self

    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """``softmax(temperature * LDA scores)`` ``[T, Q, K]`` in the episodes' dtype/device."""
        self._check_params()
        if not hasattr(self, "factor_"):
            raise ValueError("SLEM needs base features as negatives: call fit_base first")
        check_episodes(episodes, dim=self.base_mean_.shape[0])
        f = self.factor_
        dtype = episodes.support.dtype
        to = {"dtype": dtype, "device": episodes.support.device}
        factor = NegativeFactor(
            f.mu.to(**to),
            f.lam.to(**to),
            f.chol.to(**to),
            None if f.xc is None else f.xc.to(**to),
            f.mode,
        )
        support = self._prep(episodes.support, self.base_mean_)
        query = self._prep(episodes.query, self.base_mean_)
        means = class_means(support, one_hot_support(episodes.support_labels, episodes.way, dtype))
        negatives = getattr(self, "negatives_", None)
        negatives = None if negatives is None else negatives.to(query)
        engine = ENGINES[self.engine]  # probfsl.derived.slem: "handwritten" or "derived"
        scores = engine.scores(query, means, factor, negatives, self.lam_.to(query))
        return torch.softmax(self.temperature * scores, -1)

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """``[T, Q, K+1]``: :meth:`predict_proba` times 1 - P(open), and P(open) last.

        P(open) is the inductive outlier posterior of the two-covariance Gaussian reading
        of the centred (normalised) features of the LDA scores, with prior ``open_prior``
        (:meth:`~probfsl.models.base.OpenSetBackground.inductive_open`).
        It is read in the frame ``open_frame``: ``"base"``, or ``"queries"``, re-centred on
        the task's query mean (as :class:`~probfsl.models.nearest_centroid.NearestCentroid`).
        """
        proba = self.predict_proba(episodes)
        support = self._prep(episodes.support, self.base_mean_)
        query = self._prep(episodes.query, self.base_mean_)
        return self.inductive_open(episodes, proba, support, query)
