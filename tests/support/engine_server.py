"""A loopback aiohttp server answering with vLLM's and SGLang's exact response layouts.

Written with plain json + base64 + ``np.save`` (what vLLM's ``numpy2base64`` does), nothing from
the package under test, so it is an independent reference of each engine's fields (vLLM 0.33.0,
SGLang 0.5.23; the field sources are listed in ``r3lightning/rollout/client_protocol.py``):

- vLLM ``POST /inference/v1/generate`` (``GenerateTokensResponse``) and ``POST /v1/completions``
  (``CompletionResponse``): routes in ``choices[i].routed_experts`` as base64 of a ``.npy`` file,
  uint8 for <= 256 experts else uint16, ``null`` when routes are off server-wide;
- SGLang ``POST /generate`` (``meta_info``) and ``POST /v1/completions`` (routes in the
  response-level ``sglext.routed_experts``, flat int32, absent unless asked for per request).

The generation is deterministic (``fault_server.expected_generation``), dense layers hold
all-zero rows, a sampled id in ``stop_token_ids`` (or ``eos_id`` unless ``ignore_eos``) ends the
response with finish reason ``stop``, and ``extra_rows`` returns that many rows too many (a
broken engine).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
from aiohttp import web
from fault_server import expected_generation
from loopback import LoopbackServer


class EngineServer(LoopbackServer):
    def __init__(
        self,
        engine: str,
        *,
        num_layers: int = 3,
        top_k: int = 2,
        num_experts: int = 300,
        dense_layers: tuple[int, ...] = (0,),
        routes_enabled: bool = True,
        extra_rows: int = 0,
        eos_id: int = 999,
    ):
        assert engine in ("vllm", "sglang")
        self.engine = engine
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.dense_layers = dense_layers
        self.routes_enabled = routes_enabled
        self.extra_rows = extra_rows
        self.eos_id = eos_id
        self.requests: list[tuple[str, dict]] = []

    def add_routes(self, app: web.Application) -> None:
        if self.engine == "vllm":
            app.router.add_post("/inference/v1/generate", self._vllm_generate)
        else:
            app.router.add_post("/generate", self._sglang_generate)
        app.router.add_post("/v1/completions", self._completions)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt: list[int], params: dict[str, Any], start: int):
        """(ids, logprobs, routes [rows, L, K] int64 with dense layers zeroed, finish reason)."""
        limit = params.get("max_tokens", params.get("max_new_tokens", 16))
        schema = {"num_layers": self.num_layers, "top_k": self.top_k, "num_experts": self.num_experts}
        ids, logprobs, _ = expected_generation(prompt, limit, start, **schema)
        routes = expected_generation(prompt, limit + 1, start, **schema)[2]  # one spare row
        stops = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos", False):
            stops.add(self.eos_id)
        finish = "length"
        for i, token in enumerate(ids):
            if token in stops:
                ids, logprobs, finish = ids[: i + 1], logprobs[: i + 1], "stop"
                break
        routes = routes[: max(0, len(prompt) - start + len(ids) - 1) + self.extra_rows]
        routes[:, list(self.dense_layers)] = 0
        return ids, logprobs, routes, finish

    def npy_b64(self, routes: np.ndarray) -> str:
        buffer = io.BytesIO()
        np.save(buffer, routes.astype("u1" if self.num_experts <= 256 else "<u2"), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    @staticmethod
    def int32_b64(routes: np.ndarray) -> str:
        return base64.b64encode(routes.astype("<i4").tobytes()).decode("utf-8")

    @staticmethod
    def answer(body: dict) -> web.Response:
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")

    # ------------------------------------------------------------------ endpoints

    async def _vllm_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.path, body))
        params = body["sampling_params"]
        ids, logprobs, routes, finish = self.generate(
            body["token_ids"], params, params.get("routed_experts_prompt_start", 0)
        )
        content = None
        if params.get("logprobs") is not None:
            content = {
                "content": [
                    {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                    for t, lp in zip(ids, logprobs, strict=True)
                ]
            }
        choice = {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids,
            "routed_experts": self.npy_b64(routes) if self.routes_enabled else None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": content,
        }
        return self.answer(
            {
                "request_id": "r",
                "model": body.get("model"),
                "created": 1,
                "usage": None,
                "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "prompt_token_ids": None,
                "mm_placeholders": None,
                "metrics": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "output_mode": "tokens",
                "choices": [choice],
            }
        )

    async def _sglang_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.path, body))
        start = body.get("routed_experts_start_len", 0)
        ids, logprobs, routes, finish = self.generate(body["input_ids"], body["sampling_params"], start)
        meta: dict[str, Any] = {
            "id": "r",
            "finish_reason": {"type": finish, "matched": ids[-1]} if finish == "stop" else {"type": finish},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)]
        if body.get("return_routed_experts") and self.routes_enabled:
            meta["routed_experts"] = self.int32_b64(routes)
        return self.answer({"text": "", "output_ids": ids, "meta_info": meta})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.path, body))
        start_key = "routed_experts_prompt_start" if self.engine == "vllm" else "routed_experts_start_len"
        ids, logprobs, routes, finish = self.generate(body["prompt"], body, body.get(start_key, 0))
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": finish,
        }
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "text_offset": [-1] * len(ids),
                "token_logprobs": logprobs,
                "tokens": [f"t{t}" for t in ids],
                "top_logprobs": [None] * len(ids),
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        answer: dict[str, Any] = {
            "id": "cmpl-r",
            "object": "text_completion",
            "created": 1,
            "model": body.get("model", "m"),
            "choices": [choice],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)},
        }
        if self.engine == "vllm":
            choice.update(
                stop_reason=None,
                prompt_logprobs=None,
                prompt_token_ids=None,
                routed_experts=self.npy_b64(routes) if self.routes_enabled else None,
                weight_versions=None,
            )
        elif body.get("return_routed_experts") and self.routes_enabled:
            choice["matched_stop"] = ids[-1] if finish == "stop" else None
            answer["sglext"] = {"routed_experts": self.int32_b64(routes)}
        return self.answer(answer)
