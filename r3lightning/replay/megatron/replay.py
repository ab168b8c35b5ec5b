"""Router replay for megatron-core MoE models through megatron's own ``RouterReplay``."""

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor, nn

from r3lightning._keywords import refuse_moved_keywords
from r3lightning.align.layout import TokenMetadataLayout, split_for_sequence_parallel
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import route_columns, routes_on_all_layers, validate_routes_for_install
from r3lightning.replay.megatron.layout import (
    MegatronParallelism,
    megatron_padding_mask,
    megatron_token_layout,
)
from r3lightning.replay.megatron.router import MaskedRouterReplay

__all__ = ["MegatronParallelism", "MegatronRouterReplay", "megatron_padding_mask", "megatron_token_layout"]


def _virtual_stages(config: Any, modules: list[nn.Module], routers: Sequence[TopKRouter]) -> list[int | None]:
    """Each router's virtual pipeline stage (None without VPP): its module's ``vp_stage`` or chunk index."""
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if not (vpp and vpp > 1) and parallel_state.model_parallel_is_initialized():
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stage_of: dict[int, int] = {}  # router id -> vp_stage of a module holding it
    chunk_of: dict[int, int] = {}  # router id -> index of its chunk in modules
    for index, root in enumerate(modules):
        for module in root.modules():
            if isinstance(module, TopKRouter):
                chunk_of.setdefault(id(module), index)
            if getattr(module, "vp_stage", None) is None:
                continue
            for sub in module.modules():
                if isinstance(sub, TopKRouter):
                    stage_of.setdefault(id(sub), int(module.vp_stage))
    if not (vpp and vpp > 1) and len(set(stage_of.values())) <= 1:
        return [None] * len(routers)
    # a router's own vp_stage, else its chunk's index when the modules are the vpp chunks in order
    chunks_are_stages = len(modules) == vpp
    stages: list[int | None] = []
    for router in routers:
        fallback = chunk_of[id(router)] if chunks_are_stages else None
        stages.append(stage_of.get(id(router), fallback))
    if None in stages:
        layer = routers[stages.index(None)].layer_number - 1
        raise ValueError(
            f"virtual pipeline parallelism (virtual_pipeline_model_parallel_size={vpp}): cannot tell the "
            f"virtual stage of the router at decoder layer {layer}; pass the model chunks in stage order"
        )
    return stages


# 0.1 keywords -> MegatronParallelism's fields in 0.2
_PARALLELISM_MOVED = {
    name: f"parallelism=MegatronParallelism({name}=) (r3lightning.replay.megatron.layout)"
    for name in ("tp_size", "tp_rank", "cp_size", "cp_rank", "sequence_parallel")
}


class MegatronRouterReplay:
    """``RouterReplayBackend`` for the megatron-core ``TopKRouter`` s of one pipeline stage, through
    megatron-core's own ``RouterReplay``.

    Args:
        model_or_modules: The stage's model (or a wrapper), or the modules holding its routers
            (with virtual pipeline parallelism: the model chunks).
        config: The ``TransformerConfig`` (default: the first router's).
        parallelism: This rank's tensor / context parallel sizes and ranks and sequence
            parallelism (default: read from megatron's ``parallel_state``).
        tp_group: The tensor-parallel group `stop_recording` gathers over under sequence
            parallelism (default: megatron's).
        validate: Check the expert ids of every install (range, distinct per row): host syncs.
            Shapes are always checked.

    Cost per install: the sequence-parallel split of the routes (a view), then per MoE layer of
    the stage one non-blocking int64 copy of its column ``[N, K]`` to the routers' device (never
    all layers at once), and one copy of the mask; no host sync without ``validate``. Each
    forward replays through megatron's ``RouterReplay`` (``REPLAY_FORWARD``, and
    ``REPLAY_BACKWARD`` for MoE recompute) and counts the agreement on device.

    Raises:
        TypeError: ``model_or_modules`` holds no ``nn.Module``.
        ValueError: No ``TopKRouter``, sinkhorn routing, token dropping
            (``moe_expert_capacity_factor``), routers built without
            ``moe_enable_routing_replay``, a router without a layer number, two routers on one
            layer or one past ``config.num_layers``, or virtual stages that cannot be told apart.
    """

    @refuse_moved_keywords(_PARALLELISM_MOVED)
    def __init__(
        self,
        model_or_modules: nn.Module | Iterable[nn.Module],
        config: Any = None,
        *,
        parallelism: MegatronParallelism | None = None,
        tp_group: Any = None,
        validate: bool = True,
    ) -> None:
        modules = [model_or_modules] if isinstance(model_or_modules, nn.Module) else list(model_or_modules)
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise TypeError("model_or_modules must be an nn.Module or a non-empty list of nn.Modules")
        by_id: dict[int, TopKRouter] = {}  # a router reached from two of the modules counts once
        for root in modules:
            for module in root.modules():
                if isinstance(module, TopKRouter):
                    by_id[id(module)] = module
        found = by_id.values()
        if not found:
            raise ValueError(
                f"no megatron TopKRouter found in {[type(m).__name__ for m in modules]}; "
                "is it an MoE model (TransformerConfig.num_moe_experts set)?"
            )
        cfg = config if config is not None else next(iter(found)).config
        self.config = cfg
        if getattr(cfg, "moe_router_load_balancing_type", None) == "sinkhorn":
            raise ValueError("sinkhorn routing (moe_router_load_balancing_type) bypasses RouterReplay")
        if getattr(cfg, "moe_expert_capacity_factor", None) is not None:
            raise ValueError(
                f"router replay needs dropless MoE, got moe_expert_capacity_factor={cfg.moe_expert_capacity_factor}: "
                "token dropping would drop replayed experts, so the experts used would differ from the rollout's"
            )
        for router in found:
            if router.router_replay is None:
                raise ValueError(
                    "the routers were built with moe_enable_routing_replay=False (RouterReplay is made at "
                    "construction): build with TransformerConfig(moe_enable_routing_replay=True)"
                )
            if router.layer_number is None:
                raise ValueError(
                    "a TopKRouter has no layer_number (an MoELayer built outside a TransformerLayer): "
                    "call moe_layer.set_layer_number(n) with its 1-based global decoder-layer number"
                )
        self.routers: list[TopKRouter] = sorted(found, key=lambda router: router.layer_number)
        layers = [router.layer_number - 1 for router in self.routers]
        if len(set(layers)) != len(layers):
            raise ValueError(f"several TopKRouters share a decoder layer: layer indices {layers}")
        self.num_layers = int(cfg.num_layers)
        self.top_k = int(cfg.moe_router_topk)
        self.num_experts: int = int(cfg.num_moe_experts)
        if layers[-1] >= self.num_layers:
            raise ValueError(f"router at decoder layer {layers[-1]} but config.num_layers={self.num_layers}")
        self.moe_layers: tuple[int, ...] = tuple(layers)
        sp = bool(getattr(cfg, "sequence_parallel", False))
        self.parallelism = parallelism or MegatronParallelism.resolve(sequence_parallel=sp)
        self.validate = validate
        self._tp_group = tp_group
        self._replays = [MaskedRouterReplay.attach(router) for router in self.routers]
        # per router (moe_layers order); None everywhere without virtual pipeline parallelism
        self.vp_stages: tuple[int | None, ...] = tuple(_virtual_stages(self.config, modules, self.routers))

    def build_layout(
        self, batch: Any, *, packed: bool = True, fp8: bool | None = None
    ) -> TokenMetadataLayout:
        """The layout of the tokens this rank's routers see (`megatron_token_layout`).

        Args:
            batch: A left-padded attention mask ``[B, S]`` or a batch holding one.
            packed: The packed THD layout of this context-parallel rank, else unpacked ``[B, S']``.
            fp8: Pad the packed row for fp8 GEMMs (None: ``config.fp8`` when packed).

        Returns:
            The layout; host maths.
        """
        fp8 = packed and bool(getattr(self.config, "fp8", None)) if fp8 is None else fp8
        return megatron_token_layout(batch, packed=packed, parallelism=self.parallelism, fp8=fp8)

    def _split_sequence(self, tensor: Tensor) -> Tensor:
        """``[B, S, *row] -> [S_local * B, *row]``: this TP rank's tokens in megatron's ``[s, b]`` order."""
        par = self.parallelism
        if par.sequence_parallel and par.tp_size > 1:
            tensor = split_for_sequence_parallel(tensor, par.tp_size, par.tp_rank, dim=1)
        return tensor.transpose(0, 1).reshape(-1, *tensor.shape[2:])

    def install(
        self,
        routes: Tensor,
        replay_mask: Tensor | None = None,
        *,
        layers: Sequence[int] | None = None,
        vp_stage: int | None = None,
    ) -> None:
        """Replays ``routes`` in the next forward and its recompute.

        Args:
            routes: Integer ``[B, S, num_layers, top_k]`` in the layout the model is fed (padded
                ``[B, S']`` or packed ``[1, T_local]``), before the sequence-parallel split; or
                ``[B, S, len(layers), top_k]`` when ``layers`` is given (a pipeline stage's
                columns): each router gets its own column, one non-blocking int64 copy per
                layer, never all layers (host routes should be page-locked for it not to block).
            replay_mask: None, or bool ``[B, S]``: False rows route natively.
            layers: The decoder layer of each column of layer-sliced routes, covering ``moe_layers``.
            vp_stage: With virtual pipeline parallelism, the chunk whose routers take the routes.

        Raises:
            TypeError: ``routes`` is not an integer tensor.
            ValueError: ``routes``, ``replay_mask`` or ``layers`` of the wrong shape; with
                ``validate``, bad expert ids (host syncs); a ``vp_stage`` the model does not have,
                or none with virtual pipeline stages. A forward over another token count raises
                in the router.
        """
        targets = self._stage_positions(vp_stage)
        validate_routes_for_install(
            self, routes, replay_mask, token_dims=2, check_ids=self.validate, layers=layers
        )
        columns = route_columns(self, layers)
        device = self.routers[0].weight.device
        local = self._split_sequence(routes)  # [N, columns, K] compact dtype
        if replay_mask is not None:
            replay_mask = to_device_async(self._split_sequence(replay_mask).contiguous(), device)
        for position in targets:  # one widening copy per layer (no device index tensor to build)
            rows = torch.empty((local.shape[0], self.top_k), dtype=torch.int64, device=device)
            layer_rows = local[:, columns[self.moe_layers[position]]]  # [N, K] compact
            self._replays[position].install(rows.copy_(layer_rows, non_blocking=True), replay_mask)

    def vp_stage_of(self, chunk: nn.Module) -> int | None:
        """The virtual pipeline stage of a model chunk, for ``install(..., vp_stage=)``.

        Args:
            chunk: The model chunk the ``forward_step_func`` is called with.

        Returns:
            Its ``vp_stage`` (None without virtual pipeline parallelism).

        Raises:
            ValueError: ``chunk`` holds routers of several stages, or none of this backend's.
        """
        inside = {id(module) for module in chunk.modules()}
        stages = {s for r, s in zip(self.routers, self.vp_stages, strict=True) if id(r) in inside}
        if len(stages) != 1:
            found = sorted(stages, key=str)
            raise ValueError(f"{type(chunk).__name__} holds routers of virtual stages {found}, not one")
        return stages.pop()

    def _stage_positions(self, vp_stage: int | None) -> list[int]:  # into moe_layers
        stages = sorted({s for s in self.vp_stages if s is not None})
        if not stages and vp_stage not in (None, 0):
            raise ValueError(f"vp_stage={vp_stage!r} given, but the model has no virtual pipeline stages")
        if stages and vp_stage is None:
            chunks = f"virtual pipeline parallelism (model chunks of stages {stages})"
            raise ValueError(f"{chunks}: install(..., vp_stage=) is required, the forward_step_func's")
        positions = [i for i, s in enumerate(self.vp_stages) if s == vp_stage or not stages]
        if not positions:
            raise ValueError(f"vp_stage must be one of {stages} (this rank's MoE chunks), got {vp_stage!r}")
        return positions

    def clear(self) -> None:
        """Drop installed routes, queued recompute entries, recording and stats."""
        for replay in self._replays:
            replay.reset()

    def remove(self) -> None:
        """`clear` and unhook the routers (they keep the mask-aware ``RouterReplay``)."""
        self.clear()
        for router, replay in zip(self.routers, self._replays, strict=True):
            if replay.hook is not None:
                replay.hook.remove()
                replay.hook = None
            if replay.fused_config is not None:
                router.config = replay.fused_config

    def start_recording(self) -> None:
        """Capture the experts used (after any replay) in the following forwards."""
        for replay in self._replays:
            replay.recording = True
            replay.recorded_topk_idx = None
            if replay.target_topk_idx is None:
                replay.set_router_replay_action(RouterReplayAction.RECORD)

    def stop_recording(self) -> Tensor:
        """Ends the recording.

        Returns:
            int32 ``[B, S, num_layers, top_k]`` on the routers' device: the experts the last
            forward used (after any replay), in megatron's token order before the
            sequence-parallel split (TP ranks all-gather their rows: a collective), 0 on layers
            not routed here.

        Raises:
            RuntimeError: No forward of the MoE layers ran, or sequence parallelism without a
                TP group to gather over.
        """
        recorded = [replay.recorded_topk_idx for replay in self._replays]
        batch = self._replays[0].token_batch
        for replay in self._replays:
            replay.recording = False
            if replay.router_replay_action is RouterReplayAction.RECORD:
                replay.clear_router_replay_action()
        if any(rows is None for rows in recorded) or batch is None:
            raise RuntimeError("no forward pass of the MoE layers ran while recording routes")
        local = torch.stack(recorded, dim=1)  # [S_local * B, L_moe, K]
        par = self.parallelism
        if par.sequence_parallel and par.tp_size > 1:
            if self._tp_group is None and not parallel_state.model_parallel_is_initialized():
                fix = "pass tp_group= or initialise megatron.core.parallel_state"
                raise RuntimeError(f"stop_recording with tp_size={par.tp_size} gathers over TP ranks: {fix}")
            group = self._tp_group or parallel_state.get_tensor_model_parallel_group()
            pieces = [torch.empty_like(local) for _ in range(par.tp_size)]
            dist.all_gather(pieces, local.contiguous(), group=group)
            local = torch.cat(pieces)  # [S * B, L_moe, K], TP ranks in sequence order
        tokens = local.reshape(-1, batch, *local.shape[1:]).transpose(0, 1)  # [B, S, L_moe, K]
        rows = ((layer, tokens[:, :, column]) for column, layer in enumerate(self.moe_layers))
        return routes_on_all_layers(rows, tokens.shape[:2], self.num_layers, self.top_k)

    def routing_stats(self) -> dict:
        """Counts of the replaying forwards since `clear`, for this rank's MoE layers.

        Returns:
            ``layers`` (``moe_layers``), ``top_k``, and int64 ``[len(moe_layers)]``
            ``replayed_rows`` and ``agreeing_slots`` on device (no host sync).
        """
        known = [r.counts for r in self._replays if r.counts is not None]
        zero = torch.zeros(2, dtype=torch.int64, device=known[0].device if known else "cpu")
        rows, slots = torch.stack([zero if r.counts is None else r.counts for r in self._replays], dim=1)
        return dict(layers=self.moe_layers, top_k=self.top_k, replayed_rows=rows, agreeing_slots=slots)
