"""probfsl: Bayesian few-shot learning with Pyro models and batched closed-form engines."""

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)


def __getattr__(name: str):
    """``probfsl.sweep``: :func:`probfsl.sweeps.sweep`, imported when first used (so that
    ``import probfsl`` stays light)."""
    if name == "sweep":
        from probfsl.sweeps import sweep

        return sweep
    raise AttributeError(f"module 'probfsl' has no attribute {name!r}")
