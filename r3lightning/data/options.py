"""``DataOptions``: the less common settings of an ``R3DataModule``, in a module of their own so
the job checks them without importing Lightning."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from r3lightning.checks import check_fields
from r3lightning.routes import check_layers

if TYPE_CHECKING:  # imported when a buffer is given: the job checks these options without torch
    from r3lightning.data.buffer import ReplayBuffer

__all__ = ["DataOptions"]


@dataclass(frozen=True)
class DataOptions:
    """The less common settings of an ``R3DataModule`` (its ``options``).

    Args:
        pad_token_id, width_multiple: the padding id, and a multiple the padded width rounds up to.
        shard: split the buffers among data-parallel ranks; ``False`` for per-rank buffers.
        layers: the absolute decoder layers this rank's model holds (``backend.moe_layers``);
            batches keep only their route columns. ``None``: routes as they come.
        eval_buffer: data of the val / test / predict loaders (whole, in order, sharded).

    Raises:
        ValueError: A field of the wrong type or out of range (the message names it).
        TypeError: ``eval_buffer`` is not a ``ReplayBuffer``.
    """

    pad_token_id: int = 0
    width_multiple: int = 1
    shard: bool = True
    layers: Sequence[int] | None = None
    eval_buffer: ReplayBuffer | None = None

    def __post_init__(self) -> None:
        rules = {"pad_token_id": (int, 0), "width_multiple": (int, 1), "shard": (bool, None)}
        check_fields({name: getattr(self, name) for name in rules}, rules)
        object.__setattr__(self, "layers", check_layers("layers", self.layers))
        buffer = self.eval_buffer
        if buffer is None:
            return
        from r3lightning.data.buffer import ReplayBuffer

        if not isinstance(buffer, ReplayBuffer):
            raise TypeError(f"eval_buffer must be a ReplayBuffer or None, got {type(buffer).__name__}")
