"""A run folder's ``fingerprint.json``: what a saved run trained on, so that a resume with another
task, dataset or model is refused before anything is built. Torch-free: the Hydra callback runs it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from r3lightning.app.job.common import JobError, one_line, plain

__all__ = ["FINGERPRINT", "START_OVER", "check_run_dir", "fingerprint"]

FINGERPRINT = "fingerprint.json"
# how a refusal to resume tells the user to start over
START_OVER = "delete it to start this run over, or set resume=false or another hydra.run.dir"


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: leaf}`` of nested dicts (an empty dict is a leaf)."""
    if not isinstance(value, dict) or not value:
        return {prefix.removesuffix("."): value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}{key}."))
    return out


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """What a run trains on, to refuse resuming it with another task, dataset or model.

    Cost: reads each data file a ``task.<key>`` names once (streamed).

    Args:
        cfg: one run's resolved config.

    Returns:
        ``{dotted key: value}`` of the resolved ``task``, ``reward`` and ``model`` (``seed`` at 0:
        the seeds of one arm live side by side), plus ``data.task.<key>``: the size and blake2b of
        each file a ``task.<key>`` names; JSON values (an object JSON cannot hold as its string).
    """
    cfg = OmegaConf.merge(cfg, {"seed": 0})
    out = _flat({key: plain(cfg[key]) for key in ("task", "reward", "model")})
    for key, value in plain(cfg.task).items():
        if not isinstance(value, str):
            continue
        path = Path(value).expanduser()
        if not path.is_file():
            continue  # a value that names no file is fingerprinted as the value only
        with path.open("rb") as f:  # streamed
            digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
        out[f"data.task.{key}"] = f"{path.stat().st_size} bytes, blake2b {digest}"
    return json.loads(json.dumps(out, default=str))


def check_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    """Refuse to resume a run folder that holds a run of another task, dataset or model.

    Nothing is checked with ``resume=false``. Cost: one folder walk, then `fingerprint` (which
    reads the data files) only when a saved run exists.

    Args:
        cfg: one run's resolved config.
        run_dir: the folder to resume; every ``fingerprint.json`` under it beside a
            ``checkpoints`` folder is compared.

    Raises:
        JobError: a saved fingerprint that cannot be read, or that differs from ``cfg``'s,
            naming the first differing key.
    """
    if not cfg.resume:
        return
    saved_runs = [p for p in sorted(Path(run_dir).rglob(FINGERPRINT)) if (p.parent / "checkpoints").is_dir()]
    if not saved_runs:
        return
    current = fingerprint(cfg)
    for path in saved_runs:
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise JobError(f"{path} cannot be read ({one_line(exc)[:120]}); {START_OVER}") from None
        for key in [*current, *(k for k in saved if k not in current)]:  # task, reward, model, data
            old = repr(saved[key]) if key in saved else "absent"
            new = repr(current[key]) if key in current else "absent"
            if old != new:
                what = "the file differs" if key.startswith("data.") else f"{old} there, {new} now"
                raise JobError(
                    f"{path.parent} was trained on another task, dataset or model ({key.removeprefix('data.')}: "
                    f"{what}); run with its settings to resume it, or use another hydra.run.dir"
                )
