"""Moved keys say where they went, the GRPO settings and the integer ranges are checked when the
config is read, and ``data.options.layers`` must be layers the model routes."""

from __future__ import annotations

import math

import pytest
from job_cli import refusal

from r3lightning.app.job.common import JobError
from r3lightning.app.job.grpo import GRPOAdvantages, GRPOConfig
from r3lightning.app.job.main import compose_config
from r3lightning.app.job.validate import MOVED_KEYS

CARRIED = [(old, new) for old, (new, how) in MOVED_KEYS.items() if how is None]


@pytest.mark.parametrize(("old", "new"), CARRIED, ids=[old for old, _ in CARRIED])
@pytest.mark.parametrize("plus", ["", "+"], ids=["override", "append"])
def test_every_moved_key_says_where_it_went(old, new, plus):
    message = refusal([f"{plus}{old}=7"])
    assert message == f"{old} moved to {new}; set {new}=7 instead"  # never Hydra's "+key" hint


def test_moved_keys_whose_values_change_form_say_how_to_set_them():
    assert refusal(["callbacks.router_replay.log_per_layer=false"]) == (
        "callbacks.router_replay.log_per_layer moved to callbacks.router_replay.log_agreement; set "
        "callbacks.router_replay.log_agreement to per_layer (totals and each layer), true (totals) or false"
    )
    assert refusal(["+callbacks.router_replay.pad_to_multiple=8"]).startswith(
        "callbacks.router_replay.pad_to_multiple moved to callbacks.router_replay.layout_fn; set "
    )
    assert refusal(
        ["task=prompts_file", "task.tokenizer=/x", f"task.path={__file__}", "+task.prompt_key=q"]
    ) == ("task.prompt_key moved to task.columns.prompt; set task.columns.prompt=q instead")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_size": 0}, "group_size must be an integer >= 2 and <= 2147483647, got 0"),
        ({"clip_low": -0.1}, "clip_low must be a number in (0, 1), got -0.1"),
        ({"clip_low": 1.5}, "clip_low must be a number in (0, 1), got 1.5"),
        ({"clip_high": 0.0}, "clip_high must be a number > 0, got 0.0"),
        ({"ratio_band": math.inf}, "ratio_band must be a number >= 1, got inf"),
        ({"normalize_std": "yes"}, "normalize_std must be true or false, got 'yes'"),
        ({"mismatch_every_n_steps": 1.5}, "mismatch_every_n_steps must be an integer >= 0, got 1.5"),
        (
            {"correction": {"mode": "token_tis"}},
            "correction must be a CorrectionConfig (r3lightning.correction), got dict",
        ),
    ],
)
def test_grpo_config_checks_its_values(kwargs, message):
    with pytest.raises(ValueError) as info:
        GRPOConfig(**kwargs)
    assert str(info.value) == message


def test_grpo_advantages_check_their_values():
    with pytest.raises(ValueError, match=r"^std_eps must be a number > 0, got nan$"):
        GRPOAdvantages(std_eps=math.nan)
    with pytest.raises(ValueError, match=r"^normalize_std must be true or false, got 1$"):
        GRPOAdvantages(normalize_std=1)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.group_size=0", "algorithm.group_size must be an integer >= 2 and <= 2147483647, got 0"),
        ("algorithm.clip_low=1.5", "algorithm.clip_low must be a number in (0, 1), got 1.5"),
        ("algorithm.clip_low=-0.1", "algorithm.clip_low must be a number in (0, 1), got -0.1"),
        ("algorithm.std_eps=nan", "algorithm.std_eps must be a number > 0, got nan"),
        (
            "algorithm.correction=5",
            "algorithm.correction must be a mapping of CorrectionConfig settings, got 5",
        ),
        (
            "steps=9223372036854775808",
            "steps must be an integer >= 1 and <= 9223372036854775807, got 9223372036854775808",
        ),
        (
            "prompts_per_step=9223372036854775808",
            "prompts_per_step must be an integer >= 1 and <= 9223372036854775807, got 9223372036854775808",
        ),
        (
            "seed=18446744073709551616",
            "seed must be an integer >= 0 and <= 4294967295, got 18446744073709551616",
        ),
        ("rollout.collector.seed=9223372036854775808", None),  # filled in below
    ],
)
def test_job_values_are_refused_when_read(override, message):
    if message is None:  # the collector's own seed: a sampling seed hashes it as an int64
        message = "rollout.collector.seed must be an integer >= 0 and <= 9223372036854775807, got 9223372036854775808"
    assert refusal([override]) == message


@pytest.mark.slow
def test_data_options_layers_must_be_moe_layers_of_the_model(tmp_path):
    from r3lightning.app.job.main import run

    cfg = compose_config(["data.options.layers=[0,1]", "steps=1", "prompts_per_step=1", "plot=false"])
    with pytest.raises(JobError) as info:  # layer 0 of the tiny Qwen3-MoE is dense
        run(cfg, tmp_path / "run")
    assert str(info.value) == (
        "data.options.layers [0, 1]: [0] are not MoE layers of the model, which has 4 decoder layers and "
        "routers on [1, 2, 3]"
    )
    assert not (tmp_path / "run" / "replay_r3" / "metrics.csv").exists()  # refused before any step
