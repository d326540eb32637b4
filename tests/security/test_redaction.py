"""Credentials in a Redis URL never reach an error message or a log line."""

from __future__ import annotations

import logging
import subprocess
import sys

import anyio
import pytest

import keyserial
from keyserial.errors import redact
from tests.helpers import ROOT, free_closed_port


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://app:s3cret@host:6379/0", "redis://app:***@host:6379/0"),
        ("rediss://:s3cret@host:6380", "rediss://:***@host:6380"),
        ("redis://host:6379/0?password=s3cret&db=1", "redis://host:6379/0?password=***&db=1"),
        (
            "rediss://u:p%40ss@h/0?ssl_password=s3cret&ssl_ca_certs=/ca.pem",
            "rediss://u:***@h/0?ssl_password=***&ssl_ca_certs=/ca.pem",
        ),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    ],
)
def test_redact_hides_passwords_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact(url) == shown


async def test_an_unreachable_url_with_a_password_is_never_shown_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://app:s3cret@127.0.0.1:{free_closed_port()}/0"
    with pytest.raises(keyserial.BackendUnavailable) as caught:
        async with keyserial.connect(url):
            pass
    assert "s3cret" not in str(caught.value) and "s3cret" not in caught.value.url
    assert "redis://app:***@127.0.0.1" in str(caught.value)
    worker = keyserial.Worker(url)  # retries, logging each failure
    with anyio.move_on_after(0.5):
        await worker.run()
    assert "redis://app:***@127.0.0.1" in caplog.text
    assert "s3cret" not in caplog.text


@pytest.mark.slow
def test_the_worker_command_never_logs_the_password() -> None:
    url = f"redis://app:s3cret@127.0.0.1:{free_closed_port()}/0"
    process = subprocess.Popen(
        [sys.executable, "-m", "keyserial", "worker", "--redis", url],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        named = process.stdout.readline()  # (the server first: docs/deployment.md)
        lines = [process.stdout.readline() for _ in range(3)]  # three failed attempts
    finally:
        process.kill()
        process.wait()
    assert "worker using Redis at redis://app:***@127.0.0.1" in named, named
    assert "s3cret" not in named
    assert all("cannot reach Redis at redis://app:***@127.0.0.1" in line for line in lines), lines
    assert not any("s3cret" in line for line in lines)
