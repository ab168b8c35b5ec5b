"""Client side of the generate protocols, responses: a 2xx body in, a checked result out.

Each protocol's fields are read where its engine writes them (the sources are listed in
:mod:`r3lightning.wire.request`): token ids, logprobs, the stop reason and, when
asked for, the routes. The rows cover token positions ``[start, P + G - 1)``; routes asked for
but absent, or of another row count, raise :class:`MalformedResponseError`.

Bodies are parsed once with :func:`~r3lightning.wire.json_body.parse_body_with`, so the base64
route string is never materialised as a ``str`` and decodes straight into the route array while
a helper thread reads the fields; the decode also checks the routes in the same pass where it can
(:func:`_route_decoder`). Every deviation raises :class:`MalformedResponseError` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from r3lightning.routes import WIRE_DTYPES, compact_dtype
from r3lightning.wire.codec import (
    Payload,
    decode_flat_routes,
    decode_npy_routes,
    decode_routes,
    read_npy_header,
)
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.json_body import ParsedBody, PayloadDecoder, parse_body_with
from r3lightning.wire.request import ENGINE_ROUTES_FLAG, RemoteGenerateResult, RouteSchema
from r3lightning.wire.route_decode import DecodedPayload, RowCheck, decode_payload

__all__ = ["parse_response"]


def parse_response(
    raw: bytes,
    protocol: str,
    schema: RouteSchema,
    *,
    want_routes: bool,
    prompt_len: int | None = None,
    start: int = 0,
) -> RemoteGenerateResult:
    """Parse a 2xx generate body; routes are decoded and validated only when ``want_routes``.

    With ``prompt_len`` the route row count must be ``prompt_len - start + G - 1`` (``G`` = the
    response length). Cost: an orjson parse of the body's non-route part, and (when wanted) one
    base64 decode of the routes, done while parsing the body (see
    :func:`~r3lightning.wire.json_body.parse_body`), which also checks them where the fused
    kernel runs (:func:`_route_decoder`); elsewhere, one validation pass
    (:func:`~r3lightning.wire.route_check.validate_routes`). Without routes, one ``memchr``
    scan skips the payload.
    """
    parse_fields = {"sglang": _parse_sglang, "openai": _parse_openai}.get(protocol, _parse_choices)

    def fields(parsed: ParsedBody) -> tuple[RemoteGenerateResult, str, RoutesJob]:
        if not isinstance(parsed.value, dict):
            raise MalformedResponseError(
                f"response body: expected a JSON object, got {type(parsed.value).__name__}"
            )
        return parse_fields(parsed, schema, want_routes)

    # the fields are read on a helper thread while this one decodes the route payload
    decode = _route_decoder(protocol, schema) if want_routes else False
    parsed, (result, where, routes) = parse_body_with(raw, fields, decode=decode)
    if routes is not None:
        result.routed_experts = routes()
    if want_routes:
        _check_rows(result, where, prompt_len, start)
    result.raw_response = parsed.restore()
    return result


# base64 of the .npy magic b"\x93NUMPY": how a vLLM payload starts
_NPY_MAGIC_BASE64 = b"k05VTVBZ"


def _route_decoder(protocol: str, schema: RouteSchema) -> PayloadDecoder:
    """A payload decoder that also checks the routes in the same pass
    (:func:`~r3lightning.wire.route_decode.decode_payload`), under the row layout the wire
    decoder will find: read ahead from a ``.npy`` payload's header, else expected from the
    protocol and the schema. A wrong expectation costs only the fused check's own time: the
    wire decoder then checks the routes itself."""

    def decode(text: memoryview) -> DecodedPayload:
        rows, rows_from = _expected_rows(protocol, schema, text)
        return decode_payload(text, rows, rows_from)

    return decode


def _expected_rows(protocol: str, schema: RouteSchema, text: memoryview) -> tuple[RowCheck | None, int]:
    """The row check for a route payload, and the byte its rows start at."""
    if text[: len(_NPY_MAGIC_BASE64)] == _NPY_MAGIC_BASE64:  # vLLM's .npy, on either protocol
        try:
            offset, dtype, shape = read_npy_header(text, "routes")
        except MalformedResponseError:
            return None, 0  # the wire decoder reports it
        return RowCheck.of(dtype, shape[-1] if shape else None, schema.num_experts), offset
    if protocol in ("skyrl", "vllm"):  # an ndarray envelope, in the encoder's compact dtype
        dtype = compact_dtype(schema.num_experts - 1) if schema.num_experts else WIRE_DTYPES["uint8"]
        return RowCheck.of(dtype, schema.top_k, schema.num_experts), 0
    # SGLang's flat int32 (sglang, and sglext on the OpenAI endpoint)
    return RowCheck.of(WIRE_DTYPES["int32"], schema.top_k, schema.num_experts), 0


def _absent(where: str, value: Any) -> MalformedResponseError:
    state = "missing" if value is _MISSING else "null"
    return MalformedResponseError(
        f"{where}: routes were requested but the field is {state}; start the engine with "
        f"{ENGINE_ROUTES_FLAG} (vLLM, SGLang, SkyRL's vLLM server), and for SGLang also send "
        "return_routed_experts=true"
    )


def _check_rows(result: RemoteGenerateResult, where: str, prompt_len: int | None, start: int) -> None:
    if result.routed_experts is None:
        raise _absent(where, None)
    if prompt_len is None:
        return
    generated = len(result.response_ids)
    expected = max(0, prompt_len - start + generated - 1)
    rows = result.routed_experts.shape[0]
    if rows != expected:
        raise MalformedResponseError(
            f"{where}: {rows} route rows, expected P - start + G - 1 = {prompt_len} - {start} + "
            f"{generated} - 1 = {expected} (rows cover positions [start, P + G - 1))"
        )


_MISSING = object()


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


def _take(parsed: ParsedBody, container: dict[str, Any], key: str, field: str, want: bool) -> Payload | None:
    """The payload at ``container[key]`` if wanted; leaves None in its place in the raw response."""
    value, container[key] = container[key], None
    if not want:
        parsed.discard(value)
        return None
    return parsed.payload(value, field)


# Decodes a response's routes once its payload bytes are in (see parse_body_with); None when
# routes were not asked for.
RoutesJob = Callable[[], np.ndarray] | None


def _routes_job(
    parsed: ParsedBody,
    container: dict[str, Any],
    key: str,
    field: str,
    want: bool,
    decode: Callable[[Payload], np.ndarray],
) -> RoutesJob:
    """``decode`` of the payload at ``container[key]``, deferred; an unwanted one is let go now."""
    if not want:
        _take(parsed, container, key, field, want=False)
        return None
    return lambda: decode(_take(parsed, container, key, field, want=True))


def _first_choice(parsed: ParsedBody) -> dict[str, Any]:
    choices = parsed.value.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponseError("choices: expected a non-empty list of choice objects")
    for other in choices[1:]:  # one result per call: never materialise the others' routes
        if not isinstance(other, dict):
            continue
        routes = other.get("routed_experts")
        if isinstance(routes, dict) and "data" in routes:
            _take(parsed, routes, "data", "", want=False)
        elif isinstance(routes, str):
            _take(parsed, other, "routed_experts", "", want=False)
    return choices[0]


def _choice_routes(
    parsed: ParsedBody, choice: dict[str, Any], schema: RouteSchema, want: bool, where: str
) -> RoutesJob:
    """``choice["routed_experts"]``: a SkyRL ndarray envelope or vLLM's base64 ``.npy`` string."""
    routes = choice.get("routed_experts", _MISSING)
    if isinstance(routes, dict):
        if "data" not in routes:  # fails in decode_routes, naming the key
            return (lambda: decode_routes(routes, **schema.decode_kwargs(), field=where)) if want else None

        def decode_envelope(data: Payload) -> np.ndarray:
            return decode_routes({**routes, "data": data}, **schema.decode_kwargs(), field=where)

        return _routes_job(parsed, routes, "data", f"{where}.data", want, decode_envelope)
    if routes is None or routes is _MISSING:
        if want:
            raise _absent(where, routes)
        return None
    if not isinstance(routes, str):
        if not want:
            return None
        raise MalformedResponseError(
            f"{where}: expected an ndarray envelope (SkyRL) or a base64 .npy string (vLLM), "
            f"got {type(routes).__name__}"
        )
    return _routes_job(
        parsed,
        choice,
        "routed_experts",
        where,
        want,
        lambda data: decode_npy_routes(data, **schema.decode_kwargs(), field=where),
    )


def _parse_choices(
    parsed: ParsedBody, schema: RouteSchema, want_routes: bool
) -> tuple[RemoteGenerateResult, str, RoutesJob]:
    """``skyrl`` and ``vllm``: ``choices[0]`` with ``token_ids``, ``logprobs.content`` and routes."""
    choice = _first_choice(parsed)
    ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
    stop = _stop_reason(choice.get("finish_reason"), "choices[0].finish_reason")
    logprobs = None
    content = choice.get("logprobs")
    if content is not None:
        entries = content.get("content") if isinstance(content, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise MalformedResponseError(
                "choices[0].logprobs.content: expected a list of {'logprob': x} objects"
            )
        logprobs = _float_list([e.get("logprob") for e in entries], len(ids), "choices[0].logprobs.content")
    where = "choices[0].routed_experts"
    routes = _choice_routes(parsed, choice, schema, want_routes, where)
    return RemoteGenerateResult(ids, logprobs, stop, None, {}), where, routes


def _flat_routes(data: Payload, schema: RouteSchema, field: str) -> np.ndarray:
    if schema.num_layers is None or schema.top_k is None:
        raise ValueError("SGLang's flat routes need num_layers and top_k to be reshaped")
    return decode_flat_routes(data, **schema.decode_kwargs(), field=field)


def _parse_sglang(
    parsed: ParsedBody, schema: RouteSchema, want_routes: bool
) -> tuple[RemoteGenerateResult, str, RoutesJob]:
    body = parsed.value
    ids = _int_list(body.get("output_ids"), "output_ids")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise MalformedResponseError(f"meta_info: expected an object, got {type(meta).__name__}")
    stop = _stop_reason(meta.get("finish_reason"), "meta_info.finish_reason")
    logprobs = None
    entries = meta.get("output_token_logprobs")
    if entries is not None:
        if not isinstance(entries, list) or not all(isinstance(e, list) and e for e in entries):
            raise MalformedResponseError(
                "meta_info.output_token_logprobs: expected a list of [logprob, token_id, ...]"
            )
        logprobs = _float_list([e[0] for e in entries], len(ids), "meta_info.output_token_logprobs")
    where = "meta_info.routed_experts"
    routes = None
    value = meta.get("routed_experts", _MISSING)
    if value is None or value is _MISSING:
        if want_routes:
            raise _absent(where, value)
    else:
        routes = _routes_job(
            parsed, meta, "routed_experts", where, want_routes, lambda data: _flat_routes(data, schema, where)
        )
    return RemoteGenerateResult(ids, logprobs, stop, None, {}), where, routes


def _parse_openai(
    parsed: ParsedBody, schema: RouteSchema, want_routes: bool
) -> tuple[RemoteGenerateResult, str, RoutesJob]:
    """``/v1/completions`` of vLLM (per-choice ``.npy`` routes) or SGLang (``sglext`` int32)."""
    choice = _first_choice(parsed)
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise MalformedResponseError(
            "choices[0].token_ids: missing; the engine ignored return_token_ids=true "
            "(needs vLLM or SGLang's /v1/completions with token-id support)"
        )
    ids = _int_list(token_ids, "choices[0].token_ids")
    stop = _stop_reason(choice.get("finish_reason"), "choices[0].finish_reason")
    logprobs = None
    content = choice.get("logprobs")
    if content is not None:
        values = content.get("token_logprobs") if isinstance(content, dict) else None
        if not isinstance(values, list):
            raise MalformedResponseError("choices[0].logprobs.token_logprobs: expected a list of floats")
        logprobs = _float_list(values, len(ids), "choices[0].logprobs.token_logprobs")
    sglext = parsed.value.get("sglext")
    sglang_routes = sglext.get("routed_experts") if isinstance(sglext, dict) else None
    vllm_routes = choice.get("routed_experts")
    if sglang_routes is not None and vllm_routes is None:  # SGLang's answer
        where = "sglext.routed_experts"
        routes = _routes_job(
            parsed,
            sglext,
            "routed_experts",
            where,
            want_routes,
            lambda data: _flat_routes(data, schema, where),
        )
        return RemoteGenerateResult(ids, logprobs, stop, None, {}), where, routes
    if sglang_routes is not None:  # both forms: keep vLLM's, which carries its own shape
        _take(parsed, sglext, "routed_experts", "", want=False)
    where = "choices[0].routed_experts"
    if want_routes and vllm_routes is None:
        raise _absent(
            f"{where} (vLLM) / sglext.routed_experts (SGLang)", choice.get("routed_experts", _MISSING)
        )
    routes = _choice_routes(parsed, choice, schema, want_routes, where)
    return RemoteGenerateResult(ids, logprobs, stop, None, {}), where, routes
