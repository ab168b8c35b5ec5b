"""Worker methods that vLLM's workers gain with ``--worker-extension-cls r3lightning_worker.WeightReload``
(this folder on the engine's ``PYTHONPATH``), called through ``POST /collective_rpc``.

It runs inside the engine's own environment: standard library, torch and vLLM only, no r3lightning.

Why it exists: vLLM 0.30's ``reload_weights`` reloads an MoE layer through its layer-wise reload,
which re-runs the layer's weight processing as a *weight update*. On the CPU backend that skips
the grouped-GEMM prepacking of the unquantized experts' weights, so the plain layout lands in
storage the kernel reads as prepacked: after a reload the experts compute garbage (reloading the
very weights the engine started with moves its logprobs by about 0.1). `WeightReload.r3_reload_weights`
reloads, then prepacks those experts again, as the first load did.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from safetensors import safe_open

__all__ = ["WeightReload"]


def _cpu_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """``(layer, experts kernel)`` of every MoE layer that the CPU backend runs on prepacked weights."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not a build with CPU MoE kernels
        return []
    found = []
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            found.append((layer, experts))
    return found


@torch.no_grad()
def _prepack_again(layer: torch.nn.Module, experts: Any) -> None:
    from vllm._custom_ops import cpu_prepack_moe_weight

    padded = experts._padded_intermediate_size(experts.moe_config)
    if padded != experts.moe_config.intermediate_size_per_partition:
        # the first load padded the intermediate dimension; a reload cannot restore that layout
        raise NotImplementedError(
            f"r3_reload_weights: the CPU experts of {type(layer).__name__} pad their intermediate size "
            f"to {padded}; reloading such a layer is not supported"
        )
    for name in ("w13_weight", "w2_weight"):
        weight = getattr(layer, name)
        weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


def _layout(directory: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the ``*.safetensors`` of ``directory`` (headers only)."""
    layout: dict[str, tuple[int, ...]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            layout.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})  # noqa: SIM118
    return layout


def _check_layout(new: dict[str, tuple[int, ...]], served: dict[str, tuple[int, ...]], where: str) -> None:
    """``ValueError`` naming the first tensor that the served checkpoint does not have in that shape:
    vLLM's loaders copy a smaller tensor into part of a parameter without a word."""
    if not new:
        raise ValueError(f"{where} holds no tensors in *.safetensors files")
    missing = sorted(set(served) - set(new))
    unknown = sorted(set(new) - set(served))
    if missing or unknown:
        raise ValueError(
            f"{where} does not hold the served model's tensors: {len(missing)} missing (e.g. "
            f"{missing[:3]}), {len(unknown)} unknown (e.g. {unknown[:3]})"
        )
    for name, shape in new.items():
        if shape != served[name]:
            raise ValueError(
                f"{where}: {name} has shape {list(shape)}, the served model's is {list(served[name])}"
            )


class WeightReload:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    model_runner: Any  # vLLM's worker sets it: the extension only runs mixed into that class

    def r3_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """Load the checkpoint in ``weights_path`` (a directory of HF safetensors) in place, with the
        CPU experts prepacked again. It first checks that the checkpoint holds the served model's
        tensor names and shapes (vLLM copies a smaller tensor into part of a parameter silently).
        Any failure raises (the HTTP call answers 500).

        Args:
            weights_path: directory the engine reads, holding ``*.safetensors`` with HF names.

        Returns:
            ``{"weights_path": ..., "prepacked_layers": n}``.
        """
        runner = self.model_runner
        served = getattr(self, "_r3_served_layout", None)
        if served is None:  # the checkpoint the engine started from, when it is a local directory
            served = _layout(runner.model_config.model) if os.path.isdir(runner.model_config.model) else {}
        new = _layout(weights_path) if os.path.isdir(weights_path) else {}
        if served or not new:
            _check_layout(new, served or new, f"the checkpoint in {weights_path}")
        runner.reload_weights(weights_path=weights_path)
        layers = _cpu_experts(runner.get_model())
        for layer, experts in layers:
            _prepack_again(layer, experts)
        self._r3_served_layout = served or new
        return {"weights_path": weights_path, "prepacked_layers": len(layers)}
