"""An async client on an asyncio event loop of its own, in a thread of its own.

The client's transport (redis-py's asyncio client, keyserial's own asyncio protocol) runs on
asyncio only. Callers that are not on an asyncio loop reach the client through this host: the
synchronous client (any thread of a process) and the async client under trio. One host, so one
connection and one reply listener, serves all of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import os
import threading
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from ..errors import KeyserialError
from .api import Client

T = TypeVar("T")
Opener = Callable[[], AbstractAsyncContextManager[Client]]


class HostedClient:
    """Opens a client with ``opener`` on a new event loop in a daemon thread, and runs calls on
    it for other threads. :attr:`client` waits until it is open. (The client is an
    ``AsyncioClient``, whose transport runs on asyncio only; its callers use the API every
    client has, so this host needs nothing more of it.)"""

    def __init__(self, opener: Opener) -> None:
        self._pid = os.getpid()
        self._closed = False
        #: The open client, or what opening it raised.
        self.opened: concurrent.futures.Future[Client] = concurrent.futures.Future()
        #: Done once the client is closed and its loop has nothing left to run.
        self.stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        # A daemon thread: a client nobody closed must not keep the interpreter from exiting.
        self._thread = threading.Thread(
            target=self._serve, args=(opener,), name="keyserial-client", daemon=True
        )
        self._thread.start()

    @property
    def client(self) -> Client:
        """The client, once open (blocks until then; raises what opening it raised)."""
        return self.opened.result()

    def _serve(self, opener: Opener) -> None:
        try:
            asyncio.run(self._host(opener))
        finally:
            self.stopped.set_result(None)

    async def _host(self, opener: Opener) -> None:
        """Keep the client open, in this task (its task group belongs to it), until stopped."""
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with opener() as client:
                self.opened.set_result(client)
                await self._stop.wait()
        except BaseException as exc:
            if not self.opened.done():
                self.opened.set_exception(exc)
                return
            raise

    def check(self) -> None:
        """Raise if the client cannot serve this process (closed, or inherited across a fork)."""
        if self._pid != os.getpid():
            raise KeyserialError(
                f"this keyserial client was created in process {self._pid}, before a fork; this"
                f" is process {os.getpid()}, where its thread and connection do not exist."
                " Create the client after the fork: lazily on first use, or in a post-fork hook"
                " (gunicorn post_fork, Celery worker_process_init, uWSGI postfork)"
            )
        if self._closed:
            raise KeyserialError("the client is closed")

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the client's loop (call :meth:`check` before making it)."""
        # In an empty context: the caller's (trio's, say) must not leak into the loop's task,
        # where sniffio would then report the caller's library.
        return contextvars.Context().run(asyncio.run_coroutine_threadsafe, coroutine, self.loop)

    def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the client's loop and block until it returns or raises. If the
        waiting thread is interrupted (KeyboardInterrupt), the call is cancelled."""
        self.check()
        future = self.submit(make())
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> bool:
        """Start closing the client; :attr:`stopped` is done once it is closed. False if there
        is nothing to wait for: already closed, never opened, or in a forked child (where the
        thread and the connection belong to the parent)."""
        if self._closed:
            return False
        self._closed = True
        if self._pid != os.getpid() or self.opened.exception() is not None:
            return False
        self.loop.call_soon_threadsafe(self._stop.set)
        return True

    def close(self) -> None:
        """Close the client and stop its thread."""
        if self.stop():
            self.stopped.result()
            self._thread.join()
