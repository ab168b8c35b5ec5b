"""The release number is one fact: the wheel's metadata, ``__version__`` and the CHANGELOG agree."""

import re
import tomllib
from pathlib import Path

import r3lightning

ROOT = Path(__file__).resolve().parents[2]


def test_version_matches_pyproject_and_a_dated_changelog_entry():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert r3lightning.__version__ == project["version"] == "0.2.0"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", changelog, flags=re.M)
    # The newest heading collects work not yet released; the released version follows, dated.
    assert headings[0] == ("Unreleased", "")
    assert headings[1] == ("0.2.0", "2026-12-06")
