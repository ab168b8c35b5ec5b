"""Client side of the two generate protocols: request bodies out, parsed results in.

- ``skyrl``: ``POST /skyrl/v1/generate`` with ``{"token_ids", "sampling_params", "model"?,
  "cache_salt"?}``. Routes are asked for by ``sampling_params.routed_experts_prompt_start``
  (0 = from the first token) and come back in ``choices[0].routed_experts`` as an ndarray
  envelope; logprobs in ``choices[0].logprobs.content[i].logprob``.
- ``sglang``: ``POST /generate`` with ``{"input_ids", "sampling_params", "return_logprob",
  "return_routed_experts", "routed_experts_start_len"?}``. Routes come back in
  ``meta_info.routed_experts`` as base64 flat int32, reshaped with ``(num_layers, top_k)``;
  logprobs in ``meta_info.output_token_logprobs[i][0]``.

Bodies are parsed once with :func:`~r3lightning.rollout.wire.parse_body`, so the base64 route
string is never materialised as a ``str`` and decodes straight into the route array. Every
deviation raises :class:`MalformedResponseError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import MalformedResponseError
from .wire import DEFAULT_MAX_BYTES, ParsedBody, decode_flat_routes, decode_routes, parse_body

__all__ = ["PROTOCOL_PATHS", "RemoteGenerateResult", "RouteSchema", "build_request", "parse_response"]

PROTOCOL_PATHS = {"skyrl": "/skyrl/v1/generate", "sglang": "/generate"}


@dataclass
class RemoteGenerateResult:
    """One generation. ``routed_experts`` is ``[rows, num_layers, top_k]`` in a compact integer dtype
    (None unless asked for and returned); ``response_logprobs`` is None when the server sent none.

    ``raw_response`` is the decoded JSON body with the route payload strings set to None (they
    are never materialised as ``str``); ``attempts`` is how many HTTP attempts it took.
    """

    response_ids: list[int]
    response_logprobs: list[float] | None
    stop_reason: str | None
    routed_experts: np.ndarray | None
    raw_response: dict[str, Any] = field(repr=False)
    attempts: int = 1


@dataclass(frozen=True)
class RouteSchema:
    """What returned routes must look like: ``[rows, num_layers, top_k]`` ids below ``num_experts``.

    ``None`` skips a check (``sglang`` needs ``num_layers`` and ``top_k`` to reshape).
    ``check_unique`` rejects rows that repeat an expert; ``max_bytes`` caps one decoded array.
    """

    num_layers: int | None = None
    top_k: int | None = None
    num_experts: int | None = None
    check_unique: bool = True
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def build_request(
    protocol: str,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    model: str | None = None,
    return_routed_experts: bool = False,
    routed_experts_prompt_start: int | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The JSON request body of ``protocol`` (``sampling_params`` is passed through as given)."""
    params = dict(sampling_params)
    start = routed_experts_prompt_start
    if protocol == "skyrl":
        if return_routed_experts:
            params["routed_experts_prompt_start"] = start or 0
        body: dict[str, Any] = {"token_ids": prompt_ids, "sampling_params": params}
        if model is not None:
            body["model"] = model
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body
    body = {
        "input_ids": prompt_ids,
        "sampling_params": params,
        "return_logprob": True,
        "return_routed_experts": return_routed_experts,
    }
    if return_routed_experts and start is not None:
        body["routed_experts_start_len"] = start
    return body


def parse_response(
    raw: bytes, protocol: str, schema: RouteSchema, *, want_routes: bool
) -> RemoteGenerateResult:
    """Parse a 2xx generate body; routes are decoded and validated only when ``want_routes``.

    Cost: one scan of the body, an orjson parse of its non-route part, and (when wanted) one
    base64 decode into the route array plus :func:`~r3lightning.rollout.wire.validate_routes`.
    """
    parsed = parse_body(raw)
    if not isinstance(parsed.value, dict):
        raise MalformedResponseError(
            f"response body: expected a JSON object, got {type(parsed.value).__name__}"
        )
    if protocol == "skyrl":
        result = _parse_skyrl(parsed, schema, want_routes)
    else:
        result = _parse_sglang(parsed, schema, want_routes)
    result.raw_response = parsed.restore()
    return result


def _int_list(value: Any, field: str) -> list[int]:
    # a negative id would index embeddings from the end downstream instead of failing
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise MalformedResponseError(f"{field}: expected a list of non-negative integer token ids")
    return value


def _float_list(values: list[Any], length: int, field: str) -> list[float]:
    if len(values) != length:
        raise MalformedResponseError(f"{field}: {len(values)} logprobs for {length} tokens")
    if not all(type(v) is float or type(v) is int for v in values):
        raise MalformedResponseError(f"{field}: expected numeric logprobs")
    return [float(v) for v in values]


def _take(
    parsed: ParsedBody, container: dict[str, Any], key: str, field: str, want: bool
) -> str | memoryview | None:
    """The payload at ``container[key]`` if wanted; leaves None in its place in the raw response."""
    value, container[key] = container[key], None
    if not want:
        parsed.discard(value)
        return None
    return parsed.payload(value, field)


def _parse_skyrl(parsed: ParsedBody, schema: RouteSchema, want_routes: bool) -> RemoteGenerateResult:
    choices = parsed.value.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponseError("choices: expected a non-empty list of choice objects")
    choice = choices[0]
    for other in choices[1:]:  # one result per call: never materialise the others' routes
        envelope = other.get("routed_experts") if isinstance(other, dict) else None
        if isinstance(envelope, dict) and "data" in envelope:
            _take(parsed, envelope, "data", "", want=False)
    ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
    stop = choice.get("finish_reason")
    if stop is not None and not isinstance(stop, str):
        raise MalformedResponseError(f"choices[0].finish_reason: expected a string, got {stop!r}")
    logprobs = None
    content = choice.get("logprobs")
    if content is not None:
        entries = content.get("content") if isinstance(content, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise MalformedResponseError(
                "choices[0].logprobs.content: expected a list of {'logprob': x} objects"
            )
        logprobs = _float_list([e.get("logprob") for e in entries], len(ids), "choices[0].logprobs.content")
    routes = None
    where = "choices[0].routed_experts"
    envelope = choice.get("routed_experts")
    if isinstance(envelope, dict):
        data = _take(parsed, envelope, "data", f"{where}.data", want_routes) if "data" in envelope else None
        if want_routes:  # an envelope without "data" fails in decode_routes, naming the key
            routes = decode_routes(
                envelope if data is None else {**envelope, "data": data},
                num_experts=schema.num_experts,
                num_layers=schema.num_layers,
                top_k=schema.top_k,
                check_unique=schema.check_unique,
                max_bytes=schema.max_bytes,
                field=where,
            )
    elif envelope is not None and want_routes:
        raise MalformedResponseError(f"{where}: expected an ndarray envelope, got {type(envelope).__name__}")
    return RemoteGenerateResult(ids, logprobs, stop, routes, {})


def _parse_sglang(parsed: ParsedBody, schema: RouteSchema, want_routes: bool) -> RemoteGenerateResult:
    body = parsed.value
    ids = _int_list(body.get("output_ids"), "output_ids")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise MalformedResponseError(f"meta_info: expected an object, got {type(meta).__name__}")
    finish = meta.get("finish_reason")
    stop = finish.get("type") if isinstance(finish, dict) else finish
    if stop is not None and not isinstance(stop, str):
        raise MalformedResponseError(
            f"meta_info.finish_reason: expected a string or {{'type': ...}}, got {finish!r}"
        )
    logprobs = None
    entries = meta.get("output_token_logprobs")
    if entries is not None:
        if not isinstance(entries, list) or not all(isinstance(e, list) and e for e in entries):
            raise MalformedResponseError(
                "meta_info.output_token_logprobs: expected a list of [logprob, token_id, ...]"
            )
        logprobs = _float_list([e[0] for e in entries], len(ids), "meta_info.output_token_logprobs")
    routes = None
    if meta.get("routed_experts") is not None:
        data = _take(parsed, meta, "routed_experts", "meta_info.routed_experts", want_routes)
        if data is not None:
            if schema.num_layers is None or schema.top_k is None:
                raise ValueError("sglang routes need num_layers and top_k to be reshaped")
            routes = decode_flat_routes(
                data,
                num_layers=schema.num_layers,
                top_k=schema.top_k,
                num_experts=schema.num_experts,
                check_unique=schema.check_unique,
                max_bytes=schema.max_bytes,
            )
    return RemoteGenerateResult(ids, logprobs, stop, routes, {})
