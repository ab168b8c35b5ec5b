"""Client side of the generate protocols, responses: a 2xx body in, a checked result out; every
deviation raises [`MalformedResponseError`][r3lightning.wire.errors.MalformedResponseError] naming the field and the engine URL."""

from __future__ import annotations

from typing import Any

import numpy as np

from r3lightning.routes import ENGINE_ROUTES_FLAG, MISSING_ROUTE_ID, missing_rows
from r3lightning.wire.codec import checked_routes, decode_array, decode_flat_array, decode_npy_array
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.json_body import JsonBody, unescaped
from r3lightning.wire.request import RemoteGenerateResult, RouteSchema

__all__ = ["parse_response"]

_MISSING = object()
_BAD = object()  # logprobs of the wrong shape


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
    """A 2xx generate body parsed and checked.

    Args:
        raw: The response body.
        protocol: The protocol the request used.
        schema: How routes are checked and cut.
        want_routes: Decode and check routes (else they are ignored).
        prompt_len: The prompt length ``P``; with it the routes must have exactly
            ``P - start + G - 1`` rows (``G``: the response length).
        start: The ``routed_experts_prompt_start`` sent.
        url: The engine's URL, appended to error messages.

    Returns:
        The result, ``routed_experts`` ``[rows, L, K]`` on the host. Cost: an orjson parse of the
        body without its route payload, a base64 decode of the payload and a ``max`` of the ids
        (with ``schema.check_unique``, the distinct-experts check).

    Raises:
        MalformedResponseError: Any deviation from the protocol, naming the field.
    """
    try:
        body = JsonBody(raw)
        if not isinstance(body.value, dict):
            raise MalformedResponseError(
                f"response body: expected a JSON object, got {type(body.value).__name__}"
            )
        result, where, routes, flat = (
            _read_sglang(body) if protocol == "sglang" else _read_choices(body, protocol == "openai")
        )
        if want_routes:
            rows = None
            rule = ""
            if prompt_len is not None:
                g = len(result.response_ids)
                n = max(0, prompt_len - start + g - 1)
                rows = range(n, n + 1)
                rule = f"P - start + G - 1 = {prompt_len} - {start} + {g} - 1 = {n}"
                rule += " (rows cover positions [start, P + G - 1))"
            result.routed_experts = _decode(where, routes, flat, schema, rows, rule)
            result.missing_route_rows = int(missing_rows(result.routed_experts).sum())
        result.raw_response = body.finish()
        return result
    except MalformedResponseError as exc:
        if url is None:
            raise
        raise MalformedResponseError(f"{exc} (response from {url})") from None


def _decode(
    where: str, value: Any, flat: bool, schema: RouteSchema, rows: range | None, rule: str
) -> np.ndarray:
    """The routes ``value`` decoded and checked (a payload with JSON escapes: again once resolved);
    ``null`` routes (an engine that lost them) are all-missing rows unless ``missing_rows: error``."""
    if value is None and schema.missing_rows != "error" and rows is not None:
        return _all_missing(where, schema, rows.start)
    if value is None or value is _MISSING:
        raise MalformedResponseError(
            f"{where}: routes were requested but the field is {'null' if value is None else 'missing'}; "
            f"start the engine with {ENGINE_ROUTES_FLAG} (vLLM, SGLang, SkyRL's vLLM server), and for "
            "SGLang also send return_routed_experts=true"
            + (
                "; null from an engine that lost the request's routes (vLLM after preemption): "
                "missing_rows native or drop_trajectory keeps the trajectory"
                if value is None
                else ""
            )
        )
    try:
        routes = _decoded(where, value, flat, schema)
    except MalformedResponseError:
        text = unescaped(value)
        if text is None:
            raise
        routes = _decoded(where, text, flat, schema)
    return checked_routes(routes, schema, rows=rows, rows_rule=rule, compact=flat, field=where)


def _all_missing(where: str, schema: RouteSchema, count: int) -> np.ndarray:
    """``count`` missing rows ``[count, layers kept, top_k]`` of -1 (int8)."""
    if schema.num_layers is None or schema.top_k is None:
        raise MalformedResponseError(
            f"{where}: null routes (rows lost by the engine) need the route schema's num_layers and "
            "top_k to be marked missing"
        )
    layers = schema.num_layers if schema.layers is None else len(schema.layers)
    return np.full((count, layers, schema.top_k), MISSING_ROUTE_ID, dtype=np.int8)


def _decoded(where: str, value: Any, flat: bool, schema: RouteSchema) -> np.ndarray:
    limits = {"max_bytes": schema.max_bytes, "field": where}
    if flat:
        return decode_flat_array(value, schema.num_layers, schema.top_k, **limits)
    if isinstance(value, dict):  # SkyRL's ndarray envelope
        return decode_array(value, **limits)
    if isinstance(value, str | memoryview):  # vLLM's base64 .npy file
        return decode_npy_array(value, **limits)
    expected = "an ndarray envelope (SkyRL) or a .npy string (vLLM)"
    raise MalformedResponseError(f"{where}: expected {expected}, got {type(value).__name__}")


def _take_routes(body: JsonBody, container: Any, key: str) -> Any:
    """``container[key]`` (an envelope is copied), None in the raw response; ``_MISSING`` if absent."""
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


def _logprobs(values: Any, ids: list[int], field: str, expected: str) -> list[float] | None:
    """``values`` (None: the engine sent none) as one float per token id."""
    if values is None:
        return None
    if not isinstance(values, list):
        raise MalformedResponseError(f"{field}: expected {expected}")
    if len(values) != len(ids):
        raise MalformedResponseError(f"{field}: {len(values)} logprobs for {len(ids)} tokens")
    if not all(type(v) in (float, int) for v in values):
        raise MalformedResponseError(f"{field}: expected numeric logprobs")
    return list(map(float, values))


def _weight_version(value: Any, field: str) -> int | None:
    """An engine's weight version: an integer >= 0 (or its decimal string, as SGLang sends it);
    ``None`` when absent or a label that is not a number (SGLang's ``"default"``)."""
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if value is None or isinstance(value, str):
        return None
    if type(value) is not int or value < 0:
        raise MalformedResponseError(f"{field}: expected an integer >= 0, got {value!r}")
    return value


def _stop_reason(value: Any, field: str) -> str | None:
    stop = value.get("type") if isinstance(value, dict) else value
    if stop is not None and not isinstance(stop, str):
        raise MalformedResponseError(f"{field}: expected a string or {{'type': ...}}, got {value!r}")
    return stop


Read = tuple[RemoteGenerateResult, str, Any, bool]  # (result, routes field, routes, flat int32?)
_ABSENT = (None, _MISSING)


def _read_choices(body: JsonBody, openai: bool = False) -> Read:
    """``skyrl``, ``vllm``, ``openai``: ``choices[0]`` with ids, logprobs and routes (an envelope,
    a ``.npy`` string, or on ``/v1/completions`` SGLang's flat routes in ``sglext``)."""
    choices = body.value.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponseError("choices: expected a non-empty list of choice objects")
    for other in choices[1:]:  # one result per call: the others' routes are dropped unread
        _take_routes(body, other, "routed_experts")
    choice = choices[0]
    if openai and choice.get("token_ids") is None:
        raise MalformedResponseError(
            "choices[0].token_ids: missing; the engine ignored return_token_ids=true "
            "(needs vLLM or SGLang's /v1/completions with token-id support)"
        )
    ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
    # {"content": [{"logprob": x}, ...]}, or OpenAI's {"token_logprobs": [x, ...]}
    key, expected = (
        ("token_logprobs", "a list of floats") if openai else ("content", "a list of {'logprob': x} objects")
    )
    content = choice.get("logprobs")
    values = content.get(key) if isinstance(content, dict) else None
    if values is None and content is not None:
        values = _BAD
    elif not openai and isinstance(values, list):  # a malformed entry fails the numeric check
        values = [e.get("logprob") if isinstance(e, dict) else None for e in values]
    logprobs = _logprobs(values, ids, f"choices[0].logprobs.{key}", expected)
    stop = _stop_reason(choice.get("finish_reason"), "choices[0].finish_reason")
    result = RemoteGenerateResult(ids, logprobs, stop, None, {})
    # the embedded server sends it beside "choices"; an engine may put it on the choice
    version = choice.get("weight_version", body.value.get("weight_version"))
    result.weight_version = _weight_version(version, "weight_version")
    sglang = _take_routes(body, body.value.get("sglext"), "routed_experts") if openai else _MISSING
    vllm = _take_routes(body, choice, "routed_experts")
    if vllm in _ABSENT and sglang not in _ABSENT:  # SGLang's answer
        return result, "sglext.routed_experts", sglang, True
    where = "choices[0].routed_experts"  # SkyRL's or vLLM's (kept when both forms came: it has a shape)
    if openai and vllm in _ABSENT:
        where = f"{where} (vLLM) / sglext.routed_experts (SGLang)"
    return result, where, vllm, False


def _read_sglang(body: JsonBody) -> Read:
    """``sglang``: ``output_ids``, ``meta_info`` with logprobs and flat int32 routes."""
    ids = _int_list(body.value.get("output_ids"), "output_ids")
    meta = body.value.get("meta_info")
    if not isinstance(meta, dict):
        raise MalformedResponseError(f"meta_info: expected an object, got {type(meta).__name__}")
    values = meta.get("output_token_logprobs")  # [[logprob, token_id, text], ...]
    if isinstance(values, list):
        values = [v[0] if isinstance(v, list) and v else None for v in values]
    logprobs = _logprobs(values, ids, "meta_info.output_token_logprobs", "a list of [logprob, token_id, ...]")
    stop = _stop_reason(meta.get("finish_reason"), "meta_info.finish_reason")
    routes = _take_routes(body, meta, "routed_experts")
    version = _weight_version(meta.get("weight_version"), "meta_info.weight_version")
    result = RemoteGenerateResult(ids, logprobs, stop, None, {}, weight_version=version)
    return result, "meta_info.routed_experts", routes, True
