"""Diagnostics: ArviZ export, summaries and figures (ArviZ is imported lazily)."""

from probfsl.diagnostics.arviz import draws_from_guide, summary, to_datatree
from probfsl.diagnostics.plots import plot_ess, plot_forest, plot_rank, plot_trace
from probfsl.diagnostics.vmp_arviz import vmp_datatree

__all__ = [
    "draws_from_guide",
    "plot_ess",
    "plot_forest",
    "plot_rank",
    "plot_trace",
    "summary",
    "to_datatree",
    "vmp_datatree",
]
