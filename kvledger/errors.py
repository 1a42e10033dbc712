"""User-facing errors: one line that says what was wrong and what to do.

The CLI prints ``kvledger: error: <message>`` and exits with code 2; the server turns the
same exception into an HTTP 4xx. Never raise these for programming errors.
"""


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
