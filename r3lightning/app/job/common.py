"""What every part of the job shares: its user-facing error, the launcher's rank and config nodes
as plain containers. Torch-free: the config checks import it."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

__all__ = ["JobError", "is_global_zero", "one_line", "plain"]


def one_line(text: Any) -> str:
    """``text`` on one line, for an error message the user reads in a terminal.

    Args:
        text: Anything; an exception gives its message.

    Returns:
        ``str(text)`` with every run of whitespace (newlines too) as one space, stripped.
    """
    return " ".join(str(text).split())


class JobError(Exception):
    """A problem the user can fix (configuration, engine address); reported as one line."""


def is_global_zero() -> bool:
    """Whether this process is rank 0 of a (possibly not yet launched) multi-process run.

    Read from the launcher's environment variables, so it works before any process group exists.

    Returns:
        True on global rank 0 (``RANK``, else ``LOCAL_RANK``, and ``NODE_RANK``; 0 when unset).
    """
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return rank == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def plain(node: Any) -> Any:
    """A config node as plain Python containers, interpolations resolved.

    Args:
        node: A ``DictConfig`` / ``ListConfig``, or anything else (returned as it is).

    Returns:
        Dicts and lists of plain values for a config node, else ``node``.
    """
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
