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
token is never forwarded). Dense layers come back as all-zero rows. The responses are parsed by
:mod:`r3lightning.wire.response`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3lightning.wire.codec import DEFAULT_MAX_BYTES

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

    ``None`` skips a check (``sglang`` needs ``num_layers`` and ``top_k`` to reshape);
    ``max_bytes`` caps one decoded array. ``check_unique`` also refuses rows that repeat an
    expert in the parse (a second pass, several times the decode; off by default because every
    route is checked for repeats when it becomes a ``Trajectory``).
    """

    num_layers: int | None = None
    top_k: int | None = None
    num_experts: int | None = None
    check_unique: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


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
