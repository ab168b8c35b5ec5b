"""A left-padded batch and model-independent random routes for the tiny Hugging Face MoE tests."""

import torch

B, S, VOCAB = 3, 10, 96


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.bool)
    attention_mask[0, :4] = False  # left padding
    attention_mask[2, :1] = False
    input_ids[~attention_mask] = 0
    return input_ids, attention_mask


def random_routes(num_layers, top_k, num_experts, seed=0, token_shape=(B, S)):
    """Distinct random experts per row, independent of any model."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(*token_shape, num_layers, num_experts, generator=g)
    return scores.argsort(dim=-1)[..., :top_k]
