import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from r3lightning.app.models.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config, tiny_moe_config
from r3lightning.replay.hf.replay import HFRouterReplay


def test_default_config_is_a_tiny_qwen3_moe_with_one_dense_layer():
    config = tiny_moe_config()
    assert isinstance(config, Qwen3MoeConfig)
    assert (config.hidden_size, config.num_hidden_layers) == (64, 4)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
    assert list(config.mlp_only_layers) == [0]
    assert tiny_moe_config(num_hidden_layers=2, mlp_only_layers=[]).num_hidden_layers == 2


def test_build_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_moe(seed=7)
    draw = torch.rand(3)
    b = build_tiny_moe(seed=7)
    c = build_tiny_moe(seed=8)
    assert torch.equal(draw, expected_draw)
    assert isinstance(a, Qwen3MoeForCausalLM) and not a.training
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.1.mlp.gate.weight"], sc["model.layers.1.mlp.gate.weight"])
    assert sa["model.layers.1.mlp.gate.weight"].abs().sum() > 0  # routers are randomly initialised


def test_dtype_casts_the_same_initial_weights():
    a = build_tiny_moe(seed=3)
    b = build_tiny_moe(seed=3, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in b.parameters())
    wa, wb = a.lm_head.weight, b.lm_head.weight
    assert torch.equal(wa.to(torch.bfloat16), wb)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_builds_and_exposes_its_routers(family):
    config = tiny_family_config(family)
    model = build_tiny_moe(config)
    logits = model(torch.tensor([[3, 4, 5, 6]])).logits
    assert logits.shape == (1, 4, config.vocab_size)
    backend = HFRouterReplay(model)
    expected_dense = {"qwen3_moe": (0,), "qwen2_moe": (1,), "deepseek_v3": (0,)}.get(family, ())
    assert backend.moe_layers == tuple(i for i in range(4) if i not in expected_dense)
    assert (backend.num_layers, backend.top_k, backend.num_experts) == (4, 2, 8)
    backend.remove()


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError, match="family must be one of"):
        tiny_family_config("llama")


def test_gpt_oss_layer_types_follow_the_layer_count():
    assert tiny_family_config("gpt_oss").layer_types == ["sliding_attention", "full_attention"] * 2
    config = tiny_family_config("gpt_oss", num_hidden_layers=3)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
