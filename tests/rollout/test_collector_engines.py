"""RolloutCollector over several real loopback engines: an engine that fails (5xx, hung) is out
for the step and only its groups move; every engine out is one clear error; the job's engine list."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from fault_server import FaultServer, Slow, Status
from loopback import hung_engine
from rollout_support import PROMPTS, SCHEMA, collect

from r3lightning import EnginesUnavailableError
from r3lightning.rollout.config import RetryPolicy
from r3lightning.wire.errors import GenerateRequestError


async def test_an_engine_answering_500_is_out_for_the_step_and_its_groups_go_to_the_other(caplog):
    async with FaultServer(**SCHEMA) as good, FaultServer(**SCHEMA) as bad:
        bad.script.extend([Status(500, "overloaded")] * 1000)
        rollouts = await collect([bad.url, good.url], PROMPTS, 0, max_in_flight=1)
        # one line, through the package's logger, once per engine and step
        (record,) = [r for r in caplog.records if "is out" in r.getMessage()]
        assert record.name == "r3lightning.rollout.collector" and record.levelname == "WARNING"
        assert record.getMessage() == (
            f"rollout engine {bad.url} is out for step 0: HTTP 500 after 2 attempt(s); "
            "its requests go to the other engines"
        )
        alone = await collect(good.url, PROMPTS, 0)
        # the next step tries the engine again
        bad.script.clear()
        later = await collect([bad.url, good.url], PROMPTS, 1)
    # group 0 (and 2) went first to the failing engine: one request exhausted its 2 attempts there
    assert bad.hits - len(later.trajectories) // 2 == 2
    stats = rollouts.stats
    assert (stats.engine_errors, stats.engines_out, stats.requests, stats.attempts) == (1, 1, 9, 10)
    assert [t.response_ids.tolist() for t in rollouts.trajectories] == [
        t.response_ids.tolist() for t in alone.trajectories
    ]
    assert len(rollouts.trajectories) == 8
    # both engines up: even groups on the first, odd groups on the second
    first = [body["token_ids"] for _, body, _ in bad.requests[2:]]
    assert sorted(map(tuple, first)) == sorted(map(tuple, [PROMPTS[0]] * 2 + [PROMPTS[2]] * 2))
    assert later.stats.engine_errors == 0


async def test_only_the_groups_of_an_engine_that_is_out_move():
    prompts = [[20 + g] for g in range(6)]
    async with FaultServer(**SCHEMA) as a, FaultServer(**SCHEMA) as bad, FaultServer(**SCHEMA) as c:
        bad.script.extend([Status(502, "gone")] * 1000)
        rollouts = await collect([a.url, bad.url, c.url], prompts, 0, max_in_flight=1)
    served = {
        name: sorted(body["token_ids"][0] - 20 for _, body, _ in server.requests)
        for name, server in (("a", a), ("c", c))
    }
    # groups 0, 3 stay on a and 2, 5 on c; of the failed engine's groups 1 and 4, the (g % 2)-th
    # engine still up takes each: 1 -> c, 4 -> a
    assert served == {"a": [0, 0, 3, 3, 4, 4], "c": [1, 1, 2, 2, 5, 5]}
    assert len(rollouts.trajectories) == 12 and rollouts.stats.engines_out == 1


async def test_all_engines_down_is_one_clear_error_with_a_short_clause_per_engine(caplog):
    async with FaultServer(**SCHEMA) as a, FaultServer(**SCHEMA) as b:
        for server in (a, b):
            server.script.extend([Status(503, "down " * 100)] * 1000)
        with pytest.raises(EnginesUnavailableError) as info:
            await collect([a.url, b.url], PROMPTS, 7)
    assert set(info.value.errors) == {a.url, b.url}
    assert str(info.value) == (
        f"all 2 rollout engine(s) failed at step 7: {a.url}: HTTP 503 after 2 attempt(s); "
        f"{b.url}: HTTP 503 after 2 attempt(s)"
    )
    assert sum("is out for step 7" in r.getMessage() for r in caplog.records) == 2


async def test_a_rejected_request_is_not_an_outage():
    async with FaultServer(**SCHEMA) as a, FaultServer(**SCHEMA) as b:
        a.script.append(Status(400, "unknown sampling key"))
        with pytest.raises(GenerateRequestError, match="unknown sampling key"):
            await collect([a.url, b.url], PROMPTS[:1], 0, max_in_flight=1)
    assert b.hits == 0


async def test_a_hung_engine_is_detected_and_its_groups_move_while_a_slow_one_keeps_its_own(caplog):
    retry = RetryPolicy(max_attempts=2, timeout_s=600, health_interval_s=0.2, health_timeout_s=0.3)
    async with hung_engine() as hung, FaultServer(**SCHEMA) as slow:
        slow.script.extend([Slow(1.0)] * 4)  # the first requests: slow but healthy
        began = time.perf_counter()
        rollouts = await asyncio.wait_for(collect([hung, slow.url], PROMPTS, 0, retry=retry), timeout=300)
        elapsed = time.perf_counter() - began
        alone = await collect(slow.url, PROMPTS, 0)
    assert (
        elapsed < 300.0
    )  # ~1 s to declare it hung; the attempt timeout is 600 s (generous: a loaded machine)
    assert [t.response_ids.tolist() for t in rollouts.trajectories] == [
        t.response_ids.tolist() for t in alone.trajectories
    ]
    assert rollouts.stats.engines_out == 1 and slow.hits == 8 + 8
    (line,) = [r.getMessage() for r in caplog.records if "is out" in r.getMessage()]
    assert line == (
        f"rollout engine {hung} is out for step 0: stopped answering GET /health (2 probes in a row "
        "got no answer within 0.3 s) after 1 attempt(s); its requests go to the other engines"
    )


# ---------------------------------------------------------------------------- the job's engines


async def test_job_takes_a_list_of_engine_urls_and_pushes_weights_to_each():
    from aiohttp import web
    from safetensors.torch import load

    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.engine import embedded_server
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.validate import check_config

    received: dict[int, dict] = {}
    versions: dict[int, str | None] = {}

    def app(index: int) -> web.Application:
        async def update(request: web.Request) -> web.Response:
            received[index] = load(await request.read())
            versions[index] = request.query.get("weight_version")
            return web.json_response({"ok": True})

        application = web.Application(client_max_size=1 << 24)
        application.router.add_post("/update_weights", update)
        return application

    runners = [web.AppRunner(app(i)) for i in range(2)]
    urls = []
    for runner in runners:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        cfg = compose_config([f"rollout.url=[{urls[0]}/,{urls[1]}]", "rollout=skyrl"])
        check_config(cfg)
        with embedded_server(cfg) as engine:
            assert engine.urls == urls and engine.gather
            state = {"w": torch.arange(6.0).reshape(2, 3)}
            await asyncio.to_thread(engine.push, state, 3)  # no /pause here (404): uploaded anyway
    finally:
        for runner in runners:
            await runner.cleanup()
    assert versions == {0: "3", 1: "3"}  # the trainer's policy version
    for index in range(2):
        assert received[index]["w"].dtype == torch.bfloat16
        assert torch.equal(received[index]["w"], state["w"].to(torch.bfloat16))
    with pytest.raises(JobError, match=r"rollout.url must be null .* or a list of them, got .*ftp://b"):
        check_config(compose_config(["rollout.url=[http://a:1,ftp://b]"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+rollout.max_in_flight=3",
            "rollout.max_in_flight moved to rollout.collector.max_in_flight; set "
            "rollout.collector.max_in_flight=3 instead",
        ),
        (
            "+rollout.request_timeout_s=5",
            "rollout.request_timeout_s moved to rollout.retry.timeout_s; set "
            "rollout.retry.timeout_s=5 instead",
        ),
        (
            "rollout.collector.max_in_flight=0",
            "rollout.collector.max_in_flight must be an integer >= 1, got 0",
        ),
        ("rollout.retry.health_failures=0", "rollout.retry.health_failures must be an integer >= 1, got 0"),
        (
            "rollout.retry.backoff.jitter=2",
            "rollout.retry.backoff.jitter must be a number >= 0 and <= 1, got 2.0",
        ),
        ("rollout.limits.max_queue=-1", "rollout.limits.max_queue must be an integer >= 0, got -1"),
        (
            "rollout.server.dtype=int8",
            "rollout.server.dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'",
        ),
        ("rollout.server.max_batch_size=0", "rollout.server.max_batch_size must be an integer >= 1, got 0"),
    ],
)
def test_job_rollout_groups_are_checked_with_the_key_named(override, message):
    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.validate import check_config

    with pytest.raises(JobError) as info:
        check_config(compose_config([override]))
    assert str(info.value) == message


def test_job_rollout_groups_map_one_to_one_to_the_settings_objects():
    """Every key of rollout.retry / collector / limits (and rollout.server but host and port)
    is a field of its dataclass, and an override reaches it."""
    import dataclasses

    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.rollout_settings import collector_config, retry_policy, server_settings
    from r3lightning.app.serve.config import EngineConfig, ServerLimits
    from r3lightning.rollout.config import Backoff, CollectorConfig

    cfg = compose_config([])
    groups = {
        "retry": RetryPolicy,
        "retry.backoff": Backoff,
        "collector": CollectorConfig,
        "limits": ServerLimits,
        "server": EngineConfig,
    }
    for key, cls in groups.items():
        node = cfg.rollout.retry.backoff if key == "retry.backoff" else cfg.rollout[key]
        extra = {"host", "port"} if key == "server" else set()
        assert set(node) == {f.name for f in dataclasses.fields(cls)} | extra, key
    cfg = compose_config(
        [
            "rollout.retry.health_interval_s=null",
            "rollout.retry.backoff.cap_s=2",
            "rollout.collector.max_in_flight=7",
            "reward_threads=0",
            "algorithm.group_size=4",
            "rollout.limits.max_new_tokens_cap=99",
            "rollout.server.batch_wait_s=0.5",
            "seed=3",
        ]
    )
    retry, collector = retry_policy(cfg.rollout), collector_config(cfg.rollout)
    engine, limits = server_settings(cfg.rollout)
    assert retry.health_interval_s is None and retry.backoff.cap_s == 2.0 and retry.timeout_s == 600.0
    assert collector == CollectorConfig(group_size=4, seed=3, max_in_flight=7, reward_threads=0)
    assert limits == ServerLimits(max_new_tokens_cap=99)
    assert engine == EngineConfig(max_batch_size=64, batch_wait_s=0.5, seed=3, copy_model=False)


async def test_job_names_the_real_health_timeout_of_an_unreachable_engine():
    from types import SimpleNamespace

    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.rollout_loop import Engine, rollout_loop
    from r3lightning.wire.request import RouteSchema

    async with hung_engine() as url:
        cfg = compose_config([f"rollout.url={url}", "rollout.retry.health_timeout_s=0.5"])
        task = SimpleNamespace(prompts=None, score_prompt=lambda prompt, response_ids: 0.0)  # a ScoredTask
        began = time.perf_counter()
        with pytest.raises(JobError) as info:
            await asyncio.to_thread(
                rollout_loop, cfg, Engine([url]), task, RouteSchema(3, 2, 8), None, metrics_path=None
            )
        elapsed = time.perf_counter() - began
    # the probe's own timeout, as the message says; the upper bound only tells it from a hang
    # (generous: a loaded machine)
    assert 0.5 <= elapsed < 120.0
    assert str(info.value) == (
        f"cannot reach the rollout engine at {url}: GET /health did not answer 200 within 0.5s "
        "(rollout.retry.health_timeout_s); check rollout.url or start the engine"
    )
