"""Test helpers for r3lightning.data: random trajectories and a deliberately simple collation
reference built one trajectory at a time from Python lists."""

from __future__ import annotations

import random

import torch

from r3lightning.rollout.trajectory import Trajectory


def make_trajectory(
    rng: random.Random,
    *,
    tag: int | None = None,
    max_prompt: int = 5,
    max_response: int = 5,
    schema: tuple[int, int] | None = (3, 2),
    max_expert: int = 7,
    routes: str = "captured",  # "captured" (n - 1 rows), "random" (0..n rows), "none"
) -> Trajectory:
    """A random trajectory; ``tag`` (if given) becomes the first prompt token, to identify it."""
    prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, max_prompt))]
    if tag is not None:
        prompt[0] = tag
    response = [rng.randrange(1, 50) for _ in range(rng.randint(0, max_response))]
    count = len(response)
    mask = [float(rng.random() < 0.8) for _ in range(count)]
    logprobs = [-round(rng.random() * 4, 3) for _ in range(count)]
    n = len(prompt) + count
    route_rows = None
    if schema is not None and routes != "none":
        rows = n - 1 if routes == "captured" else rng.randint(0, n)
        route_rows = torch.tensor(  # distinct experts per row, as the route check requires
            [[rng.sample(range(max_expert + 1), schema[1]) for _ in range(schema[0])] for _ in range(rows)],
            dtype=torch.int64,
        ).reshape(rows, *schema)
    reward = round(rng.uniform(-1, 1), 3)
    return Trajectory(
        prompt,
        response,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        reward=reward,
        advantage=reward * 2 if rng.random() < 0.5 else None,
        routed_experts=route_rows,
    )


def reference_fields(trajectories: list[Trajectory], pad_token_id: int = 0, width: int | None = None) -> dict:
    """Every RolloutBatch field, row by row, from Python lists (routes as a list of segments)."""
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    width = max(lengths, default=0) if width is None else width
    ids, attention, loss, logprobs = [], [], [], []
    for t, n in zip(trajectories, lengths, strict=True):
        pad = width - n
        prompt = t.prompt_ids.tolist()
        ids.append([pad_token_id] * pad + prompt + t.response_ids.tolist())
        attention.append([False] * pad + [True] * n)
        loss.append([0.0] * (pad + len(prompt)) + t.loss_mask.tolist())
        logprobs.append([0.0] * (pad + len(prompt)) + t.rollout_logprobs.tolist())
    segments = [t.routed_experts for t in trajectories]
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64).reshape(len(trajectories), width),
        "attention_mask": torch.tensor(attention, dtype=torch.bool).reshape(len(trajectories), width),
        "loss_mask": torch.tensor(loss, dtype=torch.float32).reshape(len(trajectories), width),
        "rollout_logprobs": torch.tensor(logprobs, dtype=torch.float32).reshape(len(trajectories), width),
        "advantages": torch.tensor([t.advantage for t in trajectories], dtype=torch.float32),
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "prompt_lengths": torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.int64),
        "sequence_lengths": torch.tensor(lengths, dtype=torch.int64),
        "route_segments": segments,
    }


def assert_batch_matches(batch, trajectories: list[Trajectory], pad_token_id: int = 0) -> None:
    """``batch`` equals the reference in every field, value and dtype."""
    expected = reference_fields(trajectories, pad_token_id, width=batch.width)
    for name, want in expected.items():
        if name == "route_segments":
            continue
        got = getattr(batch, name)
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), f"{name}: {got} != {want}"
    seq, prompt = batch.lengths_host()
    assert torch.equal(seq, expected["sequence_lengths"]) and torch.equal(prompt, expected["prompt_lengths"])
    segments = expected["route_segments"]
    if all(s is None for s in segments):
        assert batch.routed_experts is None
        return
    present = [s for s in segments if s is not None]
    widest = present[0].dtype
    for s in present[1:]:
        widest = torch.promote_types(widest, s.dtype)
    routes = batch.routed_experts
    assert routes.dtype == widest and routes.row_shape == tuple(present[0].shape[1:])
    assert routes.lengths.tolist() == [0 if s is None else s.shape[0] for s in segments]
    for i, s in enumerate(segments):
        if s is not None:
            assert torch.equal(routes[i], s.to(widest)), f"routes of trajectory {i}"
