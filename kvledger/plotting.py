"""PNG figures with matplotlib, the optional ``plot`` extra: the one setup and the one save that
every ``--plot`` uses. matplotlib is imported here only, when a figure is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvledger.errors import KVLedgerError


def pyplot(path: str | Path, flag: str = "--plot") -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, once ``path`` is known to end in
    ``.png``. Call it before a long run, so that a wrong name or a missing matplotlib fails at once."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise KVLedgerError(f"{flag} writes a PNG: give a file name ending in .png, got {out.name!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVLedgerError(f"{flag} needs matplotlib: pip install 'kvledger[plot]'") from None
    return plt


def save_png(fig: Any, path: str | Path, flag: str = "--plot") -> Path:
    """Lay ``fig`` out, write it to ``path`` (110 dpi) and close it; a path that cannot be written
    is a KVLedgerError."""
    plt = pyplot(path, flag)
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise KVLedgerError(f"cannot write {flag} {path}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return Path(path)
