"""``r3lightning-train ARGS`` in the test's own process, as the console script runs it, and the one
line it refuses a config with."""

from __future__ import annotations

import sys


def train_cli(*args: str) -> None:
    """Run the job's console entry point with ``args`` as its command line (Hydra reads
    ``sys.argv``); a failure raises ``SystemExit`` with the exit status, as the script exits."""
    from r3lightning.app.job.main import main

    saved = sys.argv
    sys.argv = ["r3lightning-train", *args]
    try:
        main()
    finally:
        sys.argv = saved


def refusal(overrides: list[str]) -> str | None:
    """The one line the job prints for ``overrides``, without running it: Hydra's composition
    error, else the first value the job's checks refuse (values, then targets); None if none."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.literals import check_bool_overrides
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.validate import check_config, error_line

    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        return error_line(exc)
    try:
        check_bool_overrides(cfg, overrides)
        check_config(cfg)
    except JobError as exc:
        return str(exc)
    return None
