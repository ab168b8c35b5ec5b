"""Client side of the generate protocols: request bodies out, parsed results in.

Where every field comes from (read from the engines' own sources: vLLM 0.33.0, SGLang 0.5.23):

- ``skyrl``: ``POST /skyrl/v1/generate`` with ``{"token_ids", "sampling_params", "model"?,
  "cache_salt"?}``. Routes are asked for by ``sampling_params.routed_experts_prompt_start``
  (0 = from the first token) and come back in ``choices[0].routed_experts`` as an ndarray
  envelope; logprobs in ``choices[0].logprobs.content[i].logprob``.
- ``vllm``: vLLM's token-in ``POST /inference/v1/generate`` (``GenerateRequest`` /
  ``GenerateTokensResponse`` in ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``;
  the server needs ``--tokens-only`` or ``--enable-scale-out``). Request laid out like
  ``skyrl``; the start goes in ``sampling_params.routed_experts_prompt_start`` (a
  ``SamplingParams`` field). Logprobs are only sent when ``sampling_params.logprobs`` is set
  (0 = the sampled token only, which the client sends unless given), as
  ``choices[0].logprobs.content[i].logprob`` (``GenerateLogProbsContent``; ``-9999.0`` when the
  engine had none). Routes in ``choices[0].routed_experts``: ONE base64 string of a ``.npy``
  file (``vllm/utils/serial_utils.py: numpy2base64``), uint8 for <= 256 experts else uint16
  (``RoutedExpertsCapturer.output_dtype``), shape ``[rows, num_hidden_layers, top_k]``;
  ``null`` when the server was started without ``--enable-return-routed-experts`` (routes are
  server-wide: there is no per-request switch).
- ``sglang``: ``POST /generate`` with ``{"input_ids", "sampling_params", "return_logprob",
  "return_routed_experts", "routed_experts_start_len"?}`` (``GenerateReqInput``). Routes come
  back in ``meta_info.routed_experts`` as base64 flat C-order int32 without a shape
  (``detokenizer_manager._b64_encode_per_request``), reshaped with ``(num_layers, top_k)``;
  logprobs in ``meta_info.output_token_logprobs[i][0]`` (``(logprob, token_id, text)``).
- ``openai``: ``POST /v1/completions`` with a token-id ``prompt`` and the sampling parameters at
  the top level, ``logprobs`` (0 unless given) and ``return_token_ids: true`` (both engines; the
  ids come back in ``choices[0].token_ids``, logprobs in ``choices[0].logprobs.token_logprobs``).
  vLLM reads a top-level ``routed_experts_prompt_start`` and answers with per-choice
  ``choices[0].routed_experts`` (the ``.npy`` string above); SGLang reads
  ``return_routed_experts`` and ``routed_experts_start_len`` and answers with the response-level
  ``sglext.routed_experts`` (flat int32, first result only; ``SglExt`` in
  ``sglang/srt/entrypoints/openai/protocol.py``). The request carries both engines' fields
  unless ``engine`` names one (vLLM logs the other's as ignored; SGLang drops them silently);
  the parser recognises both answers.

In every protocol the rows cover token positions ``[start, P + G - 1)``: ``P - start + G - 1``
rows for a prompt of ``P`` tokens, ``G`` generated tokens and start ``start`` (the last sampled
token is never forwarded). Dense layers come back as all-zero rows. Routes asked for but absent,
or of another row count, raise :class:`MalformedResponseError`.

Bodies are parsed once with :func:`~r3lightning.rollout.wire.parse_body`, so the base64 route
string is never materialised as a ``str`` and decodes straight into the route array. Every
deviation raises :class:`MalformedResponseError` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import MalformedResponseError
from .json_body import ParsedBody, parse_body_with
from .wire import DEFAULT_MAX_BYTES, Payload, decode_flat_routes, decode_npy_routes, decode_routes

__all__ = [
    "ENGINE_ROUTES_FLAG",
    "PROTOCOL_PATHS",
    "RemoteGenerateResult",
    "RouteSchema",
    "build_request",
    "engine_sampling_params",
    "parse_response",
]

PROTOCOL_PATHS = {
    "skyrl": "/skyrl/v1/generate",
    "vllm": "/inference/v1/generate",
    "sglang": "/generate",
    "openai": "/v1/completions",
}
ENGINES = ("vllm", "sglang")
# the server flag of vLLM, SGLang (and SkyRL's vLLM-backed server) that turns route capture on
ENGINE_ROUTES_FLAG = "--enable-return-routed-experts"


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

    def decode_kwargs(self) -> dict[str, Any]:
        """The checks as keyword arguments of the wire decoders (``decode_routes`` and kin)."""
        return {
            "num_experts": self.num_experts,
            "num_layers": self.num_layers,
            "top_k": self.top_k,
            "check_unique": self.check_unique,
            "max_bytes": self.max_bytes,
        }


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
    """Sampling parameters in ``protocol``'s own field names (for ``generate``'s ``sampling_params``).

    Stop conditions from the tokenizer go to the engine here: ``stop_token_ids`` (e.g. the EOS
    ids of a chat template's end-of-turn tokens) and ``ignore_eos``. Every engine spells those
    two the same; the length and the seed differ: SGLang's ``/generate`` takes
    ``max_new_tokens`` / ``sampling_seed`` (``SamplingParams``), vLLM's ``/inference/v1/generate``,
    SkyRL and both engines' ``/v1/completions`` take ``max_tokens`` / ``seed``.
    """
    if protocol not in PROTOCOL_PATHS:
        raise ValueError(f"protocol must be one of {sorted(PROTOCOL_PATHS)}, got {protocol!r}")
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    params: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    if protocol == "sglang":
        params["max_new_tokens"] = max_new_tokens
        if seed is not None:
            params["sampling_seed"] = seed
    else:
        params["max_tokens"] = max_new_tokens
        if seed is not None:
            params["seed"] = seed
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
    """The JSON request body of ``protocol`` (``sampling_params`` is passed through as given,
    nested or, for ``openai``, at the top level). ``engine`` (``"vllm"`` / ``"sglang"``) narrows
    the ``openai`` route fields to that engine's."""
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
        body = {
            "input_ids": prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            "return_routed_experts": return_routed_experts,
        }
        if return_routed_experts and routed_experts_prompt_start is not None:
            body["routed_experts_start_len"] = start
        return body
    else:
        reserved = {"prompt", "return_token_ids", "stream", "n", "echo", "model", "cache_salt"}
        clash = sorted(reserved & set(params))
        if clash:
            raise ValueError(
                f"sampling_params must not set {clash} for protocol='openai' (the client sets them)"
            )
        body = {"prompt": prompt_ids, **params, "return_token_ids": True, "stream": False}
        body.setdefault("logprobs", 0)
        if return_routed_experts:
            if engine in (None, "vllm"):
                body["routed_experts_prompt_start"] = start
            if engine in (None, "sglang"):
                body["return_routed_experts"] = True
                body["routed_experts_start_len"] = start
    if model is not None:
        body["model"] = model
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


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
    :func:`~r3lightning.rollout.json_body.parse_body`), plus one validation pass
    (:func:`~r3lightning.rollout.route_check.validate_routes`). Without routes, one ``memchr``
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
    parsed, (result, where, routes) = parse_body_with(raw, fields, decode=want_routes)
    if routes is not None:
        result.routed_experts = routes()
    if want_routes:
        _check_rows(result, where, prompt_len, start)
    result.raw_response = parsed.restore()
    return result


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
