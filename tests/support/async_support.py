"""A Lightning callback the off-policy job tests add with ``+callbacks.versions._target_=...``: it
records every trained row (step, weight version, tokens, logprobs, routes), and can hold each
step's end until the rollout worker collected every step the staleness rule allows, so which
version generates which step does not depend on timing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl

ROWS: list[dict] = []  # in-process runs: every recorded row


class VersionRecorder(pl.Callback):
    """Records trained rows into :data:`ROWS` and, with ``path``, one JSON line each.

    Args:
        path: a JSON-lines file (for subprocess runs); None: memory only.
        hold_staleness: hold each step's end until the worker reached ``step + 1 + hold_staleness``
            (None: never hold).
        pause_at_step: sleep in the first batch of this step (a kill -9 lands there); None: never.
    """

    def __init__(
        self, path: str | None = None, hold_staleness: int | None = None, pause_at_step: int | None = None
    ):
        self.path = None if path is None else Path(path)
        self.hold_staleness, self.pause_at_step = hold_staleness, pause_at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        seq, prompt = (t.tolist() for t in batch.lengths_host())
        routes = batch.routed_experts
        rows = []
        for i in range(len(batch)):
            ids = batch.input_ids[i, batch.width - seq[i] :].tolist()
            response = slice(batch.width - seq[i] + prompt[i], batch.width)
            rows.append(
                {
                    "step": trainer.current_epoch,
                    "pid": os.getpid(),
                    "version": int(batch.weight_versions[i]),
                    "prompt": ids[: prompt[i]],
                    "response": ids[prompt[i] :],
                    "logprobs": batch.rollout_logprobs[i, response].tolist(),
                    "routes": None if routes is None else routes[i].tolist(),
                }
            )
        ROWS.extend(rows)
        if self.path is not None:
            with self.path.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        if trainer.current_epoch == self.pause_at_step and batch_idx == 0:
            time.sleep(600)  # the test kills the process here

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.hold_staleness is None:
            return
        buffer = trainer.datamodule.buffer
        wanted = min(trainer.current_epoch + 1 + self.hold_staleness, trainer.max_epochs)
        deadline = time.monotonic() + 300
        while buffer.next_put < wanted and time.monotonic() < deadline:
            time.sleep(0.01)
