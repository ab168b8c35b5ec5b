"""SIMULATION ONLY: perturb a serving model's router logits to a target routing disagreement
(docs/demo.md, "Simulated engine disagreement"). Never part of a real deployment."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from r3lightning.checks import check_setting
from r3lightning.replay.backend import agreement_hits
from r3lightning.replay.hf.routers import (
    find_routers,
    gpt_oss_weights,
    mixtral_weights,
    qwen3_5_moe_weights,
    qwen3_moe_weights,
)

# families whose experts are the top-k of the raw logits (softmax and top-k commute)
_TOPK_OF_LOGITS = {qwen3_moe_weights, qwen3_5_moe_weights, mixtral_weights, gpt_oss_weights}
_PROBE_SHAPE, _BISECTIONS = (8, 16), 8  # probe [sequences, length]; steps after the bracket


class RouterLogitPerturbation:
    """Forward hooks, ahead of the routers' others, adding ``scale * hidden @ R.T`` to every router's
    logits (``R``: ``N(0, 1/hidden) [experts, hidden]``, fixed by ``seed`` with the probe batch) and
    recomputing its experts and gate weights; ``target`` in ``[0, 0.5]``."""

    def __init__(self, model: nn.Module, target: float, *, seed: int = 0):
        check_setting("simulated_disagreement", target, low=0, high=0.5)
        self.target, self.scale = float(target), 0.0
        self.measured = 0.0  # disagreement on the probe batch at the calibrated scale
        generator = torch.Generator().manual_seed(seed)
        self._directions: dict[nn.Module, Tensor] = {}
        self._handles = []
        for _, name, router, adapter in find_routers(model):
            if adapter.gate_weights not in _TOPK_OF_LOGITS:
                raise ValueError(
                    f"router {name!r} ({type(router).__name__}) does not select the top-k of its logits; the "
                    "simulated disagreement supports those that do (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss)"
                )
            weight = next(p for p in router.parameters() if p.dim() == 2)  # [experts, hidden]
            direction = torch.randn(*weight.shape, generator=generator) / weight.shape[1] ** 0.5
            self._directions[router] = direction.to(weight.device, weight.dtype)
            self._handles.append(router.register_forward_hook(self._make_hook(adapter), prepend=True))
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2))
        self.probe = torch.randint(vocab, _PROBE_SHAPE, generator=generator)  # [sequences, length]

    def _make_hook(self, adapter) -> Callable:
        p_logits, p_weights, p_indices = adapter.output_positions

        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            if self.scale == 0.0:
                return None
            hidden = args[0].reshape(-1, self._directions[module].shape[1])  # [N, hidden]
            logits = output[p_logits] + self.scale * F.linear(hidden, self._directions[module])
            indices = logits.topk(output[p_indices].shape[-1], dim=-1).indices  # [N, K]
            replaced = list(output)
            replaced[p_logits], replaced[p_indices] = logits, indices
            replaced[p_weights] = adapter.gate_weights(module, logits, indices)
            return type(output)(replaced)

        return hook

    def calibrate(self, routes: Callable[[], Tensor]) -> float:
        """Set and return the `scale` whose probe disagreement is closest to the target
        (``routes()``: the probe's MoE-layer experts ``[..., K]``); about 11 probe forwards."""
        if self.target == 0.0:
            self.scale = self.measured = 0.0
            return 0.0
        previous, self.scale = self.scale, 0.0
        try:
            native = routes().flatten(0, -2)  # [slots / K, K]

            def measure(scale: float) -> float:
                self.scale = scale
                return 1.0 - float(agreement_hits(routes().flatten(0, -2), native).float().mean())

            # a fixed bracket, then log-scale bisection: the scale depends on the weights alone
            low, high = 0.0, 1.0
            while (measured_high := measure(high)) < self.target and high < 4.0**40:
                low, high = high, high * 4
            best = (abs(measured_high - self.target), high, measured_high)
            for _ in range(_BISECTIONS):
                mid = (low + high) / 2 if low == 0.0 else (low * high) ** 0.5
                measured = measure(mid)
                best = min(best, (abs(measured - self.target), mid, measured))
                low, high = (low, mid) if measured >= self.target else (mid, high)
        except BaseException:
            self.scale = previous
            raise
        _, self.scale, self.measured = best
        return self.scale

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
