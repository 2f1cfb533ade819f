"""Variational message passing derived from a Pyro model (docs/design/vmp.md).

Winn & Bishop, "Variational Message Passing", JMLR 6 (2005) §3-4; Bishop, *PRML* (2006)
§10.1-10.4. Given a Pyro model of conjugate-exponential sites with a leading ``tasks``
plate, :class:`VMP` reads the model's structure from ``pyro.poutine.trace`` and derives

* the factor of each latent site, in the family of its prior (mean-field, except where
  a structured factor is exact: a joint Gaussian over an event axis that a linear map
  sums, a Gaussian Markov chain, the hidden chain of a ``DiscreteHMM``; ``pyro.param``
  sites are point estimates);
* the coordinate update of each factor, η*_i = E[η_i(pa_i)] + Σ_children m_{c→i}
  (design §1), one batched tensor contraction per message;
* the analytic ELBO Σ_sites E_q[ln p(x | pa)] + Σ_latent H[q] (Winn & Bishop §3.3);
* a Pyro guide with the model's signature, and the posterior factors as
  ``torch.distributions`` objects.

**The modules.** :mod:`~probfsl.inference.vmp.compiler` reads the model into a plan
(:mod:`~probfsl.inference.vmp.layout`: one named axis per plate and per event dimension);
:mod:`~probfsl.inference.vmp.moments` gives every factor's expected statistics;
:mod:`~probfsl.inference.vmp.family` is the family record and its registry, and
:mod:`~probfsl.inference.vmp.families` holds one record per family (its roles, reading,
factor block, point rules and, for a conjugate child, its message coefficients);
:mod:`~probfsl.inference.vmp.messages` dispatches the updates and the bound, by the
records, to the message modules: :mod:`~probfsl.inference.vmp.normal`,
:mod:`~probfsl.inference.vmp.mvn`, :mod:`~probfsl.inference.vmp.conjugate_children`
(Poisson, Bernoulli, Binomial, Gamma rates, selected Categoricals),
:mod:`~probfsl.inference.vmp.linear_maps`, :mod:`~probfsl.inference.vmp.polya_gamma`,
:mod:`~probfsl.inference.vmp.dirichlet_points`, :mod:`~probfsl.inference.vmp.hmm`,
:mod:`~probfsl.inference.vmp.gaussian_chain` and :mod:`~probfsl.inference.vmp.at_prior`
(sites kept at their prior, q = p); contractions over named axes are
:mod:`~probfsl.inference.vmp.einsum`'s, refusals :mod:`~probfsl.inference.vmp.checks`'s,
and :mod:`~probfsl.inference.vmp.engine` is the engine
(:mod:`~probfsl.inference.vmp.plan_cache` keeps its last plan for new data);
:mod:`~probfsl.inference.vmp.branches` holds every parameter to the plan on runs at each
end of the latent sites' supports (a Python branch on a latent value). Linear maps are
found by automatic differentiation, and a precision or rate c · Π τ by the form it is computed in
(:mod:`~probfsl.inference.vmp.monomials`: the model's own c, no rounding), as is the
component a fixed index picks (carried from the parent's entries through the model's
indexing or one-hot products); copies of a parent, and a latent selector, are verified by
the runs below.

**How the structure is read.** Parents come from Pyro's provenance tracking
(``pyro.infer.inspect.get_dependencies``), and two runs of the model with every latent
site at values the compiler draws from streams of its own (away from the edges of each
site's support, never from the priors, so the plan does not depend on the user's random
stream) show which parameters they move. How a parent
enters a parameter is then *verified* numerically on those values: a location must equal
the parent's value (broadcast over the child's extra axes, the parent's event axes
right-aligned with the child's), a precision (1/scale², or a precision matrix) must equal
c·(parent) with c fixed, a Categorical's probabilities must equal the Dirichlet parent.
A parent plate missing from the child is a mixture component axis: the child must select
it by a latent Categorical site (``Vindex(mu)[..., z, :]``) or by a constant index (labels
given as data); a fixed per-class table selected by a latent site is accepted too.
Anything else is refused with a ``ValueError`` naming the site, its distribution and the
parent (design §5), before any update. Deriving the plan costs a few runs of the model
(``init``, with the data's device as the default device, so that Pyro's plates and torch's
samplers put their tensors with the data); the sweeps never run it.

**Supported pairs** (child parameter ← parent): see :data:`SUPPORTED` (listed in
docs/modelling.md, "Supported forms"; every refusal points there).

**Partially observed labels.** ``pyro.sample("z", Categorical(pi), obs=labels,
obs_mask=observed)`` (Pyro's own mechanism: sites ``z_observed`` and ``z_unobserved``) is one
Categorical factor whose observed entries are fixed one-hot and never updated.

**Initialisation** (design §4). Latent Categorical sites start from the given responsibilities
(``init(..., init_resp={site: probs})``), or from one-hot observed entries and
uniform-plus-noise elsewhere (noise from a fixed seed over the non-task axes, the same for
every task, so a batch equals its tasks run alone). Every other factor starts at its prior
and is then updated once from those responsibilities (an M step before the first E step),
in the model's declaration order whatever ``order`` is. A start of one's own (``init=``:
``"prior"`` draws, a site's mean, or a previous state) is :mod:`~probfsl.inference.vmp.starts`'s;
``fit(state=previous)`` continues a fit.

**Schedule.** One ``step`` updates every latent site once, in the order the model declares
them (or ``order``), and makes no host synchronisation. ``fit`` is ``init`` followed by the
shared loop :func:`probfsl.inference.base.run`: a task whose ELBO moved by less than ``tol``
(relative) in one sweep has converged, and from then on its factors are kept
(:meth:`VMP.keep` masks it); at each check (the host asks which tasks still move: on the
CPU after every sweep, where a check waits for nothing; on an accelerator after
``check_every`` sweeps, then at growing gaps) the converged tasks leave the batch
(:meth:`VMP.take`, :meth:`VMP.put`).

**Cost of a sweep.** What is fixed is computed once per plan: a coefficient c of
c·τ (the model's own constant, read off the form of the parameter:
:mod:`~probfsl.inference.vmp.monomials`) is kept as a scalar where it is one, and dropped
where it is exactly 1; ln c, m², ln π of fixed parameters and the priors'
natural parameters and log-normalisers (Gamma, Dirichlet, and Normal sites with a fixed
prior) are cached. Expected statistics are cached per factor and reused by the entropies.
A contraction that sums over no axis is a broadcast product; the others are evaluated one
pair of operands at a time (opt_einsum's order for large ones), each pair one batched
matrix product of views. Terms without the data's axes stay unbroadcast until one in-place
addition: a mixture's label update forms E ln π plus the per-component E ln N in one
full-size pass and normalises it in place. When a Categorical factor was updated last, its
ELBO terms and its children's are its normaliser Σ_n ln Σ_k e^η_nk.
"""

from probfsl.inference.vmp import families  # noqa: F401  (registers the families)
from probfsl.inference.vmp.engine import VMP, ConvergenceWarning, MeanFieldWarning, VMPState
from probfsl.inference.vmp.family import REGISTRY
from probfsl.inference.vmp.plan_cache import PlanCache
from probfsl.inference.vmp.supported import SUPPORTED

#: family name -> its Pyro distribution class (the families VMP knows)
FAMILIES = {name: record.pyro_class for name, record in REGISTRY.items()}

__all__ = [
    "FAMILIES",
    "SUPPORTED",
    "VMP",
    "ConvergenceWarning",
    "MeanFieldWarning",
    "PlanCache",
    "VMPState",
]
