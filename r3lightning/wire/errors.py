"""Errors of the rollout client and the route wire codec; catch [`RemoteGenerateError`][r3lightning.wire.errors.RemoteGenerateError]
for every failure of a generation request, or a subclass to tell them apart:

    RemoteGenerateError
    ├── RetryableGenerateError     one attempt failed in a way worth retrying (5xx, 429, timeout, ...)
    ├── GenerateRequestError       the server rejected the request (4xx other than 408/429): not retried
    ├── MalformedResponseError     the response breaks the protocol (also a ValueError): not retried
    └── RetriesExhaustedError      every allowed attempt failed; carries the attempts and last error
"""

from __future__ import annotations

__all__ = [
    "GenerateRequestError",
    "MalformedResponseError",
    "RemoteGenerateError",
    "RetriesExhaustedError",
    "RetryableGenerateError",
]


class RemoteGenerateError(Exception):
    """Base class of every error of a remote generation request."""


class RetryableGenerateError(RemoteGenerateError):
    """One attempt failed transiently; ``status``: the HTTP status (None for transport failures),
    ``retry_after``: the seconds the server asked for with ``Retry-After`` (or None)."""

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class GenerateRequestError(RemoteGenerateError):
    """A non-retryable status; ``server_message``: what the server said (truncated)."""

    def __init__(self, status: int, server_message: str, *, url: str | None = None):
        super().__init__(f"HTTP {status}{f' from {url}' if url else ''}: {server_message}")
        self.status = status
        self.server_message = server_message
        self.url = url


class MalformedResponseError(RemoteGenerateError, ValueError):
    """A response breaks the wire format (the message names the field) or is not valid HTTP."""


class RetriesExhaustedError(RemoteGenerateError):
    """Every allowed attempt failed: ``attempts`` made, ``last_error`` the last one's (chained)."""

    def __init__(self, attempts: int, last_error: BaseException, *, url: str | None = None):
        where = f" to {url}" if url else ""
        super().__init__(f"request{where} failed after {attempts} attempt(s); last error: {last_error}")
        self.attempts = attempts
        self.last_error = last_error
        self.url = url
