"""Errors raised by the rollout client and the route wire codec.

Catch :class:`RemoteGenerateError` for every failure of a generation request, or one of its
subclasses to tell them apart:

    RemoteGenerateError
    ├── RetryableGenerateError     one attempt failed in a way worth retrying (5xx, 429, timeout, ...)
    ├── GenerateRequestError       the server rejected the request (4xx other than 408/429): not retried
    ├── MalformedResponseError     the response is not what the protocol promises (also a ValueError)
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
    """One attempt failed transiently: connection refused/reset, timeout, cut-off body, 429 or 5xx.

    ``status`` is the HTTP status (None for transport failures) and ``retry_after`` the delay in
    seconds the server asked for with ``Retry-After`` (None when absent).
    """

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class GenerateRequestError(RemoteGenerateError):
    """The server rejected the request with a non-retryable HTTP status (a 4xx other than 408/429).

    ``status`` is the HTTP status and ``server_message`` what the server said (truncated).
    """

    def __init__(self, status: int, server_message: str, *, url: str | None = None):
        where = f" from {url}" if url else ""
        super().__init__(f"HTTP {status}{where}: {server_message}")
        self.status = status
        self.server_message = server_message
        self.url = url


class MalformedResponseError(RemoteGenerateError, ValueError):
    """A response does not follow the wire format (the message names the offending field) or
    is not valid HTTP at all.

    Also a ``ValueError`` so codec users can catch it without knowing the rollout client.
    Never retried: a server that answers garbage answers it again.
    """


class RetriesExhaustedError(RemoteGenerateError):
    """Every allowed attempt failed with a retryable error.

    ``attempts`` is how many attempts were made and ``last_error`` the error of the last one
    (also chained as ``__cause__``).
    """

    def __init__(self, attempts: int, last_error: BaseException, *, url: str | None = None):
        where = f" to {url}" if url else ""
        super().__init__(f"request{where} failed after {attempts} attempt(s); last error: {last_error}")
        self.attempts = attempts
        self.last_error = last_error
        self.url = url
