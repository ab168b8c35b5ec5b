"""The fields a replay step reads from a batch, whatever its type (``RolloutBatch``, mapping)."""

from typing import Any

import torch
from torch import Tensor


def batch_field(batch: Any, name: str) -> Any:
    """``batch.name`` for a ``RolloutBatch`` (or any object), ``batch[name]`` for a mapping."""
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)


def set_batch_fields(batch: Any, **values: Any) -> None:
    """``batch.name = value`` (``batch[name]`` for a mapping) for each of ``values``."""
    for name, value in values.items():
        if isinstance(batch, dict):
            batch[name] = value
        else:
            setattr(batch, name, value)


def host_attention_mask(batch: Any) -> Tensor:
    """The batch's left-padded ``[B, S]`` mask on the host: rebuilt from ``batch.lengths_host()`` (a
    ``RolloutBatch``: no device->host sync), else copied back."""
    attention_mask = batch_field(batch, "attention_mask")
    if attention_mask is None:
        raise ValueError("RouterReplayCallback needs batch.attention_mask ([B, S] bool, left-padded)")
    lengths_host = getattr(batch, "lengths_host", None)
    if callable(lengths_host):
        lengths = lengths_host()[0]
        width = attention_mask.shape[1]
        return torch.arange(width)[None, :] >= (width - lengths)[:, None]
    return attention_mask.detach().cpu()
