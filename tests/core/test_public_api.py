"""The public names of ``r3lightning`` resolve lazily to their defining modules, and the README's
code that uses them runs as written."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import r3lightning

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("name", r3lightning.__all__)
def test_every_public_name_resolves_to_its_module(name):
    value = getattr(r3lightning, name)
    module = r3lightning._EXPORTS[name]
    assert value.__module__ == module or name in vars(sys.modules[module])
    assert name in dir(r3lightning)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'PackedTensors'"):
        r3lightning.PackedTensors  # noqa: B018


def _imported_after(names: str) -> str:
    code = (
        "import sys, r3lightning\n"
        f"{names}\n"
        "print(sorted(m for m in ('lightning', 'transformers', 'megatron') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_core_names_do_not_import_optional_dependencies():
    # packing, alignment and the rollout client need neither Lightning nor the model libraries
    core = "r3lightning.PackedTensor, r3lightning.TokenMetadataLayout, r3lightning.RemoteGenerateClient"
    assert _imported_after(core) == "[]"
    # the data module needs Lightning (which itself imports transformers when installed), never megatron
    assert "megatron" not in _imported_after("r3lightning.R3DataModule")


def _readme_python_blocks(section: str) -> list[str]:
    text = README.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


@pytest.mark.slow
def test_readme_trainer_snippets_run_as_written(tmp_path, monkeypatch):
    import torch

    from r3lightning.testing.tiny import build_tiny_moe

    trainer_code, context_code = _readme_python_blocks("Using it in your own Trainer")
    monkeypatch.chdir(tmp_path)  # Lightning's default logger writes lightning_logs/ here
    scope: dict = {}
    exec(compile(trainer_code, str(README), "exec"), scope)
    buffer, trainer = scope["buffer"], scope["trainer"]
    assert len(buffer) == 4 and trainer.global_step == 2
    for trajectory in (buffer[i] for i in range(4)):
        rows = trajectory.prompt_length + trajectory.response_length - 1  # the last token is never forwarded
        assert trajectory.routed_experts.shape == (rows, 4, 2)
    metrics = trainer.callback_metrics
    layers = sorted(k for k in metrics if k.startswith("used_agreement/"))
    assert layers == ["used_agreement/layer_01", "used_agreement/layer_02", "used_agreement/layer_03"]
    assert all(float(metrics[k]) == 1.0 for k in layers)  # the engine's experts, every MoE layer

    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = ids != 0  # left-padded
    scope = {"model": build_tiny_moe(seed=0), "ids": ids, "mask": mask}
    exec(compile(context_code, str(README), "exec"), scope)
    assert scope["rec"].routes.shape == (2, 5, 4, 2)
    assert scope["loss"].requires_grad and torch.isfinite(scope["loss"])
