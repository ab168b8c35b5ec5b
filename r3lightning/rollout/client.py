"""Async HTTP client for generation requests, with routed experts, against one rollout engine:
transient failures are retried per [`RetryPolicy`][r3lightning.rollout.config.RetryPolicy], other 4xx and malformed bodies raise."""

from __future__ import annotations

import asyncio
import email.utils
import functools
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from r3lightning._keywords import refuse_moved_keywords
from r3lightning.checks import check_api_key, check_setting
from r3lightning.rollout.config import Backoff, RetryPolicy, route_schema
from r3lightning.rollout.health import EngineHungError, HealthWatch
from r3lightning.rollout.prompts import token_id_list
from r3lightning.wire.errors import (
    GenerateRequestError,
    MalformedResponseError,
    RetriesExhaustedError,
    RetryableGenerateError,
)
from r3lightning.wire.json_body import read_capped
from r3lightning.wire.request import ENGINES, PROTOCOL_PATHS, RemoteGenerateResult, RouteSchema, build_request
from r3lightning.wire.response import parse_response

__all__ = ["Backoff", "ClientStats", "RemoteGenerateClient", "RemoteGenerateResult", "RetryPolicy"]

_RETRY_STATUSES = frozenset({408, 429})  # plus every 5xx
_MAX_ERROR_TEXT = 2048


@dataclass
class ClientStats:
    """Counters since the client was built (carried over by pickling)."""

    requests: int = 0  # generate() calls
    attempts: int = 0  # HTTP attempts, first tries included
    retries: int = 0  # attempts after a retryable failure
    failures: int = 0  # generate() calls that raised


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent/bad."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _server_message(text: str) -> str:
    """The human part of an error body: ``error.message``, ``error``, ``detail``, ``message``, or the text."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        body = None
    body = body if isinstance(body, dict) else {}
    error = body.get("error")
    error = error.get("message") if isinstance(error, dict) else error
    candidates = (error, body.get("detail"), body.get("message"))
    return next((c for c in candidates if isinstance(c, str)), text.strip())[:_MAX_ERROR_TEXT]


# 0.1 keywords -> where they went in 0.2
_SCHEMA = "schema=RouteSchema({}=) (r3lightning.wire.request)"
_RETRY = "retry=RetryPolicy({}=)"
_CLIENT_MOVED = {name: _SCHEMA.format(name) for name in ("num_layers", "top_k", "num_experts")}
_CLIENT_MOVED |= {
    "max_route_bytes": _SCHEMA.format("max_bytes"),
    "check_unique_experts": _SCHEMA.format("check_unique"),
}
_CLIENT_MOVED |= {
    name: _RETRY.format(name)
    for name in ("max_attempts", "backoff", "timeout_s", "connect_timeout_s", "health_timeout_s")
}
_CLIENT_MOVED |= {
    name: f"the class attribute RemoteGenerateClient.{name}"
    for name in ("max_connections", "decode_in_thread_bytes")
}


class RemoteGenerateClient:
    """Client for one rollout engine: generate requests with routes, retries and health probes.

    Shared by the tasks of one event loop at a time (a second, running loop raises
    ``RuntimeError``; give each thread its own, e.g. a pickled copy, as pickling drops the aiohttp
    session). Set `max_connections` and `decode_in_thread_bytes` before the first
    request. Routes are decoded on the host into a compact integer dtype; no device work.

    Args:
        base_url: The engine's ``http://`` or ``https://`` URL.
        protocol: The wire protocol (``skyrl``, ``vllm``, ``sglang`` or ``openai``; the protocols page).
        schema: A ``RouteSchema`` or the model's config: how routes are checked and cut
            (``layers``); SGLang needs ``num_layers`` and ``top_k``. None: routes unchecked.
        retry: Attempts, backoff, timeouts and health probing (default: ``RetryPolicy()``).
        api_key: Sent as a bearer token.
        model: The model name of ``openai`` requests.
        engine: Which engine's route fields an ``openai`` response carries (``vllm`` or ``sglang``).
        max_response_bytes: Larger response bodies are refused while they stream.

    Raises:
        ValueError: An unknown protocol or engine, a URL without a scheme, or a bad size.
        TypeError: ``retry`` is not a ``RetryPolicy``, or a keyword of 0.1 (named with its
            replacement).
    """

    max_connections: int = 256
    decode_in_thread_bytes: int = 1 << 20  # larger bodies are parsed off the event loop

    @refuse_moved_keywords(_CLIENT_MOVED)
    def __init__(
        self,
        base_url: str,
        *,
        protocol: Literal["skyrl", "vllm", "sglang", "openai"] = "skyrl",
        schema: RouteSchema | Any = None,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        model: str | None = None,
        engine: Literal["vllm", "sglang"] | None = None,
        max_response_bytes: int = 2 << 30,
    ):
        if protocol not in PROTOCOL_PATHS:
            raise ValueError(f"protocol must be one of {sorted(PROTOCOL_PATHS)}, got {protocol!r}")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be a URL starting with http:// or https://, got {base_url!r}")
        if engine is not None and (protocol != "openai" or engine not in ENGINES):
            raise ValueError(
                f"engine must be None or one of {list(ENGINES)} with protocol='openai', "
                f"got engine={engine!r} with protocol={protocol!r}"
            )
        check_setting("max_response_bytes", max_response_bytes, low=1, integer=True)
        check_api_key(api_key)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        self.base_url = base_url.rstrip("/")
        self.protocol = protocol
        self.model = model
        self.api_key = api_key
        self.engine = engine
        self.retry = retry if retry is not None else RetryPolicy()
        self.max_response_bytes = max_response_bytes
        self.routes = RouteSchema() if schema is None else route_schema(schema)
        self.stats = ClientStats()
        self._rng = random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: str | None = None  # name of the thread whose loop owns the session
        self._watch = HealthWatch(self._probe, self.retry)

    def _session_for_running_loop(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._loop is not None and self._loop.is_running() and not self._session.closed:
                raise RuntimeError(
                    f"this RemoteGenerateClient is in use by another event loop (thread "
                    f"{self._thread!r}) and was now called from thread "
                    f"{threading.current_thread().name!r}: a client serves one event loop at a "
                    "time; give each thread its own client (pickle.loads(pickle.dumps(client)) "
                    "copies one), or await client.close() on the first loop before switching"
                )
            self._abandon_session()
            # one connection beyond the requests' slots, so a health probe never waits for one
            connector = aiohttp.TCPConnector(limit=self.max_connections + 1)
            self._session = aiohttp.ClientSession(connector=connector)
            self._slots = asyncio.Semaphore(self.max_connections)
            self._loop = loop
            self._thread = threading.current_thread().name
        return self._session, self._slots

    def _abandon_session(self) -> None:
        """Let go of a session bound to another event loop: a running one closes it; a stopped one's
        sockets cannot be closed from here (close the client before its loop ends)."""
        session = self._session
        loop = self._loop
        self._session = None
        self._slots = None
        self._loop = None
        self._watch.reset()
        if session is None or session.closed or loop is None:
            return
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(session.close(), loop)
        else:
            session.detach()

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one)."""
        if self._session is not None and self._loop is asyncio.get_running_loop():
            session = self._session
            self._session = None
            self._slots = None
            self._loop = None
            self._watch.cancel()
            await session.close()
        else:
            self._abandon_session()

    async def __aenter__(self) -> RemoteGenerateClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | dict.fromkeys(("_session", "_slots", "_loop", "_thread", "_watch"))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watch = HealthWatch(self._probe, self.retry)

    def __repr__(self) -> str:
        return f"RemoteGenerateClient({self.base_url!r}, protocol={self.protocol!r}, stats={self.stats})"

    def _headers(self, session_id: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if session_id is not None:
            headers["X-Session-ID"] = str(session_id)
        return headers

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RemoteGenerateResult:
        """Generate a continuation of ``prompt_token_ids``, retrying transient failures per ``retry``.

        The body is built and parsed on the host (large bodies off the event loop); routes stay host
        arrays in a compact dtype. Call from the event loop that owns the client.

        Args:
            prompt_token_ids: The prompt's ids (a sequence, ndarray or tensor of ints >= 0).
            sampling_params: Passed as given (`SamplingConfig.wire_params` spells them per protocol).
            return_routed_experts: Ask for routes: exactly ``P - start + G - 1`` rows from token
                ``start = routed_experts_prompt_start`` on, else a `MalformedResponseError` (absent rows
                name the engine flag ``--enable-return-routed-experts``).
            routed_experts_prompt_start: The first prompt token whose row is wanted (a multi-turn
                trace's ``prompt_start``); at most the prompt length.
            session_id: Sent as the ``X-Session-ID`` header.
            cache_salt: Sent as ``cache_salt``, the engine's prefix-cache salt.

        Returns:
            The parsed result, with ``attempts`` set.

        Raises:
            ValueError: A bad prompt or start, or SGLang routes without ``num_layers`` and ``top_k``.
            GenerateRequestError: The engine rejected the request (4xx other than 408 / 429).
            MalformedResponseError: The response breaks the protocol or the route rules.
            RetriesExhaustedError: Every attempt failed transiently (or the engine hung).
            RuntimeError: Another running event loop owns the client.
        """
        sglang = "sglang" in (self.protocol, self.engine)
        if return_routed_experts and sglang and None in (self.routes.num_layers, self.routes.top_k):
            raise ValueError("SGLang's flat routes need num_layers and top_k to be reshaped")
        start = routed_experts_prompt_start
        check_setting("routed_experts_prompt_start", start, low=0, integer=True, optional=True)
        prompt_ids = token_id_list(prompt_token_ids, "prompt_token_ids")
        if start is not None and start > len(prompt_ids):
            raise ValueError(  # an engine answers 400 (or fewer rows than asked); fail before sending
                f"routed_experts_prompt_start must be <= the prompt length {len(prompt_ids)}, got {start}"
            )
        body = build_request(
            self.protocol,
            prompt_ids,
            dict(sampling_params or {}),
            model=self.model,
            return_routed_experts=return_routed_experts,
            routed_experts_prompt_start=start,
            cache_salt=cache_salt,
            engine=self.engine,
        )
        self._session_for_running_loop()  # another loop's client: raise before touching stats
        url = f"{self.base_url}{PROTOCOL_PATHS[self.protocol]}"
        data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        self.stats.requests += 1
        try:
            raw, attempts = await self._send(url, data, self._headers(session_id))
            parse = functools.partial(
                parse_response,
                raw,
                self.protocol,
                self.routes,
                want_routes=return_routed_experts,
                prompt_len=len(prompt_ids),
                start=start or 0,
                url=url,
            )
            result = await asyncio.to_thread(parse) if len(raw) > self.decode_in_thread_bytes else parse()
        except Exception:
            self.stats.failures += 1
            raise
        result.attempts = attempts
        return result

    async def health(self) -> bool:
        """Whether ``GET /health`` answers 200 within ``retry.health_timeout_s`` (one attempt;
        raises only ``RuntimeError`` for use from a second event loop)."""
        return await self._probe() == 200

    async def _probe(self) -> int | None:
        """The status ``GET /health`` answers within ``retry.health_timeout_s``; None if none."""
        session, _ = self._session_for_running_loop()
        url = f"{self.base_url}/health"
        timeout = aiohttp.ClientTimeout(total=self.retry.health_timeout_s)
        try:
            async with session.get(url, headers=self._headers(None), timeout=timeout) as answer:
                await answer.read()
                return answer.status
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def _send(self, url: str, data: bytes, headers: dict[str, str]) -> tuple[bytes, int]:
        """POST with retries, under the health watch; the body of the 2xx answer and the attempts."""
        retry = self.retry
        for attempt in range(1, retry.max_attempts + 1):
            self.stats.attempts += 1
            try:
                session, slots = self._session_for_running_loop()
                async with slots:  # waiting for a free connection does not eat into timeout_s
                    return await self._watch.run(self._attempt(session, url, data, headers)), attempt
            except RetryableGenerateError as error:
                if attempt == retry.max_attempts or isinstance(error, EngineHungError):
                    raise RetriesExhaustedError(attempt, error, url=url) from error
                self.stats.retries += 1
                if error.retry_after is not None:
                    delay = min(error.retry_after, retry.backoff.max_retry_after_s)
                else:
                    delay = retry.backoff.delay(attempt, self._rng)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(
        self, session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str]
    ) -> bytes:
        """One HTTP attempt -> the body of a 2xx answer; transient failures -> RetryableGenerateError."""
        timeout = aiohttp.ClientTimeout(total=self.retry.timeout_s, sock_connect=self.retry.connect_timeout_s)
        try:
            async with session.post(url, data=data, headers=headers, timeout=timeout) as response:
                if response.status >= 400:
                    text = (await response.content.read(_MAX_ERROR_TEXT)).decode("utf-8", "replace")
                    message = _server_message(text)
                    if response.status in _RETRY_STATUSES or response.status >= 500:
                        raise RetryableGenerateError(
                            f"HTTP {response.status} from {url}: {message}",
                            status=response.status,
                            retry_after=_retry_after(response.headers.get("Retry-After")),
                        )
                    raise GenerateRequestError(response.status, message, url=url)
                cap = self.max_response_bytes

                def too_large(declared: int | None) -> MalformedResponseError:
                    of = "" if declared is None else f" of {declared} bytes"
                    return MalformedResponseError(f"response body{of} exceeds max_response_bytes={cap}")

                return await read_capped(response.content.iter_any(), response.content_length, cap, too_large)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
            raise RetryableGenerateError(f"POST {url} {kind}: {type(exc).__name__}: {exc}") from exc
        except aiohttp.ClientResponseError as exc:
            # aiohttp could not parse the status line or headers: garbage, like a malformed body
            raise MalformedResponseError(
                f"POST {url}: the answer is not a valid HTTP response ({exc.message})"
            ) from exc
