"""Meta-device init + FSDP2 sharding + per-rank shard loading (r3lightning.app.job.sharded) on 2
gloo processes: each rank's peak memory for the load stays well below one full copy, and the
sharded model computes what the eagerly loaded one does."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from gloo_ranks import run_ranks

from r3lightning.app.job.sharded import convert_checkpoint, meta_model, parameters_on_meta
from r3lightning.app.models.tiny import build_tiny_moe, tiny_family_config

# big enough that one fp32 copy (~100 MB) stands well above the noise of the peak RSS
CONFIG = {"hidden_size": 128, "num_experts": 64, "moe_intermediate_size": 128, "num_hidden_layers": 8}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


@contextmanager
def peak_growth(out: dict[str, int], key: str) -> Iterator[None]:
    """``out[key]``: the block's peak resident memory above the resident memory at its start
    (Linux: the high-water mark is reset through ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = _status_kib("VmRSS")
    yield
    out[key] = _status_kib("VmHWM") - start


def _rank(rank: int, hf_dir: str, dcp_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from r3lightning.app.job.sharded import load_sharded_weights

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    tokens = torch.arange(2 * 11).reshape(2, 11) % 90 + 3
    out: dict = {}
    meta_model(hf_dir)  # imports the modeling code before measuring
    with peak_growth(out, "sharded_peak"):
        model = meta_model(hf_dir)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        load_sharded_weights(model, dcp_dir, "cpu")
    with torch.no_grad():
        out["logits"] = model(input_ids=tokens).logits
    # the same measurement around an eager load shows what one full copy costs
    with peak_growth(out, "eager_peak"):
        eager = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    sizes = [p.numel() * p.element_size() for p in eager.parameters()]
    out["full_bytes"], out["largest_bytes"] = sum(sizes), max(sizes)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_meta_init_shard_and_load_uses_a_fraction_of_a_copy_per_rank_and_matches_eager(tmp_path):
    hf_dir, dcp_dir = tmp_path / "hf", tmp_path / "dcp"
    build_tiny_moe(tiny_family_config("qwen3_moe", **CONFIG), seed=3).save_pretrained(hf_dir)
    convert_checkpoint(hf_dir, dcp_dir)
    run_ranks(_rank, str(hf_dir), str(dcp_dir), str(tmp_path))
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tokens = torch.arange(2 * 11).reshape(2, 11) % 90 + 3
    with torch.no_grad():
        expected = eager(input_ids=tokens).logits
    for rank in (0, 1):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-5)
        full = out["full_bytes"]
        assert full > 60e6
        assert out["eager_peak"] > 0.9 * full  # the measurement sees a full copy when there is one
        # this rank's half, plus one saved tensor read whole (twice while decoded), plus slack
        bound = full / 2 + 2 * out["largest_bytes"] + 8e6
        assert out["sharded_peak"] < min(bound, 0.8 * full), (rank, out["sharded_peak"] / full, bound / full)


def test_parameters_on_meta_keeps_buffers_real():
    config = tiny_family_config("qwen3_moe")
    with parameters_on_meta():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    reference = build_tiny_moe(config)
    for name, buffer in model.named_buffers():
        assert buffer.device.type == "cpu"
        torch.testing.assert_close(buffer, reference.get_buffer(name))
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # restored on exit


def test_sharded_weights_without_fsdp2_and_models_without_decoder_layers_are_refused(tmp_path):
    from r3lightning.app.job.module import GRPOModule
    from r3lightning.app.job.sharded import shard_model

    build_tiny_moe(seed=0).save_pretrained(tmp_path)
    module = GRPOModule(meta_model(tmp_path), sharded_weights=str(tmp_path / "dcp"))
    with pytest.raises(ValueError, match="sharded_weights needs FSDP2 \\(ModelParallelStrategy"):
        module.configure_model()
    with pytest.raises(ValueError, match=r"decoder layers at model\.model\.layers; Linear has none"):
        shard_model(torch.nn.Linear(2, 2), mesh=None)


def test_loading_into_an_unsharded_meta_model_and_a_mismatched_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from r3lightning.app.job.sharded import load_sharded_weights

    hf_dir, dcp_dir = tmp_path / "hf", tmp_path / "dcp"
    build_tiny_moe(seed=5).save_pretrained(hf_dir)
    convert_checkpoint(hf_dir, dcp_dir)
    model = meta_model(hf_dir)
    load_sharded_weights(model, dcp_dir, "cpu")  # a single process: the whole model is its shard
    eager = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    tokens = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, eager(input_ids=tokens).logits)
    other = tmp_path / "other"
    build_tiny_moe(tiny_family_config("qwen3_moe", num_hidden_layers=5), seed=0).save_pretrained(other)
    with pytest.raises(
        ValueError,
        match=r"does not match the model: missing \['model\.layers\.4\.input_layernorm\.weight', .*\], unexpected \[\]",
    ):
        load_sharded_weights(meta_model(other), dcp_dir, "cpu")


def test_conversion_command_line_writes_the_checkpoint_in_the_dtype_asked(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from r3lightning.app.job.sharded import main

    model = build_tiny_moe(tiny_family_config("qwen3_moe"), seed=4)
    model.save_pretrained(tmp_path / "hf")
    main([str(tmp_path / "hf"), str(tmp_path / "dcp"), "--dtype", "bfloat16"])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'dcp'}\n"
    state = {k: torch.empty_like(v, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    with pytest.raises(SystemExit):  # argparse: a dtype that is not offered
        main([str(tmp_path / "hf"), str(tmp_path / "x"), "--dtype", "int8"])
