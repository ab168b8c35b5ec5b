"""One multi-turn trajectory (run_episode): a scripted environment against a scripted engine.

The engine (turn_engine.TurnEngine, a real aiohttp server on 127.0.0.1) stamps every route row
with the request that computed it, so the reference below (written here, from the requests the
test expects) pins which turn each final row comes from, boundary tokens included.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from fault_server import Status
from turn_engine import TurnEngine, response_ids, route_row

from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import RetryPolicy
from r3lightning.rollout.episode import run_episode
from r3lightning.rollout.prompts import RolloutPrompt
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.wire.errors import GenerateRequestError, MalformedResponseError
from r3lightning.wire.request import RouteSchema

L, K, E = 3, 2, 16
G = 4  # tokens per turn


class ScriptedEnv:
    """Turn k answers ``script[k]`` = (observation, reward, done); ``fail`` raises at that turn."""

    def __init__(self, script, *, fail: int | None = None, coroutine: bool = False):
        self.script, self.fail, self.coroutine = list(script), fail, coroutine
        self.responses: list = []
        self.prompt = None

    def reset(self, prompt):
        self.prompt = prompt
        return prompt.token_ids if not self.coroutine else _later(prompt.token_ids)

    def step(self, response):
        turn = len(self.responses)
        self.responses.append(response)
        if turn == self.fail:
            raise RuntimeError(f"tool crashed at turn {turn}")
        obs, reward, done = self.script[turn]
        return (obs, reward, done, {}) if not self.coroutine else _later((obs, reward, done, {}))


async def _later(value):
    await asyncio.sleep(0)
    return value


def _generate(client, *, routes=True):
    def generate(tokens, turn, start):
        params = {"max_tokens": G, "seed": turn}
        return client.generate(
            tokens, params, return_routed_experts=routes, routed_experts_prompt_start=start
        )

    return generate


def _client(url):
    return RemoteGenerateClient(url, schema=RouteSchema(L, K, E), retry=RetryPolicy(max_attempts=1))


def _reference(prompt, observations, turns):
    """Tokens, mask, logprobs and rows the engine's requests imply, computed independently."""
    tokens, mask, logprobs, first_input = list(prompt), [], [], []
    for turn in range(turns):
        prompt_len = len(tokens)
        response = response_ids(tokens, turn, G, 96)
        logprobs += [-0.01 * (prompt_len + i + 1) for i in range(G)] + [0.0] * (
            len(observations[turn]) if turn < turns - 1 else 0
        )
        # positions forwarded for the first time by this request: [rows so far, P + G - 1)
        first_input += [prompt_len] * (prompt_len + G - 1 - len(first_input))
        tokens += response
        mask += [1.0] * G
        if turn < turns - 1:
            tokens += observations[turn]
            mask += [0.0] * len(observations[turn])
    rows = np.stack([route_row(tokens[p], p, first_input[p], L, K, E) for p in range(len(tokens) - 1)])
    return tokens, mask, logprobs, rows


async def test_every_final_row_is_the_row_the_engine_computed_when_its_token_was_an_input():
    prompt = RolloutPrompt([11, 12, 13, 14, 15])
    observations = [[20, 21], [], [22, 23, 24]]
    env = ScriptedEnv(
        [(observations[0], 0.5, False), ([], 0.0, False), (observations[2], 0.25, False), ([9], 1.0, True)]
    )
    async with TurnEngine(num_layers=L, top_k=K, num_experts=E) as engine, _client(engine.url) as client:
        trace = RoutedExpertTrace(L, K, E)
        episode = await run_episode(env, prompt, _generate(client), max_turns=6, trace=trace)
    tokens, mask, logprobs, rows = _reference(prompt.token_ids, [*observations, []], 4)
    assert episode.prompt_ids == prompt.token_ids
    assert episode.prompt_ids + episode.response_ids == tokens
    assert episode.loss_mask == mask and episode.logprobs == pytest.approx(logprobs, abs=1e-12)
    assert episode.turn_rewards == [0.5, 0.0, 0.25, 1.0] and episode.reward == 1.75
    assert torch.equal(episode.routes.long(), torch.from_numpy(rows))
    # each turn asked only for the rows not captured yet, and those alone came back
    starts = [body["sampling_params"]["routed_experts_prompt_start"] for body in engine.requests]
    lengths = [len(body["token_ids"]) for body in engine.requests]
    assert starts == [0, 8, 14, 18] == [0] + [p + G - 1 for p in lengths[:-1]]
    assert episode.route_bytes == [(p + G - 1 - s) * L * K for p, s in zip(lengths, starts, strict=True)]
    # the boundary token (last of a response) is first an input in the next turn: its row is that turn's
    boundary = len(prompt.token_ids) + G - 1
    assert (
        episode.routes[boundary].numpy() == route_row(tokens[boundary], boundary, lengths[1], L, K, E)
    ).all()
    assert not (
        episode.routes[boundary].numpy() == route_row(tokens[boundary], boundary, lengths[0], L, K, E)
    ).all()
    assert env.responses == [tokens[5:9], tokens[11:15], tokens[15:19], tokens[22:26]]
    trajectory = episode.trajectory(advantage=0.3)
    assert trajectory.loss_mask.tolist() == mask and trajectory.route_rows == len(tokens) - 1


async def test_max_turns_stops_and_drops_the_unsent_observation():
    env = ScriptedEnv([([30], 1.0, False)] * 5, coroutine=True)
    async with TurnEngine(num_layers=L, top_k=K, num_experts=E) as engine, _client(engine.url) as client:
        episode = await run_episode(
            env, RolloutPrompt([40, 41]), _generate(client, routes=False), max_turns=2, trace=None
        )
        assert len(engine.requests) == 2
        assert all("routed_experts_prompt_start" not in b["sampling_params"] for b in engine.requests)
    assert episode.turn_rewards == [1.0, 1.0] and episode.routes is None
    assert len(episode.response_ids) == G + 1 + G and episode.loss_mask == [1.0] * G + [0.0] + [1.0] * G


async def test_chat_messages_and_text_responses_go_through_the_tokenizer():
    from r3lightning.app.models.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()

    class ChatEnv(ScriptedEnv):
        response_format = "text"

        def reset(self, prompt):
            return [{"role": "user", "content": "2+3?"}]

    env = ChatEnv([([{"role": "tool", "content": "5"}], 0.0, False), ([], 1.0, True)])
    env.tokenizer = tokenizer
    async with TurnEngine(num_layers=L, top_k=K, num_experts=E) as engine, _client(engine.url) as client:
        episode = await run_episode(
            env, RolloutPrompt([1]), _generate(client), max_turns=3, trace=RoutedExpertTrace(L, K, E)
        )
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=True
    )
    tool = tokenizer.apply_chat_template(
        [{"role": "tool", "content": "5"}], add_generation_prompt=True, tokenize=True
    )
    first, tool = (list(x["input_ids"] if hasattr(x, "keys") else x) for x in (first, tool))
    assert episode.prompt_ids == first
    assert episode.response_ids[G : G + len(tool)] == tool and episode.loss_mask[G : G + len(tool)] == [
        0.0
    ] * len(tool)
    assert env.responses[0] == tokenizer.decode(episode.response_ids[:G], skip_special_tokens=True)
    assert (
        isinstance(env.responses[0], str)
        and episode.routes.shape[0] == len(first) + len(episode.response_ids) - 1
    )


@pytest.mark.parametrize(
    ("env", "script", "error", "match"),
    [
        (ScriptedEnv([], fail=0), [], RuntimeError, "tool crashed at turn 0"),
        (
            ScriptedEnv([([1, -2], 0.0, False)]),
            [],
            ValueError,
            r"observation of turn 0 must be a sequence of token ids >= 0",
        ),
        (
            ScriptedEnv([("text", 0.0, False)]),
            [],
            ValueError,
            r"turn 0 must be a sequence of token ids >= 0, got 'text'",
        ),
        (ScriptedEnv([([1], float("nan"), False)]), [], ValueError, r"finite number"),
        (ScriptedEnv([([1], 0.0, False)] * 3), ["ok", "extra_row"], MalformedResponseError, r"rows"),
        (ScriptedEnv([([1], 0.0, False)] * 3), ["ok", Status(400, "bad")], GenerateRequestError, "bad"),
    ],
)
async def test_a_failing_turn_raises_and_never_finalises_the_trace(env, script, error, match):
    trace = RoutedExpertTrace(L, K, E)
    async with TurnEngine(num_layers=L, top_k=K, num_experts=E) as engine, _client(engine.url) as client:
        engine.script.extend(script)
        with pytest.raises(error, match=match):
            await run_episode(env, RolloutPrompt([3, 4, 5]), _generate(client), max_turns=3, trace=trace)
    assert not trace.finalized


async def test_step_must_return_four_fields_and_reset_a_token():
    class Bad(ScriptedEnv):
        def step(self, response):
            return [1], 0.0, False

    async with TurnEngine(num_layers=L, top_k=K, num_experts=E) as engine, _client(engine.url) as client:
        with pytest.raises(ValueError, match=r"step\(\) must return \(observation, reward, done, info\)"):
            await run_episode(Bad([]), RolloutPrompt([3]), _generate(client), max_turns=2, trace=None)
        empty = ScriptedEnv([])
        empty.reset = lambda prompt: []
        with pytest.raises(
            ValueError, match=r"reset\(\) must return a first observation of at least one token"
        ):
            await run_episode(empty, RolloutPrompt([3]), _generate(client), max_turns=2, trace=None)
