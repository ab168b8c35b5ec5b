"""Per-trajectory accumulation of token-aligned metadata across the turns of a rollout.

A multi-turn rollout sends a growing conversation to the engine several times. Re-gathering the
routes of the whole conversation each turn would resend (and re-decode) every earlier row, so the
trace tells the engine where its capture already stops (``prompt_start``) and appends only the new
rows. Row ``t`` belongs to token ``t`` *as an input*: it is what the forward at position ``t``
produced, which is also what the trainer's forward at ``t`` must replay to predict token ``t + 1``.

Only rows that were really captured are returned. Tokens without a row (the last sampled token,
which the engine never forwards; a synthetic EOS appended after a stop; a prompt whose generation
stopped before it started) are routed natively by the trainer; the trace counts them so callers
can log how much of the loss is not replayed, and ``strict=True`` turns that into an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["RoutedExpertTrace", "TokenMetadataTrace"]

ArrayLike = np.ndarray | torch.Tensor


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _as_host_array(name: str, rows: object) -> np.ndarray:
    """``rows`` as a host ndarray sharing memory where possible (a GPU tensor is copied: a sync)."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype == torch.bfloat16:
            raise ValueError(f"{name} dtype bfloat16 has no host array form; cast it first")
        return rows.detach().cpu().numpy()
    if isinstance(rows, np.ndarray):
        return rows
    raise ValueError(f"{name} must be a numpy array or torch tensor, got {type(rows).__name__}")


def _kind(dtype: np.dtype) -> str:
    return "integer" if dtype.kind in "iu" else dtype.kind


class TokenMetadataTrace:
    """Rows of one trajectory's per-token metadata ``[rows, *row_shape]``, appended in token order.

    ``row_shape`` is fixed by the constructor or by the first append; the dtype stays what the
    producer sent (integer chunks of different widths are widened to the widest only at
    :meth:`finalize`, the one copy). Chunks are kept by reference until then.
    """

    def __init__(self, row_shape: Sequence[int] | None = None, *, name: str = "rows") -> None:
        self.name = name
        self._row_shape = None if row_shape is None else tuple(int(d) for d in row_shape)
        self._chunks: list[np.ndarray] = []
        self._num_rows = 0
        self._dtype: np.dtype | None = None
        self._finalized = False
        # set by finalize: tokens without a row / loss targets whose predicting row is missing
        self.uncaptured_rows: int | None = None
        self.uncaptured_loss_targets: int | None = None

    @property
    def num_rows(self) -> int:
        """Rows captured so far (row ``t`` belongs to token ``t``)."""
        return self._num_rows

    @property
    def row_shape(self) -> tuple[int, ...] | None:
        return self._row_shape

    @property
    def dtype(self) -> np.dtype | None:
        """dtype of the rows so far (the widest integer width seen), None before any row."""
        return self._dtype

    @property
    def finalized(self) -> bool:
        return self._finalized

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError(f"this {type(self).__name__} was already finalized")

    def _validated(self, rows: ArrayLike) -> np.ndarray:
        """Checks ``rows`` against the schema without changing the trace."""
        self._check_open()
        array = _as_host_array(self.name, rows)
        if array.ndim < 1:
            raise ValueError(f"{self.name} must have a row axis [rows, *row_shape], got a 0-d array")
        shape = tuple(array.shape[1:])
        if self._row_shape is not None and shape != self._row_shape:
            raise ValueError(
                f"{self.name} row shape changed: expected [rows, {', '.join(map(str, self._row_shape))}], "
                f"got {tuple(array.shape)}"
            )
        if self._dtype is not None and _kind(array.dtype) != _kind(self._dtype):
            raise ValueError(f"{self.name} dtype changed from {self._dtype} to {array.dtype}")
        return array

    def append(self, rows: ArrayLike) -> None:
        """Append rows for the next ``len(rows)`` tokens. No copy (the chunk is kept by reference)."""
        self._store(self._validated(rows))

    def _store(self, array: np.ndarray) -> None:
        self._row_shape = tuple(array.shape[1:])
        self._dtype = array.dtype if self._dtype is None else np.result_type(self._dtype, array.dtype)
        if array.shape[0]:
            self._chunks.append(array)
            self._num_rows += array.shape[0]

    def finalize(
        self,
        token_count: int,
        loss_mask: Sequence[float] | np.ndarray | torch.Tensor | None = None,
        strict: bool = False,
    ) -> torch.Tensor:
        """The captured rows as one host tensor ``[num_rows <= token_count, *row_shape]``.

        ``loss_mask`` (length ``token_count``, nonzero = loss target) is used to count the targets
        ``t`` whose predicting row ``t - 1`` was never captured (``uncaptured_loss_targets``; token 0
        is never a target). ``strict=True`` raises ``ValueError`` if there is any. Sets
        ``uncaptured_rows = token_count - num_rows``. A trace finalizes once: a second call raises
        ``RuntimeError``; a call that raises ``ValueError`` leaves the trace open. One copy
        (concatenating the chunks).
        """
        self._check_open()
        token_count = _count("token_count", token_count)
        if self._num_rows > token_count:
            raise ValueError(
                f"{self.name}: {self._num_rows} rows were captured but token_count is {token_count}; "
                f"a trajectory has at most one row per token"
            )
        missing_targets = 0
        if loss_mask is not None:
            if isinstance(loss_mask, (np.ndarray, torch.Tensor)):
                mask = _as_host_array("loss_mask", loss_mask)
            else:
                mask = np.asarray(list(loss_mask))
            if mask.ndim != 1 or mask.shape[0] != token_count:
                raise ValueError(
                    f"loss_mask must have one entry per token (token_count={token_count}), got shape {mask.shape}"
                )
            # target t reads the forward at row t - 1; rows >= num_rows were not captured
            targets = np.flatnonzero(mask[1:] != 0) + 1
            missing = targets[targets - 1 >= self._num_rows]
            missing_targets = int(missing.size)
            if strict and missing_targets:
                raise ValueError(
                    f"{self.name}: loss target token {int(missing[0])} needs row {int(missing[0]) - 1}, but "
                    f"only {self._num_rows} rows were captured ({missing_targets} loss targets lack their row; "
                    f"strict=True)"
                )
        if self._chunks:
            rows = torch.from_numpy(np.concatenate(self._chunks, axis=0, dtype=self._dtype))
        else:
            shape = (0, *(self._row_shape or ()))
            rows = torch.from_numpy(np.empty(shape, dtype=np.uint8 if self._dtype is None else self._dtype))
        self.uncaptured_rows = token_count - self._num_rows
        self.uncaptured_loss_targets = missing_targets
        self._chunks = []
        self._finalized = True
        return rows


class RoutedExpertTrace(TokenMetadataTrace):
    """Routes ``[rows, num_layers, top_k]`` of one trajectory, recorded generation by generation.

    Per generation, send ``prompt_start`` with the request so the engine returns rows only from
    there; :meth:`record_generation` checks the count. ``num_layers`` / ``top_k`` fix the schema up
    front (otherwise the first rows do; passing them also shapes an empty result), and
    ``num_experts`` bounds the ids. Uncaptured rows are routed natively by the trainer:
    after :meth:`finalize`, ``uncaptured_rows`` counts them and ``uncaptured_loss_targets`` counts
    the loss targets that depend on them.
    """

    def __init__(
        self, num_layers: int | None = None, top_k: int | None = None, num_experts: int | None = None
    ) -> None:
        for name, value in (("num_layers", num_layers), ("top_k", top_k), ("num_experts", num_experts)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if (num_layers is None) != (top_k is None):
            raise ValueError("give both num_layers and top_k, or neither")
        super().__init__(None if num_layers is None else (num_layers, top_k), name="routed_experts")
        self.num_experts = num_experts
        self._token_count = 0  # tokens of the trajectory so far (last prompt + generated)

    @property
    def prompt_start(self) -> int:
        """Rows captured so far: the engine should return rows from this token on."""
        return self.num_rows

    def record_generation(
        self, prompt_token_count: int, generated_token_count: int, routed_experts: ArrayLike | None
    ) -> None:
        """Record one generation over a prompt of ``P`` tokens that produced ``G`` tokens.

        The engine forwarded tokens ``prompt_start .. P + G - 2`` (the last sampled token is never
        an input), so ``routed_experts`` must have exactly ``P - prompt_start + G - 1`` rows; with
        ``G == 0`` nothing was forwarded and it must be None or empty. The prompt must contain the
        whole trajectory so far (``P >= P_prev + G_prev``). Ids must be non-negative integers
        (below ``num_experts`` when given). On error the trace is unchanged.
        """
        self._check_open()
        prompt = _count("prompt_token_count", prompt_token_count)
        generated = _count("generated_token_count", generated_token_count)
        if prompt < self._token_count:
            raise ValueError(
                f"prompt_token_count ({prompt}) must cover the {self._token_count} tokens recorded so far: "
                f"each turn's prompt extends the trajectory"
            )
        expected = prompt - self.prompt_start + generated - 1 if generated else 0
        if (
            routed_experts is not None
            and not generated
            and _as_host_array("routed_experts", routed_experts).size == 0
        ):
            routed_experts = None  # an engine may send an empty array when nothing was forwarded
        if routed_experts is None:
            if expected:
                raise ValueError(
                    f"routed_experts is missing: expected {expected} rows "
                    f"(P={prompt} - prompt_start={self.prompt_start} + G={generated} - 1)"
                )
            self._token_count = prompt + generated
            return
        array = self._validated(routed_experts)
        if array.ndim != 3:
            raise ValueError(
                f"routed_experts must be [rows, num_layers, top_k], got shape {tuple(array.shape)}"
            )
        if array.shape[0] != expected:
            raise ValueError(
                f"routed_experts has {array.shape[0]} rows, expected {expected} "
                f"(P={prompt} - prompt_start={self.prompt_start} + G={generated} - 1)"
                if generated
                else f"routed_experts has {array.shape[0]} rows, expected 0 (G=0: nothing was forwarded)"
            )
        if array.dtype.kind not in "iu":
            raise ValueError(f"routed_experts must hold integer expert ids, got dtype {array.dtype}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < 0:
                raise ValueError(f"routed_experts holds a negative expert id ({low})")
            if self.num_experts is not None and high >= self.num_experts:
                raise ValueError(
                    f"routed_experts holds expert id {high}, but num_experts is {self.num_experts}"
                )
        self._store(array)
        self._token_count = prompt + generated
