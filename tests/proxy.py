"""A TCP fault proxy on 127.0.0.1 in front of Redis (these machines' kernels have no netem).

The nemesis puts one in front of each worker slot and each client, so a network fault hits one
party only; a test puts one in front of the party it faults. It forwards bytes both ways, and
on command it adds latency, holds every byte without forwarding it (a blackhole: TCP would
retransmit, so held bytes are delivered once it heals unless the links are reset), resets every
open connection (RST, as a dropped NAT entry or a crashed peer), silences the links that carry
a subscription for good (a NAT or load balancer that forgot an idle connection: no FIN, no RST,
nothing ever arrives again either way), or refuses subscriptions. It serves on the asyncio
event loop that starts it.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time
from contextlib import suppress
from types import TracebackType

_CHUNK = 1 << 16
#: How a SUBSCRIBE command starts in RESP (redis-py and hiredis both send it in capitals).
_SUBSCRIBE = b"\r\nSUBSCRIBE\r\n"


class _Link:
    """One proxied connection: the client side and the upstream side."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        #: The client sent SUBSCRIBE on it.
        self.subscribed = False
        #: Nothing is forwarded on it any more, either way (it stays open).
        self.silenced = False
        #: The server answered after the client subscribed.
        self.confirmed = False

    def reset(self) -> None:
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with suppress(OSError):
                    # Linger 0: close() sends RST instead of FIN.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


#: A TLS proxy's contexts: the one it shows clients (the server's certificate), and the one it
#: shows the server (a client certificate).
TlsContexts = tuple[ssl.SSLContext, ssl.SSLContext]


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``, with faults on demand.

    With ``tls`` it terminates TLS on both sides rather than passing the bytes through: it must
    read the commands to know which links carry a subscription.
    """

    def __init__(self, name: str, upstream_port: int, *, tls: TlsContexts | None = None) -> None:
        self.name = name
        self.upstream_port = upstream_port
        self._tls = tls
        self.port = 0
        self.delay = 0.0
        self._held_until = 0.0
        #: Links that ever sent SUBSCRIBE (a resubscription opens a new one).
        self.subscribing_links = 0
        #: Of those, the links on which the server's answer (its confirmation) came back: from
        #: then on the server delivers what is published on the channels.
        self.confirmed_subscriptions = 0
        #: Reset a link as soon as it sends SUBSCRIBE (a server that keeps going away).
        self.refuse_subscriptions = False
        #: Silence a link as soon as it sends SUBSCRIBE, which never reaches the server: it
        #: went quiet before the subscription was confirmed.
        self.silence_subscribing = False
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """A plain ``redis://`` URL through the proxy (with ``tls``, give the client the
        server's ``rediss://`` URL with :attr:`port` in it)."""
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", 0, ssl=self._tls[0] if self._tls else None
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with suppress(BaseException):
                await task

    # -- faults ----------------------------------------------------------------------------

    def reset(self) -> None:
        """RST every open connection (new ones are accepted as usual)."""
        for link in list(self._links):
            link.reset()
        self._links.clear()

    def hold(self, seconds: float) -> None:
        """Blackhole: accept connections and bytes, forward nothing for ``seconds``."""
        self._held_until = max(self._held_until, time.monotonic() + seconds)

    def silence_subscriptions(self) -> int:
        """Silence every open link that carries a subscription; how many."""
        links = [link for link in self._links if link.subscribed and not link.silenced]
        for link in links:
            link.silenced = True
        return len(links)

    def heal(self) -> None:
        """Forward at once and without delay again (held bytes are delivered now); silenced
        links are reset (their peers reconnect)."""
        self.delay = 0.0
        self._held_until = 0.0
        for link in [link for link in self._links if link.silenced]:
            link.reset()
            self._links.discard(link)

    # -- forwarding ------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:
            # The proxy is closing. asyncio's server reads the handler task's exception (which
            # a cancelled task raises) and would log a traceback per connection.
            pass
        finally:
            self._tasks.discard(task)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._wait(time.monotonic() + self.delay)
        try:
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1", self.upstream_port, ssl=self._tls[1] if self._tls else None
            )
        except OSError:  # Redis is down: the client sees its connection refused-then-closed
            writer.transport.abort()
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        try:
            # Each pipe aborts its target when its source ends, which ends the other pipe.
            await asyncio.gather(
                self._pipe(link, reader, up_writer, outbound=True),
                self._pipe(link, up_reader, writer, outbound=False),
                return_exceptions=True,
            )
        finally:
            self._links.discard(link)
            link.reset()

    async def _pipe(
        self,
        link: _Link,
        source: asyncio.StreamReader,
        target: asyncio.StreamWriter,
        *,
        outbound: bool,
    ) -> None:
        """Copy ``source`` to ``target``, each chunk no earlier than its arrival plus the delay
        and never while held; order is kept (a queue, so delay adds latency, not a cap). A
        silenced link's bytes are dropped."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await source.read(_CHUNK):
                    if outbound and not link.subscribed and _SUBSCRIBE in data:
                        link.subscribed = True
                        self.subscribing_links += 1
                        if self.refuse_subscriptions:
                            link.reset()
                            return
                        link.silenced = link.silenced or self.silence_subscribing
                    if not link.silenced:
                        queue.put_nowait((time.monotonic() + self.delay, data))
                        if not outbound and link.subscribed and not link.confirmed:
                            link.confirmed = True
                            self.confirmed_subscriptions += 1
            finally:
                queue.put_nowait(None)

        reading = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                await self._wait(due)
                if not link.silenced:
                    target.write(data)
                    await target.drain()
        finally:
            reading.cancel()
            with suppress(BaseException):
                await reading
            target.transport.abort()

    async def _wait(self, due: float) -> None:
        while True:
            wait = max(due, self._held_until) - time.monotonic()
            if wait <= 0:
                return
            await asyncio.sleep(min(wait, 0.05))
