"""G4.2: ``keyserial dev --data-dir`` keeps its data with AOF ``appendfsync always``, in the
directory it was given."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from keyserial.testing import free_port
from tests.helpers import ROOT

# `keyserial dev` as a process, with its server and workers.
pytestmark = pytest.mark.slow


def test_dev_with_a_data_dir_persists_every_write_before_replying(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keyserial",
            "dev",
            "--port",
            str(port),
            "--shard-count",
            "2",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline(), process.stdout.readline()]
        assert any("ready" in line for line in lines), lines
        client = redis.Redis(port=port)
        try:
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
            assert Path(client.config_get("dir")["dir"]).resolve() == (tmp_path / "data").resolve()
        finally:
            client.close()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        process.wait()
