"""Router replay on the transformers 5.x MoE families beyond the six of tests/test_hf_replay.py.

Each family is a real, tiny, randomly initialised model of the installed transformers. For every
one: replaying the model's own routes is bit-identical (logits and gradients), forced routes are
the experts used while the gate weights follow the live logits with the family's own formula
(checked against an independent float64 reference) and the router still gets gradients.
"""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from r3lightning import RouterAdapter, register_router, softmax_then_topk_weights
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.hf.routers import registered_router_types

B, S, VOCAB = 2, 9, 96

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 16,
}
# DeepSeek-V3-style routers: grouped sigmoid selection with a correction bias, first layer dense
_SIGMOID = {
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "num_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
_LINEAR_ATTENTION = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
}

# model type -> (config overrides, reference weight formula)
FAMILIES = {
    "glm4_moe": (_SIGMOID, "sigmoid"),
    "glm4_moe_lite": ({**_SIGMOID, **_MLA, "num_key_value_heads": 4}, "sigmoid"),
    "dots1": (_SIGMOID, "sigmoid"),
    "exaone_moe": (
        {**_SIGMOID, "layer_types": ["full_attention"] * 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
        "sigmoid",
    ),
    "solar_open": ({**_SIGMOID, "norm_topk_prob": False}, "sigmoid"),
    "deepseek_v2": (
        {
            **_MLA,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.0,
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
            "num_key_value_heads": 4,
        },
        "softmax_scaled",
    ),
    "qwen3_next": (
        {
            **_LINEAR_ATTENTION,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
        "softmax",
    ),
    "qwen3_5_moe_text": (
        {
            **_LINEAR_ATTENTION,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
        "softmax_renormalised",
    ),
    "qwen3_vl_moe_text": (
        {"num_experts": 8, "moe_intermediate_size": 32, "mlp_only_layers": [0]},
        "softmax_renormalised",
    ),
    "ernie4_5_moe": (
        {
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
            "moe_layer_interval": 1,
            "moe_layer_end_index": 2,
        },
        "ernie",
    ),
    "hunyuan_v1_moe": (
        {"num_experts": 8, "moe_topk": 2, "moe_intermediate_size": 32, "num_shared_expert": 1},
        "softmax_renormalised",
    ),
    "flex_olmo": ({"num_experts": 8, "norm_topk_prob": False}, "softmax"),
    "minimax": (
        {"num_local_experts": 8, "layer_types": ["full_attention"] * 3, "block_size": 16},
        "softmax_renormalised",
    ),
}


def build(family, seed=0):
    overrides, _ = FAMILIES[family]
    config = AutoConfig.for_model(family, **{**_COMMON, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError:  # a multimodal family's text model has no causal-LM class of its own
            model = AutoModel.from_config(config, dtype=torch.float32)
        # the checkpoint-loading path initialises router weights; from_config may leave zeros
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if name == "weight" and param.dim() == 2 and param.abs().sum() == 0:
                    nn.init.normal_(param, std=0.1)
    return model.train()


def output(model, input_ids, attention_mask):
    out = model(input_ids, attention_mask=attention_mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[0, :3] = 0  # left padding
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def random_routes(num_layers, top_k, num_experts, seed):
    """Distinct random experts per row, independent of any model."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, S, num_layers, num_experts, generator=g).argsort(dim=-1)[..., :top_k]


def reference_weights(kind, router, logits, indices):
    """The family's gate weights for given experts, in float64, written from the model sources."""
    logits = logits.double()
    if kind == "softmax_of_selected":
        return logits.gather(1, indices).softmax(-1)
    if kind == "sigmoid":
        w = logits.sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * router.routed_scaling_factor
    w = logits.softmax(-1).gather(1, indices)
    if kind == "softmax_scaled":
        return w * router.routed_scaling_factor
    if kind == "ernie":
        return w / w.sum(-1, keepdim=True).clamp(min=router.norm_min)
    if kind == "softmax_renormalised" or (kind == "softmax" and router.norm_topk_prob):
        return w / w.sum(-1, keepdim=True)
    return w


def router_weight(router):
    return next(p for name, p in router.named_parameters() if name.endswith("weight"))


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def test_every_family_is_built_in(family):
    model = build(family)
    assert {type(m) for m in model.modules()} & set(registered_router_types())
    backend = HFRouterReplay(model)
    assert backend.num_experts == 8 and backend.top_k == 2 and len(backend.moe_layers) >= 2
    backend.remove()


def test_replaying_the_models_own_routes_is_bit_identical(family):
    input_ids, attention_mask = batch(1)
    model = build(family)
    with record_routes(model) as rec:
        native = output(model, input_ids, attention_mask)
    native.square().mean().backward()
    native_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with replay_routes(model, rec.routes, attention_mask.bool()):
        replayed = output(model, input_ids, attention_mask)
        replayed.square().mean().backward()
    assert torch.equal(native, replayed)
    for name, grad in native_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, msg=name)


def test_own_routes_are_bit_identical_in_bfloat16(family):
    input_ids, attention_mask = batch(3)
    model = build(family).to(torch.bfloat16)
    with torch.no_grad():
        with record_routes(model) as rec:
            native = output(model, input_ids, attention_mask)
        with replay_routes(model, rec.routes, attention_mask.bool()):
            replayed = output(model, input_ids, attention_mask)
    assert torch.equal(native, replayed)


def test_forced_routes_get_weights_from_live_logits_and_router_gradients(family):
    input_ids, attention_mask = batch(2)
    model = build(family)
    backend = HFRouterReplay.for_model(model)
    routes = random_routes(backend.num_layers, backend.top_k, backend.num_experts, seed=7)
    mask = attention_mask.bool().clone()
    mask[1, -2:] = False  # uncaptured suffix: native routing
    seen, native, handles = {}, {}, []
    for layer, router in zip(backend.moe_layers, backend.routers, strict=True):
        # the native output (before the replay hook) and the replayed one (after it)
        handles.append(
            router.register_forward_hook(lambda m, a, o, i=layer: native.update({i: o}), prepend=True)
        )
        handles.append(router.register_forward_hook(lambda m, a, o, i=layer: seen.update({i: o})))
    try:
        with replay_routes(model, routes, mask), record_routes(model) as rec:
            output(model, input_ids, attention_mask).square().mean().backward()
    finally:
        for handle in handles:
            handle.remove()
    _, kind = FAMILIES[family]
    layers = list(backend.moe_layers)
    assert torch.equal(rec.routes[mask][:, layers], routes[mask][:, layers].int())
    for layer, router in zip(backend.moe_layers, backend.routers, strict=True):
        own = native[layer][2].reshape(B, S, -1)
        assert torch.equal(rec.routes[~mask][:, layer], own[~mask].int())
        logits, weights, indices = seen[layer]
        assert torch.equal(indices, rec.routes[:, :, layer].reshape(-1, backend.top_k).long())
        expected = reference_weights(kind, router, logits.detach(), indices)
        torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)
        grad = router_weight(router).grad
        assert grad is not None and grad.abs().sum() > 0


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
    import importlib

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
        "from r3lightning.replay.hf.routers import RouterAdapter, register_router, softmax_then_topk_weights",
        "register_router(PlainRouter, RouterAdapter(gate_weights=softmax_then_topk_weights))",
    ]
    exec("\n".join(fix), {"PlainRouter": PlainRouter})  # the fix, as printed
    x = torch.randn(1, 5, 8)
    routes = torch.rand(1, 5, 2, 6).argsort(-1)[..., :2]
    with replay_routes(model, routes):
        outs = model(x)
    for layer, (logits, weights, indices) in enumerate(outs):
        assert torch.equal(indices, routes[0, :, layer])
        torch.testing.assert_close(
            weights, softmax_then_topk_weights(model.layers[layer]["router"], logits, indices)
        )
    # the public names are the registry's own
    assert RouterAdapter.__module__ == "r3lightning.replay.hf.routers"
    assert register_router.__module__ == "r3lightning.replay.hf.routers"


def test_llama4_router_is_refused_with_the_reason():
    config = AutoConfig.for_model(
        "llama4_text",
        **{**_COMMON, "num_local_experts": 8, "num_experts_per_tok": 1, "intermediate_size_mlp": 96},
    )
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"Llama4Router\) cannot be replayed: its forward returns \(dense"):
        HFRouterReplay(model)


def test_readme_recipe_for_your_own_moe_runs_as_written():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## Bringing your own MoE\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_recipe"})
