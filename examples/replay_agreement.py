"""The README's first example: the share of the engine's experts a training forward used, routed
natively and with Rollout Routing Replay, on the tiny Qwen3-MoE against an embedded engine whose
router disagrees with the trainer's on ~10% of expert slots (a labelled SIMULATION).

    python examples/replay_agreement.py
"""

import lightning.pytorch as pl

from r3lightning import (
    CollectorConfig,
    EngineConfig,
    GRPOAdvantages,
    R3DataModule,
    ReplayBuffer,
    RolloutCollector,
    RolloutServer,
    RouterReplayCallback,
)
from r3lightning.app.job.module import GRPOModule
from r3lightning.app.models.tiny import build_tiny_moe

buffer = ReplayBuffer()
model = build_tiny_moe(seed=0)  # any Hugging Face MoE: Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, ...
engine = EngineConfig(simulated_disagreement=0.1)  # SIMULATION: its router disagrees on ~10% of slots
with RolloutServer(model, engine=engine) as server:  # or the URL of a vLLM / SGLang / SkyRL engine
    config = CollectorConfig(group_size=4)
    collector = RolloutCollector(
        server.url, lambda prompt, response: 1.0, config, advantages=GRPOAdvantages(), schema=model.config
    )
    collector.collect([[1, 2, 3, i] for i in range(4)], step=0, buffer=buffer)  # 16 trajectories with routes
agreement = {}
for mode in ("off", "r3"):  # the trainer's own routing, then the engine's experts replayed
    callback = RouterReplayCallback(backend="hf", mode=mode)
    trainer = pl.Trainer(max_steps=1, callbacks=[callback], logger=False, enable_progress_bar=False)
    trainer.fit(GRPOModule(build_tiny_moe(seed=0)), datamodule=R3DataModule(buffer, batch_size=16))
    agreement[mode] = float(trainer.callback_metrics["router_replay/used_agreement"])
print({mode: f"{share:.1%}" for mode, share in agreement.items()})
