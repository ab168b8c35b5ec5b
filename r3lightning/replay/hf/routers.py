"""Which Hugging Face router module types can be replayed, and how: the router adapter registry.

A :class:`RouterAdapter` tells :class:`~r3lightning.replay.hf.replay.HFRouterReplay` where a router's
forward returns its logits, gate weights and expert indices, and how the family turns live logits
into gate weights for given experts. The built-in families are registered lazily from the
installed transformers; :func:`register_router` adds others. :func:`find_routers` maps every
registered router of a model to its absolute decoder-layer index.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (router module, live logits [N, E], expert ids [N, K] int64) -> gate weights [N, K]
GateWeightsFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class RouterAdapter:
    """How to replay one router module type.

    The router's forward must return a tuple holding the logits, the gate weights and the expert
    indices at ``output_positions`` (in that order); ``gate_weights`` recomputes the weights for
    given indices exactly as the router itself does after its top-k selection.
    """

    gate_weights: GateWeightsFn
    top_k_attr: str = "top_k"
    num_experts_attr: str = "num_experts"
    output_positions: tuple[int, int, int] = (0, 1, 2)


def softmax_then_topk_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3-MoE, Qwen2-MoE, OLMoE, Qwen3-Next, FlexOlmo: fp32 softmax over all experts, top-k
    renormalisation when ``router.norm_topk_prob``, cast back to the logits' dtype."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def softmax_renormalised_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3.5-MoE, Qwen3-VL-MoE, Hunyuan-MoE: as :func:`softmax_then_topk_weights`, always
    renormalised over the top-k (these routers have no ``norm_topk_prob`` switch)."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)


def mixtral_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Mixtral, MiniMax: fp32 softmax over all experts, always renormalised over the top-k, kept
    in fp32."""
    weights = F.softmax(logits.float(), dim=-1).gather(-1, indices)
    return weights / weights.sum(dim=-1, keepdim=True)


def sigmoid_scaled_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V3 and its router copies (GLM-4 MoE, dots1, EXAONE-MoE, ...): sigmoid scores; the
    selection-only ``e_score_correction_bias`` and group limit play no part in the weights;
    optional renormalisation, then ``routed_scaling_factor``."""
    weights = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_scaled_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V2 (and the DeepSeek-OCR-2 / Unlimited-OCR text routers): fp32 softmax over all experts (the group limit only selects), times
    ``routed_scaling_factor``, no renormalisation."""
    weights = logits.softmax(dim=-1, dtype=torch.float32).gather(-1, indices)
    return weights * router.routed_scaling_factor


def ernie_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """ERNIE-4.5-MoE: fp32 softmax over all experts (the ``moe_statics`` bias only selects),
    renormalised with the sum clamped at ``router.norm_min``.

    Returned in fp32, the router's logits dtype; the replay hook rounds it to the dtype of the
    weights the router returned (its input's), as the router itself does.
    """
    weights = F.softmax(logits.float(), dim=1, dtype=torch.float).gather(-1, indices)
    return weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=router.norm_min)


def softmax_over_topk_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """gpt-oss, Aria: softmax over the selected logits only."""
    top = logits.gather(-1, indices)
    return F.softmax(top, dim=1, dtype=top.dtype)


_ADAPTERS: dict[type[nn.Module], RouterAdapter] = {}

_SOFTMAX = RouterAdapter(softmax_then_topk_weights)
_RENORMALISED = RouterAdapter(softmax_renormalised_weights)
_SIGMOID = RouterAdapter(sigmoid_scaled_weights)

# (transformers model package, router class, adapter) of the built-in families, each checked
# against the router's own forward; imported lazily so that a transformers build without one of
# them still serves the others.
_BUILTIN: tuple[tuple[str, str, RouterAdapter], ...] = (
    ("qwen3_moe", "Qwen3MoeTopKRouter", _SOFTMAX),
    ("qwen2_moe", "Qwen2MoeTopKRouter", _SOFTMAX),
    ("olmoe", "OlmoeTopKRouter", _SOFTMAX),
    ("qwen3_next", "Qwen3NextTopKRouter", _SOFTMAX),
    ("flex_olmo", "FlexOlmoTopKRouter", _SOFTMAX),
    ("qwen3_5_moe", "Qwen3_5MoeTopKRouter", _RENORMALISED),
    ("qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter", _RENORMALISED),
    ("qwen3_omni_moe", "Qwen3OmniMoeTextTopKRouter", _RENORMALISED),
    ("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextTopKRouter", _SOFTMAX),
    ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextTopKRouter", _SOFTMAX),
    ("qwen4_exp", "Qwen4ExpTextTopKRouter", _SOFTMAX),
    ("mellum", "MellumTopKRouter", _SOFTMAX),
    ("hunyuan_v1_moe", "HunYuanMoEV1Gate", _RENORMALISED),
    ("mixtral", "MixtralTopKRouter", RouterAdapter(mixtral_weights)),
    ("minimax", "MiniMaxTopKRouter", RouterAdapter(mixtral_weights)),
    ("deepseek_v3", "DeepseekV3TopkRouter", _SIGMOID),
    ("glm4_moe", "Glm4MoeTopkRouter", _SIGMOID),
    ("glm4_moe_lite", "Glm4MoeLiteTopkRouter", _SIGMOID),
    ("dots1", "Dots1TopkRouter", _SIGMOID),
    ("exaone_moe", "ExaoneMoeTopkRouter", _SIGMOID),
    ("solar_open", "SolarOpenTopkRouter", _SIGMOID),
    ("deepseek_v32", "DeepseekV32TopkRouter", _SIGMOID),
    ("glm4v_moe", "Glm4vMoeTextTopkRouter", _SIGMOID),
    ("glm5_next", "Glm5NextTextTopkRouter", _SIGMOID),
    ("glm_moe_dsa", "GlmMoeDsaTopkRouter", _SIGMOID),
    ("kimi_linear", "KimiLinearTopkRouter", _SIGMOID),
    ("mimo_v2_flash", "MiMoV2FlashTopkRouter", _SIGMOID),
    ("nemotron_h", "NemotronHTopkRouter", _SIGMOID),
    ("bailing_hybrid", "BailingHybridTopkRouter", _SIGMOID),
    ("dots3_note", "Dots3NoteTextTopkRouter", _SIGMOID),
    ("hy_v4", "HYV4TopkRouter", _SIGMOID),
    ("hy_v4_vl", "HYV4VLTopkRouter", _SIGMOID),
    ("axk1", "AXK1TopkRouter", _SIGMOID),
    ("axk2", "AXK2TopkRouter", _SIGMOID),
    ("deepseek_v2", "DeepseekV2TopkRouter", RouterAdapter(softmax_scaled_weights)),
    ("deepseek_ocr2", "DeepseekOcr2TextTopkRouter", RouterAdapter(softmax_scaled_weights)),
    ("unlimited_ocr", "UnlimitedOcrTextTopkRouter", RouterAdapter(softmax_scaled_weights)),
    ("ernie4_5_moe", "Ernie4_5_MoeTopKRouter", RouterAdapter(ernie_weights)),
    ("gpt_oss", "GptOssTopKRouter", RouterAdapter(softmax_over_topk_weights)),
    ("aria", "AriaTextTopKRouter", RouterAdapter(softmax_over_topk_weights)),
)

# Router types whose forward does not return (logits, weights, indices): no adapter can replay
# them through the output hook; the error says why instead of suggesting register_router.
_INCOMPATIBLE: dict[str, str] = {
    "Llama4Router": "its forward returns (dense scores [N, E], logits) without expert indices",
    "DbrxRouter": "its forward returns only the logits; the top-k is taken in the experts module",
}
_builtins_loaded: set[str] = set()  # router class names already looked up


def register_router(module_type: type[nn.Module], adapter: RouterAdapter) -> None:
    """Make ``HFRouterReplay`` find and replay routers of ``module_type`` (exact type or subclass)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(adapter, RouterAdapter):
        raise TypeError(f"adapter must be a RouterAdapter, got {type(adapter).__name__}")
    _ADAPTERS[module_type] = adapter


def _load_builtins(*, imported_only: bool = False) -> None:
    """Register the built-in families' routers. ``imported_only``: only families whose modeling
    module is imported already (as it is for every router of a model that exists), so finding a
    model's routers never imports the ~40 other families (a second or more at startup)."""
    for family, class_name, adapter in _BUILTIN:
        name = f"transformers.models.{family}.modeling_{family}"
        if class_name in _builtins_loaded or (imported_only and name not in sys.modules):
            continue
        _builtins_loaded.add(class_name)
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        router_cls = getattr(module, class_name, None)
        if router_cls is not None:
            _ADAPTERS.setdefault(router_cls, adapter)


def registered_router_types() -> list[type[nn.Module]]:
    """Every router type replay knows: the built-in families found in the installed
    transformers, then those added with :func:`register_router`."""
    _load_builtins()
    return list(_ADAPTERS)


def _adapter_for(module: nn.Module) -> RouterAdapter | None:
    for cls in type(module).__mro__:  # FSDP2 swaps in a subclass of the router's own class
        if cls in _ADAPTERS:
            return _ADAPTERS[cls]
    return None


_LAYER_RE = re.compile(r"\.layers\.(\d+)\.(?!.*\.layers\.\d+\.)")


def find_routers(model: nn.Module) -> list[tuple[int, str, nn.Module, RouterAdapter]]:
    """``(decoder layer, qualified name, router, adapter)`` of every registered router, by layer.

    The layer is the ``<i>`` of the innermost ``layers.<i>.`` in the router's qualified name (the
    Hugging Face decoder-layer list); routers outside such a list, several routers on one layer,
    or none at all raise ``ValueError`` naming the model class.
    """
    _load_builtins(imported_only=True)
    found: list[tuple[int, str, nn.Module, RouterAdapter]] = []
    for name, module in model.named_modules():
        adapter = _adapter_for(module)
        if adapter is None:
            continue
        match = _LAYER_RE.search(f".{name}.")
        if match is None:
            raise ValueError(
                f"router {name!r} ({type(module).__name__}) is not inside a 'layers.<i>' module list; "
                "cannot tell its decoder-layer index"
            )
        found.append((int(match.group(1)), name, module, adapter))
    if not found:
        raise ValueError(_no_router_message(model))
    found.sort(key=lambda item: item[0])
    layers = [layer for layer, *_ in found]
    if len(set(layers)) != len(layers):
        raise ValueError(
            f"several routers of {type(model).__name__} map to the same decoder layer "
            f"({[name for _, name, *_ in found]}); pass the single MoE model whose routes are replayed"
        )
    return found


_ROUTER_NAME_RE = re.compile(r"(Router|Gate|Gating)$|Top[Kk](Router|Gating)")


def _no_router_message(model: nn.Module) -> str:
    """Why ``model`` has nothing to replay, naming the router-like module found and the fix."""
    model_name = type(model).__name__
    candidate = next(
        ((name, type(m)) for name, m in model.named_modules() if _ROUTER_NAME_RE.search(type(m).__name__)),
        None,
    )
    if candidate is None:
        known = sorted(cls.__name__ for cls in _ADAPTERS)
        return (
            f"no MoE router found in {model_name}; supported router types: {known}. A router type of "
            "your own is replayed once registered:\n" + _register_fix("MyRouter")
        )
    name, cls = candidate
    reason = _INCOMPATIBLE.get(cls.__name__)
    if reason is not None:
        return (
            f"{model_name}'s router {name!r} ({cls.__module__}.{cls.__name__}) cannot be replayed: "
            f"{reason}, while replay rewrites a router output (router_logits [N, E], gate_weights "
            "[N, K], expert_indices [N, K])"
        )
    return (
        f"{model_name} has no registered MoE router; {name!r} is a {cls.__module__}.{cls.__name__}, a "
        "router type r3lightning does not know. If its forward returns (router_logits [N, E], "
        "gate_weights [N, K], expert_indices [N, K]), register it with the function that turns logits "
        "into its gate weights for given experts (or one of your own):\n" + _register_fix(cls.__name__)
    )


def _register_fix(class_name: str) -> str:
    return (
        "    from r3lightning.replay.hf.routers import RouterAdapter, register_router, "
        "softmax_then_topk_weights\n"
        f"    register_router({class_name}, RouterAdapter(gate_weights=softmax_then_topk_weights))"
    )
