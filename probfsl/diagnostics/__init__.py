"""Diagnostics: ArviZ export and summaries (ArviZ is imported lazily)."""

from probfsl.diagnostics.arviz import draws_from_guide, summary, to_datatree

__all__ = ["draws_from_guide", "summary", "to_datatree"]
