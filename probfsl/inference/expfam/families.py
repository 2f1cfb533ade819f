"""The exponential-family blocks (see the package docstring for the shared interface).

Every block has ``event_dim``: how many trailing batch dimensions are summed in its
log-normaliser, entropy, KL and expected log-density (``Normal(loc [T, D], p, event_dim=1)``
is a diagonal Gaussian over R^D). With base measure h(x) = 0 throughout, ln q(x) = η·u(x) − A,
so H[q] = A − η·⟨u⟩ and KL(q ‖ p) = −H[q] − E_q[ln p] (PRML eq. 2.194, B.17-B.82).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

LOG_2PI = math.log(2 * math.pi)


def _sum_last(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.sum(tuple(range(-n, 0))) if n else x


class _Block(ABC):
    """Shared algebra of the blocks: η·⟨u⟩ − A, entropy and KL from the natural form.

    A block supplies its natural parameters η, expected sufficient statistics ⟨u⟩, its
    per-variable log-normaliser A(η) and the matching ``torch.distributions`` law
    (:meth:`_law`); the rest follows."""

    event_dim: int = 0
    #: trailing dimensions of each sufficient statistic that belong to one variable
    _stat_dims: tuple[int, ...] = ()

    @abstractmethod
    def natural(self) -> tuple[torch.Tensor, ...]:
        """Natural parameters η, one tensor per sufficient statistic."""

    @abstractmethod
    def expected_stats(self) -> tuple[torch.Tensor, ...]:
        """Expected sufficient statistics ⟨u(x)⟩ under this block."""

    @abstractmethod
    def _log_normalizer(self) -> torch.Tensor:
        """A(η) per variable (before summing the ``event_dim`` trailing dimensions)."""

    @abstractmethod
    def _law(self) -> torch.distributions.Distribution:
        """The same law as a ``torch.distributions`` object, per variable."""

    def distribution(self) -> torch.distributions.Distribution:
        """This block as a batched ``torch.distributions`` law (``event_dim`` as events)."""
        d = self._law()
        return torch.distributions.Independent(d, self.event_dim) if self.event_dim else d

    def log_normalizer(self) -> torch.Tensor:
        """A(η), summed over the ``event_dim`` trailing dimensions."""
        return _sum_last(self._log_normalizer(), self.event_dim)

    def expected_log_prob(self, stats: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """E[ln self(x)] = η·⟨u(x)⟩ − A(η) for the expected statistics ``stats`` of x."""
        total = 0
        for eta, s, n in zip(self.natural(), stats, self._stat_dims, strict=True):
            total = total + _sum_last(eta * s, n)
        return _sum_last(total - self._log_normalizer(), self.event_dim)

    def entropy(self) -> torch.Tensor:
        """H[q] = A − η·⟨u⟩."""
        return -self.expected_log_prob(self.expected_stats())

    def kl(self, other: _Block) -> torch.Tensor:
        """KL(self ‖ other) = E_self[ln self − ln other]."""
        return -self.entropy() - other.expected_log_prob(self.expected_stats())


@dataclass
class Normal(_Block):
    """Normal(loc, precision⁻¹) per element; u = (x, x²), η = (λm, −λ/2) (PRML eq. 2.220)."""

    loc: torch.Tensor
    precision: torch.Tensor
    event_dim: int = 0
    _stat_dims = (0, 0)

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Normal:
        precision = -2 * eta2
        return cls(eta1 / precision, precision, event_dim)

    def natural(self):
        return self.precision * self.loc, -0.5 * self.precision

    def expected_stats(self):
        return self.loc, self.loc.square() + self.precision.reciprocal()

    def _log_normalizer(self):
        return 0.5 * (self.precision * self.loc.square() - self.precision.log() + LOG_2PI)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Normal(self.loc, self.precision.rsqrt())


@dataclass
class Gamma(_Block):
    """Gamma(shape a, rate b) of a precision; u = (τ, ln τ), η = (−b, a − 1) (PRML B.26-B.31)."""

    shape: torch.Tensor
    rate: torch.Tensor
    event_dim: int = 0
    _stat_dims = (0, 0)

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Gamma:
        return cls(eta2 + 1, -eta1, event_dim)

    def natural(self):
        return -self.rate, self.shape - 1

    def expected_stats(self):
        return self.shape / self.rate, torch.special.digamma(self.shape) - self.rate.log()

    def _log_normalizer(self):
        return torch.lgamma(self.shape) - self.shape * self.rate.log()

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Gamma(self.shape, self.rate)


@dataclass
class Dirichlet(_Block):
    """Dirichlet(α) over the last dimension; u = ln π, η = α − 1 (PRML B.16-B.19)."""

    concentration: torch.Tensor
    event_dim: int = 0
    _stat_dims = (1,)

    @classmethod
    def from_natural(cls, eta: torch.Tensor, event_dim: int = 0) -> Dirichlet:
        return cls(eta + 1, event_dim)

    def natural(self):
        return (self.concentration - 1,)

    def expected_stats(self):
        a = self.concentration
        return (torch.special.digamma(a) - torch.special.digamma(a.sum(-1, keepdim=True)),)

    def _log_normalizer(self):
        a = self.concentration
        return torch.lgamma(a).sum(-1) - torch.lgamma(a.sum(-1))

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Dirichlet(self.concentration)


@dataclass
class Beta(_Block):
    """Beta(a, b) of a probability p; u = (ln p, ln(1 − p)), η = (a − 1, b − 1), A = ln B(a, b)
    (PRML B.6-B.8; the two-category Dirichlet)."""

    concentration1: torch.Tensor
    concentration0: torch.Tensor
    event_dim: int = 0
    _stat_dims = (0, 0)

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Beta:
        return cls(eta1 + 1, eta2 + 1, event_dim)

    def natural(self):
        return self.concentration1 - 1, self.concentration0 - 1

    def expected_stats(self):
        a, b = self.concentration1, self.concentration0
        total = torch.special.digamma(a + b)
        return torch.special.digamma(a) - total, torch.special.digamma(b) - total

    def _log_normalizer(self):
        a, b = self.concentration1, self.concentration0
        return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Beta(self.concentration1, self.concentration0)


@dataclass
class Categorical(_Block):
    """Categorical(p) over the last dimension; u = one-hot(z), η = ln p (PRML eq. 2.26)."""

    probs: torch.Tensor
    event_dim: int = 0
    _stat_dims = (1,)

    @classmethod
    def from_natural(cls, logits: torch.Tensor, event_dim: int = 0) -> Categorical:
        return cls(torch.softmax(logits, -1), event_dim)

    def natural(self):
        return (self.probs.log(),)

    def expected_stats(self):
        return (self.probs,)

    def _log_normalizer(self):
        return torch.logsumexp(self.natural()[0], -1)

    def entropy(self) -> torch.Tensor:
        # xlogy keeps 0·ln 0 = 0 for one-hot factors
        return _sum_last(-torch.special.xlogy(self.probs, self.probs).sum(-1), self.event_dim)

    def expected_log_prob(self, stats):
        log_p = self.probs.log().clamp_min(torch.finfo(self.probs.dtype).min)
        return _sum_last(torch.where(stats[0] > 0, stats[0] * log_p, 0).sum(-1), self.event_dim)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Categorical(probs=self.probs)


def _logdet(m: torch.Tensor) -> torch.Tensor:
    return 2 * torch.linalg.cholesky(m).diagonal(dim1=-2, dim2=-1).log().sum(-1)


def _spd_inverse(m: torch.Tensor) -> torch.Tensor:
    return torch.cholesky_inverse(torch.linalg.cholesky(m))


@dataclass
class MultivariateNormal(_Block):
    """Normal(m, P⁻¹) over R^D; u = (x, x xᵀ), η = (P m, −P/2) (PRML eq. 2.43, 2.114)."""

    loc: torch.Tensor
    precision: torch.Tensor
    event_dim: int = 0
    _stat_dims = (1, 2)

    @classmethod
    def from_natural(
        cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0
    ) -> MultivariateNormal:
        precision = -2 * eta2
        loc = torch.cholesky_solve(eta1.unsqueeze(-1), torch.linalg.cholesky(precision))
        return cls(loc.squeeze(-1), precision, event_dim)

    def natural(self):
        return (self.precision @ self.loc.unsqueeze(-1)).squeeze(-1), -0.5 * self.precision

    def expected_stats(self):
        m = self.loc
        return m, _spd_inverse(self.precision) + m.unsqueeze(-1) * m.unsqueeze(-2)

    def _log_normalizer(self):
        m, p = self.loc, self.precision
        quad = (m * (p @ m.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return 0.5 * (quad - _logdet(p) + m.shape[-1] * LOG_2PI)

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.MultivariateNormal(self.loc, precision_matrix=self.precision)


@dataclass
class Wishart(_Block):
    """Wishart(ν, W) of a D x D precision Λ (E Λ = ν W); u = (Λ, ln|Λ|),
    η = (−W⁻¹/2, (ν − D − 1)/2) (PRML B.78-B.82)."""

    df: torch.Tensor
    scale: torch.Tensor
    event_dim: int = 0
    _stat_dims = (2, 0)

    @property
    def dim(self) -> int:
        return self.scale.shape[-1]

    @classmethod
    def from_natural(cls, eta1: torch.Tensor, eta2: torch.Tensor, event_dim: int = 0) -> Wishart:
        scale = _spd_inverse(-2 * eta1)
        return cls(2 * eta2 + scale.shape[-1] + 1, scale, event_dim)

    def natural(self):
        return -0.5 * _spd_inverse(self.scale), 0.5 * (self.df - self.dim - 1)

    def expected_stats(self):
        d, nu = self.dim, self.df
        i = torch.arange(d, device=nu.device, dtype=nu.dtype)
        e_logdet = torch.special.digamma(0.5 * (nu.unsqueeze(-1) - i)).sum(-1)
        e_logdet = e_logdet + d * math.log(2) + _logdet(self.scale)
        return nu[..., None, None] * self.scale, e_logdet

    def _log_normalizer(self):
        d, nu = self.dim, self.df
        return 0.5 * nu * (d * math.log(2) + _logdet(self.scale)) + torch.special.multigammaln(
            0.5 * nu, d
        )

    def _law(self) -> torch.distributions.Distribution:
        return torch.distributions.Wishart(self.df, covariance_matrix=self.scale)
