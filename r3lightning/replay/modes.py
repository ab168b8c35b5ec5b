"""What each replay mode does with the routes of the active (micro-)batch.

:class:`RouterReplayCallback <r3lightning.replay.callback.RouterReplayCallback>` decides which
routes are active (the step's, a micro-batch's, none); the mode object makes the forwards use them:

* :class:`Replaying` (``r3``, and ``r2`` once routes are recorded) installs them in the backend;
* :class:`Comparing` (``off``) routes natively and compares what the forwards used with them;
* :class:`OldPolicyRecorder` (``r2``) records the old-policy forward and keeps its routes per row;
* :class:`MissingRoutes` counts, warns about or refuses steps whose routes are missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.dummy import dummy_routes
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import RouterReplayBackend
from r3lightning.replay.batch_fields import batch_field, set_batch_field
from r3lightning.replay.metrics import ReplayMetrics, comparison_counts
from r3lightning.wire.request import ENGINE_ROUTES_FLAG

__all__ = [
    "Comparing",
    "Install",
    "MissingRoutes",
    "OldPolicyRecorder",
    "Replaying",
    "align_routes",
    "pack_recorded",
]


@dataclass(frozen=True)
class Install:
    """Routes that the forwards of one (micro-)batch replay or are compared with."""

    layout: TokenMetadataLayout
    routes: Tensor  # [*token_shape, L, K], dummy rows where uncaptured
    mask: Tensor  # [*token_shape] bool on the routes' device: True where a route row was captured


def align_routes(
    routes: PackedTensor, layout: TokenMetadataLayout, backend: RouterReplayBackend
) -> tuple[Tensor, Tensor]:
    """Dense routes ``[*token_shape, L, K]`` (``dummy_routes`` where nothing was captured) and the
    replay mask ``[*token_shape]``, both on the routes' device. Host work only; no host sync."""
    L, K, E = backend.num_layers, backend.top_k, backend.num_experts
    if tuple(routes.row_shape) != (L, K):
        raise ValueError(
            f"batch.routed_experts rows must be [num_layers={L}, top_k={K}], got {tuple(routes.row_shape)}"
        )
    dense = align_packed_token_metadata(
        routes, layout, pad=lambda n: dummy_routes(n, L, K, E, device=routes.device)
    )
    mask = build_replay_mask(routes.lengths, layout)  # host
    return dense, to_device_async(mask, dense.device)  # staged through page-locked memory


class Replaying:
    """r3 / r2: every forward replays the active install; without one the routers route natively.

    ``metrics`` None: nothing is counted. Routing stats accumulate in the backend across installs;
    switching to native routing clears the backend, so its counts are folded into ``metrics`` first.
    """

    def __init__(self, backend: RouterReplayBackend, metrics: ReplayMetrics | None) -> None:
        self.backend, self.metrics = backend, metrics
        self.installed_any = False

    def use(self, install: Install | None) -> None:
        if install is not None:
            self.backend.install(install.routes, install.mask)
            self.installed_any = True
            return
        if self.metrics is not None:
            self.metrics.fold()
        self.backend.clear()

    def table(self, *, reopen: bool = True) -> Tensor | None:
        return None if self.metrics is None else self.metrics.table(with_backend=True)


class Comparing:
    """off: native routing; the experts of the forwards run while an install is active are recorded
    and compared with its routes when it ends (``metrics`` None: nothing recorded or compared).

    A recording that cannot be compared (no forward, or forwards of another token shape such as a
    probe) is dropped: off mode only measures.
    """

    def __init__(self, backend: RouterReplayBackend, metrics: ReplayMetrics | None) -> None:
        self.backend, self.metrics = backend, metrics
        self.installed_any = False
        self._open: Install | None = None

    def use(self, install: Install | None) -> None:
        if self.metrics is None:
            return
        self._close()
        if install is not None:
            self.backend.start_recording()
            self._open = install

    def _close(self) -> None:
        install, self._open = self._open, None
        if install is None or self.metrics is None:
            return
        try:
            used = self.backend.stop_recording()  # [*token_shape', L, K]
        except (RuntimeError, ValueError):
            return
        table = comparison_counts(install.routes, install.mask, used, self.metrics.layer_index(used.device))
        if table is not None:
            self.metrics.add(table)

    def table(self, *, reopen: bool = True) -> Tensor | None:
        """Compare the forwards recorded so far; ``reopen``: the recording goes on for later ones."""
        if self.metrics is None:
            return None
        install = self._open
        self._close()
        if reopen and install is not None:
            self.use(install)
        return self.metrics.table(with_backend=False)


def pack_recorded(recorded: Tensor, layout: TokenMetadataLayout) -> PackedTensor:
    """Recorded ``[*token_shape, L, K]`` -> per-trajectory packed rows (real tokens, in order)."""
    if layout.cp_size != 1:
        raise ValueError("r2 needs the whole sequence on each rank: context parallelism is not supported")
    real = (layout.position_sequence >= 0).nonzero().reshape(-1)  # host, sequence-major order
    rows = recorded.reshape(-1, *recorded.shape[-2:]).index_select(0, to_device_async(real, recorded.device))
    return PackedTensor.from_lengths(rows, layout.sequence_lengths)


class OldPolicyRecorder:
    """r2: the experts the old-policy forwards of one step used, kept per row of the step's batch
    (``step_batch``), so every later pass over those rows (re-cut, shuffled, trimmed) finds them."""

    def __init__(self, step_batch: Any = None) -> None:
        self.step_batch = step_batch
        self.rows: dict[int, Tensor] = {}  # step-batch row -> recorded rows [n, L, K]
        self.recording = False

    def rows_in_step(self, batch: Any) -> Tensor | None:
        """Host positions of ``batch``'s rows in the step's batch (None: not a cut of it)."""
        if batch is self.step_batch:
            return torch.arange(len(batch_field(batch, "attention_mask")))
        rows_in = getattr(batch, "rows_in", None)
        return rows_in(self.step_batch) if callable(rows_in) and self.step_batch is not None else None

    def routes_of(self, batch: Any) -> PackedTensor | None:
        """``batch.routed_experts``, else the routes recorded for all its rows (then set on it)."""
        routes = batch_field(batch, "routed_experts")
        if routes is not None or not self.rows:
            return routes
        rows = self.rows_in_step(batch)
        if rows is None or not all(int(r) in self.rows for r in rows):
            return None
        routes = PackedTensor.from_segments([self.rows[int(r)] for r in rows])
        set_batch_field(batch, "routed_experts", routes)
        return routes

    @contextmanager
    def record(self, backend: RouterReplayBackend) -> Iterator[list[Tensor]]:
        """Record the block's forwards; on a normal exit the list holds ``[*token_shape, L, K]``.
        On an exception the backend is cleared (its routes included)."""
        out: list[Tensor] = []
        backend.start_recording()
        self.recording = True
        try:
            yield out
        except BaseException:
            backend.clear()
            raise
        finally:
            self.recording = False
        out.append(backend.stop_recording())

    def keep(self, recorded: Tensor, layout: TokenMetadataLayout, batch: Any) -> PackedTensor:
        """Pack one forward's ``recorded`` routes per trajectory, set them on ``batch`` and keep
        them for its rows of the step's batch."""
        if tuple(recorded.shape[:-2]) != layout.token_shape:
            raise ValueError(
                f"old_policy_forward recorded token shape {tuple(recorded.shape[:-2])}, expected one forward "
                f"over the batch with token shape {layout.token_shape}"
            )
        packed = pack_recorded(recorded, layout)
        set_batch_field(batch, "routed_experts", packed)
        rows = self.rows_in_step(batch)
        for i, row in enumerate([] if rows is None else rows.tolist()):  # host positions
            self.rows[row] = packed[i]
        return packed


class MissingRoutes:
    """Steps with routes expected (r3, r2) but none replayed: counted once per step, warned once per
    run and mode (rank zero), or an error under ``strict``. Count and warnings are checkpointed."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.count = 0  # this run, this rank
        self.warned: set[str] = set()
        self.counted_step = False  # reset per step by the callback

    def __call__(self, mode: str, reason: str) -> None:
        if self.strict:
            flag = f"; start the rollout engine with {ENGINE_ROUTES_FLAG}" if mode == "r3" else ""
            raise ValueError(f"RouterReplayCallback(mode={mode!r}, strict=True): {reason}{flag}")
        if not self.counted_step:
            self.counted_step = True
            self.count += 1
        if mode in self.warned:
            return
        self.warned.add(mode)
        if mode == "r2":
            rank_zero_warn(f"RouterReplayCallback(mode='r2'): {reason}; nothing was replayed")
        else:
            rank_zero_warn(
                f"RouterReplayCallback(mode='r3'): {reason}, so it routes natively. Is the rollout engine "
                f"started with {ENGINE_ROUTES_FLAG} and asked for routes? Such batches are counted in "
                "router_replay/batches_without_routes (warned once per run; strict=True raises)."
            )

    def state_dict(self) -> dict[str, Any]:
        return {"batches_without_routes": self.count, "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a bad field is a ``ValueError`` naming it (nothing changes)."""
        count, warned = state.get("batches_without_routes", 0), state.get("warned", [])
        if type(count) is not int or count < 0:
            raise ValueError(
                f"RouterReplayCallback state: batches_without_routes must be an int >= 0, got {count!r}"
            )
        if not isinstance(warned, list | tuple) or not set(warned) <= {"r3", "r2"}:
            raise ValueError(
                f"RouterReplayCallback state: warned must be a list of 'r3' / 'r2', got {warned!r}"
            )
        self.count, self.warned = count, set(warned)
