"""The application built on the library: the embedded rollout server (``serve``), the training job
with its GRPO loss and advantages (``job``), the demo tasks and rewards (``tasks``) and the small
models it ships (``models``). Nothing in the library imports this package."""
