"""Pólya-Gamma PG(b, c) variables: moments, KL, log-density and two samplers.

Facts used throughout GP-Tree (Achituve et al., ICML 2021, §3 and App. A; Polson, Scott
& Windle, JASA 2013; docs/design/gp-tree.md §3.1):

* ω ~ PG(b, c) has E[ω] = b/(2c)·tanh(c/2) (limit b/4 at c = 0) and
  Var[ω] = b (sinh c − c)/(4c³ cosh²(c/2)) (limit b/24). Both depend on |c| only.
* Infinite-sum representation: ω = 1/(2π²) Σ_{k≥1} g_k / ((k−½)² + c²/(4π²)),
  g_k ~ Gamma(b, 1) independent.
* KL(PG(1, c) ‖ PG(1, 0)) = log cosh(c/2) − (c/4) tanh(c/2).
* Augmentation identity: σ(ψ)^y (1−σ(ψ))^{1−y} = ½ e^{κψ} E_{PG(1,0)}[e^{−ωψ²/2}], κ = y − ½.

Two samplers:

* :func:`sample_pg_exact` — exact draws from the ``polyagamma`` package (Devroye /
  alternate / saddle hybrid). CPU only: the tensor goes through NumPy and comes back with
  the input's dtype and device. This is the reference sampler.
* :func:`sample_pg_torch` — pure torch, stays on the input's device: the first
  ``n_terms`` terms of the Gamma series are drawn exactly, and the remaining tail
  Σ_{k>K} is replaced by one Gamma variable with the tail's exact mean and variance
  (computed in closed form by the Euler–Maclaurin midpoint formula, relative error
  O(K⁻⁴), no cancellation). Accuracy: mean and variance of the draws equal the PG(b, c)
  moments to about 1e-6 relative for the default K = 20; only the third and higher
  cumulants of the tail (≈1 % of the mean at c = 0, less for larger |c|) are approximated,
  which is far below Monte Carlo error in the Gibbs sampler.

:class:`CounterRNG` gives every row (a GP node of a task) its own reproducible stream of
uniform, normal and Gamma draws, computed from a hash of (key, counter) in the spirit of
counter-based generators (Salmon, Moraes, Dror & Shaw, "Parallel random numbers: as easy
as 1, 2, 3", SC 2011). Row r's draws depend only on its key, never on which rows share
its batch, so a task's result does not depend on the batch it is evaluated in.
"""

from __future__ import annotations

import math

import numpy as np
import pyro.distributions as dist
import torch
from torch.distributions import constraints

_SMALL_C = 1e-2


def _check_c(c: torch.Tensor, name: str = "c") -> None:
    if not isinstance(c, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(c).__name__}")
    if not torch.isfinite(c).all():
        raise ValueError(f"{name} contains NaN or inf")


def _check_b(b: float | torch.Tensor) -> None:
    if isinstance(b, torch.Tensor):
        bad = not bool(torch.isfinite(b).all()) or bool((b <= 0).any())
    else:
        bad = not math.isfinite(b) or b <= 0
    if bad:
        raise ValueError(f"b must be positive and finite, got {b}")


def pg_mean(c: torch.Tensor, b: float | torch.Tensor = 1.0) -> torch.Tensor:
    """E[ω] for ω ~ PG(b, c): b·tanh(c/2)/(2c), with the Taylor series near c = 0."""
    a = c.abs()
    safe = torch.where(a < _SMALL_C, torch.ones_like(a), a)
    exact = torch.tanh(safe / 2) / (2 * safe)
    a2 = a * a
    series = 0.25 - a2 / 48 + a2 * a2 / 480
    return b * torch.where(a < _SMALL_C, series, exact)


def pg_var(c: torch.Tensor, b: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Var[ω] for ω ~ PG(b, c).

    Uses the overflow-free form (2 tanh(c/2) − c sech²(c/2))/(4c³), which equals
    (sinh c − c)/(4c³ cosh²(c/2)), and its Taylor series 1/24 − c²/120 + 17c⁴/13440 for
    small |c| (below 0.1 in float64-free arithmetic the closed form cancels).
    """
    a = c.abs()
    thresh = 0.1 if c.dtype == torch.float64 else 0.5
    small = a < thresh
    safe = torch.where(small, torch.ones_like(a), a)
    half = safe / 2
    exact = (2 * torch.tanh(half) - safe / torch.cosh(half).pow(2)) / (4 * safe.pow(3))
    a2 = a * a
    series = 1 / 24 - a2 / 120 + 17 * a2 * a2 / 13440 - 31 * a2.pow(3) / 181440
    return b * torch.where(small, series, exact)


def log_cosh(x: torch.Tensor) -> torch.Tensor:
    """log cosh(x), stable for large |x|: |x| + log1p(e^{−2|x|}) − log 2."""
    a = x.abs()
    return a + torch.log1p(torch.exp(-2 * a)) - math.log(2.0)


def pg_kl(c: torch.Tensor) -> torch.Tensor:
    """KL(PG(1, c) ‖ PG(1, 0)) = log cosh(c/2) − (c/4)·tanh(c/2) (design §3.1)."""
    return log_cosh(c / 2) - c.abs() / 4 * torch.tanh(c.abs() / 2)


def pg_log_prob(x: torch.Tensor, c: torch.Tensor | float = 0.0, n_terms: int = 12) -> torch.Tensor:
    """log density of PG(1, c) at ``x > 0``.

    log p(x | 1, c) = log cosh(c/2) − c²x/2 + log p(x | 1, 0) (exponential tilting), where
    p(x | 1, 0) is the alternating series (Devroye 2009; Polson et al. 2013, §2.1)
    Σ_n (−1)^n (2n+1)/√(2πx³) exp(−(2n+1)²/(8x)) for x ≤ 0.16 and
    Σ_n (−1)^n 2π(2n+1) exp(−2(n+½)²π²x) above (Devroye's J*(1) density, x = J*/4,
    switch point t/4 with t = 0.64). The first term is factored out so that
    the logarithm is taken of 1 + (small corrections).
    """
    c = torch.as_tensor(c, dtype=x.dtype, device=x.device)
    xs = x.clamp_min(torch.finfo(x.dtype).tiny)
    n = torch.arange(1, n_terms, dtype=x.dtype, device=x.device)
    sign = 1.0 - 2.0 * (n % 2)
    xe = xs.unsqueeze(-1)
    # small-x representation
    log_t0_s = -0.5 * math.log(2 * math.pi) - 1.5 * torch.log(xs) - 1 / (8 * xs)
    ratio_s = (sign * (2 * n + 1) * torch.exp(-((2 * n + 1) ** 2 - 1) / (8 * xe))).sum(-1)
    # large-x representation
    log_t0_l = math.log(2 * math.pi) - math.pi**2 * xs / 2
    ratio_l = (
        sign * (2 * n + 1) * torch.exp(-2 * (((n + 0.5) ** 2) - 0.25) * math.pi**2 * xe)
    ).sum(-1)
    small = xs <= 0.16
    log_p0 = torch.where(
        small,
        log_t0_s + torch.log1p(ratio_s.clamp_min(-0.999999)),
        log_t0_l + torch.log1p(ratio_l.clamp_min(-0.999999)),
    )
    return log_cosh(c / 2) - c * c * xs / 2 + log_p0


def _tail_sums(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S1 = Σ_{j>k} 1/((j−½)²+a²), S2 = Σ_{j>k} 1/((j−½)²+a²)² by Euler–Maclaurin midpoint.

    Σ_{j>k} f(j−½) = ∫_k^∞ f + f'(k)/24 + O(f'''(k)), with closed-form integrals;
    a series in u = a/k avoids cancellation in the S2 integral for small u.
    """
    kf = float(k)
    u = a / kf
    # ∫_k^∞ dx/(x²+a²) = atan(a/k)/a
    safe_a = torch.where(u < 1e-4, torch.ones_like(a), a)
    i1 = torch.where(u < 1e-4, (1 - u * u / 3) / kf, torch.atan(safe_a / kf) / safe_a)
    # ∫_k^∞ dx/(x²+a²)² = (atan(u) − u/(1+u²)) / (2a³)
    u2 = u * u
    small = u < 0.1
    safe_u = torch.where(small, torch.ones_like(u), u)
    safe_a2 = torch.where(small, torch.ones_like(a), a)
    closed = (torch.atan(safe_u) - safe_u / (1 + safe_u**2)) / (2 * safe_a2**3)
    series = (2 / 3 - 4 * u2 / 5 + 6 * u2 * u2 / 7 - 8 * u2**3 / 9) / (2 * kf**3)
    i2 = torch.where(small, series, closed)
    d = kf**2 + a * a
    s1 = i1 - 2 * kf / d**2 / 24
    s2 = i2 - 4 * kf / d**3 / 24
    return s1, s2


# ------------------------------------------------------------------- counter-based draws

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2²⁷: a 32-bit word times it fits in int64, no overflow


def mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 ``x`` (taken mod 2³²) into [0, 2³²): two rounds of
    xor-shift and multiply (T. Mueller's constant 0x45d9f3b; a bijection of 32-bit words
    whose output bits each depend on every input bit). Exact integer arithmetic: every
    product stays below 2⁵⁹."""
    x = x & _MASK32
    x ^= x >> 16
    x *= _MIX
    x &= _MASK32
    x ^= x >> 16
    x *= _MIX
    x &= _MASK32
    x ^= x >> 16
    return x


class CounterRNG:
    """Reproducible random streams, one per row: draw j of row r is a hash of (key_r, j).

    ``keys [V]`` (integers, any device) name the streams; a call asking for ``shape =
    (V, *rest)`` draws uses the next ``prod(rest)`` counters of every stream, so row r
    receives the same numbers whatever other rows are drawn with it. Uniforms are
    (24 bits + ½)·2⁻²⁴ in float32 and (32 bits + ½)·2⁻³² in float64 (never 0 or 1);
    normals by Box–Muller; Gamma(a) by Marsaglia & Tsang (ACM TOMS 2000) with a fixed
    number of proposals (the first accepted is kept; for a ≥ 1 the acceptance rate
    exceeds 95 %, so all ``rounds`` = 6 fail with probability below 2·10⁻⁸, and then the
    last proposal is kept), a < 1 through Gamma(a + 1)·U^{1/a}.
    """

    def __init__(self, keys: torch.Tensor, rounds: int = 6) -> None:
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
        if keys.ndim != 1 or keys.is_floating_point():
            raise ValueError("keys must be a 1-D integer tensor (one key per row)")
        keys = keys.to(torch.int64)
        self.k1 = mix32(keys ^ 0x9E3779B9)
        self.k2 = mix32(self.k1 + 0x7F4A7C15)
        self.offset = 0
        self.rounds = rounds

    def bits(self, shape: tuple[int, ...]) -> torch.Tensor:
        """32-bit random words (int64 in [0, 2³²)) of ``shape = (V, *rest)``."""
        n = math.prod(shape[1:])
        ctr = torch.arange(self.offset, self.offset + n, device=self.k1.device)
        self.offset += n
        h = mix32(mix32(ctr.unsqueeze(0) + self.k1.unsqueeze(1)) ^ self.k2.unsqueeze(1))
        return h.reshape(shape)

    def uniform(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """U(0, 1) draws in ``dtype`` (open interval)."""
        if dtype == torch.float64:
            return (self.bits(shape).to(dtype) + 0.5) * 2.0**-32
        return ((self.bits(shape) >> 8).to(dtype) + 0.5) * 2.0**-24

    def normal(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """N(0, 1) draws by Box–Muller, √(−2 log u₁)·cos(2πu₂)."""
        u1 = self.uniform(shape, dtype)
        u2 = self.uniform(shape, dtype)
        return (-2 * u1.log()).sqrt() * torch.cos(2 * math.pi * u2)

    def exponential(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Exp(1) = Gamma(1) draws, −log u."""
        return -self.uniform(shape, dtype).log()

    def standard_gamma(self, conc: torch.Tensor) -> torch.Tensor:
        """Gamma(conc, 1) draws of ``conc``'s shape and dtype (Marsaglia–Tsang)."""
        shape, dtype = tuple(conc.shape), conc.dtype
        boost = conc < 1
        a = torch.where(boost, conc + 1, conc)
        d = a - 1 / 3
        cc = 1 / (9 * d).sqrt()
        z = self.normal((shape[0], self.rounds, *shape[1:]), dtype)
        u = self.uniform((shape[0], self.rounds, *shape[1:]), dtype)
        d, cc = d.unsqueeze(1), cc.unsqueeze(1)
        v = (1 + cc * z).pow(3)
        vpos = v.clamp_min(torch.finfo(dtype).tiny)
        ok = (v > 0) & (u.log() < 0.5 * z * z + d - d * vpos + d * vpos.log())
        ok[:, -1] = True  # keep the last proposal when every one was rejected
        first = ok.to(torch.int8).argmax(1, keepdim=True)
        g = (d * vpos).gather(1, first).squeeze(1)
        u_boost = self.uniform(shape, dtype)
        return torch.where(boost, g * u_boost.pow(1 / conc), g)


def _standard_gamma(conc: torch.Tensor, generator) -> torch.Tensor:
    if isinstance(generator, CounterRNG):
        return generator.standard_gamma(conc)
    return torch._standard_gamma(conc, generator=generator)


def sample_pg_torch(
    c: torch.Tensor,
    b: float = 1.0,
    n_terms: int = 20,
    generator: torch.Generator | CounterRNG | None = None,
) -> torch.Tensor:
    """Draw ω ~ PG(b, c) elementwise on ``c``'s device (truncated Gamma series + tail Gamma).

    ω = 1/(2π²) [Σ_{k=1}^{K} g_k/d_k + T], d_k = (k−½)² + c²/(4π²), g_k ~ Gamma(b, 1),
    and T ~ Gamma with the exact mean b·S1 and variance b·S2 of the neglected tail
    Σ_{k>K} g_k/d_k (see the module docstring for the accuracy statement).
    ``generator`` is a ``torch.Generator`` or a :class:`CounterRNG` (whose rows are the
    first dimension of ``c``).
    """
    _check_c(c)
    _check_b(b)
    if n_terms < 1:
        raise ValueError(f"n_terms must be >= 1, got {n_terms}")
    return _pg_series_draw(c, b, n_terms, generator)


def _pg_series_draw(c: torch.Tensor, b: float, n_terms: int, generator) -> torch.Tensor:
    """:func:`sample_pg_torch` without the input checks (for samplers whose ``c`` is
    finite by construction: no host synchronisation inside their loops)."""
    a = c.abs() / (2 * math.pi)
    k = torch.arange(1, n_terms + 1, dtype=c.dtype, device=c.device)
    d = (k - 0.5) ** 2 + (a * a).unsqueeze(-1)
    if isinstance(generator, CounterRNG) and float(b) == 1.0:
        g = generator.exponential(tuple(d.shape), c.dtype)
    else:
        shape = torch.full(d.shape, float(b), dtype=c.dtype, device=c.device)
        g = _standard_gamma(shape, generator)
    head = (g / d).sum(-1)
    s1, s2 = _tail_sums(a, n_terms)
    conc = b * s1 * s1 / s2
    tail = _standard_gamma(conc, generator) * (s2 / s1)
    return (head + tail) / (2 * math.pi**2)


def sample_pg_exact(
    c: torch.Tensor,
    b: float = 1.0,
    random_state: int | np.random.Generator | None = None,
) -> torch.Tensor:
    """Exact PG(b, c) draws from the ``polyagamma`` package (CPU, via NumPy).

    The result has ``c``'s shape, dtype and device; ``random_state`` is a seed or a
    ``numpy.random.Generator``.
    """
    _check_c(c)
    _check_b(b)
    from polyagamma import random_polyagamma

    rng = np.random.default_rng(random_state)
    z = c.detach().to("cpu", torch.float64).numpy()
    draws = random_polyagamma(float(b), z, random_state=rng)
    return torch.as_tensor(np.asarray(draws), dtype=c.dtype, device=c.device)


class PolyaGamma(dist.TorchDistribution):
    """PG(1, c) as a Pyro distribution (``rsample`` not available; ``sample`` is the torch
    sampler, ``log_prob`` the alternating series of :func:`pg_log_prob`)."""

    arg_constraints = {"c": constraints.real}
    support = constraints.positive
    has_rsample = False

    def __init__(self, c: torch.Tensor, validate_args: bool | None = None) -> None:
        self.c = c
        super().__init__(batch_shape=c.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        return PolyaGamma(self.c.expand(batch_shape))

    @property
    def mean(self) -> torch.Tensor:
        return pg_mean(self.c)

    @property
    def variance(self) -> torch.Tensor:
        return pg_var(self.c)

    def sample(self, sample_shape: torch.Size | tuple = ()) -> torch.Tensor:
        with torch.no_grad():
            c = self.c.expand(torch.Size(sample_shape) + self.c.shape)
            return sample_pg_torch(c.contiguous())

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return pg_log_prob(value, self.c)
