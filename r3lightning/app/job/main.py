"""The main job's entry point, ``r3lightning-train`` (= ``python -m r3lightning.app.job.main``): arms and
seeds, a folder per run, each failure one line and an exit status (docs/job.md)."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from r3lightning.app.job.build import one_line, require
from r3lightning.app.job.common import JobError, is_global_zero
from r3lightning.app.job.help import format_help
from r3lightning.app.job.report import environment, environment_line, format_table, plot_runs
from r3lightning.app.job.setup import CONF_DIR, RULES, check_config, model_runtime, replay_settings, train_one
from r3lightning.wire.errors import RemoteGenerateError

PROG = "r3lightning-train"
_VALUE_FLAGS = {"--config-dir": "-cd", "--config-name": "-cn", "--config-path": "-cp"}  # Hydra's: long, short
_MULTIRUN_FLAGS = ("-m", "--multirun")
_ARM_NAME = re.compile(r"[A-Za-z0-9_.+=,-]+")


def arms(cfg: DictConfig) -> dict[str, DictConfig]:
    """``{arm name: its checked config}`` from ``compare`` (docs/demo.md); none: the arm ``replay=<mode>``."""
    check_config(cfg)
    out: dict[str, DictConfig] = {}
    for index, entry in enumerate(cfg.compare or [None]):
        spec = OmegaConf.to_container(entry) if OmegaConf.is_dict(entry) else {"replay": entry}
        where = f"compare[{index}]"
        mode, overrides = spec.pop("replay", None), spec.pop("overrides", None) or {}
        name = str(spec.pop("name", None) or f"replay={mode or cfg.replay.mode}")
        if spec:
            raise JobError(f"{where}: unknown keys {sorted(spec)}; an arm has name, replay and overrides")
        if mode is not None:
            require(f"{where}.replay", mode, RULES["replay.mode"])
        if not _ARM_NAME.fullmatch(name) or name in out:
            problem = "is used twice" if name in out else "may hold only letters, digits and _.+=,-"
            raise JobError(f"{where}.name {name!r} {problem}")
        if not isinstance(overrides, dict):
            raise JobError(f"{where}.overrides must map dotted config keys to values, got {overrides!r}")
        arm = OmegaConf.merge(cfg if mode is None else replay_settings(cfg, str(mode)), {"compare": []})
        for key, value in overrides.items():
            if OmegaConf.select(arm, str(key), default=KeyError) is KeyError:
                raise JobError(f"{where}.overrides: {key!r} is not a key of the config")
            OmegaConf.update(arm, str(key), value, merge=True)
        try:
            check_config(arm)
        except JobError as exc:
            raise JobError(f"{where} ({name}): {exc}") from None
        out[name] = arm
    return out


def run_seeds(cfg: DictConfig) -> list[int]:
    """``seed``, ``seed + 1``, ... (``seeds`` of them): every arm runs each."""
    return [int(cfg.seed) + i for i in range(require("seeds", cfg.get("seeds", 1), RULES["seeds"]))]


def run(cfg: DictConfig, run_dir: Path) -> dict[str, list[dict[str, float]]]:
    """Run every arm for every seed into ``run_dir``; returns ``{run name: history}``, named ``<arm>``
    (one seed) or ``<arm>/seed=<s>`` (folder ``<arm>/seed_<s>``, ``=`` written ``_``)."""
    from r3lightning.app.job.checkpoint import check_run_dir
    from r3lightning.app.job.engine import embedded_server

    configs, seeds = arms(cfg), run_seeds(cfg)
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
        report = format_table(runs, band, env=environment())
        (run_dir / "summary.txt").write_text(report + "\n")
        print("\n" + report)
        if cfg.plot:
            plot_runs(run_dir / "metrics.png", runs, band)
            print(f"\nplot: {run_dir / 'metrics.png'}\nrun directory: {run_dir}")
    return runs


def _error(message: BaseException | str, label: str = "", kind: str = "error", status: int = 2) -> int:
    """Print ``message`` as the one line (at most 400 characters) of a failed run; returns ``status``."""
    text = one_line(message)
    print(f"{PROG}: {label}{kind}: {text if len(text) <= 400 else text[:397] + '...'}", file=sys.stderr)
    return status


def _remove_if_unused(run_dir: Path, new_dirs: list[Path]) -> None:
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


def _run_in(cfg: DictConfig, run_dir: Path, args: list[str], label: str, new_dirs: list[Path]) -> int:
    """Run ``cfg`` into ``run_dir``; every failure the user can act on is one line and a status."""
    try:
        run(cfg, run_dir)
        return 0
    except JobError as exc:
        return _error(exc, label)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        return _error(f"{key}: {str(exc).splitlines()[0]}" if key else str(exc).splitlines()[0], label)
    except RemoteGenerateError as exc:
        return _error(exc, label, "rollout engine error", status=3)
    except KeyboardInterrupt:
        again = [PROG, *(a for a in args if not a.startswith("hydra.run.dir=")), f"hydra.run.dir={run_dir}"]
        done = any(run_dir.glob("**/checkpoints/last.ckpt"))
        state = ["no step had finished, start again", "the checkpoint keeps the last finished step, resume"]
        print(f"{PROG}: {label}interrupted; {state[done]} with: {' '.join(again)}", file=sys.stderr)
        return 130
    finally:
        if is_global_zero():
            _remove_if_unused(run_dir, new_dirs)


def _hydra_message(exc: BaseException) -> str:
    """Hydra's multi-line composition error, the search-path dump dropped (:func:`_error` joins it)."""
    text = str(exc).split("Config search path")[0].split("full_key:")[0]
    return text.replace(":\n\t", ": ").replace("\n\t", ", ")


def _split_flags(args: list[str]) -> tuple[list[str], list[str], bool, dict[str, str]]:
    """``(flags, overrides, understood, where)``: Hydra flags with their values, overrides, whether the
    pre-check understands every flag (``--cfg`` ...: not), and the ``config_dir`` / ``config_name``."""
    flags, overrides, where, understood = [], [], {}, True
    items = iter(args)
    for arg in items:
        name, eq, value = arg.partition("=")
        flag = next((f for f, short in _VALUE_FLAGS.items() if name in (f, short)), None)
        if flag is not None:
            value = value if eq else next(items, "")
            flags += [arg] if eq else [arg, value]
            if flag != "--config-path":  # --config-dir / --config-name: config_dir / config_name
                where[flag[2:].replace("-", "_")] = value
        elif arg.startswith("-"):
            flags.append(arg)
            understood = False
        else:
            overrides.append(arg)
    return flags, overrides, understood, where


def compose_config(
    overrides: list[str] | None = None,
    *,
    config_dir: str | Path | None = None,
    config_name: str = "config",
    hydra_config: bool = False,
) -> DictConfig:
    """The job's config with ``overrides`` applied, without running it; ``--config-dir`` as ``config_dir``."""
    where = [f"hydra.searchpath=[file://{Path(config_dir).expanduser().resolve()}]"] if config_dir else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, [*where, *(overrides or [])], return_hydra_config=hydra_config)


def _precheck(where: dict[str, str], overrides: list[str]) -> Path | None:
    """The absolute ``hydra.run.dir`` (None if unknown) of the config composed and checked (values, the
    run folder's fingerprints) before Hydra makes or rewrites a folder; a problem is a JobError."""
    from r3lightning.app.job.checkpoint import check_run_dir

    keep = [a for a in overrides if a.startswith("hydra.run.dir=") or not a.lstrip("+~").startswith("hydra")]
    try:
        cfg = compose_config(keep, **where, hydra_config=True)
        configs = arms(cfg)
        run_seeds(cfg)
        try:
            run_dir = Path(str(cfg.hydra.run.dir)).absolute()
        except Exception:
            return None
        for arm, arm_cfg in configs.items():  # another task, dataset or model: refused before Hydra writes
            check_run_dir(arm_cfg, run_dir / arm.replace("=", "_"))
    except (HydraException, OmegaConfBaseException) as exc:
        raise JobError(_hydra_message(exc)) from None
    return run_dir


def _single(args: list[str], label: str = "") -> int:
    """One run through Hydra; returns the exit status."""
    _, overrides, understood, where = _split_flags(args)
    new_dirs: list[Path] = []
    if understood:
        try:
            run_dir = _precheck(where, overrides)
        except JobError as exc:
            return _error(exc, label)
        if run_dir is not None:
            # the folders this run will make (so a run that fails before training removes them),
            # with the run folder pinned, so Hydra's ${now:...} cannot name another one
            new_dirs = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
            if not any(a.startswith("hydra.run.dir=") for a in overrides):
                args = [*args, f"hydra.run.dir={run_dir}"]
    status = {"code": 0}

    def task(cfg: DictConfig) -> None:
        status["code"] = _run_in(cfg, Path(HydraConfig.get().runtime.output_dir), args, label, new_dirs)

    saved = sys.argv
    sys.argv = [saved[0], *args]
    try:
        hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(task)()
    finally:
        sys.argv = saved
    return status["code"]


def _sweep(args: list[str]) -> int:
    """``-m``: the sweep's jobs one after the other; a failed one is one line and the sweep goes on."""
    flags, overrides, _, where = _split_flags([a for a in args if a not in _MULTIRUN_FLAGS])
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        return _error(_hydra_message(exc))
    jobs = [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    sweep_dir = None
    failed: list[str] = []
    for number, job in enumerate(jobs):
        label = f"job #{number} ({' '.join(job)}): "
        if sweep_dir is None:
            with contextlib.suppress(Exception):  # a job that does not compose reports it when run
                job_overrides = [a for a in job if not a.startswith("hydra.run.dir=")]
                sweep_dir = str(compose_config(job_overrides, **where, hydra_config=True).hydra.sweep.dir)
        print(f"[{PROG}] {label.rstrip(': ')}", file=sys.stderr)
        run_dir = [f"hydra.run.dir={sweep_dir}/{number}"] if sweep_dir is not None else []
        code = _single([*flags, *job, *run_dir], label)
        if code == 130:
            return 130
        if code != 0:
            failed.append(f"#{number} ({' '.join(job)})")
    if failed:
        print(f"{PROG}: {len(failed)} of {len(jobs)} jobs failed: {', '.join(failed)}", file=sys.stderr)
    return 2 if failed else 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``r3lightning-train``): Hydra parses the command-line overrides."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(format_help(CONF_DIR, args))
        sys.exit(0)
    # Lightning's banner lines (accelerator summary, logger tips) are noise here.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    sys.exit(_sweep(args) if any(a in _MULTIRUN_FLAGS for a in args) else _single(args))


if __name__ == "__main__":
    main()
