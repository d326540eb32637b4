"""The README's 30-second example runs as written (against a fresh private server), and its setup
commands are CI's. The whole README, followed in a fresh venv as a user types it, is
tests/project/test_docs_as_written.py's."""

from __future__ import annotations

import re
import subprocess
import sys

import anyio
import pytest

from keyserial.testing import LocalServer, running_worker
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def _first_python_block(heading: str) -> str:
    section = README.split(f"## {heading}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"the section {heading!r} has no python block"
    return match.group(1)


@pytest.mark.slow
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
    assert result.stdout.splitlines() == ["70 70", "refused: 70 < 1000", "later: 65"]


def test_the_two_setup_commands_are_the_ones_ci_runs() -> None:
    assert "pip install -e . && keyserial dev" in README
    assert 'pip install -e ".[dev]" && python -m pytest -q' in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet -e ".[dev]"' in ci
    assert "python -m pytest -q" in ci
