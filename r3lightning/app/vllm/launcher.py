"""A vLLM engine owned by this process: ``vllm serve`` started, health-checked and always stopped.

[`VllmServer`][r3lightning.app.vllm.launcher.VllmServer] starts ``vllm serve`` on ``127.0.0.1`` in its own process group, through
``cli_shim.py`` run by the engine's own Python (``.venv-vllm`` by default, built by ``make vllm``),
waits for ``GET /health``, and stops the whole group (``SIGTERM``, then ``SIGKILL``) when the
``with`` block ends for any reason: a normal exit, an exception, Ctrl-C, ``SIGTERM`` to this process
(turned into ``SystemExit``), interpreter exit (``atexit``), or this process dying outright
(``reaper.py``, a small watcher started next to the engine, stops the group then). ``VllmServer.external(url)`` connects to an engine someone else runs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from r3lightning.app.vllm.settings import ProcessOptions, VllmSettings, engine_command, engine_environment

__all__ = ["VllmServer", "VllmStartError"]

_SHIM = Path(__file__).with_name("cli_shim.py")
_REAPER = Path(__file__).with_name("reaper.py")
_LIVE: weakref.WeakSet[VllmServer] = weakref.WeakSet()  # started and not yet stopped


class VllmStartError(RuntimeError):
    """The engine could not start, or did not answer ``/health`` in time (the log's tail attached)."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _healthy(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):  # refused, reset, timed out, HTTP errors
        return False


def log_tail(path: Path | None, lines: int = 30) -> str:
    """The end of an engine's log, for an error message.

    Args:
        path: the log file (None or absent: no log).
        lines: how many of its last lines to return.

    Returns:
        Those lines ('' without a log). Cost: reads at most the file's last 64 KiB.
    """
    if path is None or not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(max(0, handle.seek(0, os.SEEK_END) - 64 * 1024))
        text = handle.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


class VllmServer:
    """One vLLM engine: started here (``VllmServer(settings)``) or external (`external`).

    Use as a context manager; `url` is the base URL for ``RemoteGenerateClient``.

    Args:
        settings: how to start the engine (model directory, dtype, flags, timeouts).
        log_path: where the engine's stdout and stderr go (default: a new file in the temp dir).
    """

    def __init__(self, settings: VllmSettings, *, log_path: str | Path | None = None):
        if not isinstance(settings, VllmSettings):
            raise TypeError(f"settings must be a VllmSettings, got {type(settings).__name__}")
        self.settings = settings
        self.log_path = None if log_path is None else Path(log_path)
        self.url: str | None = None
        self.process: subprocess.Popen | None = None
        self._external = False
        self._lock = threading.Lock()
        self._reaper: subprocess.Popen | None = None
        self._owner: int | None = None  # the process that started the engine

    @classmethod
    def external(cls, url: str, *, health_timeout_s: float = 30.0) -> VllmServer:
        """An engine at ``url`` that this process neither starts nor stops.

        Args:
            url: the engine's base URL (``http://host:port``).
            health_timeout_s: how long `start` waits for its ``/health``.

        Returns:
            A [`VllmServer`][r3lightning.app.vllm.launcher.VllmServer] without a process.
        """
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        server = cls(
            VllmSettings(model="(external)", process=ProcessOptions(health_timeout_s=health_timeout_s))
        )
        server.url = url.rstrip("/")
        server._external = True
        return server

    @property
    def pid(self) -> int | None:
        """The engine's process id (its process group id too); None when external or stopped."""
        return None if self.process is None else self.process.pid

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> VllmServer:
        """Start the engine (external: check it answers) and wait for ``/health``.

        Returns:
            ``self``, with `url` set.

        Raises:
            VllmStartError: the engine exited, or did not answer ``/health`` within
                ``settings.process.health_timeout_s``; the message's first line says which, the log's tail follows.
            FileNotFoundError: no engine Python (the message says ``make vllm``).
        """
        if self._external:
            self._wait_healthy()
            return self
        if self.process is not None:
            raise RuntimeError("this VllmServer is already started")
        settings = self.settings
        port = settings.port or _free_port(settings.host)
        self.url = f"http://{settings.host}:{port}"
        command = engine_command(settings, _SHIM, port)
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_environment(settings),
                start_new_session=True,  # one process group to stop; Ctrl-C reaches us, not it
            )
        self._owner = os.getpid()
        _LIVE.add(self)
        grace = str(settings.process.stop_timeout_s)
        self._reaper = subprocess.Popen(
            [sys.executable, str(_REAPER), str(os.getpid()), str(self.process.pid), grace],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal must not end the watcher first
        )
        if threading.current_thread() is threading.main_thread():
            _trap_sigterm()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        timeout_s = self.settings.process.health_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                code = self.process.returncode
                raise VllmStartError(self._failure(f"vLLM exited with code {code} before answering /health"))
            if _healthy(self.url, timeout_s=min(5.0, timeout_s)):
                return
            if time.monotonic() >= deadline:
                what = "vLLM" if self.process is not None else "the external engine"
                raise VllmStartError(
                    self._failure(f"{what} at {self.url} did not answer /health within {timeout_s:g}s")
                )
            time.sleep(self.settings.process.health_interval_s)

    def _failure(self, line: str) -> str:
        if self.log_path is None:
            return line
        tail = log_tail(self.log_path)
        return f"{line} (log: {self.log_path}); its last lines:\n{tail}"

    def stop(self) -> None:
        """Stop the engine's whole process group: ``SIGTERM``, then ``SIGKILL`` after
        ``settings.process.stop_timeout_s``. Idempotent; a no-op for an external engine."""
        with self._lock:
            process = self.process
            self.process = None
        if process is None:
            return
        _LIVE.discard(self)
        if not _LIVE:
            _restore_sigterm()
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=self.settings.process.stop_timeout_s)
        # the group can outlive its leader (engine-core workers): always sweep it, and wait (a
        # little) until the kernel has taken every member, so none is running when stop() returns
        _signal_group(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        deadline = time.monotonic() + 5.0
        while _group_running(process.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None


def _unwind(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _trap_sigterm() -> None:
    """``SIGTERM`` to this process unwinds (``SystemExit``) so ``with`` blocks stop their engines;
    only while no other handler is installed, and only until the last engine stops."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _unwind)


def _restore_sigterm() -> None:
    with contextlib.suppress(ValueError):  # not the main thread: leave it
        if signal.getsignal(signal.SIGTERM) is _unwind:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _group_running(pgid: int) -> bool:
    """Whether a member of the group still runs (Linux: a zombie, dead but not yet reaped, does not)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        if server._owner == os.getpid():  # a forked child inherits the set, never the engines
            server.stop()
