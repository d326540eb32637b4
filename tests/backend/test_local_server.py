"""The private servers keyserial starts (``keyserial dev``, the tests, the benchmark suite)."""

from __future__ import annotations

import socket

import pytest
import redis

from keyserial.testing import LocalServer

# Servers started and stopped again.
pytestmark = pytest.mark.slow


def test_a_server_whose_free_port_was_taken_meanwhile_moves_to_another() -> None:
    """Parallel test processes pick free ports independently; one may bind a port another has
    just picked. A server started on a port of its own choosing moves on; one given a port
    does not."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = LocalServer()
        server.port = port  # as if another process had bound it after the probe
        with server:
            assert server.port != port
            with redis.Redis(port=server.port) as client:
                assert client.ping()
        fixed = LocalServer(port=port)
        try:
            with pytest.raises(RuntimeError, match="Address already in use"):
                fixed.start()
        finally:
            fixed.stop()
