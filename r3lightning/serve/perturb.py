"""SIMULATION ONLY: perturb a serving model's router logits to a target routing disagreement.

Production engines and trainers compute router logits with different kernels, precisions and
parallel layouts, so they disagree on about 10% of (token, layer) expert slots for a model like
Qwen3-30B-A3B (R3 paper, arXiv 2510.11370, SGLang vs Megatron). A tiny model served in bf16
next to its fp32 trainer disagrees on well under 1%. :class:`RouterLogitPerturbation` lets the
embedded engine reproduce production-level disagreement: it adds a small deterministic term to
every router's logits before the top-k selection,

    logits' = logits + scale * hidden @ R.T        # R: fixed N(0, 1/hidden) [experts, hidden]

and picks the experts and their gate weights from ``logits'`` with the router family's own
formula, as an engine whose logits differ slightly would. The term is a function of the token's
own hidden state only, so it keeps the engine batch invariant and reproducible. ``scale`` is
calibrated by bisection so that, on a fixed probe batch, the fraction of expert slots that differ
from the unperturbed engine's routing equals ``target``. It is never part of a real deployment.
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

# Families whose experts are the top-k of the raw logits (softmax and top-k commute).
_TOPK_OF_LOGITS = (
    softmax_then_topk_weights,
    softmax_renormalised_weights,
    mixtral_weights,
    softmax_over_topk_weights,
)


class RouterLogitPerturbation:
    """Forward hooks on every router of ``model`` that perturb its logits (see the module docstring).

    ``target``: slot disagreement to calibrate to, in ``[0, 0.5]``. ``seed`` fixes ``R`` and the
    probe batch (``probe_sequences`` x ``probe_length`` random tokens). The hooks run before any
    other forward hook of the routers (a route recorder then records the perturbed experts).
    Call :meth:`calibrate` after every weight change; :meth:`remove` detaches the hooks.
    """

    def __init__(
        self,
        model: nn.Module,
        target: float,
        *,
        seed: int = 0,
        probe_sequences: int = 8,
        probe_length: int = 16,
    ) -> None:
        check_setting("simulated_disagreement", target, low=0, high=0.5)
        self.target = float(target)
        self.scale = 0.0
        self.measured = 0.0  # disagreement on the probe batch at the calibrated scale
        found = find_routers(model)
        generator = torch.Generator().manual_seed(seed)
        self._directions: dict[nn.Module, Tensor] = {}
        self._handles = []
        for _, name, router, adapter in found:
            if adapter.gate_weights not in _TOPK_OF_LOGITS:
                raise ValueError(
                    f"router {name!r} ({type(router).__name__}) does not select the top-k of its logits; "
                    "the simulated disagreement supports routers that pick the top-k of their logits (Qwen3-MoE, "
                    "Qwen2-MoE, OLMoE, Mixtral, gpt-oss, ...)"
                )
            weight = next(p for p in router.parameters() if p.dim() == 2)  # [experts, hidden]
            experts, hidden = weight.shape
            direction = torch.randn(experts, hidden, generator=generator) / hidden**0.5
            self._directions[router] = direction.to(weight.device, weight.dtype)
            self._handles.append(router.register_forward_hook(self._make_hook(adapter), prepend=True))
        config = getattr(model, "config", None)
        vocab = int(getattr(config, "vocab_size", 2))
        self.probe = torch.randint(vocab, (probe_sequences, probe_length), generator=generator)

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
            replaced[p_weights] = adapter.gate_weights(module, logits, indices)
            replaced[p_indices] = indices
            return type(output)(replaced)

        return hook

    def calibrate(self, routes: Callable[[], Tensor], *, iterations: int = 8) -> float:
        """Set :attr:`scale` so that the probe's slot disagreement is closest to the target.

        ``routes()`` runs the probe batch through the model and returns the experts it used on the
        MoE layers, ``[..., K]``. Bracketing from a fixed start, then bisection in log-scale: about
        ``iterations + 3`` probe forwards, all deterministic. Returns the scale.
        """
        if self.target == 0.0:
            self.scale, self.measured = 0.0, 0.0
            return 0.0
        previous = self.scale
        try:
            self.scale = 0.0
            native = routes()
            native = native.reshape(-1, native.shape[-1])  # [slots / K, K]

            def measure(scale: float) -> float:
                self.scale = scale
                perturbed = routes()
                hits = agreement_hits(perturbed.reshape(-1, perturbed.shape[-1]), native)
                return 1.0 - float(hits.float().mean())

            # Always from the same bracket: the scale is a function of the weights alone, never
            # of the calibrations before (a run must not depend on what the engine served earlier).
            low, high = 0.0, 1.0
            measured_high = measure(high)
            for _ in range(40):  # the disagreement grows with the scale: bracket the target
                if measured_high >= self.target:
                    break
                low, high = high, high * 4
                measured_high = measure(high)
            best = (abs(measured_high - self.target), high, measured_high)
            for _ in range(iterations):
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
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
