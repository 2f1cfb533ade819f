"""One progress display for every long step: a tqdm bar on a terminal, log lines elsewhere.

:func:`progress` returns an object with ``update(n)`` used as a context manager. On a
terminal (stderr is a TTY) it is a tqdm bar. Anywhere else (a pipe, a file, a notebook
log) a bar's carriage returns are noise, so it reports through the ``probfsl.progress``
logger instead: a line at most every ``every`` seconds, such as
``run: 3,000/10,000 tasks (30%), 12 s, about 28 s left``, and one when the step ends.
The command line shows those lines on stderr; in Python they follow ``logging``'s
configuration. With ``enabled=False`` it does nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["EVERY", "progress"]

#: seconds between two progress lines when stderr is not a terminal
EVERY = 5.0


class _LogLines:
    """Progress as log lines, at most one per ``every`` seconds, and one at the end."""

    def __init__(self, total: int, desc: str, unit: str, every: float) -> None:
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.n, self.start = 0, time.monotonic()
        self.last = self.start

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every and self.n < self.total:
            self.last = now
            self._report(now)

    def _report(self, now: float) -> None:
        elapsed = now - self.start
        share = self.n / self.total if self.total else 1.0
        text = f"{self.desc}: {self.n:,}/{self.total:,} {self.unit} ({100 * share:.0f}%), "
        text += f"{elapsed:.0f} s"
        if 0 < share < 1:
            text += f", about {elapsed * (1 - share) / share:.0f} s left"
        log.info(text)

    def __enter__(self) -> _LogLines:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    def close(self) -> None:
        """The closing line (only for steps long enough to have reported)."""
        if time.monotonic() - self.start >= self.every:
            self._report(time.monotonic())


class _Nothing:
    def __init__(self, total: int) -> None:
        self.total = total

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str, enabled: bool = True, every: float | None = None):
    """A progress display for ``total`` steps of ``unit`` (module docstring); off a
    terminal a line at most every ``every`` seconds (default :data:`EVERY`)."""
    if not enabled:
        return _Nothing(total)
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False)
    return _LogLines(total, desc, unit, EVERY if every is None else every)
