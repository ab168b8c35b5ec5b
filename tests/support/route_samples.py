"""Route arrays and reference decoders shared by the wire, body-parsing and validation tests."""

from __future__ import annotations

import base64

import numpy as np


def distinct_routes(rows: int, layers: int, top_k: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """``[rows, layers, top_k]`` ids, distinct within each row, uniform over ``num_experts``."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, layers, num_experts)), axis=-1)[..., :top_k]


def naive_decode(envelope: dict) -> np.ndarray:
    """The obvious decoder: standard-library base64, then numpy."""
    raw = base64.b64decode(envelope["data"], validate=True)
    return np.frombuffer(raw, dtype=np.dtype(envelope["dtype"]).newbyteorder("<")).reshape(envelope["shape"])
