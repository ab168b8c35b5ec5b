"""A calculator task whose tool fails on every turn: every group of every step is dropped."""

from __future__ import annotations

from r3lightning.app.tasks.calculator import CalculatorEnvironment, CalculatorTask


class BrokenToolEnvironment(CalculatorEnvironment):
    def step(self, response):
        raise RuntimeError("the tool is broken")


class BrokenToolTask(CalculatorTask):
    def make_environment(self, score):
        return BrokenToolEnvironment(self, score)
