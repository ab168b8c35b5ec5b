"""The public names of ``r3lightning``: one short list, resolved lazily to their defining modules."""

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import r3lightning


def test_all_is_one_short_list_of_the_type_checking_imports():
    tree = ast.parse(Path(r3lightning.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    imported = sorted(alias.name for node in block.body for alias in node.names)
    assert r3lightning.__all__ == imported
    assert len(r3lightning.__all__) <= 35


@pytest.mark.parametrize("name", r3lightning.__all__)
def test_every_public_name_resolves_to_its_defining_module(name):
    value = getattr(r3lightning, name)
    module = r3lightning._EXPORTS.modules[name]
    assert value.__module__ == module  # the defining module, not a re-export
    assert name in dir(r3lightning)


def test_every_config_a_public_constructor_takes_is_public():
    """A dataclass named in the signature of a public class (``CollectorConfig`` of the collector,
    ``EngineConfig`` of the server, ...) is public too: a user builds one without a deep import.
    A config's own nested configs (``RetryPolicy.backoff``) stay in their module: 35 names at most."""
    missing = {}
    for name in r3lightning.__all__:
        cls = getattr(r3lightning, name)
        if not inspect.isclass(cls) or issubclass(cls, BaseException) or dataclasses.is_dataclass(cls):
            continue
        namespace = vars(sys.modules[cls.__module__])
        for parameter in inspect.signature(cls).parameters.values():
            for word in re.findall(r"\b[A-Z]\w*", str(parameter.annotation)):
                value = namespace.get(word)
                if (
                    inspect.isclass(value)
                    and dataclasses.is_dataclass(value)
                    and word not in r3lightning.__all__
                ):
                    missing.setdefault(name, []).append(word)
    missing.pop("CollectedRollouts", None)  # RolloutStats: a result the collector builds, never the user
    assert missing == {}


def test_the_collector_is_built_from_top_level_names_only():
    collector = r3lightning.RolloutCollector(
        "http://127.0.0.1:1",
        lambda prompt, response_ids: 0.0,
        r3lightning.CollectorConfig(group_size=2),
        advantages=r3lightning.GRPOAdvantages(),
        schema=r3lightning.RouteSchema(2, 2, 4),
        client_options={"retry": r3lightning.RetryPolicy(max_attempts=1)},
    )
    assert collector.clients[0].retry.max_attempts == 1


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'r3lightning' has no attribute 'PackedTensors'"):
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
    assert _imported_after("") == "[]"
    # packing, alignment and the rollout client need neither Lightning nor the model libraries
    core = "r3lightning.PackedTensor, r3lightning.TokenMetadataLayout, r3lightning.RemoteGenerateClient"
    assert _imported_after(core) == "[]"
    # the data module needs Lightning (which itself imports transformers when installed), never megatron
    assert "megatron" not in _imported_after("r3lightning.R3DataModule")
