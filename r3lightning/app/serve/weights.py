"""What a serving model may load: its parameters and persistent buffers in their shapes, floating
ones only from floats of 16 bits or more (fp8, ints, bools would be cast silently), the others
from their own dtype, values finite in the serving dtype (a NaN makes every later token 0)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["check_finite", "check_weights", "loadable_targets", "serving_copy"]

# floating sources a floating parameter may be loaded from (casting them is exact or rounding)
_LOADABLE_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def loadable_targets(model: torch.nn.Module) -> dict[str, Tensor]:
    """The tensors an upload may replace.

    Args:
        model: the serving model.

    Returns:
        Name -> the model's own tensor (not a copy) for every parameter and persistent buffer;
        tied weights appear under each of their names.
    """
    return model.state_dict(keep_vars=True)


def check_weights(
    targets: Mapping[str, Tensor], specs: Mapping[str, tuple], *, strict: bool, where: str = "state_dict"
) -> None:
    """Check an upload from its names, dtypes and shapes alone, before any value is read.

    Args:
        targets: the model's loadable tensors (`loadable_targets`).
        specs: name -> ``(dtype, shape)`` of each uploaded tensor.
        strict: every name of ``targets`` must be uploaded.
        where: what the messages call the upload.

    Raises:
        ValueError: naming the tensor: an empty upload (it would count as a new weight version),
            a name the model does not have, a shape other than the target's, a floating target
            from a non-float or 8-bit float, a non-floating target from another dtype, or (with
            ``strict``) a missing name.
    """
    if not specs:  # an empty upload would count as a new weight version
        raise ValueError(f"{where} holds no tensor: nothing to load")
    unknown = sorted(set(specs) - set(targets))
    missing = sorted(set(targets) - set(specs))
    if unknown:
        odd = "names that are not parameters or persistent buffers of the model"
        raise ValueError(f"{where} has {len(unknown)} {odd}, e.g. {unknown[:3]}")
    if strict and missing:
        raise ValueError(f"{where} lacks {len(missing)} model names, e.g. {missing[:3]}")
    for name, (dtype, shape) in specs.items():
        target = targets[name]
        at = f"{where}[{name!r}]"
        if tuple(shape) != tuple(target.shape):
            raise ValueError(f"{at} has shape {tuple(shape)}, the model expects {tuple(target.shape)}")
        if target.is_floating_point() and dtype not in _LOADABLE_FLOATS:
            floats = "float16, bfloat16, float32 or float64"
            raise ValueError(f"{at} has dtype {dtype}; the model's floating tensor takes only {floats}")
        if not target.is_floating_point() and dtype != target.dtype:
            raise ValueError(f"{at} has dtype {dtype}, the model's buffer is {target.dtype}")


def check_finite(state_dict: Mapping[str, Tensor], targets: Mapping[str, Tensor]) -> None:
    """Refuse floating values that are not finite once cast to their target's dtype (``3.4e38``
    into bfloat16 too). Cost: one cast and check a tensor at a time; one host sync per device.

    Args:
        state_dict: name -> uploaded tensor, names already checked by `check_weights`.
        targets: the model's loadable tensors (`loadable_targets`).

    Raises:
        ValueError: naming the first such tensor and how many of its values are not finite.
    """
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


def serving_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A fresh ``type(model)(config)`` with a copy of the weights, without the source's hooks (its
    replay backend must not see serving forwards).

    Args:
        model: a Hugging Face causal LM (it has a ``.config``).

    Returns:
        The copy, on the CPU, in ``model``'s dtypes. Cost: one init (a forked RNG, so the global
        one is untouched) and one copy of every tensor.

    Raises:
        TypeError: ``model`` has no ``.config``.
    """
    if getattr(model, "config", None) is None:
        raise TypeError(f"expected a Hugging Face causal LM with a .config, got {type(model).__name__}")
    with torch.random.fork_rng(devices=[]):
        fresh = type(model)(copy.deepcopy(model.config))
    fresh.load_state_dict(model.state_dict())
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh
