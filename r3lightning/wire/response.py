"""Client side of the generate protocols, responses: a 2xx body in, a checked result out.

Each protocol's fields are read where its engine writes them (the sources are listed in
:mod:`r3lightning.wire.request`). The body is parsed once (:class:`~r3lightning.wire.json_body.JsonBody`):
the route payload stays in the body's bytes, is decoded by pybase64 straight into the route
array and goes through the route check with the row count ``P - start + G - 1`` (rows cover
token positions ``[start, P + G - 1)``). Routes asked for but absent raise
:class:`MalformedResponseError` naming the engine flag, as does every other deviation, naming the
field (and the engine URL when given).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3lightning.wire.codec import checked_routes, decode_array, decode_flat_array, decode_npy_array
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.json_body import JsonBody
from r3lightning.wire.request import ENGINE_ROUTES_FLAG, RemoteGenerateResult, RouteSchema

__all__ = ["parse_response"]

_MISSING = object()


def parse_response(
    raw: bytes,
    protocol: str,
    schema: RouteSchema,
    *,
    want_routes: bool,
    prompt_len: int | None = None,
    start: int = 0,
    url: str | None = None,
) -> RemoteGenerateResult:
    """Parse a 2xx generate body; routes are decoded and checked only when ``want_routes``.

    With ``prompt_len`` the route row count must be ``prompt_len - start + G - 1`` (``G`` = the
    response length). ``url`` is named in every error. Cost: an orjson parse of the body without
    its route payload, one ``memchr`` pass and one base64 decode of the payload, the range
    check (one ``max``) and, with ``schema.check_unique``, the distinct-experts check.
    """
    try:
        body = JsonBody(raw)
        if not isinstance(body.value, dict):
            raise MalformedResponseError(
                f"response body: expected a JSON object, got {type(body.value).__name__}"
            )
        read = {"sglang": _read_sglang, "openai": _read_openai}.get(protocol, _read_choices)
        result, where, routes, flat = read(body)
        if want_routes:
            rows, rule = None, ""
            if prompt_len is not None:
                generated = len(result.response_ids)
                expected = max(0, prompt_len - start + generated - 1)
                rows = range(expected, expected + 1)
                rule = (
                    f"P - start + G - 1 = {prompt_len} - {start} + {generated} - 1 = {expected} "
                    "(rows cover positions [start, P + G - 1))"
                )
            result.routed_experts = _decode(body, routes, flat, where, schema, rows, rule)
        result.raw_response = body.finish()
        return result
    except MalformedResponseError as exc:
        if url is None:
            raise
        raise MalformedResponseError(f"{exc} (response from {url})") from None


def _decode(
    body: JsonBody, value: Any, flat: bool, where: str, schema: RouteSchema, rows: range | None, rule: str
) -> np.ndarray:
    """The routes ``value`` (from :func:`_take_routes`) decoded in its wire format and checked."""
    if value is None or value is _MISSING:
        raise MalformedResponseError(
            f"{where}: routes were requested but the field is {'null' if value is None else 'missing'}; "
            f"start the engine with {ENGINE_ROUTES_FLAG} (vLLM, SGLang, SkyRL's vLLM server), and for "
            "SGLang also send return_routed_experts=true"
        )
    limits = {"max_bytes": schema.max_bytes, "field": where}
    if flat:
        if schema.num_layers is None or schema.top_k is None:
            raise ValueError("SGLang's flat routes need num_layers and top_k to be reshaped")
        routes = decode_flat_array(body.payload(value, where), schema.num_layers, schema.top_k, **limits)
    elif isinstance(value, dict):  # SkyRL's ndarray envelope
        if "data" in value:
            value = {**value, "data": body.payload(value["data"], f"{where}.data")}
        routes = decode_array(value, **limits)
    elif isinstance(value, str):  # vLLM's base64 .npy file
        routes = decode_npy_array(body.payload(value, where), **limits)
    else:
        raise MalformedResponseError(
            f"{where}: expected an ndarray envelope (SkyRL) or a base64 .npy string (vLLM), "
            f"got {type(value).__name__}"
        )
    return checked_routes(
        routes,
        num_experts=schema.num_experts,
        num_layers=schema.num_layers,
        top_k=schema.top_k,
        check_unique=schema.check_unique,
        rows=rows,
        rows_rule=rule,
        compact=flat,
        field=where,
    )


def _take_routes(body: JsonBody, container: Any, key: str) -> Any:
    """The routes at ``container[key]`` (an envelope, copied, or a payload string), left as None
    (an envelope's ``data`` as None) in the raw response; ``_MISSING`` when absent."""
    if not isinstance(container, dict) or key not in container:
        return _MISSING
    value = container[key]
    if isinstance(value, dict):
        return {**value, "data": body.take(value, "data")} if "data" in value else dict(value)
    return body.take(container, key)


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


def _stop_reason(value: Any, field: str) -> str | None:
    stop = value.get("type") if isinstance(value, dict) else value
    if stop is not None and not isinstance(stop, str):
        raise MalformedResponseError(f"{field}: expected a string or {{'type': ...}}, got {value!r}")
    return stop


def _first_choice(body: JsonBody) -> dict[str, Any]:
    choices = body.value.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponseError("choices: expected a non-empty list of choice objects")
    for other in choices[1:]:  # one result per call: the others' routes are dropped unread
        _take_routes(body, other, "routed_experts")
    return choices[0]


Read = tuple[RemoteGenerateResult, str, Any, bool]  # (result, routes field, routes, flat int32)


def _result(ids: list[int], logprobs: list[float] | None, stop: str | None) -> RemoteGenerateResult:
    return RemoteGenerateResult(ids, logprobs, stop, None, {})


def _read_choices(body: JsonBody) -> Read:
    """``skyrl`` and ``vllm``: ``choices[0]`` with ``token_ids``, ``logprobs.content`` and routes."""
    choice = _first_choice(body)
    ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
    stop = _stop_reason(choice.get("finish_reason"), "choices[0].finish_reason")
    logprobs = None
    if (content := choice.get("logprobs")) is not None:
        entries = content.get("content") if isinstance(content, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise MalformedResponseError("choices[0].logprobs.content: expected a list of {'logprob': x} objects")
        logprobs = _float_list([e.get("logprob") for e in entries], len(ids), "choices[0].logprobs.content")
    routes = _take_routes(body, choice, "routed_experts")
    return _result(ids, logprobs, stop), "choices[0].routed_experts", routes, False


def _read_sglang(body: JsonBody) -> Read:
    ids = _int_list(body.value.get("output_ids"), "output_ids")
    meta = body.value.get("meta_info")
    if not isinstance(meta, dict):
        raise MalformedResponseError(f"meta_info: expected an object, got {type(meta).__name__}")
    stop = _stop_reason(meta.get("finish_reason"), "meta_info.finish_reason")
    logprobs = None
    if (entries := meta.get("output_token_logprobs")) is not None:
        if not isinstance(entries, list) or not all(isinstance(e, list) and e for e in entries):
            raise MalformedResponseError("meta_info.output_token_logprobs: expected a list of [logprob, token_id, ...]")
        logprobs = _float_list([e[0] for e in entries], len(ids), "meta_info.output_token_logprobs")
    routes = _take_routes(body, meta, "routed_experts")
    return _result(ids, logprobs, stop), "meta_info.routed_experts", routes, True


def _read_openai(body: JsonBody) -> Read:
    """``/v1/completions`` of vLLM (per-choice ``.npy`` routes) or SGLang (``sglext`` int32)."""
    choice = _first_choice(body)
    if (token_ids := choice.get("token_ids")) is None:
        raise MalformedResponseError(
            "choices[0].token_ids: missing; the engine ignored return_token_ids=true "
            "(needs vLLM or SGLang's /v1/completions with token-id support)"
        )
    ids = _int_list(token_ids, "choices[0].token_ids")
    stop = _stop_reason(choice.get("finish_reason"), "choices[0].finish_reason")
    logprobs = None
    if (content := choice.get("logprobs")) is not None:
        values = content.get("token_logprobs") if isinstance(content, dict) else None
        if not isinstance(values, list):
            raise MalformedResponseError("choices[0].logprobs.token_logprobs: expected a list of floats")
        logprobs = _float_list(values, len(ids), "choices[0].logprobs.token_logprobs")
    sglang = _take_routes(body, body.value.get("sglext"), "routed_experts")
    vllm = _take_routes(body, choice, "routed_experts")
    if vllm in (None, _MISSING) and sglang not in (None, _MISSING):  # SGLang's answer
        return _result(ids, logprobs, stop), "sglext.routed_experts", sglang, True
    # vLLM's (kept when both forms came, as it carries its own shape)
    where = "choices[0].routed_experts" if vllm not in (None, _MISSING) else (
        "choices[0].routed_experts (vLLM) / sglext.routed_experts (SGLang)"
    )
    return _result(ids, logprobs, stop), where, vllm, False
