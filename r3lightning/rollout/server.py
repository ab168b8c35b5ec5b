"""Embedded rollout server: an aiohttp app serving a causal MoE model that returns its routes.

    with RolloutServer() as server:                 # tiny Qwen3-MoE in bf16, ephemeral port
        client = RemoteGenerateClient(server.url)
        ...
        server.update_weights(trainer_model.state_dict())   # stay on-policy

    async with RolloutServer(model, port=0) as server: ...  # inside a running event loop

Routes (JSON bodies unless noted):

- ``POST /skyrl/v1/generate`` and ``POST /generate`` (sglang): one generation per request, in the
  formats of :mod:`r3lightning.rollout.server_protocol`; concurrent requests are batched by the
  :class:`~r3lightning.rollout.engine.GenerationEngine` worker thread, so the event loop only
  parses, validates and serialises.
- ``GET /health``: liveness plus the route schema (``num_layers``, ``top_k``, ``num_experts``)
  and the ``weight_version``; never needs the API key.
- ``POST /update_weights``: a safetensors body (any float dtype, cast into the serving dtype);
  ``?strict=true`` also requires every model tensor. Answers ``{"updated", "weight_version"}``.

Errors are JSON ``{"error": {"message", "type", "code"}}``: 400 for bad JSON or fields (the
message names the field), 401 for a wrong bearer token, 404/405 for unknown routes, 413 for a
body over the cap, 500 if generation itself fails. The server keeps serving after any of them.

Command line: ``python -m r3lightning.rollout.server --port 30000`` (or ``r3lightning-serve``)
serves the tiny model (or ``--model PATH``, a Hugging Face checkpoint directory).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import logging
import signal
import threading
from collections.abc import Mapping

import orjson
import torch
from aiohttp import web

from .client_protocol import PROTOCOL_PATHS
from .engine import GenerationEngine
from .server_protocol import RequestFieldError, build_response, parse_generate_request, wants_logprobs
from .wire import read_capped

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_MAX_WEIGHTS_BYTES = 8 << 30
_READ_CHUNK = 1 << 20


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error_response(status: int, message: str) -> web.Response:
    kind = {400: "BadRequest", 401: "Unauthorized", 413: "PayloadTooLarge", 500: "InternalError"}
    return _json_response(
        {"error": {"message": message, "type": kind.get(status, "HTTPError"), "code": status}}, status
    )


class RolloutServer:
    """Serve ``model`` (default: ``build_tiny_moe(seed=seed)``) over HTTP on ``host:port``.

    The model is copied and cast to ``dtype`` (bf16 by default) by a
    :class:`~r3lightning.rollout.engine.GenerationEngine`; the caller's model is never touched.
    ``port=0`` picks a free port (read :attr:`port` / :attr:`url` once started). ``api_key``:
    when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
    ``max_request_bytes`` caps generate bodies, ``max_weights_bytes`` weight-update bodies.
    ``max_batch_size`` bounds how many concurrent requests share one forward. ``seed`` seeds the
    default model and the sampling seeds of requests that send none. ``copy_model=False`` serves
    ``model`` itself (cast in place) instead of a private copy. ``batch_invariant`` and
    ``simulated_disagreement`` (a simulation knob): see :class:`GenerationEngine`.

    Use as ``async with`` inside a running loop, or as a plain ``with`` (the server then runs its
    own event loop in a daemon thread, for synchronous callers such as a Lightning training loop).
    A server runs once: it cannot be restarted after it stops.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
        max_batch_size: int = 8,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        seed: int = 0,
        model_name: str | None = None,
        copy_model: bool = True,
        batch_invariant: bool | None = None,
        simulated_disagreement: float | None = None,
    ) -> None:
        for name, value in (
            ("max_request_bytes", max_request_bytes),
            ("max_weights_bytes", max_weights_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port!r}")
        if model is None:
            copy_model = False
            from ..models.tiny import build_tiny_moe

            model = build_tiny_moe(seed=seed)
        self.engine = GenerationEngine(
            model,
            dtype=dtype,
            device=device,
            max_batch_size=max_batch_size,
            seed=seed,
            copy_model=copy_model,
            batch_invariant=batch_invariant,
            simulated_disagreement=simulated_disagreement,
        )
        self.model_name = model_name or getattr(model.config, "name_or_path", None) or type(model).__name__
        self.host = host
        self.port = port
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.max_weights_bytes = max_weights_bytes
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
        if self.api_key is not None and request.path != "/health":
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return _error_response(401, "missing or wrong bearer token in the Authorization header")
        try:
            return await handler(request)
        except _HTTPError as exc:
            return _error_response(exc.status, exc.message)
        except web.HTTPException as exc:
            return _error_response(exc.status, exc.reason)
        except Exception as exc:
            logger.exception("request %s %s failed", request.method, request.path)
            return _error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    async def _read_body(self, request: web.Request, cap: int) -> bytes:
        """The request body, refusing (413) more than ``cap`` bytes before reading past it."""

        def too_large(declared: int | None) -> _HTTPError:
            of = "" if declared is None else f" of {declared} bytes"
            return _HTTPError(413, f"request body{of} exceeds the cap of {cap} bytes")

        return await read_capped(
            request.content.iter_chunked(_READ_CHUNK), request.content_length, cap, too_large
        )

    async def _generate(self, request: web.Request, protocol: str) -> web.Response:
        raw = await self._read_body(request, self.max_request_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _HTTPError(400, f"request body is not valid JSON: {exc}") from None
        try:
            gen_request = parse_generate_request(body, protocol)
            prompt_field = "token_ids" if protocol == "skyrl" else "input_ids"
            future = self.engine.submit(gen_request, prompt_field=prompt_field)  # validates first
        except (RequestFieldError, ValueError) as exc:
            raise _HTTPError(400, str(exc)) from None
        output = await asyncio.wrap_future(future)
        request_id = request.headers.get("X-Session-ID") or f"gen-{next(self._ids)}"
        payload = build_response(
            output,
            protocol,
            request_id=request_id,
            model_name=self.model_name,
            logprobs=wants_logprobs(body, protocol),
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
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        strict_arg = request.query.get("strict", "false").lower()
        if strict_arg not in ("true", "false", "1", "0"):
            raise _HTTPError(400, f"query parameter strict must be true or false, got {strict_arg!r}")
        raw = await self._read_body(request, self.max_weights_bytes)
        try:
            state_dict = load_safetensors(raw)
        except (SafetensorError, ValueError) as exc:
            raise _HTTPError(400, f"request body is not a safetensors file: {exc}") from None
        try:
            updated = await asyncio.to_thread(
                self.engine.update_weights, state_dict, strict=strict_arg in ("true", "1")
            )
        except ValueError as exc:
            raise _HTTPError(400, str(exc)) from None
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
        runner = web.AppRunner(self.make_app(), access_log=None)
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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="r3lightning-serve",
        description="Serve a causal MoE model that returns its routed experts (skyrl and sglang protocols).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start)")
    parser.add_argument(
        "--model", default=None, help="Hugging Face checkpoint directory (default: the tiny MoE)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda:0 (default: cuda if available)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def _serve_until_signalled(server: RolloutServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"r3lightning rollout server listening on {server.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``r3lightning-serve``); serves until SIGINT / SIGTERM."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = None  # RolloutServer builds the tiny MoE
    if args.model is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    server = RolloutServer(
        model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        max_batch_size=args.max_batch_size,
        dtype=dtype,
        device=device,
        seed=args.seed,
        model_name=args.model or "r3lightning-tiny-moe",
        copy_model=False,
    )
    asyncio.run(_serve_until_signalled(server))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
