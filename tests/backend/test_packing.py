"""The C command packer (hiredis) that keyserial's TCP connections use packs byte for byte what
redis-py's Python packer does, and refuses what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from keyserial._backend.resp import HiredisPackedConnection, client_options

COMMANDS: list[tuple[Any, ...]] = [
    ("PING",),
    ("SET", "key", "value"),
    ("EVALSHA", "a" * 40, 2, "ks:{ns:3}:stream", b"raw\x00bytes", 0, -7, 2**70, 0.1, 1e-7, ""),
    ("CLIENT SETNAME", "keyserial"),
    ("HSET", "k", "f", "ünïcødé ✓"),
    (b"GET", memoryview(b"view")),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: str(command[0]))
def test_packs_what_redis_py_packs(command: tuple[Any, ...]) -> None:
    assert b"".join(HiredisPackedConnection().pack_command(*command)) == b"".join(
        Connection().pack_command(*command)
    )


def test_refuses_what_redis_py_refuses() -> None:
    with pytest.raises(DataError):
        HiredisPackedConnection().pack_command("SET", "key", True)


def test_only_plain_tcp_urls_get_it() -> None:
    options = client_options("redis://127.0.0.1:6379/0")
    assert options["connection_class"] is HiredisPackedConnection
    assert "connection_class" not in client_options("rediss://127.0.0.1:6379/0")
    assert "connection_class" not in client_options("unix:///tmp/redis.sock")
