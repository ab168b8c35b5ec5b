"""Server side of the ``skyrl`` and ``sglang`` generate protocols (client side:
`r3lightning.wire.request`): request bodies -> requests, outputs -> response bodies. Every
parse error is a `RequestFieldError` naming the field, whatever the JSON value."""

from __future__ import annotations

from typing import Any

from r3lightning.app.serve.requests import GenerationOutput, GenerationRequest
from r3lightning.app.serve.sampling import MAX_SEED, SamplingParams
from r3lightning.checks import check_setting
from r3lightning.wire.codec import encode_flat_routes, encode_routes

PROTOCOLS = ("skyrl", "sglang")  # what the embedded server speaks (clients speak more)
PROMPT_FIELDS = {"skyrl": "token_ids", "sglang": "input_ids"}  # what each calls the prompt


class RequestFieldError(ValueError):
    """A request body field is missing or has a bad value; the message names the field."""


# SamplingParams field -> its names on the wire, per protocol (the first is the protocol's own)
_ALIASES = {
    "skyrl": {"max_new_tokens": ("max_tokens", "max_new_tokens"), "seed": ("seed",)},
    "sglang": {"max_new_tokens": ("max_new_tokens", "max_tokens"), "seed": ("sampling_seed", "seed")},
}
_PLAIN = ("temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos")  # same name everywhere
# keys that only shape text output (never produced here): any bool is accepted
_TEXT_ONLY_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"}
_TEXT_ONLY_KEYS.add("detokenize")
# keys accepted only at their no-op value (n: one request per sample; logprobs: always returned)
_NEUTRAL_VALUES: dict[str, tuple] = {"min_p": (0, 0.0), "min_tokens": (0,), "n": (1,), "stop": ([],)}
_NEUTRAL_VALUES |= {"repetition_penalty": (1, 1.0), "logprobs": (0, 1), "presence_penalty": (0, 0.0)}
_NEUTRAL_VALUES["frequency_penalty"] = (0, 0.0)
_SAMPLING_KEYS = {name for aliases in _ALIASES.values() for names in aliases.values() for name in names}
_SAMPLING_KEYS |= set(_PLAIN) | _TEXT_ONLY_KEYS | set(_NEUTRAL_VALUES)
# top-level keys per protocol (skyrl also reads the route fields inside sampling_params)
_BODY_KEYS = {"skyrl": {"token_ids", "model", "cache_salt"}, "sglang": {"input_ids", "return_logprob"}}
for _keys in _BODY_KEYS.values():
    _keys |= {"sampling_params", "return_routed_experts", "stream"}
_BODY_KEYS["sglang"].add("routed_experts_start_len")
_SKYRL_ROUTE_KEYS = {"routed_experts_prompt_start", "return_routed_experts"}


def _int(value: Any, field: str, **bounds: Any) -> int | None:
    try:
        check_setting(field, value, integer=True, **bounds)
    except ValueError as exc:
        raise RequestFieldError(str(exc)) from None
    return value


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise RequestFieldError(f"{field} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise RequestFieldError(f"{field} must be a list of token ids, got {type(value).__name__}")
    bad = next((i for i, t in enumerate(value) if type(t) is not int or t < 0), None)
    if bad is not None:
        raise RequestFieldError(f"{field}[{bad}] must be a non-negative integer token id, got {value[bad]!r}")
    return tuple(value)


def _check_keys(values: dict, known: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in values if key not in known)
    if unknown:
        raise RequestFieldError(f"{where} has unknown keys {unknown}; supported: {sorted(known)}")


def parse_sampling_params(
    params: dict, protocol: str, *, max_new_tokens_cap: int | None = None
) -> SamplingParams:
    """A request's ``sampling_params`` object as `SamplingParams`.

    Args:
        params: the decoded JSON object; the other protocol's names for a setting are aliases
            (``max_tokens`` / ``max_new_tokens``, ``sampling_seed`` / ``seed``).
        protocol: ``"skyrl"`` (which also reads its route keys here) or ``"sglang"``.
        max_new_tokens_cap: the server's cap on ``max_new_tokens`` (None: no cap).

    Returns:
        The sampling parameters.

    Raises:
        RequestFieldError: naming the field: an unknown key, a penalty or other no-op key away
            from its neutral value, two aliases with different values, a value out of range or
            over the cap.
    """
    known = _SAMPLING_KEYS | (_SKYRL_ROUTE_KEYS if protocol == "skyrl" else set())
    _check_keys(params, known, "sampling_params")
    for key in _TEXT_ONLY_KEYS & {k for k, v in params.items() if v is not None}:
        _bool(params[key], f"sampling_params.{key}")
    for key, neutral in _NEUTRAL_VALUES.items():
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or value not in neutral):
            raise RequestFieldError(
                f"sampling_params.{key} = {value!r} is not supported by this engine "
                f"(accepted: {' or '.join(repr(v) for v in neutral)})"
            )
    kwargs: dict[str, Any] = {key: params[key] for key in _PLAIN if params.get(key) is not None}
    if "stop_token_ids" in kwargs:
        kwargs["stop_token_ids"] = _token_ids(kwargs["stop_token_ids"], "sampling_params.stop_token_ids")
    for target, names in _ALIASES[protocol].items():
        given = [name for name in names if params.get(name) is not None]  # at most two names
        if len(given) == 2 and params[given[0]] != params[given[1]]:
            raise RequestFieldError(f"sampling_params sets both {given[0]} and {given[1]} differently")
        if not given:
            continue
        field = f"sampling_params.{given[0]}"
        cap = max_new_tokens_cap
        bounds = {"low": 0, "high": MAX_SEED} if target == "seed" else {"low": 1}
        value = _int(params[given[0]], field, **bounds)
        kwargs[target] = value
        if target == "max_new_tokens" and cap is not None and value > cap:
            raise RequestFieldError(f"{field} must be <= {cap} (this server's cap), got {value}")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # SamplingParams names its field; on the wire it is sampling_params.<field>
        raise RequestFieldError(f"sampling_params.{exc}") from None


def parse_generate_request(
    body: Any, protocol: str, *, max_prompt_tokens: int | None = None, max_new_tokens_cap: int | None = None
) -> GenerationRequest:
    """A decoded generate request body as a `GenerationRequest`.

    Args:
        body: the decoded JSON body.
        protocol: ``"skyrl"`` (routes are returned unless ``return_routed_experts`` is false, as
            SkyRL's server does) or ``"sglang"`` (routes only when asked for).
        max_prompt_tokens: the longest prompt the model's context leaves room for (None: any).
        max_new_tokens_cap: the server's cap on ``max_new_tokens`` (None: no cap).

    Returns:
        The request: prompt ids, sampling parameters, whether routes are wanted and their first
        prompt row.

    Raises:
        ValueError: ``protocol`` is not one of `PROTOCOLS`.
        RequestFieldError: naming the field: a body that is not an object, a missing or bad
            prompt, an unknown key, ``stream`` set, a bad route option or sampling parameter.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if not isinstance(body, dict):
        raise RequestFieldError(f"request body must be a JSON object, got {type(body).__name__}")
    prompt_field = PROMPT_FIELDS[protocol]
    if prompt_field not in body:
        hint = " (text prompts are not supported)" if "text" in body else ""
        raise RequestFieldError(f"{prompt_field} is required (the prompt as a list of token ids){hint}")
    _check_keys(body, _BODY_KEYS[protocol], "the request body")
    stream = body.get("stream")
    if stream not in (None, False):
        raise RequestFieldError(f"stream = {stream!r} is not supported by this server (accepted: false)")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise RequestFieldError(f"sampling_params must be a JSON object, got {type(sampling).__name__}")
    raw_prompt = body[prompt_field]
    if protocol == "skyrl":
        start_field = "sampling_params.routed_experts_prompt_start"
        start = sampling.get("routed_experts_prompt_start")
        wanted = body.get("return_routed_experts", sampling.get("return_routed_experts"))
        want_routes = True if wanted is None else _bool(wanted, "return_routed_experts")
    else:
        if isinstance(raw_prompt, list) and raw_prompt and isinstance(raw_prompt[0], list):
            raise RequestFieldError("input_ids must be one prompt (a flat list); send one request per prompt")
        start_field = "routed_experts_start_len"
        start = body.get("routed_experts_start_len")
        want_routes = _bool(body.get("return_routed_experts", False), "return_routed_experts")
    start = _int(start, start_field, low=0, optional=True)
    if isinstance(raw_prompt, list) and max_prompt_tokens is not None and len(raw_prompt) > max_prompt_tokens:
        raise RequestFieldError(
            f"{prompt_field} has {len(raw_prompt)} tokens, more than the {max_prompt_tokens} this "
            "server's model context leaves room for"
        )
    prompt = _token_ids(raw_prompt, prompt_field)
    if not prompt:
        raise RequestFieldError(f"{prompt_field} must not be empty")
    if start is not None and start > len(prompt):
        raise RequestFieldError(f"{start_field} must be <= the prompt length {len(prompt)}, got {start}")
    params = parse_sampling_params(sampling, protocol, max_new_tokens_cap=max_new_tokens_cap)
    return GenerationRequest(prompt, params, want_routes, start or 0)


def wants_logprobs(body: dict, protocol: str) -> bool:
    """Whether the response carries the sampled tokens' logprobs.

    Args:
        body: the decoded request body.
        protocol: ``"skyrl"`` (always) or ``"sglang"`` (when ``return_logprob`` is true).

    Raises:
        RequestFieldError: ``return_logprob`` is not a bool.
    """
    return protocol == "skyrl" or _bool(body.get("return_logprob", False), "return_logprob")


def build_response(
    output: GenerationOutput, protocol: str, *, request_id: str, model_name: str, logprobs: bool
) -> dict:
    """The JSON-ready response body of one generation in ``protocol``'s layout.

    Args:
        output: what the engine produced.
        protocol: ``"skyrl"`` (an OpenAI-style ``choices`` list) or ``"sglang"`` (``output_ids``
            and ``meta_info``).
        request_id: the response's id.
        model_name: the served model's name (skyrl's ``model``).
        logprobs: include the sampled tokens' logprobs.

    Returns:
        The body; routes ``[rows, L, K]``, when present, base64-encoded with their shape and dtype.
    """
    ids = output.token_ids
    routes = output.routed_experts
    version = output.weight_version
    pairs = list(zip(ids, output.logprobs, strict=True))
    usage = {"prompt_tokens": output.prompt_tokens, "completion_tokens": len(ids)}
    if protocol == "skyrl":
        content = [{"logprob": lp, "token_id": t} for t, lp in pairs]
        choice = {"index": 0, "token_ids": ids, "finish_reason": output.finish_reason}
        choice["stop_reason"] = output.stop_token_id
        choice["logprobs"] = {"content": content} if logprobs else None
        choice["routed_experts"] = None if routes is None else encode_routes(routes)  # [rows, L, K]
        response = {"id": request_id, "model": model_name, "choices": [choice], "usage": usage}
        return response | {"weight_version": version}
    finish = {"type": "length", "length": len(ids)}
    if output.finish_reason == "stop":
        finish = {"type": "stop", "matched": output.stop_token_id}
    meta: dict[str, Any] = {"id": request_id, "finish_reason": finish, **usage, "weight_version": version}
    if logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in pairs]
    if routes is not None:
        meta["routed_experts"] = encode_flat_routes(routes)
    return {"text": "", "output_ids": ids, "meta_info": meta}
