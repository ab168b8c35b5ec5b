"""Which Hugging Face router types can be replayed, and how: the router adapter registry. Built-in
families (``_BUILTIN``) are registered lazily from the installed transformers; `register_router`
adds others. The gate-weight functions ``(router, logits [N, E], experts [N, K] int64) -> [N, K]``,
each named for the family it was written from (the families it serves: the docs' "Modes"):
``qwen3_moe_weights``, ``qwen3_5_moe_weights``, ``mixtral_weights``, ``deepseek_v3_weights``,
``deepseek_v2_weights``, ``ernie_weights``, ``gpt_oss_weights``, ``phimoe_weights``."""

import importlib
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GateWeightsFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class RouterAdapter:
    """How to replay one router type: where its output tuple holds the logits, gate weights and
    expert indices, and ``gate_weights``, its own formula for given indices."""

    gate_weights: GateWeightsFn
    top_k_attr: str = "top_k"
    num_experts_attr: str = "num_experts"
    output_positions: tuple[int, int, int] = (0, 1, 2)


def qwen3_moe_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3-MoE's weights: fp32 softmax over all experts, renormalised over the top-k if ``norm_topk_prob``.

    Args:
        router: The router: its ``norm_topk_prob``.
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        ``[N, K]`` in the logits' dtype.
    """
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def qwen3_5_moe_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Qwen3.5-MoE's weights: as `qwen3_moe_weights`, always renormalised.

    Args:
        router: The router module (unused).
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        ``[N, K]`` in the logits' dtype.
    """
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, indices)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)


def mixtral_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """Mixtral's weights: fp32 softmax over all experts, renormalised over the top-k.

    Args:
        router: The router module (unused).
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        float32 ``[N, K]``.
    """
    weights = F.softmax(logits.float(), dim=-1).gather(-1, indices)
    return weights / weights.sum(dim=-1, keepdim=True)


def deepseek_v3_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V3's weights: sigmoid scores, renormalised if ``norm_topk_prob``, times
    ``routed_scaling_factor``.

    Args:
        router: The router: its ``norm_topk_prob`` and ``routed_scaling_factor``.
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        ``[N, K]`` in the logits' dtype.
    """
    # the selection-only e_score_correction_bias and group limit play no part in the weights
    weights = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def deepseek_v2_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """DeepSeek-V2's weights: fp32 softmax over all experts times ``routed_scaling_factor``.

    Args:
        router: The router: its ``routed_scaling_factor``.
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        float32 ``[N, K]``.
    """
    weights = logits.softmax(dim=-1, dtype=torch.float32).gather(-1, indices)
    return weights * router.routed_scaling_factor


def ernie_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """ERNIE 4.5's weights: fp32 softmax, renormalised with the sum clamped at ``norm_min``.

    Args:
        router: The router: its ``norm_min``.
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        float32 ``[N, K]`` (the hook rounds it to the router's output dtype).
    """
    # fp32, as the router computes (moe_statics only selects); the hook rounds to its output dtype
    weights = F.softmax(logits.float(), dim=1, dtype=torch.float).gather(-1, indices)
    return weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=router.norm_min)


def gpt_oss_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """gpt-oss's weights: softmax over the selected experts' logits only.

    Args:
        router: The router module (unused).
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        ``[N, K]`` in the logits' dtype.
    """
    top = logits.gather(-1, indices)
    return F.softmax(top, dim=1, dtype=top.dtype)


def phimoe_weights(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """PhiMoE's sparsemixer weights for given experts, as inference computes it (the docs' "Modes").

    Args:
        router: The router: its ``router_jitter_noise``.
        logits: The router's logits ``[N, E]``.
        indices: int64 ``[N, K]``: the experts to weight (the replayed ones).

    Returns:
        ``[N, K]`` in the logits' dtype: one masked softmax per slot (``K`` passes over ``[N, E]``).
    """
    scores = logits
    band = 2 * router.router_jitter_noise
    columns = []
    for k in range(indices.shape[-1]):
        chosen = indices[:, k : k + 1]  # [N, 1]
        with torch.no_grad():
            best = scores.max(dim=-1, keepdim=True).values
            outside = (best - logits) / logits.abs().clamp(min=best) > band
        columns.append(scores.masked_fill(outside, float("-inf")).softmax(dim=-1).gather(-1, chosen))
        scores = scores.scatter(-1, chosen, float("-inf"))
    return torch.cat(columns, dim=-1)


# names before this release: importable, with a DeprecationWarning, until the next minor release
_RENAMED = {"softmax_then_topk_weights": "qwen3_moe_weights", "softmax_over_topk_weights": "gpt_oss_weights"}
_RENAMED |= {"softmax_renormalised_weights": "qwen3_5_moe_weights"}
_RENAMED |= {"sigmoid_scaled_weights": "deepseek_v3_weights", "softmax_scaled_weights": "deepseek_v2_weights"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    message = f"{__name__}.{name} is deprecated (removed in the next minor release); use {__name__}.{new}"
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    globals()[name] = globals()[new]  # warned once, as the other moved names
    return globals()[new]


_ADAPTERS: dict[type[nn.Module], RouterAdapter] = {}

# "<transformers model package>.<router class>" per formula, each checked against the router's own
# forward; imported lazily, so a transformers build without one of them still serves the others
_BUILTIN: dict[GateWeightsFn, str] = {
    qwen3_moe_weights: """qwen3_moe.Qwen3MoeTopKRouter qwen2_moe.Qwen2MoeTopKRouter olmoe.OlmoeTopKRouter
        qwen3_next.Qwen3NextTopKRouter flex_olmo.FlexOlmoTopKRouter mellum.MellumTopKRouter
        qwen3_omni_moe.Qwen3OmniMoeThinkerTextTopKRouter qwen3_omni_moe.Qwen3OmniMoeTalkerTextTopKRouter
        qwen4_exp.Qwen4ExpTextTopKRouter""",
    qwen3_5_moe_weights: """qwen3_5_moe.Qwen3_5MoeTopKRouter qwen3_vl_moe.Qwen3VLMoeTextTopKRouter
        qwen3_omni_moe.Qwen3OmniMoeTextTopKRouter hunyuan_v1_moe.HunYuanMoEV1Gate""",
    mixtral_weights: "mixtral.MixtralTopKRouter minimax.MiniMaxTopKRouter",
    deepseek_v3_weights: """deepseek_v3.DeepseekV3TopkRouter glm4_moe.Glm4MoeTopkRouter
        glm4_moe_lite.Glm4MoeLiteTopkRouter dots1.Dots1TopkRouter exaone_moe.ExaoneMoeTopkRouter
        solar_open.SolarOpenTopkRouter deepseek_v32.DeepseekV32TopkRouter glm4v_moe.Glm4vMoeTextTopkRouter
        glm5_next.Glm5NextTextTopkRouter glm_moe_dsa.GlmMoeDsaTopkRouter kimi_linear.KimiLinearTopkRouter
        mimo_v2_flash.MiMoV2FlashTopkRouter nemotron_h.NemotronHTopkRouter
        bailing_hybrid.BailingHybridTopkRouter dots3_note.Dots3NoteTextTopkRouter hy_v4.HYV4TopkRouter
        hy_v4_vl.HYV4VLTopkRouter axk1.AXK1TopkRouter axk2.AXK2TopkRouter""",
    deepseek_v2_weights: """deepseek_v2.DeepseekV2TopkRouter deepseek_ocr2.DeepseekOcr2TextTopkRouter
        unlimited_ocr.UnlimitedOcrTextTopkRouter""",
    ernie_weights: "ernie4_5_moe.Ernie4_5_MoeTopKRouter",
    gpt_oss_weights: """gpt_oss.GptOssTopKRouter aria.AriaTextTopKRouter granitemoe.GraniteMoeTopKRouter
        granitemoeshared.GraniteMoeSharedTopKRouter granitemoehybrid.GraniteMoeHybridTopKRouter
        granitemoe_swa.GraniteMoeSWATopKRouter""",
    phimoe_weights: "phimoe.PhimoeTopKRouter",
}

# Router types whose forward does not return (logits, weights, indices): no adapter can replay
# them through the output hook; the error says why instead of suggesting register_router.
_INCOMPATIBLE: dict[str, str] = {
    "Llama4Router": "its forward returns (dense scores [N, E], logits) without expert indices",
    "DbrxRouter": "its forward returns only the logits; the top-k is taken in the experts module",
}
_builtins_loaded: set[str] = set()  # 'family.RouterClass' names already looked up
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.(?!.*\.layers\.\d+\.)")  # the innermost layers.<i>.
_ROUTER_NAME_RE = re.compile(r"(Router|Gate|Gating)$|Top[Kk](Router|Gating)")
_OUTPUT = "(router_logits [N, E], gate_weights [N, K], expert_indices [N, K])"


def register_router(module_type: type[nn.Module], adapter: RouterAdapter) -> None:
    """Makes ``HFRouterReplay`` find and replay routers of a type (the type or any subclass).

    Args:
        module_type: The router's ``nn.Module`` class. Its forward must return
            ``(router_logits [N, E], gate_weights [N, K], expert_indices [N, K])`` (positions set
            by the adapter), and it must sit in a ``layers.<i>`` module list.
        adapter: Where the outputs are, the top-k / expert-count attributes, and the gate-weight
            formula (one of this module's ``*_weights`` functions, or your own).

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass or ``adapter`` not a
            ``RouterAdapter``.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(adapter, RouterAdapter):
        raise TypeError(f"adapter must be a RouterAdapter, got {type(adapter).__name__}")
    _ADAPTERS[module_type] = adapter


def _load_builtins(*, imported_only: bool = False) -> None:
    """Register the built-in routers; ``imported_only``: of imported families only (not all ~40)."""
    for gate_weights, names in _BUILTIN.items():
        adapter = RouterAdapter(gate_weights)
        for name in names.split():
            family, class_name = name.split(".")
            module_name = f"transformers.models.{family}.modeling_{family}"
            if name in _builtins_loaded or (imported_only and module_name not in sys.modules):
                continue
            _builtins_loaded.add(name)
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            router_cls = getattr(module, class_name, None)
            if router_cls is not None:
                _ADAPTERS.setdefault(router_cls, adapter)


def registered_router_types() -> list[type[nn.Module]]:
    """Every router type replay knows: built-in ones of the installed transformers, then registered."""
    _load_builtins()
    return list(_ADAPTERS)


def _adapter_for(module: nn.Module) -> RouterAdapter | None:
    # by the class or a base: FSDP2 swaps in a subclass of the router's own class
    return next((_ADAPTERS[cls] for cls in type(module).__mro__ if cls in _ADAPTERS), None)


def find_routers(model: nn.Module) -> list[tuple[int, str, nn.Module, RouterAdapter]]:
    """The registered routers inside a model, by decoder layer.

    Args:
        model: The MoE model (or the part of it one rank holds).

    Returns:
        ``(decoder layer, qualified name, router, adapter)`` of every router of a registered type,
        sorted by layer (the innermost ``layers.<i>.`` in its name). Loads the built-in adapters
        of the transformers families already imported.

    Raises:
        ValueError: No registered router (the message says how to register one, or why the
            router type cannot be replayed), a router outside a ``layers.<i>`` list, or two
            routers on one layer.
    """
    _load_builtins(imported_only=True)
    found: list[tuple[int, str, nn.Module, RouterAdapter]] = []
    for name, module in model.named_modules():
        adapter = _adapter_for(module)
        if adapter is None:
            continue
        match = _LAYER_RE.search(f".{name}.")
        if match is None:
            where = f"router {name!r} ({type(module).__name__})"
            raise ValueError(f"{where} is not inside a 'layers.<i>' module list: no decoder-layer index")
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


def _no_router_message(model: nn.Module) -> str:
    model_name = type(model).__name__
    like = ((name, type(m)) for name, m in model.named_modules() if _ROUTER_NAME_RE.search(type(m).__name__))
    name, cls = next(like, ("", None))
    fix = (
        "    from r3lightning.replay.hf.routers import RouterAdapter, qwen3_moe_weights, register_router\n"
        f"    register_router({cls.__name__ if cls else 'MyRouter'}, RouterAdapter(gate_weights=qwen3_moe_weights))"
    )
    if cls is None:
        known = sorted(c.__name__ for c in _ADAPTERS)
        return f"no MoE router found in {model_name}; supported router types: {known}. Yours replays once registered:\n{fix}"
    where = f"{name!r} ({cls.__module__}.{cls.__name__})"
    reason = _INCOMPATIBLE.get(cls.__name__)
    if reason:
        return f"{model_name}'s router {where} cannot be replayed: {reason}, while replay rewrites {_OUTPUT}"
    unknown = f"{model_name} has no registered MoE router; {name!r} is a {cls.__module__}.{cls.__name__}"
    register = f"If its forward returns {_OUTPUT}, register it with its gate-weight function"
    return f"{unknown}, a router type r3lightning does not know. {register} (or one of your own):\n{fix}"
