"""The README's 30-second example runs as written (against a fresh private server), and so does
its test of the Testing section (as a user's pytest would run it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import anyio

from keyserial.testing import LocalServer, running_worker
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def _first_python_block(heading: str) -> str:
    section = README.split(f"## {heading}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"the section {heading!r} has no python block"
    return match.group(1)


def test_the_quick_start_runs_as_written() -> None:
    code = _first_python_block("30-second example")
    assert 'keyserial.connect("redis://127.0.0.1:6390/0")' in code
    with LocalServer() as server:
        script = code.replace("redis://127.0.0.1:6390/0", server.url)

        async def run() -> subprocess.CompletedProcess[str]:
            async with running_worker(server.url, "default", shard_count=16):
                return await anyio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
                    )
                )

        result = anyio.run(run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["70 70", "refused: 70 < 1000"]


def test_the_two_setup_commands_are_the_ones_ci_runs() -> None:
    assert "pip install -e . && keyserial dev" in README
    assert 'pip install -e ".[dev]" && python -m pytest -q' in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[dev]"' in ci
    assert "python -m pytest -q" in ci


def test_ci_proves_the_bare_install_runs_the_quick_start() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    bare = (ROOT / ".ci" / "bare-install").read_text()
    assert ci.index("bash .ci/bare-install") < ci.index('pip install --quiet -e ".[dev]"')
    assert "pip install --quiet .\n" in bare
    assert "keyserial dev" in bare and "--version" in bare
    assert "## 30-second example" in bare


def test_the_testing_example_passes_as_written(tmp_path: Path) -> None:
    (tmp_path / "test_example.py").write_text(_first_python_block("Testing"))
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nasyncio_mode = "auto"\n')
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout, result.stdout
