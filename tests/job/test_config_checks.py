"""Every value of the job's config is checked when it is read: one line naming the key, exit 2,
before the model or the engine is built."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from job_cli import refusal
from python_process import run_python

from r3lightning.app.job.common import JobError
from r3lightning.app.job.main import compose_config
from r3lightning.app.job.validate import check_config, check_values

MODES = "['r3', 'r2', 'off']"

BAD_VALUES = [
    ("steps=0", "steps must be an integer >= 1 and <= 9223372036854775807, got 0"),
    ("prompts_per_step=two", "prompts_per_step must be an integer, got 'two'"),
    ("seed=-3", "seed must be an integer >= 0 and <= 4294967295, got -3"),
    ("seed=4294967296", "seed must be an integer >= 0 and <= 4294967295, got 4294967296"),
    ("seed=abc", "seed must be an integer, got 'abc'"),
    ("reward_threads=-1", "reward_threads must be an integer >= 0 and <= 1024, got -1"),
    ("resume=maybe", "resume must be true or false, got 'maybe'"),
    ("plot=maybe", "plot must be true or false, got 'maybe'"),
    ("plot=1", "plot must be true or false, got 1"),  # OmegaConf alone would read it as true
    ("plot=yes", "plot must be true or false, got 'yes'"),
    ("replay.request_routes=0", "replay.request_routes must be true or false, got 0"),
    ("rollout.sampling.max_new_tokens=-5", "rollout.sampling.max_new_tokens must be an integer >= 1, got -5"),
    (
        "rollout.sampling.temperature=-1",
        "rollout.sampling.temperature must be a finite number >= 0, got -1.0",
    ),
    (
        "rollout.sampling.temperature=nan",
        "rollout.sampling.temperature must be a finite number >= 0, got nan",
    ),
    ("rollout.sampling.top_p=0", "rollout.sampling.top_p must be a number in (0, 1], got 0.0"),
    ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p must be a number in (0, 1], got 1.5"),
    (
        "rollout.sampling.top_k=-2",
        "rollout.sampling.top_k must be an integer >= -1 (-1 or 0: no filter), got -2",
    ),
    ("rollout.sampling.ignore_eos=maybe", "rollout.sampling.ignore_eos must be true or false, got 'maybe'"),
    (
        "rollout.sampling.stop_token_ids=[-1]",
        "rollout.sampling.stop_token_ids must be null or a list of token ids >= 0, got [-1]",
    ),
    ("rollout.sampling.extra=3", "rollout.sampling.extra must be a mapping, got 3"),
    (
        "rollout.protocol=grpc",
        "rollout.protocol must be one of ['skyrl', 'vllm', 'sglang', 'openai'], got 'grpc'",
    ),
    (
        "rollout.protocol=vllm",
        "rollout.protocol=vllm needs rollout.url (the engine's http://host:port); the embedded engine "
        "speaks ['skyrl', 'sglang']",
    ),
    (
        "rollout.url=localhost:30000",
        "rollout.url must be null (embedded engine), http(s)://host:port or a list of them, got 'localhost:30000'",
    ),
    (
        "rollout.url=[]",
        "rollout.url must be null (embedded engine), http(s)://host:port or a list of them, got []",
    ),
    ("rollout.retry.timeout_s=0", "rollout.retry.timeout_s must be a number > 0, got 0.0"),
    ("rollout.retry.timeout_s=abc", "rollout.retry.timeout_s must be a number, got 'abc'"),
    ("rollout.collector.max_in_flight=0", "rollout.collector.max_in_flight must be an integer >= 1, got 0"),
    ("rollout.max_staleness=-1", "rollout.max_staleness must be an integer >= 0, got -1"),
    ("rollout.max_staleness=0.5", "rollout.max_staleness must be an integer, got 0.5"),
    (
        "rollout.request_timeout_s=5",
        "rollout.request_timeout_s moved to rollout.retry.timeout_s; set rollout.retry.timeout_s=5 instead",
    ),
    ("rollout.sync_weights=maybe", "rollout.sync_weights must be true or false, got 'maybe'"),
    ("rollout.server.port=70000", "rollout.server.port must be an integer >= 0 and <= 65535, got 70000"),
    ("rollout.server.max_batch_size=0", "rollout.server.max_batch_size must be an integer >= 1, got 0"),
    (
        "rollout.server.dtype=int8",
        "rollout.server.dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'",
    ),
    (
        "rollout.server.simulated_disagreement=2",
        "rollout.server.simulated_disagreement must be None or a number >= 0 and <= 0.5, got 2.0",
    ),
    ("reward.timeout_s=0", "reward.timeout_s must be None or a number > 0, got 0"),
    ("task.num_classes=1", "task.num_classes must be an integer >= 2, got 1"),
    ("task.num_classes=two", "task.num_classes must be an integer >= 2, got 'two'"),
    ("task.prompt_length=0", "task.prompt_length must be an integer >= 1, got 0"),
    ("task.first_token=-1", "task.first_token must be an integer >= 0, got -1"),
    ("task.vocab_size=0", "task.vocab_size must be None or an integer >= 1, got 0"),
    (
        "task.vocab_size=8",  # room for 2 * num_classes ids
        "task.first_token must be in [0, vocab_size - 2 * num_classes) = [0, 4), got 4",
    ),
    (
        "model.dtype=float33",
        "model.dtype must be one of ['bfloat16', 'float16', 'float32', 'float64'], got 'float33'",
    ),
    ("replay.mode=r4", f"replay.mode must be one of {MODES}, got 'r4'"),
    ("replay.strict=maybe", "replay.strict must be true or false, got 'maybe'"),
    ("algorithm.group_size=1", "algorithm.group_size must be an integer >= 2 and <= 2147483647, got 1"),
    ("algorithm.clip_low=abc", "algorithm.clip_low must be a number, got 'abc'"),
    ("algorithm.ratio_band=0.5", "algorithm.ratio_band must be a number >= 1, got 0.5"),
    (
        "algorithm.mismatch_every_n_steps=-1",
        "algorithm.mismatch_every_n_steps must be an integer >= 0, got -1",
    ),
    ("algorithm.normalize_std=maybe", "algorithm.normalize_std must be true or false, got 'maybe'"),
    ("algorithm.optim.lr=-1", "algorithm.optim.lr must be a number >= 0, got -1.0"),
    ("algorithm.optim.weight_decay=-1", "algorithm.optim.weight_decay must be a number >= 0, got -1.0"),
    (
        "algorithm.optim.betas=[0.9,1.0]",
        "algorithm.optim.betas must be two numbers in [0, 1), got [0.9, 1.0]",
    ),
    ("algorithm.optim.grad_clip=abc", "algorithm.optim.grad_clip must be a number, got 'abc'"),
    (
        "callbacks.router_replay.log_agreement=layers",
        "callbacks.router_replay: log_agreement must be true, false or 'per_layer', got 'layers'",
    ),
    ("data.batch_size=0", "data: batch_size must be an int >= 1, got 0"),
    ("data.shuffle=maybe", "data.shuffle must be true or false, got 'maybe'"),
    (
        "data.options.layers=[2,1]",
        "data.options.layers must be None or sorted, unique decoder-layer ids >= 0, got [2, 1]",
    ),
    ("+trainer.max_epochs=3", "trainer.max_epochs is set by the job; use steps (one epoch is one RL step)"),
]


@pytest.mark.parametrize(("override", "message"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_every_bad_value_is_one_error_naming_the_key(override, message):
    assert refusal([override]) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout=openai"], "rollout.protocol=openai needs rollout.url (the engine's http://host:port); "),
        (
            ["rollout=skyrl"],
            "rollout.url must be set to the engine's http://host:port (rollout.require_url=true)",
        ),
        (["model=hf_checkpoint"], "model.path must be set (add model.path=... to the command line)"),
        (
            ["task=prompts_file", "task.tokenizer=/x"],
            "task.path must be set (add task.path=... to the command line)",
        ),
        (
            ["task=prompts_file", "task.tokenizer=/x", "task.path=/no/such.parquet"],
            "task.path: no such file: /no/such.parquet",
        ),
        (
            [
                "algorithm.group_size=1",
                "task=prompts_file",
                "task.tokenizer=/x",
                "task.path=/no/such.parquet",
            ],
            "algorithm.group_size must be an integer >= 2 and <= 2147483647, got 1",  # a value before a missing file
        ),
        (
            ["experiment=fsdp_moe", "model.path=/m"],
            "rollout.url must be set to the engine's http://host:port ",
        ),
        (
            ["+algorithm.clip=0.2"],
            "algorithm.clip is not a setting here; expected one of ['group_size', 'clip_low', 'clip_high', "
            "'normalize_std', 'ratio_band', 'mismatch_every_n_steps', 'correction', 'loss']",
        ),
        (
            ["algorithm.clip=0.2"],
            "algorithm.clip is not a setting of GRPOConfig (a typo, or a key of another group?)",
        ),
        (["task=calculator", "task.max_turns=0"], "task.max_turns must be an integer >= 1, got 0"),
        (
            ["task=prompts_file", "task.tokenizer=/x", f"task.path={__file__}", "task.overlong=cut"],
            "task.overlong must be one of ['drop', 'truncate_left', 'truncate_right'], got 'cut'",
        ),
        (["loggers=5"], "loggers must be a list, got 5"),
        (["loggers=[csv]"], "loggers[0] must be a mapping with a _target_, got 'csv'"),
        (["callbacks.router_replay=5"], "callbacks.router_replay must be a mapping with a _target_, got 5"),
    ],
)
def test_values_that_depend_on_each_other(overrides, message):
    assert refusal(overrides).startswith(message)


def test_good_values_pass():
    for overrides in (
        [],
        [
            "seed=4294967295",
            "rollout.sampling.temperature=0",
            "rollout.sampling.top_k=0",
            "reward.timeout_s=null",
        ],
        ["rollout.url=[http://127.0.0.1:1,https://h:2]", "rollout.protocol=vllm", "replay.strict=true"],
        [
            "model.dtype=float64",
            "plot=false",
            "replay.strict=False",
            "task.vocab_size=9",
            "task.first_token=4",
        ],
        [
            "callbacks.router_replay=null",
            "+callbacks.x=null",
            "loggers=null",
            "algorithm.optim.grad_clip=null",
        ],
    ):
        assert refusal(overrides) is None, overrides


NO_MODULE = "no module named '{}' (is its package installed?)"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data._target_=does.not.Exist",
            "data._target_: cannot import 'does.not.Exist': " + NO_MODULE.format("does"),
        ),
        (
            "callbacks.router_replay._target_=does.not.Exist",
            "callbacks.router_replay._target_: cannot import 'does.not.Exist': " + NO_MODULE.format("does"),
        ),
        (
            "+callbacks.extra._target_=nowhere.Callback",
            "callbacks.extra._target_: cannot import 'nowhere.Callback': " + NO_MODULE.format("nowhere"),
        ),
        (
            "module._target_=r3lightning.app.job.module.NoSuchModule",
            "module._target_: cannot import 'r3lightning.app.job.module.NoSuchModule': module "
            "'r3lightning.app.job.module' has no attribute 'NoSuchModule'",
        ),
        (
            "reward._target_=r3lightning.app.tasks.rewards.nonexistent",
            "reward._target_: cannot import 'r3lightning.app.tasks.rewards.nonexistent': module "
            "'r3lightning.app.tasks.rewards' has no attribute 'nonexistent'",
        ),
        (
            "model._target_=nowhere.build",
            "model._target_: cannot import 'nowhere.build': " + NO_MODULE.format("nowhere"),
        ),
        (
            "loggers=[{_target_: nowhere.Logger}]",
            "loggers[0]._target_: cannot import 'nowhere.Logger': " + NO_MODULE.format("nowhere"),
        ),
    ],
)
def test_an_unimportable_target_names_what_is_missing(override, message):
    with pytest.raises(JobError) as info:
        check_config(compose_config([override]))
    assert str(info.value) == message


def test_the_engine_device_is_checked_with_the_targets_once_torch_is_imported():
    # check_values keeps rollout.server's dtype and device by name (no torch); check_targets
    # builds the EngineConfig, whose device must exist here
    cfg = compose_config(["rollout.server.device=tpu"])
    assert check_values(cfg).engine.dtype == "bfloat16"
    with pytest.raises(JobError) as info:
        check_config(cfg)
    assert str(info.value) == "rollout.server.device must be None, 'cpu', 'cuda' or 'cuda:N', got 'tpu'"


def test_a_user_module_without_the_function_names_the_attribute(tmp_path, monkeypatch):
    (tmp_path / "my_scorer.py").write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
    (tmp_path / "needs_dep.py").write_text("import some_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_config(compose_config(["task=prompts_file", "task.tokenizer=/x", f"task.path={__file__}",
                                 "reward._target_=my_scorer.compute_score"]))  # fmt: skip
    for target, reason in (
        ("my_scorer.nonexistent", "module 'my_scorer' has no attribute 'nonexistent'"),
        ("my_scorer.compute_score.inner", "function 'my_scorer.compute_score' has no attribute 'inner'"),
        ("needs_dep.f", NO_MODULE.format("some_missing_dependency")),  # the module exists, its import fails
    ):
        with pytest.raises(JobError) as info:
            check_config(compose_config([f"reward._target_={target}"]))
        assert str(info.value) == f"reward._target_: cannot import '{target}': {reason}"


def test_unknown_group_option_and_key_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="replay"):
        compose_config(["replay=sometimes"])
    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        compose_config(["no_such_key=1"])
    assert refusal(["rollout.retry.timeout=5"]) == (  # the schema's class, not Hydra's +key hint
        "rollout.retry.timeout is not a setting of RetryPolicy (a typo, or a key of another group?)"
    )
    assert refusal(["task.no_such=1"]).endswith("; add a new key with +task.no_such=...")  # an open node


def _job(tmp_path: Path, *args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``r3lightning-train ARGS`` in a fresh interpreter (``prelude`` runs first)."""
    script = f"import sys\n{textwrap.dedent(prelude)}\nfrom r3lightning.app.job.main import main\nmain()\n"
    return run_python(tmp_path, "-c", script, *args, f"hydra.run.dir={tmp_path / 'run'}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rollout.sampling.max_new_tokens=-5",
            "rollout.sampling.max_new_tokens must be an integer >= 1, got -5",
        ),
        ("seed=-3", "seed must be an integer >= 0 and <= 4294967295, got -3"),
        ("seed=abc", "seed must be an integer, got 'abc'"),  # refused by Hydra's structured config
        ("data.shard=true", "data.shard moved to data.options.shard; set data.options.shard=true instead"),
        (
            "rollout.sampling.temperature=-1",
            "rollout.sampling.temperature must be a finite number >= 0, got -1.0",
        ),
    ],
)
def test_a_bad_override_exits_2_in_one_line_before_anything_is_built(tmp_path, override, message):
    # building the model or the engine would fail the run: a bad value must be refused before
    prelude = """
        import r3lightning.app.job.models, r3lightning.app.serve.server
        def refuse(*a, **k): raise AssertionError("built")
        r3lightning.app.job.models.tiny_moe = r3lightning.app.serve.server.RolloutServer = refuse
    """
    proc = _job(tmp_path, override, prelude=prelude)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"r3lightning-train: error: {message}\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_megatron_backend_without_megatron_core_names_the_extra(tmp_path):
    proc = _job(tmp_path, "callbacks=router_replay_megatron", prelude="sys.modules['megatron'] = None")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (
        "r3lightning-train: error: callbacks.router_replay.backend=megatron needs megatron-core, which is not "
        'installed: pip install "r3lightning[megatron]"\n'
    )
    proc = _job(tmp_path, "model=tiny_megatron_moe", prelude="sys.modules['megatron'] = None")
    assert proc.returncode == 2 and proc.stderr == (
        'r3lightning-train: error: model.runtime: megatron-core is not installed: pip install "r3lightning[megatron]"\n'
    )
