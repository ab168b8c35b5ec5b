"""A scripted skyrl engine on 127.0.0.1 whose every route row names the request that computed it.

Row ``p`` of a request over a ``P``-token prompt is :func:`route_row` of (the token at ``p``,
``p``, ``P``, the engine's ``salt``): the same position forwarded by two turns, or by two
engines, gets two different rows, so a test can tell which request's row a trajectory kept,
boundary tokens included. Written with plain json +
base64 (nothing from the package under test). Responses are :func:`response_ids` of the prompt
and the request's seed; logprobs ``-0.01 * (position + 1)``. Each request pops an action from
``script`` (``"ok"`` when empty): ``Status`` answers that HTTP status, ``"extra_row"`` sends one
row too many (a broken engine). Routes go as uint8, or int16 past 256 experts. ``served`` keeps (prompt, start, response, routes) of every ok answer.
"""

from __future__ import annotations

import base64
import json
from collections import deque
from typing import Any

import numpy as np
from aiohttp import web
from fault_server import Status
from loopback import LoopbackServer


def route_row(
    token: int, position: int, prompt_len: int, num_layers: int, top_k: int, num_experts: int, salt: int = 0
):
    """``[L, K]`` distinct ids per layer, a function of the token, its position, the request and
    the engine's ``salt``."""
    base = (token * 7 + position * 3 + prompt_len * 11 + salt * 5) % num_experts
    layers = np.arange(num_layers)[:, None] * 5
    return (base + layers + np.arange(top_k)[None, :]) % num_experts


def response_ids(prompt: list[int], seed: int, count: int, vocab: int) -> list[int]:
    return [(sum(prompt) * 31 + seed * 17 + 13 * i) % (vocab - 10) + 10 for i in range(count)]


class TurnEngine(LoopbackServer):
    def __init__(
        self, *, num_layers: int = 3, top_k: int = 2, num_experts: int = 16, vocab: int = 96, salt: int = 0
    ):
        self.schema = (num_layers, top_k, num_experts)
        self.salt = salt
        self.vocab = vocab
        self.script: deque[Any] = deque()
        self.served: list[tuple[list[int], int, list[int], np.ndarray]] = []
        self.requests: list[dict] = []

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/skyrl/v1/generate", self._generate)
        app.router.add_get("/health", lambda request: web.json_response({"ok": True}))

    def rows(self, tokens: list[int], prompt_len: int, start: int, stop: int) -> np.ndarray:
        rows = [route_row(tokens[p], p, prompt_len, *self.schema, self.salt) for p in range(start, stop)]
        return np.array(rows, dtype=np.int64).reshape(len(rows), *self.schema[:2])

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        action = self.script.popleft() if self.script else "ok"
        if isinstance(action, Status):
            return web.Response(status=action.status, text=action.body)
        prompt, params = body["token_ids"], body["sampling_params"]
        start = params.get("routed_experts_prompt_start") or 0
        ids = response_ids(prompt, params.get("seed", 0), params["max_tokens"], self.vocab)
        tokens = prompt + ids
        routes = self.rows(tokens, len(prompt), start, len(tokens) - 1 + (action == "extra_row"))
        self.served.append((prompt, start, ids, routes))
        dtype = "uint8" if self.schema[2] <= 256 else "int16"  # the compact wire dtype of the ids
        envelope = {
            "data": base64.b64encode(routes.astype(dtype).tobytes()).decode(),
            "shape": list(routes.shape),
            "dtype": dtype,
        }
        logprobs = [{"logprob": -0.01 * (len(prompt) + i + 1)} for i in range(len(ids))]
        choice = {"token_ids": ids, "finish_reason": "length", "logprobs": {"content": logprobs}}
        choice["routed_experts"] = envelope
        return web.Response(body=json.dumps({"choices": [choice]}).encode(), content_type="application/json")
