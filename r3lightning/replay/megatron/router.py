"""megatron-core's ``RouterReplay`` with a per-token replay mask, agreement counts and recording."""

import copy
import types
from typing import Any, Self

import torch
from megatron.core import package_info
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor, nn

from r3lightning.replay.backend import agreement_counts, in_recompute

__all__ = ["MaskedRouterReplay"]
# megatron-core versions whose TopKRouter._apply_expert_bias broadcasts the padding mask wrongly
_EXPERT_BIAS_MASK_BUG = (package_info.MAJOR, package_info.MINOR) < (0, 20)
_FORWARD = RouterReplayAction.REPLAY_FORWARD
_BACKWARD = RouterReplayAction.REPLAY_BACKWARD


class MaskedRouterReplay(RouterReplay):
    """One router's replay state; ``replay_backward_masks`` mirrors the FIFO ``replay_backward_list``."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()
        self.hook: Any = None
        self.fused_config: Any = None  # the router's own config when it uses the fused top-k
        self.unfused_config: Any = None  # its copy with moe_router_fusion=False, used to replay

    @classmethod
    def attach(cls, router: TopKRouter) -> Self:
        """Gives a router this replay state (idempotent).

        Swaps ``router.router_replay`` for this class in the same slot of megatron's global list,
        hooks the router's forward, patches the expert-bias token count of megatron-core < 0.20,
        and keeps an unfused copy of a fused router's config to replay with.

        Args:
            router: A ``TopKRouter`` built with ``moe_enable_routing_replay``.

        Returns:
            The router's ``MaskedRouterReplay``.
        """
        current = router.router_replay
        replay = current
        if not isinstance(current, cls):
            replay = cls()
            instances = RouterReplay.global_router_replay_instances
            instances.pop()  # the entry __init__ just appended; take over the old one's slot (or append)
            slot = next((i for i, item in enumerate(instances) if item is current), len(instances))
            instances[slot : slot + 1] = [replay]
            router.router_replay = replay
        if replay.hook is None:
            replay.hook = router.register_forward_pre_hook(replay._before_forward)
        if _EXPERT_BIAS_MASK_BUG and getattr(router, "enable_expert_bias", False):
            router._apply_expert_bias = types.MethodType(_count_expert_tokens, router)
        if replay.fused_config is None and getattr(router.config, "moe_router_fusion", False):
            replay.fused_config = router.config
            replay.unfused_config = copy.copy(router.config)
            replay.unfused_config.moe_router_fusion = False
        return replay

    def install(self, indices: Tensor, mask: Tensor | None) -> None:
        """Replays experts in the next forward (and its recompute); replaces an unused install.

        Args:
            indices: int64 ``[N, K]`` on the router's device, in megatron's ``[s, b]`` token order.
            mask: bool ``[N]``: False rows route natively (None: all replayed).
        """
        if self.fresh:
            self.replay_backward_list.pop()
            self.replay_backward_masks.pop()
        self.set_target_indices(indices, mask)
        self.fresh = True
        self.set_router_replay_action(_FORWARD)

    def set_target_indices(self, topk_indices: Tensor, replay_mask: Tensor | None = None) -> None:
        """megatron's ``set_target_indices``, with the replay mask queued beside the indices.

        Args:
            topk_indices: int64 ``[N, K]``.
            replay_mask: bool ``[N]`` (None: all replayed).
        """
        super().set_target_indices(topk_indices)
        self.target_mask = replay_mask
        self.replay_backward_masks.append(replay_mask)

    def clear_indices(self) -> None:
        """Drop the installed indices, the queued recompute entries and their masks."""
        super().clear_indices()
        # target_mask: [N] bool or None; fresh: installed routes no forward used yet (already queued)
        self.target_mask = None
        self.replay_backward_masks = []
        self.fresh = False

    def reset(self) -> None:
        """Back to native routing: no indices, no action, no recording, no counts."""
        self.clear_indices()
        self.clear_router_replay_action()
        # token_batch: b of the last forward's [s, b, h] input; counts: agreement_counts [2] of the forwards
        self.recording = False
        self.recorded_topk_idx = None
        self.token_batch = None
        self.counts = None

    def _before_forward(self, router: nn.Module, args: tuple) -> None:
        if self.fused_config is not None:  # megatron's unfused top-k while replaying or recording
            active = self.target_topk_idx is not None or self.recording
            router.config = self.unfused_config if active else self.fused_config
        hidden = args[0] if args else None  # [s, b, h]
        if in_recompute():  # activation recomputation: replay what the forward replayed
            if self.target_topk_idx is not None:
                self.set_router_replay_action(_BACKWARD)
            return
        if hidden is not None:
            self.token_batch = hidden.shape[1]
        if self.target_topk_idx is None:
            if self.recording:
                self.set_router_replay_action(RouterReplayAction.RECORD)
            return
        tokens = None if hidden is None else hidden.shape[0] * hidden.shape[1]
        if tokens is not None and tokens != len(self.target_topk_idx):
            where = f"router at layer {router.layer_number - 1} routes {tokens} tokens ([s, b] = {list(hidden.shape[:2])})"
            raise ValueError(f"{where} but the installed routes hold {len(self.target_topk_idx)} rows")
        if not self.fresh:  # a further forward with the same routes gets its own FIFO entry
            self.replay_backward_list.append(self.target_topk_idx)
            self.replay_backward_masks.append(self.target_mask)
        self.fresh = False
        self.set_router_replay_action(_FORWARD)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """megatron's replayed top-k, with masked rows routed natively and the agreement counted.

        Args:
            scores: The router's scores ``[N, E]``.
            topk: Experts per token.
            num_groups: Expert groups of group-limited routing (None: off).
            group_topk: Groups each token may use.
            default_compute_topk: megatron's native top-k function.

        Returns:
            ``(probs [N, K], indices [N, K])`` as megatron's router expects them. Counting
            happens on the forward pass only, on device; no host sync.

        Raises:
            RuntimeError: A recompute pass finds no queued routes.
        """
        action = self.router_replay_action
        if action not in (_FORWARD, _BACKWARD):
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if action is _BACKWARD and not self.replay_backward_list:
            raise RuntimeError("activation recompute found no queued routes: cleared after its forward")
        mask = self.replay_backward_masks.pop(0) if action is _BACKWARD else self.target_mask
        probs, replayed = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if mask is None and action is _BACKWARD:
            return probs, replayed
        indices = replayed
        groups = dict(num_groups=num_groups, group_topk=group_topk)
        if mask is None:
            with torch.no_grad():  # only for the agreement counts
                _, native = default_compute_topk(scores, topk, **groups)
        else:
            native_probs, native = default_compute_topk(scores, topk, **groups)
            keep = mask.to(scores.device, non_blocking=True).unsqueeze(-1)  # [N, 1]
            indices = torch.where(keep, replayed, native)
            probs = torch.where(keep, probs, native_probs)
        if action is _FORWARD:
            counts = agreement_counts(replayed, native, None if mask is None else mask.to(replayed.device))
            self.counts = counts if self.counts is None else self.counts + counts
            if self.recording:
                self.record_indices(indices.detach())
        return probs, indices


def _count_expert_tokens(router: TopKRouter, routing_map: Tensor, padding_mask: Tensor | None = None) -> None:
    """``TopKRouter._apply_expert_bias`` with the ``[N]`` padding mask broadcast per token."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.unsqueeze(-1)  # [N, E] & [N, 1]
            router.local_tokens_per_expert += routing_map.sum(dim=0)
