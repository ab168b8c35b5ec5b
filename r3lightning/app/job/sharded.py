"""Loading a large Hugging Face MoE under FSDP2 without a full copy per rank (examples/fsdp_moe):
`convert_checkpoint` (``python -m r3lightning.app.job.sharded HF_DIR OUT_DIR [--dtype bfloat16]``)
writes it once as a DCP directory; every rank builds the model on the meta device, shards it and
reads only its own shards."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "convert_checkpoint",
    "load_sharded_weights",
    "main",
    "meta_model",
    "parameters_on_meta",
    "shard_model",
]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered inside the block lives on the meta device (no storage);
    buffers are real, so values computed at construction (rotary frequencies) stay.

    The swap is process-wide for the block's duration: modules built meanwhile on other threads
    get meta parameters too.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    # the method is swapped on the class on purpose: every module built in the block registers
    # through it; the finally puts the original back
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]  # as above


def meta_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A Hugging Face causal LM built from its config alone, its parameters on the meta device.

    Cost: imports transformers; reads ``config.json`` only, allocates no parameter memory
    (buffers are real).

    Args:
        path: a Hugging Face checkpoint directory.
        dtype: the parameters' dtype.

    Returns:
        The model, in eval mode, ready for `shard_model` then `load_sharded_weights`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def shard_model(model: nn.Module, mesh: Any) -> None:
    """FSDP2 ``fully_shard`` of every decoder layer, then of the root, in place; router hooks
    survive (the module objects are kept).

    Args:
        model: a causal LM whose decoder layers are ``model.model.layers`` (or ``model.layers``).
        mesh: the 1-D device mesh to shard over.

    Raises:
        ValueError: the model has no such ``nn.ModuleList``.
    """
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
    """Write a Hugging Face checkpoint once as a DCP directory that ranks read shard by shard.

    Cost: imports transformers and loads one full copy of the model in CPU memory; run it once,
    in one process.

    Args:
        path: the Hugging Face checkpoint directory.
        out_dir: the DCP directory to write.
        dtype: the dtype the weights are written in.

    Returns:
        ``out_dir``.
    """
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    dcp.save(model.state_dict(), checkpoint_id=str(out_dir), no_dist=True)
    return Path(out_dir)


def load_sharded_weights(model: nn.Module, checkpoint_dir: str | Path, device: torch.device | str) -> None:
    """Materialise a sharded meta model on ``device`` and read this rank's shards into it.

    Syncs: collective; every rank of the model's mesh calls it. Cost: this rank's shards only are
    allocated and read; the buffers (built real on the meta model) are copied over.

    Args:
        model: a model from `meta_model`, ``fully_shard``-ed by `shard_model`.
        checkpoint_dir: a DCP directory written by `convert_checkpoint`.
        device: this rank's device.

    Raises:
        ValueError: the checkpoint's parameters differ from the model's (the first five missing
            and unexpected names).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=torch.device(device))  # this rank's shards only: the parameters are sharded already
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    state = get_model_state_dict(model)  # the parameters themselves (DTensors): loaded in place
    saved = set(dcp.FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata)
    missing = sorted(set(state) - saved)
    unexpected = sorted(saved - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {checkpoint_dir} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    dcp.load(state, checkpoint_id=str(checkpoint_dir))  # reads this rank's slices only
    set_model_state_dict(model, state)  # a no-op copy where DCP already wrote into the parameters


def main(argv: list[str] | None = None) -> None:
    """``python -m r3lightning.app.job.sharded HF_DIR OUT_DIR [--dtype bfloat16]``: `convert_checkpoint`.

    Args:
        argv: the arguments (default: the command line's).

    Raises:
        SystemExit: 2 for bad arguments (argparse's message).
    """
    parser = argparse.ArgumentParser(description="Convert a Hugging Face checkpoint for shard loading.")
    parser.add_argument("hf_dir", type=Path, help="Hugging Face checkpoint directory")
    parser.add_argument("out_dir", type=Path, help="DCP directory to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args(argv)
    print(f"wrote {convert_checkpoint(args.hf_dir, args.out_dir, dtype=getattr(torch, args.dtype))}")


if __name__ == "__main__":
    main()
