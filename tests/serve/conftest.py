import pytest
import torch

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.server import RolloutServer


@pytest.fixture
async def srv():
    """A running server of the seed-0 tiny MoE in fp32, batches of up to 8 requests."""
    async with RolloutServer(
        build_tiny_moe(seed=0), engine=EngineConfig(dtype=torch.float32, max_batch_size=8)
    ) as server:
        yield server
