"""Embedded rollout server: an aiohttp app serving a causal MoE model that returns its routes
(routes, limits and error statuses: docs/protocols.md, "The embedded server")."""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import orjson
import torch
from aiohttp import web

from r3lightning._keywords import refuse_moved_keywords
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.engine import GenerationEngine
from r3lightning.app.serve.exposure import check_exposure, is_loopback
from r3lightning.app.serve.protocol import (
    PROMPT_FIELDS,
    PROTOCOLS,
    build_response,
    parse_generate_request,
    wants_logprobs,
)
from r3lightning.app.serve.weights import check_weights, loadable_targets
from r3lightning.wire.json_body import read_capped
from r3lightning.wire.request import PROTOCOL_PATHS
from r3lightning.wire.safetensors import read_safetensors

__all__ = ["RolloutServer", "check_exposure", "is_loopback"]  # the last two: from exposure.py

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequest", 401: "Unauthorized", 408: "RequestTimeout", 409: "Conflict"}
_ERROR_TYPES |= {413: "PayloadTooLarge", 429: "TooManyRequests", 500: "InternalError"}


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after

    def response(self) -> web.Response:
        kind = _ERROR_TYPES.get(self.status, "HTTPError")
        error = {"message": self.message, "type": kind, "code": self.status}
        headers = None if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return _json_response({"error": error}, self.status, headers)


def _json_response(payload: object, status: int = 200, headers: dict | None = None) -> web.Response:
    body = orjson.dumps(payload)
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def _too_large(cap: int, declared: int | None) -> _HTTPError:
    of = "" if declared is None else f" of {declared} bytes"
    return _HTTPError(413, f"request body{of} exceeds the cap of {cap} bytes")


# 0.1 keywords -> the settings object that holds them in 0.2
_ENGINE_KEYWORDS = ("max_batch_size", "seed", "dtype", "device", "copy_model", "batch_invariant")
_ENGINE_KEYWORDS += ("simulated_disagreement",)
_LIMIT_KEYWORDS = ("max_queue", "max_new_tokens_cap", "max_request_bytes", "max_weights_bytes")
_LIMIT_KEYWORDS += ("header_timeout_s", "body_timeout_s", "retry_after_s")
_SERVER_MOVED = {name: f"engine=EngineConfig({name}=)" for name in _ENGINE_KEYWORDS}
_SERVER_MOVED |= {name: f"limits=ServerLimits({name}=)" for name in _LIMIT_KEYWORDS}


class RolloutServer:
    """Serve ``model`` over HTTP with the ``skyrl`` and ``sglang`` generate protocols, ``/health``,
    ``/update_weights``, ``/pause`` and ``/resume`` (docs/protocols.md). Use as ``async with`` in a
    running loop, or as ``with`` (its own loop in a daemon thread); it runs once.

    Args:
        model: the Hugging Face causal MoE LM to serve (None: the tiny MoE of ``engine.seed``).
        engine: how the model is served: device, dtype, batching, seed (`EngineConfig()` if None).
        limits: the request limits: queue, token cap, body sizes and timeouts (`ServerLimits()`
            if None; ``max_request_bytes=None`` becomes 64 KiB plus 24 bytes per context token).
        host: the address to bind; a non-loopback one needs ``api_key`` or
            ``allow_unauthenticated``.
        port: the port to bind (0: a free one, in `port` once started).
        api_key: the bearer token every route but ``/health`` requires (None: no authentication).
        allow_unauthenticated: serve a non-loopback ``host`` without ``api_key``.
        model_name: what responses call the model (default: its ``name_or_path``, else its class).

    Raises:
        TypeError: ``limits`` is not a `ServerLimits`, or a 0.1 keyword (named with its
            replacement) is given.
        ValueError: a bad ``port``, an empty or blank ``api_key``, an exposed host without a key,
            or a model the engine cannot serve.
    """

    @refuse_moved_keywords(_SERVER_MOVED)
    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        engine: EngineConfig | None = None,
        limits: ServerLimits | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        allow_unauthenticated: bool = False,
        model_name: str | None = None,
    ) -> None:
        engine = engine or EngineConfig()
        limits = limits or ServerLimits()
        if not isinstance(limits, ServerLimits):
            raise TypeError(f"limits must be a ServerLimits, got {type(limits).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        check_exposure(host, api_key, allow_unauthenticated)
        if model is None:
            from r3lightning.app.models.tiny import build_tiny_moe

            model = build_tiny_moe(seed=engine.seed)
            engine = replace(engine, copy_model=False)  # the model is the server's own: no copy
        self.engine = GenerationEngine(model, engine)
        self.model_name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
        self.host = host
        self.port = port
        self.api_key = api_key
        self._api_key_bytes = None if api_key is None else api_key.encode()
        if limits.max_request_bytes is None:  # a full-context prompt: 24 bytes a token id + 64 KiB
            limits = replace(limits, max_request_bytes=(64 << 10) + 24 * self.engine.max_context)
        self.limits = limits
        self._generating = 0  # generate requests admitted and not yet answered
        self._uploading = False  # one weight upload at a time
        # One thread decodes generate bodies: decoding holds the GIL, and a single decoder leaves
        # the event loop as the only other contender, so /health waits for at most one decode.
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="r3-request-decoder")
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None  # and its thread, under ``with``
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if self._runner is None:
            raise RuntimeError("the server is not running")
        return f"http://{self.host}:{self.port}"

    @property
    def weight_version(self) -> int:
        """How many weight updates the serving model has received (0 = the initial weights)."""
        return self.engine.weight_version

    def make_app(self) -> web.Application:
        """The aiohttp application (routes + error/auth middleware), unstarted."""
        app = web.Application(middlewares=[self._middleware])
        for name in PROTOCOLS:
            app.router.add_post(PROTOCOL_PATHS[name], functools.partial(self._generate, protocol=name))
        app.router.add_get("/health", self._health)
        app.router.add_post("/update_weights", self._update_weights)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self._api_key_bytes is not None and request.path != "/health":
            # aiohttp decodes header bytes as UTF-8 with surrogateescape: encoding back the same
            # way gives the bytes sent, so a non-UTF-8 header is just a wrong token
            header = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            scheme, _, token = header.partition(b" ")
            wrong = not token.strip() or not hmac.compare_digest(token, self._api_key_bytes)
            if scheme.lower() != b"bearer" or wrong:  # an empty token never matches, whatever the key
                return _HTTPError(401, "missing or wrong bearer token in the Authorization header").response()
        try:
            return await handler(request)
        except _HTTPError as exc:
            return exc.response()
        except web.HTTPException as exc:
            return _HTTPError(exc.status, exc.reason).response()
        except Exception as exc:
            logger.exception("request %s %s failed", request.method, request.path)
            return _HTTPError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    async def _body_chunks(self, request: web.Request) -> AsyncIterator[bytes]:
        """The body as it arrives; 408 when no byte comes for ``body_timeout_s``, or when the body
        falls behind ``min_body_rate`` after its first ``body_timeout_s`` (a trickling client)."""
        wait = self.limits.body_timeout_s
        rate = self.limits.min_body_rate
        loop = asyncio.get_running_loop()
        start = loop.time()
        received = 0
        while True:
            # the time by which more than ``received`` bytes must have come
            behind = start + wait + received / rate - loop.time()
            try:
                async with asyncio.timeout(min(wait, max(behind, 0.0))):
                    chunk = await request.content.readany()
            except TimeoutError:
                if behind >= wait:
                    raise _HTTPError(
                        408, f"request body stalled: no data for {wait:g} s (body_timeout_s)"
                    ) from None
                took = loop.time() - start
                raise _HTTPError(
                    408,
                    f"request body too slow: {received} bytes in {took:.1f} s, below min_body_rate "
                    f"({rate} bytes/s after the first {wait:g} s, body_timeout_s)",
                ) from None
            if not chunk:
                return
            received += len(chunk)
            yield chunk

    def _admit(self, raw: bytes, protocol: str):
        """Decode, check and queue one generate body: the engine's future, whether logprobs are wanted."""
        caps = {"max_prompt_tokens": self.engine.max_context - 1}
        caps["max_new_tokens_cap"] = self.limits.max_new_tokens_cap
        try:
            body = orjson.loads(raw)
            request = parse_generate_request(body, protocol, **caps)
            logprobs = wants_logprobs(body, protocol)
            return self.engine.submit(request, prompt_field=PROMPT_FIELDS[protocol]), logprobs
        except orjson.JSONDecodeError as exc:
            raise _HTTPError(400, f"request body is not valid JSON: {exc}") from None
        except ValueError as exc:  # RequestFieldError, or the engine's check naming the field
            raise _HTTPError(400, str(exc)) from None

    async def _generate(self, request: web.Request, protocol: str) -> web.Response:
        batch = self.engine.config.max_batch_size
        queued = self.limits.max_queue
        if self._generating >= batch + queued:
            busy = f"{self._generating} generate requests in flight (max_batch_size {batch} + max_queue {queued})"
            raise _HTTPError(429, f"the server is busy: {busy}", retry_after=self.limits.retry_after_s)
        self._generating += 1
        try:
            cap = self.limits.max_request_bytes
            too_large = functools.partial(_too_large, cap)
            raw = await read_capped(self._body_chunks(request), request.content_length, cap, too_large)
            loop = asyncio.get_running_loop()
            future, logprobs = await loop.run_in_executor(self._decoder, self._admit, raw, protocol)
            del raw  # the body is not kept while the request waits for its batch
            output = await asyncio.wrap_future(future)
        finally:
            self._generating -= 1
        request_id = request.headers.get("X-Session-ID") or f"gen-{next(self._ids)}"
        names = {"request_id": request_id, "model_name": self.model_name}
        return _json_response(build_response(output, protocol, **names, logprobs=logprobs))

    async def _health(self, request: web.Request) -> web.Response:
        if self.engine.worker_died:  # answering 200 would send requests to a server that never answers
            raise _HTTPError(503, "the generation thread has died; restart the server")
        fields = ("num_layers", "top_k", "num_experts", "vocab_size", "max_context", "weight_version")
        health = {name: getattr(self.engine, name) for name in fields}
        return _json_response({"status": "ok", "model": self.model_name} | health)

    async def _pause(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(self.engine.pause)  # returns once the running batch is done
        return _json_response({"paused": True, "weight_version": self.engine.weight_version})

    async def _resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return _json_response({"paused": False, "weight_version": self.engine.weight_version})

    async def _update_weights(self, request: web.Request) -> web.Response:
        strict_arg = request.query.get("strict", "false").lower()
        if strict_arg not in ("true", "1", "false", "0"):
            raise _HTTPError(400, f"query parameter strict must be true or false, got {strict_arg!r}")
        version = request.query.get("weight_version")
        if version is not None and not (version.isascii() and version.isdecimal()):
            raise _HTTPError(400, f"query parameter weight_version must be an integer >= 0, got {version!r}")
        version = None if version is None else int(version)
        if self._uploading:
            raise _HTTPError(409, "another weight upload is in progress; send one at a time")
        strict = strict_arg in ("true", "1")
        cap = self.limits.max_weights_bytes
        length = request.content_length
        if length is not None and length > cap:
            raise _too_large(cap, length)
        self._uploading = True
        try:
            targets = loadable_targets(self.engine.model)
            check = functools.partial(check_weights, targets, strict=strict, where="upload")
            body = self._body_chunks(request)
            state_dict = await read_safetensors(body, content_length=length, max_bytes=cap, check=check)
            update = functools.partial(self.engine.update_weights, strict=strict, version=version)
            updated = await asyncio.to_thread(update, state_dict)
        except ValueError as exc:  # UploadError (400 or 413) or the engine's checks
            raise _HTTPError(getattr(exc, "status", 400), str(exc)) from None
        finally:
            self._uploading = False
        return _json_response({"updated": updated, "weight_version": self.engine.weight_version})

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        strict: bool = False,
        weight_version: int | None = None,
    ) -> int:
        """Load weights in process: `GenerationEngine.update_weights` between the engine's pause
        and resume, so no batch starts during the copy. Blocking: on the server's own event loop,
        call it through ``asyncio.to_thread``.

        Args:
            state_dict: parameter or persistent buffer name -> its new value.
            strict: every parameter and persistent buffer must be given.
            weight_version: what ``/health`` and the answers report from now on (the trainer's
                policy version); None adds one.

        Returns:
            How many tensors were copied.

        Raises:
            ValueError: the engine's checks refuse the upload; nothing is copied then.
        """
        self.engine.pause()
        try:
            return self.engine.update_weights(state_dict, strict=strict, version=weight_version)
        finally:
            self.engine.resume()

    async def start(self) -> RolloutServer:
        """Bind and serve on the running loop; `port` is the bound port after."""
        if self._started:
            raise RuntimeError("a RolloutServer runs once; create a new one")
        self._started = True
        # aiohttp closes a connection whose request head is incomplete (or that idles between
        # requests) after keepalive_timeout: that is the header read timeout
        timeout = self.limits.header_timeout_s
        runner = web.AppRunner(self.make_app(), access_log=None, keepalive_timeout=timeout)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        logger.info("rollout server listening on %s", self.url)
        return self

    async def stop(self) -> None:
        """Stop accepting requests, finish the queued generations, release the port."""
        runner = self._runner
        self._runner = None
        if runner is not None:
            await runner.cleanup()
        await asyncio.to_thread(self._decoder.shutdown)
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> RolloutServer:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    def __enter__(self) -> RolloutServer:
        """Serve from a daemon thread's own event loop; returns once bound."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="r3-rollout-server", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), self._loop).result()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._thread = self._loop = None
