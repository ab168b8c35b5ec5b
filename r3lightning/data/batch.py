"""``RolloutBatch``: one training batch of trajectories, token fields left-padded, routes packed;
its fields are listed in the class docstring."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from r3lightning.checks import check_int
from r3lightning.data.fill import ROW_FIELDS, TOKEN_FIELDS, joined_fields, placeholder_fields
from r3lightning.packed import PackedTensor
from r3lightning.padded import position_ids_from_mask
from r3lightning.ragged import batch_index, repeat_counts, tensor_from_bytes, tensor_to_bytes, to_device_async

__all__ = ["ROW_FIELDS", "TOKEN_FIELDS", "RolloutBatch"]


@dataclass(eq=False)
class RolloutBatch:
    """One training batch of ``B`` trajectories: token fields left-padded to width ``S`` (real tokens
    at the right end of each row), routes packed. Built by `RolloutCollator` (the constructor checks
    shapes only); moves, pins, slices, joins and pickles like one tensor. A CPU copy of the two length
    vectors rides along (`lengths_host`), so layouts are planned without a device-to-host sync.

    Args:
        input_ids: ``[B, S]`` int64, prompt then response tokens; padding holds the pad token id.
        attention_mask: ``[B, S]`` bool, True on real tokens.
        loss_mask: ``[B, S]`` float32, the trajectory's loss mask on its response tokens, else 0.
        rollout_logprobs: ``[B, S]`` float32, the engine's logprob of each response token, else 0.
        advantages, rewards: ``[B]`` float32.
        prompt_lengths, sequence_lengths: ``[B]`` int64 real tokens.
        routed_experts: `PackedTensor` ``[sum(captured), L, K]``, segment ``i`` = row ``i``'s
            captured route rows from its first real token (uncaptured rows route natively); None.
        route_layers: The decoder layer of each route column (None: column ``j`` is layer ``j``).
        weight_versions: ``[B]`` int64 engine weight version of each row, -1 unknown (None: all).

    Raises:
        ValueError: A field shaped unlike ``input_ids``, a non-bool mask, or not one route segment per row.
        TypeError: ``routed_experts`` that is not a `PackedTensor`.
    """

    input_ids: Tensor  # [B, S] int64
    attention_mask: Tensor  # [B, S] bool
    loss_mask: Tensor  # [B, S] float32
    rollout_logprobs: Tensor  # [B, S] float32
    advantages: Tensor  # [B] float32
    rewards: Tensor  # [B] float32
    prompt_lengths: Tensor  # [B] int64
    sequence_lengths: Tensor  # [B] int64
    routed_experts: PackedTensor | None = None  # [sum(captured), L, K], one segment per row
    route_layers: tuple[int, ...] | None = None  # decoder layer of each of the L columns
    weight_versions: Tensor | None = None  # [B] int64, -1 = unknown; None: all unknown
    # CPU (sequence_lengths, prompt_lengths); filled lazily (one sync) when not given
    _host_lengths: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    _lease: Any = field(default=None, init=False, repr=False)
    # a cut's lineage: the first uncut ancestor and the host int64 [B] positions of its rows there
    _root: RolloutBatch | None = field(default=None, init=False, repr=False)
    _rows: Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"RolloutBatch.input_ids must be [B, S], got shape {shape}")
        if self.weight_versions is None:
            self.weight_versions = torch.full(shape[:1], -1, dtype=torch.int64, device=self.input_ids.device)
        for names, want, like in ((TOKEN_FIELDS, shape, " like input_ids"), (ROW_FIELDS, shape[:1], "")):
            for name in names:
                got = tuple(getattr(self, name).shape)
                if got != want:
                    raise ValueError(f"RolloutBatch.{name} must have shape {want}{like}, got {got}")
        if self.attention_mask.dtype != torch.bool:
            raise ValueError(f"RolloutBatch.attention_mask must be bool, got {self.attention_mask.dtype}")
        r = self.routed_experts
        if r is not None and not isinstance(r, PackedTensor):
            raise TypeError(f"RolloutBatch.routed_experts must be a PackedTensor, got {type(r).__name__}")
        if r is not None and len(r) != shape[0]:
            raise ValueError(
                f"RolloutBatch.routed_experts must have one segment per row ({shape[0]}), got {len(r)}"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        """Padded sequence width ``S``."""
        return self.input_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def response_lengths(self) -> Tensor:
        """``[B]`` int64 response tokens per row, on the batch's device."""
        return self.sequence_lengths - self.prompt_lengths

    @property
    def position_ids(self) -> Tensor:
        """``[B, S]`` int64 rotary positions of the left-padded tokens, 0 on the padding."""
        return position_ids_from_mask(self.attention_mask)

    def lengths_host(self) -> tuple[Tensor, Tensor]:
        """CPU int64 ``(sequence_lengths, prompt_lengths)``; no sync for collated batches."""
        if self._host_lengths is None:
            self._host_lengths = (self.sequence_lengths.cpu(), self.prompt_lengths.cpu())  # one sync
        return self._host_lengths

    @property
    def num_tokens(self) -> int:
        """Real tokens in the batch (host only)."""
        return int(self.lengths_host()[0].sum())

    def _replace(
        self, each: Callable[[Any], Any], rows: Any = None, *, routes: Any = None, tokens_only: bool = False
    ) -> RolloutBatch:
        """Unchecked new batch: ``each`` on every field (or ``routes`` on the routes; ``tokens_only``),
        host lengths of the ``rows`` (a slice or host index; None: all)."""
        names = TOKEN_FIELDS if tokens_only else (*TOKEN_FIELDS, *ROW_FIELDS)
        values = {name: getattr(self, name) for name in (*TOKEN_FIELDS, *ROW_FIELDS)}
        values.update({name: each(values[name]) for name in names})
        r = self.routed_experts
        values["routed_experts"] = r if r is None or tokens_only else (routes or each)(r)
        hosts = self._host_lengths if rows is None else tuple(h[rows] for h in self.lengths_host())
        out = object.__new__(RolloutBatch)
        values.update(route_layers=self.route_layers, _host_lengths=hosts, _root=self._root, _rows=self._rows)
        out.__dict__.update(values, _lease=None)
        return out

    def _lineage(self) -> tuple[RolloutBatch, Tensor]:
        """The first uncut ancestor and the host int64 ``[B]`` positions of this batch's rows there."""
        return (self, torch.arange(len(self))) if self._root is None else (self._root, self._rows)

    def _cut(self, out: RolloutBatch, rows: Tensor) -> RolloutBatch:
        """Record that ``out`` holds this batch's rows ``rows`` (host int64 ``[n]``)."""
        out._root, mine = self._lineage()
        out._rows = mine[rows]
        return out

    def rows_in(self, batch: RolloutBatch) -> Tensor | None:
        """Where this batch's rows sit in ``batch``, when both were cut from one batch (at any depth).

        Args:
            batch: A batch sharing this one's first uncut ancestor.

        Returns:
            Host int64 ``[B]`` positions, or None when some row is not in ``batch``.
        """
        root, mine = self._lineage()
        other_root, theirs = batch._lineage()
        if root is not other_root:
            return None
        where = torch.full((len(root),), -1, dtype=torch.int64)
        where[theirs] = torch.arange(len(batch))
        found = where[mine]
        return found if bool((found >= 0).all()) else None  # host tensors

    def _gather(self, index: Tensor) -> RolloutBatch:
        """Rows ``index`` (host int64 ``[n]`` in ``[0, B)``) into new storage."""
        device_index = to_device_async(index, self.device)
        out = self._replace(lambda t: t.index_select(0, device_index), index, routes=lambda r: r[index])
        out._root = out._rows = None  # new rows (repeats); indexing records its cut itself
        return out

    def __getitem__(
        self, index: int | slice | Sequence[int] | Sequence[bool] | Tensor | np.ndarray
    ) -> RolloutBatch:
        """int -> one row; step-1 slice -> view; else a gathered copy (a device index: one sync)."""
        picked = batch_index(index, len(self), owner="RolloutBatch", unit="row")
        if isinstance(picked, int):
            return self[picked : picked + 1]
        if isinstance(picked, slice):
            view = self._replace(lambda t: t[picked], picked)
            return self._cut(view, torch.arange(picked.start, picked.stop))
        return self._cut(self._gather(picked), picked)

    def select(self, rows: Sequence[int] | Sequence[bool] | Tensor | np.ndarray) -> RolloutBatch:
        """Rows in new storage (device ``rows``: a sync).

        Args:
            rows: Positions in any order, or a bool mask of length ``B``.

        Raises:
            TypeError: An int or a slice (use ``batch[i]`` / ``batch[a:b]``).
        """
        if isinstance(rows, (int, slice)):
            raise TypeError(
                "RolloutBatch.select takes row positions or a bool mask; use batch[i] / batch[a:b]"
            )
        return self[rows]

    def split(self, split_size_or_sections: int | Sequence[int]) -> list[RolloutBatch]:
        """Micro-batches as views, like ``torch.split`` along the batch axis.

        Args:
            split_size_or_sections: Rows per micro-batch (the last may be shorter), or each one's rows.

        Raises:
            ValueError: A size below 1, or sections that are negative or do not sum to ``B``.
        """
        count = len(self)
        if isinstance(split_size_or_sections, int):
            size = check_int("split size", split_size_or_sections)
            sections = [min(size, count - s) for s in range(0, count, size)]
        else:
            sections = [operator.index(s) for s in split_size_or_sections]
            if any(s < 0 for s in sections) or sum(sections) != count:
                raise ValueError(f"split sections {sections} must be >= 0 and sum to the batch size {count}")
        ends = list(itertools.accumulate(sections))
        return [self[end - size : end] for end, size in zip(ends, sections, strict=True)]

    def chunk(self, chunks: int) -> list[RolloutBatch]:
        """At most ``chunks`` views of ``ceil(B / chunks)`` rows, like ``torch.chunk``.

        Args:
            chunks: How many, >= 1.
        """
        check_int("chunks", chunks)
        return self.split(max(1, math.ceil(len(self) / chunks)))

    def trim(self) -> RolloutBatch:
        """View without the leading columns that are padding in every row (host lengths, no sync)."""
        start = self.width - (int(self.lengths_host()[0].max()) if len(self) else 0)
        if start == 0:
            return self
        trimmed = self._replace(lambda t: t[:, start:], tokens_only=True)
        return self._cut(trimmed, torch.arange(len(self)))

    @staticmethod
    def cat(batches: Sequence[RolloutBatch], *, pad_token_id: int = 0) -> RolloutBatch:
        """Rows of all ``batches`` in new storage, left-padded to the widest, routes in the widest dtype.

        Args:
            batches: At least one; one device, one ``route_layers``, all with routes or none.
            pad_token_id: Pads ``input_ids`` of narrower batches.

        Raises:
            ValueError: No batch, mixed routes, or different ``route_layers``.
        """
        return RolloutBatch(**joined_fields(list(batches), pad_token_id=pad_token_id))

    def repeat(self, repeats: int) -> RolloutBatch:
        """The whole batch ``repeats`` times (``[a, b, a, b]``), new storage.

        Args:
            repeats: How many copies, >= 0.
        """
        return self._gather(torch.arange(len(self)).repeat(check_int("repeats", repeats, 0)))

    def repeat_interleave(self, repeats: int | Sequence[int] | Tensor) -> RolloutBatch:
        """Each row repeated in place (``[a, a, b, b]``), new storage.

        Args:
            repeats: An int >= 0, or one count >= 0 per row (device counts: a sync).
        """
        per_row = repeat_counts(repeats, len(self), unit="row")
        return self._gather(torch.repeat_interleave(torch.arange(len(self)), per_row))

    def pad_to_multiple(
        self,
        multiple: int,
        *,
        num_layers: int | None = None,
        top_k: int | None = None,
        num_experts: int | None = None,
        pad_token_id: int = 0,
    ) -> RolloutBatch:
        """Append zero-loss placeholder rows until ``len`` is a multiple of ``multiple``, each with one
        dummy route row (distinct experts, rotating over all of them).

        Args:
            multiple: The row multiple, >= 1.
            num_layers, top_k: Checked against the routes' schema (None: taken from it).
            num_experts: Sizes the dummy routes; required when the batch has routes.
            pad_token_id: The placeholders' one prompt token.

        Returns:
            ``self`` when nothing is missing, else a batch in new storage on the same device.

        Raises:
            ValueError: A schema mismatch, or routes without ``num_experts``.
        """
        missing = -len(self) % check_int("multiple", multiple)
        if missing == 0:
            return self
        schema = None
        if self.routed_experts is not None:
            schema = self.routed_experts.row_shape
            wanted = (schema[0] if num_layers is None else num_layers, schema[1] if top_k is None else top_k)
            if wanted != schema:
                raise ValueError(
                    f"pad_to_multiple: (num_layers, top_k) = {wanted} does not match the routes' schema {schema}"
                )
            if num_experts is None:
                raise ValueError("pad_to_multiple: num_experts is required to build placeholder routes")
        fields = placeholder_fields(
            missing,
            pad_token_id=pad_token_id,
            route_schema=schema,
            num_experts=num_experts,
            route_layers=self.route_layers,
        )
        return RolloutBatch.cat([self, RolloutBatch(**fields).to(self.device)], pad_token_id=pad_token_id)

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> RolloutBatch:
        """Every field on ``device`` (``self`` when already there).

        Args:
            device: The target device.
            non_blocking: Asynchronous copies from pinned memory.
        """
        moved = self.input_ids.to(device, non_blocking=non_blocking)
        if moved is self.input_ids:
            return self
        return self._replace(
            lambda t: moved if t is self.input_ids else t.to(device, non_blocking=non_blocking)
        )

    def cpu(self) -> RolloutBatch:
        return self.to("cpu")

    def pin_memory(self) -> RolloutBatch:
        """Page-locked copy (``self`` when already pinned); CPU only."""
        if self.is_pinned():
            return self
        return self._replace(lambda t: t.pin_memory())

    def is_pinned(self) -> bool:
        tensors = [getattr(self, n) for n in (*TOKEN_FIELDS, *ROW_FIELDS, "routed_experts")]
        return all(t.is_pinned() for t in tensors if t is not None)

    def release(self, after: Any = None) -> None:
        """Hand pooled collation buffers back; the batch and its views must not be used after.

        Args:
            after: An event (e.g. ``torch.cuda.Event``) the next write into the buffers waits for,
                such as the end of the copy that read them.
        """
        lease = self._lease
        self._lease = None
        if lease is not None:
            lease(after)

    def equal(self, other: object) -> bool:
        """Same fields: shapes, dtypes, devices and values (a sync for device batches).

        Args:
            other: Any object (only a `RolloutBatch` can be equal).
        """
        if not isinstance(other, RolloutBatch):
            return False
        for name in (*TOKEN_FIELDS, *ROW_FIELDS):
            a = getattr(self, name)
            b = getattr(other, name)
            if a.dtype != b.dtype or a.device != b.device or a.shape != b.shape or not torch.equal(a, b):
                return False
        a = self.routed_experts
        b = other.routed_experts
        if a is None or b is None:
            return a is b
        return self.route_layers == other.route_layers and a.equal(b)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Raw bytes through numpy: fast, and every dtype (bfloat16 included) survives the trip.
        tensors = {name: tensor_to_bytes(getattr(self, name)) for name in (*TOKEN_FIELDS, *ROW_FIELDS)}
        routes = self.routed_experts
        layers = self.route_layers
        return _rebuild, (tensors, routes, self.lengths_host(), str(self.device), layers)

    def __repr__(self) -> str:
        routes = "None" if self.routed_experts is None else repr(self.routed_experts)
        routes += "" if self.route_layers is None else f" on layers {list(self.route_layers)}"
        return f"RolloutBatch(B={len(self)}, S={self.width}, device={self.device}, routed_experts={routes})"


# Opaque to Lightning's ``apply_to_collection``: under "bf16-true" / "16-true" it would cast the
# float32 logprobs (error ~0.06 at -20) into pageable copies (blocking the pinned copy) and drop the
# lease. Lightning then infers no batch size either: ``self.log(..., batch_size=len(batch))``.
del RolloutBatch.__dataclass_fields__


def _rebuild(
    tensors: dict[str, tuple[np.ndarray, str, tuple[int, ...]]],
    routes: PackedTensor | None,
    host: tuple[Tensor, Tensor],
    device: str,
    route_layers: tuple[int, ...] | None = None,
) -> RolloutBatch:
    values = {name: tensor_from_bytes(*spec) for name, spec in tensors.items()}
    routes = None if routes is None else routes.to("cpu")
    batch = RolloutBatch(**values, routed_experts=routes, route_layers=route_layers, _host_lengths=host)
    return batch.to(device)
