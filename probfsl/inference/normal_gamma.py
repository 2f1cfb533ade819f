"""Closed-form engines for the textbook models of :mod:`probfsl.models.normal_gamma`.

They are the smallest engines that honour the contract of
:mod:`probfsl.inference.base`, and the reference for writing a new one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference import expfam
from probfsl.inference.base import Engine, Info

LOG_2PI = math.log(2 * math.pi)


@dataclass
class NormalMeanState:
    x: torch.Tensor
    mean: torch.Tensor  # [T] posterior mean of mu
    precision: torch.Tensor  # [T] posterior precision of mu
    objective: torch.Tensor  # [T] ELBO (= log evidence at the exact posterior)


class NormalMeanPosterior(Engine):
    """Exact posterior of a Normal mean with known precision (Bishop eq. 2.141-2.142).

    q(mu) = Normal(m_N, (lam_N tau)^-1) with lam_N = lam0 + N and
    m_N = (lam0 mu0 + sum_n x_n) / lam_N. Its ELBO is the log evidence.
    """

    def __init__(self, mu0: float = 0.0, lam0: float = 1.0, tau: float = 1.0) -> None:
        self.mu0, self.lam0, self.tau = mu0, lam0, tau

    def init(self, x: torch.Tensor) -> NormalMeanState:
        zero = x.new_zeros(x.shape[0])
        return self.step(NormalMeanState(x, zero + self.mu0, zero + self.lam0 * self.tau, zero))[0]

    def step(self, state: NormalMeanState) -> tuple[NormalMeanState, Info]:
        x, n = state.x, state.x.shape[-1]
        lam_n = self.lam0 + n
        mean = (self.lam0 * self.mu0 + x.sum(-1)) / lam_n
        precision = torch.full_like(mean, lam_n * self.tau)
        new = replace(state, mean=mean, precision=precision)
        new = replace(new, objective=self.elbo(new))
        return new, Info(new.objective)

    def elbo(self, state: NormalMeanState) -> torch.Tensor:
        """E_q[ln p(x, mu)] + H[q(mu)], in closed form."""
        x, m, p, tau, n = state.x, state.mean, state.precision, self.tau, state.x.shape[-1]
        sq = ((x - m.unsqueeze(-1)) ** 2).sum(-1) + n / p
        lik = 0.5 * n * (math.log(tau) - LOG_2PI) - 0.5 * tau * sq
        p0 = self.lam0 * tau
        prior = 0.5 * (math.log(p0) - LOG_2PI) - 0.5 * p0 * ((m - self.mu0) ** 2 + 1 / p)
        return lik + prior + expfam.Normal(m, p).entropy()

    def guide(self, state: NormalMeanState):
        def guide(x: torch.Tensor, *args, **kwargs) -> None:
            with pyro.plate("tasks", x.shape[0], dim=-1):
                pyro.sample("mu", dist.Normal(state.mean, state.precision.rsqrt()))

        return guide


@dataclass
class NormalGammaState:
    x: torch.Tensor
    mu_mean: torch.Tensor  # [T] mean of q(mu)
    mu_precision: torch.Tensor  # [T] precision of q(mu)
    tau_shape: torch.Tensor  # [T] a_N of q(tau)
    tau_rate: torch.Tensor  # [T] b_N of q(tau)
    objective: torch.Tensor  # [T] ELBO


class NormalGammaVB(Engine):
    """Mean-field VB q(mu) q(tau) for the Normal-Gamma model (Bishop §10.1.3, eq. 10.26-10.30).

    One step updates q(mu) given E[tau], then q(tau) given the moments of q(mu);
    each is a coordinate-ascent update, so the ELBO never decreases.
    """

    def __init__(
        self, mu0: float = 0.0, lam0: float = 1.0, a0: float = 1.0, b0: float = 1.0
    ) -> None:
        self.mu0, self.lam0, self.a0, self.b0 = mu0, lam0, a0, b0

    def init(self, x: torch.Tensor) -> NormalGammaState:
        zero = x.new_zeros(x.shape[0])
        state = NormalGammaState(
            x, zero + self.mu0, zero + self.lam0, zero + self.a0, zero + self.b0, zero
        )
        return replace(state, objective=self.elbo(state))

    def step(self, state: NormalGammaState) -> tuple[NormalGammaState, Info]:
        new = self._update_tau(self._update_mu(state))
        return new, Info(new.objective)

    def _update_mu(self, s: NormalGammaState) -> NormalGammaState:
        """Eq. 10.26-10.27: q(mu) = Normal(mu_N, lam_N^-1)."""
        n = s.x.shape[-1]
        e_tau = s.tau_shape / s.tau_rate
        mean = (self.lam0 * self.mu0 + s.x.sum(-1)) / (self.lam0 + n)
        new = replace(s, mu_mean=mean, mu_precision=(self.lam0 + n) * e_tau)
        return replace(new, objective=self.elbo(new))

    def _update_tau(self, s: NormalGammaState) -> NormalGammaState:
        """Eq. 10.29-10.30: q(tau) = Gamma(a_N, b_N)."""
        n = s.x.shape[-1]
        var = 1 / s.mu_precision
        sq = ((s.x - s.mu_mean.unsqueeze(-1)) ** 2).sum(-1) + n * var
        prior_sq = self.lam0 * ((s.mu_mean - self.mu0) ** 2 + var)
        shape = torch.full_like(s.mu_mean, self.a0 + 0.5 * (n + 1))
        new = replace(s, tau_shape=shape, tau_rate=self.b0 + 0.5 * (sq + prior_sq))
        return replace(new, objective=self.elbo(new))

    def elbo(self, s: NormalGammaState) -> torch.Tensor:
        """E_q[ln p(x, mu, tau)] - E_q[ln q(mu) q(tau)] in closed form."""
        n = s.x.shape[-1]
        e_tau = s.tau_shape / s.tau_rate
        e_log_tau = torch.special.digamma(s.tau_shape) - s.tau_rate.log()
        var = 1 / s.mu_precision
        sq = ((s.x - s.mu_mean.unsqueeze(-1)) ** 2).sum(-1) + n * var
        lik = 0.5 * n * (e_log_tau - LOG_2PI) - 0.5 * e_tau * sq
        prior_mu = 0.5 * (math.log(self.lam0) + e_log_tau - LOG_2PI) - 0.5 * self.lam0 * e_tau * (
            (s.mu_mean - self.mu0) ** 2 + var
        )
        prior = expfam.Gamma(torch.full_like(e_tau, self.a0), torch.full_like(e_tau, self.b0))
        prior_tau = prior.expected_log_prob((e_tau, e_log_tau))
        h_mu = expfam.Normal(s.mu_mean, s.mu_precision).entropy()
        h_tau = expfam.Gamma(s.tau_shape, s.tau_rate).entropy()
        return lik + prior_mu + prior_tau + h_mu + h_tau

    def guide(self, state: NormalGammaState):
        def guide(x: torch.Tensor, *args, **kwargs) -> None:
            with pyro.plate("tasks", x.shape[0], dim=-1):
                pyro.sample("tau", dist.Gamma(state.tau_shape, state.tau_rate))
                pyro.sample("mu", dist.Normal(state.mu_mean, state.mu_precision.rsqrt()))

        return guide
