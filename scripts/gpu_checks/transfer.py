"""``transfer``: buffer -> data module (pinned pool) -> device, then the callback's install."""

from __future__ import annotations

from typing import Any

import torch

from gpu_checks.common import (
    EXPERTS,
    copy_bandwidth,
    expect,
    gpu_sleep,
    make_trajectories,
    no_device_syncs,
    position_ids,
    reference_fields,
    replayed_slots,
)


def check_transfer(device: torch.device) -> dict[str, Any]:
    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes
    from r3lightning.replay.hf.replay import HFRouterReplay

    cuda = device.type == "cuda"
    batch_size, count = 4, 16
    # longest first: later batches fit in the pooled buffers of earlier ones, so every pinned
    # buffer the pool hands out again keeps its address
    trajectories = sorted(make_trajectories(count, seed=1), key=lambda t: -t.num_tokens)
    buffer = ReplayBuffer(num_experts=EXPERTS)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, batch_size, shuffle=False, pin_memory=cuda, collate_threads=2)
    model = build_tiny_moe(seed=0).to(device)
    callback = RouterReplayCallback(backend=HFRouterReplay(model, validate=False))  # validate syncs
    hosts, moved, pointers, copy_events = [], [], set(), []
    for batch in data.train_dataloader():
        if cuda:
            expect(batch.is_pinned(), "a collated batch is not in pinned memory")
            expect(batch.routed_experts.is_pinned(), "batch.routed_experts is not in pinned memory")
            pointers.add(batch.input_ids.data_ptr())
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        hosts.append(batch)  # kept alive: a reused pointer can only come from the pool
        gpu_sleep(device)  # the copy queues behind GPU work: a missing fence lets later writes win
        on_device = data.transfer_batch_to_device(batch, device, 0)
        if cuda:
            events[1].record()
            copy_events.append(events)
        expect(on_device.input_ids.device.type == device.type, f"batch landed on {on_device.device}")
        expect(on_device.routed_experts.device.type == device.type, "routes were not moved to the device")
        moved.append(on_device)
    expect(len(moved) == count // batch_size, f"expected {count // batch_size} batches, got {len(moved)}")
    figures: dict[str, Any] = {"batches": len(moved)}
    if cuda:
        expect(
            len(pointers) <= 2,
            f"the pinned pool did not reuse its buffers: {len(pointers)} distinct input_ids buffers "
            f"for {len(moved)} batches (2 pool slots)",
        )
        torch.cuda.synchronize(device)
        figures["batch_copy_ms"] = sum(a.elapsed_time(b) for a, b in copy_events) / len(copy_events)
        figures["pool_buffers"] = len(pointers)
        misses = data._collator.pool.misses
        expect(misses == 0, f"the pinned pool missed {misses} times (a batch found no free slot)")
    # after later batches rewrote the pooled host buffers, every device batch must be intact
    for index, on_device in enumerate(moved):
        group = trajectories[index * batch_size : (index + 1) * batch_size]
        ref = reference_fields(group)
        for name in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "advantages"):
            expect(torch.equal(getattr(on_device, name).cpu(), ref[name]), f"batch {index}: {name} differs")
        routes = on_device.routed_experts
        expect(torch.equal(routes.values.cpu().long(), ref["routes"]), f"batch {index}: route values differ")
        expect(torch.equal(routes.lengths, ref["route_lengths"]), f"batch {index}: route lengths differ")
        expect(routes.cu_seqlens.dtype == torch.int32, "cu_seqlens must stay int32")
        expect(
            torch.equal(routes.cu_seqlens.cpu(), routes.cu_seqlens_host),
            f"batch {index}: device and host cu_seqlens differ",
        )
    # layout + align + install of the callback: no device->host sync, and a forward uses them
    agree = total = 0
    for index, on_device in enumerate(moved):
        gpu_sleep(device)  # staged index maps must stay intact until their copies ran
        with no_device_syncs(device):
            callback.on_train_batch_start(None, None, on_device, index)  # type: ignore[arg-type]
        mask = on_device.attention_mask
        with torch.no_grad(), record_routes(model) as rec:
            model(input_ids=on_device.input_ids, attention_mask=mask.long(), position_ids=position_ids(mask))
        callback.teardown(None, None, "fit")  # type: ignore[arg-type]
        expect(not callback.backend.installed, "routes still installed after teardown")
        a, t = replayed_slots(rec.routes.cpu(), trajectories[index * batch_size : (index + 1) * batch_size])
        agree, total = agree + a, total + t
    expect(agree == total, f"forward used the installed experts on {agree}/{total} slots")
    figures["replay_agreement"] = agree / total
    if cuda:
        figures.update(copy_bandwidth(device))
    data.teardown("fit")
    return figures
