"""Fixtures: private Redis servers started by the tests (never the machine's shared one).

Every test that talks to Redis runs twice: on a standalone server and on a one-node Redis
Cluster that owns every slot (which rejects any script touching two hash slots).
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio

from keyserial._backend.backend import Backend
from keyserial.testing import LocalServer
from tests.helpers import ROOT, WorkerProcess, worker_processes
from tests.postgres import LocalPostgres, find_binaries
from tests.tls import TlsServer, TlsUnsupported, make_certificates


def pytest_configure(config: pytest.Config) -> None:
    """Give SIGINT its usual meaning in every test process, whatever started the run: a
    background job of a non-interactive shell (CI's, `pytest &`) starts with SIGINT ignored, and
    an ignored or blocked SIGINT passes to every child a test starts, so a test that stops one
    with Ctrl-C's signal would wait in vain."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)


TOPOLOGIES = ("standalone", "cluster")
_counter = itertools.count()


@pytest.fixture(scope="session")
def standalone_server() -> Iterator[LocalServer]:
    with LocalServer() as server:
        yield server


@pytest.fixture(scope="session")
def cluster_server() -> Iterator[LocalServer]:
    with LocalServer(cluster=True) as server:
        yield server


@pytest.fixture(scope="session")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    """A private server listening on TLS only, requiring a client certificate (tests/tls.py)."""
    directory = tmp_path_factory.mktemp("tls")
    try:
        server = TlsServer(directory, make_certificates(directory))
        server.start()
    except TlsUnsupported as exc:
        pytest.skip(f"no TLS-capable redis-server: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=TOPOLOGIES)
def redis_url(request: pytest.FixtureRequest) -> str:
    """URL of a private server, once per topology."""
    server: LocalServer = request.getfixturevalue(f"{request.param}_server")
    return server.url


@pytest.fixture(params=TOPOLOGIES)
def durable_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalServer]:
    """A private server of its own (it gets killed), persisting every write before replying."""
    server = LocalServer(
        cluster=request.param == "cluster", appendfsync="always", data_dir=tmp_path / "redis"
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    """A namespace no other test uses, so tests share servers without sharing data."""
    name = request.node.name.replace("[", "-").replace("]", "").replace(":", "-")
    return f"t{next(_counter)}-{name}"[:60].replace(" ", "")


@pytest.fixture(autouse=True)
def _importable_test_apps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker subprocesses import ``tests.apps``: put the repository on their path."""
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{path}" if path else str(ROOT))


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``keyserial worker`` processes; all are killed at the end (logs shown on failure)."""
    with worker_processes(tmp_path) as starter:
        yield starter


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres]:
    """A private PostgreSQL server (initdb + pg_ctl on a free port); skips without binaries."""
    bindir = find_binaries()
    if bindir is None:
        pytest.skip(
            "no PostgreSQL server binaries (initdb, pg_ctl) on PATH or under"
            " /usr/lib/postgresql/*/bin: install the postgresql package"
        )
    with LocalPostgres(bindir) as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres_server: LocalPostgres) -> str:
    """A fresh database on the private server, for one test."""
    return postgres_server.create_database(f"t{next(_counter)}")


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[Backend]:
    """keyserial's connection to the test's server, for tests that run script calls as built."""
    connected = await Backend.connect(redis_url)
    try:
        yield connected
    finally:
        await connected.aclose()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    """Plain commands to the test's server (the test cluster has one node: it serves every
    slot)."""
    connection = redis.asyncio.Redis.from_url(redis_url)
    try:
        yield connection
    finally:
        await connection.aclose()
