"""The job's Hydra callback (``hydra.callbacks.r3lightning`` in ``conf/config.yaml``) and the one
line every failure prints.

- ``on_run_start`` checks the command line's true/false literals and every arm's values (and a
  resumed run folder's fingerprints) before Hydra makes the run folder, so a bad value is one
  line, exit status 2, and leaves no folder behind, before torch is imported.
- In a sweep (``-m``), ``on_multirun_start`` checks the true/false literals of every swept value;
  each job checks its own values and records its exit status in the sweep folder;
  ``on_multirun_end`` prints one line listing the failed jobs and exits 2 when any failed,
  whichever launcher ran them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from r3lightning.app.job.common import JobError, one_line

__all__ = [
    "PROG",
    "JobCallback",
    "discard_unused_sweep",
    "new_folders",
    "record_job",
    "remove_if_unused",
    "report",
]

PROG = "r3lightning-train"
_RECORDS = ".r3lightning-jobs"  # in the sweep folder: one file per job, its status and overrides
_state: dict[str, Any] = {"new_dirs": [], "sweep_is_new": False}


def report(message: BaseException | str, label: str = "", kind: str = "error", status: int = 2) -> int:
    """Print ``message`` as the one line (at most 400 characters) of a failed run; returns ``status``."""
    text = one_line(message)
    print(f"{PROG}: {label}{kind}: {text if len(text) <= 400 else text[:397] + '...'}", file=sys.stderr)
    return status


def new_folders() -> list[Path]:
    """The folders this run's ``on_run_start`` found missing (its run folder, then its parents)."""
    return list(_state["new_dirs"])


def remove_if_unused(run_dir: Path, new_dirs: list[Path]) -> None:
    """Remove ``run_dir`` if it is in ``new_dirs`` (deepest first) and holds only what a run that never
    trained writes (``.hydra/``, logs, ``config.yaml``), then the other new folders left empty."""
    run_dir = run_dir.absolute()

    def disposable(path: Path) -> bool:
        if path.is_dir():
            return path.name == ".hydra" or all(disposable(p) for p in path.iterdir())
        return path.suffix == ".log" or (path.parent == run_dir and path.name == "config.yaml")

    if run_dir in new_dirs and run_dir.is_dir() and all(disposable(p) for p in run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in new_dirs[new_dirs.index(run_dir) + 1 :]:
            if not parent.is_dir() or any(parent.iterdir()):
                break
            parent.rmdir()


def record_job(sweep_dir: Path, number: int, overrides: list[str], status: int) -> None:
    """Note job ``number``'s exit status in the sweep folder (jobs may run in other processes)."""
    folder = sweep_dir / _RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{number}").write_text(f"{status}\n{' '.join(overrides)}\n")


def _missing(path: Path) -> list[Path]:
    path = path.absolute()
    return [p for p in (path, *path.parents) if not p.exists()]


def discard_unused_sweep() -> None:
    """Remove the sweep folder this process's sweep made if no job left anything in it (a sweep
    that failed, or that Hydra refused before its first job), then its new parents left empty."""
    new_dirs = _state["new_dirs"]
    if not _state["sweep_is_new"] or not new_dirs or not new_dirs[0].is_dir():
        return
    if any(p.name != "multirun.yaml" for p in new_dirs[0].iterdir()):
        return
    shutil.rmtree(new_dirs[0], ignore_errors=True)
    for parent in new_dirs[1:]:
        if not parent.is_dir() or any(parent.iterdir()):
            break
        parent.rmdir()


class JobCallback(Callback):
    """Checks before Hydra writes anything, and the sweep's summary (see the module docstring)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from r3lightning.app.job.arms import arms
        from r3lightning.app.job.validate import check_bool_overrides

        try:
            run_dir = Path(str(config.hydra.run.dir)).absolute()
            task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            check_bool_overrides(task_cfg, list(config.hydra.overrides.task))
            configs = arms(task_cfg, targets=False)
            if run_dir.exists():  # a resumed folder: refused now if it holds another task's run
                from r3lightning.app.job.checkpoint import check_run_dir

                for arm, arm_cfg in configs.items():
                    check_run_dir(arm_cfg, run_dir / arm.replace("=", "_"))
        except JobError as exc:
            sys.exit(report(exc))
        except OmegaConfBaseException as exc:  # an arm's override of the wrong type
            from r3lightning.app.job.validate import error_line

            sys.exit(report(error_line(exc)))
        _state["new_dirs"] = _missing(run_dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from r3lightning.app.job.validate import check_bool_overrides

        try:  # every job's values are checked by the job itself; a sweep's literals only here
            task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            check_bool_overrides(task_cfg, list(config.hydra.overrides.task))
        except JobError as exc:
            sys.exit(report(exc))
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        _state["sweep_is_new"] = not sweep_dir.exists()
        _state["new_dirs"] = _missing(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        records = sweep_dir / _RECORDS
        jobs = sorted(records.glob("*"), key=lambda p: int(p.name)) if records.is_dir() else []
        failed = []
        for path in jobs:
            status, overrides = path.read_text().splitlines()[:2]
            if status != "0":
                failed.append(f"#{path.name} ({overrides})")
        shutil.rmtree(records, ignore_errors=True)
        discard_unused_sweep()  # nothing trained: no folder left
        if failed:
            print(f"{PROG}: {len(failed)} of {len(jobs)} jobs failed: {', '.join(failed)}", file=sys.stderr)
            sys.exit(2)
