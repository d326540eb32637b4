"""What the README says about installing keyserial matches the package's metadata."""

from __future__ import annotations

import tomllib

from tests.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
README = (ROOT / "README.md").read_text()


def test_the_readme_states_the_python_version_the_package_requires() -> None:
    assert PYPROJECT["requires-python"] == ">=3.11"
    assert "requires Python ≥ 3.11" in README


def test_the_license_file_is_the_mit_license_the_package_declares() -> None:
    assert PYPROJECT["license"] == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert "Copyright (c) keyserial contributors" in text
    assert "[LICENSE](LICENSE)" in README
