"""A subscription whose connection a NAT or a load balancer dropped without a word (no FIN, no
RST: it only goes quiet) is noticed by its health check and reconnected, instead of every reply
(or a worker's every wake-up) waiting for the result sweep (or idle polling). On keyserial's own
connections (``redis://`` URLs) and on redis-py's (TLS, clients the caller configured)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Callable
from contextlib import suppress

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests.helpers import WorkerProcess
from tests.nemesis.proxy import FaultProxy
from tests.tls import TlsServer

standalone_only = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


class SilencingProxy:
    """Forwards 127.0.0.1:<port> to Redis; :meth:`silence_subscriptions` makes every link that
    has sent SUBSCRIBE stop forwarding in both directions, forever, without closing it. With
    ``tls`` (a server-side and an upstream context) it terminates TLS on both sides, so that it
    sees the commands."""

    def __init__(
        self, upstream_port: int, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None
    ) -> None:
        self.upstream_port = upstream_port
        self._tls = tls
        self.port = 0
        self.subscribing_links = 0
        self._silenced: set[int] = set()
        self._subscribed: set[int] = set()
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        self._next = 0

    def start(self) -> None:
        """Serve from an event loop of its own, in a thread: the proxy is the network, not
        part of the program under test."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            self._stopping = asyncio.Event()
            self._server = await asyncio.start_server(
                self._serve, "127.0.0.1", 0, ssl=self._tls[0] if self._tls else None
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            await self._stopping.wait()  # close()
            self._server.close()
            for task in self._links:
                task.cancel()
            await asyncio.gather(*self._links, return_exceptions=True)

        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(serve()), daemon=True
        )
        self._thread.start()
        ready.wait(5)

    def close(self) -> None:
        """Stop serving and drop every link, then end the proxy's thread."""
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(10)
            self._loop.close()

    def silence_subscriptions(self) -> None:
        self._silenced |= self._subscribed

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link, self._next = self._next, self._next + 1
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1", self.upstream_port, ssl=self._tls[1] if self._tls else None
            )
            await asyncio.gather(self._pipe(link, reader, up_writer, outbound=True),
                                 self._pipe(link, up_reader, writer, outbound=False))
        except asyncio.CancelledError:
            pass  # close(); asyncio's server would log a cancelled handler's "exception"
        finally:
            self._links.discard(task)
            for each in (writer, up_writer):
                if each is not None:
                    each.transport.abort()

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


@standalone_only
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
                took = await _silence_and_time_a_submit(ks, proxy)
                assert await ks.read("acct") == 2
        assert took < 2, "the reply came by the sweep, not pub/sub"
    finally:
        proxy.close()


def _tls_contexts(server: TlsServer) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The proxy's TLS: it shows the server's certificate to clients, and the client
    certificate to the server."""
    c = server.certificates
    facing_clients = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    facing_clients.load_cert_chain(c.server_cert, c.server_key)
    facing_server = ssl.create_default_context(cafile=str(c.ca))
    facing_server.load_cert_chain(c.client_cert, c.client_key)
    return facing_clients, facing_server


async def _silence_and_time_a_submit(ks: keyserial.Client, proxy: SilencingProxy) -> float:
    """Silence the proxied subscription once it is up, wait for the health check to replace
    it, and time a submit then (it waited for the sweep or idle polling had nothing noticed)."""
    assert await ks.submit("acct", deposit(1), timeout=10) >= 1
    assert proxy.subscribing_links == 1
    proxy.silence_subscriptions()
    while proxy.subscribing_links < 2:  # the health check resubscribes
        await anyio.sleep(0.05)
    started = time.monotonic()
    await ks.submit("acct", deposit(1), timeout=10)
    return time.monotonic() - started


def _assert_warned(caplog: pytest.LogCaptureFixture) -> None:
    lost = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "subscription to" in r.getMessage()]
    assert lost and "no answer to a PING" in lost[0], caplog.text


async def test_a_silently_dropped_tls_reply_subscription_is_noticed_and_reconnected(
    tls_server: TlsServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``rediss://`` subscriptions run on redis-py's connections: checked all the same."""
    caplog.set_level(logging.WARNING, "keyserial")
    proxy = SilencingProxy(tls_server.port, tls=_tls_contexts(tls_server))
    proxy.start()
    try:
        proxied = tls_server.url.replace(f":{tls_server.port}/", f":{proxy.port}/")
        with anyio.fail_after(60):
            async with running_worker(tls_server.url, namespace, shard_count=1), \
                    keyserial.connect(proxied, shards=1, namespace=namespace, idle_poll=30,
                                      health_interval=0.3) as ks:
                took = await _silence_and_time_a_submit(ks, proxy)
        assert took < 2, "the reply came by the sweep, not pub/sub"
        _assert_warned(caplog)
    finally:
        proxy.close()


@standalone_only
async def test_a_silently_dropped_subscription_of_a_callers_client_is_noticed(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A redis-py client the caller configured (and keeps owning) subscribes through redis-py:
    checked all the same."""
    caplog.set_level(logging.WARNING, "keyserial")
    proxy = SilencingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    proxy.start()
    client = redis.asyncio.Redis(host="127.0.0.1", port=proxy.port)
    try:
        with anyio.fail_after(60):
            async with running_worker(redis_url, namespace, shard_count=1), \
                    keyserial.connect(client, shards=1, namespace=namespace, idle_poll=30,
                                      health_interval=0.3) as ks:
                took = await _silence_and_time_a_submit(ks, proxy)
        assert took < 2, "the reply came by the sweep, not pub/sub"
        _assert_warned(caplog)
    finally:
        await client.aclose()
        proxy.close()


@standalone_only
@pytest.mark.parametrize("via", ["url", "callers_client"])
async def test_a_silently_dropped_wake_up_subscription_of_a_worker_is_noticed(
    redis_url: str, namespace: str, via: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's wake-ups (and coordination messages) come by a subscription too: one that
    went quiet is replaced, not left to idle polling (every 30 s here)."""
    caplog.set_level(logging.WARNING, "keyserial")
    proxy = SilencingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    proxy.start()
    client = redis.asyncio.Redis(host="127.0.0.1", port=proxy.port)
    redis_for_worker: str | redis.asyncio.Redis = (
        f"redis://127.0.0.1:{proxy.port}/0" if via == "url" else client
    )
    try:
        with anyio.fail_after(60):
            async with running_worker(redis_for_worker, namespace, shard_count=1,  # type: ignore[arg-type]
                                      idle_poll=30, health_interval=0.3), \
                    keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
                took = await _silence_and_time_a_submit(ks, proxy)
        assert took < 2, "the worker heard of the entry by polling, not by its wake-up"
        _assert_warned(caplog)
    finally:
        await client.aclose()
        proxy.close()


@standalone_only
async def test_a_worker_whose_first_subscription_fails_keeps_serving(
    redis_url: str, namespace: str, start: Callable[..., WorkerProcess]
) -> None:
    """Started while Redis keeps going away, a worker may connect and then lose its first
    SUBSCRIBE (long nemesis seed 3161): it must serve by polling and subscribe once it can,
    not exit."""
    proxy = FaultProxy("worker", int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    proxy.refuse_subscriptions = True
    try:
        worker = start(proxy.url, namespace, shards="0", shard_count=1,
                       env={"KEYSERIAL_IDLE_POLL": "0.2"})
        async with keyserial.connect(redis_url, shards=1, namespace=namespace) as ks:
            with anyio.fail_after(30):
                while proxy.subscribing_links < 2:  # refused, and tried again
                    await anyio.sleep(0.05)
            assert await ks.submit("acct", deposit(1), timeout=20) == 1
            assert worker.process.poll() is None, worker.log()[-2000:]
            proxy.refuse_subscriptions = False
            refused = proxy.subscribing_links
            with anyio.fail_after(30):
                while proxy.subscribing_links == refused:  # its next try gets through
                    await anyio.sleep(0.05)
            assert await ks.submit("acct", deposit(1), timeout=20) == 2
        assert worker.process.poll() is None
        assert "subscribing to wake-ups" in worker.log()
    finally:
        await proxy.aclose()
