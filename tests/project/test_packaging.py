"""What the README says about installing keyserial matches the package's metadata."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_the_wheel_installs_the_library_alone(tmp_path: Path) -> None:
    """``workers``, ``benchmarks`` and ``examples`` stay in the checkout: installed as
    top-level packages they would shadow (or be shadowed by) a user's own of the same name."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("keyserial-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/", 1)[0] for name in archive.namelist()}
    assert {name for name in top if not name.endswith(".dist-info")} == {"keyserial"}
    assert "keyserial/_scripts/lua/step.lua" in archive.namelist()


def test_keyserial_bench_outside_a_checkout_says_where_to_run_it(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "keyserial", "bench", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert completed.returncode == 2
    assert "from the root of a keyserial checkout" in completed.stderr
