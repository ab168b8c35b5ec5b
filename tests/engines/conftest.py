"""Real vLLM engines for the whole test session, one per dtype, started only when a test asks.

Fixtures (session scope):
- ``vllm_model_dir``: the tiny vLLM model (``save_tiny_vllm_model``, seed ``VLLM_SEED``) with its tokenizer.
- ``vllm_fp32`` / ``vllm_bf16``: a started :class:`VllmServer` serving it in that dtype, with routes
  and dev mode (weight-sync endpoints); ``.url`` for clients, ``.settings.model`` for the weights.
  A test that changes an engine's weights restores the ``VLLM_SEED`` weights before it ends.
- ``vllm_engine_python``: the engine's Python; the session fails (not skips) without it, saying
  ``make vllm``, unless ``R3_SKIP_VLLM=1`` asks to skip every ``vllm`` test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_engines import start_engine

from r3lightning.app.vllm import VllmServer, save_tiny_vllm_model
from r3lightning.app.vllm.settings import engine_python

VLLM_SEED = 0
SKIP_ENV = "R3_SKIP_VLLM"


@pytest.fixture(scope="session")
def vllm_engine_python() -> Path:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the tests against a real vLLM engine are skipped")
    try:
        return engine_python()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (or set {SKIP_ENV}=1 to skip the vLLM tests)", pytrace=False)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vllm_model(tmp_path_factory.mktemp("vllm-model"), seed=VLLM_SEED)


@pytest.fixture(scope="session")
def vllm_fp32(vllm_engine_python, vllm_model_dir, tmp_path_factory) -> Iterator[VllmServer]:
    yield from start_engine(
        vllm_model_dir, vllm_engine_python, tmp_path_factory.mktemp("logs"), dtype="float32"
    )


@pytest.fixture(scope="session")
def vllm_bf16(vllm_engine_python, vllm_model_dir, tmp_path_factory) -> Iterator[VllmServer]:
    yield from start_engine(
        vllm_model_dir, vllm_engine_python, tmp_path_factory.mktemp("logs"), dtype="bfloat16"
    )
