"""The job as a user runs it: from the built wheel, in a folder of their own, with their own
module, reward and callbacks given by ``_target_`` in their own YAML, never editing the package."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

USER_CODE = '''
from pathlib import Path

import r3lightning
from r3lightning.app.job.module import GRPOModule


class MarkedModule(GRPOModule):
    """A user's LightningModule: records where the package came from when the fit starts."""

    def __init__(self, *args, marker: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.marker = marker

    def on_fit_start(self):
        Path(self.marker).write_text(r3lightning.__file__)


def length_reward(prompt_ids, response_ids, scale):
    return scale * len(response_ids)
'''


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory) -> Path:
    """The package built as a wheel (from a copy of the sources) and installed, without its
    dependencies, into a folder of its own; returns that folder (a ``PYTHONPATH`` entry)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("r3lightning", "conf"):  # conf/ is copied into the wheel by setup.py
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (root / "dist").glob("r3lightning-*.whl")
    target = root / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "r3lightning" / "conf" / "config.yaml").is_file()
    assert (target / "r3lightning" / "conf" / "model" / "tiny_megatron_moe.yaml").is_file()
    return target


def test_job_from_the_wheel_with_user_module_reward_and_callback(installed_wheel, tmp_path):
    user = tmp_path / "user"
    (user / "conf" / "reward").mkdir(parents=True)
    (user / "userpkg.py").write_text(USER_CODE)
    (user / "conf" / "reward" / "length.yaml").write_text(
        textwrap.dedent(
            """\
            # every response token scores `scale`
            _target_: userpkg.length_reward
            _partial_: true
            scale: 0.25
            """
        )
    )
    marker = tmp_path / "module.txt"
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(installed_wheel), str(user)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "r3lightning.app.job.main",
            "--config-dir",
            str(user / "conf"),
            "reward=length",
            "module._target_=userpkg.MarkedModule",
            f"+module.marker={marker}",
            "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
            "steps=1",
            "prompts_per_step=2",
            "plot=false",
            "trainer.enable_progress_bar=false",
            f"hydra.run.dir={out}",
        ],
        cwd=tmp_path,  # not the source checkout
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the package ran from the wheel, with the user's LightningModule
    assert Path(marker.read_text()).resolve().is_relative_to(installed_wheel.resolve())
    # the user's reward: 4 response tokens x 0.25 for every sample (the token-class reward: ~0.5)
    with open(out / "replay_r3" / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["reward"]) == 1.0 and float(row["reward_std"]) == 0.0
    # the callback added by _target_ logged the learning rate (algorithm.optim.lr)
    with open(out / "replay_r3" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rates = [float(r["lr-AdamW"]) for r in csv.DictReader(f) if r.get("lr-AdamW")]
    assert rates and all(r == pytest.approx(5e-3) for r in rates)
    config = (out / "config.yaml").read_text()
    assert "_target_: userpkg.MarkedModule" in config and "_target_: userpkg.length_reward" in config
