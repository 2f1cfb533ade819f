"""The families VMP supports, one module each (docs/design/vmp.md §7): importing this
package registers them (:func:`~probfsl.inference.vmp.family.register`). A new family is
one module here and its line below."""

from probfsl.inference.vmp.families import (  # noqa: F401  (each registers its record)
    bernoulli,
    beta,
    categorical,
    dirichlet,
    discrete_hmm,
    exponential,
    gamma,
    multinomial,
    multivariate_normal,
    normal,
    poisson,
    wishart,
)
