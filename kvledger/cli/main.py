"""Entry point of the ``kvledger`` command.

Each subcommand lives in its own module under ``kvledger.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function taking the
parsed ``argparse.Namespace`` and returning an exit code. Modules import heavy libraries
(torch, transformers) inside that function, never at import time, so the planner's
commands start fast and never load torch.

User errors (:class:`kvledger.errors.KVLedgerError`) become one line on stderr and exit 2;
doubts about the input (:class:`kvledger.errors.InputWarning`) one ``warning:`` line each.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from typing import Callable, NoReturn, Sequence

from kvledger.errors import InputWarning, KVLedgerError

SUBCOMMANDS = [
    "kvledger.cli.kv_bytes",
    "kvledger.cli.verify",
    "kvledger.cli.plan",
    "kvledger.cli.advise",
    "kvledger.cli.gpus",
    "kvledger.cli.generate",
    "kvledger.cli.kv_quality",
    "kvledger.cli.serve",
    "kvledger.cli.bench",
    "kvledger.cli.simulate",
    "kvledger.cli.calibrate",
]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: what was wrong and where to look.

    A value that looks like a negative number, with or without a unit (``-80GiB``, ``-1e5``), is
    a value, not an unknown flag, so that its option's own check says what is wrong with it."""

    NEGATIVE_VALUE = re.compile(r"^-\d[\d_.]*(?:[eE][+-]?\d+)?\s*[A-Za-z/]*$")
    """``-80GiB``, ``-1.5TB/s``, ``-1e5``: no option of kvledger starts with ``-`` and a digit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvledger", description=__doc__.splitlines()[0])
    from kvledger import __version__

    parser.add_argument("--version", action="version", version=f"kvledger {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    subparsers.required = True
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # subcommand not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
            return int(args.func(args) or 0)
    except KVLedgerError as err:
        print(f"kvledger {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _one_line_warnings(command: str, show: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints an :class:`InputWarning` as one line,
    ``kvledger COMMAND: warning: ...`` on stderr, and leaves every other warning to ``show``."""
    def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, InputWarning):
            print(f"kvledger {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return show_warning


if __name__ == "__main__":
    sys.exit(main())
