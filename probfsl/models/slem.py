"""Square-loss exemplar machines (SLEM) as a retrieval encoder and a few-shot classifier.

Rezende, Zepeda, Ponce, Bach, Pérez, "Kernel Square-Loss Exemplar Machines for Image
Retrieval", CVPR 2017 (spec ``slem.md``). The closed forms are in
:mod:`probfsl.inference.woodbury`.

Probabilistic reading (spec §2b): classes are Gaussian with a shared covariance,
``z | c ~ Normal(mu_c, Sigma)``; SLEM's direction ``(Sigma_bg + lambda I)^-1 (x0 - mu_bg)``
is the plug-in LDA direction with the background covariance shrunk towards lambda I.
SLEM itself is an optimisation problem (no sample sites), so no Pyro model is declared.

* :class:`SLEMEncoder`: ``fit(negatives)`` once, then ``transform(x)`` gives normalised
  exemplar descriptors for cosine retrieval (:func:`slem_similarity`); ``exemplars(x0)``
  gives the full ``(omega, nu)`` by the Woodbury form.
* :class:`SLEM`: few-shot classifier (``probfsl run --method slem``): one SLEM per class
  (class mean as the exemplar) against the base set as negatives; the scores are the
  LDA discriminants with covariance ``Sigma_base + lambda I``.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.inference.woodbury import (
    NegativeFactor,
    default_lambda,
    factor_negatives,
    lda_scores,
    slem_descriptors,
    slem_similarity,
    slem_woodbury,
)
from probfsl.models.base import FewShotClassifier
from probfsl.validation import as_float_tensor, check_base, check_episodes, check_hyperparameter


def _tensor(x: Any, name: str = "x") -> torch.Tensor:
    """``x`` as a checked float32/float64 tensor (NumPy converted; ``TypeError`` otherwise)."""
    return as_float_tensor(x, name)


def _check_lam(lam: Any, rel_lam: Any) -> None:
    if lam is not None:
        check_hyperparameter("lam", lam, nonnegative=True)
    check_hyperparameter("rel_lam", rel_lam, positive=True)


class SLEMEncoder:
    """Exemplar descriptors against a fixed negative pool (spec §3 "Descriptor and similarity").

    Args:
        lam: ridge penalty; ``None`` gives ``rel_lam * trace(Sigma) / d`` (spec default 1e-3).
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


class SLEM(FewShotClassifier):
    """Few-shot SLEM / shrinkage LDA against the base set (spec §1, §3 "Several positives").

    For each class c of a task, ``omega_c = A^-1 (xbar_c - mu)`` with the base mean ``mu``
    and ``A = Sigma_base + lambda I``; a query x scores ``omega_c^T (x - (xbar_c + mu)/2)``
    (LDA offsets), and ``predict_proba`` is ``softmax(temperature * score)``, the LDA
    posterior with covariance ``A / temperature``-free scaling at temperature 1.

    Args:
        lam: ridge penalty; ``None`` gives ``rel_lam * trace(Sigma_base) / d``.
        rel_lam: relative penalty used when ``lam`` is None. The spec's retrieval default
            1e-3 under-regularises few-shot classification; 10 was chosen on base-class
            validation episodes (half the base classes as negatives, 5-way tasks from the
            other half) of Omniglot Lite0-1280 and PCA-64 features (see
            ``benchmarks/bench_evidence.py``).
        normalize: L2-normalise features (after subtracting the base mean) first.
        temperature: multiplies the scores in the softmax.
    """

    needs_base = True

    def __init__(
        self,
        lam: float | None = None,
        rel_lam: float = 10.0,
        normalize: bool = True,
        temperature: float = 1.0,
    ) -> None:
        self.lam = lam
        self.rel_lam = rel_lam
        self.normalize = normalize
        self.temperature = temperature

    def _check_params(self) -> None:
        """``TypeError``/``ValueError`` naming the first bad hyperparameter."""
        _check_lam(self.lam, self.rel_lam)
        check_hyperparameter("temperature", self.temperature, positive=True)
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be True or False, got {self.normalize!r}")

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
        self.factor_ = factor_negatives(neg, lam)
        self.lam_ = self.factor_.lam
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
        onehot = torch.nn.functional.one_hot(episodes.support_labels, episodes.way).to(dtype)
        means = (onehot.mT @ support) / onehot.sum(-2).unsqueeze(-1).clamp_min(1)
        scores = lda_scores(query, means, factor)
        return torch.softmax(self.temperature * scores, -1)
