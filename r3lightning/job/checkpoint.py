"""A run's checkpoint and fingerprint, and resuming from them (refused in one line when it cannot work).

Every run keeps ``<run>/checkpoints/last.ckpt`` (rewritten after every step) and, from its first
checkpoint on, ``<run>/fingerprint.json``: the resolved ``task``, ``reward`` and ``model``
settings and a digest of every data file a ``task.*`` setting names. A rerun into the same run
directory resumes from a run only when its fingerprint matches: another task, dataset or model
is refused before anything in the directory is written.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from r3lightning.job.build import JobError, plain

FINGERPRINT = "fingerprint.json"
_FIX = "delete it to start this run over, or set resume=false or another hydra.run.dir"


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """blake2b of a file's bytes (read in 1 MiB blocks), cached per (path, size, mtime)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"{size} bytes, blake2b {digest.hexdigest()}"


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flat(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """``{dotted key: value}`` of the resolved ``task``, ``reward`` and ``model`` settings, plus
    ``data.task.<key>`` (size and digest) of each file a ``task.<key>`` names, JSON-normalised.
    Cost: each such file is read once per process (then cached by size and mtime)."""
    out = _flat({key: plain(cfg[key]) for key in ("task", "reward", "model")}, "", {})
    for key, value in plain(cfg.task).items():
        path = Path(str(value)).expanduser()
        if isinstance(value, str) and path.is_file():
            stat = path.stat()
            out[f"data.task.{key}"] = _file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    return json.loads(json.dumps(out, default=str))


def check_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse (:class:`JobError`) to resume into ``run_dir`` when one of its runs with a checkpoint
    was made for another task, dataset or model. Nothing is written; ``resume=false`` skips it."""
    saved_runs = [
        p for p in sorted(Path(run_dir).glob(f"*/{FINGERPRINT}")) if (p.parent / "checkpoints").is_dir()
    ]
    if not cfg.resume or not saved_runs:
        return
    current = fingerprint(cfg)
    for path in saved_runs:
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise JobError(f"{path} cannot be read ({' '.join(str(exc).split())[:120]}); {_FIX}") from None
        for key in [*current, *(k for k in saved if k not in current)]:  # task, reward, model, data
            old, new = (repr(side[key]) if key in side else "absent" for side in (saved, current))
            if old != new:
                what = "the file differs" if key.startswith("data.") else f"{old} there, {new} now"
                raise JobError(
                    f"{path.parent} was trained on another task, dataset or model ({key.removeprefix('data.')}: "
                    f"{what}); run with its settings to resume it, or use another hydra.run.dir"
                )


class RunCheckpoint(ModelCheckpoint):
    """``<run>/checkpoints/last.ckpt`` after every step, and the run's fingerprint beside it."""

    def __init__(self, out_dir: Path, cfg: DictConfig) -> None:
        super().__init__(
            out_dir / "checkpoints", "last", save_top_k=1, every_n_epochs=1, enable_version_counter=False
        )
        self.fingerprint_path, self._fingerprint = out_dir / FINGERPRINT, fingerprint(cfg)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if trainer.is_global_zero and not self.fingerprint_path.exists():
            self.fingerprint_path.write_text(json.dumps(self._fingerprint, indent=1) + "\n")


def _saved_shapes(last: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """``({parameter name: shape}, steps done)`` of a checkpoint, without reading its tensors: a
    file is a ``torch.save``d Lightning checkpoint (opened memory-mapped); a folder the distributed
    checkpoint of ``ModelParallelStrategy`` (global shapes from ``.metadata``, the epoch from
    Lightning's ``meta.pt``)."""
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
    read, was saved for this model and has no more steps done than ``steps`` asks for. Cost: the
    checkpoint's metadata is read (tensors are not) before Lightning loads it."""
    last = out_dir / "checkpoints" / "last.ckpt"
    if not cfg.resume or not last.exists():
        return None
    try:
        saved, done = _saved_shapes(last)
    except Exception as exc:
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise JobError(f"checkpoint {last} cannot be read ({reason}); {_FIX}") from None
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
