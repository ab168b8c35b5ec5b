"""Per-request sampling: each row of a batch with its request's parameters and seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from r3lightning.checks import check_setting

MAX_SEED = 2**63 - 1
# float32 logits divided by a temperature under 1e-3 overflow to inf (1e-300 is 0 in float32)
TEMPERATURE_RANGE = (1e-3, 1e3)
MAX_TOP_K = 2**31 - 1  # beyond any vocabulary only disables the filter; the bound keeps a C int


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: ``temperature`` 0 is greedy; ``top_k <= 0`` and ``top_p == 1`` are
    off; it stops after ``max_new_tokens`` (``"length"``) or at a sampled token of ``stop_token_ids``
    or, unless ``ignore_eos``, EOS (``"stop"``, token kept); ``seed`` None: the engine's."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        check_setting("max_new_tokens", self.max_new_tokens, low=1, integer=True)
        check_setting("top_k", self.top_k, low=-1, high=MAX_TOP_K, integer=True)
        check_setting("temperature", self.temperature, low=0)
        low, high = TEMPERATURE_RANGE
        if self.temperature != 0 and not low <= self.temperature <= high:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{low:g}, {high:g}] (smaller values overflow "
                f"float32 logits), got {self.temperature!r}"
            )
        check_setting("top_p", self.top_p, low=0, above=True, high=1.0)
        for token in self.stop_token_ids:
            check_setting("stop_token_ids", token, low=0, integer=True)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.seed is not None:
            check_setting("seed", self.seed, low=0, high=MAX_SEED, integer=True)


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token.

    Args:
        logits: float32 ``[V]``, the last position's.
        params: temperature (0: greedy argmax), top-k and top-p.
        generator: the request's RNG (on ``logits``' device); untouched when greedy.

    Returns:
        ``(token, logprob)``: the token and its log-probability under ``log_softmax(logits /
        temperature)`` (temperature 1 when greedy), before top-k / top-p filtering. Cost: two host
        syncs, and a ``[V]`` sort when ``top_p < 1``.
    """
    if params.temperature == 0.0:
        token = int(logits.argmax())
        return token, float(logits.log_softmax(-1)[token])
    filtered = scaled = logits / params.temperature  # [V]
    logprobs = scaled.log_softmax(-1)
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        filtered = filtered.masked_fill(filtered < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = filtered.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass strictly before it already reaches top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        filtered = filtered.masked_fill(drop_sorted.scatter(0, order, drop_sorted), -math.inf)
    token = int(torch.multinomial(filtered.softmax(-1), 1, generator=generator))
    return token, float(logprobs[token])
