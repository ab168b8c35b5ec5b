"""Train a small megatron-core MoE with Rollout Routing Replay (R3).

Each step:

1. a "rollout engine" (a bf16 copy of the policy, synced every ``--sync-every`` steps, so its
   numerics and weights differ from the fp32 trainer's) samples responses and records, through megatron's ``RouterReplay`` (RECORD), the experts every
   MoE layer used for every forwarded token: routes ``[n - 1, num_layers, top_k]`` per trajectory,
   kept packed (:class:`r3lightning.PackedTensor`);
2. the trainer builds the packed megatron token layout for its TP/CP position, aligns the packed
   routes to it (padding and uncaptured tokens get distinct placeholder experts and a False replay
   mask), installs them into :class:`r3lightning.MegatronRouterReplay`, and runs a policy-gradient
   step: every MoE layer uses the rollout's experts while the gate weights come from the trainer's
   own logits, so the routers keep learning;
3. it prints how often the trainer's native top-k would have agreed with the rollout (the mismatch
   R3 removes) and checks that the experts actually used equal the rollout's on every token/layer.

The model is the package's tiny megatron-core MoE (:func:`r3lightning.app.models.tiny_megatron.tiny_megatron_moe`:
token-wise embedding, megatron MLP / ``MoELayer`` blocks with residuals, LM head; no attention) so
that it runs on a CPU; the MoE layers, routers and ``RouterReplay`` are megatron-core's own. Run::

    python examples/megatron_moe/train_r3.py --steps 20            # CPU or the current GPU
    python examples/megatron_moe/train_r3.py --device cuda --steps 20

Under a multi-GPU launch with megatron's ``parallel_state`` initialised for TP/CP, the backend and
:meth:`MegatronRouterReplay.build_layout` read the TP/CP sizes and ranks from ``parallel_state``; this
script runs a single process.
"""

from __future__ import annotations

import argparse
import os

import torch

from r3lightning import (
    MegatronRouterReplay,
    PackedTensor,
    align_packed_token_metadata,
    build_replay_mask,
    dummy_routes,
)
from r3lightning.app.models.tiny_megatron import megatron_runtime, tiny_megatron_moe


def rollout(engine, engine_replay, prompts, response_len, generator):
    """Sample responses; return token lists and each trajectory's routes ``[n - 1, L, K]``."""
    trajectories, routes = [], []
    with torch.no_grad():
        for prompt in prompts:
            tokens = prompt.clone()
            for _ in range(response_len):
                logits = engine(tokens[None]).logits[0, -1]
                nxt = torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator)
                tokens = torch.cat([tokens, nxt.to(tokens.device)])
            # the engine forwards every token but the last sampled one: n - 1 route rows
            engine_replay.start_recording()
            engine(tokens[None, :-1])
            routes.append(engine_replay.stop_recording()[0].to(torch.uint8))  # compact on the wire
            trajectories.append(tokens)
    return trajectories, PackedTensor.from_segments(routes)


def left_padded(trajectories: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [B, S]`` and bool ``attention_mask [B, S]``, real tokens at the right end."""
    tokens = PackedTensor.from_segments(trajectories)  # [sum(n)], on the trajectories' device
    real = PackedTensor(torch.ones_like(tokens.values, dtype=torch.bool), tokens.cu_seqlens)
    return tokens.to_padded(side="left"), real.to_padded(pad=False, side="left")


def train_step(policy, backend, optimizer, input_ids, attention_mask, routes, rewards):
    """One R3 policy-gradient step on a packed ``[1, T]`` batch; returns the experts used."""
    layout = backend.build_layout(attention_mask)  # packed, padded for this rank's TP/CP
    L, K, E = backend.num_layers, backend.top_k, backend.num_experts
    aligned = align_packed_token_metadata(
        routes, layout, pad=lambda n: dummy_routes(n, L, K, E, device=routes.device)
    )  # [1, T, L, K]
    replay_mask = build_replay_mask(routes, layout)  # [1, T]: False on padding / uncaptured rows
    tokens = layout.from_batch(input_ids)  # [1, T]
    labels = layout.from_batch(input_ids, next_token=True)
    has_label = layout.from_batch(attention_mask, next_token=True, pad=False)
    advantages = layout.from_batch(rewards[:, None].expand_as(input_ids).contiguous())
    backend.install(aligned, replay_mask)
    backend.start_recording()
    try:
        logprobs = torch.log_softmax(policy(tokens).logits, -1).gather(-1, labels[..., None])[..., 0]
        loss = -(logprobs * advantages * has_label).sum() / has_label.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        used = backend.stop_recording()
        stats = backend.routing_stats()
    finally:
        backend.clear()
    return loss.item(), aligned, replay_mask, used, stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-every", type=int, default=2, help="weight sync period (engine lag)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # a world-size-1 process group, megatron's parallel_state and the CPU shims; undone on exit
    with megatron_runtime(device.type):
        train(args, device)


def train(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = 64
    # dense first layer then three MoE layers of 16 experts, top-2 (DeepSeek-style), routing replay on
    policy = tiny_megatron_moe(vocab_size=vocab, num_experts=16, seed=args.seed).train().to(device)
    engine = tiny_megatron_moe(vocab_size=vocab, num_experts=16).to(device, torch.bfloat16)  # synced below
    backend = MegatronRouterReplay(policy)
    engine_replay = MegatronRouterReplay(engine)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    print(f"moe layers {backend.moe_layers} of {backend.num_layers}, top_k {backend.top_k}")

    for step in range(args.steps):
        if step % args.sync_every == 0:  # the engine lags the trainer, as in asynchronous RL
            engine.load_state_dict(policy.state_dict())  # and stays bf16
        lengths = torch.randint(2, 6, (args.batch,), generator=generator)
        prompts = [torch.randint(0, vocab, (int(n),), generator=generator, device=device) for n in lengths]
        trajectories, routes = rollout(engine, engine_replay, prompts, 4, generator)
        # toy reward: fraction of even tokens in the response, centred over the batch
        rewards = torch.tensor([(t[-4:] % 2 == 0).float().mean().item() for t in trajectories], device=device)
        rewards = rewards - rewards.mean()
        input_ids, attention_mask = left_padded(trajectories)
        loss, aligned, replay_mask, used, stats = train_step(
            policy, backend, optimizer, input_ids, attention_mask, routes.to(device), rewards
        )
        moe = list(backend.moe_layers)
        rows = replay_mask[..., None, None].expand(-1, -1, len(moe), backend.top_k)
        same = (used[:, :, moe] == aligned[:, :, moe].to(used.dtype)) | ~rows
        native = stats["agreeing_slots"].sum() / (stats["replayed_rows"].sum() * stats["top_k"])
        print(
            f"step {step}: loss {loss:+.4f}  native top-k agreement with rollout {100 * native:.2f}%  "
            f"replayed agreement with rollout routes: {100 * same.float().mean():.2f}%"
        )
        if not bool(same.all()):
            raise SystemExit("replayed experts differ from the rollout's")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
