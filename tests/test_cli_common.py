"""The CLI's number types: what each accepts, and the one line it gives for what it refuses; and the
files the CLI writes (plots, Markdown) failing as one line."""

from __future__ import annotations

import argparse
import re

import pytest

from kvledger.cli.common import fraction, non_negative_int, positive_float, positive_int, rate, size
from kvledger.errors import KVLedgerError


@pytest.mark.parametrize("parse, text, value", [
    (positive_int, "3", 3), (non_negative_int, "0", 0), (positive_float, "0.25", 0.25), (fraction, "1", 1.0),
    (size, "80GiB", 80 * 1024**3), (size, "80GB", 80 * 10**9), (size, "1.5e9", 1_500_000_000),
    (rate, "1.5TB/s", 1.5e12), (rate, "2039GB/s", 2.039e12), (rate, "1e9", 1e9),
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


@pytest.mark.parametrize("parse, text, message", [
    (size, "1e400", "must be a finite number, got '1e400'"),
    (size, "1e300GiB", "must be a finite number, got '1e300GiB'"),
    (rate, "1e400TB/s", "must be a finite number, got '1e400TB/s'"),
    (rate, "1e300TB/s", "must be a finite number, got '1e300TB/s'"),
    (size, "0.5", "must be positive, got '0.5'"),
    (rate, "0TB/s", "must be positive, got '0TB/s'"),
    (size, "3XB", "unknown unit 'XB'"),
    (rate, "3XB/s", "unknown unit 'XB'"),
    (size, "fast", "is not a size"),
    (rate, "fast", "is not a rate"),
    (size, "1TB/s", "is not a size"),
])
def test_sizes_and_rates_refuse_with_one_line(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse(text)


def test_markdown_that_cannot_be_written_is_a_user_error(tmp_path):
    from kvledger.cli.bench import append_markdown

    with pytest.raises(KVLedgerError, match="cannot append to --markdown"):
        append_markdown(str(tmp_path / "missing" / "BENCHMARKS.md"), "text\n")
    append_markdown(str(tmp_path / "BENCHMARKS.md"), "one\n")
    append_markdown(str(tmp_path / "BENCHMARKS.md"), "two\n")
    assert (tmp_path / "BENCHMARKS.md").read_text() == "one\ntwo\n"


def test_savefig_that_fails_is_a_user_error(tmp_path):
    pytest.importorskip("matplotlib")
    from kvledger.plotting import pyplot, save_png

    plt = pyplot(tmp_path / "a.png")
    fig = plt.figure()
    with pytest.raises(KVLedgerError, match="cannot write --plot"):
        save_png(fig, tmp_path / "missing" / "a.png")
    assert not plt.get_fignums()  # closed even so
    with pytest.raises(KVLedgerError, match=r"--plot writes a PNG.*'a\.pdf'"):
        pyplot(tmp_path / "a.pdf")
