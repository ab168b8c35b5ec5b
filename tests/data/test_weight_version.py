"""``Trajectory.weight_version``: from the engine's response, through the collector, the replay
buffer's state, collation and every batch operation, into the batch's ``weight_versions``."""

from __future__ import annotations

import pickle

import pytest
import torch

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.server import RolloutServer
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer, pack_trajectories, unpack_trajectories
from r3lightning.data.collate import RolloutCollator
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import CollectorConfig, RetryPolicy
from r3lightning.rollout.prompts import SamplingConfig
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response


def _trajectory(tag: int, version: int | None) -> Trajectory:
    return Trajectory([tag, 2], [3, 4, 5], reward=float(tag), weight_version=version)


def test_trajectory_keeps_its_version_and_refuses_bad_ones():
    assert _trajectory(1, 7).weight_version == 7
    assert _trajectory(1, None).weight_version is None
    assert "weight_version=7" in repr(_trajectory(1, 7))
    assert _trajectory(1, 7) != _trajectory(1, 8)  # equality compares the version
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(ValueError, match=r"Trajectory.weight_version must be an integer >= 0 or None"):
            _trajectory(1, bad)


def test_buffer_state_round_trips_versions_and_reads_states_without_them():
    buffer = ReplayBuffer()
    buffer.extend([_trajectory(1, 3), _trajectory(2, None), _trajectory(3, 0)])
    restored = ReplayBuffer()
    restored.load_state_dict(pickle.loads(pickle.dumps(buffer.state_dict())))
    assert [t.weight_version for t in restored] == [3, None, 0]
    packed = pack_trajectories(list(buffer))
    del packed["weight_versions"]  # a state saved before versions existed
    assert [t.weight_version for t in unpack_trajectories(packed)] == [None, None, None]
    packed = pack_trajectories(list(buffer))
    packed["weight_versions"][0] = -2
    with pytest.raises(ValueError, match=r"weight_versions\[0\] must be >= -1"):
        unpack_trajectories(packed)


def test_collation_and_batch_operations_carry_the_versions():
    trajectories = [_trajectory(i, v) for i, v in enumerate([5, None, 4, 6], 1)]
    collate = RolloutCollator(num_threads=2)
    try:
        batch = collate(trajectories)
    finally:
        collate.close()
    assert batch.weight_versions.dtype == torch.int64
    assert batch.weight_versions.tolist() == [5, -1, 4, 6]
    assert batch[1:3].weight_versions.tolist() == [-1, 4]
    assert batch.select([3, 0]).weight_versions.tolist() == [6, 5]
    assert [b.weight_versions.tolist() for b in batch.split(3)] == [[5, -1, 4], [6]]
    assert RolloutBatch.cat([batch[2:], batch[:1]]).weight_versions.tolist() == [4, 6, 5]
    assert pickle.loads(pickle.dumps(batch)).weight_versions.tolist() == [5, -1, 4, 6]
    assert batch.repeat_interleave(2).weight_versions.tolist() == [5, 5, -1, -1, 4, 4, 6, 6]
    # a batch built by hand without versions: all unknown
    fields = {name: getattr(batch, name) for name in ("input_ids", "attention_mask", "loss_mask")}
    rows = {
        name: getattr(batch, name) for name in ("advantages", "rewards", "prompt_lengths", "sequence_lengths")
    }
    plain = RolloutBatch(**fields, rollout_logprobs=batch.rollout_logprobs, **rows)
    assert plain.weight_versions.tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize(
    ("protocol", "body", "version"),
    [
        ("skyrl", b'{"choices": [{"token_ids": [1], "logprobs": null}], "weight_version": 4}', 4),
        ("skyrl", b'{"choices": [{"token_ids": [1], "logprobs": null, "weight_version": 2}]}', 2),
        ("vllm", b'{"choices": [{"token_ids": [1], "logprobs": null}]}', None),
        ("sglang", b'{"output_ids": [1], "meta_info": {"weight_version": "9"}}', 9),
        ("sglang", b'{"output_ids": [1], "meta_info": {"weight_version": "default"}}', None),
    ],
)
def test_the_client_reads_the_engines_weight_version(protocol, body, version):
    schema = RouteSchema(2, 2, 4)
    assert parse_response(body, protocol, schema, want_routes=False).weight_version == version


def test_a_malformed_weight_version_is_refused():
    body = b'{"choices": [{"token_ids": [1], "logprobs": null}], "weight_version": -1}'
    with pytest.raises(MalformedResponseError, match=r"weight_version: expected an integer >= 0, got -1"):
        parse_response(body, "skyrl", RouteSchema(2, 2, 4), want_routes=False)


@pytest.mark.parametrize("protocol", ["skyrl", "sglang"])
def test_collected_trajectories_record_the_version_the_embedded_engine_served(protocol):
    with RolloutServer(engine=EngineConfig(seed=0)) as server:
        model = server.engine.model
        config = CollectorConfig(group_size=2, protocol=protocol, request_routes=True)
        schema = RouteSchema(server.engine.num_layers, server.engine.top_k, server.engine.num_experts)
        collector = RolloutCollector(
            server.url,
            lambda prompt, response: float(len(response)),
            config,
            advantages=GRPOAdvantages(),
            schema=schema,
            sampling=SamplingConfig(max_new_tokens=3),
            client_options={"retry": RetryPolicy(max_attempts=1)},
        )
        first = collector.collect([[5, 6, 7]], step=0).trajectories
        state = {k: v.clone() for k, v in model.state_dict().items()}
        server.update_weights(state, weight_version=12)  # the trainer's policy version
        second = collector.collect([[5, 6, 7]], step=1).trajectories
        server.update_weights(state)  # no version given: one more than the last
        assert server.weight_version == 13
        collector.close()
    assert [t.weight_version for t in first] == [0, 0]
    assert [t.weight_version for t in second] == [12, 12]


def test_a_multi_turn_trajectory_keeps_the_oldest_version_of_its_turns():
    from r3lightning.rollout.episode import Episode
    from r3lightning.wire.request import RemoteGenerateResult

    episode = Episode([1, 2])
    for version in (None, 5, 4, 6):  # a turn whose engine sent none counts for nothing
        episode.record(None, 2, RemoteGenerateResult([3], [-0.5], "length", None, {}, weight_version=version))
    assert episode.trajectory(0.0).weight_version == 4
    assert Episode([1]).trajectory(0.0).weight_version is None
