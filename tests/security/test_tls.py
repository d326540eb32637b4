"""``rediss://`` URLs end to end: every connection keyserial opens speaks TLS, with the URL's
CA and client certificate (the server requires one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests.helpers import WorkerProcess, keys_on_shard
from tests.tls import TlsServer

#: What the server logs when a client speaks plaintext (or a bad handshake) to its TLS port.
_HANDSHAKE_ERRORS = ("wrong version number", "SSL routines", "Error accepting a client")


async def _submit_and_transfer(url: str, namespace: str) -> dict[str, Any]:
    """Deposit on two accounts on different shards, transfer between them, and read back."""
    source, target = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(3, 4, 1, "acct")[0]
    async with keyserial.connect(url, shards=4, namespace=namespace) as ks:
        await ks.submit(source, deposit(100), timeout=20, op_id="open-source")
        await ks.submit(target, deposit(5), timeout=20)
        moved = await ks.transfer(source, target, 30)
        return {
            "moved": [moved[source], moved[target]],
            "stored": await ks.result("open-source", key=source),
            "read": (await ks.read(source), await ks.read(target)),
        }


def _assert_no_plaintext(server: TlsServer, since: int) -> None:
    """No connection since the server's log was ``since`` long spoke plaintext to it."""
    log = server.log()[since:]
    assert not [error for error in _HANDSHAKE_ERRORS if error in log], log[-2000:]


@pytest.mark.slow
async def test_an_in_process_worker_and_a_client_work_over_tls(
    tls_server: TlsServer, namespace: str
) -> None:
    since = len(tls_server.log())
    async with running_worker(tls_server.url, namespace, shard_count=4):
        outcome = await _submit_and_transfer(tls_server.url, namespace)
    assert outcome == {"moved": [70, 35], "stored": 100, "read": (70, 35)}
    _assert_no_plaintext(tls_server, since)


@pytest.mark.slow
async def test_a_worker_process_and_a_client_work_over_tls(
    tls_server: TlsServer, namespace: str, tmp_path: Path
) -> None:
    since = len(tls_server.log())
    worker = WorkerProcess(
        tls_server.url, namespace, shards="0-3", shard_count=4, log_path=tmp_path / "worker.log"
    )
    try:
        outcome = await _submit_and_transfer(tls_server.url, namespace)
        assert worker.terminate() == 0
    finally:
        worker.close()
    assert outcome == {"moved": [70, 35], "stored": 100, "read": (70, 35)}
    assert "Traceback" not in worker.log()
    _assert_no_plaintext(tls_server, since)


async def test_a_tls_port_refuses_a_plaintext_url_with_backend_unavailable(
    tls_server: TlsServer,
) -> None:
    with pytest.raises(keyserial.BackendUnavailable):
        async with keyserial.connect(f"redis://127.0.0.1:{tls_server.port}/0"):
            pass
