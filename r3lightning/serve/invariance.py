"""Batch-invariant serving forwards: a request's tokens, logprobs and routes do not depend on what
else the engine batches it with.

A padded batch forward differs from the same request's forward alone in ways that change
floating-point results: attention reduces over the batch's padded key width, matrix multiplies
pick kernels and blockings by their row count (``x[i] @ W`` among ``M`` rows is not bitwise
``x[i] @ W`` alone), and grouped expert GEMMs depend on how many tokens each expert gets. Three
changes remove all of it, by construction rather than by tolerance:

* attention runs over each row's real keys only (``row_invariant_attention``, registered with
  transformers' attention interface as ``"r3_row_invariant"``): rows with the same padding share
  one SDPA call in which each row is computed by its own (batch, head) program over the same key
  span as when it is alone;
* MoE experts run as transformers' ``"eager"`` loop over experts (accumulated in expert order);
* every ``F.linear`` of the modules that own weights (linears, routers, experts) runs on fixed
  ``tile_rows``-row tiles (``RowTiledLinear``, a torch function mode entered around those modules
  only, by forward hooks): every GEMM call has one shape, and a row's output does not depend on
  the other rows of its tile (a GEMM has no cross-row reduction).

The other operations of a decoder (embedding gathers, RMSNorm, rotary embeddings, softmax, top-k)
are per row already. Cost: one attention call per distinct padding width and layer, the eager
expert loop, and ``ceil(M / tile_rows)`` GEMM calls per linear plus the padding of the last tile
(benchmarks/bench_engine.py measures the throughput cost). No host syncs: the per-row key
offsets are host integers the engine tracks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

ATTENTION_NAME = "r3_row_invariant"

# First real key position of each batch row in the current forward (host ints), set by the engine.
_ROW_STARTS: ContextVar[Sequence[int] | None] = ContextVar("r3_row_starts", default=None)
_TILE_ROWS: ContextVar[int | None] = ContextVar("r3_tile_rows", default=None)


def row_invariant_attention(
    module: nn.Module,
    query: Tensor,  # [B, H, Q, D]
    key: Tensor,  # [B, H_kv, S_kv, D]
    value: Tensor,  # [B, H_kv, S_kv, D]
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention of each row over its own real keys; returns ``[B, Q, H, D]``.

    Left-padded rows: row ``b``'s real keys start at ``starts[b]`` (set by :func:`batch_invariant`).
    Queries on padding positions get zeros (their outputs are never used). Supports a prefill from
    an empty cache (``Q == S_kv``) and one-token decode steps (``Q == 1``). Outside a
    :func:`batch_invariant` block (a plain forward of the model) it is transformers' SDPA attention.
    """
    starts = _ROW_STARTS.get()
    if starts is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if len(starts) != query.shape[0]:
        raise RuntimeError(f"batch_invariant got {len(starts)} row offsets for {query.shape[0]} rows")
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len != 1 and q_len != kv_len:
        raise RuntimeError(f"{ATTENTION_NAME} supports prefill from an empty cache or one-token decode steps")
    gqa = query.shape[1] != key.shape[1]
    out = query.new_zeros(query.shape[0], q_len, query.shape[1], query.shape[3])
    groups: dict[int, list[int]] = {}  # rows with the same padding share one call
    for row, start in enumerate(starts):
        groups.setdefault(start, []).append(row)
    for start, rows in groups.items():
        q_start = start if q_len > 1 else 0
        index = torch.tensor(rows, device=query.device)
        # Gathered copies: each row's attention is computed by its own (batch, head) program of
        # the kernel, the same as when the row is alone.
        attended = F.scaled_dot_product_attention(
            query.index_select(0, index)[:, :, q_start:],
            key.index_select(0, index)[:, :, start:],
            value.index_select(0, index)[:, :, start:],
            is_causal=q_len > 1,
            scale=scaling,
            enable_gqa=gqa,
        )  # [rows, H, Q - q_start, D]
        out[index, q_start:] = attended.transpose(1, 2)
    return out, None


def batch_invariance_problem(model: nn.Module) -> str | None:
    """Why :func:`row_invariant_attention` cannot stand in for ``model``'s attention, or None.

    It needs a transformers model; sliding-window layers and attention sinks (gpt-oss) are not
    implemented by it.
    """
    if not hasattr(model, "set_attn_implementation"):
        return f"{type(model).__name__} is not a transformers model"
    config = getattr(model, "config", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return f"{type(model).__name__} has sliding-window attention layers"
    if any(hasattr(module, "sinks") for module in model.modules()):
        return f"{type(model).__name__} has attention sinks"
    return None


def make_batch_invariant(model: nn.Module) -> None:
    """Switch ``model`` (a transformers model) to computations :func:`batch_invariant` covers.

    Attention: :func:`row_invariant_attention`. MoE experts: transformers' ``"eager"`` experts (a
    loop of ``F.linear`` per expert hit, accumulated in expert order), which the row tiling
    covers; the default grouped GEMM's results depend on how many tokens each expert gets.
    Raises ``ValueError`` when :func:`batch_invariance_problem` finds one.
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
    for module in model.modules():
        # the modules that multiply by their own weights: linears, routers, experts
        if isinstance(module, nn.Embedding):
            continue
        if any(p.dim() >= 2 for p in module.parameters(recurse=False)) and not getattr(
            module, "_r3_row_tiled", False
        ):
            module.register_forward_pre_hook(_start_tiling)
            module.register_forward_hook(_stop_tiling, always_call=True)
            module._r3_row_tiled = True


def _start_tiling(module: nn.Module, args: tuple) -> None:
    tile = _TILE_ROWS.get()
    stack = module.__dict__.setdefault("_r3_tiling", [])
    if tile is None:
        stack.append(None)
        return
    mode = RowTiledLinear(tile)
    mode.__enter__()
    stack.append(mode)


def _stop_tiling(module: nn.Module, args: tuple, output) -> None:
    stack = module.__dict__.get("_r3_tiling")
    if stack:
        mode = stack.pop()
        if mode is not None:
            mode.__exit__(None, None, None)


class RowTiledLinear(TorchFunctionMode):
    """Run every ``F.linear`` on fixed ``tile_rows``-row tiles so all its GEMMs have one shape.

    Rows beyond the input's are zero padding, computed and dropped. Costs ``ceil(M / tile_rows)``
    GEMM calls per linear instead of one, plus a copy of the input rows into the padded tiles.
    """

    def __init__(self, tile_rows: int) -> None:
        super().__init__()
        if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
            raise ValueError(f"tile_rows must be an integer >= 1, got {tile_rows!r}")
        self.tile_rows = tile_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self._linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        tile = self.tile_rows
        num_tiles = max(1, math.ceil(rows.shape[0] / tile))
        padded = rows.new_zeros(num_tiles * tile, rows.shape[1])
        padded[: rows.shape[0]] = rows
        out = torch.cat([F.linear(padded[i * tile : (i + 1) * tile], weight, bias) for i in range(num_tiles)])
        return out[: rows.shape[0]].reshape(*x.shape[:-1], weight.shape[0])


@contextmanager
def batch_invariant(row_starts: Sequence[int], tile_rows: int) -> Iterator[None]:
    """Forwards in this block compute each row as it would be computed alone.

    Needs :func:`make_batch_invariant` on the model (its hooks tile the GEMMs of the modules that
    own weights, only inside this block). ``row_starts``: per batch row, the position of its first real key (left padding width).
    """
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be an integer >= 1, got {tile_rows!r}")
    starts = _ROW_STARTS.set(list(row_starts))
    tile = _TILE_ROWS.set(tile_rows)
    try:
        yield
    finally:
        _TILE_ROWS.reset(tile)
        _ROW_STARTS.reset(starts)
