"""The public names of ``r3lightning`` resolve lazily to their defining modules."""

import subprocess
import sys

import pytest

import r3lightning


@pytest.mark.parametrize("name", r3lightning.__all__)
def test_every_public_name_resolves_to_its_module(name):
    value = getattr(r3lightning, name)
    module = r3lightning._EXPORTS[name]
    assert value.__module__ == f"r3lightning{module}" or name in vars(sys.modules[f"r3lightning{module}"])
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
