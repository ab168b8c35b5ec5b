"""An environment whose ``reset()`` or ``step()`` hangs (sync or async) no longer hangs the
collection: past ``Environments.timeout_s`` (the job's ``rollout.env_timeout_s``) its group is
dropped and counted, as a failing environment's, and the other groups are kept. No wall-clock
bound: a hang the timeout misses would stop the test at its generous guard."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from turn_engine import TurnEngine

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import SamplingConfig
from r3lightning.wire.request import RouteSchema

SCHEMA = {"num_layers": 3, "top_k": 2, "num_experts": 16}
PROMPTS = [[11, 12, 13], [14, 15], [16, 17, 18, 19]]
GUARD_S = 120  # generous: only a collection that never gives up on the hang reaches it
RELEASE = threading.Event()  # set when a test ends: the abandoned calls then return


class Hanging:
    """Two turns; ``method`` hangs for the trajectories of prompt 14 (until the test ends)."""

    method = "step"

    def __init__(self) -> None:
        self.hangs = False

    def reset(self, prompt):
        self.hangs = prompt.token_ids[0] == 14
        if self.hangs and self.method == "reset":
            RELEASE.wait(GUARD_S)
        return prompt.token_ids

    def step(self, response):
        if self.hangs and self.method == "step":
            RELEASE.wait(GUARD_S)
        return [40], 1.0, False, {}


class AsyncHanging(Hanging):
    async def reset(self, prompt):
        self.hangs = prompt.token_ids[0] == 14
        if self.hangs and self.method == "reset":
            await asyncio.sleep(GUARD_S)
        return prompt.token_ids

    async def step(self, response):
        if self.hangs and self.method == "step":
            await asyncio.sleep(GUARD_S)
        return [40], 1.0, False, {}


@pytest.fixture(autouse=True)
def _release():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("method", ["reset", "step"])
@pytest.mark.parametrize(("env", "reward_threads"), [(Hanging, 0), (Hanging, 2), (AsyncHanging, 0)])
async def test_a_hanging_environment_drops_its_group_and_the_others_are_kept(
    env, reward_threads, method, caplog
):
    env = type("Env", (env,), {"method": method})
    config = CollectorConfig(group_size=2, progress=False, reward_threads=reward_threads)
    retry = RetryPolicy(max_attempts=1, backoff=Backoff(base_s=0.001, cap_s=0.001))
    async with TurnEngine(**SCHEMA) as engine:
        collector = RolloutCollector(
            engine.url,
            Environments(env, max_turns=2, timeout_s=0.3),
            config,
            advantages=GRPOAdvantages(),
            schema=RouteSchema(**SCHEMA),
            sampling=SamplingConfig(max_new_tokens=2),
            client_options={"retry": retry},
        )
        async with collector, asyncio.timeout(GUARD_S):
            rollouts = await collector.collect_async(PROMPTS, step=0)
    assert rollouts.stats.dropped_groups == 1
    assert sorted(t.prompt_ids.tolist()[0] for t in rollouts.trajectories) == [11, 11, 16, 16]
    assert (
        f"group 1 of step 0 dropped: {method}() did not return within 0.3 s (env_timeout_s)"
        in caplog.messages
    )


def test_the_timeout_is_checked_and_unbounded_by_default():
    assert Environments(Hanging).timeout_s is None
    for bad in (0, -1.0, float("inf"), "5"):
        with pytest.raises(ValueError, match=r"^Environments.timeout_s must be None or a number > 0"):
            Environments(Hanging, timeout_s=bad)


@pytest.mark.parametrize(("override", "expected"), [([], 300.0), (["rollout.env_timeout_s=2.5"], 2.5)])
def test_the_jobs_rollout_env_timeout_s_reaches_the_collector(override, expected):
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.rollout_loop import Engine, RolloutLoop

    task = SimpleNamespace(
        prompts=None, score_prompt=lambda p, r: 0.0, environments=lambda: Environments(Hanging, max_turns=2)
    )
    cfg = compose_config(override)
    loop = RolloutLoop(cfg, Engine(["http://127.0.0.1:9"]), task, RouteSchema(3, 2, 16), None, None)
    assert loop.new_collector(["http://127.0.0.1:9"]).environments.timeout_s == expected


def test_a_bad_rollout_env_timeout_s_is_one_line_naming_the_key():
    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.validate import check_values

    with pytest.raises(JobError, match=r"^rollout.env_timeout_s must be None or a number > 0, got -1.0$"):
        check_values(compose_config(["rollout.env_timeout_s=-1"]))
    check_values(compose_config(["rollout.env_timeout_s=null"]))
