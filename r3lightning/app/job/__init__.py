"""The main job: GRPO training of a causal MoE with Rollout Routing Replay, configured by Hydra
(``r3lightning-train``; docs/job.md). ``main`` is the entry point, ``setup`` checks a config and
trains one run, ``rollout_loop`` and ``engine`` feed it, ``report`` writes its outputs."""
