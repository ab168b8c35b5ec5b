"""Server side of the two generate protocols: request bodies -> requests, outputs -> response bodies.

The client side (request bodies out, responses parsed) is :mod:`r3lightning.wire.request`.

``skyrl`` (``POST /skyrl/v1/generate``, vLLM sampling-parameter names) and ``sglang``
(``POST /generate``) differ only in field names and response layout; both map onto one
:class:`~r3lightning.serve.engine.GenerationRequest`. Every parse error is a
:class:`RequestFieldError` whose message names the offending field (the server answers 400).
"""

from __future__ import annotations

import math
from typing import Any

from r3lightning.serve.engine import GenerationOutput, GenerationRequest
from r3lightning.serve.sampling import MAX_SEED, SamplingParams
from r3lightning.wire.codec import encode_flat_routes, encode_routes

PROTOCOLS = ("skyrl", "sglang")  # what the embedded server speaks (clients speak more)


class RequestFieldError(ValueError):
    """A request body field is missing or has a bad value; the message names the field."""


# sampling-parameter name on the wire -> SamplingParams field, per protocol (first name wins)
_SAMPLING_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "skyrl": {
        "max_new_tokens": ("max_tokens", "max_new_tokens"),
        "seed": ("seed",),
    },
    "sglang": {
        "max_new_tokens": ("max_new_tokens", "max_tokens"),
        "seed": ("sampling_seed", "seed"),
    },
}


def _int(
    value: Any, field: str, *, low: int | None = None, high: int | None = None, allow_none: bool = False
) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestFieldError(f"{field} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise RequestFieldError(f"{field} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise RequestFieldError(f"{field} must be <= {high}, got {value}")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestFieldError(f"{field} must be a finite number, got {value!r}")
    return float(value)


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise RequestFieldError(f"{field} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise RequestFieldError(f"{field} must be a list of token ids, got {type(value).__name__}")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise RequestFieldError(f"{field}[{i}] must be a non-negative integer token id, got {token!r}")
    return tuple(value)


def _object(value: Any, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestFieldError(f"{field} must be a JSON object, got {type(value).__name__}")
    return value


# Keys accepted with any value of the right type because they only shape text output, which
# these token-in, token-out protocols never produce.
_TEXT_ONLY_KEYS = frozenset(
    {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize"}
)
# Keys accepted only with the value that leaves sampling unchanged: any other value asks for
# something this engine does not do, which must not pass silently.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "repetition_penalty": (1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "stop": ([],),
    "logprobs": (0, 1),  # the sampled token's logprob is always returned (skyrl)
}
_SAMPLING_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n"}
    | {name for names in _SAMPLING_NAMES["skyrl"].values() for name in names}
    | {name for names in _SAMPLING_NAMES["sglang"].values() for name in names}
)
# skyrl carries the route fields inside sampling_params
_SKYRL_ROUTE_KEYS = frozenset({"routed_experts_prompt_start", "return_routed_experts"})
# top-level request keys per protocol (plus "stream", accepted only as false)
_BODY_KEYS = {
    "skyrl": frozenset({"token_ids", "sampling_params", "model", "cache_salt", "return_routed_experts"}),
    "sglang": frozenset(
        {
            "input_ids",
            "sampling_params",
            "return_logprob",
            "return_routed_experts",
            "routed_experts_start_len",
        }
    ),
}


def _check_body_keys(body: dict, protocol: str) -> None:
    known = _BODY_KEYS[protocol] | {"stream"}
    unknown = sorted(str(key) for key in body if key not in known)
    if unknown:
        raise RequestFieldError(f"request body has unknown keys {unknown}; supported: {sorted(known)}")
    if body.get("stream") not in (None, False):
        raise RequestFieldError(
            f"stream = {body['stream']!r} is not supported by this server (accepted: false)"
        )


def _check_keys(params: dict, protocol: str) -> None:
    known = _SAMPLING_KEYS | _TEXT_ONLY_KEYS | set(_NEUTRAL_VALUES)
    if protocol == "skyrl":
        known |= _SKYRL_ROUTE_KEYS
    unknown = sorted(str(key) for key in params if key not in known)
    if unknown:
        raise RequestFieldError(f"sampling_params has unknown keys {unknown}; supported: {sorted(known)}")
    for key in _TEXT_ONLY_KEYS & params.keys():
        if params[key] is not None:
            _bool(params[key], f"sampling_params.{key}")
    for key, neutral in _NEUTRAL_VALUES.items():
        value = params.get(key)
        if value is not None and (
            isinstance(value, bool) != isinstance(neutral[0], bool) or value not in neutral
        ):
            raise RequestFieldError(
                f"sampling_params.{key} = {value!r} is not supported by this engine "
                f"(accepted: {' or '.join(repr(v) for v in neutral)})"
            )


def parse_sampling_params(
    params: dict, protocol: str, *, max_new_tokens_cap: int | None = None
) -> SamplingParams:
    """``sampling_params`` of a request -> :class:`SamplingParams`; unknown keys are refused.

    Names follow the protocol (``max_tokens`` / ``seed`` for skyrl, ``max_new_tokens`` /
    ``sampling_seed`` for sglang; the other protocol's name is accepted as an alias). Keys that
    only shape text output are accepted; penalties and the like only at their neutral value.
    ``max_new_tokens_cap``: the server's cap on the requested length (a larger request is refused,
    so one long generation cannot hold a batch for the whole context).
    """
    _check_keys(params, protocol)
    kwargs: dict[str, Any] = {}
    for target, names in _SAMPLING_NAMES[protocol].items():
        given = [name for name in names if params.get(name) is not None]
        if any(params[name] != params[given[0]] for name in given[1:]):
            raise RequestFieldError(f"sampling_params sets both {given[0]} and {given[1]} differently")
        if given:
            field = f"sampling_params.{given[0]}"
            if target == "seed":
                kwargs[target] = _int(params[given[0]], field, low=0, high=MAX_SEED)
            else:
                kwargs[target] = _int(params[given[0]], field, low=1)
                if max_new_tokens_cap is not None and kwargs[target] > max_new_tokens_cap:
                    raise RequestFieldError(
                        f"{field} must be <= {max_new_tokens_cap} (this server's cap), got {kwargs[target]}"
                    )
    if params.get("temperature") is not None:
        kwargs["temperature"] = _number(params["temperature"], "sampling_params.temperature")
    if params.get("top_p") is not None:
        kwargs["top_p"] = _number(params["top_p"], "sampling_params.top_p")
    if params.get("top_k") is not None:
        kwargs["top_k"] = _int(params["top_k"], "sampling_params.top_k")
    if params.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = _token_ids(params["stop_token_ids"], "sampling_params.stop_token_ids")
    if params.get("ignore_eos") is not None:
        kwargs["ignore_eos"] = _bool(params["ignore_eos"], "sampling_params.ignore_eos")
    if params.get("n") is not None and _int(params["n"], "sampling_params.n") != 1:
        raise RequestFieldError(
            f"sampling_params.n must be 1 (send one request per sample), got {params['n']}"
        )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        # SamplingParams names its own fields; the wire name is sampling_params.<field>
        raise RequestFieldError(f"sampling_params.{exc}") from None


def parse_generate_request(
    body: Any,
    protocol: str,
    *,
    max_prompt_tokens: int | None = None,
    max_new_tokens_cap: int | None = None,
) -> GenerationRequest:
    """A decoded JSON request body of ``protocol`` -> :class:`GenerationRequest`.

    ``max_prompt_tokens`` refuses longer prompts before looking at their ids, so an oversized
    prompt costs one ``len``; ``max_new_tokens_cap`` is passed to :func:`parse_sampling_params`.
    skyrl returns routes unless ``return_routed_experts`` is false (as SkyRL's own server does
    when it records them); ``routed_experts_prompt_start`` only narrows them.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if not isinstance(body, dict):
        raise RequestFieldError(f"request body must be a JSON object, got {type(body).__name__}")
    prompt_field = "token_ids" if protocol == "skyrl" else "input_ids"
    if prompt_field not in body:
        hint = " (text prompts are not supported)" if "text" in body else ""
        raise RequestFieldError(f"{prompt_field} is required (the prompt as a list of token ids){hint}")
    _check_body_keys(body, protocol)
    sampling = _object(body.get("sampling_params"), "sampling_params")
    raw_prompt = body[prompt_field]
    if protocol == "skyrl":
        start_field = "sampling_params.routed_experts_prompt_start"
        start = _int(sampling.get("routed_experts_prompt_start"), start_field, low=0, allow_none=True)
        wanted = body.get("return_routed_experts", sampling.get("return_routed_experts"))
        want_routes = True if wanted is None else _bool(wanted, "return_routed_experts")
    else:
        if isinstance(raw_prompt, list) and raw_prompt and isinstance(raw_prompt[0], list):
            raise RequestFieldError("input_ids must be one prompt (a flat list); send one request per prompt")
        start_field = "routed_experts_start_len"
        start = _int(body.get("routed_experts_start_len"), start_field, low=0, allow_none=True)
        want_routes = _bool(body.get("return_routed_experts", False), "return_routed_experts")
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
    return GenerationRequest(
        prompt_ids=prompt,
        params=parse_sampling_params(sampling, protocol, max_new_tokens_cap=max_new_tokens_cap),
        return_routed_experts=want_routes,
        routed_experts_prompt_start=start or 0,
    )


def wants_logprobs(body: dict, protocol: str) -> bool:
    """sglang sends ``return_logprob``; skyrl responses always carry the sampled tokens' logprobs."""
    return protocol == "skyrl" or _bool(body.get("return_logprob", False), "return_logprob")


def build_response(
    output: GenerationOutput, protocol: str, *, request_id: str, model_name: str, logprobs: bool
) -> dict:
    """The JSON-ready response body of one generation in ``protocol``'s layout."""
    routes = output.routed_experts  # [rows, L, K] or None
    completion = len(output.token_ids)
    if protocol == "skyrl":
        return {
            "id": request_id,
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "token_ids": output.token_ids,
                    "finish_reason": output.finish_reason,
                    "stop_reason": output.stop_token_id,
                    "logprobs": (
                        {
                            "content": [
                                {"logprob": lp, "token_id": t}
                                for t, lp in zip(output.token_ids, output.logprobs, strict=True)
                            ]
                        }
                        if logprobs
                        else None
                    ),
                    "routed_experts": None if routes is None else encode_routes(routes),
                }
            ],
            "usage": {"prompt_tokens": output.prompt_tokens, "completion_tokens": completion},
            "weight_version": output.weight_version,
        }
    if output.finish_reason == "stop":
        finish = {"type": "stop", "matched": output.stop_token_id}
    else:
        finish = {"type": "length", "length": completion}
    meta: dict[str, Any] = {
        "id": request_id,
        "finish_reason": finish,
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": completion,
        "weight_version": output.weight_version,
    }
    if logprobs:
        meta["output_token_logprobs"] = [
            [lp, t, None] for t, lp in zip(output.token_ids, output.logprobs, strict=True)
        ]
    if routes is not None:
        meta["routed_experts"] = encode_flat_routes(routes)
    return {"text": "", "output_ids": output.token_ids, "meta_info": meta}
