"""The main job: GRPO training of a causal MoE with Rollout Routing Replay (Hydra-configured).

task         the toy task, its reward, and the task/reward interface the job consumes
models       model factories (tiny MoE families, Hugging Face checkpoints)
megatron     a tiny megatron-core MoE model and megatron's process setup for the job
grpo         group advantages, clipped policy loss, training/inference mismatch metrics
module       the LightningModule (logprobs of left-padded batches, FSDP2 sharding)
rollout_loop each rank's rollouts into its own replay buffer, one RL step per epoch
report       metrics CSV, summary table, plot
engine       the embedded rollout server or an external engine, and weight pushes to it
build        ``_target_`` instantiation and typed settings, with one-line errors
setup        checks the config and builds a run's pieces
checkpoint   resuming from last.ckpt, with its checks
help         ``--help`` from the YAML comments
common       the job's one-line error and the launcher's rank
main         the Hydra entry point (``python -m r3lightning.job.main``, ``r3lightning-train``)
"""
