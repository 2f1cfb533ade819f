"""Exponential-family blocks for conjugate variational inference.

Each block is a batched factor q(x) = exp(η·u(x) − A(η) + h(x)) over any leading shape,
holding its usual parameters as tensors (device and dtype follow them). Every block gives

* ``natural()``: η, a tuple of tensors (the coefficients of ``u(x)``);
* ``from_natural(*eta)``: the block back from η;
* ``expected_stats()``: ⟨u(x)⟩ under the block, a tuple matching ``natural()``;
* ``log_normalizer()``: A(η) (with the base measure's constant folded in, so that
  ``E ln q = η·⟨u⟩ − A``);
* ``entropy()`` and ``kl(other)`` (KL(self ‖ other)), one value per batch element;
* ``expected_log_prob(stats)``: E_q'[ln self(x)] for ⟨u(x)⟩ = ``stats`` under another factor q';
* ``distribution()``: the equivalent ``torch.distributions`` object.

References: Bishop, *PRML* (2006) §2.4 (the exponential family), Appendix B (the
Beta, Dirichlet, Gamma and Wishart moments and entropies); Winn & Bishop, "Variational Message
Passing", JMLR 6 (2005), Appendix A (the same table as natural parameters).
"""

from probfsl.inference.expfam.families import (
    Beta,
    Categorical,
    Dirichlet,
    Gamma,
    MultivariateNormal,
    Normal,
    Wishart,
)

__all__ = ["Beta", "Categorical", "Dirichlet", "Gamma", "MultivariateNormal", "Normal", "Wishart"]
