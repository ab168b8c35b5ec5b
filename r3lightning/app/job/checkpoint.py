"""A run's ``last.ckpt``, saved atomically, and resuming from it (docs/job.md, Outputs); the run's
``fingerprint.json`` is checked in `r3lightning.app.job.run_dir`."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig
from torch.distributed.checkpoint import FileSystemReader

from r3lightning.app.job.common import JobError, one_line
from r3lightning.app.job.run_dir import FINGERPRINT, START_OVER, fingerprint

__all__ = [
    "AtomicCheckpointIO",
    "RunCheckpoint",
    "publish_folder",
    "refuse_bad_data_state",
    "remove_stale_temps",
    "resume_checkpoint",
    "saves_a_folder",
]


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _remove(path: Path) -> None:
    """Delete a file, a link or a folder; what another process deleted first is not an error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _versions(link: Path) -> list[Path]:
    """The checkpoint folders ``link`` may point at (`publish_folder` writes them next to it)."""
    return sorted(link.parent.glob(f".{link.name}.v-*"))


def remove_stale_temps(directory: Path) -> None:
    """Delete what a killed save left in ``directory``, and finish a folder swap a kill interrupted.

    A killed process cannot remove its own temp files: `AtomicCheckpointIO`'s ``.<name>.tmp-<pid>``
    files, and the checkpoint folders (``.<name>.v-*``) that no ``<name>`` link points at, half
    written or replaced (`publish_folder`). A ``<name>`` folder that a kill moved aside while it
    was being replaced by a link (``.<name>.v-moved``) is linked back first.

    Safe to run from several ranks at once. Cost: one directory listing; deleted folders are freed.

    Args:
        directory: a checkpoint directory (``<run>/checkpoints``); absent is fine.
    """
    directory = Path(directory)
    for path in directory.glob(".*.tmp-*"):
        _remove(path)
    for moved in directory.glob(".*.v-moved"):
        link = directory / moved.name.removeprefix(".").removesuffix(".v-moved")
        if not os.path.lexists(link):
            _point(link, moved)
    # every <name> that has version folders: ".<name>.v-<random>" without the dot and the suffix
    links = {directory / v.name[1:].partition(".v-")[0] for v in directory.glob(".*.v-*")}
    for link in links:
        target = Path(os.readlink(link)).name if link.is_symlink() else None
        for version in _versions(link):
            if version.name != target:
                _remove(version)


def _point(link: Path, folder: Path) -> None:
    """Make ``link`` a relative symlink to ``folder`` (its sibling) in one rename: a reader sees the
    old target or the new one, never no ``link``."""
    temp = _temp_name(link)
    temp.unlink(missing_ok=True)
    os.symlink(folder.name, temp)
    os.replace(temp, link)
    _fsync(link.parent)  # the rename itself survives a power loss


def new_version(target: Path) -> Path:
    """A fresh folder name for the next checkpoint of ``target``; nothing is created.

    Args:
        target: the path a resume names (``<run>/checkpoints/last.ckpt``).

    Returns:
        ``.<name>.v-<12 random hex digits>`` beside ``target`` (what `remove_stale_temps` knows).
    """
    return target.with_name(f".{target.name}.v-{uuid.uuid4().hex[:12]}")


def publish_folder(target: Path, folder: Path) -> None:
    """Point ``target`` at the whole checkpoint ``folder`` and delete the one it replaces.

    ``target`` becomes a symlink in one ``os.replace``, so a kill at any point leaves it naming the
    old checkpoint or the new one, both whole; Lightning resumes through the link. A ``target``
    that is still a real folder (saved before links were used) is first moved aside as
    ``.<name>.v-moved``, which `remove_stale_temps` links back if a kill comes before the link.

    Args:
        target: the path a resume names (``<run>/checkpoints/last.ckpt``).
        folder: the new checkpoint, a sibling of ``target``, completely written.
    """
    for path in folder.rglob("*"):
        if path.is_file():
            _fsync(path)  # the bytes are on disk before a name points at them
    _fsync(folder)
    if target.is_dir() and not target.is_symlink():
        moved = target.with_name(f".{target.name}.v-moved")
        os.rename(target, moved)
    _point(target, folder)
    remove_stale_temps(target.parent)


def saves_a_folder(strategy: Any) -> bool:
    """Whether ``strategy.save_checkpoint`` writes a folder (a distributed checkpoint) rather than a
    file.

    Args:
        strategy: the Trainer's strategy.

    Returns:
        True for ``ModelParallelStrategy`` (FSDP2) saving a distributed checkpoint (its default)
        and for ``FSDPStrategy`` with sharded state dicts.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return bool(strategy._save_distributed_checkpoint)
    return isinstance(strategy, FSDPStrategy) and strategy._state_dict_type == "sharded"


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
        _fsync(target.parent)  # the rename itself survives a power loss


class RunCheckpoint(ModelCheckpoint):
    """``<run>/checkpoints/last.ckpt`` after every step, and the run's fingerprint beside it.

    A kill at any point of a save leaves the previous checkpoint or the new one whole:

    - a single file is written by `AtomicCheckpointIO` (unless the strategy was given a checkpoint
      IO of its own);
    - a folder (FSDP2's distributed checkpoint, see `saves_a_folder`) is written by every rank into
      a fresh sibling folder, then rank 0 repoints the ``last.ckpt`` symlink at it
      (`publish_folder`) and deletes the previous one. What a kill leaves is deleted by the next
      save and when the run resumes (`remove_stale_temps`).

    Args:
        out_dir: the run's folder; the checkpoint goes to ``out_dir/checkpoints``.
        cfg: the job's resolved config, fingerprinted into ``out_dir/fingerprint.json``.
    """

    def __init__(self, out_dir: Path, cfg: DictConfig) -> None:
        super().__init__(
            out_dir / "checkpoints", "last", save_top_k=1, every_n_epochs=1, enable_version_counter=False
        )
        self.path = out_dir / FINGERPRINT
        self.fingerprint = fingerprint(cfg)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Lightning's setup; Lightning's default checkpoint IO is swapped for `AtomicCheckpointIO`."""
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: not atomic
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Rank 0 writes ``fingerprint.json`` with the first checkpoint (a resumed run keeps it)."""
        if trainer.is_global_zero and not self.path.exists():
            self.path.write_text(json.dumps(self.fingerprint, indent=1) + "\n")

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """Lightning's save, into a fresh folder published by rank 0 when the strategy saves folders.

        Syncs: a broadcast of the folder's name and a barrier after the link moved, on top of the
        strategy's own collectives.
        """
        if not saves_a_folder(trainer.strategy):
            super()._save_checkpoint(trainer, filepath)
            return
        target = Path(filepath)
        if trainer.is_global_zero:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(target.parent)  # before the new folder exists: it is not stale
        folder = Path(trainer.strategy.broadcast(str(new_version(target))))  # rank 0's name on every rank
        super()._save_checkpoint(trainer, str(folder))  # ends with a barrier: every shard is written
        if trainer.is_global_zero:
            publish_folder(target, folder)
        trainer.strategy.barrier("RunCheckpoint.publish_folder")
        self._last_checkpoint_saved = filepath


def _saved_shapes(last: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """``({parameter: shape}, steps done)`` of a ``torch.save``d file (memory-mapped) or a
    ``ModelParallelStrategy`` checkpoint folder (``.metadata``, ``meta.pt``), tensors unread."""
    if last.is_dir():
        metadata = FileSystemReader(str(last)).read_metadata().state_dict_metadata
        tensors = {
            k.removeprefix("state_dict."): v for k, v in metadata.items() if k.startswith("state_dict.")
        }
        shapes = {k: tuple(v.size) for k, v in tensors.items() if hasattr(v, "size")}
        meta = torch.load(last / "meta.pt", map_location="cpu", weights_only=False)
        return shapes, int(meta["epoch"]) + 1
    state = torch.load(last, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise ValueError("not a Lightning checkpoint")
    shapes = {k: tuple(v.shape) for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}
    return shapes, int(state["epoch"]) + 1


def resume_checkpoint(cfg: DictConfig, out_dir: Path, module) -> str | None:
    """The checkpoint a run resumes from, checked before ``fit`` starts.

    What a killed save left in ``<run>/checkpoints`` is deleted first, with or without ``resume``.
    Cost: the checkpoint's metadata is read (a file is memory-mapped), not its tensors.

    Args:
        cfg: the run's config (``resume``, ``steps``).
        out_dir: the run's folder.
        module: the Lightning module to resume, whose ``state_dict`` shapes the checkpoint must have.

    Returns:
        ``<run>/checkpoints/last.ckpt`` if ``resume`` and it exists, else None.

    Raises:
        JobError: the checkpoint cannot be read, was saved for another model (naming the first
            differing parameter), or has done more steps than ``steps``.
    """
    last = out_dir / "checkpoints" / "last.ckpt"
    if last.parent.is_dir():
        remove_stale_temps(last.parent)
    if not cfg.resume or not last.exists():
        return None
    try:
        saved, done = _saved_shapes(last)
    except Exception as exc:
        raise JobError(
            f"checkpoint {last} cannot be read ({one_line(exc)[:160] or type(exc).__name__}); {START_OVER}"
        ) from None
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    if expected != saved:
        # a parameter one side lacks, else the first one whose shape differs
        one_sided = sorted(set(expected) ^ set(saved))
        key = one_sided[0] if one_sided else next(k for k in expected if expected[k] != saved[k])
        raise JobError(
            f"checkpoint {last} was saved for another model ({key}: {saved.get(key, 'absent')} in the "
            f"checkpoint, {expected.get(key, 'absent')} in this model); {START_OVER}"
        )
    if int(cfg.steps) < done:
        raise JobError(
            f"steps={int(cfg.steps)} is below the {done} steps this run has done ({last}); "
            f"set steps={done} or more to continue, or {START_OVER}"
        )
    return str(last)


def refuse_bad_data_state(datamodule: Any, ckpt_path: str) -> None:
    """Make a data-module state that ``datamodule`` refuses a one-line `JobError`.

    Lightning restores the data module inside ``fit``, after every up-front check, so a tampered
    or foreign checkpoint would otherwise fail there with a traceback.

    Args:
        datamodule: the run's data module; its ``load_state_dict`` is wrapped in place.
        ckpt_path: the checkpoint being resumed, named in the message.
    """
    restore = datamodule.load_state_dict

    def load_state_dict(state: Any) -> None:
        try:
            restore(state)
        except (TypeError, ValueError, KeyError) as exc:
            raise JobError(
                f"checkpoint {ckpt_path}: its data module state is refused ({one_line(exc)[:200]}); {START_OVER}"
            ) from None

    datamodule.load_state_dict = load_state_dict
