"""User-facing errors: one line that says what was wrong and what to do.

The CLI prints ``kvledger: error: <message>`` and exits with code 2; the server turns the
same exception into an HTTP 4xx. Never raise these for programming errors.
"""

from typing import Any


class KVLedgerError(Exception):
    """A problem with the user's input. ``str(err)`` is the whole one-line message."""


class ConfigError(KVLedgerError):
    """A model config that is missing, unreadable or lacks what Eq 2.2 needs."""


class ParameterError(KVLedgerError):
    """A request parameter with a value the engine cannot honour; ``param`` names it (the server
    reports it as the OpenAI error object's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_json(text: str) -> Any:
    """``json.loads(text)`` for a user's file. A document nested deeper than the interpreter's
    recursion limit (about 1,000 levels) is a :class:`json.JSONDecodeError` like any other
    malformed file, not a ``RecursionError``, so each reader's one-line message covers it."""
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read (more than about 1,000 levels)", text, 0) from None


def shorten(text: str, limit: int = 120) -> str:
    """``text`` as it is up to ``limit`` characters; a longer one (a name pasted by mistake) as its
    head and tail around its length, so that a message stays one readable line."""
    if len(text) <= limit:
        return text
    half = (limit - 30) // 2
    return f"{text[:half]}...({len(text):,} characters)...{text[-half:]}"


class InputWarning(UserWarning):
    """Input taken, with a doubt the user should see: the CLI prints ``str(warning)`` as one
    ``warning:`` line on stderr (a typo'd ``model_type``, say); the library leaves it to Python."""
