"""A refused config, and ``--help``, are answered before torch, Lightning, transformers or
megatron-core is imported: the job's config modules import none of them at module level, and a
fresh ``r3lightning-train`` whose imports of them fail still refuses every kind of bad value in
one line (exit status 2) and prints its help (exit status 0)."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest
from python_process import run_python

from r3lightning.app.job.main import compose_config
from r3lightning.app.job.run_dir import fingerprint

PACKAGE = Path(__file__).resolve().parents[2] / "r3lightning"
HEAVY = ("torch", "lightning", "transformers", "megatron")
# what Hydra imports to compose the config and run the callback that checks it
ENTRY_POINTS = ("r3lightning.app.job.main", "r3lightning.app.job.hooks", "r3lightning.app.job.help")

# A fresh interpreter in which importing any HEAVY package fails and is noted in a file, then the
# job's entry point as the console script runs it.
BLOCKED_JOB = textwrap.dedent(
    f"""
    import os, runpy, sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {HEAVY!r}:
                with open(os.environ["R3_BLOCKED_LOG"], "a") as log:
                    log.write(name + "\\n")
                raise ImportError(f"{{name}} is blocked by the test")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.argv = ["r3lightning-train", *sys.argv[1:]]
    runpy.run_module("r3lightning.app.job.main", run_name="__main__")
    """
)

REFUSED = [
    # a wrong type: Hydra's structured config refuses it
    (["steps=abc"], "steps must be an integer, got 'abc'"),
    (["rollout.retry.timeout_s=abc"], "rollout.retry.timeout_s must be a number, got 'abc'"),
    # an unknown key, of the job and of a library settings object
    (["no_such_key=1"], "no_such_key is not a setting of JobConfig (a typo, or a key of another group?)"),
    (
        ["rollout.collector.max_inflight=2"],
        "rollout.collector.max_inflight is not a setting of CollectorConfig (a typo, or a key of another group?)",
    ),
    # an out-of-range value: the settings dataclass's own check
    (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p must be a number in (0, 1], got 1.5"),
    (["algorithm.clip_low=1.5"], "algorithm.clip_low must be a number in (0, 1), got 1.5"),
    (
        ["data.options.layers=[2,1]"],
        "data.options.layers must be None or sorted, unique decoder-layer ids >= 0, got [2, 1]",
    ),
    (
        ["rollout.server.dtype=int8"],  # the engine's settings, whose built form holds a torch dtype
        "rollout.server.dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'",
    ),
    # a bad choice: of a value, and of a group's option
    (["replay.mode=r4"], "replay.mode must be one of ['r3', 'r2', 'off'], got 'r4'"),
    (
        ["algorithm.correction.mode=tis"],
        "algorithm.correction.mode must be one of ['none', 'token_tis', 'sequence_tis', 'geometric_mask', "
        "'token_mask'], got 'tis'",
    ),
    (
        ["replay=sometimes"],
        "In 'config': Could not find 'replay/sometimes' Available options in 'replay': off, r2, r3",
    ),
    # a moved key
    (["data.shard=true"], "data.shard moved to data.options.shard; set data.options.shard=true instead"),
    # the nodes built after the model: checked before it
    (["task.num_classes=1"], "task.num_classes must be an integer >= 2, got 1"),
    (["task=calculator", "task.max_turns=0"], "task.max_turns must be an integer >= 1, got 0"),
    (
        ["model.dtype=float33"],
        "model.dtype must be one of ['bfloat16', 'float16', 'float32', 'float64'], got 'float33'",
    ),
    (["reward.timeout_s=0"], "reward.timeout_s must be None or a number > 0, got 0"),
    # an arm of compare: every arm's overridden config is checked as the job's own
    (
        ["experiment=compare", "compare=[r3,{name:bad,replay:off,overrides:{algorithm.clip_low:1.5}}]"],
        "compare[1] (bad): algorithm.clip_low must be a number in (0, 1), got 1.5",
    ),
    (
        ["experiment=compare", "compare=[r3,{name:int8,overrides:{rollout.server.dtype:int8}}]"],
        "compare[1] (int8): rollout.server.dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'",
    ),
    (
        ["experiment=compare", "compare=[off,{name:wait,overrides:{rollout.server:{batch_wait_s:11}}}]"],
        "compare[1] (wait): rollout.server.batch_wait_s must be a number >= 0 and <= 10, got 11.0",
    ),
    (
        ["experiment=compare", "compare=[r3,{name:p,overrides:{plot:1}}]"],
        "compare[1] (p): plot must be true or false, got 1",
    ),
    # a true/false setting given another literal, on its own or in a sweep
    (["plot=1"], "plot must be true or false, got 1"),
    (["-m", "plot=true,1"], "plot must be true or false, got 1"),
]


def _blocked_job(tmp_path: Path, *args: str):
    """``r3lightning-train ARGS`` with the HEAVY imports failing; returns the process and the
    imports it attempted."""
    log = tmp_path / "blocked.log"
    proc = run_python(tmp_path, "-c", BLOCKED_JOB, *args, R3_BLOCKED_LOG=str(log))
    return proc, log.read_text().split() if log.exists() else []


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_a_bad_value_is_refused_in_one_line_without_torch(tmp_path, overrides, message):
    proc, attempted = _blocked_job(tmp_path, *overrides)
    assert attempted == [], f"imported before the refusal: {attempted}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"r3lightning-train: error: {message}\n"
    assert list(tmp_path.iterdir()) == []  # no run or sweep folder made


# YAML files of a user's config folder that set a true/false key to another literal, and the
# command line that composes each: the literal as the file wrote it is refused, naming the file
USER_FILES = {
    "experiment/mine.yaml": "# @package _global_\nplot: 1\n",
    "replay/mine.yaml": "defaults:\n  - r3\n  - _self_\nrequest_routes: 1\n",
    "primary.yaml": "defaults:\n  - config\n  - _self_\nreplay:\n  request_routes: yes\n",
}
REFUSED_IN_FILES = [
    (["experiment=mine"], "plot must be true or false, got 1", "experiment/mine.yaml"),
    (["replay=mine"], "replay.request_routes must be true or false, got 1", "replay/mine.yaml"),
    (["--config-name", "primary"], "replay.request_routes must be true or false, got 'yes'", "primary.yaml"),
    (["-m", "experiment=mine", "seed=1,2"], "plot must be true or false, got 1", "experiment/mine.yaml"),
]


@pytest.mark.parametrize(
    ("args", "message", "file"), REFUSED_IN_FILES, ids=[" ".join(a) for a, _, _ in REFUSED_IN_FILES]
)
def test_a_bad_literal_in_a_user_yaml_file_is_refused_without_torch(tmp_path, args, message, file):
    conf = tmp_path / "conf"
    for name, text in USER_FILES.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    proc, attempted = _blocked_job(tmp_path, "--config-dir", str(conf), *args)
    assert attempted == [], f"imported before the refusal: {attempted}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"r3lightning-train: error: {message} (in {conf}/{file})\n"
    assert [p.name for p in tmp_path.iterdir()] == ["conf"]  # no run or sweep folder made


def test_resuming_a_run_of_another_task_is_refused_without_torch(tmp_path):
    """The run folder's fingerprint is compared before anything heavy is imported: a resume with
    another task is one line, exit 2, and the saved run is left as it was."""
    run = tmp_path / "run" / "replay_r3"
    (run / "checkpoints").mkdir(parents=True)
    saved = fingerprint(compose_config(["task.num_classes=3"]))  # the default task has 2 classes
    (run / "fingerprint.json").write_text(json.dumps(saved))
    proc, attempted = _blocked_job(tmp_path, f"hydra.run.dir={tmp_path / 'run'}")
    assert attempted == [], f"imported before the refusal: {attempted}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (
        f"r3lightning-train: error: {run} was trained on another task, dataset or model "
        "(task.num_classes: 3 there, 2 now); run with its settings to resume it, or use another hydra.run.dir\n"
    )
    assert json.loads((run / "fingerprint.json").read_text()) == saved
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "fingerprint.json"]


@pytest.mark.parametrize("selected", [[], ["task=calculator"]], ids=["defaults", "an option selected"])
def test_help_is_printed_without_torch(tmp_path, selected):
    proc, attempted = _blocked_job(tmp_path, *selected, "--help")
    assert attempted == [], f"imported for --help: {attempted}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.startswith("r3lightning-train: GRPO training")
    assert "Config groups (* = selected):" in proc.stdout
    assert ("task (calculator):" in proc.stdout) == bool(selected)


def _module_path(name: str) -> Path | None:
    """The source file of the package module ``name`` (None: not one of the package's)."""
    rel = Path(*name.split(".")[1:])
    for path in ((PACKAGE / rel).with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if name.split(".")[0] == "r3lightning" and path.is_file():
            return path
    return None


def _module_level_imports(name: str, path: Path) -> set[str]:
    """What importing module ``name`` imports: its import statements outside function bodies and
    ``if TYPE_CHECKING:`` blocks, and the packages above it."""
    tree = ast.parse(path.read_text())
    found = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _module_path(f"{base}.{a.name}"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_the_job_config_modules_import_no_torch():
    # every package module reachable through module-level imports from what Hydra imports to
    # compose and check the config, with the import chain that reaches each
    chains: dict[str, list[str]] = {name: [name] for name in ENTRY_POINTS}
    todo = list(ENTRY_POINTS)
    heavy = []
    while todo:
        name = todo.pop()
        for imported in sorted(_module_level_imports(name, _module_path(name))):
            if imported.split(".")[0] in HEAVY:
                heavy.append(" -> ".join([*chains[name], imported]))
            elif imported not in chains and _module_path(imported) is not None:
                chains[imported] = [*chains[name], imported]
                todo.append(imported)
    assert heavy == []
    # the settings the schema is made from are among them, so the check above covers them
    for module in (
        "r3lightning.app.job.store",
        "r3lightning.app.job.validate",
        "r3lightning.app.job.literals",
        "r3lightning.app.job.settings",
        "r3lightning.app.job.algorithm",
        "r3lightning.correction.config",
        "r3lightning.rollout.config",
        "r3lightning.rollout.prompts",
        "r3lightning.data.options",
        "r3lightning.app.serve.config",
        "r3lightning.app.vllm.settings",
        "r3lightning.app.tasks.settings",
        "r3lightning.wire.codec",
    ):
        assert module in chains, module
