"""probfsl: Bayesian few-shot learning with Pyro models and batched closed-form engines."""

__version__ = "0.1.0"
