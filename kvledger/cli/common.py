"""Argument helpers shared by subcommands: bounded numbers, sizes, rates, JSON output."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from kvledger.units import INT64_MAX, INT64_MIN
from kvledger.units import parse_rate, parse_size
from kvledger.errors import KVLedgerError, shorten


def _number(kind: type, noun: str, ok: Callable[[Any], bool], requirement: str, name: str):
    """An argparse type: ``kind(text)``, refused with one line unless ``ok(value)``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value
    parse.__name__ = name
    return parse


positive_int = _number(int, "an integer", lambda v: v > 0, "a positive integer", "positive_int")
MAX_TOKENS = 2**40
"""The most tokens a length flag takes (about 10^12): beyond any context or pool."""
token_count = _number(int, "an integer", lambda v: 0 < v <= MAX_TOKENS, "a positive integer of at most 2^40",
                      "token_count")
non_negative_int = _number(int, "an integer", lambda v: v >= 0, "zero or more", "non_negative_int")
positive_float = _number(float, "a number", lambda v: 0 < v < math.inf, "a positive finite number", "positive_float")
non_negative_float = _number(float, "a number", lambda v: 0 <= v < math.inf, "a finite number, zero or more",
                             "non_negative_float")
fraction = _number(float, "a number", lambda v: 0 < v <= 1, "in (0, 1]", "fraction")
MAX_LENGTH_SCALE = 1000.0
"""The largest --length-scale: a thousand times a trace's lengths is beyond any model's context."""
length_scale = _number(float, "a number", lambda v: 0 < v <= MAX_LENGTH_SCALE,
                       f"a positive number of at most {MAX_LENGTH_SCALE:g}", "length_scale")
TIME_SCALE_RANGE = (1e-6, 1e6)
"""--time-scale's bounds: a trace sped up or slowed down a million times is no longer its arrival pattern,
and beyond that its times leave the range a report prints (or a float holds)."""
time_scale = _number(float, "a number", lambda v: TIME_SCALE_RANGE[0] <= v <= TIME_SCALE_RANGE[1],
                     f"from {TIME_SCALE_RANGE[0]:g} to {TIME_SCALE_RANGE[1]:g}", "time_scale")
seed = _number(int, "an integer", lambda v: 0 <= v <= INT64_MAX, "an integer from 0 to 2^63 - 1", "seed")
"""A seed of numpy's draws (rows, arrivals, token ids), which refuse a negative one."""
signed_seed = _number(int, "an integer", lambda v: INT64_MIN <= v <= INT64_MAX, "an integer from -2^63 to 2^63 - 1",
                      "signed_seed")
"""A seed of torch's generators (``generate``, ``verify``): any 64-bit signed integer, as the engine takes."""


def _wrap(parse):  # argparse wants ArgumentTypeError for a clean one-line message
    def convert(text: str):
        try:
            return parse(text)
        except KVLedgerError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = parse.__name__
    return convert


def request_rate(text: str) -> float | str:
    """``--request-rate`` of ``bench serve``: requests/s (a positive finite number), ``inf`` (every
    request at once, as vLLM's benchmark means it) or ``trace``."""
    if text in ("inf", "trace"):
        return math.inf if text == "inf" else "trace"
    return _finite_rate(text, "'inf' (all at once) or 'trace'")


def simulated_request_rate(text: str) -> float | str:
    """``--request-rate`` of ``simulate``: requests/s (a positive finite number) or ``trace``.
    ``inf`` is refused: on a virtual clock a burst of the whole trace at 0 s measures the queue,
    not the service, so a finite rate (or the trace's own times) must be named."""
    if text == "trace":
        return "trace"
    if text.strip().lower() in ("inf", "+inf", "infinity"):
        raise argparse.ArgumentTypeError("'inf' is not a rate the simulator replays; give requests/s "
                                         "(e.g. 20) or 'trace' for the trace's own timestamps")
    return _finite_rate(text, "or 'trace'")


MIN_REQUEST_RATE = 1e-6
"""The lowest --request-rate, in requests/s: one request every 11.6 days. Below it a replay's
duration runs to hundreds of digits (1e-300 requests/s) and measures nothing a server does."""


def _finite_rate(text: str, others: str) -> float:
    """A finite number of requests/s of at least ``MIN_REQUEST_RATE`` from ``text``; ``others``
    names the words also accepted."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests/s, {others}") from None
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a positive finite number of requests/s, {others}, got {text}")
    if value < MIN_REQUEST_RATE:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_REQUEST_RATE:g} requests/s (one request every "
                                         f"{1 / MIN_REQUEST_RATE / 86400:.1f} days), {others}, got {text}")
    return value


size = _wrap(parse_size)
rate = _wrap(parse_rate)


def check_writable(path: str, flag: str) -> None:
    """Refuse, before a long run, an output ``path`` that cannot be written: its directory missing,
    the path a directory, or no permission. Nothing is created (a refused run leaves no file)."""
    out = Path(path)
    try:
        if out.is_dir():
            raise KVLedgerError(f"{flag} {path} is a directory; give a file name")
        directory = out.parent
        if not directory.is_dir():
            raise KVLedgerError(f"{flag} {path}: no directory {directory}; create it first or give another path")
        if not os.access(directory, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
            raise KVLedgerError(f"{flag} {path} cannot be written (permission denied); give a path you can write")
    except OSError as err:  # a name longer than the file system takes, say
        raise KVLedgerError(f"{flag} {shorten(path)}: {err.strerror or err}; give another path") from None


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
