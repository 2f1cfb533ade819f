"""GP-Tree's variational nodes derived from their declaration.

Achituve, Navon, Yemini, Chechik, Fetaya, "GP-Tree: A Gaussian Process Classifier for
Few-Shot Incremental Learning", ICML 2021, §3.3 and App. A; docs/design/gp-tree.md §3.3.

The declaration is :func:`gp_tree_node`: each internal node of the class tree is a
Pólya-Gamma augmented GP classifier of its two class groups with inducing values u at the
inducing inputs X̄ (one row of a batch of nodes, padded and masked as in
:class:`~probfsl.inference.gp_tree_nodes.VINodes`). The node's latent values are
f_i = A_i u + ε_i, A = K_nm K_mm⁻¹, with ε_i ~ N(0, K̃_ii), K̃_ii = K_ii − K_im K_mm⁻¹ K_mi,
kept at its prior (``infer={"q": "prior"}``, :mod:`probfsl.inference.vmp.at_prior`): that
is the paper's q(f | u) = p(f | u), so the Pólya-Gamma tilt sees
c_i² = K̃_ii + (AΣ̃Aᵀ)_ii + (Aμ̃)_i² and the bound is the paper's (§3.3). (A mean-field
factor q(ε_i) instead would be a larger family, with a higher bound and another q(u):
on the test nodes of ``tests/test_derived_gp_tree.py``, μ̃ and Σ̃ move by up to 1.1.)

Variational message passing (:class:`probfsl.inference.VMP`) derives from it the two
coordinate updates of §3.3: q(ω_i) = PG(1, c_i) from the current q(u), then
q(u) = N(μ̃, Σ̃) with Σ̃⁻¹ = K_mm⁻¹ + AᵀΘA and Σ̃⁻¹μ̃ = Aᵀκ. :class:`DerivedVINodes` is
:class:`~probfsl.inference.gp_tree_nodes.VINodes` with its ``step`` replaced by one VMP sweep
on that declaration: it starts from q(u) = N(0, I) of design §3.3, damps the derived natural
parameters by ``natural_lr`` (ρ = 1: the exact coordinate optimum) and returns the
hand-written :class:`~probfsl.inference.gp_tree_nodes.VIState`, so the kernel
hyper-parameters' gradient steps and the predictive of
:class:`~probfsl.models.gp_tree.GPTree` read it unchanged. The one difference is the
bound the state reports: VMP's, at the Pólya-Gamma factors of the new q(u) (the tighter
bound the next step's c-update reaches), where ``VINodes`` reports it at the factors
that produced q(u).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import pyro
import pyro.distributions as dist
import torch

from probfsl.inference import gp_tree_nodes as gpn
from probfsl.inference.base import Info
from probfsl.inference.vmp import VMP, VMPState, polya_gamma


def gp_tree_node(
    y: torch.Tensor,
    mask: torch.Tensor,
    A: torch.Tensor,
    ktilde: torch.Tensor,
    kmm_tril: torch.Tensor,
) -> None:
    """A batch of GP-Tree's inducing-point nodes (design §3.3), one row (task) per node.

    ``y [V, n]`` node labels (1 = right subtree), ``mask [V, n]`` real points,
    ``A [V, n, M]`` = K_nm K_mm⁻¹, ``ktilde [V, n]`` the conditional variances K̃_ii > 0,
    ``kmm_tril [V, M, M]`` the Cholesky factor of K_mm (with its jitter). u ~ N(0, K_mm);
    f_i = A_i u + ε_i with ε_i ~ N(0, K̃_ii) kept at its prior (q(f | u) = p(f | u));
    y_i ~ Bernoulli(σ(f_i)), augmented by Pólya-Gamma variables in VMP.
    """
    V, n, M = A.shape
    with pyro.plate("tasks", V, dim=-2):
        u = pyro.sample("u", dist.MultivariateNormal(A.new_zeros(M), scale_tril=kmm_tril[:, None]))
        with pyro.plate("points", n, dim=-1):
            eps = pyro.sample("eps", dist.Normal(0.0, ktilde.sqrt()), infer={"q": "prior"})
            f = (A * u).sum(-1) + eps
            pyro.sample("y", dist.Bernoulli(logits=f).mask(mask), obs=y)


def node_data(data: tuple, t: gpn.VITerms) -> tuple:
    """The arguments of :func:`gp_tree_node` from ``VINodes``' data and kernel terms.

    K̃ is clamped to the dtype's smallest normal number on real points (a Normal needs a
    positive scale; ``VINodes`` clamps it at 0) and set to 1 on padded ones (their
    labels are masked, so ε never reaches the bound there)."""
    y, mask = data[1], data[2].bool()
    tiny = torch.finfo(t.A.dtype).tiny
    ones = torch.ones_like(t.Ktilde)
    ktilde = torch.where(mask, t.Ktilde.clamp_min(tiny), ones)
    return y.to(t.A.dtype), mask, t.A, ktilde, t.chol_Kmm


class DerivedVINodes(gpn.VINodes):
    """:class:`~probfsl.inference.gp_tree_nodes.VINodes` whose q(u) and Pólya-Gamma factors come
    from VMP on :func:`gp_tree_node` (module docstring).

    ``init``/``init_from_terms`` start from q(u) = N(0, I) (design §3.3: η = 0, H = −½I);
    a ``step`` compiles the declaration for the state's kernel terms (once per terms:
    the last plan is kept), sets q(u) to the state's, and runs one VMP sweep. The
    predictive and the guide are ``VINodes``'. Host synchronisations: the compilation's
    (a few per new kernel terms) and none in the sweep.
    """

    def __init__(self, jitter: float = 1e-2, natural_lr: float = 1.0, code_elbo: bool = False):
        super().__init__(jitter, natural_lr, code_elbo)
        self.vmp = VMP(gp_tree_node, warn_mean_field=False)  # q(u) p(eps) by design
        self._plan: tuple | None = None  # (terms, the VMP state of their compilation)

    def _vmp_state(
        self, data: tuple, t: gpn.VITerms, loc: torch.Tensor, prec: torch.Tensor
    ) -> VMPState:
        """The VMP state of the nodes ``t`` with q(u) = N(loc, prec⁻¹), ε at its prior."""
        if self._plan is None or self._plan[0] is not t:
            self._plan = (t, self.vmp.init(*node_data(data, t)))
        base = self._plan[1]
        return VMPState(base.plan, {**base.q, "u": (loc, prec)}, base.objective)

    def _state(self, data: tuple, t: gpn.VITerms, vstate: VMPState, c: torch.Tensor) -> gpn.VIState:
        """The hand-written state of the derived q(u) = (μ̃, Λ) and tilts ``c`` (Λ was
        factorised by the update already: no check, no host synchronisation)."""
        loc, prec = vstate.q["u"]
        chol = torch.linalg.cholesky_ex(prec)[0]
        moments = (loc, torch.cholesky_inverse(chol), chol)
        eta = (prec @ loc.unsqueeze(-1)).squeeze(-1)
        return gpn.VIState(data, eta, prec, c, vstate.objective, t, moments)

    def init_from_terms(self, data: tuple, t: gpn.VITerms) -> gpn.VIState:
        """q(u) = N(0, I) and c = 1 (design §3.3), with VMP's bound at that q(u)."""
        eta, prec, c = self.initial_factors(t.A.shape[0], t.A.shape[-1], t.A)
        vstate = self._vmp_state(data, t, eta, prec)
        vstate = VMPState(vstate.plan, vstate.q, self.vmp.elbo(vstate))
        return self._state(data, t, vstate, c)

    def step(self, state: gpn.VIState) -> tuple[gpn.VIState, Info]:
        """One VMP sweep: q(ω) = PG(1, c) from the state's q(u), then q(u) given q(ω)
        (§3.3 steps 1–2, derived); with ``natural_lr`` ρ < 1 the natural parameters move
        by ρ towards the derived ones (η ← (1−ρ)η + ρη*, as ``VINodes``)."""
        t, data = state.terms, state.data
        loc = state.moments[0] if state.moments else gpn.q_moments(state.eta, state.prec)[0]
        old = self._vmp_state(data, t, loc, state.prec)
        y = old.plan.sites["y"]
        c = polya_gamma.augmented(old.plan, old.q, y)[3] * t.mask  # the factors used
        new, _ = self.vmp.step(old)
        rho = self.natural_lr
        if rho != 1:
            loc_t, prec_t = new.q["u"]
            eta_t = (prec_t @ loc_t.unsqueeze(-1)).squeeze(-1)
            prec = (1 - rho) * state.prec + rho * prec_t
            prec = 0.5 * (prec + prec.transpose(-1, -2))
            eta = (1 - rho) * state.eta + rho * eta_t
            chol = torch.linalg.cholesky_ex(prec)[0]  # a mean of positive definite matrices
            loc = torch.cholesky_solve(eta.unsqueeze(-1), chol)
            q = {**new.q, "u": (loc.squeeze(-1), prec)}
            new = VMPState(new.plan, q, self.vmp.elbo(VMPState(new.plan, q, new.objective)))
        out = self._state(data, t, new, c)
        return out, Info(out.objective)


def gp_tree_exact_node(y: torch.Tensor, mask: torch.Tensor, k: torch.Tensor) -> None:
    """A batch of GP-Tree's few-shot nodes on the exact kernel (design §3.2), one row
    (task) per node: ``y [V, n]`` node labels, ``mask [V, n]`` the node's points, ``k [V,
    n, n]`` their kernel matrix (identity rows on the other points). f ~ N(0, K);
    y_i ~ Bernoulli(σ(f_i)) on the node's points, Pólya-Gamma augmented in VMP."""
    v, n = y.shape
    with pyro.plate("tasks", v, dim=-2):
        f = pyro.sample("f", dist.MultivariateNormal(y.new_zeros(v, 1, n), k.unsqueeze(-3)))
        with pyro.plate("points", n, dim=-1):
            pyro.sample("y", dist.Bernoulli(logits=f.squeeze(-2)).mask(mask), obs=y)


def exact_node_probs(
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    x_star: torch.Tensor,
    outputscale: float,
    lengthscale: float,
    jitter: float = 1e-3,
    tol: float = 1e-8,
    max_iter: int = 200,
) -> torch.Tensor:
    """p(y_v = 1 | x*) ``[V, N]`` of the few-shot nodes (``x [V, n, D]``, ``x_star [V, N,
    D]``) from the q(f) = N(m, S) VMP derives from :func:`gp_tree_exact_node`: the
    predictive f* ~ N(k*ᵀK⁻¹m, k** − k*ᵀK⁻¹k* + k*ᵀK⁻¹SK⁻¹k*), averaged through the
    sigmoid by Gauss–Hermite, as the hand-written Gibbs nodes average over their chains
    (``gibbs_predict``). ``jitter`` is the Gibbs engine's."""
    x, x_star, mask = gpn.normalize(x), gpn.normalize(x_star), mask.bool()
    s = x.new_full(x.shape[:1], outputscale)
    ls = x.new_full(x.shape[:1], lengthscale)
    k = gpn.masked_gram(gpn.rbf_kernel(x, x, s, ls), mask, jitter)
    node = VMP(gp_tree_exact_node, max_iter=max_iter, tol=tol, warn=False)  # a fixed budget
    state, _ = node.fit(y.to(x), mask, k)
    m, prec = state.q["f"]
    cov = torch.cholesky_inverse(torch.linalg.cholesky(prec))
    ks = gpn.rbf_kernel(x, x_star, s, ls) * mask.to(x.dtype).unsqueeze(-1)
    a = torch.cholesky_solve(ks, torch.linalg.cholesky(k))  # K⁻¹ k*  [V, n, N]
    mean = (a * m.unsqueeze(-1)).sum(-2)
    var = s.unsqueeze(-1) - (ks * a).sum(-2) + (a * (cov @ a)).sum(-2)
    return gpn.gauss_hermite_sigmoid(mean, var.clamp_min(1e-12))


# -- the engines of the estimators, side by side -----------------------------------------

#: node probabilities of a batch of few-shot nodes: (support ``[v, n, D]``, node labels
#: ``y [v, n]``, ``mask [v, n]``, query ``[v, Q, D]``, per-node keys ``[v]``) ->
#: (p(y_v = 1 | x*) ``[v, Q]``, a factorisation failed ``[v]``)
NodeProbs = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class FewShotSettings(Protocol):
    """The hyperparameters of :class:`~probfsl.models.gp_tree.GPTreeFewShot` its node
    engines read."""

    n_chains: int
    n_sweeps: int
    outputscale: float
    lengthscale: float
    pg_sampler: str
    seed: int


def gibbs_node_probs(hp: FewShotSettings) -> NodeProbs:
    """The hand-written few-shot nodes: one :class:`~probfsl.inference.gp_tree_nodes.GibbsNodes`
    for the whole prediction (its generator runs on across node batches), block Gibbs
    sampling on the exact kernel and its Monte Carlo predictive."""
    engine = gpn.GibbsNodes(
        int(hp.n_chains), hp.outputscale, hp.lengthscale, sampler=hp.pg_sampler, seed=int(hp.seed)
    )

    def probs(support, y, mask, query, keys):
        # the node data come from validated episodes: the engine skips its checks
        state = engine.fit(support, y, mask, int(hp.n_sweeps), keys=keys, checked=False)
        return gpn.gibbs_predict(state, query), state.chol_failed

    return probs


def exact_node_probs_of(hp: FewShotSettings) -> NodeProbs:
    """The derived few-shot nodes: q(f) by VMP on :func:`gp_tree_exact_node`
    (:func:`exact_node_probs`); nothing to report as failed."""

    def probs(support, y, mask, query, keys):
        p = exact_node_probs(support, y, mask, query, hp.outputscale, hp.lengthscale)
        return p, torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)

    return probs


@dataclass(frozen=True)
class GPTreeEngines:
    """One engine's node inference for each stage of GP-Tree.

    Attributes:
        vi: the variational base nodes, an :class:`~probfsl.inference.base.Engine` class
            built as ``vi(natural_lr=..., code_elbo=...)`` (:class:`GPTree`,
            ``inference="vi"``).
        gibbs: the Gibbs base nodes' class (``inference="gibbs"``), or None where this
            engine has none (the Gibbs sampler is no message-passing derivation).
        few_shot: given the few-shot estimator's hyperparameters, the node probabilities
            of a batch of few-shot nodes (:data:`NodeProbs`).
    """

    vi: type[gpn.VINodes]
    gibbs: type[gpn.GibbsNodes] | None
    few_shot: Callable[[FewShotSettings], NodeProbs]


#: GP-Tree's engines by the estimators' ``engine`` hyperparameter
ENGINES: dict[str, GPTreeEngines] = {
    "handwritten": GPTreeEngines(gpn.VINodes, gpn.GibbsNodes, gibbs_node_probs),
    "derived": GPTreeEngines(DerivedVINodes, None, exact_node_probs_of),
}
