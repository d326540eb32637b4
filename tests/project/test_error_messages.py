"""Error messages a new user met: each says what went wrong, in the user's terms."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import keyserial
from keyserial.testing import LocalServer, running_worker
from tests.helpers import ROOT


@pytest.fixture
def not_redis_port() -> Iterator[int]:
    """A port where a plain TCP server answers anything with an HTTP error, then hangs up."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stopping = threading.Event()

    def serve() -> None:
        while not stopping.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(5)
                connection.recv(1024)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stopping.set()
        thread.join()
        server.close()


async def test_a_port_that_is_not_redis_raises_backend_unavailable_naming_the_url(
    not_redis_port: int,
) -> None:
    url = f"redis://127.0.0.1:{not_redis_port}/0"
    with pytest.raises(keyserial.BackendUnavailable) as caught:
        async with keyserial.connect(url):
            pass
    assert caught.value.url == url
    assert url in str(caught.value)
    assert "does not speak Redis" in str(caught.value)


@pytest.mark.parametrize(
    ("argument", "error", "shown"),
    [
        (datetime.datetime(2024, 5, 1, 12, 0), TypeError, "datetime"),
        ({"a", "b"}, TypeError, "set"),
        (float("nan"), ValueError, "nan"),
    ],
)
async def test_a_non_json_argument_names_the_op_and_the_argument(
    standalone_server: LocalServer,
    namespace: str,
    argument: Any,
    error: type[Exception],
    shown: str,
) -> None:
    async with keyserial.connect(standalone_server.url, shards=2, namespace=namespace) as ks:
        with pytest.raises(error) as caught:
            await ks.submit("sku:1", keyserial.call("restock", 5, arrived=argument))
    message = str(caught.value)
    assert message.startswith("op 'restock': argument 'arrived' (")
    assert shown in message
    assert "op arguments must be JSON values" in message


async def test_a_shard_count_mismatch_from_python_speaks_of_shards(
    standalone_server: LocalServer, namespace: str
) -> None:
    async with keyserial.connect(standalone_server.url, shards=2, namespace=namespace):
        pass
    with pytest.raises(keyserial.ShardCountMismatch, match=r"Use shards=2 \(or a new namespace"):
        async with keyserial.connect(standalone_server.url, shards=4, namespace=namespace):
            pass


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "env", "advice"),
    [
        (["--shard-count", "4"], {}, "Use --shard-count 2 (or a new namespace"),
        ([], {"KEYSERIAL_SHARD_COUNT": "4"}, "Use KEYSERIAL_SHARD_COUNT=2 (or a new namespace"),
    ],
)
def test_a_shard_count_mismatch_on_the_command_line_speaks_of_what_set_it(
    standalone_server: LocalServer,
    namespace: str,
    flags: list[str],
    env: dict[str, str],
    advice: str,
) -> None:
    async def record_two_shards() -> None:
        async with keyserial.connect(standalone_server.url, shards=2, namespace=namespace):
            pass

    anyio.run(record_two_shards)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keyserial",
            "worker",
            "--redis",
            standalone_server.url,
            "--namespace",
            namespace,
            *flags,
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert advice in result.stderr
    assert "shards=" not in result.stderr


async def test_unknown_operation_does_not_repeat_its_prefix(
    standalone_server: LocalServer, namespace: str
) -> None:
    async with (
        running_worker(standalone_server.url, namespace, shard_count=1),
        keyserial.connect(standalone_server.url, shards=1, namespace=namespace) as ks,
    ):
        with pytest.raises(keyserial.UnknownOperation) as caught:
            await ks.submit("sku:1", keyserial.call("no_such_op"), timeout=10)
    assert str(caught.value).startswith("no op named 'no_such_op' on this worker")
    shown = traceback.format_exception_only(caught.value)[-1]
    assert shown.startswith("keyserial.errors.UnknownOperation: no op named")
    assert shown.count("UnknownOperation") == 1


def test_a_remote_error_keeps_its_type_in_the_message() -> None:
    error = keyserial.OperationFailed.from_wire(
        {"type": "ValueError", "message": "only 3 left"}, key="sku:1", op_id="o1"
    )
    assert str(error) == "ValueError: only 3 left (op 'o1' on key 'sku:1')"


def test_an_unreachable_error_wrapping_another_says_where_once() -> None:
    inner = keyserial.BackendUnavailable("redis://app:pw@host:6379/0", "the cluster is down")
    outer = keyserial.BackendUnavailable("redis://app:pw@host:6379/0", inner, op_id="x")
    assert str(outer).count("cannot reach Redis at redis://app:***@host:6379/0") == 1
    assert outer.reason == "the cluster is down"
