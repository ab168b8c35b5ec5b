"""One trajectory's routes (token-aligned metadata), accumulated across the turns of a rollout.
Row ``t`` is the forward at token ``t``, which predicts token ``t + 1``; tokens without a row (the
last sampled token, a synthetic EOS) are routed natively by the trainer and counted."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from r3lightning.routes import MISSING_ROUTE_ID

ArrayLike = np.ndarray | torch.Tensor


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _as_host_array(name: str, rows: object) -> np.ndarray:
    """``rows`` as a host ndarray, sharing memory where possible (a GPU tensor is copied: a sync)."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype == torch.bfloat16:
            raise ValueError(f"{name} dtype bfloat16 has no host array form; cast it first")
        return rows.detach().cpu().numpy()
    if isinstance(rows, np.ndarray):
        return rows
    raise ValueError(f"{name} must be a numpy array or torch tensor, got {type(rows).__name__}")


class TokenMetadataTrace:
    """Rows ``[rows, *row_shape]`` of one trajectory's per-token metadata, appended in token order
    by reference; `finalize` makes the one copy, in the widest integer width appended. Host
    memory only; one trajectory, one thread.

    Args:
        row_shape: The shape of one row (None: the first append fixes it).
        name: What the rows are called in errors.
    """

    def __init__(self, row_shape: Sequence[int] | None = None, *, name: str = "rows") -> None:
        self.name = name
        self.row_shape = None if row_shape is None else tuple(int(d) for d in row_shape)
        self.dtype: np.dtype | None = None  # the widest integer width so far; None before any row
        self.num_rows = 0  # rows captured so far (row t belongs to token t)
        self.finalized = False
        self._chunks: list[np.ndarray] = []
        # set by finalize: tokens without a row / loss targets whose predicting row is missing
        self.uncaptured_rows: int | None = None
        self.uncaptured_loss_targets: int | None = None

    def _check_open(self) -> None:
        if self.finalized:
            raise RuntimeError(f"this {type(self).__name__} was already finalized")

    def _validated(self, rows: ArrayLike) -> np.ndarray:
        """``rows`` checked against the schema; the trace is unchanged."""
        self._check_open()
        array = _as_host_array(self.name, rows)
        if array.ndim < 1:
            raise ValueError(f"{self.name} must have a row axis [rows, *row_shape], got a 0-d array")
        if self.row_shape is not None and tuple(array.shape[1:]) != self.row_shape:
            raise ValueError(
                f"{self.name} row shape changed: expected [rows, {', '.join(map(str, self.row_shape))}], "
                f"got {tuple(array.shape)}"
            )
        if self.dtype is not None and self.dtype.kind.replace("u", "i") != array.dtype.kind.replace("u", "i"):
            raise ValueError(f"{self.name} dtype changed from {self.dtype} to {array.dtype}")
        return array

    def append(self, rows: ArrayLike) -> None:
        """Rows for the next ``len(rows)`` tokens, kept by reference (no copy).

        Args:
            rows: ``[n, *row_shape]`` ndarray or tensor (a device tensor is copied to the host: a sync).

        Raises:
            ValueError: A 0-d array, another row shape, another integer kind, or bfloat16.
            RuntimeError: The trace is finalized.
        """
        self._store(self._validated(rows))

    def _store(self, array: np.ndarray) -> None:
        self.row_shape = tuple(array.shape[1:])
        self.dtype = array.dtype if self.dtype is None else np.result_type(self.dtype, array.dtype)
        if array.shape[0]:
            self._chunks.append(array)
            self.num_rows += array.shape[0]

    def finalize(
        self,
        token_count: int,
        loss_mask: Sequence[float] | np.ndarray | torch.Tensor | None = None,
        strict: bool = False,
    ) -> torch.Tensor:
        """The rows as one host tensor, once; a ``ValueError`` leaves the trace open.

        Sets ``uncaptured_rows`` (tokens without a row) and, from ``loss_mask``,
        ``uncaptured_loss_targets``: loss targets ``t`` whose row ``t - 1`` was never captured.

        Args:
            token_count: Tokens of the whole trajectory (at least the rows captured).
            loss_mask: One entry per token (nonzero: a loss target), or None.
            strict: Raise instead of counting a loss target without its row.

        Returns:
            ``[num_rows <= token_count, *row_shape]`` in the widest dtype appended (one concatenation).

        Raises:
            ValueError: More rows than tokens, a ``loss_mask`` of the wrong length, or (``strict``) a
                loss target without its row.
            RuntimeError: Already finalized.
        """
        self._check_open()
        token_count = _count("token_count", token_count)
        if self.num_rows > token_count:
            raise ValueError(
                f"{self.name}: {self.num_rows} rows were captured but token_count is {token_count}; "
                f"a trajectory has at most one row per token"
            )
        missing_targets = 0
        if loss_mask is not None:
            tensor_like = isinstance(loss_mask, (np.ndarray, torch.Tensor))
            mask = _as_host_array("loss_mask", loss_mask) if tensor_like else np.asarray(list(loss_mask))
            if mask.ndim != 1 or mask.shape[0] != token_count:
                raise ValueError(
                    f"loss_mask must have one entry per token (token_count={token_count}), got shape {mask.shape}"
                )
            targets = np.flatnonzero(mask[1:] != 0) + 1  # target t reads the forward at row t - 1
            missing = targets[targets - 1 >= self.num_rows]
            missing_targets = int(missing.size)
            if strict and missing_targets:
                raise ValueError(
                    f"{self.name}: loss target token {int(missing[0])} needs row {int(missing[0]) - 1}, but "
                    f"only {self.num_rows} rows were captured ({missing_targets} loss targets lack their row; "
                    f"strict=True)"
                )
        if self._chunks:
            rows = torch.from_numpy(np.concatenate(self._chunks, axis=0, dtype=self.dtype))
        else:
            dtype = np.uint8 if self.dtype is None else self.dtype
            rows = torch.from_numpy(np.empty((0, *(self.row_shape or ())), dtype=dtype))
        self.uncaptured_rows = token_count - self.num_rows
        self.uncaptured_loss_targets = missing_targets
        self._chunks = []
        self.finalized = True
        return rows


class RoutedExpertTrace(TokenMetadataTrace):
    """Routes ``[rows, num_layers, top_k]`` of one multi-turn trajectory, recorded generation by
    generation. Send ``prompt_start`` with each request so the engine returns rows from there
    on. Host memory only.

    Args:
        num_layers: Route columns per row (with ``top_k``; None: the first rows fix them).
        top_k: Experts per row and column (with ``num_layers``).
        num_experts: Ids must be below it (None: unchecked).

    Raises:
        ValueError: A size that is not an int >= 1, or only one of ``num_layers`` and ``top_k``.
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
        """Record one generation's routes; on error the trace is unchanged.

        Args:
            prompt_token_count: ``P``, the tokens the generation continued (the whole trajectory so
                far, at least the tokens recorded).
            generated_token_count: ``G``, the tokens it generated.
            routed_experts: Exactly ``P - prompt_start + G - 1`` rows ``[rows, L, K]`` of ids in
                ``[0, num_experts)`` (-1: a row the engine lost); None or empty when ``G == 0``.

        Raises:
            ValueError: A count that is not an int >= 0, a prompt shorter than the trajectory, missing
                routes, the wrong row count, shape or dtype, or an id out of range.
            RuntimeError: The trace is finalized.
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
        where = f"(P={prompt} - prompt_start={self.prompt_start} + G={generated} - 1)"
        if not generated:
            where = "(G=0: nothing was forwarded)"
        # an engine may send an empty array when nothing was forwarded
        if routed_experts is None or (
            not generated and _as_host_array("routed_experts", routed_experts).size == 0
        ):
            if expected:
                raise ValueError(f"routed_experts is missing: expected {expected} rows {where}")
            self._token_count = prompt + generated
            return
        array = self._validated(routed_experts)
        if array.ndim != 3:
            raise ValueError(f"routed_experts must be [rows, num_layers, top_k], got {tuple(array.shape)}")
        if array.shape[0] != expected:
            raise ValueError(f"routed_experts has {array.shape[0]} rows, expected {expected} {where}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"routed_experts must hold integer expert ids, got dtype {array.dtype}")
        if array.size:
            low = int(array.min())
            high = int(array.max())
            if low < MISSING_ROUTE_ID:  # -1 marks a row the engine lost (the client's missing_rows)
                raise ValueError(
                    f"routed_experts holds a negative expert id ({low}); only -1 marks a missing row"
                )
            if self.num_experts is not None and high >= self.num_experts:
                raise ValueError(f"routed_experts: expert id {high}, but num_experts is {self.num_experts}")
        self._store(array)
        self._token_count = prompt + generated
