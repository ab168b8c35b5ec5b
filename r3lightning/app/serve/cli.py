"""``r3lightning-serve``: serve a causal MoE model that returns its routes (docs: protocols.md).
A bad argument or start-up is one line and exit 2; heavy imports wait for the arguments."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import Any

# the CLI's own defaults where they differ from the dataclasses': the server loads its own model,
# so a private copy of it would only double the memory
_CLI_DEFAULTS = {"copy_model": False}


class _StartupError(Exception):
    """A bad argument or a failed startup: printed as one line, exit status 2."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage first)
        raise _StartupError(message)


def _port(value: str) -> int:
    port = _setting(value)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 65535], got {port!r}")
    return port


def _setting(text: str) -> Any:
    """none, true/false, an int, a float or the text: the config dataclass checks the value."""
    words = {"none": None, "null": None, "true": True, "false": False}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _ArgumentParser(
        prog="r3lightning-serve", description="Serve a MoE model that returns its routes."
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="not loopback: needs a key or --allow-unauthenticated")
    add("--port", type=_port, default=30000, help="0 picks a free port (printed at start)")
    add("--model", help="local Hugging Face checkpoint directory (default: the tiny MoE)")
    add("--api-key", help="require 'Authorization: Bearer <key>'")
    add("--allow-unauthenticated", action="store_true", help="serve a non-loopback host keyless")
    add("--log-level", default="INFO")
    from r3lightning.app.serve.config import EngineConfig, ServerLimits  # torch waits for a build

    for cls in (EngineConfig, ServerLimits):  # a flag for every field of either settings object
        for field in dataclasses.fields(cls):
            default = _CLI_DEFAULTS.get(field.name, field.default)
            flag = f"--{field.name.replace('_', '-')}"
            add(flag, type=_setting, default=default, help=str(default).removeprefix("torch."))
    return parser.parse_args(argv)  # 0.1's --header-timeout / --body-timeout: unique prefixes


def _settings(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags of ``cls``'s fields, by field name."""
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(cls)}


def _device(name: str | None):
    import torch

    from r3lightning.app.serve.config import serving_device

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu")
    try:
        return serving_device(name)
    except ValueError as exc:
        raise _StartupError(f"--{exc}") from None  # "--device ...": the message names the setting


def _load_model(path: str, dtype):
    directory = Path(path)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        what = "is not a directory" if not directory.is_dir() else "has no config.json"
        raise _StartupError(
            f"--model {path} {what}; expected a local Hugging Face checkpoint directory "
            "(config.json + weights; hub names are not downloaded)"
        )
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    except Exception as exc:  # any loader failure is a startup error of this one argument
        reason = f"{type(exc).__name__}: {exc}"
        raise _StartupError(f"--model {path}: cannot load the checkpoint: {reason}") from None


async def _serve_until_signalled(server) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as exc:
        await asyncio.to_thread(server.engine.close)
        raise _StartupError(f"cannot listen on {server.host}:{server.port}: {exc.strerror or exc}") from None
    try:
        print(f"r3lightning rollout server listening on {server.url}", flush=True)
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``r3lightning-serve``): serves until SIGINT / SIGTERM.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 after a signal, 2 after a bad argument or a failed start-up (printed
        as one line on stderr).
    """
    try:
        _serve(_parse_args(argv))
    except _StartupError as exc:
        print(f"r3lightning-serve: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> None:
    from r3lightning.app.serve.config import EngineConfig, ServerLimits

    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        raise _StartupError(f"--log-level {args.log_level}: expected DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        limits = ServerLimits(**_settings(ServerLimits, args))  # checked before torch is imported
        from r3lightning.app.serve.exposure import check_exposure

        # before torch and a model load
        check_exposure(args.host, args.api_key, args.allow_unauthenticated, "--api-key")
        from r3lightning.app.serve.server import RolloutServer

        engine = EngineConfig(**_settings(EngineConfig, args) | {"device": _device(args.device)})
        model = None if args.model is None else _load_model(args.model, engine.dtype)  # None: the tiny MoE
        exposure = {"api_key": args.api_key, "allow_unauthenticated": args.allow_unauthenticated}
        name = args.model or "r3lightning-tiny-moe"
        server = RolloutServer(
            model, engine=engine, limits=limits, host=args.host, port=args.port, **exposure, model_name=name
        )
    except ValueError as exc:  # a bad setting, or a model the engine cannot serve
        raise _StartupError(str(exc)) from None
    asyncio.run(_serve_until_signalled(server))


if __name__ == "__main__":
    raise SystemExit(main())
