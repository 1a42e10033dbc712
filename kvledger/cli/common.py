"""Argument helpers shared by subcommands: positive integers, sizes, rates, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvledger.spec.dtypes import KV_CACHE_DTYPES
from kvledger.units import parse_rate, parse_size
from kvledger.errors import KVLedgerError


def _positive(kind: type, noun: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive {noun.split()[-1]}, got {value}")
        return value
    parse.__name__ = f"positive_{kind.__name__}"
    return parse


positive_int = _positive(int, "an integer")
positive_float = _positive(float, "a number")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _wrap(parse):  # argparse wants ArgumentTypeError for a clean one-line message
    def convert(text: str):
        try:
            return parse(text)
        except KVLedgerError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = parse.__name__
    return convert


size = _wrap(parse_size)
rate = _wrap(parse_rate)


def add_kv_cache_dtype(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    parser.add_argument("--kv-cache-dtype", default=default, choices=KV_CACHE_DTYPES, metavar="D",
                        help=f"KV-cache element type: {', '.join(KV_CACHE_DTYPES)} (default: {default}, the model's dtype)")


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
