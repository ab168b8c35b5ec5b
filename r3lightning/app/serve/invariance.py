"""Batch-invariant serving: a request's tokens, logprobs and routes do not depend on its batch
(attention over each row's real keys, the eager expert loop, ``F.linear`` on fixed row tiles; the
docs' protocols page says why and what it costs). No host syncs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from r3lightning.checks import check_setting

ATTENTION_NAME = "r3_row_invariant"

# first real key of each batch row in the current forward (host ints), and the GEMM row tile
_ROW_STARTS: ContextVar[Sequence[int] | None] = ContextVar("r3_row_starts", default=None)
_TILE_ROWS: ContextVar[int | None] = ContextVar("r3_tile_rows", default=None)


def row_invariant_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention of each row over its own real keys (set by `batch_invariant`; SDPA
    outside one). Registered with transformers' ``AttentionInterface`` by `make_batch_invariant`.

    Cost: one SDPA call per distinct padding width in the batch, on gathered copies; no host syncs.

    Args:
        module: the attention module (passed on to SDPA outside `batch_invariant`).
        query: ``[B, H, Q, D]``; a prefill (``Q == S_kv``) or a one-token decode step (``Q == 1``).
        key: ``[B, H_kv, S_kv, D]`` (grouped-query heads when ``H_kv < H``).
        value: ``[B, H_kv, S_kv, D]``.
        attention_mask: used only outside `batch_invariant` (each row's start replaces it inside).
        dropout: passed on to SDPA outside `batch_invariant` (serving is eval: 0).
        scaling: the softmax scale (None: ``D ** -0.5``).
        **kwargs: transformers' other attention arguments, passed on outside `batch_invariant`.

    Returns:
        ``([B, Q, H, D] attended values, zeros on padding queries; None)``, as transformers'
        attention functions return (no attention weights).

    Raises:
        RuntimeError: the row starts do not match the batch, or ``Q`` is neither 1 nor ``S_kv``.
    """
    starts = _ROW_STARTS.get()
    if starts is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if len(starts) != query.shape[0]:
        raise RuntimeError(f"batch_invariant got {len(starts)} row offsets for {query.shape[0]} rows")
    q_len = query.shape[2]
    kv_len = key.shape[2]
    if q_len != 1 and q_len != kv_len:
        raise RuntimeError(f"{ATTENTION_NAME} supports prefill from an empty cache or one-token decode steps")
    out = query.new_zeros(query.shape[0], q_len, query.shape[1], query.shape[3])
    gqa = query.shape[1] != key.shape[1]
    for start in dict.fromkeys(starts):  # rows with the same padding share one call
        q_start = start if q_len > 1 else 0
        index = torch.tensor([row for row, s in enumerate(starts) if s == start], device=query.device)
        # gathered copies: each row computed by its own (batch, head) program, as when alone
        q = query.index_select(0, index)[:, :, q_start:]
        k = key.index_select(0, index)[:, :, start:]
        v = value.index_select(0, index)[:, :, start:]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scaling, enable_gqa=gqa)
        out[index, q_start:] = attended.transpose(1, 2)
    return out, None


def batch_invariance_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be served batch invariant, if it cannot.

    Args:
        model: the model to serve.

    Returns:
        A reason naming the model's class (not a transformers model, sliding-window attention
        layers, attention sinks), or None when `make_batch_invariant` supports it.
    """
    name = type(model).__name__
    if not hasattr(model, "set_attn_implementation"):
        return f"{name} is not a transformers model"
    if "sliding_attention" in (getattr(getattr(model, "config", None), "layer_types", None) or ()):
        return f"{name} has sliding-window attention layers"
    return f"{name} has attention sinks" if any(hasattr(m, "sinks") for m in model.modules()) else None


def make_batch_invariant(model: nn.Module) -> None:
    """Switch ``model`` to row-invariant attention, eager experts and row-tiled weight modules,
    in place; forwards inside `batch_invariant` then compute each row as if it were alone, and
    forwards outside it as before. Calling it twice hooks each module once.

    Args:
        model: a transformers causal LM (see `batch_invariance_problem`).

    Raises:
        ValueError: naming why ``model`` cannot be made batch invariant.
    """
    problem = batch_invariance_problem(model)
    if problem is not None:
        raise ValueError(f"batch-invariant serving is not supported: {problem}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, row_invariant_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # for forwards outside the engine
    model.set_attn_implementation(ATTENTION_NAME)
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    for module in model.modules():  # the modules that multiply by their own weights
        if isinstance(module, nn.Embedding) or getattr(module, "_r3_row_tiled", False):
            continue
        if any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(_start_tiling)
            module.register_forward_hook(_stop_tiling, always_call=True)
            module._r3_row_tiled = True


def _start_tiling(module: nn.Module, args: tuple) -> None:
    tile = _TILE_ROWS.get()
    mode = None if tile is None else RowTiledLinear(tile).__enter__()
    module.__dict__.setdefault("_r3_tiling", []).append(mode)


def _stop_tiling(module: nn.Module, args: tuple, output) -> None:
    stack = module.__dict__.get("_r3_tiling")
    mode = stack.pop() if stack else None
    if mode is not None:
        mode.__exit__(None, None, None)


class RowTiledLinear(TorchFunctionMode):
    """Run every ``F.linear`` on fixed ``tile_rows``-row tiles (the last zero-padded) so its GEMMs
    have one shape. Cost: ``ceil(M / tile_rows)`` GEMMs per linear and a copy of the input rows.

    Args:
        tile_rows: rows per GEMM tile, an integer >= 1.

    Raises:
        ValueError: ``tile_rows`` is not an integer >= 1.
    """

    def __init__(self, tile_rows: int) -> None:
        super().__init__()
        check_setting("tile_rows", tile_rows, low=1, integer=True)
        self.tile_rows = tile_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return (self._linear if func is F.linear else func)(*args, **(kwargs or {}))

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        tile = self.tile_rows
        num_tiles = max(1, math.ceil(rows.shape[0] / tile))
        padded = F.pad(rows, (0, 0, 0, num_tiles * tile - rows.shape[0]))  # zero rows up to whole tiles
        out = torch.cat([F.linear(rows_tile, weight, bias) for rows_tile in padded.split(tile)])
        return out[: rows.shape[0]].reshape(*x.shape[:-1], weight.shape[0])


@contextmanager
def batch_invariant(row_starts: Sequence[int], tile_rows: int) -> Iterator[None]:
    """Forwards of a `make_batch_invariant` model in this block compute each row as it would
    be computed alone (the settings are context variables: other threads are unaffected).

    Args:
        row_starts: per batch row, its first real key (its left padding width), host ints.
        tile_rows: the row tile of every weight module's GEMMs.
    """
    starts_token = _ROW_STARTS.set(list(row_starts))
    tile_token = _TILE_ROWS.set(tile_rows)
    try:
        yield
    finally:
        _TILE_ROWS.reset(tile_token)
        _ROW_STARTS.reset(starts_token)
