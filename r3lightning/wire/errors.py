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
    """Base class of every error of a remote generation request.

    Raised (as one of its subclasses) by `RemoteGenerateClient.generate` and the route decoders;
    ``except RemoteGenerateError`` catches every failure of one request.
    """


class RetryableGenerateError(RemoteGenerateError):
    """One attempt failed transiently: a 5xx, 408 or 429 status, a timeout or a broken connection.

    Raised inside the client's retry loop and retried with backoff; it reaches a caller only as
    the ``last_error`` of a `RetriesExhaustedError` (at once for the health watch's
    ``EngineHungError``, a subclass).

    Args:
        message: What failed.
        status: The HTTP status, or None for a transport failure.
        retry_after: The seconds the server asked for with ``Retry-After``, or None.

    Attributes:
        status: As given.
        retry_after: As given.
    """

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class GenerateRequestError(RemoteGenerateError):
    """The server rejected the request with a status that retrying cannot fix (a 4xx other than
    408 and 429): raised at once, never retried.

    Args:
        status: The HTTP status.
        server_message: What the server said, truncated.
        url: The request's URL, named in the message when given.

    Attributes:
        status, server_message, url: As given.
    """

    def __init__(self, status: int, server_message: str, *, url: str | None = None):
        super().__init__(f"HTTP {status}{f' from {url}' if url else ''}: {server_message}")
        self.status = status
        self.server_message = server_message
        self.url = url


class MalformedResponseError(RemoteGenerateError, ValueError):
    """A response breaks the wire protocol or is not valid HTTP: never retried.

    Raised by the response parser and the route decoders; the message names the offending field
    (``choices[0].routed_experts.shape: ...``) and, from the client, the engine's URL. Also a
    ``ValueError``, so code that validates with ``except ValueError`` catches it.
    """


class RetriesExhaustedError(RemoteGenerateError):
    """Every allowed attempt of a request failed with a retryable error (see `RetryPolicy`).

    Args:
        attempts: How many attempts were made.
        last_error: The last attempt's error; also chained as ``__cause__`` by the client.
        url: The request's URL, named in the message when given.

    Attributes:
        attempts, last_error, url: As given.
    """

    def __init__(self, attempts: int, last_error: BaseException, *, url: str | None = None):
        where = f" to {url}" if url else ""
        super().__init__(f"request{where} failed after {attempts} attempt(s); last error: {last_error}")
        self.attempts = attempts
        self.last_error = last_error
        self.url = url
