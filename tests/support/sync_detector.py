"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: find the device->host syncs a
training step of the package would make on a GPU.

On the CPU nothing syncs, so "device" tensors are tracked instead: the tensors of the batch after
its transfer and the model's parameters are marked, and every tensor an operation derives from a
marked one is marked too (a ``TorchFunctionMode``). An operation that would block the host on a
GPU is reported when its input is marked: ``item``, ``tolist``, ``cpu``, ``numpy``, ``bool`` /
``int`` / ``float`` of a tensor, ``nonzero``, ``masked_select``, ``unique``, ``equal``, and indexing
(or index assignment) with a bool mask or a Python list. Converting a Python number to a tensor
inside ``LightningModule.log`` (a blocking host->device copy per metric on a GPU) is reported
too. Only calls made by the package count (the innermost non-torch frame is in ``r3lightning``,
or Lightning works on the package's behalf); transformers' and megatron's own syncs are theirs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import r3lightning

PACKAGE = str(Path(r3lightning.__file__).parent)
TORCH = str(Path(torch.__file__).parent)
LIGHTNING = str(Path(pl.__file__).parent.parent)
HERE = __file__

_SYNC_METHODS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.cpu,
    Tensor.numpy,
    Tensor.__bool__,
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__index__,
    Tensor.nonzero,
    torch.nonzero,
    Tensor.masked_select,
    torch.masked_select,
    Tensor.unique,
    torch.unique,
    torch.equal,
    Tensor.equal,
}


def _bad_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if isinstance(item, list):
            return True
        if isinstance(item, Tensor) and item.dtype == torch.bool:
            return True
    return False


class SyncDetector(TorchFunctionMode):
    """Record would-be device->host syncs made by the package while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.armed = False
        self.syncs: list[str] = []

    def mark(self, *tensors: Tensor) -> None:
        for tensor in tensors:
            self.device[tensor] = True

    def _marked(self, value) -> bool:
        return isinstance(value, Tensor) and value in self.device

    def _culprit(self) -> str | None:
        """``file:line`` of the package code responsible for the current call, if any."""
        frame = sys._getframe(2)
        innermost = None
        while frame is not None:
            path = frame.f_code.co_filename
            if path != HERE and not path.startswith(TORCH):
                if innermost is None:
                    innermost = path
                    if not (path.startswith(PACKAGE) or path.startswith(LIGHTNING)):
                        return None  # another library's own call (transformers, megatron)
                if path.startswith(PACKAGE):
                    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.armed:
            reason = None
            if func in _SYNC_METHODS and args and self._marked(args[0]):
                reason = getattr(func, "__name__", str(func))
            elif func in (Tensor.__getitem__, Tensor.__setitem__) and (
                self._marked(args[0]) and _bad_index(args[1])
            ):
                reason = f"{func.__name__} with a bool mask or list"
            elif (
                func in (torch.tensor, torch.as_tensor)
                and not (args and isinstance(args[0], Tensor))
                and any("__to_tensor" in f.f_code.co_name for f in _frames())
            ):
                reason = "a Python number logged (host->device copy per metric)"
            if reason is not None:
                where = self._culprit()
                if where is not None:
                    self.syncs.append(f"{reason} at {where}")
        out = func(*args, **kwargs)
        if self.armed:
            inputs, _ = tree_flatten((args, kwargs))
            if any(self._marked(t) for t in inputs):
                outputs, _ = tree_flatten(out)
                for tensor in outputs:
                    if isinstance(tensor, Tensor):
                        self.device[tensor] = True
                name = getattr(func, "__name__", "")
                target = args[0] if args else None
                if isinstance(target, Tensor) and (
                    name.startswith("__i")
                    or name == "__setitem__"
                    or (name.endswith("_") and not name.endswith("__"))
                ):
                    while target is not None:  # written in place: the tensor and what it views
                        self.device[target] = True
                        target = target._base
        return out


def _frames():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def device_tensors(batch) -> list[Tensor]:
    """The tensors of a ``RolloutBatch`` (routes included) or a mapping batch."""
    values = vars(batch).values() if not isinstance(batch, dict) else batch.values()
    out = []
    for value in values:
        if isinstance(value, Tensor):
            out.append(value)
        elif hasattr(value, "cu_seqlens_host"):  # a PackedTensor: on the CPU its offsets may be
            out.append(value.values)  # the host copy itself, which stays on the host on a GPU
            if value.cu_seqlens is not value.cu_seqlens_host:
                out.append(value.cu_seqlens)
    return out


class ArmDetector(pl.Callback):
    """First callback: marks the transferred batch and the parameters, arms the detector."""

    def __init__(self, detector: SyncDetector) -> None:
        self.detector = detector

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.detector.mark(*device_tensors(batch), *pl_module.parameters())
        self.detector.armed = True


class DisarmDetector(pl.Callback):
    """Last callback: the step (metrics logged by every callback included) is over."""

    def __init__(self, detector: SyncDetector) -> None:
        self.detector = detector

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.detector.armed = False
