"""Textbook conjugate models that demonstrate the model/guide contract.

Bishop, *Pattern Recognition and Machine Learning* (2006), §2.3.6 and §10.1.3:
a batch of T independent univariate Gaussian samples ``x [T, N]``.

* :func:`normal_mean_model`: unknown mean, known precision ``tau``;
  mu ~ Normal(mu0, (lam0 tau)^-1), x_n ~ Normal(mu, tau^-1). The posterior is exact.
* :func:`normal_gamma_model`: unknown mean and precision;
  tau ~ Gamma(a0, b0), mu | tau ~ Normal(mu0, (lam0 tau)^-1), x_n ~ Normal(mu, tau^-1),
  fitted by mean-field VB (:class:`probfsl.inference.normal_gamma.NormalGammaVB`).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch


def normal_mean_model(
    x: torch.Tensor, mu0: float = 0.0, lam0: float = 1.0, tau: float = 1.0
) -> None:
    """Normal likelihood with known precision and a conjugate Normal prior on the mean."""
    with pyro.plate("tasks", x.shape[0], dim=-1):
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(mu0), x.new_tensor(lam0 * tau).rsqrt()))
        scale = x.new_tensor(tau).rsqrt()
        pyro.sample("x", dist.Normal(mu.unsqueeze(-1), scale).to_event(1), obs=x)


def normal_gamma_model(
    x: torch.Tensor, mu0: float = 0.0, lam0: float = 1.0, a0: float = 1.0, b0: float = 1.0
) -> None:
    """Normal likelihood with unknown mean and precision under a Normal-Gamma prior."""
    with pyro.plate("tasks", x.shape[0], dim=-1):
        tau = pyro.sample("tau", dist.Gamma(x.new_tensor(a0), x.new_tensor(b0)))
        mu = pyro.sample("mu", dist.Normal(x.new_tensor(mu0), (lam0 * tau).rsqrt()))
        scale = tau.rsqrt().unsqueeze(-1)
        pyro.sample("x", dist.Normal(mu.unsqueeze(-1), scale).to_event(1), obs=x)
