"""The main job's entry point, ``r3lightning-train`` (= ``python -m r3lightning.app.job.main``): a
standard ``@hydra.main`` over the structured config of `r3lightning.app.job.store`, so ``-m`` runs
through Hydra's sweeper and any launcher plugin. Each failure is one line and an exit status
(docs/job.md); `JobCallback` checks values before Hydra writes."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from r3lightning.app.job import help as _help  # noqa: F401  (registers the help template's resolver)
from r3lightning.app.job.arms import arms, run_seeds
from r3lightning.app.job.common import JobError, is_global_zero
from r3lightning.app.job.config_errors import error_line
from r3lightning.app.job.hooks import (
    PROG,
    discard_unused_sweep,
    new_folders,
    record_job,
    remove_if_unused,
    report,
)
from r3lightning.app.job.store import CONF_DIR, register

__all__ = ["arms", "compose_config", "main", "run", "run_seeds", "train"]

register()  # the schema conf/config.yaml starts from, before Hydra composes


def run(cfg: DictConfig, run_dir: Path) -> dict[str, list[dict[str, float]]]:
    """Run every arm of ``compare`` for every seed into ``run_dir``, then write the summary.

    Every arm's values are checked first, before torch is imported; then the arms' run folders
    are checked against their fingerprints. Arms with the same rollout and model settings share
    one engine. Rank 0 writes ``config.yaml`` (with the environment line), ``summary.txt`` and,
    with ``plot``, ``metrics.png``. Cost: imports torch, Lightning and the model's modules once
    the values passed; starts the engines and trains.

    Args:
        cfg: the composed job config.
        run_dir: the output folder (Hydra's ``runtime.output_dir``).

    Returns:
        ``{run name: history}``, named ``<arm>`` (one seed) or ``<arm>/seed=<s>`` (folder
        ``<arm>/seed_<s>``, ``=`` written ``_``).

    Raises:
        JobError: a refused value, or a run folder of another task, dataset or model.
    """
    configs = arms(cfg)  # every value refused before torch is imported (a sweep's job too)
    seeds = run_seeds(cfg)
    from r3lightning.app.job.engine import embedded_server
    from r3lightning.app.job.report import environment, environment_line, format_table, plot_runs
    from r3lightning.app.job.run_dir import check_run_dir
    from r3lightning.app.job.setup import model_runtime, train_one

    for arm, arm_cfg in configs.items():  # before config.yaml is rewritten
        check_run_dir(arm_cfg, run_dir / arm.replace("=", "_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_global_zero():
        env = f"# {environment_line(environment())}\n"
        (run_dir / "config.yaml").write_text(env + OmegaConf.to_yaml(cfg, resolve=True))
    runs: dict[str, list[dict[str, float]]] = {}
    with model_runtime(cfg.model), contextlib.ExitStack() as stack:
        engines = {}  # one engine per distinct rollout and model settings
        for seed in seeds:
            for arm, arm_cfg in configs.items():
                key = OmegaConf.to_yaml({"rollout": arm_cfg.rollout, "model": arm_cfg.model})
                if key not in engines:
                    engines[key] = stack.enter_context(embedded_server(arm_cfg))
                name = arm if len(seeds) == 1 else f"{arm}/seed={seed}"
                seeded = OmegaConf.merge(arm_cfg, {"seed": seed})
                runs[name] = train_one(seeded, run_dir / name.replace("=", "_"), engines[key])
    if is_global_zero():
        band = float(cfg.algorithm.ratio_band)
        table = format_table(runs, band, env=environment())
        (run_dir / "summary.txt").write_text(table + "\n")
        print("\n" + table)
        if cfg.plot:
            plot_runs(run_dir / "metrics.png", runs, band)
            print(f"\nplot: {run_dir / 'metrics.png'}\nrun directory: {run_dir}")
    return runs


def _run_in(cfg: DictConfig, run_dir: Path, overrides: list[str], label: str, new_dirs: list[Path]) -> int:
    """Run ``cfg`` into ``run_dir``; every failure the user can act on is one line and a status."""
    from r3lightning.wire.errors import RemoteGenerateError

    try:
        run(cfg, run_dir)
        return 0
    except JobError as exc:
        return report(exc, label)
    except OmegaConfBaseException as exc:
        return report(error_line(exc), label)
    except RemoteGenerateError as exc:
        return report(exc, label, "rollout engine error", status=3)
    except KeyboardInterrupt:
        again = [PROG, *overrides, f"hydra.run.dir={run_dir}"]
        if any(run_dir.glob("**/checkpoints/last.ckpt")):
            state = "the checkpoint keeps the last finished step, resume"
        else:
            state = "no step had finished, start again"
        print(f"{PROG}: {label}interrupted; {state} with: {' '.join(again)}", file=sys.stderr)
        return 130
    finally:
        if is_global_zero():
            remove_if_unused(run_dir, new_dirs)


def compose_config(
    overrides: list[str] | None = None,
    *,
    config_dir: str | Path | None = None,
    config_name: str = "config",
    hydra_config: bool = False,
) -> DictConfig:
    """The job's config as Hydra composes it, without running it (tests, notebooks).

    Args:
        overrides: command-line overrides (``steps=2``, ``replay=off``).
        config_dir: a folder searched before the package's configs, as ``--config-dir``.
        config_name: the primary config's name.
        hydra_config: keep the ``hydra`` node (needed where Hydra's resolvers are used).

    Returns:
        The composed config; nothing is checked beyond what Hydra's structured config refuses.

    Raises:
        HydraException: a config Hydra cannot compose (OmegaConf's errors as its cause).
    """
    search_path: list[str] = []
    if config_dir:
        search_path = [f"hydra.searchpath=[file://{Path(config_dir).expanduser().resolve()}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, [*search_path, *(overrides or [])], return_hydra_config=hydra_config)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def train(cfg: DictConfig) -> int:
    """Hydra's task function: one job (a run, or one job of a sweep) into Hydra's output folder.

    Args:
        cfg: the config Hydra composed (its ``hydra`` node is read through ``HydraConfig``).

    Returns:
        The job's exit status (0, 2 a refused config, 3 an engine failure, 130 interrupted). A run
        exits with it; a sweep's job records it and the sweep goes on (see ``JobCallback``).

    Raises:
        SystemExit: a run that failed, with its status; a sweep's job only when interrupted (130),
            which stops the sweep.
    """
    # Lightning's banner lines (accelerator summary, logger tips) are noise here.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        status = _run_in(cfg, run_dir, overrides, "", new_folders())
        if status:
            sys.exit(status)
        return 0
    number = int(hydra_cfg.job.num)
    status = _run_in(
        cfg, run_dir, overrides, f"job #{number} ({' '.join(overrides)}): ", [run_dir.absolute()]
    )
    record_job(Path(hydra_cfg.sweep.dir).absolute(), number, overrides, status)
    if status == 130:
        sys.exit(130)
    return status


def _raised_by_hydra(exc: BaseException) -> bool:
    """Whether ``exc`` is Hydra's or OmegaConf's, or raised inside them (a ``ValueError`` of Hydra's
    defaults list); the task function reports its own errors."""
    if isinstance(exc, HydraException | OmegaConfBaseException):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = "" if tb is None else str(tb.tb_frame.f_globals.get("__name__", ""))
    return module.split(".")[0] in ("hydra", "omegaconf")


def main() -> None:
    """Console entry point (``r3lightning-train``): Hydra parses the command line.

    ``HYDRA_FULL_ERROR`` is set while Hydra runs, so that Hydra raises its composition errors here
    instead of printing them, and restored after.

    Raises:
        SystemExit: 2 with one line for a config Hydra cannot compose (wrong type, unknown key,
            moved key, missing option); ``HYDRA_FULL_ERROR=1`` re-raises Hydra's own error instead.
            Otherwise `train`'s status.
    """
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its composition errors to this function
    try:
        train()
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        if full_error == "1" or not _raised_by_hydra(exc):
            raise
        discard_unused_sweep()  # a sweep refused before its first job
        sys.exit(report(error_line(exc)))
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error


if __name__ == "__main__":
    main()
