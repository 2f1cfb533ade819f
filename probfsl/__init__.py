"""probfsl: Bayesian few-shot learning with Pyro models and batched closed-form engines."""

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)
