"""A two-stage megatron-core pipeline on two gloo ranks (CPU), each rank a Lightning Trainer whose
R3DataModule keeps only its stage's route columns (``DataOptions(layers=backend.moe_layers)``):
micro-batch by micro-batch, stage 0 sends its activations to stage 1 and gets their gradient back,
and every router uses the engine's experts of its absolute layer. ``used_agreement`` is exactly 1 on
each stage, and the metrics summed over both stages name every MoE layer."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from gloo_ranks import run_ranks

L, K, E, HIDDEN, VOCAB = 4, 2, 8, 16, 32
LENGTHS = [5, 7, 4, 6]


def engine_routes(rows: int, seed: int) -> torch.Tensor:
    """[rows, L, K] uint8, distinct experts per row on every decoder layer (dense layer 0 included)."""
    scores = torch.rand(rows, L, E, generator=torch.Generator().manual_seed(seed))
    return scores.topk(K, dim=-1).indices.to(torch.uint8)


def rollouts():
    from r3lightning.rollout.trajectory import Trajectory

    g = torch.Generator().manual_seed(5)
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        out.append(Trajectory(tokens[:2], tokens[2:], routed_experts=engine_routes(n - 1, i)))
    return out


def stage_module(rank: int):
    """This rank's pipeline stage: megatron's own TransformerBlock of decoder layers 2r, 2r + 1 (layer
    0 dense), with the embedding on stage 0 and the LM head on stage 1."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron_cpu import make_config

    from r3lightning.replay.callback import RouterReplayCallback

    config = make_config(
        num_layers=L,
        hidden_size=HIDDEN,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )

    class Stage(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(rank)
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
            self.block = TransformerBlock(config, spec, post_process=rank == 1)
            self.edge = torch.nn.Embedding(VOCAB, HIDDEN) if rank == 0 else torch.nn.Linear(HIDDEN, VOCAB)
            self.automatic_optimization = False
            self.report = {"route_layers": [], "used": [], "counts": None}

        def training_step(self, batch, batch_idx):
            callback = RouterReplayCallback.find(self.trainer)
            self.report["route_layers"].append(
                [list(batch.route_layers), list(batch.routed_experts.row_shape)]
            )
            for mb in batch.split(2):  # micro-batches: forward and backward across both stages
                with callback.micro_batch(mb) as layout:
                    self.report["route_layers"].append(
                        [list(mb.route_layers), list(mb.routed_experts.row_shape)]
                    )
                    tokens = layout.num_positions
                    causal = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).triu(1)
                    used = {}
                    hooks = [r.register_forward_hook(self._keep(used)) for r in callback.backend.routers]
                    if rank == 0:
                        hidden = self.edge(layout.from_batch(mb.input_ids)).transpose(0, 1)  # [T, 1, H]
                        out = self.block(hidden, attention_mask=causal)
                        dist.send(out.detach().contiguous(), 1)
                        grad = torch.empty_like(out)
                        dist.recv(grad, 1)
                        out.backward(grad)
                    else:
                        hidden = torch.empty(tokens, 1, HIDDEN)
                        dist.recv(hidden, 0)
                        hidden.requires_grad_()
                        logits = self.edge(self.block(hidden, attention_mask=causal))
                        logits.float().logsumexp(-1).mean().backward()
                        dist.send(hidden.grad.contiguous(), 0)
                    for hook in hooks:
                        hook.remove()
                    self.report["used"].append(self._check(mb, layout, used))
            self.report["counts"] = {k: v.tolist() for k, v in callback.routing_counts().items()}
            self.optimizers().step()

        @staticmethod
        def _keep(used):
            def hook(router, args, output):
                used[router.layer_number - 1] = [row.nonzero().flatten().tolist() for row in output[1]]

            return hook

        @staticmethod
        def _check(mb, layout, used):
            """(captured rows whose experts are the engine's, captured rows) over this stage's layers."""
            full = rollouts()
            rows_in = mb.rows_in(mb._root) if mb._root is not None else torch.arange(len(mb))
            same = total = 0
            for position in range(layout.num_positions):
                i, j = int(layout.position_sequence[position]), int(layout.position_offset[position])
                if i < 0 or j >= full[int(rows_in[i])].route_rows:
                    continue
                for layer, experts in used.items():
                    total += 1
                    same += experts[position] == sorted(
                        full[int(rows_in[i])].routed_experts[j, layer].tolist()
                    )
            return [same, total]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Stage()


def _stage_worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"):  # one Lightning process per stage
        os.environ.pop(key)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron_cpu import cpu_shims
    from trainers import cpu_trainer

    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import DataOptions, R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.megatron.replay import MegatronRouterReplay

    tracker = tp_random.get_cuda_rng_tracker()  # attention forks a CUDA RNG: a no-op on the CPU
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    reports = {}
    with cpu_shims():
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        for sync_dist in (False, True):  # this stage's metrics, then both stages' summed
            module = stage_module(rank)
            backend = MegatronRouterReplay(module.block)
            buffer = ReplayBuffer(num_experts=E)
            buffer.extend(rollouts())  # routes on every layer, as an engine sends them
            options = DataOptions(layers=backend.moe_layers)  # the stage keeps its own columns
            data = R3DataModule(buffer, len(LENGTHS), shuffle=False, collate_threads=1, options=options)
            callback = RouterReplayCallback(backend=backend, strict=True, sync_dist=sync_dist)
            trainer = cpu_trainer(
                devices=1,
                max_steps=1,
                logger=False,
                callbacks=[callback],
            )
            trainer.fit(module, datamodule=data)
            metrics = {
                k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("router_replay/")
            }
            reports[str(sync_dist)] = {
                "moe_layers": list(backend.moe_layers),
                "metrics": metrics,
                **module.report,
            }
        parallel_state.destroy_model_parallel()
    Path(out_dir, f"stage{rank}.json").write_text(json.dumps(reports))


@pytest.mark.slow
def test_each_pipeline_stage_gets_only_its_layers_routes_and_replays_them_exactly(tmp_path):
    run_ranks(_stage_worker, str(tmp_path))
    stages = [json.loads((tmp_path / f"stage{rank}.json").read_text()) for rank in range(2)]
    held = [[1], [2, 3]]  # layer 0 is dense
    captured = sum(n - 1 for n in LENGTHS)
    for stage, layers in zip(stages, held, strict=True):
        for sync_dist in ("False", "True"):
            report = stage[sync_dist]
            assert report["moe_layers"] == layers
            # the batch and each micro-batch hold only this stage's columns
            assert report["route_layers"] == [[layers, [len(layers), K]]] * 3
            same, total = map(sum, zip(*report["used"], strict=True))
            assert same == total == captured * len(layers)  # every captured row, every held layer
            counts = report["counts"]  # this stage's own counts, per held layer
            assert (
                counts["used_hits"] == [c * K for c in counts["route_rows"]] and sum(counts["route_rows"]) > 0
            )
        local, summed = stage["False"]["metrics"], stage["True"]["metrics"]
        assert (
            local["router_replay/used_agreement"] == 1.0 and local["router_replay/replayed_fraction"] == 1.0
        )
        assert {k for k in local if "/layer_" in k} == {
            f"router_replay/native_agreement/layer_{x:02d}" for x in layers
        }
        # summed over both stages: still exact, and every MoE layer of the model is named
        assert summed["router_replay/used_agreement"] == 1.0
        assert {k for k in summed if "/layer_" in k} == {
            f"router_replay/native_agreement/layer_{x:02d}" for x in (1, 2, 3)
        }
    per_layer = [s["True"]["metrics"] for s in stages]
    assert per_layer[0] == per_layer[1]  # both ranks log the same summed values
