"""The main job on a multi-turn task (task=calculator): replay modes, per-turn metrics, resume.

Real components throughout: the embedded bf16 engine on 127.0.0.1, the tiny Qwen3-MoE, a
Lightning Trainer.
"""

from __future__ import annotations

import pytest

from r3lightning.app.job.main import compose_config, run
from r3lightning.app.job.report import agreement_keys

pytestmark = pytest.mark.slow
QUIET = ["trainer.enable_progress_bar=false", "plot=false"]


def turn_keys(turns: int) -> set[str]:
    """The columns of a step whose longest trajectory had ``turns`` turns."""
    per_turn = {f"{m}/turn_{k}" for m in ("turn_reward", "route_bytes") for k in range(1, turns + 1)}
    return {"turns", "dropped_groups"} | per_turn


def test_calculator_trains_in_every_replay_mode_with_per_turn_metrics(tmp_path):
    cfg = compose_config(["task=calculator", "steps=2", "prompts_per_step=4", "compare=[r3,r2,off]", *QUIET])
    runs = run(cfg, tmp_path)
    assert set(runs) == {"replay=r3", "replay=r2", "replay=off"}
    for name, history in runs.items():
        assert len(history) == 2
        for record in history:
            assert 1.0 <= record["turns"] <= 3.0 and record["dropped_groups"] == 0.0
            # per-turn columns up to the longest trajectory's turns (at least the mean's)
            reached = sum(f"turn_reward/turn_{k}" in record for k in (1, 2, 3))
            assert reached >= record["turns"] and set(record) >= turn_keys(reached), name
            assert "turn_reward/turn_4" not in record
            # the first turn carries the prompt's and response's rows (6 + 4 - 1 rows of 4 x 2
            # uint8 ids); a later turn only the boundary token, the 2-token observation and its
            # response; r2 asks the engine for no routes
            row = 0 if name == "replay=r2" else 4 * 2
            assert record["route_bytes/turn_1"] == (6 + 4 - 1) * row
            if reached >= 2:  # a column only for a turn some trajectory of the step reached
                assert record["route_bytes/turn_2"] == (1 + 2 + 4 - 1) * row
            # the paired mismatch needs the engine's routes (r2 has none)
            assert ("mismatch/k3_replayed" in record) == (name != "replay=r2"), name
        agreements = [r[k] for r in history for k in agreement_keys(r)]
        if name == "replay=r3":  # every row of every turn replayed: the engine's experts used
            assert len(agreements) == 3 * 2 and all(a == 1.0 for a in agreements)
        elif name == "replay=off":
            assert agreements and all(0.9 < a <= 1.0 for a in agreements)
    # the step-0 rollouts are the same in every arm (same seed, same initial weights)
    firsts = [h[0] for h in runs.values()]
    assert len({(r["reward"], r["turns"], r["turn_reward/turn_1"]) for r in firsts}) == 1


def test_calculator_resumes_exactly(tmp_path):
    base = ["task=calculator", "prompts_per_step=4", *QUIET]
    straight = run(compose_config([*base, "steps=3"]), tmp_path / "straight")["replay=r3"]
    run(compose_config([*base, "steps=2"]), tmp_path / "resumed")
    resumed = run(compose_config([*base, "steps=3"]), tmp_path / "resumed")["replay=r3"]
    for a, b in zip(straight, resumed, strict=True):
        assert set(a) == set(b)  # the same per-turn columns: every step reached the same turns
        keys = ["step", "reward", "reward_std", "k3_kl", "loss", *sorted(k for k in a if "turn" in k)]
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-7)
