"""Settings of the embedded engine and server, checked when built (docs: configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from r3lightning.checks import check_setting

if TYPE_CHECKING:
    from torch import device as TorchDevice
    from torch import dtype as TorchDtype
else:  # torch is imported when a config is built; the annotations resolve without it
    TorchDevice = TorchDtype = Any

__all__ = ["EngineConfig", "EngineSettings", "ServerLimits"]

_MAX_BATCH_WAIT_S = 10.0
# torch is imported when a config is built, not with this module: `r3lightning-serve --help` and
# a bad flag answer without paying for torch
_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineSettings:
    """`EngineConfig`'s values as a config file holds them (``dtype`` and ``device`` by name),
    checked without importing torch: the job refuses a bad ``rollout.server`` value, for every arm
    of ``compare``, before torch is imported. `EngineConfig` is the same settings built."""

    dtype: TorchDtype | str = "bfloat16"
    device: TorchDevice | str | None = None
    max_batch_size: int = 8
    batch_wait_s: float = 0.002
    seed: int = 0
    copy_model: bool = True
    batch_invariant: bool | None = None
    simulated_disagreement: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        check_setting("max_batch_size", self.max_batch_size, low=1, integer=True)
        # a collection window for batch-mates: past 10 s it only adds latency, and a huge value
        # overflows the queue's timeout and kills the batching thread
        check_setting("batch_wait_s", self.batch_wait_s, low=0, high=_MAX_BATCH_WAIT_S)
        check_setting("seed", self.seed, low=0, high=2**63 - 1, integer=True)
        if not isinstance(self.copy_model, bool):
            raise ValueError(f"copy_model must be true or false, got {self.copy_model!r}")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be None or a bool, got {self.batch_invariant!r}")
        check_setting("simulated_disagreement", self.simulated_disagreement, low=0, high=0.5, optional=True)


@dataclass(frozen=True)
class EngineConfig(EngineSettings):
    """How a `GenerationEngine` serves. ``device`` None: the
    model's; ``copy_model=False`` serves the model itself, cast in place; ``simulated_disagreement``
    (SIMULATION): the share of expert slots flipped by perturbed router logits.

    Built, ``dtype`` is a ``torch.dtype`` and ``device`` a present device (this imports torch);
    `EngineSettings` checks the other values without torch."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # torch last: every value above is refused without it (the job checks its config first)
        import torch

        dtypes = {name: getattr(torch, name) for name in _DTYPES}
        dtype = dtypes.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in dtypes.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.device is not None:
            serving_device(self.device)


def serving_device(value: TorchDevice | str | int) -> TorchDevice:
    """Check a device before any model is moved there.

    Args:
        value: a ``torch.device``, its name or a CUDA index.

    Returns:
        The device: ``cpu``, ``cuda`` or ``cuda:N`` present on this machine.

    Raises:
        ValueError: naming ``device``: not a CPU or CUDA device, or no such CUDA device here.
    """
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    count = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        found = (
            f"this machine has {count} CUDA device(s)" if count else "CUDA is not available on this machine"
        )
        raise ValueError(f"device {value!r}: {found}; use 'cpu'")
    return device


@dataclass(frozen=True)
class ServerLimits:
    """What a [`RolloutServer`][r3lightning.app.serve.server.RolloutServer] accepts. ``max_new_tokens_cap`` None:
    the context; ``max_request_bytes`` None: 24 bytes a context token + 64 KiB. A body is cut (408)
    when no byte comes for ``body_timeout_s``, or when it has taken longer than ``body_timeout_s``
    plus its bytes so far at ``min_body_rate``: a client trickling a byte at a time cannot hold a
    generate slot or the one weight-upload slot for long."""

    max_queue: int = 256
    max_new_tokens_cap: int | None = 4096
    max_request_bytes: int | None = None
    max_weights_bytes: int = 8 << 30
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    retry_after_s: int = 1
    min_body_rate: int = 64 << 10  # bytes/s a body must average after its first body_timeout_s

    def __post_init__(self) -> None:
        check_setting("max_queue", self.max_queue, low=0, integer=True)
        for name in ("max_new_tokens_cap", "max_request_bytes"):
            check_setting(name, getattr(self, name), low=1, integer=True, optional=True)
        check_setting("max_weights_bytes", self.max_weights_bytes, low=1, integer=True)
        check_setting("retry_after_s", self.retry_after_s, low=1, integer=True)
        check_setting("min_body_rate", self.min_body_rate, low=1, integer=True)
        for name in ("header_timeout_s", "body_timeout_s"):
            check_setting(name, getattr(self, name), low=0, above=True)
