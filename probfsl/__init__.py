"""probfsl: Bayesian few-shot learning with Pyro models and batched closed-form engines.

``probfsl.make_estimator(name, preset=None, **params)`` builds any registered method
(:func:`probfsl.tuning.make_estimator`); ``probfsl.run(probfsl.RunSpec(...))`` runs one
evaluation as ``probfsl run`` does (:class:`probfsl.run_spec.RunSpec`,
:func:`probfsl.running.run`); ``probfsl.sweep`` runs a sweep
(:func:`probfsl.sweeps.sweep`). They are imported when first used, so that
``import probfsl`` stays light.
"""

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it)

__all__ = ["RunSpec", "__version__", "make_estimator", "run", "sweep"]


def __getattr__(name: str):
    """``probfsl.make_estimator`` (:func:`probfsl.tuning.make_estimator`),
    ``probfsl.RunSpec`` (:class:`probfsl.run_spec.RunSpec`), ``probfsl.run``
    (:func:`probfsl.running.run`) and ``probfsl.sweep`` (:func:`probfsl.sweeps.sweep`),
    imported when first used."""
    if name == "RunSpec":
        from probfsl.run_spec import RunSpec

        return RunSpec
    if name == "run":
        from probfsl.running import run

        return run
    if name == "make_estimator":
        from probfsl.tuning import make_estimator

        return make_estimator
    if name == "sweep":
        from probfsl.sweeps import sweep

        return sweep
    raise AttributeError(f"module 'probfsl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
