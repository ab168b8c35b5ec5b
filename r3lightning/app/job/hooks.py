"""The job's Hydra callback (``hydra.callbacks.r3lightning`` in ``conf/config.yaml``) and the one
line every failure prints.

- ``on_run_start`` checks the true/false literals of the command line and of the YAML files
  composed, and every arm's values (and a resumed run folder's fingerprints) before Hydra makes
  the run folder, so a bad value is one line, exit status 2, and leaves no folder behind, before
  torch is imported.
- In a sweep (``-m``), ``on_multirun_start`` checks the true/false literals of every swept value
  and of the YAML files the fixed overrides compose; each job checks its own values and records
  its exit status in the sweep folder; ``on_multirun_end`` prints one line listing the failed
  jobs and exits 2 when any failed, whichever launcher ran them.
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
    """Print the one line of a failed run on stderr: ``r3lightning-train: <label><kind>: <message>``.

    Args:
        message: the error, or its text; newlines and runs of spaces become one space.
        label: what failed, ending in ``": "`` (a sweep's ``job #3 (...): ``); empty for a run.
        kind: what went wrong (``error``, ``rollout engine error``).
        status: the exit status the caller exits with.

    Returns:
        ``status``, so that ``sys.exit(report(exc))`` reads as one step.
    """
    text = one_line(message)
    if len(text) > 400:  # one terminal line or a few, never a traceback's worth
        text = text[:397] + "..."
    print(f"{PROG}: {label}{kind}: {text}", file=sys.stderr)
    return status


def new_folders() -> list[Path]:
    """The folders this run's ``on_run_start`` found missing.

    Returns:
        A copy: the run folder, then those of its parents that did not exist either (the
        ``new_dirs`` of `remove_if_unused`).
    """
    return list(_state["new_dirs"])


def remove_if_unused(run_dir: Path, new_dirs: list[Path]) -> None:
    """Remove the run folder of a run that never trained, so a refused run leaves nothing behind.

    ``run_dir`` goes only if this run made it and it holds nothing but what a run writes before
    training (``.hydra/``, logs, ``config.yaml``); then each new parent, deepest first, while it
    is empty. A folder that held anything before the run is kept.

    Args:
        run_dir: the run's folder.
        new_dirs: the folders the run made, deepest first (`new_folders`).
    """
    run_dir = run_dir.absolute()

    def disposable(path: Path) -> bool:
        """Whether ``path`` is only what a run writes before it trains."""
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
    """Note a sweep job's exit status in the sweep folder, for ``on_multirun_end``'s summary.

    A file rather than memory: a launcher may run the jobs in other processes or on other hosts.

    Args:
        sweep_dir: the sweep's folder (``hydra.sweep.dir``).
        number: the job's number in the sweep (``hydra.job.num``).
        overrides: the job's overrides, named in the summary.
        status: its exit status (0: done).
    """
    folder = sweep_dir / _RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{number}").write_text(f"{status}\n{' '.join(overrides)}\n")


def _missing(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist, deepest first."""
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
        """Check a run's values, and its folder's fingerprints when it exists, before Hydra makes
        the folder; note which folders the run will make.

        Cost: the torch-free config checks; an existing run folder also imports torch (its
        checkpoint module). Exits 2 with one line on the first refused value.
        """
        from r3lightning.app.job.arms import arms
        from r3lightning.app.job.literals import check_bool_files, check_bool_overrides

        try:
            run_dir = Path(str(config.hydra.run.dir)).absolute()
            task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            check_bool_overrides(task_cfg, list(config.hydra.overrides.task))
            overrides = [*config.hydra.overrides.hydra, *config.hydra.overrides.task]
            check_bool_files(task_cfg, config.hydra.job.config_name, overrides)
            configs = arms(task_cfg, targets=False)
            if run_dir.exists():  # a resumed folder: refused now if it holds another task's run
                from r3lightning.app.job.run_dir import check_run_dir

                for arm, arm_cfg in configs.items():
                    check_run_dir(arm_cfg, run_dir / arm.replace("=", "_"))
        except JobError as exc:
            sys.exit(report(exc))
        except OmegaConfBaseException as exc:  # an arm's override of the wrong type
            from r3lightning.app.job.config_errors import error_line

            sys.exit(report(error_line(exc)))
        _state["new_dirs"] = _missing(run_dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Check the true/false literals of every swept value; note the folders the sweep makes.
        Exits 2 with one line on a refused literal."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from r3lightning.app.job.literals import check_bool_files, check_bool_overrides

        try:  # every job's values are checked by the job itself; a sweep's literals only here
            task_cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            check_bool_overrides(task_cfg, list(config.hydra.overrides.task))
            # the files every job composes: those the overrides but the swept ones choose
            parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
            fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
            check_bool_files(task_cfg, config.hydra.job.config_name, [*config.hydra.overrides.hydra, *fixed])
        except JobError as exc:
            sys.exit(report(exc))
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        _state["sweep_is_new"] = not sweep_dir.exists()
        _state["new_dirs"] = _missing(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Print one line naming the failed jobs and exit 2 if any failed; remove the job records,
        and the sweep folder if no job left anything in it."""
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
