"""The worker and client ACL users docs/deployment.md gives, created on a test's server as
written (tests/security/test_acl.py checks they are enough, and little more)."""

from __future__ import annotations

import re
import shlex
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from tests.helpers import ROOT

DOCS = (ROOT / "docs" / "deployment.md").read_text()


def documented_rules(user: str) -> list[list[str]]:
    """Every ``ACL SETUSER <user> ...`` line of the docs, as arguments after ``ACL SETUSER``."""
    lines = re.findall(rf"^ACL SETUSER keyserial-{user} (.*)$", DOCS, re.M)
    assert lines, f"docs/deployment.md has no ACL SETUSER line for keyserial-{user}"
    return [shlex.split(line) for line in lines]  # (as redis-cli reads a quoted selector)


def rules_for(user: str, *, cluster: bool, fsync: bool) -> list[list[str]]:
    """The documented lines a deployment runs: the user's own, then those of a cluster and of
    ``durable_fsync`` where they apply."""
    own, *extras = documented_rules(user)
    chosen = [own]
    for extra in extras:
        if "+waitaof" in extra:
            chosen += [extra] if fsync else []
        else:
            assert any(rule.startswith("+cluster|") for rule in extra), f"what is {extra} for?"
            chosen += [extra] if cluster else []
    return chosen


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
            f"{entry['username']}: {entry['object']}"
            for entry in map(_entry, entries)
            if entry["username"] in self.names and entry["object"] != "client|setinfo"
        ]


def _entry(raw: list[bytes] | dict[bytes, bytes]) -> dict[str, str]:
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
    return {_text(key): _text(value) for key, value in pairs}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextmanager
def documented_users(redis_url: str, *, fsync: bool = False) -> Iterator[Users]:
    """The documented worker and client users, created on the server under fresh names."""
    admin = redis.Redis.from_url(redis_url)
    cluster = bool(admin.info("cluster").get("cluster_enabled"))
    suffix = uuid.uuid4().hex[:8]
    urls = {}
    for user in ("worker", "client"):
        name, password = f"ks-{user}-{suffix}", uuid.uuid4().hex
        own, *extras = rules_for(user, cluster=cluster, fsync=fsync)
        base = [rule.replace(f">{user.upper()}_PASSWORD", f">{password}") for rule in own]
        admin.execute_command("ACL", "SETUSER", name, *base)
        for extra in extras:
            admin.execute_command("ACL", "SETUSER", name, *extra)
        urls[user] = redis_url.replace("redis://", f"redis://{name}:{password}@", 1)
    client = redis.Redis.from_url(urls["client"])
    try:
        yield Users(
            urls["worker"],
            urls["client"],
            client,
            admin,
            (f"ks-worker-{suffix}", f"ks-client-{suffix}"),
        )
    finally:
        client.close()
        for user in ("worker", "client"):
            admin.execute_command("ACL", "DELUSER", f"ks-{user}-{suffix}")
        admin.close()
