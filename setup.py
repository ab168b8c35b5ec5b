"""The build copies the top-level ``conf/`` (the job's Hydra configs) into the wheel as
``r3lightning/conf`` so ``r3lightning-train`` runs from an installed wheel, from any directory.
Everything else is declared in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConf(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's conf/ directly
            shutil.copytree(
                Path(__file__).parent / "conf",
                Path(self.build_lib) / "r3lightning" / "conf",
                dirs_exist_ok=True,
            )


setup(cmdclass={"build_py": BuildPyWithConf})
