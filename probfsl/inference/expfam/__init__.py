"""Exponential-family blocks for conjugate variational inference.

One module a family, on the shared algebra of :mod:`~probfsl.inference.expfam.block`.
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

from probfsl.inference.expfam.beta import Beta
from probfsl.inference.expfam.categorical import Categorical
from probfsl.inference.expfam.dirichlet import Dirichlet
from probfsl.inference.expfam.gamma import Gamma
from probfsl.inference.expfam.multivariate_normal import MultivariateNormal
from probfsl.inference.expfam.normal import Normal
from probfsl.inference.expfam.wishart import Wishart

__all__ = ["Beta", "Categorical", "Dirichlet", "Gamma", "MultivariateNormal", "Normal", "Wishart"]
