"""``r3lightning-serve``: serve a causal MoE model that returns its routes, from the command line.

    r3lightning-serve --port 30000                       # the tiny MoE on 127.0.0.1
    r3lightning-serve --model /ckpt/qwen3-moe --device cuda:0 --api-key KEY --host 0.0.0.0

Every limit of :class:`~r3lightning.serve.server.RolloutServer` has a flag. A bad argument or
a failed startup (a ``--model`` that is not a local checkpoint directory, which is never looked
up on the hub; ``--device cuda`` without CUDA; a port out of range or in use; a non-loopback
``--host`` without ``--api-key`` or ``--allow-unauthenticated``) prints one line naming it and
exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import torch

from r3lightning.serve.server import (
    DEFAULT_MAX_NEW_TOKENS_CAP,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WEIGHTS_BYTES,
    RolloutServer,
    check_exposure,
)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage first)
        raise _StartupError(message)


class _StartupError(Exception):
    """A bad argument or a failed startup: printed as one line, exit status 2."""


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 65535], got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 65535], got {port}")
    return port


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _ArgumentParser(
        prog="r3lightning-serve",
        description="Serve a causal MoE model that returns its routed experts (skyrl and sglang protocols).",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; one that is not loopback needs --api-key or --allow-unauthenticated",
    )
    parser.add_argument("--port", type=_port, default=30000, help="0 picks a free port (printed at start)")
    parser.add_argument(
        "--model",
        default=None,
        help="local Hugging Face checkpoint directory (default: the tiny MoE); never downloaded",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda:0 (default: cuda if available)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback --host without --api-key",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument(
        "--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help="waiting generate requests before 429"
    )
    parser.add_argument(
        "--max-new-tokens-cap",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS_CAP,
        help="largest max_tokens / max_new_tokens a request may ask for",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest generate body (default: what a full-context prompt needs)",
    )
    parser.add_argument(
        "--max-weights-bytes",
        type=int,
        default=DEFAULT_MAX_WEIGHTS_BYTES,
        help="largest /update_weights body (safetensors)",
    )
    parser.add_argument(
        "--header-timeout", type=float, default=30.0, help="seconds to receive a request head"
    )
    parser.add_argument("--body-timeout", type=float, default=30.0, help="most seconds between body reads")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise _StartupError(f"--device {name}: not a device name (expected e.g. cpu, cuda, cuda:0)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise _StartupError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise _StartupError(f"--device {name}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        raise _StartupError(f"--device {name}: expected cpu or cuda[:N]")
    return device


def _load_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
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
        raise _StartupError(
            f"--model {path}: cannot load the checkpoint: {type(exc).__name__}: {exc}"
        ) from None


async def _serve_until_signalled(server: RolloutServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
    """Console entry point (``r3lightning-serve``); serves until SIGINT / SIGTERM.

    A bad argument or a startup failure prints one line naming it and exits 2.
    """
    try:
        args = _parse_args(argv)
        _serve(args)
    except _StartupError as exc:
        message = " ".join(str(exc).split())
        print(f"r3lightning-serve: error: {message}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> None:
    try:
        check_exposure(args.host, args.api_key, args.allow_unauthenticated)
    except ValueError as exc:
        raise _StartupError(str(exc)) from None
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        raise _StartupError(f"--log-level {args.log_level}: expected DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dtype = getattr(torch, args.dtype)
    device = _device(args.device)
    model = None if args.model is None else _load_model(args.model, dtype)  # None: the tiny MoE
    try:
        server = RolloutServer(
            model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            allow_unauthenticated=args.allow_unauthenticated,
            max_request_bytes=args.max_request_bytes,
            max_weights_bytes=args.max_weights_bytes,
            max_batch_size=args.max_batch_size,
            max_queue=args.max_queue,
            max_new_tokens_cap=args.max_new_tokens_cap,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            dtype=dtype,
            device=device,
            seed=args.seed,
            model_name=args.model or "r3lightning-tiny-moe",
            copy_model=False,
        )
    except ValueError as exc:  # a bad limit, or a model the engine cannot serve
        raise _StartupError(str(exc)) from None
    asyncio.run(_serve_until_signalled(server))


if __name__ == "__main__":
    raise SystemExit(main())
