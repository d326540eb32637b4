"""The ``durable_replicas`` setting on a master with one replica: an acknowledgement (a reply,
or a stored result a client takes as its answer) waits until the replica has the commit.

The replica is stopped (SIGSTOP) while an op commits on the master: the op's submit must stay
unanswered and its stored result must not count as an answer until the replica is resumed and
has caught up. Without the setting the submit would return at once.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

import keyserial
from keyserial import BackendUnavailable, Settings, shard_for
from keyserial.testing import LocalServer, ShardKeys
from tests import apps
from tests.helpers import WorkerProcess, eventually, keys_on_shard, noted, server_with_waitaof

SHARDS = 2


@pytest.fixture
def replicated() -> Iterator[tuple[LocalServer, LocalServer]]:
    """A master and its replica, in sync."""
    with LocalServer() as master:
        replica = LocalServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)])
        with replica:
            wait_in_sync(replica)
            yield master, replica
            replica.send_signal(signal.SIGCONT)


def wait_in_sync(replica: LocalServer) -> None:
    with redis.Redis(port=replica.port) as client:
        deadline = time.monotonic() + 10
        while client.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never came in sync"
            time.sleep(0.02)


def wait_aof_ready(replica: LocalServer) -> None:
    """Until the replica's AOF is on and no rewrite is under way or due: after its full sync a
    replica rewrites its AOF, and confirms no WAITAOF until that is done (on a loaded machine,
    for many seconds)."""
    with redis.Redis(port=replica.port) as client:
        deadline = time.monotonic() + 60
        while True:
            info = client.info("persistence")
            if info.get("aof_enabled") and not (
                info.get("aof_rewrite_in_progress") or info.get("aof_rewrite_scheduled")
            ):
                return
            assert time.monotonic() < deadline, f"the replica's AOF is not ready: {info}"
            time.sleep(0.05)


def stored_on(server: LocalServer, namespace: str, key: str, op_id: str) -> bool:
    shard = ShardKeys(namespace, shard_for(key, SHARDS))
    with redis.Redis(port=server.port) as client:
        return any(client.hexists(hash_, op_id) for hash_ in (shard.results, shard.results_old))


@pytest.mark.slow
async def test_an_acknowledgement_waits_until_a_replica_has_the_commit(
    replicated: tuple[LocalServer, LocalServer],
    namespace: str,
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    master, replica = replicated
    monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")  # the worker process's setting
    start(master.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=2.0)
    async with keyserial.connect(
        master.url, shards=SHARDS, namespace=namespace, durable_replicas=1, idle_poll=0.2
    ) as ks:
        for number in range(5):  # acknowledged: the replica has each one already
            op_id = f"warm-{number}"
            await ks.submit("acct", apps.append(number), op_id=op_id, timeout=20)
            assert stored_on(replica, namespace, "acct", op_id)

        replica.send_signal(signal.SIGSTOP)
        # Committed on the master, not on the stopped replica: neither the reply nor the
        # client's sweep (every 0.2 s here) may take it as acknowledged meanwhile.
        answer = await held_until_released(
            ks,
            "late",
            apps.append("late"),
            committed=lambda: stored_on(master, namespace, "acct", "late"),
            refusal="not confirmed in time",
            release=lambda: replica.send_signal(signal.SIGCONT),
        )
        assert answer == [0, 1, 2, 3, 4, "late"]
        assert stored_on(replica, namespace, "acct", "late")
        assert await ks.result("late", key="acct") == [0, 1, 2, 3, 4, "late"]


@pytest.mark.slow
async def test_an_owner_whose_commit_is_not_confirmed_gives_its_shard_up_with_no_strike(
    replicated: tuple[LocalServer, LocalServer],
    namespace: str,
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A commit its replica does not confirm breaks the owner's write_chain: it gives the shard up
    (its successor starts from Redis), cleanly, for the ops it leaves unfinished are not to
    blame: the next owner runs them again without suspecting any (a strike each, three times,
    would dead-letter innocent ops while a replica lags)."""
    master, replica = replicated
    monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")
    worker = start(
        master.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=2.0
    )
    slow, fast = keys_on_shard(shard_for("acct", SHARDS), SHARDS, 2, "acct")
    note = tmp_path / "held"
    async with keyserial.connect(
        master.url, shards=SHARDS, namespace=namespace, durable_replicas=1, idle_poll=0.2
    ) as ks:
        await ks.submit(fast, apps.append("warm"), timeout=20)
        async with anyio.create_task_group() as group:
            group.start_soon(partial(ks.submit, slow, apps.hold(3.0, str(note)), timeout=60))
            await eventually(lambda: noted(note), message="the slow op running")
            replica.send_signal(signal.SIGSTOP)
            group.start_soon(partial(ks.submit, fast, apps.append("late"), timeout=60))
            await eventually(lambda: "giving the shard up" in worker.log(), timeout=20)
            replica.send_signal(signal.SIGCONT)
            await eventually(
                lambda: worker.log().count("acquired (epoch") > SHARDS,
                message="the shard taken over again",
            )
            await eventually(
                lambda: note.read_text().count("\n") >= 2,
                timeout=30,
                message="the successor running the slow op again",
            )
            group.cancel_scope.cancel()
    assert "suspect op" not in worker.log(), "an op took a strike for an unconfirmed commit"


@pytest.mark.slow
async def test_a_worker_runs_no_op_under_an_epoch_its_replica_has_not_confirmed(
    replicated: tuple[LocalServer, LocalServer],
    namespace: str,
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Acquiring a shard bumps its fencing epoch. A bump no replica has dies with its master,
    and the promoted replica hands the same epoch to the next owner: two owners that fencing
    cannot tell apart, each committing on its own view of the shard. So an owner starts only
    once its replica confirms the epoch (the acquire is sent again, the same attempt, until)."""
    master, replica = replicated
    monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")
    shard = ShardKeys(namespace, shard_for("acct", SHARDS))
    async with keyserial.connect(
        master.url, shards=SHARDS, namespace=namespace, durable_replicas=1, idle_poll=0.2
    ) as ks:
        answers: list[Any] = []

        async def submit() -> None:
            answers.append(await ks.submit("acct", apps.append("first"), op_id="first", timeout=60))

        replica.send_signal(signal.SIGSTOP)
        async with anyio.create_task_group() as group:
            group.start_soon(submit)
            await eventually(lambda: items_naming(master, shard, "first"))
            worker = start(
                master.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=2.0
            )
            await eventually(
                lambda: (
                    worker.log().count("not confirmed by the replicas") >= 3
                    or stored_on(master, namespace, "acct", "first")
                ),
                timeout=20,
                message="three acquire rounds, or the op run",
            )
            assert not stored_on(master, namespace, "acct", "first"), (
                "an op ran under an epoch the replica did not have"
            )
            replica.send_signal(signal.SIGCONT)
    assert answers == [["first"]]
    assert "acquired (epoch 1)" in worker.log()  # the same attempt's grant, confirmed


@pytest.mark.slow
async def test_an_unconfirmed_outcome_does_not_keep_a_lost_append_from_being_made_again(
    replicated: tuple[LocalServer, LocalServer],
    namespace: str,
) -> None:
    """While a shard's master has no replica to confirm with (after a failover, until one
    joins), some stored outcome is always unconfirmed. The client's sweep must still push
    again an op whose entry a failover lost: it waits for the unconfirmed outcome alone."""
    master, replica = replicated
    shard = ShardKeys(namespace, shard_for("acct", SHARDS))
    async with keyserial.connect(
        master.url, shards=SHARDS, namespace=namespace, durable_replicas=1, idle_poll=0.2
    ) as ks:
        replica.send_signal(signal.SIGSTOP)

        def submit(op_id: str) -> Callable[[], Any]:
            return partial(ks.submit, "acct", apps.append(op_id), op_id=op_id, timeout=30)

        async with anyio.create_task_group() as group:  # no worker: both stay unanswered
            group.start_soon(submit("answered-op"))
            await eventually(lambda: items_naming(master, shard, "answered-op"))
            group.start_soon(submit("lost-op"))  # (pushed after it: the inbox's last item)
            await eventually(lambda: items_naming(master, shard, "lost-op"))
            with redis.Redis(port=master.port) as client:
                # One op's outcome is stored (its replica stopped: unconfirmed); the other's
                # entry is gone with no outcome, as a failover would lose it.
                client.hset(shard.results, "answered-op", '{"ok": ["answered-op"]}')
                assert b"lost-op" in client.rpop(shard.inbox)
            await eventually(
                lambda: items_naming(master, shard, "lost-op"),
                timeout=5,
                message="the lost op pushed again",
            )
            replica.send_signal(signal.SIGCONT)
            group.cancel_scope.cancel()


def items_naming(server: LocalServer, shard: ShardKeys, op_id: str) -> list[bytes]:
    """The items in the shard's inbox that carry ``op_id`` (no worker runs: none is moved into
    the stream)."""
    with redis.Redis(port=server.port) as client:
        items: list[bytes] = client.lrange(shard.inbox, 0, -1)
    return [item for item in items if op_id.encode() in item]


async def held_until_released(
    ks: keyserial.Client,
    op_id: str,
    op: Any,
    *,
    committed: Callable[[], bool],
    refusal: str,
    release: Callable[[], object],
) -> Any:
    """Submit ``op`` on "acct" and wait until ``committed()``; it must stay unacknowledged (no
    reply, and ``ks.result`` refused with ``refusal``) until ``release()``; then its answer."""
    answers: list[Any] = []
    done = anyio.Event()

    async def submit() -> None:
        answers.append(await ks.submit("acct", op, op_id=op_id, timeout=60))
        done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(submit)
        await eventually(committed)
        with anyio.move_on_after(1.5):
            await done.wait()
        assert not done.is_set(), "acknowledged before the commit was as durable as asked"
        with pytest.raises(BackendUnavailable, match=refusal):
            await ks.result(op_id, key="acct")
        release()
        with anyio.fail_after(20):
            await done.wait()
    return answers[0]


def test_durable_replicas_is_a_setting_with_a_checked_value() -> None:
    assert Settings.resolve({"KEYSERIAL_DURABLE_REPLICAS": "2"}).durable_replicas == 2
    with pytest.raises(keyserial.ConfigError, match="durable_replicas"):
        Settings(durable_replicas=-1)


async def test_durable_fsync_on_a_server_that_cannot_confirm_it_is_refused_at_once(
    namespace: str,
) -> None:
    """No AOF (or no WAITAOF at all, as on Redis 7.0): every acknowledgement would wait
    forever, so connecting says so instead."""
    with (
        LocalServer() as server,
        pytest.raises(keyserial.ConfigError, match="durable_fsync needs WAITAOF"),
    ):
        async with keyserial.connect(
            server.url, shards=SHARDS, namespace=namespace, durable_fsync=True
        ):
            pass


@pytest.mark.slow
async def test_with_durable_fsync_an_acknowledgement_waits_for_the_replica_s_aof(
    namespace: str,
    start: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica that has the commit but keeps no AOF confirms WAIT, never WAITAOF: with
    durable_fsync the op stays unacknowledged until the replica turns its AOF on."""
    binary = server_with_waitaof()
    with LocalServer(binary=binary, appendfsync="always") as master:
        replica = LocalServer(
            binary=binary,
            appendfsync="always",
            extra_args=["--replicaof", "127.0.0.1", str(master.port)],
        )
        with replica, redis.Redis(port=replica.port) as replica_client:
            wait_in_sync(replica)
            wait_aof_ready(replica)
            monkeypatch.setenv("KEYSERIAL_DURABLE_REPLICAS", "1")
            monkeypatch.setenv("KEYSERIAL_DURABLE_FSYNC", "true")
            worker = start(
                master.url, namespace, shards=f"0-{SHARDS - 1}", shard_count=SHARDS, lease_ttl=2.0
            )
            async with keyserial.connect(
                master.url, shards=SHARDS, namespace=namespace, idle_poll=0.2
            ) as ks:
                assert ks.settings.durable_fsync and ks.settings.durable_replicas == 1
                # (Its leases are taken only once the replica's AOF has them: both fsync every
                # write, so no WAITAOF waits out an fsync's second or a loaded machine's.)
                await eventually(
                    lambda: worker.log().count("acquired (epoch") == SHARDS,
                    timeout=30,
                    message="the leases confirmed in both AOFs",
                )
                replica_client.config_set("appendonly", "no")
                # On the replica (WAIT would count it), not in its AOF (WAITAOF does not).
                assert await held_until_released(
                    ks,
                    "fsynced",
                    apps.append("x"),
                    committed=lambda: stored_on(replica, namespace, "acct", "fsynced"),
                    refusal="durable_fsync=True",
                    release=lambda: replica_client.config_set("appendonly", "yes"),
                ) == ["x"]
                assert await ks.result("fsynced", key="acct") == ["x"]


@pytest.mark.slow
async def test_an_enqueue_returns_only_once_a_replica_has_its_append(
    replicated: tuple[LocalServer, LocalServer], namespace: str
) -> None:
    """An enqueue's answer is its append: with ``durable_replicas``, a replica confirms the
    append first (a failover to it then loses nothing enqueued), or the enqueue fails saying
    it may have been appended (a delayed one waits in the inbox until a worker moves it)."""
    master, replica = replicated
    inbox = ShardKeys(namespace, shard_for("acct", SHARDS)).inbox
    async with keyserial.connect(
        master.url, shards=SHARDS, namespace=namespace, durable_replicas=1
    ) as ks:
        await ks.enqueue("acct", apps.append(1), op_id="confirmed", delay=60)
        with redis.Redis(port=replica.port) as client:
            assert client.llen(inbox) == 1, "the replica has the append"
        replica.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(keyserial.BackendUnavailable, match="not confirmed in time"):
                await ks.enqueue("acct", apps.append(2), op_id="unconfirmed", delay=60)
        finally:
            replica.send_signal(signal.SIGCONT)
        with redis.Redis(port=master.port) as client:
            assert client.llen(inbox) == 2, "appended on the master, unconfirmed"
