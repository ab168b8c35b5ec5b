"""What the generation engine is asked (`GenerationRequest`) and what it answers
(`GenerationOutput`): the types the engine, the wire protocols and in-process callers share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from r3lightning.app.serve.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue; ``routed_experts_prompt_start``: the first route row to return."""

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0


@dataclass
class GenerationOutput:
    """What one request produced. ``logprobs[i]``: float32 log-probability of ``token_ids[i]``
    before top-k / top-p (``log_softmax(logits / temperature)``; raw logits when greedy).
    ``routed_experts``: ``[prompt_tokens - prompt_start + len(token_ids) - 1, L, K]`` or None."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_token_id: int | None
    prompt_tokens: int
    routed_experts: np.ndarray | None = None
    weight_version: int = 0  # engine.weight_version the tokens were sampled with
