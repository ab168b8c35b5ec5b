"""Micro-batch recipes as users write them: sub-batches of a ``RolloutBatch`` keep their routes, the
the docs' PPO recipe replays every micro-batch, and the job is strict against an external engine."""

import copy

import pytest
import torch
from micro_policy import (
    seven_batch,
)
from replay_policy import fit, make_batch

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.replay.callback import RouterReplayCallback


@pytest.fixture(scope="module")
def seven():
    return seven_batch()


def test_sub_batches_keep_their_routes_and_know_their_rows(seven):
    shuffled = seven.select([6, 0, 3, 1, 5, 2, 4])
    assert shuffled.rows_in(seven).tolist() == [6, 0, 3, 1, 5, 2, 4]
    assert seven.select(torch.tensor([True, False] * 3 + [True])).rows_in(seven).tolist() == [0, 2, 4, 6]
    parts = [mb.trim() for mb in shuffled.split([3, 2, 2])]
    assert [mb.rows_in(seven).tolist() for mb in parts] == [[6, 0, 3], [1, 5], [2, 4]]
    assert parts[1].rows_in(shuffled).tolist() == [3, 4]  # cut from a cut
    for mb in (*parts, *seven.chunk(3), seven[2:5].trim()):
        for i, row in enumerate(mb.rows_in(seven).tolist()):
            assert torch.equal(mb.routed_experts[i], seven.routed_experts[row])
            n = int(seven.sequence_lengths[row])
            assert torch.equal(mb.input_ids[i, mb.width - n :], seven.input_ids[row, seven.width - n :])
    assert seven.rows_in(seven).tolist() == list(range(7))
    assert seven.repeat(2).rows_in(seven) is None  # new rows, not a cut
    assert make_batch(11, [5, 9]).rows_in(seven) is None
    with pytest.raises(TypeError, match="select takes row positions or a bool mask"):
        seven.select(2)


def test_docs_micro_batch_recipe_replays_every_micro_batch(seven, tmp_path, monkeypatch):
    """docs/recipes/lightning-module.md's PPOPolicy, fed a batch with a routeless trajectory."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "recipes" / "lightning-module.md"
    code = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)[0]  # the module itself
    scope: dict = {}
    exec(compile(code, str(page), "exec"), scope)
    module = scope["PPOPolicy"](build_tiny_moe(seed=0))
    forwards = []
    backend = RouterReplayCallback()

    def spy(*args):  # every micro-batch forward, with the routes installed for it
        layout = backend.layout  # None: a micro-batch of only the routeless trajectory (native)
        forwards.append((tuple(args[1][0].shape[:2]), None if layout is None else layout.token_shape))

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)  # the example shuffles with torch.randperm
    hook = module.model.model.layers[1].register_forward_pre_hook(spy)
    _, logger = fit(module, [copy.deepcopy(seven)], backend)
    hook.remove()
    assert len(forwards) == 8  # 2 epochs x 4 micro-batches of 2, 2, 2, 1
    assert all(shape == installed for shape, installed in forwards if installed is not None)
    assert sum(installed is None for _, installed in forwards) <= 2  # row 4 alone, once per epoch
    assert logger.series("router_replay/used_agreement") == [1.0]
    assert logger.series("router_replay/replayed_fraction") == [1.0]


@pytest.mark.slow
def test_the_job_runs_strict_against_an_external_engine(tmp_path):
    """An external engine that returns no routes fails the main job (naming the engine flag)
    unless replay.strict=false, which trains natively, warns and counts the batches."""
    import csv

    from r3lightning.app.job.main import compose_config, run
    from r3lightning.app.serve.config import EngineConfig
    from r3lightning.app.serve.server import RolloutServer

    engine = EngineConfig(max_batch_size=64, copy_model=False)
    with RolloutServer(build_tiny_moe(seed=0), engine=engine) as server:
        base = [
            f"rollout.url={server.url}",
            "rollout.protocol=sglang",
            "replay.request_routes=false",  # as an engine started without routes would answer
            "steps=1",
            "prompts_per_step=2",
            "plot=false",
            "trainer.enable_progress_bar=false",
        ]
        with pytest.raises(
            ValueError, match=r"strict=True\): the batch has no routed_experts.*--enable-return"
        ):
            run(compose_config(base), tmp_path / "strict")
        with pytest.warns(UserWarning, match="--enable-return-routed-experts"):
            run(compose_config([*base, "replay.strict=false"]), tmp_path / "relaxed")
    with open(tmp_path / "relaxed" / "replay_r3" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("router_replay/batches_without_routes")]
    assert [float(r["router_replay/batches_without_routes"]) for r in logged] == [1.0]
