"""The main job: GRPO training of a causal MoE with Rollout Routing Replay, configured by Hydra.

    python -m r3lightning.job.main                          # tiny Qwen3-MoE, embedded engine, R3
    python -m r3lightning.job.main experiment=compare       # replay on and off, side by side
    python -m r3lightning.job.main replay=off steps=10
    python -m r3lightning.job.main rollout.url=http://host:30000 rollout.protocol=sglang
    r3lightning-train ...                                   # the same, as a console script

Per RL step (one Lightning epoch): the rollout engine (bf16, the embedded ``RolloutServer`` by
default) samples a group of responses per prompt and returns the experts it routed every token
to; trajectories go through ``RoutedExpertTrace`` into the ``ReplayBuffer``; ``R3DataModule``
collates them with packed routes; ``RouterReplayCallback`` installs the routes so the fp32
training forward uses the engine's experts; the updated weights go back to the engine.

Outputs land in Hydra's run directory: ``config.yaml`` (resolved), per run ``<name>/metrics.csv``
and ``<name>/checkpoints/last.ckpt`` (a rerun with the same ``hydra.run.dir`` resumes from it),
``summary.txt`` (the final table) and ``metrics.png``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from .setup import CONF_DIR, JobError, is_global_zero


def run(cfg: DictConfig, run_dir: Path) -> dict[str, list[dict[str, float]]]:
    """Run the job described by ``cfg`` into ``run_dir``; returns ``{run name: history}``."""
    from .engine import embedded_server
    from .report import format_table, plot_runs
    from .setup import check_config, replay_settings, train_one

    check_config(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    modes = [str(m) for m in cfg.compare] or [str(cfg.replay.mode)]
    if is_global_zero():
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    runs: dict[str, list[dict[str, float]]] = {}
    with embedded_server(cfg) as engine:
        for mode in modes:
            run_cfg = cfg if not cfg.compare else replay_settings(cfg, mode)
            name = f"replay={mode}"
            runs[name] = train_one(run_cfg, run_dir / name.replace("=", "_"), engine)
    if is_global_zero():
        band = float(cfg.algorithm.ratio_band)
        table = format_table(runs, band)
        (run_dir / "summary.txt").write_text(table + "\n")
        print("\n" + table)
        if cfg.plot:
            plot_runs(run_dir / "metrics.png", runs, band)
            print(f"\nplot: {run_dir / 'metrics.png'}\nrun directory: {run_dir}")
    return runs


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _task(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..rollout.errors import RemoteGenerateError

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run(cfg, run_dir)
    except JobError as exc:
        print(f"r3lightning-train: error: {_one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except MissingMandatoryValue as exc:
        key = exc.full_key or "a required value"
        print(
            f"r3lightning-train: error: {key} must be set (add {key}=... to the command line)",
            file=sys.stderr,
        )
        sys.exit(2)
    except RemoteGenerateError as exc:
        print(f"r3lightning-train: rollout engine error: {_one_line(exc)}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:
        print("r3lightning-train: interrupted; rerun with the same hydra.run.dir to resume", file=sys.stderr)
        sys.exit(130)


def _hydra_message(exc: BaseException) -> str:
    """Hydra's multi-line composition error as one line (the search-path dump dropped)."""
    text = str(exc).split("Config search path")[0].split("full_key:")[0]
    text = text.replace(":\n\t", ": ").replace("\n\t", ", ")
    return _one_line(text)


def _check_overrides(args: list[str]) -> str | None:
    """Compose the config with the command-line overrides once, before Hydra does, to report a
    bad override as one line. Hydra's own flags and ``hydra.*`` overrides are left to Hydra."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(a.startswith("-") for a in args):
        return None
    overrides = [a for a in args if not a.lstrip("+~").startswith(("hydra.", "hydra/", "hydra="))]
    try:
        compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        return _hydra_message(exc)
    return None


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``r3lightning-train``): Hydra parses the command-line overrides."""
    import hydra

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    problem = _check_overrides(sys.argv[1:])
    if problem is not None:
        print(f"r3lightning-train: error: {problem}", file=sys.stderr)
        sys.exit(2)
    # Lightning's banner lines (accelerator summary, logger tips) are noise here.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_task)()


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The job's config with ``overrides`` applied, without running it (tests, notebooks)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []))


if __name__ == "__main__":
    main()
