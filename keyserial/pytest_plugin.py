"""keyserial's pytest plugin (loaded by pytest once keyserial is installed): a private server
for the session, and per test a namespace of its own, a worker that owns it, and a client.

Fixtures:

- ``keyserial_server``: a :class:`~keyserial.testing.LocalServer` for the whole session (one
  per xdist process), started on first use.
- ``keyserial_namespace``: a namespace no other test uses, so tests never see each other's keys.
- ``keyserial_worker``: a worker that owns every shard of ``keyserial_namespace`` for the test,
  serving the ledger's ops and those of the modules in the ``keyserial_apps`` ini option (or
  of a test's ``@pytest.mark.keyserial_apps("myapp.ops", ...)``). It runs in a thread with its
  own event loop, so sync tests (Django, Flask) use it as async ones do. It is a
  :class:`KeyserialWorker`: ``url``, ``namespace``, ``shard_count``.
- ``keyserial_client``: a :class:`~keyserial.SyncClient` for that worker's namespace. An async
  test connects itself: ``async with keyserial.connect(keyserial_worker.url,
  namespace=keyserial_worker.namespace) as ks``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ._client.sync import SyncClient
    from ._local.server import LocalServer

#: Shards of a test's namespace: enough for cross-shard ops, few enough to start at once.
_SHARDS = 4
#: Seconds a worker has to own its namespace, and to drain when the test ends.
_START_TIMEOUT = 30.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "keyserial_apps",
        "modules whose @keyserial.op functions the keyserial_worker fixture serves",
        type="linelist",
        default=[],
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "keyserial_apps(*modules): the op modules keyserial_worker serves for this test",
    )


@pytest.fixture(scope="session")
def keyserial_server() -> Iterator[LocalServer]:
    from ._local.server import LocalServer

    with LocalServer() as server:
        yield server


@pytest.fixture
def keyserial_namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@dataclass
class KeyserialWorker:
    """A worker in a thread of its own, owning every shard of ``namespace`` while it runs."""

    url: str
    namespace: str
    apps: Sequence[str]
    shard_count: int = _SHARDS
    _ready: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(),), name="keyserial-worker", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise TimeoutError(f"the keyserial worker did not start in {_START_TIMEOUT:g}s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(_START_TIMEOUT)
        if self._error is not None:
            raise self._error

    async def _serve(self) -> None:
        from ._local.running import running_worker

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with running_worker(
                self.url, self.namespace, shard_count=self.shard_count, apps=self.apps
            ):
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()


@pytest.fixture
def keyserial_worker(
    request: pytest.FixtureRequest, keyserial_server: LocalServer, keyserial_namespace: str
) -> Iterator[KeyserialWorker]:
    marker = request.node.get_closest_marker("keyserial_apps")
    apps = list(marker.args) if marker else request.config.getini("keyserial_apps")
    worker = KeyserialWorker(keyserial_server.url, keyserial_namespace, apps)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def keyserial_client(keyserial_worker: KeyserialWorker) -> Iterator[SyncClient]:
    from ._client.sync import connect_sync

    with connect_sync(
        keyserial_worker.url,
        shards=keyserial_worker.shard_count,
        namespace=keyserial_worker.namespace,
    ) as client:
        yield client
