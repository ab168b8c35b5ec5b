"""Client side of the generate protocols (``skyrl``, ``vllm``, ``sglang``, ``openai``; see the
protocols page): request bodies, sampling parameters, the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3lightning.checks import check_int
from r3lightning.routes import ENGINE_ROUTES_FLAG
from r3lightning.wire.codec import RouteSchema

__all__ = [
    "ENGINE_ROUTES_FLAG",
    "PROTOCOL_PATHS",
    "RemoteGenerateResult",
    "RouteSchema",
    "build_request",
    "engine_sampling_params",
]

PROTOCOL_PATHS = {
    "skyrl": "/skyrl/v1/generate",
    "vllm": "/inference/v1/generate",
    "sglang": "/generate",
    "openai": "/v1/completions",
}
ENGINES = ("vllm", "sglang")


@dataclass
class RemoteGenerateResult:
    """One generation, as the client parsed it.

    Args:
        response_ids: The generated token ids.
        response_logprobs: Their logprobs (None when the server sent none).
        stop_reason: Why generation stopped, as the engine said.
        routed_experts: ``[rows, num_layers, top_k]`` host array in a compact integer dtype (None
            unless asked for).
        raw_response: The JSON body with its route payloads as None (never a ``str``).
        attempts: HTTP attempts it took.
        weight_version: The engine's weight version that generated it (None: the engine sent none).
        missing_route_rows: Route rows the engine lost (marked -1; ``RouteSchema.missing_rows``).
    """

    response_ids: list[int]
    response_logprobs: list[float] | None
    stop_reason: str | None
    routed_experts: np.ndarray | None
    raw_response: dict[str, Any] = field(repr=False)
    attempts: int = 1
    weight_version: int | None = None
    missing_route_rows: int = 0


def engine_sampling_params(
    protocol: str,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """Sampling parameters in ``protocol``'s own names.

    Args:
        protocol: ``skyrl``, ``vllm``, ``sglang`` or ``openai``: SGLang's ``/generate`` says
            ``max_new_tokens`` / ``sampling_seed``, the others ``max_tokens`` / ``seed``.
        max_new_tokens: The longest response.
        temperature: 0 is greedy.
        top_p: 1 disables the filter.
        top_k: -1 disables the filter.
        seed: The sample's seed (None: the engine's choice).
        stop_token_ids: Ids that also end a response (e.g. a chat template's end of turn).
        ignore_eos: Keep sampling past an end-of-sequence token.

    Returns:
        The ``sampling_params`` mapping of one request.

    Raises:
        ValueError: An unknown protocol or ``max_new_tokens`` below 1.
    """
    if protocol not in PROTOCOL_PATHS:
        raise ValueError(f"protocol must be one of {sorted(PROTOCOL_PATHS)}, got {protocol!r}")
    check_int("max_new_tokens", max_new_tokens)
    params: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    length, seed_key = ("max_new_tokens", "sampling_seed") if protocol == "sglang" else ("max_tokens", "seed")
    params[length] = max_new_tokens
    if seed is not None:
        params[seed_key] = seed
    if stop_token_ids:
        ids = [int(t) for t in stop_token_ids]
        if any(t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {ids}")
        params["stop_token_ids"] = ids
    params["ignore_eos"] = bool(ignore_eos)
    return params


def build_request(
    protocol: str,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    model: str | None = None,
    return_routed_experts: bool = False,
    routed_experts_prompt_start: int | None = None,
    cache_salt: str | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """The JSON request body of one generate call.

    Args:
        protocol: ``skyrl``, ``vllm``, ``sglang`` or ``openai`` (checked by the caller).
        prompt_ids: The prompt's token ids.
        sampling_params: Passed as given (``openai``: at the top level of the body).
        model: Sent as ``model`` when given.
        return_routed_experts: Ask the engine for routes.
        routed_experts_prompt_start: The first prompt token whose route row is wanted (default 0).
        cache_salt: Sent as ``cache_salt`` when given.
        engine: ``"vllm"`` or ``"sglang"`` narrows ``openai``'s route fields to that engine's own
            (None: both).

    Returns:
        The body, ready for ``orjson.dumps``.

    Raises:
        ValueError: ``openai`` sampling parameters that set a key the client sets itself.
    """
    params = dict(sampling_params)
    start = routed_experts_prompt_start or 0
    body: dict[str, Any]
    if protocol in ("skyrl", "vllm"):
        if return_routed_experts:
            params["routed_experts_prompt_start"] = start
        if protocol == "vllm":
            params.setdefault("logprobs", 0)
        body = {"token_ids": prompt_ids, "sampling_params": params}
    elif protocol == "sglang":
        body = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}
        body["return_routed_experts"] = return_routed_experts
        if return_routed_experts and routed_experts_prompt_start is not None:
            body["routed_experts_start_len"] = start
        return body
    else:
        reserved = {"prompt", "return_token_ids", "stream", "n", "echo", "model", "cache_salt"}
        clash = sorted(reserved & set(params))
        if clash:
            raise ValueError(f"sampling_params must not set {clash} for protocol='openai' (the client does)")
        body = {"prompt": prompt_ids, **params, "return_token_ids": True, "stream": False}
        body.setdefault("logprobs", 0)
        if return_routed_experts:
            if engine in (None, "vllm"):
                body["routed_experts_prompt_start"] = start
            if engine in (None, "sglang"):
                body["return_routed_experts"] = True
                body["routed_experts_start_len"] = start
    return body | {key: v for key, v in (("model", model), ("cache_salt", cache_salt)) if v is not None}
