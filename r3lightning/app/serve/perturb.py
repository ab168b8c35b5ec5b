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
_PROBE_SHAPE = (8, 16)  # the calibration probe: [sequences, length] token ids
_BISECTIONS = 8  # calibration steps after the bracket


class RouterLogitPerturbation:
    """Forward hooks, ahead of the routers' others, adding ``scale * hidden @ R.T`` to every router's
    logits (``R``: ``N(0, 1/hidden) [experts, hidden]``, fixed by ``seed`` with the probe batch) and
    recomputing its experts and gate weights. The hooks do nothing until `calibrate` sets a scale.

    Args:
        model: the serving model; its routers must select the top-k of their logits.
        target: the routing disagreement to reach, in ``[0, 0.5]`` (the share of expert slots
            that differ from the unperturbed model's on the probe batch).
        seed: fixes the directions ``R`` and the probe batch.

    Raises:
        ValueError: ``target`` is outside ``[0, 0.5]``, or a router's family does not select
            the top-k of its logits.
    """

    def __init__(self, model: nn.Module, target: float, *, seed: int = 0):
        check_setting("simulated_disagreement", target, low=0, high=0.5)
        self.target = float(target)
        self.scale = 0.0
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
            replaced[p_logits] = logits
            replaced[p_indices] = indices
            replaced[p_weights] = adapter.gate_weights(module, logits, indices)
            return type(output)(replaced)

        return hook

    def calibrate(self, routes: Callable[[], Tensor]) -> float:
        """Set the `scale` whose disagreement on the probe batch is closest to ``target``; it
        depends on the weights alone. ``measured`` records the disagreement it gives.

        Args:
            routes: runs the probe batch through the model (hooks active) and returns its
                MoE layers' experts ``[..., K]``.

        Returns:
            The scale. Cost: about 11 probe forwards (one unperturbed, a bracket, 8 bisections).

        Raises:
            Exception: whatever ``routes`` raises; the previous scale is kept then.
        """
        if self.target == 0.0:
            self.scale = self.measured = 0.0
            return 0.0
        previous = self.scale
        self.scale = 0.0
        try:
            native = routes().flatten(0, -2)  # [slots / K, K]

            def measure(scale: float) -> float:
                self.scale = scale
                return 1.0 - float(agreement_hits(routes().flatten(0, -2), native).float().mean())

            # a fixed bracket, then log-scale bisection: the scale depends on the weights alone
            low = 0.0
            high = 1.0
            measured_high = measure(high)
            while measured_high < self.target and high < 4.0**40:
                low = high
                high = high * 4
                measured_high = measure(high)
            best = (abs(measured_high - self.target), high, measured_high)  # (error, scale, measured)
            for _ in range(_BISECTIONS):
                mid = (low + high) / 2 if low == 0.0 else (low * high) ** 0.5
                measured = measure(mid)
                best = min(best, (abs(measured - self.target), mid, measured))
                if measured >= self.target:
                    high = mid
                else:
                    low = mid
        except BaseException:
            self.scale = previous
            raise
        _, self.scale, self.measured = best
        return self.scale

    def remove(self) -> None:
        """Remove the hooks: the routers compute their own logits again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
