"""What the generation engine is asked (`GenerationRequest`) and what it answers
(`GenerationOutput`): the types the engine, the wire protocols and in-process callers share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from r3lightning.app.serve.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue.

    Attributes:
        prompt_ids: the prompt's token ids (at least one, each below the model's vocabulary size).
        params: how to sample (temperature, top-k / top-p, token budget, stops, seed).
        return_routed_experts: return the experts every forwarded token was routed to.
        routed_experts_prompt_start: the first prompt row of those routes, in
            ``[0, len(prompt_ids)]`` (``len(prompt_ids)``: the response's rows only).
    """

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0


@dataclass
class GenerationOutput:
    """What one request produced.

    Attributes:
        token_ids: the sampled tokens, the stop token included when one ended the answer.
        logprobs: per sampled token, its float32 log-probability before top-k / top-p:
            ``log_softmax(logits / temperature)``, or ``log_softmax(logits)`` when greedy.
        finish_reason: ``"stop"`` (a stop or EOS token) or ``"length"`` (the token budget or the
            model's context ran out).
        stop_token_id: the token that stopped it, or None.
        prompt_tokens: the prompt's length.
        routed_experts: ``[prompt_tokens - prompt_start + len(token_ids) - 1, L, K]`` expert ids
            (the last sampled token is never forwarded), or None when not asked for.
        weight_version: the engine's `weight_version` the tokens were sampled with.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_token_id: int | None
    prompt_tokens: int
    routed_experts: np.ndarray | None = None
    weight_version: int = 0
