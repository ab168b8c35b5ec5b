"""Resuming a run: checkpoint checks, the run's fingerprint (task, dataset, model), and the
rollouts a resumed run collects (none after a run's last step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from python_process import run_python

from r3lightning.app.job.main import compose_config
from r3lightning.app.job.run_dir import FINGERPRINT, check_run_dir, fingerprint
from r3lightning.app.job.setup import JobError

QUIET = ["trainer.enable_progress_bar=false", "plot=false"]


def _ckpt(path, state_dict, epoch):
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": epoch, "global_step": epoch + 1, "state_dict": state_dict}, path)


def test_resume_refuses_unreadable_foreign_or_overtaken_checkpoints(tmp_path):
    from r3lightning.app.job.checkpoint import resume_checkpoint
    from r3lightning.app.job.module import GRPOModule
    from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config

    module = GRPOModule(build_tiny_moe(seed=0))
    last = tmp_path / "checkpoints" / "last.ckpt"
    fix = "delete it to start this run over, or set resume=false or another hydra.run.dir"
    assert resume_checkpoint(compose_config(["steps=3"]), tmp_path, module) is None  # nothing to resume
    _ckpt(last, module.state_dict(), epoch=1)  # two steps done
    assert resume_checkpoint(compose_config(["steps=3"]), tmp_path, module) == str(last)
    assert resume_checkpoint(compose_config(["steps=3", "resume=false"]), tmp_path, module) is None
    with pytest.raises(
        JobError, match=rf"^steps=1 is below the 2 steps this run has done \({last}\); set steps=2"
    ):
        resume_checkpoint(compose_config(["steps=1"]), tmp_path, module)
    other = GRPOModule(build_tiny_moe(tiny_moe_config(num_hidden_layers=2), seed=0))
    _ckpt(last, other.state_dict(), epoch=1)
    with pytest.raises(
        JobError, match=rf"^checkpoint {last} was saved for another model \(model\.model\.layers\.2\."
    ):
        resume_checkpoint(compose_config(["steps=3"]), tmp_path, module)
    _ckpt(last, module.state_dict(), epoch=1)
    whole = last.read_bytes()
    for content in (b"", b"garbage" * 10, whole[: len(whole) // 2]):
        last.write_bytes(content)
        with pytest.raises(JobError) as info:
            resume_checkpoint(compose_config(["steps=3"]), tmp_path, module)
        message = str(info.value)
        assert message.startswith(f"checkpoint {last} cannot be read (") and message.endswith(fix)
        assert "\n" not in message
        assert last.read_bytes() == content  # nothing was touched


def _saved_run(run_dir: Path, overrides: list[str]) -> Path:
    """A run folder as a finished run leaves it: a checkpoint folder and its fingerprint."""
    out = run_dir / "replay_r3"
    (out / "checkpoints").mkdir(parents=True)
    (out / FINGERPRINT).write_text(json.dumps(fingerprint(compose_config(overrides))))
    return out


def _refusal(run: Path, detail: str) -> str:
    return (
        f"{run} was trained on another task, dataset or model ({detail}); run with its settings to resume it, "
        "or use another hydra.run.dir"
    )


def test_a_run_resumes_only_with_its_own_task_and_model(tmp_path):
    run = _saved_run(tmp_path, ["steps=2"])
    # same task and model (the seed is a run's dimension: seeds=3 runs live in seed_<s> folders)
    check_run_dir(compose_config(["steps=5", "prompts_per_step=3", "seed=1"]), tmp_path)
    for overrides, detail in (
        (["task.num_classes=3"], "task.num_classes: 2 there, 3 now"),
        (["model.family=olmoe"], "model.family: 'qwen3_moe' there, 'olmoe' now"),
        (["+model.overrides.num_hidden_layers=2"], "model.overrides.num_hidden_layers: absent there, 2 now"),
        (
            ["reward=exact_match"],
            "reward._target_: 'r3lightning.app.tasks.token_class.TokenClassReward' there, "
            "'r3lightning.app.tasks.rewards.exact_match' now",
        ),
    ):
        with pytest.raises(JobError) as info:
            check_run_dir(compose_config(overrides), tmp_path)
        assert str(info.value) == _refusal(run, detail)
    check_run_dir(compose_config(["task.num_classes=3", "resume=false"]), tmp_path)  # starts over
    (run / "checkpoints").rmdir()  # nothing left to resume: a new run may use the folder
    check_run_dir(compose_config(["task.num_classes=3"]), tmp_path)


def test_a_run_resumes_only_on_its_own_dataset(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "reward_model": {"ground_truth": "2"}}\n')
    dataset = ["task=prompts_file", f"task.path={data}", "task.tokenizer=/tok"]
    run = _saved_run(tmp_path / "run", dataset)
    saved = json.loads((run / FINGERPRINT).read_text())
    assert saved["task.path"] == str(data) and saved["data.task.path"].startswith("57 bytes, blake2b ")
    check_run_dir(compose_config(dataset), tmp_path / "run")
    data.write_text('{"prompt": "2+2", "reward_model": {"ground_truth": "4"}}\n')  # same size
    with pytest.raises(JobError) as info:
        check_run_dir(compose_config(dataset), tmp_path / "run")
    assert str(info.value) == _refusal(run, "task.path: the file differs")
    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text())
    with pytest.raises(JobError, match=r"\(task\.path: '.*train\.jsonl' there, '.*other\.jsonl' now\)"):
        check_run_dir(compose_config([*dataset, f"task.path={other}"]), tmp_path / "run")
    (run / FINGERPRINT).write_text("{not json")
    with pytest.raises(JobError, match=rf"^{run / FINGERPRINT} cannot be read \("):
        check_run_dir(compose_config(dataset), tmp_path / "run")


@pytest.mark.slow
def test_no_rollout_after_the_last_step_and_a_foreign_resume_leaves_the_run_untouched(tmp_path, monkeypatch):
    """A run collects the rollouts of its own steps only; extended, it collects the next step's on
    restored weights; rerun with another task it is refused before anything is rewritten."""
    from job_cli import train_cli

    from r3lightning.app.job import rollout_loop
    from r3lightning.app.job.main import run

    collected: list[int] = []
    original = rollout_loop.RolloutLoop._summarize

    def spy(self, step, rollouts):
        collected.append(step)
        return original(self, step, rollouts)

    monkeypatch.setattr(rollout_loop.RolloutLoop, "_summarize", spy)
    tiny = ["prompts_per_step=2", "algorithm.group_size=2", "task.response_length=2", *QUIET]
    train_cli(*tiny, "steps=2", f"hydra.run.dir={tmp_path}")  # returns: exit status 0
    assert collected == [0, 1]  # no rollout for a step 2 that never trains
    saved = {p: p.read_bytes() for p in [tmp_path / "config.yaml", *(tmp_path / ".hydra").iterdir()]}
    checkpoint = (tmp_path / "replay_r3" / "checkpoints" / "last.ckpt").read_bytes()
    assert len(saved) == 4  # config.yaml and Hydra's three files
    proc = run_python(
        tmp_path,
        "-m",
        "r3lightning.app.job.main",
        *tiny,
        "steps=3",
        "task.num_classes=3",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        proc.stderr
        == f"r3lightning-train: error: {_refusal(tmp_path / 'replay_r3', 'task.num_classes: 2 there, 3 now')}\n"
    )
    assert {p: p.read_bytes() for p in saved} == saved
    assert (tmp_path / "replay_r3" / "checkpoints" / "last.ckpt").read_bytes() == checkpoint
    collected.clear()
    history = run(compose_config([*tiny, "steps=3"]), tmp_path)["replay=r3"]
    assert collected == [2] and [r["step"] for r in history] == [0.0, 1.0, 2.0]  # step 2 collected on restore
