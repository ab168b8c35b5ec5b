"""A verl-layout prompt dataset and a verl-style reward through the main job, offline.

A tiny checkpoint directory (model + chat tokenizer) is written locally, a 20-row parquet in
verl's layout trains for 2 steps on the embedded engine, and the rewards, prompts and stop
conditions are checked against independent computations (the tokenizer's own chat template and
decode, the scorer's own return values).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from r3lightning.app.job.main import compose_config, run
from r3lightning.app.job.report import read_csv
from r3lightning.app.models.tiny_tokenizer import build_tiny_tokenizer, save_tiny_checkpoint
from r3lightning.app.tasks.prompts_file import PromptsFileTask
from r3lightning.data.buffer import ReplayBuffer

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
pytestmark = pytest.mark.slow

QUIET = ["trainer.enable_progress_bar=false", "plot=false"]
CALLS: list[tuple[str, str, dict, float]] = []  # (solution_str, ground_truth, extra_info, score)
_LOCK = threading.Lock()
RELEASE = threading.Event()  # holds the scorer of the rows that hang until the test ends


def recording_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl signature; rows whose index is a multiple of 5 raise, those 1 past one hang, the
    others score by length."""
    if extra_info["index"] % 5 == 0:
        raise ValueError(f"cannot score row {extra_info['index']}")
    if extra_info["index"] % 5 == 1:
        RELEASE.wait(120)  # a scorer stuck on a dead sandbox: reward.timeout_s gives up on it
        return 0.0
    score = len(solution_str) / 10 + (data_source == "toy/add")
    with _LOCK:
        CALLS.append((solution_str, ground_truth, extra_info, score))
    return {"score": score, "length": float(len(solution_str))}


def verl_rows(count):
    return [
        {
            "data_source": "toy/add",
            "prompt": [{"role": "user", "content": f"what is {i}+{i % 7}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + i % 7)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts_job")
    ckpt = save_tiny_checkpoint(root / "ckpt")
    rows = verl_rows(20)
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return root, ckpt, rows


def overrides(root, ckpt, *extra):
    return [
        "model=hf_checkpoint",
        f"model.path={ckpt}",
        "task=prompts_file",
        f"task.path={root / 'train.parquet'}",
        "prompts_per_step=4",
        "rollout.sampling.max_new_tokens=6",
        *QUIET,
        *extra,
    ]


def test_verl_dataset_and_reward_train_through_the_job(dataset, tmp_path, caplog):
    root, ckpt, rows = dataset
    CALLS.clear()
    scorer = ["reward._target_=test_prompts_job.recording_score", "reward.timeout_s=0.5"]
    cfg = compose_config(overrides(root, ckpt, "steps=2", *scorer))
    try:
        with caplog.at_level(logging.WARNING, logger="r3lightning.rollout.prompts"):
            history = run(cfg, tmp_path)["replay=r3"]
    finally:
        RELEASE.set()
    assert read_csv(tmp_path / "replay_r3" / "metrics.csv") == history
    tokenizer = build_tiny_tokenizer()
    template = {
        r["extra_info"]["index"]: tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)[
            "input_ids"
        ]
        for r in rows
    }
    # the checkpoint holds the last step's trajectories: their prompts are the chat-templated rows,
    # and each reward is the scorer's score of the decoded response (0 where it raised or hung)
    checkpoint = torch.load(tmp_path / "replay_r3" / "checkpoints" / "last.ckpt", weights_only=False)
    buffer = ReplayBuffer()
    buffer.load_state_dict(checkpoint["R3DataModule"]["buffer"])
    by_ids = {tuple(ids): index for index, ids in template.items()}
    assert len(buffer) == 4 * cfg.algorithm.group_size
    for trajectory in buffer:
        index = by_ids[tuple(trajectory.prompt_ids.tolist())]  # KeyError: no chat template applied
        text = tokenizer.decode(trajectory.response_ids.tolist(), skip_special_tokens=True)
        expected = 0.0 if index % 5 in (0, 1) else len(text) / 10 + 1.0
        assert trajectory.reward == pytest.approx(expected)
        # the engine stopped at the tokenizer's EOS: it is never followed by more tokens
        ids = trajectory.response_ids.tolist()
        assert tokenizer.eos_token_id not in ids[:-1]
    # two collections (steps 0 and 1; none after the last step) of 4 prompts: 8 different rows (20
    # rows, one epoch); a row whose scorer raised or hung scores 0, is counted per step, never fatal
    task = PromptsFileTask(root / "train.parquet", ckpt, seed=int(cfg.seed))
    steps = [[p.extra_info["index"] for p in task.prompts_for_step(s, 4)] for s in range(2)]
    assert len({i for step in steps for i in step}) == 8
    assert {extra["index"] for _, _, extra, _ in CALLS} == {i for step in steps for i in step if i % 5 > 1}
    group = int(cfg.algorithm.group_size)
    assert [r["reward/failures"] for r in history] == [group * sum(i % 5 == 0 for i in s) for s in steps]
    assert [r["reward/timeouts"] for r in history] == [group * sum(i % 5 == 1 for i in s) for s in steps]
    assert sum(r["reward/failures"] for r in history) > 0 and sum(r["reward/timeouts"] for r in history) > 0
    assert all(r["reward/length"] > 0 for r in history)
    # each kind of scorer trouble is logged once per run, saying the response scored 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("reward recording_score raised ValueError: cannot score row ")
    assert messages[0].endswith("; the response scored 0 (counted in reward/failures; logged once per run)")
    assert messages[1] == (
        "reward recording_score did not return within 0.5 s; the response scored 0 (counted in "
        "reward/timeouts; logged once per run)"
    )


def test_resume_continues_at_the_next_unseen_prompts(dataset, tmp_path):
    root, ckpt, _ = dataset
    # one request per engine batch: the logprobs compared below do not depend on request timing
    base = overrides(root, ckpt, "reward=math_answer", "rollout.server.max_batch_size=1")
    straight = run(compose_config([*base, "steps=3"]), tmp_path / "straight")["replay=r3"]
    run(compose_config([*base, "steps=2"]), tmp_path / "resumed")
    resumed = run(compose_config([*base, "steps=3"]), tmp_path / "resumed")["replay=r3"]
    keys = ["step", "reward", "response_length", "k3_kl", "loss"]
    for a, b in zip(straight, resumed, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-7)
