"""A client given a shard count (``connect(shards=16)``, as the README had it) keeps connecting
after ``keyserial reshard`` changes the count: it warns and routes by the recorded layout, as
every client does (docs/client.md#the-shard-count). A count the namespace never changed from is
still refused (``tests/project/test_error_messages.py``)."""

from __future__ import annotations

import logging

import anyio
import pytest

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, running_worker


async def test_a_count_from_before_a_reshard_connects_warns_and_routes_by_the_new_one(
    standalone_server: LocalServer,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = standalone_server.url
    async with running_worker(url, namespace, shard_count=2):
        async with keyserial.connect(url, shards=2, namespace=namespace) as ks:
            assert await ks.submit("account:1", deposit(5), timeout=10) == 5
        assert await keyserial.reshard(url, to=4, namespace=namespace) is not None
        caplog.set_level(logging.WARNING, logger="keyserial.client")
        async with keyserial.connect(url, shards=2, namespace=namespace) as ks:
            assert ks.shard_count == 4 and ks.layout.generation == 1
            assert await ks.submit("account:1", deposit(5), timeout=10) == 10
        warned = [record.getMessage() for record in caplog.records if "resharded" in record.msg]
        assert warned == [
            f"namespace {namespace!r} was resharded to 4 shards (layout generation 1), and this"
            " client was given shards=2: it routes by the recorded layout, as every client"
            " does. Leave shards= out, or make it 4."
        ]
        caplog.clear()
        monkeypatch.setenv("KEYSERIAL_SHARD_COUNT", "2")
        async with keyserial.connect(url, namespace=namespace) as ks:
            assert ks.shard_count == 4
            assert await ks.submit("account:1", deposit(1), timeout=10) == 11
        assert any("was given KEYSERIAL_SHARD_COUNT=2" in r.getMessage() for r in caplog.records)


async def test_the_count_a_move_under_way_goes_to_is_taken_without_a_word(
    standalone_server: LocalServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = standalone_server.url
    async with keyserial.connect(url, shards=2, namespace=namespace) as ks:
        await ks.enqueue("account:1", deposit(1))
    with anyio.move_on_after(1.0):  # (no worker: the move is recorded and never drains)
        await keyserial.reshard(url, to=8, namespace=namespace)
    caplog.set_level(logging.WARNING, logger="keyserial.client")
    async with keyserial.connect(url, shards=8, namespace=namespace) as ks:
        assert ks.layout.shards == 8
    assert not caplog.records
    never_moved = f"{namespace}-still"
    async with keyserial.connect(url, shards=3, namespace=never_moved):
        pass
    with pytest.raises(keyserial.ShardCountMismatch, match="has 3 shards recorded"):
        async with keyserial.connect(url, shards=4, namespace=never_moved):
            pass
