"""Sweeps: many ``probfsl run`` cells (data × methods × settings × seeds) on worker
processes or a Ray cluster, one resumable results store, and reports made from it.

:func:`sweep` runs a :class:`SweepConfig` (or its YAML file, :func:`load_config`) into a
:class:`ResultsStore`; :func:`probfsl.sweeps.report.write_report` makes its tables and
figures.
"""

from probfsl.sweeps.cell import Cell
from probfsl.sweeps.config import (
    MethodEntry,
    Resources,
    RunOptions,
    Source,
    SweepConfig,
    config_from_dict,
    load_config,
)
from probfsl.sweeps.runner import sweep
from probfsl.sweeps.store import ResultsStore, read_table, stable_columns

__all__ = [
    "Cell",
    "MethodEntry",
    "ResultsStore",
    "Resources",
    "RunOptions",
    "Source",
    "SweepConfig",
    "config_from_dict",
    "load_config",
    "read_table",
    "stable_columns",
    "sweep",
]
