"""MegatronRouterReplay in production step structures on CPU: several forward/backward passes on one
install with MoE recompute, and one install per micro-batch of megatron's forward_backward_func."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron_cpu import (
    HIDDEN,
    LAYERS,
    UsedExperts,
    make_config,
    make_moe_layer,
    megatron_cpu,  # noqa: F401 (the module's fixture)
    sorted_rows,
    stage_routes,
)

from r3lightning.replay.megatron.replay import (
    MegatronRouterReplay,
)

pytestmark = pytest.mark.usefixtures("megatron_cpu")


def test_replay_modules_import_without_the_callback():
    code = (
        "import sys\n"
        "import r3lightning.replay.megatron.replay\n"
        "assert 'r3lightning.replay.callback' not in sys.modules, 'megatron imports the callback'\n"
        "assert 'lightning' not in sys.modules\n"
        "import r3lightning.replay.callback\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_device_shims_cover_the_schedules_and_are_undone():
    from megatron.core.pipeline_parallel import schedules

    from r3lightning.app.models.megatron_cpu import megatron_device_shims

    outer = schedules.torch  # already shimmed by this module's fixture
    with megatron_device_shims("cpu"):
        assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert schedules.torch.ones is torch.ones  # everything else is torch itself
    assert schedules.torch is outer
    with megatron_device_shims("cuda"):  # on a GPU only the Transformer Engine patch applies
        assert schedules.torch is outer


def test_several_forward_backward_passes_on_one_install_with_moe_recompute():
    """PPO epochs over one micro-batch: one install, three forward/backward passes, megatron's MoE
    recompute in each backward replays the installed routes (never a stale or missing entry)."""
    torch.manual_seed(11)
    plain = make_moe_layer(make_config(), 2)
    recomputing = make_moe_layer(make_config(recompute_granularity="selective", recompute_modules=["moe"]), 2)
    recomputing.load_state_dict(plain.state_dict())
    x = torch.randn(6, 1, HIDDEN, requires_grad=True)
    routes = stage_routes(6, LAYERS, seed=3)
    grads = {}
    for name, layer in (("plain", plain), ("recompute", recomputing)):
        backend = MegatronRouterReplay(layer)
        used = UsedExperts(backend.routers)
        backend.install(routes)
        per_pass = []
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            layer(x)[0].pow(2).sum().backward()
            per_pass.append(layer.router.weight.grad.clone())
        queued = len(layer.router.router_replay.replay_backward_list)
        stats = backend.routing_stats()
        backend.clear()
        used.remove()
        grads[name] = per_pass
        # every call, recomputations included, used the installed experts
        assert len(used.calls) == (6 if name == "recompute" else 3)
        assert all(experts == sorted_rows(routes, 1) for _, experts in used.calls)
        assert stats["replayed_rows"].tolist() == [3 * 6]  # forwards counted, recompute not
        if name == "recompute":
            assert queued == 0  # each recompute consumed the entry its forward queued
    for plain_grad, recompute_grad in zip(grads["plain"], grads["recompute"], strict=True):
        torch.testing.assert_close(recompute_grad, plain_grad)
    assert grads["plain"][0].abs().sum() > 0


class MoEStage(torch.nn.Module):
    """A one-stage megatron model for ``forward_backward_func``: two MoE decoder layers (1 and 3)
    with MoE recompute, residual, over given hidden states."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.moe = torch.nn.ModuleList([make_moe_layer(config, 2), make_moe_layer(config, 4)])

    model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, tensor) -> None:  # megatron's pipeline hook; one stage: unused
        pass

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [s, b, h]
        for layer in self.moe:
            hidden = hidden + layer(hidden)[0]
        return hidden


def test_one_install_per_micro_batch_of_forward_backward_func():
    """megatron's own schedule (no pipelining, one rank) over three micro-batches of different
    lengths: the forward_step_func installs each micro-batch's routes; every forward and every
    recompute uses its own micro-batch's experts and the gradients equal separate replays."""
    torch.manual_seed(12)
    config = make_config(recompute_granularity="selective", recompute_modules=["moe"])
    model = MoEStage(config)
    reference = MoEStage(make_config())
    reference.load_state_dict(model.state_dict())
    lengths = [5, 3, 7]
    micro_batches = [
        (torch.randn(n, 1, HIDDEN, requires_grad=True), stage_routes(n, LAYERS, seed=20 + i))
        for i, n in enumerate(lengths)
    ]
    backend = MegatronRouterReplay(model)
    used = UsedExperts(backend.routers)
    installs = []

    def forward_step(data_iterator, stage):
        hidden, routes = next(data_iterator)
        backend.install(routes)
        installs.append(routes)
        output = stage(hidden)

        def loss_func(out):
            loss = out.pow(2).mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    model.zero_grad(set_to_none=True)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=max(lengths),
        micro_batch_size=1,
        forward_only=False,
    )
    assert len(model.moe[0].router.router_replay.replay_backward_list) == 0
    backend.clear()
    used.remove()
    # per micro-batch: forward (layers 1, 3), then its backward recomputes layers 3, 1
    assert len(used.calls) == 4 * len(lengths)
    for index, (_, routes) in enumerate(micro_batches):
        calls = used.calls[4 * index : 4 * index + 4]
        assert [layer for layer, _ in calls] == [1, 3, 3, 1]
        for layer, experts in calls:
            assert experts == sorted_rows(routes, layer)
    # the same gradients as replaying each micro-batch by hand, without recompute
    reference_backend = MegatronRouterReplay(reference)
    reference.zero_grad(set_to_none=True)
    for hidden, routes in micro_batches:
        reference_backend.install(routes)
        (reference(hidden).pow(2).mean() / len(micro_batches)).backward()
        reference_backend.clear()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref.grad, msg=name)
