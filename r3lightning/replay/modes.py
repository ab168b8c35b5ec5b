"""What each mode does with the active routes: `Replaying` (r3, r2) installs them, `Comparing`
(off) measures native routing against them; r2 records with `OldPolicyRecorder`."""

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.checks import check_int
from r3lightning.packed import PackedTensor
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import RouterReplayBackend, install_routes, route_columns
from r3lightning.replay.batch_fields import batch_field, set_batch_fields
from r3lightning.replay.metrics import ReplayMetrics, comparison_counts
from r3lightning.routes import ENGINE_ROUTES_FLAG, dummy_routes


@dataclass(frozen=True)
class Install:
    """Routes that the forwards of one (micro-)batch replay or are compared with."""

    layout: TokenMetadataLayout
    routes: Tensor  # [*token_shape, columns, K], dummy rows where uncaptured
    mask: Tensor  # [*token_shape] bool on the routes' device: True where a route row was captured
    layers: tuple[int, ...] | None = None  # each column's decoder layer (None: one per layer, L columns)


def align_routes(
    routes: PackedTensor,
    layout: TokenMetadataLayout,
    backend: RouterReplayBackend,
    layers: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor]:
    """Routes laid out as the model sees its tokens, with the mask of the captured rows.

    Layer-sliced routes stay sliced: the result holds the columns of ``layers`` only, and the
    backend writes each into its layer's router (``install(..., layers=layers)``).

    Args:
        routes: Packed routes, rows ``[columns, top_k]`` in a compact integer dtype.
        layout: The model's token layout.
        backend: The backend that installs them (its layer count, top-k and expert count).
        layers: Each route column's decoder layer (None: one column per decoder layer), covering
            the backend's ``moe_layers``.

    Returns:
        ``(dense, mask)``: ``dense [*token_shape, columns, top_k]`` in the routes' dtype and on
        their device (dummy rows where no route was captured), ``mask [*token_shape]`` bool on the
        same device. Rows marked missing (a -1 id; signed routes only) are masked out and hold
        dummy ids (the dtype widens if the dummy ids' compact dtype needs it). Host index maths, then non-blocking copies of the gather index and of the host
        mask (page-locked) to the device; no host sync.

    Raises:
        ValueError: The rows' shape does not match ``layers`` (or ``num_layers``), or ``layers``
            names a layer the model lacks or leaves out one of its MoE layers.
    """
    L = backend.num_layers
    K = backend.top_k
    E = backend.num_experts
    columns = L if layers is None else len(layers)
    if layers is not None and layers[-1] >= L:  # named before the shape, which it explains
        raise ValueError(
            f"routes on layers {list(layers)} name layer {layers[-1]}, but the model has {L} decoder "
            f"layers (ids 0..{L - 1})"
        )
    if tuple(routes.row_shape) != (columns, K):
        held = f"the model's num_layers={L}" if layers is None else f"one per route layer {list(layers)}"
        raise ValueError(
            f"route rows must be [{columns} layers ({held}), top_k={K}], got {[*routes.row_shape]}"
        )
    route_columns(backend, layers)  # every MoE layer has its column

    def pad(count: int) -> Tensor:
        return dummy_routes(count, columns, K, E, device=routes.device)

    dense = align_packed_token_metadata(routes, layout, pad=pad)  # [*token_shape, columns, K]
    mask = to_device_async(build_replay_mask(routes.lengths, layout), dense.device)  # staged, pinned
    if routes.dtype.is_signed:  # rows marked missing (-1): native, and dummy ids, never -1 installed
        present = PackedTensor(
            (routes.values >= 0).flatten(1).all(1), routes.cu_seqlens, cu_seqlens_host=routes.cu_seqlens_host
        )
        present_dense = align_packed_token_metadata(present, layout, pad=False)  # [*token_shape]
        filler = pad(present_dense.numel()).reshape(dense.shape)
        wide = torch.promote_types(dense.dtype, filler.dtype)
        dense = torch.where(present_dense[..., None, None], dense.to(wide), filler.to(wide))
        mask = mask & present_dense.to(mask.device)
    return dense, mask


class Replaying:
    """r3 / r2: the forwards replay the active install, or route natively without one.

    Args:
        backend: The backend that installs the routes.
        metrics: The step's metrics (None: nothing is counted).
    """

    def __init__(self, backend: RouterReplayBackend, metrics: ReplayMetrics | None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.installed_any = False

    def use(self, install: Install | None) -> None:
        """Makes ``install`` the routes of the following forwards.

        Args:
            install: The routes to install (replacing any), or None: bank the backend's counts
                in the metrics and clear it, so the forwards route natively.
        """
        if install is not None:
            install_routes(self.backend, install.routes, install.mask, install.layers)
            self.installed_any = True
            return
        if self.metrics is not None:  # clearing drops the backend's counts
            self.metrics.add(self.metrics.backend_counts())
        self.backend.clear()

    def table(self, *, reopen: bool = True) -> Tensor | None:
        """The step's counts so far, the backend's included.

        Args:
            reopen: Unused here (`Comparing` takes it).

        Returns:
            int64 ``[COUNTS, len(moe_layers)]``, or None without metrics.
        """
        return None if self.metrics is None else self.metrics.table(with_backend=True)


class Comparing(Replaying):
    """off: native routing; what the forwards used while an install is active is recorded and
    compared with its routes when it ends (dropped when it cannot be: no forward, another shape)."""

    _open: Install | None = None  # the install the forwards are recorded against

    def use(self, install: Install | None) -> None:
        """Compares the forwards recorded against the open install, then records against ``install``.

        Args:
            install: The routes the following forwards are compared with (None: none).
        """
        if self.metrics is None:
            return
        opened = self._open
        self._open = install
        if opened is not None:
            try:
                used = self.backend.stop_recording()  # [*token_shape', L, K]
            except (RuntimeError, ValueError):  # no forward, or forwards that cannot be joined
                used = None
            table = None
            if used is not None:
                index = self.metrics.layer_index(used.device)
                columns = self.metrics.column_index(opened.layers, used.device)
                table = comparison_counts(opened.routes, opened.mask, used, index, columns)
            if table is not None:
                self.metrics.add(table)
        if install is not None:
            self.backend.start_recording()

    def table(self, *, reopen: bool = True) -> Tensor | None:
        """Compares the forwards recorded so far.

        Args:
            reopen: The recording goes on for later forwards (False at the step's end).

        Returns:
            int64 ``[COUNTS, len(moe_layers)]``, or None without metrics.
        """
        self.use(self._open if reopen else None)
        return None if self.metrics is None else self.metrics.table(with_backend=False)


class OldPolicyRecorder:
    """r2: the routes one step's old-policy forwards recorded, kept per row of the step's batch.

    Args:
        step_batch: The step's batch (None: outside a step).
    """

    def __init__(self, step_batch: Any = None) -> None:
        self.step_batch = step_batch
        self.rows: dict[int, Tensor] = {}  # step-batch row -> recorded rows [n, L, K]
        self.layers: tuple[int, ...] | None = None  # those the backend routes (None: all)
        self.recording = False

    def rows_in_step(self, batch: Any) -> Tensor | None:
        """Where a batch's rows sit in the step's batch.

        Args:
            batch: The step's batch, or a cut of it with ``rows_in(step_batch)``.

        Returns:
            int64 host ``[len(batch)]`` positions, or None when ``batch`` is not a cut of it.
        """
        if batch is self.step_batch:
            return torch.arange(len(batch_field(batch, "attention_mask")))
        rows_in = getattr(batch, "rows_in", None)
        return rows_in(self.step_batch) if callable(rows_in) and self.step_batch is not None else None

    def routes_of(self, batch: Any) -> PackedTensor | None:
        """The routes of a batch or a cut of it.

        Args:
            batch: The step's batch or a cut of it.

        Returns:
            ``batch.routed_experts``; else, when every row of ``batch`` was recorded, those rows
            packed (and set on ``batch`` with ``route_layers``); else None.
        """
        routes = batch_field(batch, "routed_experts")
        if routes is not None or not self.rows:  # its own routes, or nothing recorded yet
            return routes
        rows = self.rows_in_step(batch)
        if rows is None or not all(int(r) in self.rows for r in rows):
            return routes
        routes = PackedTensor.from_segments([self.rows[int(r)] for r in rows])
        set_batch_fields(batch, routed_experts=routes, route_layers=self.layers)
        return routes

    def keep(
        self, recorded: Tensor, layout: TokenMetadataLayout, batch: Any, backend: RouterReplayBackend
    ) -> PackedTensor:
        """Packs one old-policy forward's experts per trajectory and keeps them per row.

        Args:
            recorded: int32 ``[*token_shape, L, K]``: what the forward over ``batch`` used.
            layout: ``batch``'s layout (the forward's token shape).
            batch: The batch the forward covered: its ``routed_experts`` and ``route_layers`` are
                set.
            backend: The backend that recorded them: only its ``moe_layers`` columns are kept.

        Returns:
            The packed routes, ``[columns, K]`` rows per trajectory on the recording's device.
            One gather of the real tokens' rows (and of the MoE columns); no host sync.

        Raises:
            ValueError: ``recorded`` does not have the layout's token shape, or the layout is
                context-parallel.
        """
        if tuple(recorded.shape[:-2]) != layout.token_shape:
            got = tuple(recorded.shape[:-2])
            expected = layout.token_shape
            raise ValueError(f"old_policy_forward recorded token shape {got}, expected {expected}")
        if layout.cp_size != 1:
            raise ValueError("r2 needs the whole sequence on each rank: context parallelism is not supported")
        real = to_device_async(layout.token_mask.reshape(-1).nonzero().reshape(-1), recorded.device)
        rows = recorded.reshape(-1, *recorded.shape[-2:]).index_select(0, real)  # sequence-major order
        if len(backend.moe_layers) < backend.num_layers:  # dense layers, other stages: not kept
            self.layers = tuple(backend.moe_layers)
            rows = rows.index_select(1, to_device_async(torch.tensor(self.layers), rows.device))
        packed = PackedTensor.from_lengths(rows, layout.sequence_lengths)
        set_batch_fields(batch, routed_experts=packed, route_layers=self.layers)
        positions = self.rows_in_step(batch)
        for i, row in enumerate([] if positions is None else positions.tolist()):
            self.rows[row] = packed[i]
        return packed


class MissingRoutes:
    """Steps with routes expected but none replayed: counted per step, warned once per mode or raised.

    Args:
        strict: Raise ``ValueError`` instead of counting and warning.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.count = 0
        self.counted_step = False
        self.warned: set[str] = set()

    def __call__(self, mode: str, reason: str) -> None:
        """Counts this step once (warns once per mode), or raises ``ValueError`` when ``strict``.

        Args:
            mode: The callback's mode (``"r3"`` / ``"r2"``): the warning names the engine flag in r3.
            reason: What is missing, for the message.
        """
        if self.strict:
            flag = f"; start the rollout engine with {ENGINE_ROUTES_FLAG}" if mode == "r3" else ""
            raise ValueError(f"RouterReplayCallback(mode={mode!r}, strict=True): {reason}{flag}")
        self.count += not self.counted_step
        self.counted_step = True
        if mode not in self.warned:
            self.warned.add(mode)
            hint = f", so it routes natively. Is the engine run with {ENGINE_ROUTES_FLAG}, asked for routes?"
            hint += " Counted in router_replay/batches_without_routes (warned once; strict=True raises)."
            hint = hint if mode == "r3" else "; nothing was replayed"
            rank_zero_warn(f"RouterReplayCallback(mode={mode!r}): {reason}{hint}")

    def state_dict(self) -> dict[str, Any]:
        """``batches_without_routes`` and the modes already warned about."""
        return {"batches_without_routes": self.count, "warned": sorted(self.warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict`'s values (absent: 0 and none); ``ValueError`` naming a malformed one."""
        count = state.get("batches_without_routes", 0)
        warned = state.get("warned", [])
        check_int("RouterReplayCallback state: batches_without_routes", count, 0)
        if not isinstance(warned, list | tuple) or not set(warned) <= {"r3", "r2"}:
            expected = "warned must be a list of 'r3' / 'r2'"
            raise ValueError(f"RouterReplayCallback state: {expected}, got {warned!r}")
        self.count = count
        self.warned = set(warned)
