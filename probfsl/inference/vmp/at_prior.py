"""Latent Gaussian sites whose factor is their prior, q(ε) = p(ε) (integrated out).

A site declared with ``infer={"q": "prior"}``, e.g.

```python
eps = pyro.sample("eps", dist.Normal(0.0, ktilde.sqrt()), infer={"q": "prior"})
pyro.sample("y", dist.Bernoulli(logits=(A * u).sum(-1) + eps), obs=y)
```

keeps its prior as its factor: it is never updated, so its children see its prior moments
(⟨ε⟩ = 0 and Var ε in a Pólya-Gamma child's ⟨ψ²⟩) and its term of the bound,
E ln p(ε) + H[q(ε)] = −KL(p ‖ p), is zero. This is the sparse variational GP's
q(f | u) = p(f | u) (Titsias, AISTATS 2009; Hensman, Matthews & Ghahramani, AISTATS 2015)
written with f_i = A_i u + ε_i, ε_i ~ N(0, K̃_ii), K̃_ii = K_ii − K_iu K_uu⁻¹ K_ui: the
likelihood factorises over points, so only each ε_i's marginal enters, and
q(u, ε) = q(u) p(ε) is that structured factor exactly. (Without the flag, ε would get a
mean-field factor q(ε_i) updated from its child: a larger family with a higher bound, but
another posterior than the sparse GP's.)

The site must be a latent Normal or MultivariateNormal with fixed parameters (no latent
parent: its prior is then a fixed law, which the factor equals); anything else is refused
before any sweep. :func:`marked` reads the flag off a trace node, :func:`check` verifies
the plan; :func:`probfsl.inference.vmp.messages.natural` leaves the children's messages
out of such a site's update.
"""

from __future__ import annotations

from probfsl.inference.vmp.checks import refuse
from probfsl.inference.vmp.family import lookup
from probfsl.inference.vmp.layout import Plan

#: the key and value of a site's ``infer`` dict that keep its factor at its prior
KEY, VALUE = "q", "prior"


def marked(node: dict) -> bool:
    """Whether the trace node asks for q = p (``infer={"q": "prior"}``); ``ValueError``
    for another value of ``infer["q"]``."""
    value = node["infer"].get(KEY)
    if value is not None and value != VALUE:
        raise ValueError(
            f"site {node['name']!r}: infer[{KEY!r}] may only be {VALUE!r}, got {value!r}"
        )
    return value == VALUE


def check(plan: Plan) -> None:
    """``ValueError`` naming a site kept at its prior that is not a latent Gaussian with
    fixed parameters (module docstring)."""
    for name, s in plan.sites.items():
        if not s.at_prior:
            continue
        why = None
        if s.observed or s.point:
            why = "only a latent site can keep its prior as its factor"
        elif not lookup(s.family).gaussian:
            why = "only a Normal or MultivariateNormal site can keep its prior as its factor"
        elif any(p.parent or p.terms or p.bilinear or p.selector for p in s.params.values()):
            why = "a site kept at its prior (q = p) needs fixed parameters, not latent parents"
        elif s.chain is not None:
            why = "a site of a Gaussian Markov chain cannot keep its prior as its factor"
        if why is not None:
            raise refuse(name, s.fn_name, "-", why)
