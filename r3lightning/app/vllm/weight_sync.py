"""The checkpoint a vLLM engine reloads: the trainer's weights as an HF safetensors checkpoint in
the engine's dtype, written atomically into a directory the engine reads.

The engine loads it with ``r3_reload_weights`` (``POST /collective_rpc``): vLLM's ``reload_weights``
plus the repair the CPU backend needs (``engine_side/r3lightning_worker.py``). The engine gains it
with ``--worker-extension-cls r3lightning_worker.WeightReload`` and that folder on its
``PYTHONPATH``, which `VllmServer` sets up with ``dev_mode``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

__all__ = ["RELOAD_METHOD", "checkpoint_tensors", "write_checkpoint"]

RELOAD_METHOD = "r3_reload_weights"
_FILE = "model.safetensors"


def _skeleton(config: Any) -> torch.nn.Module:
    """The model of ``config`` on the meta device: it names the checkpoint layout, holds no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def checkpoint_tensors(
    state_dict: Mapping[str, Tensor], config: Any, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The trainer's weights as an HF checkpoint holds them (the names and layout ``save_pretrained``
    writes, e.g. one tensor per expert, tied copies dropped), contiguous on the host in ``dtype``.

    Args:
        state_dict: the model's full state dict (``full_state_dict``), HF module names.
        config: the model's HF config (its ``model_type`` picks the layout).
        dtype: the engine's dtype.

    Returns:
        ``{checkpoint name: tensor}``.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    skeleton = _skeleton(config)
    untied = remove_tied_weights_from_state_dict(dict(state_dict), skeleton)  # before a cast unshares them
    host = {k: v.detach().to("cpu", dtype) for k, v in untied.items()}
    out = revert_weight_conversion(skeleton, host)
    return {k: v.contiguous() for k, v in out.items()}


def write_checkpoint(directory: Path, tensors: Mapping[str, Tensor]) -> Path:
    """``tensors`` as ``directory/model.safetensors``, replaced atomically (an engine never reads a
    half-written file).

    Args:
        directory: the engine's weight directory (created if missing).
        tensors: checkpoint name -> tensor (`checkpoint_tensors`).

    Returns:
        The file's path.

    Raises:
        ValueError: the directory holds other ``*.safetensors`` files (vLLM would load them too).
    """
    directory.mkdir(parents=True, exist_ok=True)
    others = sorted(p.name for p in directory.glob("*.safetensors") if p.name != _FILE)
    if others:
        raise ValueError(
            f"the weight directory {directory} holds other safetensors files {others[:3]}; the engine "
            "would load them too: give the weight sync a directory of its own"
        )
    target = directory / _FILE
    partial = directory / f"{_FILE}.partial"  # outside vLLM's *.safetensors pattern
    save_file(dict(tensors), str(partial), metadata={"format": "pt"})
    os.replace(partial, target)
    return target
