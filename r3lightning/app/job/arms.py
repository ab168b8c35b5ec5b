"""The job's arms (``compare``) and seeds, each arm's config checked (docs/demo.md)."""

from __future__ import annotations

import re

from omegaconf import DictConfig, OmegaConf

from r3lightning.app.job.common import JobError
from r3lightning.app.job.literals import refuse_non_bool
from r3lightning.app.job.settings import REPLAY_MODES
from r3lightning.app.job.store import replay_settings
from r3lightning.app.job.validate import check_targets, check_values

__all__ = ["arms", "run_seeds"]

_ARM_NAME = re.compile(r"[A-Za-z0-9_.+=,-]+")


def arms(cfg: DictConfig, *, targets: bool = True) -> dict[str, DictConfig]:
    """The arms of ``compare`` (docs/demo.md), each a whole config of its own.

    Every arm's values are checked first (`check_values`, and its overrides' true/false literals),
    all before torch is imported; then, if ``targets``, its ``_target_`` nodes. An empty ``compare`` is the one arm ``replay=<replay.mode>``.

    Args:
        cfg: The job's composed config.
        targets: Also run `check_targets` on every arm: its ``_target_`` objects import, its
            callbacks and data module build once (slower: imports Lightning and the targets).

    Returns:
        ``{arm name: its checked config}`` in the order of ``compare``; each arm's own
        ``compare`` is empty.

    Raises:
        JobError: An arm with an unknown key, a replay mode that does not exist, a bad or repeated
            name, an override of a key the config does not have, a true/false key set to another
            literal, or a value its check refuses; the message names the arm (``compare[i]``).
    """
    check_values(cfg)
    out: dict[str, DictConfig] = {}
    for index, entry in enumerate(cfg.compare or [None]):
        spec = OmegaConf.to_container(entry) if OmegaConf.is_dict(entry) else {"replay": entry}
        where = f"compare[{index}]"
        mode = spec.pop("replay", None)
        overrides = spec.pop("overrides", None) or {}
        name = str(spec.pop("name", None) or f"replay={mode or cfg.replay.mode}")
        if spec:
            raise JobError(f"{where}: unknown keys {sorted(spec)}; an arm has name, replay and overrides")
        if mode is not None and mode not in REPLAY_MODES:
            raise JobError(f"{where}.replay must be one of {list(REPLAY_MODES)}, got {mode!r}")
        if not _ARM_NAME.fullmatch(name) or name in out:
            problem = "is used twice" if name in out else "may hold only letters, digits and _.+=,-"
            raise JobError(f"{where}.name {name!r} {problem}")
        if not isinstance(overrides, dict):
            raise JobError(f"{where}.overrides must map dotted config keys to values, got {overrides!r}")
        base = cfg if mode is None else replay_settings(cfg, str(mode))
        arm = OmegaConf.merge(base, {"compare": []})  # an arm is one run: it compares nothing
        for key, value in overrides.items():
            if OmegaConf.select(arm, str(key), default=KeyError) is KeyError:
                raise JobError(f"{where}.overrides: {key!r} is not a key of the config")
            try:  # the literal as written: the structured merge would read 1 or "yes" as true
                refuse_non_bool(arm, str(key), value)
            except JobError as exc:
                raise JobError(f"{where} ({name}): {exc}") from None
            OmegaConf.update(arm, str(key), value, merge=True)
        try:  # torch-free: every arm is checked before anything heavy is imported
            check_values(arm)
        except JobError as exc:
            raise JobError(f"{where} ({name}): {exc}") from None
        out[name] = arm
    for name, arm in out.items() if targets else ():
        try:
            check_targets(arm)
        except JobError as exc:
            raise JobError(exc if len(out) == 1 else f"{name}: {exc}") from None
    return out


def run_seeds(cfg: DictConfig) -> list[int]:
    """The seeds every arm runs: ``seed``, ``seed + 1``, ... (``seeds`` of them).

    Args:
        cfg: The job's composed config.

    Returns:
        The seeds, ascending.

    Raises:
        JobError: A value of ``cfg`` its check refuses.
    """
    run = check_values(cfg).run
    return [run.seed + i for i in range(run.seeds)]
