"""Tiny transformers configs and independent gate-weight references for the router family tests.

Each reference recomputes, in float64 and from the family's modeling source, the gate weights a
router gives its (given) experts; none calls the package's own weight functions.
"""

import math

import torch

VOCAB = 96

TINY_TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 16,
}


def phimoe_reference(router, logits, indices):
    """PhiMoE's sparsemixer for given experts, row by row: slot ``k`` takes the softmax over the
    experts no earlier slot took whose logit is within ``2 * router_jitter_noise`` (relative to
    ``max(|logit|, best)``) of the best of them, at its expert (0 when that expert is outside)."""
    band = 2 * router.router_jitter_noise
    out = torch.zeros(indices.shape, dtype=torch.float64)
    for n, (row, chosen) in enumerate(zip(logits.double().tolist(), indices.tolist(), strict=True)):
        taken = set()
        for k, expert in enumerate(chosen):
            rest = [j for j in range(len(row)) if j not in taken]
            best = max(row[j] for j in rest)
            # 0 / 0 (an all-zero row) compares False in the model: such experts stay
            kept = [j for j in rest if best == row[j] or (best - row[j]) / max(abs(row[j]), best) <= band]
            if expert in kept:
                out[n, k] = math.exp(row[expert] - best) / sum(math.exp(row[j] - best) for j in kept)
            taken.add(expert)
    return out


def reference_weights(kind, router, logits, indices):
    """The family's gate weights for given experts, in float64, written from the model sources."""
    if kind == "phimoe":
        return phimoe_reference(router, logits, indices)
    logits = logits.double()
    if kind == "softmax_of_selected":
        return logits.gather(1, indices).softmax(-1)
    if kind == "sigmoid":
        w = logits.sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * router.routed_scaling_factor
    w = logits.softmax(-1).gather(1, indices)
    if kind == "softmax_scaled":
        return w * router.routed_scaling_factor
    if kind == "ernie":
        return w / w.sum(-1, keepdim=True).clamp(min=router.norm_min)
    if kind == "softmax_renormalised" or (kind == "softmax" and router.norm_topk_prob):
        return w / w.sum(-1, keepdim=True)
    return w


def router_weight(router):
    return next(p for name, p in router.named_parameters() if name.endswith("weight"))
