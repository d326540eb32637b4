"""Least privilege: the ACL rules docs/deployment.md gives a worker and a client, run as written,
are enough to serve and submit, and keep the client from writing state."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import ShardKeys, running_worker
from tests.helpers import ROOT, keys_on_shard

DOCS = (ROOT / "docs" / "deployment.md").read_text()


def _documented_rules(user: str) -> list[list[str]]:
    """Every ``ACL SETUSER <user> ...`` line of the docs, as arguments after ``ACL SETUSER``."""
    lines = re.findall(rf"^ACL SETUSER keyserial-{user} (.*)$", DOCS, re.M)
    assert lines, f"docs/deployment.md has no ACL SETUSER line for keyserial-{user}"
    return [line.split() for line in lines]


@dataclass(frozen=True)
class Users:
    worker_url: str
    client_url: str
    client: redis.Redis  # a synchronous connection as the client user
    admin: redis.Redis
    names: tuple[str, str]

    def refusals(self) -> list[str]:
        """What the server refused these users (``ACL LOG``), besides redis-py's optional
        ``CLIENT SETINFO``."""
        entries = self.admin.execute_command("ACL", "LOG")
        return [
            f"{entry['username']}: {entry['object']}" for entry in map(_entry, entries)
            if entry["username"] in self.names and entry["object"] != "client|setinfo"
        ]


def _entry(raw: list[bytes] | dict[bytes, bytes]) -> dict[str, str]:
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
    return {_text(key): _text(value) for key, value in pairs}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    """The documented worker and client users, created on the server under fresh names."""
    admin = redis.Redis.from_url(redis_url)
    cluster = bool(admin.info("cluster").get("cluster_enabled"))
    suffix = uuid.uuid4().hex[:8]
    urls = {}
    for user in ("worker", "client"):
        name, password = f"ks-{user}-{suffix}", uuid.uuid4().hex
        rules = _documented_rules(user)
        base = [rule.replace(f">{user.upper()}_PASSWORD", f">{password}") for rule in rules[0]]
        admin.execute_command("ACL", "SETUSER", name, *base)
        if cluster:
            for extra in rules[1:]:
                admin.execute_command("ACL", "SETUSER", name, *extra)
        urls[user] = redis_url.replace("redis://", f"redis://{name}:{password}@", 1)
    client = redis.Redis.from_url(urls["client"])
    try:
        yield Users(urls["worker"], urls["client"], client, admin,
                    (f"ks-worker-{suffix}", f"ks-client-{suffix}"))
    finally:
        client.close()
        for user in ("worker", "client"):
            admin.execute_command("ACL", "DELUSER", f"ks-{user}-{suffix}")
        admin.close()


async def test_documented_users_can_submit_transfer_and_read_results(
    users: Users, namespace: str
) -> None:
    source, target = keys_on_shard(0, 4, 1, "acct")[0], keys_on_shard(2, 4, 1, "acct")[0]
    async with (
        running_worker(users.worker_url, namespace, shard_count=4),
        keyserial.connect(users.client_url, namespace=namespace) as ks,
    ):
        assert await ks.submit(source, deposit(100), op_id="opening", timeout=20) == 100
        moved = await ks.transfer(source, target, 40)
        assert moved == {source: 60, target: 40}
        assert await ks.result("opening", key=source) == 100
        assert (await ks.read(source), await ks.read(target)) == (60, 40)
    assert users.refusals() == []


async def test_the_client_user_cannot_write_state_or_results(
    users: Users, namespace: str
) -> None:
    async with running_worker(users.worker_url, namespace, shard_count=4):
        pass  # records the namespace's shard count
    shard = ShardKeys(namespace, 0)
    forged = [
        ("HSET", shard.state, "acct:1", "1000000"),
        ("HSET", shard.results, "some-op", '{"ok":1}'),
        ("SET", shard.epoch, "999"),
        ("EVAL", "return redis.call('HSET', KEYS[1], 'acct:1', '1000000')", 1, shard.state),
    ]
    for command in forged:
        with pytest.raises(redis.exceptions.ResponseError, match="no permissions"):
            users.client.execute_command(*command)
    assert users.client.hget(shard.state, "acct:1") is None


async def test_a_client_user_cannot_record_a_new_namespace(users: Users, namespace: str) -> None:
    with pytest.raises(keyserial.ConfigError, match="start a worker first"):
        async with keyserial.connect(users.client_url, namespace=namespace):
            pass
