"""A subscription whose connection a NAT or a load balancer dropped without a word (no FIN, no
RST: it only goes quiet) is noticed by its health check and reconnected, instead of every reply
waiting for the result sweep."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import suppress

import anyio
import pytest

import keyserial
from keyserial.ledger import deposit
from tests.helpers import running_worker

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


class SilencingProxy:
    """Forwards 127.0.0.1:<port> to Redis; :meth:`silence_subscriptions` makes every link that
    has sent SUBSCRIBE stop forwarding in both directions, forever, without closing it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.subscribing_links = 0
        self._silenced: set[int] = set()
        self._subscribed: set[int] = set()
        self._server: asyncio.Server | None = None
        self._next = 0

    def start(self) -> None:
        """Serve from an event loop of its own, in a thread: the proxy is the network, not
        part of the program under test."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            with suppress(asyncio.CancelledError):  # close()
                await self._server.serve_forever()

        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(serve()), daemon=True
        )
        self._thread.start()
        ready.wait(5)

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)

    def silence_subscriptions(self) -> None:
        self._silenced |= self._subscribed

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link, self._next = self._next, self._next + 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pipe(link, reader, up_writer, outbound=True),
                             self._pipe(link, up_reader, writer, outbound=False))

    async def _pipe(self, link: int, source: asyncio.StreamReader,
                    target: asyncio.StreamWriter, *, outbound: bool) -> None:
        with suppress(OSError, asyncio.IncompleteReadError):
            while data := await source.read(65536):
                if outbound and b"SUBSCRIBE" in data.upper() and link not in self._subscribed:
                    self._subscribed.add(link)
                    self.subscribing_links += 1
                if link in self._silenced:
                    continue  # dropped on the floor; the connection stays open
                target.write(data)
                await target.drain()


async def test_a_silently_dropped_reply_subscription_is_noticed_and_reconnected(
    redis_url: str, namespace: str
) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = SilencingProxy(port)
    proxy.start()
    try:
        with anyio.fail_after(60):
            async with running_worker(redis_url, namespace, shard_count=1), \
                    keyserial.connect(f"redis://127.0.0.1:{proxy.port}/0", shards=1,
                                      namespace=namespace, idle_poll=30,
                                      health_interval=0.3) as ks:
                assert await ks.submit("acct", deposit(1), timeout=10) == 1
                assert proxy.subscribing_links == 1
                proxy.silence_subscriptions()
                while proxy.subscribing_links < 2:  # the health check resubscribes
                    await anyio.sleep(0.05)
                started = time.monotonic()
                assert await ks.submit("acct", deposit(1), timeout=10) == 2
                assert time.monotonic() - started < 2, "the reply came by the sweep, not pub/sub"
    finally:
        proxy.close()
