"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through :class:`APIError`, so a client sees one shape
for a bad field (400), a bad key (401), an unknown model (404), a body too slow (408), a body
too large (413), a full queue or a shutdown (503) and a failure inside the engine (500).
``type`` uses OpenAI's names.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An HTTP error with an OpenAI error body. ``message`` is one line naming the problem."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON object OpenAI's API returns for an error (``code`` is the HTTP status)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
