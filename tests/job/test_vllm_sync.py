"""The vLLM weight sync without an engine: the checkpoint it writes against ``save_pretrained``'s, and
the order of its calls against a stand-in server (the real engine's tests are in tests/engines/)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file

from r3lightning.app.job.common import JobError
from r3lightning.app.job.vllm_sync import vllm_disk_push
from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config
from r3lightning.app.vllm.weight_sync import checkpoint_tensors, write_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_holds_what_save_pretrained_writes_in_the_engine_dtype(tmp_path, dtype):
    """Names, shapes and values equal the file transformers writes for the same model (one tensor
    per expert where the trainer's model fuses them), cast to the engine's dtype."""
    config = tiny_moe_config(tie_word_embeddings=True)
    model = build_tiny_moe(config, seed=3)
    model.save_pretrained(tmp_path / "reference")
    reference = load_file(tmp_path / "reference" / "model.safetensors")
    written = load_file(
        write_checkpoint(tmp_path / "sync", checkpoint_tensors(model.state_dict(), config, dtype))
    )
    assert sorted(written) == sorted(reference)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in written and "lm_head.weight" not in written
    for name, value in reference.items():
        assert written[name].dtype == dtype and torch.equal(written[name], value.to(dtype)), name


def test_write_refuses_a_directory_with_other_checkpoints(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"holds other safetensors files \['model-00001-of-00002.safetensors'\]"
    ):
        write_checkpoint(tmp_path, {"x": torch.zeros(1)})


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("POST", "/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_sync_pauses_loads_resets_versions_and_resumes_in_that_order(tmp_path):
    """One checkpoint, then per engine: pause (waiting for requests in flight), reload from the
    directory, reset the prefix cache, set the version, resume; a failed reload stops there."""
    calls: list[tuple[str, str, object]] = []
    fail_reload = []

    async def handler(request: web.Request) -> web.Response:
        name, body = request.match_info["name"], await request.json() if request.can_read_body else None
        calls.append((name, request.query_string, body))
        if name == "collective_rpc":
            if fail_reload:
                return web.json_response(
                    {"error": {"message": "Worker failed with error 'bad header'"}}, status=500
                )
            return web.json_response({"results": [{"weights_path": body["kwargs"]["weights_path"]}]})
        return web.json_response({"success": True})

    runner, url = await _serve(handler)
    config = tiny_moe_config()
    push = vllm_disk_push([url], None, 10.0, tmp_path / "w", config, torch.float32)
    try:
        await asyncio.to_thread(push, build_tiny_moe(config).state_dict(), 4)
        path = str((tmp_path / "w").resolve())
        assert calls == [
            ("pause", "mode=wait", None),
            ("collective_rpc", "", {"method": "r3_reload_weights", "kwargs": {"weights_path": path}}),
            ("reset_prefix_cache", "", None),
            ("update_weight_version", "", {"new_version": "4"}),
            ("resume", "", None),
        ]
        calls.clear()
        fail_reload.append(True)
        with pytest.raises(
            JobError,
            match=r"policy version 5 failed at .*: r3_reload_weights .* gave HTTP 500: .*bad header.*the engine stays paused",
        ):
            await asyncio.to_thread(push, build_tiny_moe(config).state_dict(), 5)
        assert [name for name, _, _ in calls] == ["pause", "collective_rpc"]  # never resumed
    finally:
        await runner.cleanup()


async def test_an_engine_without_dev_mode_is_named(tmp_path):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    runner, url = await _serve(handler)
    config = tiny_moe_config()
    push = vllm_disk_push([url], None, 10.0, tmp_path / "w", config, torch.float32)
    try:
        with pytest.raises(JobError, match=r"has no /pause endpoint: start it with VLLM_SERVER_DEV_MODE=1"):
            await asyncio.to_thread(push, build_tiny_moe(config).state_dict(), 1)
    finally:
        await runner.cleanup()
