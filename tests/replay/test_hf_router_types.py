"""Router types replayed one router at a time, routers nobody registered, and the weight helpers'
names (the old names still import, with a DeprecationWarning naming the new one).
"""

import importlib
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_reference import TINY_TEXT_CONFIG, reference_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from r3lightning.replay.context import replay_routes
from r3lightning.replay.hf import routers
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.hf.routers import (
    RouterAdapter,
    qwen3_moe_weights,
    register_router,
    registered_router_types,
)

# Router types whose families are too large to build as whole models here (hybrid, multimodal or
# sparse-attention stacks): each real router module is checked on its own, inside a two-layer
# model, with the same three guarantees.
ROUTER_ONLY = {
    "Qwen3OmniMoeTextTopKRouter": ("qwen3_omni_moe", "softmax_renormalised"),
    "Qwen3OmniMoeThinkerTextTopKRouter": ("qwen3_omni_moe", "softmax"),
    "Qwen3OmniMoeTalkerTextTopKRouter": ("qwen3_omni_moe", "softmax"),
    "Qwen4ExpTextTopKRouter": ("qwen4_exp", "softmax"),
    "MellumTopKRouter": ("mellum", "softmax"),
    "DeepseekV32TopkRouter": ("deepseek_v32", "sigmoid"),
    "Glm4vMoeTextTopkRouter": ("glm4v_moe", "sigmoid"),
    "Glm5NextTextTopkRouter": ("glm5_next", "sigmoid"),
    "GlmMoeDsaTopkRouter": ("glm_moe_dsa", "sigmoid"),
    "KimiLinearTopkRouter": ("kimi_linear", "sigmoid"),
    "MiMoV2FlashTopkRouter": ("mimo_v2_flash", "sigmoid"),
    "NemotronHTopkRouter": ("nemotron_h", "sigmoid"),
    "BailingHybridTopkRouter": ("bailing_hybrid", "sigmoid"),
    "Dots3NoteTextTopkRouter": ("dots3_note", "sigmoid"),
    "HYV4TopkRouter": ("hy_v4", "sigmoid"),
    "HYV4VLTopkRouter": ("hy_v4_vl", "sigmoid"),
    "AXK1TopkRouter": ("axk1", "sigmoid"),
    "AXK2TopkRouter": ("axk2", "sigmoid"),
    "DeepseekOcr2TextTopkRouter": ("deepseek_ocr2", "softmax_scaled"),
    "UnlimitedOcrTextTopkRouter": ("unlimited_ocr", "softmax_scaled"),
    "AriaTextTopKRouter": ("aria", "softmax_of_selected"),
    "GraniteMoeHybridTopKRouter": ("granitemoehybrid", "softmax_of_selected"),
    "GraniteMoeSWATopKRouter": ("granitemoe_swa", "softmax_of_selected"),
}


def test_registered_router_types_cover_every_tested_type():
    names = {cls.__name__ for cls in registered_router_types()}
    assert set(ROUTER_ONLY) <= names and len(names) >= 40


class RouterStack(nn.Module):
    """Two real routers of one type in a ``layers.<i>`` list, fed the same hidden states."""

    def __init__(self, router_cls, config):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"gate": router_cls(config)}) for _ in range(2))
        for layer in self.layers:
            nn.init.normal_(layer["gate"].weight, std=0.5)
            bias = getattr(layer["gate"], "e_score_correction_bias", None)
            if bias is not None:  # a selection-only bias: must not leak into the weights
                bias.copy_(torch.rand(bias.shape))

    def forward(self, hidden):  # [N, H]
        return [layer["gate"](hidden) for layer in self.layers]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("class_name", sorted(ROUTER_ONLY))
def test_router_type_replays_own_and_forced_routes_with_live_weights(class_name, norm_topk_prob):
    family, kind = ROUTER_ONLY[class_name]
    router_cls = getattr(
        importlib.import_module(f"transformers.models.{family}.modeling_{family}"), class_name
    )
    config = SimpleNamespace(
        num_experts_per_tok=2,
        num_local_experts=8,
        n_routed_experts=8,
        num_experts=8,
        hidden_size=16,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
        norm_topk_prob=norm_topk_prob,
        topk_method="group_limited_greedy",
        moe_num_experts=8,
        moe_topk=2,
    )
    torch.manual_seed(0)
    model = RouterStack(router_cls, config)
    backend = HFRouterReplay(model)
    assert backend.moe_layers == (0, 1) and (backend.top_k, backend.num_experts) == (2, 8)
    hidden = torch.randn(6, 16)
    native = model(hidden)
    own = torch.stack([indices for _, _, indices in native], dim=1)[None]  # [1, 6, 2, K]
    with replay_routes(model, own):
        again = model(hidden)
    for (_, weights, indices), (_, replayed, replayed_indices) in zip(native, again, strict=True):
        assert torch.equal(replayed_indices, indices) and torch.equal(replayed, weights)
    forced = torch.rand(1, 6, 2, 8, generator=torch.Generator().manual_seed(1)).argsort(-1)[..., :2]
    with replay_routes(model, forced):
        outputs = model(hidden)
        # unequal weights per slot: the plain sum of normalised weights is constant (no gradient)
        slot_weights = torch.arange(1.0, forced.shape[-1] + 1)
        sum((w * slot_weights).sum() for _, w, _ in outputs).backward()
    for layer, (logits, weights, indices) in enumerate(outputs):
        router = model.layers[layer]["gate"]
        assert torch.equal(indices, forced[0, :, layer])
        expected = reference_weights(kind, router, logits.detach(), indices)
        torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    backend.remove()


class PlainRouter(nn.Module):
    """A router type nobody registered: softmax over all experts, top-k renormalised."""

    def __init__(self, hidden=8, experts=6, k=2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden))
        self.top_k, self.num_experts, self.norm_topk_prob = k, experts, True

    def forward(self, x):
        logits = x.reshape(-1, x.shape[-1]) @ self.weight.t()
        probs = logits.softmax(-1)
        values, indices = probs.topk(self.top_k, dim=-1)
        return logits, values / values.sum(-1, keepdim=True), indices


class PlainMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"router": PlainRouter()}) for _ in range(2))

    def forward(self, x):
        return [layer["router"](x) for layer in self.layers]


def test_unknown_router_error_names_the_class_and_the_two_line_fix_works():
    torch.manual_seed(0)
    model = PlainMoE()
    with pytest.raises(ValueError) as raised:
        HFRouterReplay(model)
    message = str(raised.value)
    assert f"'layers.0.router' is a {__name__}.PlainRouter" in message
    fix = [line.strip() for line in message.splitlines()[-2:]]
    assert fix == [
        "from r3lightning.replay.hf.routers import RouterAdapter, qwen3_moe_weights, register_router",
        "register_router(PlainRouter, RouterAdapter(gate_weights=qwen3_moe_weights))",
    ]
    exec("\n".join(fix), {"PlainRouter": PlainRouter})  # the fix, as printed
    x = torch.randn(1, 5, 8)
    routes = torch.rand(1, 5, 2, 6).argsort(-1)[..., :2]
    with replay_routes(model, routes):
        outs = model(x)
    for layer, (logits, weights, indices) in enumerate(outs):
        assert torch.equal(indices, routes[0, :, layer])
        torch.testing.assert_close(weights, qwen3_moe_weights(model.layers[layer]["router"], logits, indices))
    # the public names are the registry's own
    assert RouterAdapter.__module__ == "r3lightning.replay.hf.routers"
    assert register_router.__module__ == "r3lightning.replay.hf.routers"


def test_llama4_router_is_refused_with_the_reason():
    config = AutoConfig.for_model(
        "llama4_text",
        **{**TINY_TEXT_CONFIG, "num_local_experts": 8, "num_experts_per_tok": 1, "intermediate_size_mlp": 96},
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"Llama4Router\) cannot be replayed: its forward returns \(dense"):
        HFRouterReplay(model)


def test_docs_recipe_for_your_own_moe_runs_as_written():
    page = Path(__file__).resolve().parents[2] / "docs" / "recipes" / "own-moe.md"
    (code,) = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    exec(compile(code, str(page), "exec"), {"__name__": "docs_recipe"})


RENAMED = {
    "softmax_then_topk_weights": "qwen3_moe_weights",
    "softmax_renormalised_weights": "qwen3_5_moe_weights",
    "sigmoid_scaled_weights": "deepseek_v3_weights",
    "softmax_scaled_weights": "deepseek_v2_weights",
    "softmax_over_topk_weights": "gpt_oss_weights",
}


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_old_weight_helper_names_import_with_a_deprecation_warning(old, new, monkeypatch):
    """Warned once per process (then cached, as every moved name): forget an earlier lookup first."""
    message = rf"r3lightning\.replay\.hf\.routers\.{old} is deprecated .*use r3lightning\.replay\.hf\.routers\.{new}$"
    monkeypatch.delitem(vars(routers), old, raising=False)
    with pytest.warns(DeprecationWarning, match=message) as caught:
        exec(f"from r3lightning.replay.hf.routers import {old} as helper", scope := {})
    assert scope["helper"] is getattr(routers, new)
    assert caught[0].filename == "<string>"  # points at the importing line
    monkeypatch.delitem(vars(routers), old)
    with pytest.warns(DeprecationWarning, match=message):
        assert getattr(routers, old) is getattr(routers, new)
    # the old flat r3lightning.replay.hf module served these names too
    monkeypatch.delitem(vars(routers), old)
    monkeypatch.delitem(vars(importlib.import_module("r3lightning.replay.hf")), old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^r3lightning\.replay\.hf\.{old} moved to"):
        exec(f"from r3lightning.replay.hf import {old} as helper", scope := {})
    assert scope["helper"] is getattr(routers, new)


def test_new_weight_helper_names_import_silently_and_unknown_names_fail():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in (*RENAMED.values(), "mixtral_weights", "ernie_weights", "phimoe_weights"):
            assert callable(getattr(routers, name)) and name in routers.__doc__
    with pytest.raises(AttributeError, match="has no attribute 'softmax_weights'"):
        routers.softmax_weights  # noqa: B018
