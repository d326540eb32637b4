"""With ``durable_replicas``, a WAIT confirms what ran on its own connection: a script's writes, or
what a read found, go out with their barrier and WAIT in one pipeline, on one connection to one
master.

A WAIT sent on its own, after the read or the write it is meant to confirm, can reach another
master: a failover in between moves the slot, the client learns the new routing, and the new
master confirms its own writes. A randomized cluster fault run (seed 167) found exactly that: a
participant read a payment's decision from the master a failover had just left behind (it still
took itself for the master), confirmed it on the promoted replica, which never had it, and
applied it; the payment then ran again under the new owner of its home shard.

Each test watches the master with MONITOR and checks which connection sent what. A single-node
cluster serves: ``WAIT 0`` confirms at once, and the connection is what is under test.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
import redis

from keyserial._backend.backend import Backend
from keyserial._backend.durability import held_confirmed, run_confirmed, stored_confirmed
from keyserial._scripts.cross import ResolveArgs, resolve
from keyserial._settings import Durability
from keyserial._worker.pipeline import Pipeliner
from keyserial.testing import LocalServer, ShardKeys
from tests.helpers import eventually

CONFIRMED = Durability(replicas=0, fsync=False, wait_ms=1000)


@contextmanager
def monitored(server: LocalServer) -> Iterator[list[dict[str, Any]]]:
    """The commands the server runs meanwhile, as MONITOR reports them (``client_port``,
    ``command``), collected by a thread."""
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    with redis.Redis(port=server.port, socket_timeout=0.1) as client, client.monitor() as monitor:

        def collect() -> None:
            while not stop.is_set():
                try:
                    seen.append(monitor.next_command())
                except redis.TimeoutError:
                    continue

        thread = threading.Thread(target=collect, daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            stop.set()
            thread.join(timeout=5)


async def senders(seen: list[dict[str, Any]], *names: str) -> dict[str, set[str]]:
    """The connections (client ports) that sent each named command, once MONITOR has shown a
    WAIT (the last command of a confirmed round trip)."""
    await eventually(
        lambda: any(each["command"].startswith("WAIT") for each in seen),
        message="a WAIT seen by MONITOR",
    )
    by_name: dict[str, set[str]] = {name: set() for name in names}
    for each in seen:
        name = each["command"].split(" ", 1)[0]
        if name in by_name and each.get("client_type") != "lua":
            by_name[name].add(each["client_port"])
    return by_name


@pytest.fixture
async def backend(cluster_server: LocalServer) -> AsyncIterator[Backend]:
    """A backend of the one-node cluster."""
    backend = await Backend.connect(cluster_server.url)
    yield backend
    await backend.aclose()


def one_connection(sent: dict[str, set[str]], *names: str) -> set[str]:
    """The one connection that sent every command of ``names``, and the WAIT."""
    senders_of_calls = set().union(*(sent[name] for name in names))
    assert len(senders_of_calls) == 1, sent
    assert senders_of_calls == sent["WAIT"], f"calls and WAIT on different connections: {sent}"
    return senders_of_calls


async def test_a_stored_result_is_read_on_the_connection_its_wait_confirms(
    cluster_server: LocalServer,
    backend: Backend,
) -> None:
    shard = ShardKeys("confirm-read", 0)
    await backend.call("HSET", shard.results, "op-1", '{"value":1}')
    with monitored(cluster_server) as seen:
        found = await stored_confirmed(backend, CONFIRMED, shard, ["op-1", "op-2"])
        sent = await senders(seen, "HMGET", "WAIT")
    assert found == ([b'{"value":1}', None], True)
    # (A first read may go elsewhere: only the one its WAIT vouches for counts.)
    assert len(sent["WAIT"]) == 1, sent
    assert sent["WAIT"] <= sent["HMGET"], f"no read on the WAIT's connection: {sent}"


async def test_a_hold_is_read_on_the_connection_its_wait_confirms(
    cluster_server: LocalServer,
    backend: Backend,
) -> None:
    """How a coordinator reads a grant it was not handed: from the participant's held hash,
    with a WAIT on the same connection; nothing found is an answer too."""
    shard = ShardKeys("confirm-hold", 0)
    await backend.call("HSET", shard.held, "op-1#2", '{"t":"g"}')
    with monitored(cluster_server) as seen:
        found = await held_confirmed(backend, CONFIRMED, shard, "op-1#2")
        sent = await senders(seen, "HGET", "WAIT")
    assert found == (b'{"t":"g"}', True)
    assert len(sent["WAIT"]) == 1, sent
    assert sent["WAIT"] <= sent["HGET"], f"no read on the WAIT's connection: {sent}"
    assert await held_confirmed(backend, CONFIRMED, shard, "op-1#3") == (None, True)


async def test_script_calls_run_on_the_connection_their_wait_confirms(
    cluster_server: LocalServer,
    backend: Backend,
) -> None:
    shard = ShardKeys("confirm-calls", 0)
    await backend.call("SET", shard.epoch, "7")
    calls = [resolve(shard, ResolveArgs(f"op-{n}", 7)) for n in range(3)]
    with monitored(cluster_server) as seen:
        replies, confirmed = await run_confirmed(backend, calls, CONFIRMED)
        sent = await senders(seen, "EVALSHA", "EVAL", "WAIT")
    assert replies == [None, None, None]  # undecided: the coordinator still owns epoch 7
    assert confirmed
    one_connection(sent, "EVALSHA", "EVAL")


async def test_a_durable_call_is_returned_from_a_pipeline_its_own_wait_confirmed(
    cluster_server: LocalServer,
    backend: Backend,
) -> None:
    """What a participant does to read a decision: through the pipeliner, with its WAIT."""
    shard = ShardKeys("confirm-durably", 0)
    pipeliner = Pipeliner(backend, CONFIRMED)
    await backend.call("SET", shard.epoch, "3")
    await backend.call("HSET", shard.results, "op-1#3#d", '{"w":{}}')
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pipeliner.serve)
        with monitored(cluster_server) as seen:
            decision = await pipeliner.run_durably(resolve(shard, ResolveArgs("op-1", 3)))
            sent = await senders(seen, "EVALSHA", "EVAL", "WAIT")
        tasks.cancel_scope.cancel()
    assert decision == {"w": {}}
    one_connection(sent, "EVALSHA", "EVAL")
