"""The main job on 2 and 4 gloo processes: every rank collects only its own GRPO groups from
rank 0's embedded engine, and step 0's trajectories are those of a 1-process run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

from r3lightning.data.buffer import pack_trajectories, unpack_trajectories

pytestmark = pytest.mark.slow

PROMPTS, GROUP = 4, 2
OVERRIDES = [
    f"prompts_per_step={PROMPTS}",
    f"algorithm.group_size={GROUP}",
    "task.response_length=3",
    "rollout.server.max_batch_size=1",  # one request per forward: results independent of timing
    "plot=false",
    "trainer.enable_progress_bar=false",
]


def _run_job(run_dir: Path, world: int, rank: int, steps: int = 1, spy_dir: Path | None = None) -> None:
    """Run the job, saving this rank's buffer into ``spy_dir`` after each step's collection."""
    from r3lightning.app.job import rollout_loop
    from r3lightning.app.job.main import compose_config, run

    summarize = rollout_loop.RolloutLoop._summarize

    def spy(self, step, rollouts):
        path = (spy_dir or run_dir) / f"step{step}_rank{rank}.pt"
        torch.save(pack_trajectories(rollouts.trajectories), path)
        return summarize(self, step, rollouts)

    rollout_loop.RolloutLoop._summarize = spy
    try:
        devices = [f"trainer.devices={world}", "trainer.strategy=ddp"] if world > 1 else []
        run(compose_config([*OVERRIDES, f"steps={steps}", *devices]), run_dir)
    finally:
        rollout_loop.RolloutLoop._summarize = summarize


def _rank(rank: int, world: int, run_dir: str, steps: int = 1, spy_dir: str | None = None) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    _run_job(Path(run_dir), world, rank, steps, None if spy_dir is None else Path(spy_dir))


def _load(path: Path):
    return unpack_trajectories(torch.load(path))


def _key(t):
    return (t.prompt_ids.tolist(), t.response_ids.tolist())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("world1")
    _run_job(run_dir, 1, 0)
    return _load(run_dir / "step0_rank0.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_collects_its_own_groups_and_step0_matches_one_process(one_process, tmp_path, world):
    steps = 2 if world == 2 else 1
    run_ranks(_rank, world, str(tmp_path), steps, nprocs=world)
    assert len(one_process) == PROMPTS * GROUP
    per_rank = PROMPTS * GROUP // world
    union = []
    for rank in range(world):
        mine = _load(tmp_path / f"step0_rank{rank}.pt")
        # exactly its contiguous block of whole groups, nothing else
        expected = one_process[rank * per_rank : (rank + 1) * per_rank]
        assert [_key(t) for t in mine] == [_key(t) for t in expected]
        for a, b in zip(mine, expected, strict=True):
            assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
            assert torch.equal(a.routed_experts, b.routed_experts) and a.routed_experts.dtype == torch.uint8
            assert (a.reward, a.advantage) == (b.reward, b.advantage)
        union += mine
        assert not (tmp_path / f"step{steps}_rank{rank}.pt").exists()  # no rollout after the last step
    assert sorted(map(str, map(_key, union))) == sorted(map(str, map(_key, one_process)))
    # every step trained on every rank and rank 0 wrote the metrics with the all-reduced statistics
    metrics = (tmp_path / "replay_r3" / "metrics.csv").read_text().splitlines()
    assert len(metrics) == steps + 1
    row = dict(zip(metrics[0].split(","), metrics[1].split(","), strict=True))
    rewards = [t.reward for t in one_process]
    assert float(row["reward"]) == pytest.approx(sum(rewards) / len(rewards))
    assert float(row["rollout_attempts"]) == PROMPTS * GROUP and float(row["engine_errors"]) == 0
    if world != 2:
        return
    # stopped after one step, then extended to two: the checkpoint holds no rollouts of step 1 (and
    # only rank 0's buffer), so every rank collects its own groups of step 1 on the restored
    # weights: the same ones as the run that went straight through
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    run_ranks(_rank, world, str(stopped), 1, nprocs=world)
    assert not list(stopped.glob("step1_*"))
    run_ranks(_rank, world, str(stopped), 2, nprocs=world)
    for rank in range(world):
        straight, resumed = _load(tmp_path / f"step1_rank{rank}.pt"), _load(stopped / f"step1_rank{rank}.pt")
        assert [_key(t) for t in resumed] == [_key(t) for t in straight] and len(resumed) == per_rank
        assert all(
            torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(resumed, straight, strict=True)
        )
    assert len((stopped / "replay_r3" / "metrics.csv").read_text().splitlines()) == 3
