"""Every constructor keyword that 0.2 moved into a settings object is refused with a TypeError
naming its replacement (the migration table's "before" column), before anything is built."""

from __future__ import annotations

import inspect

import pytest
import torch

from r3lightning.app.serve.server import RolloutServer
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.collate import RolloutCollator
from r3lightning.data.datamodule import R3DataModule
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.rollout.client import RemoteGenerateClient

URL = "http://127.0.0.1:8000"

CASES = [
    *[
        (RemoteGenerateClient, (URL,), kw, f"schema=RouteSchema({kw}=)")
        for kw in ("num_layers", "top_k", "num_experts")
    ],
    (RemoteGenerateClient, (URL,), "max_route_bytes", "schema=RouteSchema(max_bytes=)"),
    (
        RemoteGenerateClient,
        (URL,),
        "check_unique_experts",
        "schema=RouteSchema(check_unique=) (r3lightning.wire.request)",
    ),
    *[
        (RemoteGenerateClient, (URL,), kw, f"retry=RetryPolicy({kw}=)")
        for kw in ("max_attempts", "backoff", "timeout_s")
    ],
    (
        RemoteGenerateClient,
        (URL,),
        "max_connections",
        "the class attribute RemoteGenerateClient.max_connections",
    ),
    *[
        (RolloutServer, (), kw, f"engine=EngineConfig({kw}=)")
        for kw in ("max_batch_size", "seed", "dtype", "device")
    ],
    *[(RolloutServer, (), kw, f"limits=ServerLimits({kw}=)") for kw in ("max_queue", "max_request_bytes")],
    (RolloutCollator, (), "pool_slots", "pin_memory=PinnedBufferPool(slots)"),
    (RolloutCollator, (), "allocator", "pin_memory=PinnedBufferPool(allocator=)"),
    (RolloutCollator, (), "recycle_after", "pin_memory=PinnedBufferPool(recycle_after=)"),
    *[
        (R3DataModule, (ReplayBuffer(), 2), kw, f"options=DataOptions({kw}=)")
        for kw in ("pad_token_id", "shard")
    ],
    (RouterReplayCallback, (), "log_per_layer", 'log_agreement="per_layer"'),
    (RouterReplayCallback, (), "pad_to_multiple", "layout_fn=functools.partial(TokenMetadataLayout.padded"),
]


@pytest.mark.parametrize(
    ("cls", "args", "keyword", "replacement"), CASES, ids=lambda c: getattr(c, "__name__", None)
)
def test_an_old_keyword_is_a_type_error_naming_its_replacement(cls, args, keyword, replacement):
    with pytest.raises(TypeError) as info:
        cls(*args, **{keyword: 1})
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}() no longer takes {keyword}= is now {replacement}"), message
    assert message.endswith("(docs: migration.md)")


@pytest.mark.parametrize("keyword", ["tp_size", "tp_rank", "cp_size", "cp_rank", "sequence_parallel"])
def test_megatron_parallel_keywords_name_megatron_parallelism(keyword):
    from r3lightning.replay.megatron.replay import MegatronRouterReplay

    with pytest.raises(
        TypeError, match=rf"no longer takes {keyword}= is now parallelism=MegatronParallelism\({keyword}=\)"
    ):
        MegatronRouterReplay(torch.nn.Linear(1, 1), **{keyword: 2})


def test_several_old_keywords_are_named_together_and_signatures_are_kept():
    with pytest.raises(
        TypeError, match=r"max_attempts= is now retry=RetryPolicy\(max_attempts=\); top_k= is now"
    ):
        RemoteGenerateClient(URL, max_attempts=2, top_k=2)
    assert "schema" in inspect.signature(RemoteGenerateClient).parameters  # help() still shows 0.2's
    assert "max_attempts" not in inspect.signature(RemoteGenerateClient).parameters
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):  # other keywords as before
        RemoteGenerateClient(URL, nonsense=1)


def test_the_migration_table_lists_every_refused_keyword():
    """Each keyword a constructor refuses as moved is in that class's rows of the CHANGELOG's
    "Moved and renamed parameters" table (the migration page shows it)."""
    import re
    from pathlib import Path

    from r3lightning.replay.megatron.replay import MegatronRouterReplay

    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    table = changelog.split("<!-- --8<-- [start:parameters] -->")[1].split(
        "<!-- --8<-- [end:parameters] -->"
    )[0]
    classes = (RemoteGenerateClient, RolloutServer, MegatronRouterReplay, RolloutCollator, R3DataModule)
    for cls in (*classes, RouterReplayCallback):
        moved = cls.__init__.moved_keywords
        rows = [row.split("|")[2] for row in table.splitlines() if row.startswith(f"| `{cls.__name__}` |")]
        listed = {name for row in rows for name in re.findall(r"`(\w+)=", row) + re.findall(r", (\w+)=", row)}
        assert set(moved) <= listed, (cls.__name__, sorted(set(moved) - listed))
