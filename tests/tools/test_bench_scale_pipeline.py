"""benchmarks/bench_scale_pipeline.py measures what it claims: each pipeline stage holds megatron-core's
block of layers, the engine's routes differ per layer (a wrong column cannot pass), and per-rank
route bytes equal ``global / DP x layers held / num_layers``, in the buffer and in the batches."""

from __future__ import annotations

import re

import numpy as np
import pytest
from python_process import BENCHMARKS, REPO, benchmark_module, run_python


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bench_scale_pipeline") as module:
        yield module


def test_stage_blocks_are_contiguous_and_cover_every_layer(bench):
    for num_layers, pp, first in ((48, 1, None), (48, 2, None), (48, 4, None), (61, 4, 16), (61, 8, 5)):
        blocks = [bench.stage_layers(num_layers, pp, s, first) for s in range(pp)]
        assert [layer for b in blocks for layer in b] == list(range(num_layers))
    assert bench.stage_layers(48, 4, 2) == tuple(range(24, 36))
    with pytest.raises(ValueError, match="61 layers do not split evenly over 4 stages"):
        bench.stage_layers(61, 4, 0)
    with pytest.raises(ValueError, match="45 layers do not split evenly over 7 stages"):
        bench.stage_layers(61, 8, 0, first=16)


def test_stage_blocks_are_megatron_cores(bench):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for num_layers, pp, first in ((48, 2, None), (48, 4, None), (61, 4, 16), (61, 8, 5)):
        config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   num_layers_in_first_pipeline_stage=first)  # fmt: skip
        for stage in range(pp):
            offset = get_transformer_layer_offset(config, pp_rank=stage)
            count = get_num_layers_to_build(config, pp_rank=stage)
            assert bench.stage_layers(num_layers, pp, stage, first) == tuple(range(offset, offset + count))


def test_engine_routes_are_distinct_per_row_and_differ_between_layers(bench):
    routes = bench._rollout_ranks.known_routes(300)
    assert routes.shape == (300, 48, 8) and routes.dtype == np.uint8 and routes.max() < 128
    assert all(len(set(row)) == 8 for row in routes.reshape(-1, 8).tolist())
    columns = {routes[:, layer].tobytes() for layer in range(48)}
    assert len(columns) == 48


def test_projection_slices_to_the_busiest_stages_moe_layers(bench):
    rows = {(r[0], r[1], r[2]): r for r in bench.projection_table((64,), (1, 4, 8))}
    qwen, deepseek = rows[("Qwen3-30B-A3B", 64, "8 x 8")], rows[("DeepSeek-V3", 64, "4 x 16")]
    assert qwen[5:] == ["48 / 6", "0.750", "0.094", "0.125"]  # 8 x 32767 x 384 B = 96 MiB sliced
    assert deepseek[3] == "16/15/15/15" and deepseek[5] == "61 / 15"  # stage 0: 3 dense + 13 MoE
    assert rows[("DeepSeek-V3", 64, "1 x 64")][5] == "61 / 58"  # dense layers carry no kept routes


@pytest.mark.slow
def test_quick_run_meets_the_formula_on_every_rank_with_each_stages_layers(bench):
    done = run_python(REPO, str(BENCHMARKS / "bench_scale_pipeline.py"), "--quick", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "stages of one DP rank hold the same trajectories: ok" in out
    assert "target: host route bytes per rank = formula exactly: met" in out
    assert "target: H2D route bytes per rank = formula within 0.1%: met" in out
    assert "target: device route bytes now / before = layers held / 48 within 1%: met" in out
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in out.split("### Per rank, measured")[1].split("###")[0].splitlines()
        if re.match(r"\| \d", line)
    ]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("1", "2", "0", "0"), ("1", "2", "1", "0"), ("2", "1", "0", "0"), ("2", "1", "1", "1"),
    ]  # fmt: skip
    for pp, _, _, stage, layers, formula, host, host_ratio, h2d, h2d_ratio, *_ in rows:
        block = bench.stage_layers(48, int(pp), int(stage))
        assert layers == f"{block[0]}-{block[-1]}"
        assert host == formula == "3.0" and float(host_ratio) == 1.0  # 16 x 1023 x 384 B / 2 ranks
        assert h2d == formula and 1.0 <= float(h2d_ratio) <= 1.001  # + the batches' int32 offsets
