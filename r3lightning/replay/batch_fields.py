"""The fields a replay step reads from a batch, whatever its type (``RolloutBatch``, mapping)."""

from typing import Any

import torch
from torch import Tensor


def batch_field(batch: Any, name: str) -> Any:
    """One field of a batch, whatever its type.

    Args:
        batch: A ``RolloutBatch`` (or any object), or a dict.
        name: The field.

    Returns:
        ``batch.get(name)`` for a dict, else ``getattr(batch, name, None)``: None when absent.
    """
    return batch.get(name) if isinstance(batch, dict) else getattr(batch, name, None)


def set_batch_fields(batch: Any, **values: Any) -> None:
    """Sets fields of a batch, whatever its type.

    Args:
        batch: A ``RolloutBatch`` (or any object), or a dict.
        **values: ``name=value`` pairs: ``batch[name] = value`` for a dict, else
            ``setattr(batch, name, value)``.
    """
    for name, value in values.items():
        if isinstance(batch, dict):
            batch[name] = value
        else:
            setattr(batch, name, value)


def host_attention_mask(batch: Any) -> Tensor:
    """The batch's left-padded attention mask on the host.

    Args:
        batch: A ``RolloutBatch`` or a mapping with ``attention_mask [B, S]``.

    Returns:
        bool host ``[B, S]`` rebuilt from ``batch.lengths_host()`` (a ``RolloutBatch``: no
        device-to-host sync), else the mask copied back (a sync for a device mask).

    Raises:
        ValueError: The batch has no ``attention_mask``.
    """
    attention_mask = batch_field(batch, "attention_mask")
    if attention_mask is None:
        raise ValueError("RouterReplayCallback needs batch.attention_mask ([B, S] bool, left-padded)")
    lengths_host = getattr(batch, "lengths_host", None)
    if callable(lengths_host):
        lengths = lengths_host()[0]
        width = attention_mask.shape[1]
        return torch.arange(width)[None, :] >= (width - lengths)[:, None]
    return attention_mask.detach().cpu()
