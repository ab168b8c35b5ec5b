"""Resuming a run from ``<run>/checkpoints/last.ckpt``, refused in one line when it cannot work."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from r3lightning.job.build import JobError


def _saved_shapes(last: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """``({parameter name: shape}, steps done)`` of a checkpoint, without reading its tensors.

    A file is a ``torch.save``d Lightning checkpoint (opened memory-mapped); a folder is the
    distributed checkpoint of ``ModelParallelStrategy`` (FSDP2): global shapes from its
    ``.metadata``, the epoch from Lightning's ``meta.pt``.
    """
    if last.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(last)).read_metadata().state_dict_metadata
        meta = torch.load(last / "meta.pt", map_location="cpu", weights_only=False)
        prefix = "state_dict."
        shapes = {
            k[len(prefix) :]: tuple(v.size)
            for k, v in metadata.items()
            if k.startswith(prefix) and hasattr(v, "size")
        }
        return shapes, int(meta["epoch"]) + 1
    state = torch.load(last, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise ValueError("not a Lightning checkpoint")
    shapes = {k: tuple(v.shape) for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor)}
    return shapes, int(state["epoch"]) + 1


def resume_checkpoint(cfg: DictConfig, out_dir: Path, module) -> str | None:
    """``<run>/checkpoints/last.ckpt`` when ``resume`` and it exists, after checking that it can be
    read, was saved for this model and has no more steps done than ``steps`` asks for.

    Cost: the checkpoint's metadata is read (tensors are not) before Lightning loads it.
    """
    last = out_dir / "checkpoints" / "last.ckpt"
    if not cfg.resume or not last.exists():
        return None
    fix = "delete it to start this run over, or set resume=false or another hydra.run.dir"
    try:
        saved, done = _saved_shapes(last)
    except Exception as exc:
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise JobError(f"checkpoint {last} cannot be read ({reason}); {fix}") from None
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    if expected != saved:
        diff = sorted(set(expected) ^ set(saved)) or [k for k in expected if expected[k] != saved[k]]
        key = diff[0]
        raise JobError(
            f"checkpoint {last} was saved for another model ({key}: {saved.get(key, 'absent')} in the "
            f"checkpoint, {expected.get(key, 'absent')} in this model); {fix}"
        )
    if int(cfg.steps) < done:
        raise JobError(
            f"steps={int(cfg.steps)} is below the {done} steps this run has done ({last}); "
            f"set steps={done} or more to continue, or {fix}"
        )
    return str(last)
