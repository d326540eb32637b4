"""Least privilege: the ACL rules docs/deployment.md gives a worker and a client, run as written,
are enough to serve and submit, and keep the client from writing state."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
import redis
import redis.asyncio

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests.helpers import ROOT, keys_on_shard, server_with_waitaof
from tests.users import Users, documented_rules, documented_users, rules_for


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    with documented_users(redis_url) as created:
        yield created


@pytest.mark.slow
async def test_documented_users_can_submit_transfer_and_read_results(
    users: Users, namespace: str
) -> None:
    source, target = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(2, 4, 1, "acct")[0]
    async with (
        running_worker(users.worker_url, namespace, shard_count=4),
        keyserial.connect(users.client_url, namespace=namespace) as ks,
    ):
        assert await ks.submit(source, deposit(100), op_id="opening", timeout=20) == 100
        assert await ks.submit(source, deposit(1), delay=0.2) == 101  # (waits in the timers)
        moved = await ks.transfer(source, target, 41)
        assert moved == {source: 60, target: 41}
        assert await ks.result("opening", key=source) == 100
        # (Queued behind the transfer's apply on the target's shard, which read() may trail.)
        assert await ks.submit(target, deposit(1)) == 42
        assert (await ks.read(source), await ks.read(target)) == (60, 42)
    assert users.refusals() == []


@pytest.mark.slow
async def test_the_client_user_cannot_write_state_or_results(users: Users, namespace: str) -> None:
    """The client user's writes to a key's state, a result, an epoch, a stream (a ``SET``, and
    an ``XADD``: only a shard's owner appends to it, moving in what its inbox holds), its inbox
    other than by ``RPUSH`` (an ``LTRIM``), its timers (a ``ZADD`` that would move a delayed
    op's due time, a ``ZREM`` that would drop it), and a script of its own that writes state,
    are all refused and change nothing; the server's ACL log shows these refusals and no other."""
    async with running_worker(users.worker_url, namespace, shard_count=4):
        pass  # records the namespace's shard count
    shard = ShardKeys(namespace, 0)
    users.client.rpush(shard.inbox, '1\n[{"id":"waiting","key":"acct:1","op":"balance"}]')
    # (Each with what the ACL log names: the command its user may not run, or the key.)
    forged = [
        (("HSET", shard.state, "acct:1", "1000000"), "hset"),
        (("SET", shard.stream, "wedged"), shard.stream),
        (("HSET", shard.results, "some-op", '{"ok":1}'), "hset"),
        (("SET", shard.epoch, "999"), shard.epoch),
        (
            ("EVAL", "return redis.call('HSET', KEYS[1], 'acct:1', '1000000')", 1, shard.state),
            shard.state,
        ),
        (("XADD", shard.stream, "*", "v", "1", "ops", "[]"), "xadd"),
        (("LTRIM", shard.inbox, 1, 0), "ltrim"),
        (("ZADD", shard.timers, 0, "0000000000000001"), "zadd"),
        (("ZREM", shard.timers, "0000000000000001"), "zrem"),
    ]
    for command, _ in forged:
        with pytest.raises(redis.exceptions.ResponseError, match="no permissions"):
            users.client.execute_command(*command)
    assert users.client.hget(shard.state, "acct:1") is None
    assert users.client.hget(shard.results, "some-op") is None
    assert users.client.get(shard.epoch) != b"999"
    assert (users.client.xlen(shard.stream), users.client.llen(shard.inbox)) == (0, 1)
    refused = {f"{users.names[1]}: {named}" for _, named in forged}
    assert sorted(users.refusals()) == sorted(refused)


async def test_a_client_user_cannot_record_a_new_namespace(users: Users, namespace: str) -> None:
    with pytest.raises(keyserial.ConfigError, match="start a worker first"):
        async with keyserial.connect(users.client_url, namespace=namespace):
            pass
    assert users.refusals() == [f"{users.names[1]}: hsetnx"]  # (its record of the shard count)


@pytest.mark.slow
async def test_documented_users_serve_and_submit_with_durable_replicas(namespace: str) -> None:
    """Every acknowledgement waits for the replica: the worker's commits and leases, and the
    client's ``result()``, each write the shard's barrier key and send ``WAIT``."""
    with LocalServer() as master:
        replica = LocalServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)])
        with replica, documented_users(master.url) as users:
            await _durably_served(users, namespace, durable_replicas=1)


async def test_documented_users_serve_and_submit_with_durable_fsync(namespace: str) -> None:
    """``durable_fsync`` on a server that has ``WAITAOF``, with the extra lines."""
    with (
        LocalServer(binary=server_with_waitaof(), appendfsync="always") as server,
        documented_users(server.url, fsync=True) as users,
    ):
        await _durably_served(users, namespace, durable_fsync=True)


async def _durably_served(users: Users, namespace: str, **durability: Any) -> None:
    key = keys_on_shard(1, 2, 1, "acct")[0]
    async with (
        running_worker(users.worker_url, namespace, shard_count=2, **durability),
        keyserial.connect(users.client_url, namespace=namespace, **durability) as ks,
    ):
        assert await ks.submit(key, deposit(5), op_id="durable", timeout=20) == 5
        assert await ks.result("durable", key=key) == 5
    assert users.refusals() == []


async def test_a_submit_timing_out_as_the_client_user_names_the_shards_with_no_owner(
    users: Users, namespace: str
) -> None:
    async with running_worker(users.worker_url, namespace, shard_count=2):
        pass  # records the namespace's shard count, and releases its leases
    key = keys_on_shard(1, 2, 1, "acct")[0]
    async with keyserial.connect(users.client_url, namespace=namespace) as ks:
        with pytest.raises(keyserial.SubmitTimeout) as timed_out:
            await ks.submit(key, deposit(1), timeout=0.3)
    assert timed_out.value.vacant == (1,)
    assert users.refusals() == []


@pytest.mark.slow
async def test_a_submit_timing_out_on_a_paused_key_as_the_client_user_says_it_is_paused(
    users: Users, namespace: str
) -> None:
    key = keys_on_shard(1, 2, 1, "acct")[0]
    async with running_worker(users.worker_url, namespace, shard_count=2):
        code, _, err = await _cli("keys", "pause", key, url=users.worker_url, namespace=namespace)
        assert code == 0, err
        async with keyserial.connect(users.client_url, namespace=namespace) as ks:
            with pytest.raises(keyserial.SubmitTimeout) as timed_out:
                await ks.submit(key, deposit(1), timeout=0.5)
        # (Its op then runs: the worker's stop has no op to wait a lease TTL for.)
        code, _, err = await _cli("keys", "resume", key, url=users.worker_url, namespace=namespace)
        assert code == 0, err
    assert timed_out.value.paused == (key,) and timed_out.value.vacant == ()
    assert users.refusals() == []


@pytest.mark.slow
async def test_operator_commands_run_as_the_documented_worker_user(
    users: Users, namespace: str
) -> None:
    shard = ShardKeys(namespace, 0)
    async with running_worker(users.worker_url, namespace, shard_count=2):
        users.client.rpush(shard.inbox, "1\n{not json")  # (moved in, and dead-lettered)
        with anyio.fail_after(10):
            while not users.admin.xlen(shard.dead):
                await anyio.sleep(0.02)
        status = ("status", "--json", "--interval", "0.1")  # (ops/s over 0.1 s, not 1 s)
        assert (await _cli(*status, url=users.worker_url, namespace=namespace))[0] == 0
        async with keyserial.connect(users.client_url, namespace=namespace) as ks:
            await ks.enqueue(keys_on_shard(0, 2, 1, "acct")[0], deposit(1), delay=60)
        with anyio.fail_after(10):
            while not users.admin.zcard(shard.timers):
                await anyio.sleep(0.02)
        [timer] = users.admin.zrange(shard.timers, 0, -1)
        for action in (("list",), ("cancel", timer.decode())):
            code, _, err = await _cli("timers", *action, url=users.worker_url, namespace=namespace)
            assert code == 0, f"timers {action[0]}: {err}"
        assert users.admin.zcard(shard.timers) == 0
    code, out, err = await _cli(
        "dead-letters", "list", "--json", url=users.worker_url, namespace=namespace
    )
    assert code == 0, err
    (letter,) = [json.loads(line)["id"] for line in out.splitlines()]
    for action in ("show", "replay", "drop"):
        code, _, err = await _cli(
            "dead-letters", action, letter, url=users.worker_url, namespace=namespace
        )
        assert code == 0, f"{action}: {err}"
    assert users.admin.xlen(shard.dead) == 0
    assert users.refusals() == []


async def _cli(*args: str, url: str, namespace: str) -> tuple[int, str, str]:
    with anyio.fail_after(30):
        result = await anyio.run_process(
            [sys.executable, "-m", "keyserial", *args, "--redis", url, "--namespace", namespace],
            cwd=ROOT,
            check=False,
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@contextmanager
def service_user(admin: redis.Redis, redis_url: str, service: str) -> Iterator[str]:
    """The documented client user of one service (the line for ``billing``, renamed to
    ``service``), created on the server under a fresh name: its URL."""
    own = documented_rules("client-billing")[0]
    name, password = f"ks-{service}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = [
        rule.replace(">BILLING_PASSWORD", f">{password}").replace(
            ":reply:billing.", f":reply:{service}."
        )
        for rule in own
    ]
    admin.execute_command("ACL", "SETUSER", name, *rules)
    cluster = bool(admin.info("cluster").get("cluster_enabled"))
    for extra in rules_for("client", cluster=cluster, fsync=False)[1:]:  # (as documented)
        admin.execute_command("ACL", "SETUSER", name, *extra)
    try:
        yield redis_url.replace("redis://", f"redis://{name}:{password}@", 1)
    finally:
        admin.execute_command("ACL", "DELUSER", name)


async def test_a_service_user_serves_its_clients_and_cannot_reach_another_services_replies(
    users: Users, redis_url: str, namespace: str
) -> None:
    """Clients of a service, each connected with ``service=`` as its service's documented user,
    submit, transfer and read results, refused nothing. Another service's user can publish on
    neither their reply channels nor the workers' coordination channels (its only refusals): it
    cannot forge their replies."""
    source, target = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(2, 4, 1, "acct")[0]
    with (
        service_user(users.admin, redis_url, "billing") as billing_url,
        service_user(users.admin, redis_url, "evil") as evil_url,
    ):
        evil = redis.asyncio.Redis.from_url(evil_url)
        try:
            async with (
                running_worker(users.worker_url, namespace, shard_count=4),
                keyserial.connect(billing_url, namespace=namespace, service="billing") as ks,
            ):
                assert ks.client_id.startswith("billing.")
                assert await ks.submit(source, deposit(100), op_id="opening", timeout=20) == 100
                forged = json.dumps({"v": 1, "r": [["next", {"ok": 1_000_000}]]})
                reply_channel = f"ks:{namespace}:reply:{ks.client_id}"
                for channel in (reply_channel, f"ks:{namespace}:worker:any"):
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        await evil.publish(channel, forged)
                await evil.publish(ShardKeys(namespace, 0).wake_channel, "1")  # a hint: allowed
                assert await ks.submit(source, deposit(1), op_id="next") == 101
                assert await ks.transfer(source, target, 40) == {source: 61, target: 40}
                assert await ks.result("opening", key=source) == 100
        finally:
            await evil.aclose()
        assert _refusals_of(users.admin, billing_url) == []
        assert sorted(_refusals_of(users.admin, evil_url)) == sorted(
            [reply_channel, f"ks:{namespace}:worker:any"]
        )
    assert users.refusals() == []


def _refusals_of(admin: redis.Redis, url: str) -> list[str]:
    """What the server refused the user of ``url`` (its ``ACL LOG``), besides redis-py's
    optional ``CLIENT SETINFO``."""
    name = urlsplit(url).username
    return [
        entry["object"]
        for entry in admin.acl_log()
        if entry["username"] == name and entry["object"] != "client|setinfo"
    ]


async def test_a_client_whose_service_its_user_does_not_allow_fails_to_connect(
    users: Users, redis_url: str, namespace: str
) -> None:
    async with running_worker(users.worker_url, namespace, shard_count=2):
        with service_user(users.admin, redis_url, "billing") as billing_url:
            for service in ("", "other"):
                with pytest.raises(keyserial.ConfigError, match="reply"):
                    async with keyserial.connect(billing_url, namespace=namespace, service=service):
                        pass
            refused = _refusals_of(users.admin, billing_url)  # (its subscriptions only)
            assert refused and all(":reply:" in channel for channel in refused)
            assert not any(":reply:billing." in channel for channel in refused)
    assert users.refusals() == []
