"""The error a request can get: an HTTP status and an OpenAI-style error type with the usual message."""

from __future__ import annotations

from tuneport.convert.errors import UserError


class ApiError(UserError):
    """A request that cannot be served: the gateway answers ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, hint: str = "", status: int = 400, kind: str | None = None) -> None:
        super().__init__(message, hint)
        self.status = status
        self.kind = kind or ("upstream_error" if status >= 500 else "invalid_request_error")
