"""A real aiohttp generate server on 127.0.0.1 that answers by a script of faults.

It speaks both generate protocols with deliberately plain code (json + base64, nothing from the
package under test), so it doubles as an independent reference of the wire format. Each request pops the next action from ``script`` (``"ok"`` once the script is
empty) and is recorded in ``requests``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web
from loopback import LoopbackServer

OK = "ok"


@dataclass
class Status:
    """Answer with an HTTP status, optional headers and a text body."""

    status: int
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Raw:
    """Answer 200 with these exact bytes."""

    body: bytes


@dataclass
class Slow:
    """Sleep, then answer normally."""

    seconds: float


DROP_MID_BODY = "drop_mid_body"  # announce the full length, send half of it, close the socket
CLOSE = "close"  # close the socket without answering


def expected_generation(
    prompt: list[int], max_tokens: int, start: int, *, num_layers: int, top_k: int, num_experts: int
) -> tuple[list[int], list[float], np.ndarray]:
    """What the server generates: response ids, their logprobs, routes ``[rows, L, K]`` int64."""
    response = [(sum(prompt) + 7 * i) % 1000 for i in range(max_tokens)]
    logprobs = [-0.125 * (i + 1) for i in range(max_tokens)]
    rows = np.arange(start, len(prompt) + max_tokens - 1)[:, None, None]
    layers = np.arange(num_layers)[None, :, None]
    ranks = np.arange(top_k)[None, None, :]
    routes = (rows * 3 + layers * 5 + ranks) % num_experts  # distinct within a row: top_k <= num_experts
    return response, logprobs, routes.astype(np.int64)


class FaultServer(LoopbackServer):
    def __init__(
        self, *, num_layers: int = 3, top_k: int = 2, num_experts: int = 300, extra: dict | None = None
    ):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.extra = extra or {}  # extra top-level fields in every ok answer
        self.script: deque[Any] = deque()
        self.requests: list[tuple[str, dict, dict[str, str]]] = []  # (path, json body, headers)
        self.in_flight = 0
        self.max_in_flight = 0

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/skyrl/v1/generate", self._skyrl)
        app.router.add_post("/generate", self._sglang)
        app.router.add_get("/health", self._health)

    @property
    def hits(self) -> int:
        return len(self.requests)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _skyrl(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body["sampling_params"]
        start = params.get("routed_experts_prompt_start")

        def ok() -> dict:
            ids, logprobs, routes = self._generate(body["token_ids"], params["max_tokens"], start or 0)
            envelope = None
            if start is not None:
                dtype = "uint8" if routes.max(initial=0) < 256 else "int16"
                envelope = {
                    "data": base64.b64encode(routes.astype(dtype).tobytes()).decode(),
                    "shape": list(routes.shape),
                    "dtype": dtype,
                }
            choice = {
                "index": 0,
                "token_ids": ids,
                "finish_reason": "length",
                "logprobs": {
                    "content": [{"logprob": lp, "token_id": t} for t, lp in zip(ids, logprobs, strict=True)]
                },
                "routed_experts": envelope,
            }
            return {"id": "x", "choices": [choice], **self.extra}

        return await self._answer(request, body, ok)

    async def _sglang(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        start = body.get("routed_experts_start_len", 0)

        def ok() -> dict:
            ids, logprobs, routes = self._generate(
                body["input_ids"], body["sampling_params"]["max_new_tokens"], start
            )
            meta: dict[str, Any] = {
                "finish_reason": {"type": "length", "length": len(ids)},
                "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)],
            }
            if body.get("return_routed_experts"):
                meta["routed_experts"] = base64.b64encode(routes.astype("<i4").tobytes()).decode()
            return {"text": "", "output_ids": ids, "meta_info": meta, **self.extra}

        return await self._answer(request, body, ok)

    def _generate(self, prompt: list[int], max_tokens: int, start: int):
        return expected_generation(
            prompt,
            max_tokens,
            start,
            num_layers=self.num_layers,
            top_k=self.top_k,
            num_experts=self.num_experts,
        )

    async def _answer(self, request: web.Request, body: dict, ok) -> web.StreamResponse:
        self.requests.append((request.path, body, dict(request.headers)))
        action = self.script.popleft() if self.script else OK
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)  # let concurrent requests overlap
            if isinstance(action, Slow):
                await asyncio.sleep(action.seconds)
                action = OK
            if action == OK:
                return web.Response(body=json.dumps(ok()).encode(), content_type="application/json")
            if isinstance(action, Status):
                return web.Response(status=action.status, text=action.body, headers=action.headers)
            if isinstance(action, Raw):
                return web.Response(body=action.body, content_type="application/json")
            assert request.transport is not None
            if action == CLOSE:
                request.transport.close()
                raise asyncio.CancelledError
            assert action == DROP_MID_BODY
            payload = json.dumps(ok()).encode()
            response = web.StreamResponse()
            response.content_length = len(payload)
            response.content_type = "application/json"
            await response.prepare(request)
            await response.write(payload[: len(payload) // 2])
            request.transport.close()
            raise asyncio.CancelledError
        finally:
            self.in_flight -= 1
