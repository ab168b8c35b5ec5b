"""The main job: GRPO training of a causal MoE with Rollout Routing Replay (Hydra-configured).

task         the verifiable toy task and its reward
grpo         group advantages, clipped policy loss, training/inference mismatch metrics
module       the LightningModule (logprobs of left-padded batches, FSDP2 sharding)
rollout_loop each rank's rollouts into its own replay buffer, one RL step per epoch
report       metrics CSV, summary table, plot
engine       the embedded rollout server or an external engine, and weight pushes to it
setup        builds a run from its config
common       the job's one-line error and the launcher's rank
main         the Hydra entry point (``python -m r3lightning.job.main``, ``r3lightning-train``)
"""
