"""Helper threads for the client's decode path.

A generate response with routes is one large base64 payload in a small JSON document. The
payload's decode (a GIL-free compiled kernel, or pybase64) drops the GIL; the JSON parse
(orjson) and the reading of its fields keep it. So :func:`~r3lightning.wire.json_body.parse_body_with` hands the JSON to a helper
thread from :func:`helper_pool` while the calling thread decodes. Helpers never wait on the pool
themselves, so concurrent parses cannot deadlock it. Threads start on first use.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["helper_pool"]

# Enough for a few concurrent parses (the collector decodes responses on several threads).
_MAX_HELPERS = 3


@functools.cache
def _helper_count() -> int:
    """Helper threads: one per core this process may use beyond the caller's, at most 3."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(cores - 1, _MAX_HELPERS))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_after_fork() -> None:
    # a forked child (a data loader worker) has none of the parent's threads: start afresh
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def helper_pool() -> ThreadPoolExecutor | None:
    """The process-wide helper threads; None on a single core (callers then do everything
    themselves)."""
    global _pool
    count = _helper_count()
    if not count:
        return None
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="r3-decode")
        return _pool
