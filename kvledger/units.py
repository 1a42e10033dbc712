"""Parse and format byte sizes and rates.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) are
powers of 1000, as on a datasheet. ``80GB`` is therefore 80e9 bytes and ``80GiB`` is
85,899,345,920 bytes.
"""

from __future__ import annotations

import math
import re

from kvledger.errors import KVLedgerError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The range of a 64-bit signed integer: seeds, token ids and counts that reach torch or numpy."""

MiB = 1 << 20
"""Bytes in one mebibyte."""
GiB = 1 << 30
"""Bytes in one gibibyte."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4, "pi": 1024**5, "pib": 1024**5,
}
_NUMBER = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _quantity(text: str | int | float, what: str, kind: str, suffix: str = "") -> float:
    """``number x unit`` in bytes from ``text`` such as ``58.11GiB``, ``1.5e9`` or a number; finite,
    its sign left to the caller. ``kind`` names the quantity and ``suffix`` (``/s``) may end the text."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip()
        if suffix and raw.lower().endswith(suffix):
            raw = raw[: -len(suffix)]
        match = _NUMBER.match(raw)
        if not match:
            noun, example = ("bytes", "80GiB or 58.11GiB") if kind == "size" else ("bytes per second", "1.5TB/s")
            raise KVLedgerError(f"{what} {text!r} is not a {kind}: give {noun} or a number with a unit, e.g. {example}")
        unit = match.group(2).lower()
        if unit not in _UNITS:
            raise KVLedgerError(f"{what} {text!r} has an unknown unit {match.group(2)!r}: "
                                "use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
        value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise KVLedgerError(f"{what} must be a finite number, got {text!r}")
    return value


MAX_SIZE = 1 << 50
"""The largest size accepted (1 PiB): more memory than any device or host has."""


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Bytes from ``123``, ``58.11GiB``, ``80GB`` or ``1.5e9``; rounds down to a whole byte; at most ``MAX_SIZE``."""
    result = int(_quantity(text, what, "size"))
    if result <= 0:
        raise KVLedgerError(f"{what} must be positive, got {text!r}; give bytes or a size such as 80GiB")
    if result > MAX_SIZE:
        raise KVLedgerError(f"{what} {text!r} is more than any device has (at most 1PiB)")
    return result


def parse_rate(text: str | int | float, what: str = "rate") -> float:
    """Bytes per second from ``1.5TB/s``, ``2039GB/s`` or a plain number of bytes per second."""
    value = _quantity(text, what, "rate", suffix="/s")
    if value <= 0:
        raise KVLedgerError(f"{what} must be positive, got {text!r}; give bytes per second or a rate such as 1.5TB/s")
    return value


def format_bytes(n: float, binary: bool = True, digits: int = 2) -> str:
    """``131072`` -> ``128.00 KiB`` (binary) or ``131.07 KB`` (decimal)."""
    base, names = (1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else (1000, ["B", "KB", "MB", "GB", "TB", "PB"])
    value = float(n)
    for name in names:
        if abs(value) < base or name == names[-1]:
            return f"{int(value)} B" if name == "B" else f"{value:.{digits}f} {name}"
        value /= base
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """``1.5e12`` -> ``1.50 TB/s`` (decimal, as bandwidth is quoted)."""
    return format_bytes(bytes_per_s, binary=False) + "/s"


def available_ram_bytes() -> int:
    """Host memory available now: ``MemAvailable`` from /proc/meminfo, else total physical memory."""
    from pathlib import Path

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
