"""The public names of ``r3lightning``: one short list, resolved lazily to their defining modules."""

import ast
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
    assert len(r3lightning.__all__) <= 30


@pytest.mark.parametrize("name", r3lightning.__all__)
def test_every_public_name_resolves_to_its_defining_module(name):
    value = getattr(r3lightning, name)
    module = r3lightning._EXPORTS[name]
    assert value.__module__ == module  # the defining module, not a re-export
    assert name in dir(r3lightning)


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
