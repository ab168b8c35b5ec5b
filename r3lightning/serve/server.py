"""Embedded rollout server: an aiohttp app serving a causal MoE model that returns its routes.

    with RolloutServer() as server:                 # tiny Qwen3-MoE in bf16, ephemeral port
        client = RemoteGenerateClient(server.url)
        ...
        server.update_weights(trainer_model.state_dict())   # stay on-policy

    async with RolloutServer(model, limits=ServerLimits(max_queue=64)) as server: ...

Routes: ``POST /skyrl/v1/generate`` and ``POST /generate`` (sglang), one generation per request
in the formats of :mod:`r3lightning.serve.protocol`, batched by the engine's worker thread (the
event loop only reads and answers; bodies are decoded and checked in one decoder thread, so
large bodies do not stall ``/health``); ``GET /health``: liveness, the route schema and the
``weight_version``, never behind the API key; ``POST /update_weights``: a safetensors body
checked from its header before any data is read, cast into the serving dtype, all or nothing
(:mod:`r3lightning.serve.weights`), one upload at a time (``?strict=true`` also requires every
model tensor).

Limits (:class:`~r3lightning.serve.config.ServerLimits`): header and body read timeouts, a
bounded queue (429 with ``Retry-After``), a cap on ``max_tokens`` under every protocol's name,
body size caps; unknown request or sampling keys are 400. Errors are JSON ``{"error":
{"message", "type", "code"}}``: 400 bad JSON or field (named), 401 wrong bearer token, 404/405,
408 stalled body, 409 concurrent weight upload, 413 body over the cap, 429 queue full, 500 if
generation itself fails; the server keeps serving after any of them. Command line:
:mod:`r3lightning.serve.cli` (``r3lightning-serve``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import orjson
import torch
from aiohttp import web

from r3lightning.serve.config import EngineConfig, ServerLimits
from r3lightning.serve.engine import GenerationEngine
from r3lightning.serve.protocol import (
    RequestFieldError,
    build_response,
    parse_generate_request,
    wants_logprobs,
)
from r3lightning.serve.weights import UploadError, loadable_targets, read_safetensors_upload
from r3lightning.wire.json_body import read_capped
from r3lightning.wire.request import PROTOCOL_PATHS

logger = logging.getLogger(__name__)

# a full-context prompt in JSON: up to 24 bytes per token id plus room for the sampling parameters
_REQUEST_BYTES_PER_TOKEN = 24
_REQUEST_BYTES_SLACK = 64 << 10
_ERROR_TYPES = {
    400: "BadRequest",
    401: "Unauthorized",
    408: "RequestTimeout",
    409: "Conflict",
    413: "PayloadTooLarge",
    429: "TooManyRequests",
    500: "InternalError",
}


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error_response(status: int, message: str, retry_after: int | None = None) -> web.Response:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "HTTPError"), "code": status}
    response = _json_response({"error": error}, status)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (``localhost`` or a loopback IP)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """``ValueError`` for a non-loopback ``host`` without an ``api_key``, unless explicitly allowed."""
    if api_key is None and not allow_unauthenticated and not is_loopback(host):
        raise ValueError(
            f"host {host!r} is reachable from other machines but no api_key is set: anyone could "
            "generate and replace the weights; set an api_key (--api-key), or allow_unauthenticated "
            "(--allow-unauthenticated) to serve without one"
        )


class RolloutServer:
    """Serve ``model`` (default: ``build_tiny_moe(seed=engine.seed)``) over HTTP on ``host:port``.

    ``engine`` (:class:`~r3lightning.serve.config.EngineConfig`) builds the
    :class:`~r3lightning.serve.engine.GenerationEngine`: by default a bf16 private copy, so the
    caller's model is never touched. ``limits``: :class:`~r3lightning.serve.config.ServerLimits`.
    ``port=0`` picks a free port (read :attr:`port` / :attr:`url` once started). ``api_key``:
    every route but ``/health`` then needs ``Authorization: Bearer <api_key>``; a host that is
    not loopback needs one unless ``allow_unauthenticated`` (``ValueError`` otherwise).
    ``model_name``: what responses and ``/health`` call the model.

    Use as ``async with`` inside a running loop, or as a plain ``with`` (the server then runs its
    own event loop in a daemon thread, for synchronous callers such as a Lightning training loop).
    A server runs once: it cannot be restarted after it stops.
    """

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
        engine = EngineConfig() if engine is None else engine
        limits = ServerLimits() if limits is None else limits
        if not isinstance(limits, ServerLimits):
            raise TypeError(f"limits must be a ServerLimits, got {type(limits).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        check_exposure(host, api_key, allow_unauthenticated)
        if model is None:
            from r3lightning.testing.tiny import build_tiny_moe

            model, engine = build_tiny_moe(seed=engine.seed), replace(engine, copy_model=False)
        self.engine = GenerationEngine(model, engine)
        self.model_name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
        self.host, self.port, self.api_key = host, port, api_key
        self._api_key_bytes = None if api_key is None else api_key.encode()
        if limits.max_request_bytes is None:
            needed = _REQUEST_BYTES_SLACK + _REQUEST_BYTES_PER_TOKEN * self.engine.max_context
            limits = replace(limits, max_request_bytes=needed)
        self.limits = limits
        self._generating = 0  # generate requests admitted and not yet answered
        self._uploading = False  # one weight upload at a time
        # One thread decodes generate bodies: decoding holds the GIL, and a single decoder leaves
        # the event loop as the only other contender, so /health waits for at most one decode.
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="r3-request-decoder")
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._started = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

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

    # ------------------------------------------------------------------ app

    def make_app(self) -> web.Application:
        """The aiohttp application (routes + error/auth middleware), unstarted."""
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post(PROTOCOL_PATHS["skyrl"], self._skyrl_generate)
        app.router.add_post(PROTOCOL_PATHS["sglang"], self._sglang_generate)
        app.router.add_get("/health", self._health)
        app.router.add_post("/update_weights", self._update_weights)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        if self._api_key_bytes is not None and request.path != "/health":
            # aiohttp decodes header bytes as UTF-8 with surrogateescape: encoding back the same
            # way gives the bytes sent, so a non-UTF-8 header is just a wrong token
            header = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token, self._api_key_bytes):
                return _error_response(401, "missing or wrong bearer token in the Authorization header")
        try:
            return await handler(request)
        except _HTTPError as exc:
            return _error_response(exc.status, exc.message, exc.retry_after)
        except web.HTTPException as exc:
            return _error_response(exc.status, exc.reason)
        except Exception as exc:
            logger.exception("request %s %s failed", request.method, request.path)
            return _error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    async def _body_chunks(self, request: web.Request) -> AsyncIterator[bytes]:
        """The body as it arrives; 408 when no byte comes for ``body_timeout_s``."""
        while True:
            try:
                async with asyncio.timeout(self.limits.body_timeout_s):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise _HTTPError(
                    408,
                    f"request body stalled: no data for {self.limits.body_timeout_s:g} s (body_timeout_s)",
                ) from None
            if not chunk:
                return
            yield chunk

    async def _read_body(self, request: web.Request, cap: int) -> bytes:
        """The request body, refusing (413) more than ``cap`` bytes before reading past it."""

        def too_large(declared: int | None) -> _HTTPError:
            of = "" if declared is None else f" of {declared} bytes"
            return _HTTPError(413, f"request body{of} exceeds the cap of {cap} bytes")

        return await read_capped(self._body_chunks(request), request.content_length, cap, too_large)

    def _admit(self, raw: bytes, protocol: str):
        """Decode, validate and queue one generate body (runs in a worker thread: the prompt check
        is a Python pass over its ids). Returns the engine's future and whether logprobs are wanted."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _HTTPError(400, f"request body is not valid JSON: {exc}") from None
        prompt_field = "token_ids" if protocol == "skyrl" else "input_ids"
        try:
            gen_request = parse_generate_request(
                body,
                protocol,
                max_prompt_tokens=self.engine.max_context - 1,
                max_new_tokens_cap=self.limits.max_new_tokens_cap,
            )
            logprobs = wants_logprobs(body, protocol)
            future = self.engine.submit(gen_request, prompt_field=prompt_field)  # validates first
        except (RequestFieldError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from None
        return future, logprobs

    async def _generate(self, request: web.Request, protocol: str) -> web.Response:
        if self._generating >= self.engine.max_batch_size + self.limits.max_queue:
            raise _HTTPError(
                429,
                f"the server is busy: {self._generating} generate requests in flight "
                f"(max_batch_size {self.engine.max_batch_size} + max_queue {self.limits.max_queue})",
                retry_after=self.limits.retry_after_s,
            )
        self._generating += 1
        try:
            raw = await self._read_body(request, self.limits.max_request_bytes)
            loop = asyncio.get_running_loop()
            future, logprobs = await loop.run_in_executor(self._decoder, self._admit, raw, protocol)
            del raw
            output = await asyncio.wrap_future(future)
        finally:
            self._generating -= 1
        request_id = request.headers.get("X-Session-ID") or f"gen-{next(self._ids)}"
        payload = build_response(
            output, protocol, request_id=request_id, model_name=self.model_name, logprobs=logprobs
        )
        return _json_response(payload)

    async def _skyrl_generate(self, request: web.Request) -> web.Response:
        return await self._generate(request, "skyrl")

    async def _sglang_generate(self, request: web.Request) -> web.Response:
        return await self._generate(request, "sglang")

    async def _health(self, request: web.Request) -> web.Response:
        engine = self.engine
        return _json_response(
            {
                "status": "ok",
                "model": self.model_name,
                "num_layers": engine.num_layers,
                "top_k": engine.top_k,
                "num_experts": engine.num_experts,
                "vocab_size": engine.vocab_size,
                "max_context": engine.max_context,
                "weight_version": engine.weight_version,
            }
        )

    async def _update_weights(self, request: web.Request) -> web.Response:
        strict_arg = request.query.get("strict", "false").lower()
        if strict_arg not in ("true", "false", "1", "0"):
            raise _HTTPError(400, f"query parameter strict must be true or false, got {strict_arg!r}")
        if self._uploading:
            raise _HTTPError(409, "another weight upload is in progress; send one at a time")
        self._uploading = True
        try:
            cap = self.limits.max_weights_bytes
            if request.content_length is not None and request.content_length > cap:
                raise _HTTPError(
                    413, f"request body of {request.content_length} bytes exceeds the cap of {cap} bytes"
                )
            strict = strict_arg in ("true", "1")
            try:
                state_dict = await read_safetensors_upload(
                    self._body_chunks(request),
                    content_length=request.content_length,
                    max_bytes=cap,
                    targets=loadable_targets(self.engine.model),
                    strict=strict,
                    too_large=lambda size: UploadError(
                        f"safetensors body of {size} bytes exceeds the cap of {cap} bytes", status=413
                    ),
                )
                updated = await asyncio.to_thread(self.engine.update_weights, state_dict, strict=strict)
            except UploadError as exc:
                raise _HTTPError(exc.status, str(exc)) from None
            except ValueError as exc:
                raise _HTTPError(400, str(exc)) from None
        finally:
            self._uploading = False
        return _json_response({"updated": updated, "weight_version": self.engine.weight_version})

    # ------------------------------------------------------------------ weights (in process)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = False) -> int:
        """Copy ``state_dict`` (e.g. fp32 training weights) into the serving model; returns the count.

        Thread-safe and blocking: waits for the running batch, never lands mid-generation.
        From a coroutine on the server's loop use ``await asyncio.to_thread(server.update_weights, sd)``.
        """
        return self.engine.update_weights(state_dict, strict=strict)

    # ------------------------------------------------------------------ lifecycle (async)

    async def start(self) -> RolloutServer:
        """Bind and start serving on the running loop; :attr:`port` holds the bound port after."""
        if self._started:
            raise RuntimeError("a RolloutServer runs once; create a new one")
        self._started = True
        # aiohttp closes a connection whose request head is incomplete (or that idles between
        # requests) after keepalive_timeout: that is the header read timeout
        runner = web.AppRunner(
            self.make_app(), access_log=None, keepalive_timeout=self.limits.header_timeout_s
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        logger.info("rollout server listening on %s", self.url)
        return self

    async def stop(self) -> None:
        """Stop accepting requests, finish the queued generations, release the port."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await asyncio.to_thread(self._decoder.shutdown)
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> RolloutServer:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    # ------------------------------------------------------------------ lifecycle (sync)

    def __enter__(self) -> RolloutServer:
        """Run the server on its own event loop in a daemon thread; returns once it is bound."""
        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="r3-rollout-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = self._loop = None


if __name__ == "__main__":  # python -m r3lightning.serve.server: the r3lightning-serve command
    from r3lightning.serve.cli import main

    raise SystemExit(main())
