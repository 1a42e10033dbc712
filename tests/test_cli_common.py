"""The CLI's number types: what each accepts, and the one line it gives for what it refuses."""

from __future__ import annotations

import argparse

import pytest

from kvledger.cli.common import fraction, non_negative_int, positive_float, positive_int


@pytest.mark.parametrize("parse, text, value", [
    (positive_int, "3", 3), (non_negative_int, "0", 0), (positive_float, "0.25", 0.25), (fraction, "1", 1.0),
])
def test_accepts(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize("parse, text, message", [
    (positive_int, "0", "must be a positive integer, got 0"),
    (positive_int, "2.5", "'2.5' is not an integer"),
    (non_negative_int, "-1", "must be zero or more, got -1"),
    (positive_float, "nan", "must be a positive finite number, got nan"),
    (positive_float, "inf", "must be a positive finite number, got inf"),
    (positive_float, "x", "'x' is not a number"),
    (fraction, "1.5", "must be in (0, 1], got 1.5"),
    (fraction, "0", "must be in (0, 1], got 0.0"),
])
def test_refuses_with_one_line(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse(text)
    assert str(err.value) == message
