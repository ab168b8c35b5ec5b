"""A real vLLM engine for the job and the tests: the launcher, its settings and the model it serves."""

from r3lightning.app.vllm.launcher import VllmServer, VllmStartError
from r3lightning.app.vllm.model import VLLM_HEAD_DIM, save_tiny_vllm_model, tiny_vllm_moe_config
from r3lightning.app.vllm.settings import ProcessOptions, ServeOptions, VllmSettings

__all__ = [
    "VLLM_HEAD_DIM",
    "ProcessOptions",
    "ServeOptions",
    "VllmServer",
    "VllmSettings",
    "VllmStartError",
    "save_tiny_vllm_model",
    "tiny_vllm_moe_config",
]
