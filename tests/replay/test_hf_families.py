"""Router replay on the transformers 5.x MoE families beyond the six of test_hf_replay.py.

Each family is a real, tiny, randomly initialised model of the installed transformers. For every
one: replaying the model's own routes is bit-identical (logits and gradients), forced routes are
the experts used while the gate weights follow the live logits with the family's own formula
(checked against an independent float64 reference) and the router still gets gradients.
"""

import pytest
import torch
from hf_reference import TINY_TEXT_CONFIG, VOCAB, reference_weights, router_weight
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.hf.routers import registered_router_types

B, S = 2, 9

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
    "granitemoe": ({"num_local_experts": 8}, "softmax_of_selected"),
    "granitemoeshared": ({"num_local_experts": 8, "shared_intermediate_size": 32}, "softmax_of_selected"),
    # a wide jitter band, so that forced experts away from the best keep non-zero weights
    "phimoe": ({"num_local_experts": 8, "router_jitter_noise": 0.5}, "phimoe"),
}
# PhiMoE samples its experts in training mode (Gumbel noise): its own routes replay in eval mode
EVAL_ONLY = {"phimoe"}


def build(family, seed=0):
    overrides, _ = FAMILIES[family]
    config = AutoConfig.for_model(family, **{**TINY_TEXT_CONFIG, **overrides})
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
    return model.eval() if family in EVAL_ONLY else model.train()


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
