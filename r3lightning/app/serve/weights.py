"""What a serving model may load: its parameters and persistent buffers in their shapes, floating
ones only from floats of 16 bits or more (fp8, ints, bools would be cast silently), the others
from their own dtype, values finite in the serving dtype (a NaN makes every later token 0)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["check_finite", "check_weights", "loadable_targets"]

# floating sources a floating parameter may be loaded from (casting them is exact or rounding)
_LOADABLE_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def loadable_targets(model: torch.nn.Module) -> dict[str, Tensor]:
    """Name -> the model's tensor for every parameter and persistent buffer (tied ones twice)."""
    return model.state_dict(keep_vars=True)


def check_weights(
    targets: Mapping[str, Tensor], specs: Mapping[str, tuple], *, strict: bool, where: str = "state_dict"
) -> None:
    """``ValueError`` naming the tensor unless ``specs`` (name -> (dtype, shape)) fit ``targets``."""
    if not specs:  # an empty upload would count as a new weight version
        raise ValueError(f"{where} holds no tensor: nothing to load")
    unknown, missing = sorted(set(specs) - set(targets)), sorted(set(targets) - set(specs))
    if unknown:
        odd = "names that are not parameters or persistent buffers of the model"
        raise ValueError(f"{where} has {len(unknown)} {odd}, e.g. {unknown[:3]}")
    if strict and missing:
        raise ValueError(f"{where} lacks {len(missing)} model names, e.g. {missing[:3]}")
    for name, (dtype, shape) in specs.items():
        target, at = targets[name], f"{where}[{name!r}]"
        if tuple(shape) != tuple(target.shape):
            raise ValueError(f"{at} has shape {tuple(shape)}, the model expects {tuple(target.shape)}")
        if target.is_floating_point() and dtype not in _LOADABLE_FLOATS:
            floats = "float16, bfloat16, float32 or float64"
            raise ValueError(f"{at} has dtype {dtype}; the model's floating tensor takes only {floats}")
        if not target.is_floating_point() and dtype != target.dtype:
            raise ValueError(f"{at} has dtype {dtype}, the model's buffer is {target.dtype}")


def check_finite(state_dict: Mapping[str, Tensor], targets: Mapping[str, Tensor]) -> None:
    """``ValueError`` naming the first floating tensor not finite once cast to its target's dtype
    (``3.4e38`` into bfloat16 too). One cast and check a tensor at a time; one host sync a device."""
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for name, value in state_dict.items():
        if value.is_floating_point():
            by_device.setdefault(value.device, []).append((name, value))
    for items in by_device.values():
        flags = torch.stack([torch.isfinite(v.to(targets[n].dtype)).all() for n, v in items]).cpu()
        if not bool(flags.all()):
            name, value = items[int((~flags).nonzero()[0, 0])]
            dtype = targets[name].dtype
            bad = f"{int((~torch.isfinite(value.to(dtype))).sum())} values that are not finite"
            raise ValueError(
                f"state_dict[{name!r}] holds {bad} in the serving dtype {dtype} (NaN, inf, or beyond its range)"
            )
