"""The main job: GRPO training of a causal MoE with Rollout Routing Replay (Hydra-configured).

main         the entry point (``python -m r3lightning.job.main``, ``r3lightning-train``), arms, seeds
setup        checks the config and trains one run; build: from config nodes to objects
rollout_loop each rank's rollouts into its own replay buffer, one RL step per epoch
engine       the embedded rollout server or external engines, and weight pushes to them
module       the GRPO LightningModule; models: model factories; sharded: FSDP2 shard loading
checkpoint   resuming from last.ckpt; report: metrics CSV, summary table, plot; help: ``--help``
"""
