"""A run's ``last.ckpt`` and ``fingerprint.json``, and resuming from them (docs/job.md, Outputs)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import FileSystemReader

from r3lightning.app.job.build import plain
from r3lightning.app.job.common import JobError, one_line

FINGERPRINT = "fingerprint.json"
_FIX = "delete it to start this run over, or set resume=false or another hydra.run.dir"


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        return {prefix.removesuffix("."): value}
    return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """``{dotted key: value}`` of the resolved ``task``, ``reward`` and ``model`` (``seed`` at 0: seeds
    live side by side), plus ``data.task.<key>``: size and blake2b of each file a ``task.<key>`` names."""
    cfg = OmegaConf.merge(cfg, {"seed": 0})
    out = _flat({key: plain(cfg[key]) for key in ("task", "reward", "model")})
    for key, value in plain(cfg.task).items():
        if isinstance(value, str) and (path := Path(value).expanduser()).is_file():
            with path.open("rb") as f:  # streamed
                digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
            out[f"data.task.{key}"] = f"{path.stat().st_size} bytes, blake2b {digest}"
    return json.loads(json.dumps(out, default=str))


def check_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Unless ``resume=false``, a `JobError` if a run in ``run_dir`` has another fingerprint."""
    saved_runs = [p for p in sorted(Path(run_dir).rglob(FINGERPRINT)) if (p.parent / "checkpoints").is_dir()]
    current = fingerprint(cfg) if cfg.resume and saved_runs else {}
    for path in saved_runs if current else []:
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise JobError(f"{path} cannot be read ({one_line(exc)[:120]}); {_FIX}") from None
        for key in [*current, *(k for k in saved if k not in current)]:  # task, reward, model, data
            old, new = (repr(side[key]) if key in side else "absent" for side in (saved, current))
            if old != new:
                what = "the file differs" if key.startswith("data.") else f"{old} there, {new} now"
                raise JobError(
                    f"{path.parent} was trained on another task, dataset or model ({key.removeprefix('data.')}: "
                    f"{what}); run with its settings to resume it, or use another hydra.run.dir"
                )


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def remove_stale_temps(directory: Path) -> None:
    """Delete what a killed save left in ``directory``: the temp files `AtomicCheckpointIO`
    writes next to its targets (a process killed mid-save cannot remove its own)."""
    for path in Path(directory).glob(".*.tmp-*"):
        path.unlink(missing_ok=True)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into a temp file next to the target, then ``os.replace`` over it.

    Lightning's own save writes its temp file in ``$TMPDIR`` and moves it over the target, a copy
    when ``$TMPDIR`` is on another filesystem (usual on clusters): a kill during that copy leaves a
    truncated ``last.ckpt``. Here the rename is within one directory, so a kill at any point leaves
    the old or the new checkpoint whole; a temp file a kill leaves is deleted by the next save and
    when the run resumes.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` atomically (``storage_options`` is refused, as by Lightning's).

        Args:
            checkpoint: the state Lightning dumps.
            path: the target file.
            storage_options: must be None.

        Raises:
            TypeError: ``storage_options`` is given.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target.parent)
        temp = _temp_name(target)
        try:
            with temp.open("wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)


class RunCheckpoint(ModelCheckpoint):
    """``<run>/checkpoints/last.ckpt`` after every step, and the run's fingerprint beside it.
    Single-file checkpoints are written by `AtomicCheckpointIO` unless the strategy was given
    a checkpoint IO of its own."""

    def __init__(self, out_dir: Path, cfg: DictConfig) -> None:
        super().__init__(
            out_dir / "checkpoints", "last", save_top_k=1, every_n_epochs=1, enable_version_counter=False
        )
        self.path, self.fingerprint = out_dir / FINGERPRINT, fingerprint(cfg)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: not atomic
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if trainer.is_global_zero and not self.path.exists():
            self.path.write_text(json.dumps(self.fingerprint, indent=1) + "\n")


def _saved_shapes(last: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """``({parameter: shape}, steps done)`` of a ``torch.save``d file (memory-mapped) or a
    ``ModelParallelStrategy`` checkpoint folder (``.metadata``, ``meta.pt``), tensors unread."""
    if last.is_dir():
        metadata = FileSystemReader(str(last)).read_metadata().state_dict_metadata
        tensors = {
            k.removeprefix("state_dict."): v for k, v in metadata.items() if k.startswith("state_dict.")
        }
        shapes = {k: tuple(v.size) for k, v in tensors.items() if hasattr(v, "size")}
        return shapes, int(torch.load(last / "meta.pt", map_location="cpu", weights_only=False)["epoch"]) + 1
    state = torch.load(last, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise ValueError("not a Lightning checkpoint")
    shapes = {k: tuple(v.shape) for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}
    return shapes, int(state["epoch"]) + 1


def resume_checkpoint(cfg: DictConfig, out_dir: Path, module) -> str | None:
    """``<run>/checkpoints/last.ckpt`` if ``resume`` and it exists, once checked to be readable, saved
    for this model and no further than ``steps``. Cost: its metadata is read, not its tensors."""
    last = out_dir / "checkpoints" / "last.ckpt"
    if last.parent.is_dir():
        remove_stale_temps(last.parent)
    if not cfg.resume or not last.exists():
        return None
    try:
        saved, done = _saved_shapes(last)
    except Exception as exc:
        raise JobError(
            f"checkpoint {last} cannot be read ({one_line(exc)[:160] or type(exc).__name__}); {_FIX}"
        ) from None
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    if expected != saved:
        key = (sorted(set(expected) ^ set(saved)) or [k for k in expected if expected[k] != saved[k]])[0]
        raise JobError(
            f"checkpoint {last} was saved for another model ({key}: {saved.get(key, 'absent')} in the "
            f"checkpoint, {expected.get(key, 'absent')} in this model); {_FIX}"
        )
    if int(cfg.steps) < done:
        raise JobError(
            f"steps={int(cfg.steps)} is below the {done} steps this run has done ({last}); "
            f"set steps={done} or more to continue, or {_FIX}"
        )
    return str(last)


def refuse_bad_data_state(datamodule: Any, ckpt_path: str) -> None:
    """Lightning restores ``datamodule`` inside ``fit``, after every up-front check: a state its
    ``load_state_dict`` refuses (a tampered or foreign checkpoint) becomes a one-line `JobError`."""
    restore = datamodule.load_state_dict

    def load_state_dict(state: Any) -> None:
        try:
            restore(state)
        except (TypeError, ValueError, KeyError) as exc:
            raise JobError(
                f"checkpoint {ckpt_path}: its data module state is refused ({one_line(exc)[:200]}); {_FIX}"
            ) from None

    datamodule.load_state_dict = load_state_dict
