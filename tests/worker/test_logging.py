"""What the worker logs, and how: levels, JSON lines, and op refusals without tracebacks."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import keyserial
from keyserial._logfields import FIELDS
from keyserial.cli.logs import JsonFormatter
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, running_worker
from tests.helpers import ROOT


@keyserial.op
def refuse(ctx: keyserial.Context, reason: str) -> None:
    """An op that refuses, as user code does: the caller gets OperationFailed."""
    raise ValueError(reason)


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyserial", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.slow
def test_an_unknown_log_level_is_a_usage_error_without_traceback() -> None:
    result = _cli("worker", "--log-level", "chatty")
    assert result.returncode == 2
    assert "--log-level" in result.stderr and "'chatty' is not a log level" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_json_log_lines_carry_time_level_logger_and_message(
    standalone_server: LocalServer, namespace: str
) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keyserial",
            "worker",
            "--redis",
            standalone_server.url,
            "--namespace",
            namespace,
            "--shard-count",
            "1",
            "--log-format",
            "json",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        named = json.loads(process.stderr.readline())  # (the server first: docs/deployment.md)
        first = json.loads(process.stderr.readline())
        acquired = json.loads(process.stderr.readline())  # before it, there is nothing to release
        assert "shard 0: acquired" in acquired["message"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        rest = [json.loads(line) for line in process.stderr.read().splitlines()]
    finally:
        process.kill()
        process.wait()
    assert named["message"] == f"worker using Redis at {standalone_server.url} (--redis)"
    for entry in [named, first, acquired, *rest]:  # (and only the documented fields besides)
        assert set(entry) - set(FIELDS) == {"time", "level", "logger", "message"}, entry
    assert (acquired["shard"], acquired["epoch"]) == (0, 1)
    assert first["level"] == "INFO" and first["logger"] == "keyserial.worker"
    assert "serving shards 0 of 1" in first["message"]
    assert any("released shards 0" in entry["message"] for entry in rest)


@pytest.mark.slow
def test_an_unexpected_error_is_logged_at_error_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('boom at import')\n")
    result = _cli("worker", "--app", "broken_app", "--log-format", "json", cwd=tmp_path)
    assert result.returncode == 1
    entry = json.loads(result.stderr.splitlines()[-1])
    assert entry["level"] == "ERROR"
    assert "unexpected error" in entry["message"]
    assert "Traceback" in entry["exc_info"] and "RuntimeError: boom at import" in entry["exc_info"]


async def test_an_op_refusal_is_logged_at_info_without_traceback(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="keyserial")
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.worker.test_logging"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        with pytest.raises(keyserial.OperationFailed, match="no stock left"):
            await ks.submit("sku:1", refuse("no stock left"), timeout=10)
    refusals = [r for r in caplog.records if "'refuse'" in r.getMessage()]
    assert len(refusals) == 1
    assert refusals[0].levelno == logging.INFO
    assert refusals[0].exc_info is None
    assert "ValueError: no stock left" in refusals[0].getMessage()
    # (keyserial's own records: another library's, such as asyncio's report of a client an
    # earlier test left to the garbage collector, say nothing about this op.)
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("keyserial")
    ]


@pytest.mark.slow
async def test_an_outage_of_redis_is_logged_once_per_process_side_and_once_when_it_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker and a client whose server is down for 3 s: each retrying task of theirs
    (leases, steps, subscriptions, the sweep) would warn at every try; each side logs the
    outage once instead, and once more when Redis answers again, saying how many warnings it
    held back."""
    server = LocalServer(data_dir=tmp_path, appendfsync="always")
    server.start()
    fast = {"lease_ttl": 1.0, "idle_poll": 0.2, "health_interval": 0.5}
    try:
        async with (
            running_worker(server.url, "outage", shard_count=2, **fast),
            keyserial.connect(server.url, shards=2, namespace="outage", **fast) as ks,
        ):
            assert await ks.submit("account:1", deposit(1)) == 1
            caplog.clear()
            caplog.set_level(logging.DEBUG, logger="keyserial")
            server.stop()
            await anyio.sleep(3)  # (the outage's length)
            server.start()
            assert await ks.submit("account:1", deposit(1), timeout=30) == 2
            warnings = [
                record.getMessage()
                for record in caplog.records
                if record.levelno >= logging.WARNING and record.name.startswith("keyserial")
            ]
            held_back = [
                record
                for record in caplog.records
                if record.levelno == logging.DEBUG and "retrying" in record.getMessage()
            ]
    finally:
        server.stop()
    ended = [message for message in warnings if "answers again" in message]
    assert len(ended) == 2, warnings  # the worker's connection and the client's
    assert all("warnings were held back meanwhile" in message for message in ended)
    assert held_back  # (there were retries to hold back)
    assert len(warnings) <= 12, "\n".join(warnings)


async def test_json_lines_carry_the_shard_key_op_and_op_id_as_fields(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A log pipeline filters by shard, key or op id without parsing messages: the record of an
    op that raised, and of a shard acquired, carry them, and a JSON line writes them."""
    caplog.set_level(logging.INFO, logger="keyserial")
    async with (
        running_worker(redis_url, namespace, shard_count=2) as worker,
        keyserial.connect(redis_url, namespace=namespace) as ks,
    ):
        with pytest.raises(keyserial.OperationFailed):
            await ks.submit("account:7", deposit(-5), op_id="bad-deposit")
        shard = ks.shard_of("account:7")
        epoch = worker._runner(shard).epoch
    formatter = JsonFormatter()
    [failed] = [json.loads(formatter.format(r)) for r in caplog.records if "failed" in r.msg]
    assert {name: failed[name] for name in ("shard", "key", "op", "op_id", "error")} == {
        "shard": shard,
        "key": "account:7",
        "op": "deposit",
        "op_id": "bad-deposit",
        "error": "ValueError",
    }
    acquired = [
        json.loads(formatter.format(r)) for r in caplog.records if "acquired" in r.getMessage()
    ]
    assert {"shard": shard, "epoch": epoch} in [
        {"shard": line["shard"], "epoch": line["epoch"]} for line in acquired
    ]
