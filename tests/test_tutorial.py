"""docs/tutorial.md as written: its files, written out into a new project, run. The project's
own test suite passes through keyserial's pytest plugin, and its script prints what the page
says against a worker serving the page's ops."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from keyserial.testing import LocalServer, running_worker
from tests.helpers import ROOT

PAGE = ROOT / "docs" / "tutorial.md"
#: A fenced block whose first line names its file: ```python\n# shop/ops.py\n...```.
FILE_BLOCK = re.compile(r"```(?:python|ini)\n# (\S+)\n(.*?)```", re.DOTALL)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    files = FILE_BLOCK.findall(PAGE.read_text())
    assert {name for name, _ in files} >= {"shop/ops.py", "shop/web.py", "buy.py", "pytest.ini"}
    for name, body in files:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body if name.endswith(".ini") else f"# {name}\n{body}")
    return tmp_path


def test_the_tutorial_s_test_suite_passes(project: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(project)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


async def test_the_tutorial_s_script_prints_what_the_page_says(
    project: Path, standalone_server: LocalServer, namespace: str
) -> None:
    sys.path.insert(0, str(project))
    try:
        async with running_worker(standalone_server.url, namespace, apps=["shop.ops"]):
            with anyio.fail_after(60):
                result = await anyio.run_process(
                    [sys.executable, "buy.py"],
                    cwd=project,
                    check=False,
                    env={
                        **os.environ,
                        "KEYSERIAL_REDIS_URL": standalone_server.url,
                        "KEYSERIAL_NAMESPACE": namespace,
                    },
                )
    finally:
        sys.path.remove(str(project))
        for name in [name for name in sys.modules if name == "shop" or name.startswith("shop.")]:
            del sys.modules[name]
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "98 seats left"
    assert "python buy.py                    # 98 seats left" in PAGE.read_text()
