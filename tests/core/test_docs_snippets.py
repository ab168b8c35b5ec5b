"""Every ```python block of README.md and docs/ runs as written: a page's blocks in order, in one
scope, in a temporary directory. ```py blocks are sketches that need a GPU cluster or an external
engine and are not run."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def _check_getting_started(scope: dict) -> None:
    import torch

    buffer, trainer = scope["buffer"], scope["trainer"]
    assert len(buffer) == 4 and trainer.global_step == 2
    for trajectory in (buffer[i] for i in range(4)):
        rows = trajectory.prompt_length + trajectory.response_length - 1  # the last token is never forwarded
        assert trajectory.routed_experts.shape == (rows, 4, 2)
    metrics = trainer.callback_metrics
    layers = sorted(k for k in metrics if k.startswith("used_agreement/"))
    assert layers == ["used_agreement/layer_01", "used_agreement/layer_02", "used_agreement/layer_03"]
    assert all(float(metrics[k]) == 1.0 for k in layers)  # the engine's experts, every MoE layer
    assert scope["rec"].routes.shape == (2, 5, 4, 2)
    assert scope["loss"].requires_grad and torch.isfinite(scope["loss"])


def _check_micro_batches(scope: dict) -> None:
    trainer = scope["trainer"]
    assert (
        trainer.global_step == 4
    )  # 2 epochs x 2 micro-batches, one optimiser step each, in one training step
    assert float(trainer.callback_metrics["router_replay/replayed_fraction"]) == 1.0


def _check_readme(scope: dict) -> None:
    agreement = scope["agreement"]
    assert agreement["r3"] == 1.0  # replayed: the engine's experts, every slot
    assert agreement["off"] < 0.95  # the simulated ~10% disagreement, routed natively


CHECKS = {
    "README.md": _check_readme,
    "docs/getting-started.md": _check_getting_started,
    "docs/recipes/lightning-module.md": _check_micro_batches,
}
RUNNABLE = [p for p in PAGES if python_blocks(p)]


def test_the_pages_with_checks_have_code():
    assert {str(p.relative_to(ROOT)) for p in RUNNABLE} >= set(CHECKS)


def test_the_readme_example_is_the_script_its_numbers_come_from():
    script = (ROOT / "examples" / "replay_agreement.py").read_text()
    assert python_blocks(ROOT / "README.md")[0] == script.split('"""\n\n', 1)[1]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Lightning's default logger writes lightning_logs/ here
    scope: dict = {"__name__": "__docs__"}
    for block in python_blocks(page):
        exec(compile(block, str(page), "exec"), scope)
    check = CHECKS.get(str(page.relative_to(ROOT)))
    if check is not None:
        check(scope)
