"""Settings of the embedded engine and server refused when built, each boundary tried on both
sides, and uploads that must be a 400 without touching the weights or their version."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save
from server_support import post, same_weights, still_serving, weights_of

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.server import RolloutServer


@pytest.mark.parametrize("device", ["tpu", "tpu:0", "cuda:x", "meta", 3.5, ["cpu"]])
def test_engine_device_that_cannot_serve_is_refused_when_built(device):
    with pytest.raises(ValueError, match=r"^device must be None, 'cpu', 'cuda' or 'cuda:N', got "):
        EngineConfig(device=device)


def test_engine_device_cpu_and_the_cuda_devices_present():
    assert EngineConfig(device="cpu").device == "cpu"
    assert EngineConfig(device=torch.device("cpu")).device == torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        assert EngineConfig(device=f"cuda:{count - 1}").device == f"cuda:{count - 1}"
    with pytest.raises(ValueError, match=rf"^device 'cuda:{count}': .*; use 'cpu'$"):
        EngineConfig(device=f"cuda:{count}")  # one past the last device present


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1024", float("inf")])
def test_max_request_bytes_must_be_a_positive_integer_or_none(value):
    with pytest.raises(
        ValueError, match=rf"^max_request_bytes must be None or an integer >= 1, got {value!r}$"
    ):
        ServerLimits(max_request_bytes=value)


def test_max_request_bytes_accepts_one_and_none():
    assert ServerLimits(max_request_bytes=1).max_request_bytes == 1
    assert ServerLimits(max_request_bytes=None).max_request_bytes is None


def _body(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


async def test_a_deeply_nested_safetensors_header_is_a_400():
    nested = b"[" * 100_000 + b"]" * 100_000  # recursion in the JSON parser, not a server fault
    async with RolloutServer(build_tiny_moe(seed=0)) as srv:
        before = weights_of(srv)
        status, payload, _ = await post(f"{srv.url}/update_weights", _body(nested))
        assert status == 400, payload
        assert payload["error"]["message"].startswith("request body is not a safetensors file: header")
        assert same_weights(srv, before) and srv.weight_version == 0
        await still_serving(srv)


async def test_an_upload_of_no_tensor_is_a_400_and_keeps_the_weight_version():
    async with RolloutServer(build_tiny_moe(seed=0)) as srv:
        for upload in (save({}), _body(b'{"__metadata__": {"step": "3"}}')):
            status, payload, _ = await post(f"{srv.url}/update_weights", upload)
            assert status == 400 and payload["error"]["message"] == "upload holds no tensor: nothing to load"
        assert srv.weight_version == 0
        one = {"model.norm.weight": torch.ones(srv.engine.model.model.norm.weight.shape)}
        status, payload, _ = await post(f"{srv.url}/update_weights", save(one))
        assert status == 200 and payload == {"updated": 1, "weight_version": 1}  # one tensor is enough
        with pytest.raises(ValueError, match="state_dict holds no tensor: nothing to load"):
            srv.update_weights({})
        assert srv.weight_version == 1
        await still_serving(srv)


def test_the_settings_resolve_their_annotations_for_the_job():
    """The job checks config values against the fields' types (``typing.get_type_hints``), which
    must resolve although the module imports torch only when a config is built."""
    import typing

    hints = typing.get_type_hints(EngineConfig)
    assert set(hints) == {f for f in EngineConfig.__dataclass_fields__}
    assert EngineConfig(dtype="float32").dtype == torch.float32 and EngineConfig().dtype == torch.bfloat16
