"""Progress on stderr for work that can run longer than a few seconds.

Every command that can run long without printing (``verify`` on a long sequence, ``bench serve``
over many requests, ``kv-quality`` over a long text) shows the same bar: tqdm's, on stderr, so
that stdout (and ``--json``) stays exactly what it was. It appears only once the work has lasted
``PROGRESS_DELAY_S``, so a quick run prints nothing. On a terminal it is cleared when the work
ends; where stderr is a file or a pipe its last state stays as one line, a record of the run. Where
tqdm is not installed (the planner alone needs only numpy and tabulate), nothing is shown.
"""

from __future__ import annotations

import sys
from typing import Protocol

PROGRESS_DELAY_S = 1.0
"""Seconds of work before a bar appears (quicker runs print nothing), and the shortest interval
between two of its updates."""


class ProgressBar(Protocol):
    """What the work calls: ``update`` as units finish, ``close`` at the end."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class _NoProgress:
    """A bar that shows nothing (progress turned off, or tqdm absent)."""

    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to clear."""


def progress_bar(total: int, desc: str, unit: str, *, enabled: bool = True) -> ProgressBar:
    """A bar on stderr over ``total`` units named ``unit``, labelled ``desc``; it shows only after
    ``PROGRESS_DELAY_S`` of work. ``enabled=False``, or no tqdm installed: a bar that shows nothing."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=PROGRESS_DELAY_S,
                mininterval=PROGRESS_DELAY_S, leave=not sys.stderr.isatty())
