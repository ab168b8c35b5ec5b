"""SIMULATION ONLY: perturb a serving model's router logits to a target routing disagreement.

Production engines and trainers disagree on ~10% of expert slots for Qwen3-30B-A3B (R3 paper,
arXiv 2510.11370); a tiny bf16 engine beside its fp32 trainer on under 1%. Each router's logits
get ``scale * hidden @ R.T`` (``R``: fixed ``N(0, 1/hidden)`` ``[experts, hidden]``) before the
top-k, experts and gate weights recomputed with the family's own formula; a function of the
token's own hidden state, so the engine stays batch invariant. ``scale`` is calibrated so that
the probe batch's share of flipped slots equals the target. Never part of a real deployment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from r3lightning.replay.backend import agreement_hits
from r3lightning.replay.hf.routers import (
    find_routers,
    mixtral_weights,
    softmax_over_topk_weights,
    softmax_renormalised_weights,
    softmax_then_topk_weights,
)
from r3lightning.rollout.config import check_setting

# families whose experts are the top-k of the raw logits (softmax and top-k commute)
_TOPK_OF_LOGITS = {softmax_then_topk_weights, softmax_renormalised_weights, mixtral_weights}
_TOPK_OF_LOGITS.add(softmax_over_topk_weights)
_PROBE_SHAPE, _BISECTIONS = (8, 16), 8  # probe [sequences, length]; steps after the bracket


class RouterLogitPerturbation:
    """Forward hooks on every router of ``model`` that perturb its logits (the module docstring):
    ``target`` in ``[0, 0.5]``; ``seed`` fixes ``R`` and the probe batch of random tokens. They
    run before the routers' other hooks (a route recorder records the perturbed experts).
    :meth:`calibrate` after every weight change; :meth:`remove` detaches."""

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
        """Set :attr:`scale` so that the probe's slot disagreement is closest to the target;
        ``routes()`` runs the probe and returns the experts of the MoE layers ``[..., K]``.
        Bracketing from a fixed start, then log-scale bisection: about 11 probe forwards, all
        deterministic. Returns the scale."""
        if self.target == 0.0:
            self.scale = self.measured = 0.0
            return 0.0
        previous, self.scale = self.scale, 0.0
        try:
            native = routes()
            native = native.reshape(-1, native.shape[-1])  # [slots / K, K]

            def measure(scale: float) -> float:
                self.scale = scale
                perturbed = routes()
                hits = agreement_hits(perturbed.reshape(-1, perturbed.shape[-1]), native)
                return 1.0 - float(hits.float().mean())

            # always the same bracket: the scale depends on the weights alone, never on what the
            # engine calibrated (served) before
            low, high = 0.0, 1.0  # the disagreement grows with the scale: bracket the target
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
