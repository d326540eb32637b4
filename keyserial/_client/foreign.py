"""The async client on an event loop other than asyncio's (trio, through anyio).

The client's transport runs on asyncio only, so under trio :func:`keyserial.connect` hosts the
client on an asyncio loop in a thread of its own (:mod:`keyserial._client.hosted`) and hands the
caller a
:class:`ForeignLoopClient`: the same API, each call crossing to that loop and its outcome coming
back through the caller's loop. Cancelling a call cancels it there, with the usual meaning
(withdrawn if not sent yet, else the op may still apply).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any, TypeVar

import anyio
import sniffio

from .._wire.call import Call
from .._wire.layout import Layout
from ..errors import KeyserialError
from .api import Client, Keys
from .hosted import HostedClient, Opener
from .pending import When

T = TypeVar("T")
R = TypeVar("R")


class ForeignLoopClient(Client):
    """A :class:`Client` whose calls run on a hosted asyncio loop (see the module docstring).

    It shares :class:`Client`'s argument checks and routing; only the calls that talk to Redis
    are forwarded, to the hosted client.
    """

    def __init__(self, hosted: HostedClient, notify: Notify) -> None:
        inner = hosted.client
        super().__init__(inner.settings, inner.layout, inner.client_id)
        self._hosted = hosted
        self._notify = notify
        self._inner = inner

    @classmethod
    async def open(cls, opener: Opener) -> ForeignLoopClient:
        notify = _waker()
        hosted = HostedClient(opener)
        try:
            await _wait(hosted.opened, notify)
        except BaseException:
            if hosted.stop():
                await _wait(hosted.stopped, notify)
            raise
        return cls(hosted, notify)

    async def aclose(self) -> None:
        if self._hosted.stop():
            with anyio.CancelScope(shield=True):
                await _wait(self._hosted.stopped, self._notify)

    def new_op_id(self) -> str:
        return self._inner.new_op_id()

    @property
    def layout(self) -> Layout:
        return self._inner.layout

    async def _send(
        self, keys: Keys, call: Call[R], timeout: float, op_id: str | None, when: When | None
    ) -> R:
        return await self._run(lambda: self._inner._send(keys, call, timeout, op_id, when))

    async def _enqueue(
        self, keys: Keys, call: Call[Any], timeout: float, op_id: str | None, when: When | None
    ) -> str:
        return await self._run(lambda: self._inner._enqueue(keys, call, timeout, op_id, when))

    async def _state(self, key: str) -> Any:
        return await self._run(lambda: self._inner._state(key))

    async def _stored_result(
        self, op_id: str, keys: tuple[str, ...], bound_to: str | None = None
    ) -> Any:
        return await self._run(lambda: self._inner._stored_result(op_id, keys, bound_to))

    async def _run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        self._hosted.check()
        await anyio.lowlevel.checkpoint_if_cancelled()  # already cancelled: send nothing
        future = self._hosted.submit(make())
        try:
            return await _wait(future, self._notify)
        except BaseException:  # cancelled: cancel the call on the client's loop too
            future.cancel()
            raise


Notify = Callable[[Callable[[], object]], None]


async def _wait(future: concurrent.futures.Future[T], notify: Notify) -> T:
    """The outcome of ``future`` (done in another thread), awaited on the caller's loop."""
    done = anyio.Event()
    future.add_done_callback(lambda _: notify(done.set))
    await done.wait()
    return future.result()


def _waker() -> Notify:
    """A thread-safe, non-blocking way to run a callback on the current (trio) event loop."""
    library = sniffio.current_async_library()
    if library != "trio":
        raise KeyserialError(f"keyserial's client runs on asyncio or trio, not {library}")
    import trio  # only here: trio is optional

    token = trio.lowlevel.current_trio_token()

    def notify(callback: Callable[[], object]) -> None:
        with suppress(trio.RunFinishedError):  # the caller's loop is gone: nobody waits
            token.run_sync_soon(callback)

    return notify
