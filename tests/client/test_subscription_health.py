"""A subscription whose connection a NAT or a load balancer dropped without a word (no FIN, no
RST: it only goes quiet) is noticed by its health check and reconnected, instead of every reply
(or a worker's every wake-up) waiting for the result sweep (or idle polling). On keyserial's own
connections (``redis://`` URLs) and on redis-py's (TLS, clients the caller configured)."""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import running_worker
from tests.helpers import WorkerProcess
from tests.proxy import FaultProxy, TlsContexts
from tests.tls import TlsServer

standalone_only = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)


@standalone_only
async def test_a_silently_dropped_reply_subscription_is_noticed_and_reconnected(
    redis_url: str, namespace: str
) -> None:
    async with FaultProxy("client", _port(redis_url)) as proxy:
        with anyio.fail_after(60):
            async with _worker_and_proxied_client(redis_url, namespace, proxy) as ks:
                took = await _silence_and_time_a_submit(ks, proxy)
                assert await ks.read("acct") == 2
        assert took < 2, "the reply came by the sweep, not pub/sub"


@asynccontextmanager
async def _worker_and_proxied_client(
    redis_url: str, namespace: str, proxy: FaultProxy
) -> AsyncIterator[keyserial.Client]:
    """A worker on the server, and a client through ``proxy`` whose subscription is health
    checked every 0.3 s and whose sweep waits 30 s (so a reply it gets in time came by pub/sub,
    or by a lookup after a resubscription)."""
    async with (
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(
            proxy.url, shards=1, namespace=namespace, idle_poll=30, health_interval=0.3
        ) as ks,
    ):
        yield ks


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def _tls_contexts(server: TlsServer) -> TlsContexts:
    """The proxy's TLS: it shows the server's certificate to clients, and the client
    certificate to the server."""
    c = server.certificates
    facing_clients = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    facing_clients.load_cert_chain(c.server_cert, c.server_key)
    facing_server = ssl.create_default_context(cafile=str(c.ca))
    facing_server.load_cert_chain(c.client_cert, c.client_key)
    return facing_clients, facing_server


async def _silence_and_time_a_submit(ks: keyserial.Client, proxy: FaultProxy) -> float:
    """Silence the proxied subscription once it is up, wait for the health check to replace
    it, and time a submit then (it waited for the sweep or idle polling had nothing noticed)."""
    assert await ks.submit("acct", deposit(1), timeout=10) >= 1
    assert proxy.subscribing_links == 1
    proxy.silence_subscriptions()
    # The health check resubscribes; the server confirms the new subscription (the entry's
    # wake-up, published by the server, would not reach one the server had not taken yet).
    while proxy.confirmed_subscriptions < 2:
        await anyio.sleep(0.05)
    started = time.monotonic()
    await ks.submit("acct", deposit(1), timeout=10)
    return time.monotonic() - started


def _assert_warned(caplog: pytest.LogCaptureFixture) -> None:
    lost = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "subscription to" in r.getMessage()
    ]
    assert lost and "no answer to a PING" in lost[0], caplog.text


@pytest.mark.slow
async def test_a_silently_dropped_tls_reply_subscription_is_noticed_and_reconnected(
    tls_server: TlsServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``rediss://`` subscriptions run on redis-py's connections: checked all the same."""
    caplog.set_level(logging.WARNING, "keyserial")
    async with FaultProxy("client", tls_server.port, tls=_tls_contexts(tls_server)) as proxy:
        proxied = tls_server.url.replace(f":{tls_server.port}/", f":{proxy.port}/")
        with anyio.fail_after(60):
            async with (
                running_worker(tls_server.url, namespace, shard_count=1),
                keyserial.connect(
                    proxied, shards=1, namespace=namespace, idle_poll=30, health_interval=0.3
                ) as ks,
            ):
                took = await _silence_and_time_a_submit(ks, proxy)
        assert took < 2, "the reply came by the sweep, not pub/sub"
        _assert_warned(caplog)


@standalone_only
async def test_a_silently_dropped_subscription_of_a_callers_client_is_noticed(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A redis-py client the caller configured (and keeps owning) subscribes through redis-py:
    checked all the same."""
    caplog.set_level(logging.WARNING, "keyserial")
    async with FaultProxy("client", _port(redis_url)) as proxy:
        client = redis.asyncio.Redis(host="127.0.0.1", port=proxy.port)
        try:
            with anyio.fail_after(60):
                async with (
                    running_worker(redis_url, namespace, shard_count=1),
                    keyserial.connect(
                        client, shards=1, namespace=namespace, idle_poll=30, health_interval=0.3
                    ) as ks,
                ):
                    took = await _silence_and_time_a_submit(ks, proxy)
            assert took < 2, "the reply came by the sweep, not pub/sub"
            _assert_warned(caplog)
        finally:
            await client.aclose()


@standalone_only
@pytest.mark.parametrize("via", ["url", "callers_client"])
async def test_a_silently_dropped_wake_up_subscription_of_a_worker_is_noticed(
    redis_url: str, namespace: str, via: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's wake-ups (and coordination messages) come by a subscription too: one that
    went quiet is replaced, not left to idle polling (every 30 s here)."""
    caplog.set_level(logging.WARNING, "keyserial")
    async with FaultProxy("worker", _port(redis_url)) as proxy:
        client = redis.asyncio.Redis(host="127.0.0.1", port=proxy.port)
        redis_for_worker: str | redis.asyncio.Redis = proxy.url if via == "url" else client
        try:
            with anyio.fail_after(60):
                async with (
                    running_worker(
                        redis_for_worker,
                        namespace,
                        shard_count=1,
                        idle_poll=30,
                        health_interval=0.3,
                    ),
                    keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
                ):
                    took = await _silence_and_time_a_submit(ks, proxy)
            assert took < 2, "the worker heard of the entry by polling, not by its wake-up"
            _assert_warned(caplog)
        finally:
            await client.aclose()


@pytest.mark.slow
@standalone_only
async def test_a_worker_whose_first_subscription_fails_keeps_serving(
    redis_url: str, namespace: str, start: Callable[..., WorkerProcess]
) -> None:
    """Started while Redis keeps going away, a worker may connect and then lose its first
    SUBSCRIBE (long nemesis seed 3161): it must serve by polling and subscribe once it can,
    not exit."""
    proxy = FaultProxy("worker", _port(redis_url))
    await proxy.start()
    proxy.refuse_subscriptions = True
    try:
        worker = start(
            proxy.url, namespace, shards="0", shard_count=1, env={"KEYSERIAL_IDLE_POLL": "0.2"}
        )
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


@pytest.mark.slow
@standalone_only
@pytest.mark.parametrize("via", ["url", "callers_client"])
async def test_a_subscription_silenced_before_its_confirmation_is_replaced_in_time(
    redis_url: str, namespace: str, via: str
) -> None:
    """A connection that goes quiet between SUBSCRIBE and its confirmation (long nemesis seed
    3638: silenced as the client resubscribed after a Redis restart) is given up within a
    health interval per round trip, as an unanswered PING is within one, and subscribed again:
    not left to a command timeout (10 s) while every reply waits for the sweep."""
    interval = 0.3
    async with FaultProxy("client", _port(redis_url)) as proxy:
        client = redis.asyncio.Redis(host="127.0.0.1", port=proxy.port)
        try:
            with anyio.fail_after(60):
                async with (
                    running_worker(redis_url, namespace, shard_count=1),
                    keyserial.connect(
                        proxy.url if via == "url" else client,
                        shards=1,
                        namespace=namespace,
                        idle_poll=30,
                        health_interval=interval,
                    ) as ks,
                ):
                    assert await ks.submit("acct", deposit(1), timeout=10) == 1
                    proxy.silence_subscribing = True
                    proxy.silence_subscriptions()
                    while proxy.subscribing_links < 2:  # resubscribed; that link goes quiet
                        await anyio.sleep(0.01)
                    proxy.silence_subscribing = False
                    quiet_since = time.monotonic()
                    while proxy.subscribing_links < 3:
                        await anyio.sleep(0.01)
                    took = time.monotonic() - quiet_since
                    started = time.monotonic()
                    assert await ks.submit("acct", deposit(1), timeout=10) == 2
                    replied_in = time.monotonic() - started
        finally:
            await client.aclose()
    assert took < 3 * interval + 1, f"subscribed again after {took:.2f}s"
    assert replied_in < 2, "the reply came by the sweep, not pub/sub"


@pytest.mark.slow
@standalone_only
async def test_a_resubscription_over_a_slow_link_gets_a_health_interval_per_round_trip(
    redis_url: str, namespace: str
) -> None:
    """Over a link whose round trip is under the health interval (its PINGs are answered in
    time), a resubscription, which takes more than one round trip, must still get through:
    bounded by one interval it would time out and try again forever, every reply left to the
    sweep."""
    interval = 2.0
    async with FaultProxy("client", _port(redis_url)) as proxy:
        with anyio.fail_after(90):
            async with (
                running_worker(redis_url, namespace, shard_count=1),
                keyserial.connect(
                    proxy.url, shards=1, namespace=namespace, idle_poll=60, health_interval=interval
                ) as ks,
            ):
                assert await ks.submit("acct", deposit(1), timeout=10) == 1
                # Each way: a PING's round trip takes 0.84 of the interval; connecting (the
                # proxy's delay) and subscribing take 1.26.
                proxy.delay = 0.42 * interval
                proxy.silence_subscriptions()
                with anyio.fail_after(40):
                    while True:  # a reply lost before the resubscription is sent again
                        with anyio.move_on_after(6):
                            assert await ks.submit("acct", deposit(1), op_id="probe") == 2
                            break


async def test_what_was_published_while_subscriptions_were_down_is_read_at_once(
    redis_url: str, namespace: str
) -> None:
    """Every subscription is cut (CLIENT KILL TYPE pubsub, as a failover does to a master's
    shard-channel subscribers) and an op is submitted before they are back: its wake-up and its
    reply go to no one. After resubscribing, the worker reads its shards and the client looks
    up its waiting ops at once, so the op is answered in well under the idle poll (30 s)."""
    admin = redis.asyncio.Redis.from_url(redis_url)
    try:
        with anyio.fail_after(60):
            async with (
                running_worker(redis_url, namespace, shard_count=1, idle_poll=30),
                keyserial.connect(redis_url, shards=1, namespace=namespace, idle_poll=30) as ks,
            ):
                await ks.submit("acct", deposit(1))
                killed = await admin.client_kill_filter(_type="pubsub")
                assert killed >= 2  # the worker's wake-ups and the client's replies, at least
                started = time.monotonic()
                assert await ks.submit("acct", deposit(1), timeout=10) == 2
                took = time.monotonic() - started
    finally:
        await admin.aclose()
    assert took < 3, "the op waited for an idle poll or the sweep"


@standalone_only
async def test_a_reply_published_while_the_client_resubscribes_is_looked_up_at_once(
    redis_url: str, namespace: str
) -> None:
    """The client's subscription goes quiet and an op is submitted at once: its reply is lost
    on the quiet link. Once the health check has replaced the subscription, the client looks up
    its waiting ops, not waiting for the sweep (30 s)."""
    async with FaultProxy("client", _port(redis_url)) as proxy:
        with anyio.fail_after(60):
            async with _worker_and_proxied_client(redis_url, namespace, proxy) as ks:
                await ks.submit("acct", deposit(1))
                assert proxy.silence_subscriptions() == 1
                started = time.monotonic()
                assert await ks.submit("acct", deposit(1), timeout=10) == 2
                took = time.monotonic() - started
    assert took < 3, "the reply came by the sweep"
