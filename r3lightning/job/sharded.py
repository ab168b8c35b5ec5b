"""Loading a large Hugging Face MoE policy under FSDP2 without a full copy per rank.

``from_pretrained`` on every rank materialises the whole model in host memory on each of them
before ``fully_shard`` keeps only a slice (Qwen3-30B-A3B in fp32: ~120 GB per rank, ~1 TB on an
8-GPU node). Instead:

1. once, anywhere with room for one copy: :func:`convert_checkpoint` turns the HF checkpoint
   directory into a ``torch.distributed.checkpoint`` (DCP) directory under the model's own
   parameter names (after transformers' load-time conversions such as fused experts);
   ``python -m r3lightning.job.sharded HF_DIR OUT_DIR [--dtype bfloat16]`` does the same;
2. on every rank: :func:`meta_model` builds the model with its parameters on the meta device (no
   memory; buffers such as rotary frequencies are real), the training code shards it
   (``fully_shard`` per decoder layer, then the root), and :func:`load_sharded_weights`
   materialises only this rank's shards on ``device`` and reads exactly those from the DCP
   directory.

Memory per rank: its shards (``1 / world`` of the model in the checkpoint's dtype) plus, while
loading, about twice the largest single saved tensor (DCP reads a saved tensor whole, decodes it
and keeps the rank's slice), instead of a full copy. Qwen3-30B-A3B in fp32 on 8 ranks: ~15 GB of
shards + ~3 GB transient per rank (one layer's fused experts), against ~120 GB per rank for
``from_pretrained`` everywhere. The conversion needs one full copy in one process, once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["convert_checkpoint", "load_sharded_weights", "meta_model", "parameters_on_meta", "shard_model"]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered inside the block lives on the meta device (no storage);
    buffers are created for real, so values computed at construction (rotary frequencies) stay."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def meta_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of the HF checkpoint directory ``path`` with parameters on the meta device
    (its config only is read; no weights). Shard it, then call :func:`load_sharded_weights`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def shard_model(model: nn.Module, mesh: Any) -> None:
    """FSDP2 ``fully_shard`` of every decoder layer (``model.model.layers``), then of the root, on
    ``mesh`` (a 1-D data-parallel ``DeviceMesh``). Works on meta and materialised models alike;
    router hooks survive (``fully_shard`` keeps the module objects and swaps in a subclass).
    Raises ``ValueError`` when the model has no decoder layers there."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"FSDP2 sharding looks for the decoder layers at model.model.layers; {type(model).__name__} has none"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def convert_checkpoint(path: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write the HF checkpoint ``path`` as a DCP directory ``out_dir`` (one process, one full copy
    of the model in ``dtype`` in host memory, once per checkpoint). Returns ``out_dir``."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    out = Path(out_dir)
    dcp.save(model.state_dict(), checkpoint_id=str(out), no_dist=True)
    return out


def load_sharded_weights(model: nn.Module, checkpoint_dir: str | Path, device: torch.device | str) -> None:
    """Materialise the (``fully_shard``-ed) meta ``model`` on ``device`` and fill every rank's
    shards from the DCP directory ``checkpoint_dir`` (see :func:`convert_checkpoint`).

    Buffers keep the values they were built with. Collective: every rank of the model's mesh
    calls it. Raises ``ValueError`` naming the missing or unexpected parameters when the
    checkpoint does not match the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    device = torch.device(device)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)  # this rank's shards only: the parameters are sharded already
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    state = get_model_state_dict(model)  # the parameters themselves (DTensors): loaded in place
    saved = set(dcp.FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata)
    missing, unexpected = sorted(set(state) - saved), sorted(saved - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {checkpoint_dir} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    dcp.load(state, checkpoint_id=str(checkpoint_dir))  # reads this rank's slices only
    set_model_state_dict(model, state)  # a no-op copy where DCP already wrote into the parameters
