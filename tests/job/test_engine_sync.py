"""Weight sync from the job to external engines (r3lightning-serve over HTTP, SGLang through a shared directory)."""

from __future__ import annotations

import pytest

from r3lightning.app.job.main import compose_config
from r3lightning.app.job.setup import JobError


async def test_sglang_weight_sync_through_a_shared_directory(tmp_path):
    """rollout.weight_sync_dir: the weights land in the directory as bf16 safetensors (plus the
    checkpoint's config.json) and the engine is told to load them; a refusal is a JobError."""
    import asyncio
    import json

    import torch
    from aiohttp import web
    from safetensors.torch import load_file

    from r3lightning.app.job.engine import _sglang_disk_push

    answers = [{"success": True, "message": "ok"}, {"success": False, "message": "shape mismatch"}]
    seen: list[dict] = []

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "weights": load_file(f"{body['model_path']}/model.safetensors")})
        return web.json_response(answers[len(seen) - 1])

    app = web.Application()
    app.router.add_post("/update_weights_from_disk", update)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    target = tmp_path / "shared"
    push = _sglang_disk_push([url], None, 10.0, target, str(source))
    state = {"lm_head.weight": torch.randn(3, 2), "model.norm.weight": torch.arange(4.0)}
    try:
        await asyncio.to_thread(push, state, 1)
        assert seen[0]["body"] == {"model_path": str(target)}
        assert set(seen[0]["weights"]) == set(state)
        for name, value in state.items():
            assert seen[0]["weights"][name].dtype == torch.bfloat16
            assert torch.equal(seen[0]["weights"][name], value.to(torch.bfloat16))
        assert json.loads((target / "config.json").read_text()) == {"model_type": "qwen3_moe"}
        with pytest.raises(
            JobError, match=r"update_weights_from_disk at .* failed: HTTP 200: .*shape mismatch"
        ):
            await asyncio.to_thread(push, state, 1)
    finally:
        await runner.cleanup()


def test_external_engine_weight_sync_follows_the_protocol(tmp_path, monkeypatch):
    """Every rank joins the full-weight gather exactly when rank 0 has somewhere to push it."""
    from r3lightning.app.job.engine import embedded_server

    url = ["rollout.url=http://10.0.0.1:30000/"]
    sglang = [*url, "rollout.protocol=sglang"]
    with embedded_server(compose_config([*url, "rollout=skyrl"])) as engine:
        assert engine.urls == ["http://10.0.0.1:30000"] and engine.push is not None and engine.gather
    with embedded_server(compose_config([*sglang, f"rollout.weight_sync_dir={tmp_path}"])) as engine:
        assert engine.push is not None and engine.gather
    with (
        pytest.warns(UserWarning, match="weight_sync_dir is not set"),
        embedded_server(compose_config(sglang)) as engine,
    ):
        assert engine.push is None and not engine.gather  # nothing to push: no collective either
    with embedded_server(compose_config([*url, "rollout.sync_weights=false"])) as engine:
        assert engine.push is None and not engine.gather
    monkeypatch.setenv("RANK", "1")  # other ranks join the gather but never push
    with embedded_server(compose_config([*url, "rollout=skyrl"])) as engine:
        assert engine.push is None and engine.gather
    with embedded_server(compose_config([])) as engine:  # the embedded server runs on rank 0 only
        assert engine.urls is None and engine.push is None and engine.gather
