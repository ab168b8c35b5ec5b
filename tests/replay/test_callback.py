"""RouterReplayCallback in r3 mode through a real Lightning Trainer: what the training forwards
use, when routes are cleared, strictness, options and the Hydra configs."""

import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from gloo_ranks import run_ranks
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from replay_policy import LAYERS, TinyPolicy, engine_dense, fit, loader, make_batch, real_rows
from trainers import cpu_trainer

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes
from r3lightning.replay.hf.replay import HFRouterReplay

CONF = Path(__file__).resolve().parents[2] / "conf" / "callbacks"


@pytest.fixture(scope="module")
def batches():
    return [make_batch(0, [7, 9, 5]), make_batch(1, [6, 9, 8], dropped_rows=3)]


def test_r3_training_forwards_use_the_rollout_experts(batches):
    module = TinyPolicy()
    callback = RouterReplayCallback(mode="r3")
    _, logger = fit(module, copy.deepcopy(batches), callback)
    for batch, used in zip(batches, module.train_routes, strict=True):
        expected = engine_dense(batch)
        index = tuple(torch.tensor(real_rows(batch)).T)
        assert torch.equal(used[index][:, LAYERS].long(), expected[index][:, LAYERS])  # 100% replayed
    assert not callback.backend.installed
    # every slot with a route row was replayed, and the forward used the route's experts
    assert logger.series("router_replay/replayed_fraction") == [1.0, 1.0]
    assert logger.series("router_replay/used_agreement") == [1.0, 1.0]
    # batch 1 lost 2 rows per trajectory whose next token is a loss target: 3 * 2 natively routed
    assert logger.series("router_replay/native_loss_tokens") == [0.0, 6.0]
    assert logger.series("router_replay/batches_without_routes") == [0.0, 0.0]
    agreement = logger.series("router_replay/native_agreement")
    assert len(agreement) == 2 and all(0.5 < a < 0.98 for a in agreement)
    assert len(logger.series("router_replay/native_agreement/layer_03")) == 2


def test_a_callback_reused_for_another_module_replays_into_that_module(batches):
    callback = RouterReplayCallback(mode="r3")
    for module in (TinyPolicy(), TinyPolicy()):
        fit(module, copy.deepcopy(batches[:1]), callback)
        index = tuple(torch.tensor(real_rows(batches[0])).T)
        used = module.train_routes[0][index][:, LAYERS].long()
        assert torch.equal(used, engine_dense(batches[0])[index][:, LAYERS])
        assert callback.backend is HFRouterReplay.for_model(module.model)


def test_uncaptured_and_padding_positions_get_valid_distinct_routes(batches):
    batch = batches[1]  # left padding and 3 uncaptured rows per trajectory
    callback = RouterReplayCallback()
    callback.backend = HFRouterReplay.for_model(build_tiny_moe())
    layout = callback.build_layout(batch.attention_mask)
    dense, mask = callback.align_routes(batch.routed_experts, layout)
    assert dense.shape == (3, 9, 4, 2) and mask.shape == (3, 9)
    assert int(mask.sum()) == batch.routed_experts.num_rows
    filler = dense[~mask]
    assert filler.min() >= 0 and filler.max() < 8
    assert (filler[..., 0] != filler[..., 1]).all()
    index = tuple(torch.tensor(real_rows(batch)).T)
    assert torch.equal(mask, torch.zeros_like(mask).index_put_(index, torch.tensor(True)))
    assert torch.equal(dense[index].long(), engine_dense(batch)[index])


def test_validation_and_sanity_check_never_see_routes(batches):
    module = TinyPolicy()
    callback = RouterReplayCallback(mode="r3")
    val = [copy.deepcopy(batches[0])]
    fit(
        module,
        copy.deepcopy(batches),
        callback,
        val_batches=val,
        val_check_interval=1,
        num_sanity_val_steps=1,
    )
    # sanity check + one validation run after each of the 2 training batches
    assert len(module.val_logits) == 3
    model = module.model.eval()
    with torch.no_grad(), record_routes(model):
        expected = module(val[0])
    torch.testing.assert_close(module.val_logits[-1], expected)


def test_exception_in_a_step_clears_the_routes(batches):
    module = TinyPolicy(fail_at=1)
    callback = RouterReplayCallback(mode="r3")

    class InstallSpy(pl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(callback.backend.installed)

    trainer = cpu_trainer(
        max_epochs=1,
        logger=False,
        callbacks=[callback, spy := InstallSpy()],
    )
    with pytest.raises(KeyError, match="boom"):
        trainer.fit(module, loader(copy.deepcopy(batches)))
    assert spy.seen == [True, True]  # installed before each step ...
    assert not callback.backend.installed  # ... and cleared by the exception
    ids = batches[0].input_ids
    with record_routes(module.model) as rec:
        module.model(ids)
    assert rec.routes.shape == (*ids.shape, 4, 2)


def test_a_step_skipped_by_the_module_leaves_no_routes_after_the_epoch(batches):
    """A LightningModule returning -1 from on_train_batch_start ends the epoch after the callback
    installed the routes and without on_train_batch_end; epoch-end forwards must route natively."""
    seen = []

    class SkipSecond(TinyPolicy):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 1 else None

        def on_train_epoch_end(self):
            seen.append(callback.backend.installed)

    callback = RouterReplayCallback(mode="r3")
    module = SkipSecond()
    fit(module, copy.deepcopy(batches), callback)
    assert len(module.train_routes) == 1 and seen == [False]


def test_strict_mode_refuses_to_route_natively(batches):
    no_routes = copy.deepcopy(batches[0])
    no_routes.routed_experts = None
    with pytest.raises(
        ValueError, match=r"strict=True\): the batch has no routed_experts.*--enable-return-routed"
    ):
        fit(TinyPolicy(), [no_routes], RouterReplayCallback(mode="r3", strict=True))
    with pytest.raises(RuntimeError, match="a training forward ran with no routes installed"):
        fit(TinyPolicy(), [copy.deepcopy(no_routes)], RouterReplayCallback(mode="r2", strict=True))
    module = TinyPolicy(old_policy=True)
    fit(module, [copy.deepcopy(no_routes)], RouterReplayCallback(mode="r2", strict=True))  # r2 done right


def test_dict_batches_and_activation_checkpointing(batches):
    results = []
    for checkpointing in (False, True):
        module = TinyPolicy(checkpointing=checkpointing)
        dict_batches = [
            {k: getattr(b, k) for k in ("input_ids", "attention_mask", "loss_mask", "routed_experts")}
            for b in copy.deepcopy(batches)
        ]
        fit(module, dict_batches, RouterReplayCallback(mode="r3"))
        for batch, used in zip(batches, module.train_routes, strict=True):
            index = tuple(torch.tensor(real_rows(batch)).T)
            assert torch.equal(used[index][:, LAYERS].long(), engine_dense(batch)[index][:, LAYERS])
        results.append(module.model.state_dict())
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_install_skips_the_id_check_unless_validate_routes(batches):
    """Ids are checked upstream (range at buffer insert, repeats at wire decode), so by default the
    callback's backend does not re-check them on install, which would sync device->host per step."""
    bad = copy.deepcopy(batches[0])
    bad.routed_experts.values[0, 1, 0] = 8  # replayed row, MoE layer 1: out of range for 8 experts
    module = TinyPolicy()
    attached = HFRouterReplay.for_model(module.model)  # e.g. from an earlier record_routes(model)
    assert attached.validate
    callback = RouterReplayCallback()
    callback.on_fit_start(None, module)
    assert callback.backend is attached and not attached.validate
    callback.on_train_batch_start(None, module, bad, 0)  # trusted: installed as given
    assert attached.installed
    callback.on_exception(None, module, RuntimeError())
    assert not attached.installed
    with pytest.raises(ValueError, match=r"expert ids in \[0, 8\].*expected ids in \[0, 7\]"):
        fit(TinyPolicy(), [copy.deepcopy(bad)], RouterReplayCallback(validate_routes=True))
    # a backend object keeps its own flag unless validate_routes is given
    assert RouterReplayCallback(backend=attached).backend.validate is False
    attached.validate = True
    assert RouterReplayCallback(backend=attached).backend.validate is True
    assert RouterReplayCallback(backend=attached, validate_routes=False).backend.validate is False


def test_bad_arguments_and_route_schema():
    with pytest.raises(ValueError, match="mode must be one of"):
        RouterReplayCallback(mode="r4")
    with pytest.raises(ValueError, match="backend must be None, 'hf', 'megatron'"):
        RouterReplayCallback(backend="vllm")

    class NoFlag:  # a backend without a validate flag
        num_layers, top_k, num_experts, moe_layers = 4, 2, 8, (1, 2, 3)

        def install(self, routes, replay_mask=None): ...
        def clear(self): ...
        def start_recording(self): ...
        def stop_recording(self): ...
        def routing_stats(self): ...

    with pytest.raises(
        ValueError, match="validate_routes=True needs a backend with a 'validate' flag, got NoFlag"
    ):
        RouterReplayCallback(backend=NoFlag(), validate_routes=True)
    assert RouterReplayCallback(backend=NoFlag()).validate_routes is None
    bad = make_batch(4, [4, 5])
    bad.routed_experts = PackedTensor.from_lengths(bad.routed_experts.values[:, :3], [3, 4])
    with pytest.raises(
        ValueError,
        match=r"^route rows must be \[4 layers \(the model's num_layers=4\), top_k=2\], got \[3, 2\]$",
    ):
        fit(TinyPolicy(), [bad], RouterReplayCallback())
    with pytest.raises(LookupError, match="no RouterReplayCallback"):
        RouterReplayCallback.find(pl.Trainer(logger=False, enable_checkpointing=False))


@pytest.mark.parametrize(
    ("choice", "mode", "strict", "backend"),
    [
        ("default", "r3", False, "hf"),
        ("router_replay_strict", "r2", True, "hf"),
        ("router_replay_megatron", "off", False, "megatron"),
    ],
)
def test_hydra_callback_configs_compose_and_instantiate(choice, mode, strict, backend):
    with initialize_config_dir(config_dir=str(CONF.parent), version_base=None):
        config = compose(overrides=[f"+callbacks={choice}", f"+replay={mode}"])
    callback = instantiate(config.callbacks.router_replay)
    assert isinstance(callback, RouterReplayCallback)
    assert (callback.mode, callback.strict, callback._backend_spec) == (mode, strict, backend)
    assert callback.validate_routes is False  # ids are checked upstream: no host sync per step


# ---------------------------------------------------------------------------- FSDP2 (gloo)
class ShardedPolicy(TinyPolicy):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.device_mesh)
        fully_shard(self.model, mesh=self.device_mesh)


def _fsdp_fit(rank, batches):
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = ShardedPolicy()
    callback = RouterReplayCallback(mode="r3")
    trainer = cpu_trainer(
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=1,
        logger=False,
        callbacks=[callback],
        use_distributed_sampler=False,
    )
    mine = [batches[rank]]
    trainer.fit(module, loader(mine))
    index = tuple(torch.tensor(real_rows(mine[0])).T)
    assert torch.equal(
        module.train_routes[0][index][:, LAYERS].long(), engine_dense(mine[0])[index][:, LAYERS]
    )
    assert not callback.backend.installed


@pytest.mark.slow
def test_fsdp2_model_parallel_strategy_replays_per_rank(batches):
    run_ranks(_fsdp_fit, batches)
