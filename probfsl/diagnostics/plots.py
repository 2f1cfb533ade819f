"""Posterior figures through arviz-plots (forest, trace, ESS, rank plots).

arviz-plots and matplotlib come with the ``plots`` extra; they are imported when a
figure is asked for, with an ``ImportError`` saying how to install them otherwise.
Each function takes an ``xarray.DataTree`` (from :func:`probfsl.diagnostics.to_datatree`
or an estimator's ``to_datatree``), draws with the matplotlib backend unless told
otherwise, and returns arviz-plots' ``PlotCollection`` (``.viz`` holds the axes).
"""

from __future__ import annotations

from typing import Any

PLOTS_MISSING = (
    "probfsl's plots need arviz-plots and matplotlib (the 'plots' extra): "
    'pip install -c constraints.txt -e ".[plots]" from a clone of probfsl, '
    "or pip install arviz-plots matplotlib"
)


def _arviz_plots():
    try:
        import arviz_plots
    except ImportError as err:
        raise ImportError(PLOTS_MISSING) from err
    return arviz_plots


def _plot(name: str, tree: Any, kwargs: dict) -> Any:
    kwargs.setdefault("backend", "matplotlib")
    return getattr(_arviz_plots(), name)(tree, **kwargs)


def plot_forest(tree: Any, var_names: list[str] | None = None, **kwargs: Any) -> Any:
    """Credible intervals and point estimates of each variable (``arviz_plots.plot_forest``)."""
    return _plot("plot_forest", tree, {"var_names": var_names, **kwargs})


def plot_trace(tree: Any, var_names: list[str] | None = None, **kwargs: Any) -> Any:
    """Draws against iteration, one line per chain (``arviz_plots.plot_trace``)."""
    return _plot("plot_trace", tree, {"var_names": var_names, **kwargs})


def plot_ess(tree: Any, var_names: list[str] | None = None, **kwargs: Any) -> Any:
    """Effective sample size per quantile or interval (``arviz_plots.plot_ess``)."""
    return _plot("plot_ess", tree, {"var_names": var_names, **kwargs})


def plot_rank(tree: Any, var_names: list[str] | None = None, **kwargs: Any) -> Any:
    """Rank plot of the chains: flat when they mix (``arviz_plots.plot_rank``)."""
    return _plot("plot_rank", tree, {"var_names": var_names, **kwargs})
