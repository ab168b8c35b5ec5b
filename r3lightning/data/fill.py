"""The collation core below ``RolloutBatch`` and the collator: a batch's fields from trajectories.
Each fill task writes all of its own rows (padding included) with torch ops, which release the GIL."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from r3lightning.packed import PackedTensor
from r3lightning.ragged import offsets_from_lengths
from r3lightning.rollout.trajectory import Trajectory, padding_trajectories, route_signature
from r3lightning.routes import widest_route_dtype

__all__ = [
    "ROW_FIELDS",
    "TOKEN_FIELDS",
    "Allocator",
    "Buffers",
    "collate_fields",
    "joined_fields",
    "pinned_empty",
    "placeholder_fields",
    "plain_empty",
    "weight_versions",
]

TOKEN_FIELDS = ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs")  # [B, S]
ROW_FIELDS = ("advantages", "rewards", "prompt_lengths", "sequence_lengths", "weight_versions")  # [B]
_TOKEN_PAD = {"attention_mask": False, "loss_mask": 0.0, "rollout_logprobs": 0.0}  # input_ids: pad id

Allocator = Callable[[tuple[int, ...], torch.dtype], Tensor]


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Page-locked uninitialised CPU tensor (needs an accelerator runtime).

    Args:
        shape, dtype: The tensor's.
    """
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def plain_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Pageable uninitialised CPU tensor.

    Args:
        shape, dtype: The tensor's.
    """
    return torch.empty(shape, dtype=dtype)


@dataclass(eq=False)
class Buffers:
    """Named output buffers: fresh per batch, or views of one pool slot's reusable storage."""

    allocator: Allocator
    storage: dict[str, Tensor] | None = None  # name -> flat [capacity], grown on demand; None: unpooled

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A buffer for one field: fresh, or a view of the pool slot's storage (grown with 25% headroom
        so slowly growing batches do not re-pin every step).

        Args:
            name: The field, which owns its storage in the slot.
            shape, dtype: The buffer's.
        """
        numel = math.prod(shape)
        if self.storage is None:
            return self.allocator(shape, dtype)
        flat = self.storage.get(name)
        if flat is None or flat.dtype != dtype or flat.numel() < numel:
            # 25% headroom so slowly growing batches do not re-pin every step
            flat = self.allocator((max(numel + numel // 4, 1),), dtype)
            self.storage[name] = flat
        return flat[:numel].view(shape)

    def fresh(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A buffer outside the pool, for data that outlives the batch's lease.

        Args:
            shape, dtype: The buffer's.
        """
        return self.allocator(shape, dtype)


def weight_versions(trajectories: Sequence[Trajectory]) -> Tensor:
    """``[B]`` int64 engine weight version of each trajectory, -1 where unknown.

    Args:
        trajectories: The batch's trajectories.
    """
    versions = [-1 if t.weight_version is None else t.weight_version for t in trajectories]
    return torch.tensor(versions, dtype=torch.int64)


def _fill_rows(
    trajectories: Sequence[Trajectory],
    out: dict[str, Tensor],
    offsets: list[int],
    pad_token_id: int,
    rows: range,
) -> None:
    """Write every position of ``rows`` (padding included); tasks own disjoint rows."""
    width = out["input_ids"].shape[1]
    routes = out.get("routes")
    for i in rows:
        t = trajectories[i]
        prompt = t.prompt_length
        pad = width - t.num_tokens
        response_start = pad + prompt
        ids = out["input_ids"][i]
        ids[:pad].fill_(pad_token_id)
        ids[pad:response_start].copy_(t.prompt_ids)
        ids[response_start:].copy_(t.response_ids)
        mask = out["attention_mask"][i]
        mask[:pad].fill_(False)
        mask[pad:].fill_(True)
        for name, source in (("loss_mask", t.loss_mask), ("rollout_logprobs", t.rollout_logprobs)):
            row = out[name][i]
            row[:response_start].zero_()
            row[response_start:].copy_(source)
        if routes is not None and t.routed_experts is not None:
            routes[offsets[i] : offsets[i + 1]].copy_(t.routed_experts)


def collate_fields(
    trajectories: Sequence[Trajectory],
    buffers: Buffers,
    *,
    pad_token_id: int,
    width_multiple: int = 1,
    executor: ThreadPoolExecutor | None = None,
    tasks: int = 1,
) -> dict[str, Any]:
    """`RolloutBatch` keyword arguments written into ``buffers``. One host pass to plan, then
    ``O(B * S + route bytes)`` copies; each task writes its own rows, padding included.

    Args:
        trajectories: The batch's trajectories (one route schema).
        buffers: Where the fields go.
        pad_token_id: The padding id of ``input_ids``.
        width_multiple: The padded width rounds up to a multiple of it.
        executor: Runs the fill tasks (None: serially here).
        tasks: How many fill tasks, at most one per row.

    Returns:
        The fields, ``routed_experts`` packed with host offsets, and the host lengths.

    Raises:
        ValueError: Different route schemas or layer sets.
    """
    count = len(trajectories)
    prompt_lengths = torch.tensor([t.prompt_length for t in trajectories], dtype=torch.int64)
    sequence_lengths = torch.tensor([t.num_tokens for t in trajectories], dtype=torch.int64)
    width = int(sequence_lengths.max()) if count else 0
    width = -(-width // width_multiple) * width_multiple

    schema, layers = route_signature(trajectories, "trajectories in one batch")
    token_dtypes = {"input_ids": torch.int64, "attention_mask": torch.bool}
    out = {n: buffers.take(n, (count, width), token_dtypes.get(n, torch.float32)) for n in TOKEN_FIELDS}
    offsets: list[int] = []
    cu_host: Tensor | None = None
    if schema is not None:
        routed = [t.routed_experts for t in trajectories if t.routed_experts is not None]
        dtype = widest_route_dtype(r.dtype for r in routed)
        rows = torch.tensor([t.route_rows for t in trajectories], dtype=torch.int64)
        # not pooled: B + 1 ints are cheap to allocate, and routes derived without a device move
        # (dtype casts, pinning) keep these host offsets, which must outlive the batch's lease
        cu_host = buffers.fresh((count + 1,), torch.int32).copy_(offsets_from_lengths(rows, "route rows"))
        offsets = cu_host.tolist()
        out["routes"] = buffers.take("routes", (offsets[-1], *schema), dtype)

    scalars = {
        "advantages": torch.tensor([t.advantage for t in trajectories], dtype=torch.float32),
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "prompt_lengths": prompt_lengths,
        "sequence_lengths": sequence_lengths,
        "weight_versions": weight_versions(trajectories),
    }
    fields = {name: buffers.take(name, (count,), v.dtype).copy_(v) for name, v in scalars.items()}

    tasks = 1 if executor is None else max(1, min(tasks, count))
    if tasks == 1:
        _fill_rows(trajectories, out, offsets, pad_token_id, range(count))
    else:
        bounds = [count * k // tasks for k in range(tasks + 1)]
        fill = functools.partial(_fill_rows, trajectories, out, offsets, pad_token_id)
        list(executor.map(fill, map(range, bounds[:-1], bounds[1:])))  # re-raises a worker's exception

    routed = None if cu_host is None else PackedTensor(out.pop("routes"), cu_host, cu_seqlens_host=cu_host)
    hosts = (sequence_lengths, prompt_lengths)
    return {**out, **fields, "routed_experts": routed, "route_layers": layers, "_host_lengths": hosts}


# batches are RolloutBatches, untyped here: fill sits below batch and never imports it
def joined_fields(batches: Sequence[Any], *, pad_token_id: int) -> dict[str, Any]:
    """`RolloutBatch` keyword arguments of the rows of ``batches`` in new storage: token fields
    left-padded to the widest, routes widened to the widest dtype. No sync.

    Args:
        batches: At least one; one device, one ``route_layers``, all with routes or none.
        pad_token_id: Pads ``input_ids`` of narrower batches.

    Returns:
        The fields, with the joined host lengths.

    Raises:
        ValueError: No batch, mixed routes, or different ``route_layers``.
    """
    if not batches:
        raise ValueError("RolloutBatch.cat needs at least one batch")
    has_routes = {b.routed_experts is not None for b in batches}
    if len(has_routes) != 1:
        raise ValueError("RolloutBatch.cat: either every batch has routed_experts or none does")
    layer_sets = {b.route_layers for b in batches}
    if len(layer_sets) != 1:
        raise ValueError(f"RolloutBatch.cat: different route_layers {sorted(layer_sets, key=str)}")
    width = max(b.width for b in batches)
    values: dict[str, Any] = {}
    for name in TOKEN_FIELDS:
        pad = _TOKEN_PAD.get(name, pad_token_id)
        parts = [getattr(b, name) for b in batches]  # [B_i, S_i] -> [B_i, width], padded on the left
        values[name] = torch.cat([F.pad(t, (width - t.shape[1], 0), value=pad) for t in parts])
    for name in ROW_FIELDS:
        values[name] = torch.cat([getattr(b, name) for b in batches])
    routes = [b.routed_experts for b in batches if b.routed_experts is not None]  # all or none
    if routes:
        dtype = widest_route_dtype(r.dtype for r in routes)
        values["routed_experts"] = PackedTensor.cat([r.to(dtype=dtype) for r in routes])
    host = tuple(torch.cat(parts) for parts in zip(*(b.lengths_host() for b in batches), strict=True))
    return {**values, "route_layers": layer_sets.pop(), "_host_lengths": host}


def placeholder_fields(
    count: int,
    *,
    pad_token_id: int,
    route_schema: tuple[int, int] | None,
    num_experts: int | None,
    route_layers: tuple[int, ...] | None,
) -> dict[str, Any]:
    """`RolloutBatch` keyword arguments of ``count`` zero-loss placeholder rows
    (`padding_trajectories`), collated serially into fresh CPU memory.

    Args:
        count: How many rows, >= 0.
        pad_token_id, route_schema, num_experts, route_layers: As for `padding_trajectories`.

    Returns:
        The fields.
    """
    placeholders = padding_trajectories(
        count,
        pad_token_id=pad_token_id,
        route_schema=route_schema,
        num_experts=num_experts,
        route_layers=route_layers,
    )
    return collate_fields(placeholders, Buffers(plain_empty), pad_token_id=pad_token_id)
