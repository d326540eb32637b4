"""``docs/wire-format.md`` is true: a foreign client that follows it, with plain redis-py commands
and no keyserial client, submits ops to a running worker and reads replies and stored results.

The routing vectors and the submit script are read from the document itself, and the names of
keys and channels below are the document's, so the document cannot drift from the code.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
import redis.asyncio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from redis import exceptions as redis_errors
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from keyserial import Settings, shard_for
from keyserial._backend.backend import Backend
from keyserial._reshard.mover import move_namespace
from keyserial._scripts.reshard import record_move, seal
from keyserial._scripts.submit import SubmitArgs
from keyserial._wire.layout import Layout
from keyserial._wire.resharding import Move
from keyserial.testing import running_worker
from tests.helpers import ROOT, eventually

DOC = (ROOT / "docs" / "wire-format.md").read_text(encoding="utf-8")
SHARDS = 4


def doc_submit_script() -> str:
    match = re.search(r"```lua\n(.*?)```", DOC, re.DOTALL)
    assert match, "docs/wire-format.md has no ```lua block"
    return match.group(1)


def doc_routing_vectors() -> list[tuple[str, str, int, int]]:
    """Rows ``| `key` | `hex` | crc32 | shard of 16 |`` of the routing table."""
    rows = re.findall(r"^\| `([^`]+)` \| `([0-9a-f]+)` \| (\d+) \| (\d+) \|$", DOC, re.MULTILINE)
    return [(key, hex_bytes, int(crc), int(shard)) for key, hex_bytes, crc, shard in rows]


def test_the_routing_vectors_are_crc32_of_the_utf8_key_modulo_16() -> None:
    vectors = doc_routing_vectors()
    assert len(vectors) >= 5
    for key, hex_bytes, crc, shard in vectors:
        assert key.encode().hex() == hex_bytes
        assert zlib.crc32(key.encode()) == crc
        assert crc % 16 == shard == shard_for(key, 16)


def test_the_documented_submit_script_is_the_one_the_python_client_runs() -> None:
    """As it runs it: a foreign client's EVALSHA of the file's text finds the script the Python
    client loaded (no helpers from lib.lua go before it: it uses none)."""
    shipped = (ROOT / "keyserial" / "_scripts" / "lua" / "submit.lua").read_text(encoding="utf-8")
    assert doc_submit_script().strip() == shipped.strip()
    assert SubmitArgs.SCRIPT.text == shipped
    assert SubmitArgs.SCRIPT.sha == hashlib.sha1(shipped.encode()).hexdigest()


class ForeignClient:
    """What a Go or Node service would do, in redis-py: only the commands the document names."""

    def __init__(self, url: str, namespace: str, commands: Any, *, signed: bool = False) -> None:
        self.namespace = namespace
        self.commands = commands  # a Redis or RedisCluster client (decode_responses=True)
        self.reply_channel = f"ks:{namespace}:reply:{uuid.uuid4().hex}"
        #: For signed replies: a key pair of its own, the public half ending its channel's name.
        self.private_key = X25519PrivateKey.generate()
        self.public_key = (
            base64.urlsafe_b64encode(self.private_key.public_key().public_bytes_raw())
            .decode()
            .rstrip("=")
        )
        if signed:
            self.reply_channel += f".{self.public_key}"
        # Channels are not keys: on a cluster, PUBLISH and SUBSCRIBE through any one node.
        self.node = redis.asyncio.Redis.from_url(url, decode_responses=True)
        self.pubsub: PubSub = self.node.pubsub(ignore_subscribe_messages=True)
        self.shard_count = 0
        self._counter = 0
        #: Items pushed to each shard: the tests' namespaces are their own, and this client the
        #: only one that pushes to them, so the next item's place is one more.
        self._pushes: dict[int, int] = {}

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, url: str, namespace: str, *, signed: bool = False
    ) -> AsyncIterator[ForeignClient]:
        probe = redis.asyncio.Redis.from_url(url)
        try:
            cluster = bool((await probe.info("cluster")).get("cluster_enabled"))
        finally:
            await probe.aclose()
        commands: Any = (
            RedisCluster.from_url(url, decode_responses=True)
            if cluster
            else redis.asyncio.Redis.from_url(url, decode_responses=True)
        )
        client = cls(url, namespace, commands, signed=signed)
        try:
            # Subscribe before pushing anything.
            await client.pubsub.subscribe(client.reply_channel)
            yield client
        finally:
            await client.pubsub.aclose()  # type: ignore[no-untyped-call]
            await client.node.aclose()
            await commands.aclose()

    async def read_shard_count(self) -> int:
        self.shard_count = int(await self.commands.hget(f"ks:{{{self.namespace}}}:meta", "shards"))
        return self.shard_count

    def shard(self, key: str) -> int:
        return zlib.crc32(key.encode("utf-8")) % self.shard_count

    def name(self, shard: int, suffix: str) -> str:
        return f"ks:{{{self.namespace}:{shard}}}:{suffix}"

    def inbox(self, shard: int) -> str:
        return self.name(shard, "inbox")

    def taken(self, shard: int) -> str:
        return self.name(shard, "inbox:taken")

    def stream(self, shard: int) -> str:
        return self.name(shard, "stream")

    def results(self, shard: int) -> str:
        return self.name(shard, "results")

    def state(self, shard: int) -> str:
        return self.name(shard, "state")

    def dead(self, shard: int) -> str:
        return self.name(shard, "dead")

    def wake(self, shard: int) -> str:
        return f"ks:{self.namespace}:wake:{shard}"

    def envelope(
        self, key: str, op: str, *args: Any, op_id: str | None = None, reply: bool = True
    ) -> dict[str, Any]:
        if op_id is None:
            op_id = f"{self.reply_channel.rsplit(':', 1)[1]}-{self._counter}"
            self._counter += 1
        envelope: dict[str, Any] = {"id": op_id, "key": key, "op": op}
        if args:
            envelope["args"] = list(args)
        if reply:
            envelope["reply"] = self.reply_channel
        return envelope

    def _next_place(self, shard: int) -> int:
        self._pushes[shard] = self._pushes.get(shard, 0) + 1
        return self._pushes[shard]

    async def push(
        self, shard: int, envelopes: Sequence[dict[str, Any]], *, version: str = "1"
    ) -> str:
        """Push the item of an entry with RPUSH, then PUBLISH its place on the wake channel."""
        return await self.push_item(shard, f"{version}\n{_packed(envelopes)}")

    async def push_item(self, shard: int, item: str) -> str:
        """Push ``item`` as it is with RPUSH, and PUBLISH its place; the place. The taken count
        read before and after it, if the same, gives the place as documented."""
        before = await self.commands.get(self.taken(shard))
        length = await self.commands.rpush(self.inbox(shard), item)
        after = await self.commands.get(self.taken(shard))
        place = self._next_place(shard)
        if before == after:
            assert int(before or 0) + length == place
        await self.node.publish(self.wake(shard), str(place))
        return str(place)

    async def eval_submit(
        self,
        shard: int,
        envelopes: Sequence[dict[str, Any]],
        *,
        backlog: int = 100_000,
        fresh: bool = False,
        due: str = "",
    ) -> str:
        """Push with the document's submit script (``due``: its sixth argument, a delayed
        entry's due time); the place it returns."""
        more = ["1" if fresh else "0", due] if due else ["1"] if fresh else []
        place, at_ms, ahead, *due_ms = await self.commands.eval(
            doc_submit_script(),
            1,
            self.inbox(shard),
            backlog,
            "1",
            _packed(envelopes),
            self.wake(shard),
            *more,
        )
        assert place == self._next_place(shard)
        assert abs(at_ms - time.time() * 1000) < 60_000 and ahead >= 0
        assert len(due_ms) == (1 if due else 0) and all(ms >= at_ms for ms in due_ms)
        return str(place)

    async def next_message(self, *, timeout: float = 10) -> str:
        """The next message on the reply channel, as published."""
        with anyio.fail_after(timeout):
            while (message := await self.pubsub.get_message(timeout=0.2)) is None:
                pass
        assert message["channel"] == self.reply_channel
        data: str = message["data"]
        return data

    async def push_one(self, shard: int, envelope: dict[str, Any]) -> Any:
        """Push an entry of one op, and wait for its outcome's reply message."""
        await self.push(shard, [envelope])
        return (await self.replies([envelope["id"]]))[envelope["id"]]

    async def replies(self, op_ids: Sequence[str], *, timeout: float = 10) -> dict[str, Any]:
        """Outcomes by op id from reply messages, until every id in ``op_ids`` has one."""
        found: dict[str, Any]
        wanted, found = set(op_ids), {}
        deadline = time.monotonic() + timeout
        while not wanted <= found.keys():
            assert time.monotonic() < deadline, f"no reply for {wanted - found.keys()}"
            reply = json.loads(await self.next_message(timeout=deadline - time.monotonic()))
            assert reply["v"] == 1
            assert "k" not in reply, "a channel that names no client key gets no signature"
            for op_id, outcome in reply["r"]:
                found[op_id] = _as_replied(outcome)
        return found

    async def stored(self, shard: int, op_id: str) -> Any:
        raw = await self.commands.hget(self.results(shard), op_id)
        return None if raw is None else _as_read(json.loads(raw))


def _packed(envelopes: Sequence[dict[str, Any]]) -> str:
    """An entry's ops: its envelopes as a compact JSON array."""
    return json.dumps(list(envelopes), separators=(",", ":"))


def _as_replied(outcome: dict[str, Any]) -> dict[str, Any]:
    """An outcome as a reply carries it: as stored, with the shard, layout generation and the
    places of the entries it answers."""
    assert isinstance(outcome.pop("s"), int), "s is the op's shard"
    assert outcome.pop("g") == 0, "g is its layout generation (0: never resharded)"
    entries = outcome.pop("e")  # (none for an op of an entry that could not be read)
    assert all(re.fullmatch(r"[1-9][0-9]*", entry) for entry in entries), "places"
    return _as_read(outcome)


def _as_read(outcome: dict[str, Any]) -> dict[str, Any]:
    """An outcome as a client reads it: ``ok`` or ``error`` (type, message, data), the binding
    ``b`` and an error's ``traceback`` left aside, once checked as documented."""
    assert re.fullmatch(r"[0-9a-f]{16}", outcome.pop("b", "0" * 16)), "b is the op's binding"
    error = outcome.get("error")
    if isinstance(error, dict) and "traceback" in error:
        where = error.pop("traceback")
        assert where.startswith("Traceback (most recent call last)") and len(where) <= 8192
        assert error["message"] in where, "it ends where the op raised"
    return outcome


async def test_a_signed_reply_checks_out_as_documented(redis_url: str, namespace: str) -> None:
    """A client whose channel names its key gets replies it can check with the signer's key
    from the signers hash, the tag made as docs/wire-format.md says."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace, signed=True) as client,
    ):
        await client.read_shard_count()
        key = "account:5"
        shard = client.shard(key)
        deposit = client.envelope(key, "deposit", 100)
        place = await client.eval_submit(shard, [deposit])
        message = await client.next_message()
        signed = message[: message.rindex(',"k":')]
        suffix = json.loads("{" + message[len(signed) + 1 :])
        assert re.fullmatch(r"[0-9a-f]{16}", suffix["k"])
        record = json.loads(await client.commands.hget(f"ks:{namespace}:signers", suffix["k"]))
        signer_key = record["key"]
        shared = client.private_key.exchange(
            X25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(signer_key + "="))
        )
        mac_key = hashlib.sha256(
            b"\n".join(
                (
                    b"keyserial reply signature v1",
                    shared,
                    client.public_key.encode(),
                    signer_key.encode(),
                    suffix["k"].encode(),
                )
            )
        ).digest()
        tag = hmac.digest(mac_key, f"{client.reply_channel}\n{signed}".encode(), "sha256")
        assert tag[:16].hex() == suffix["t"]
        assert json.loads(signed + "}") == {
            "v": 1,
            "r": [[deposit["id"], {"ok": 100, "s": shard, "g": 0, "e": [place]}]],
        }


async def test_rpush_and_publish_then_reply_stored_result_state_and_dedup(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        assert await client.read_shard_count() == SHARDS
        key = "account:5"
        shard = client.shard(key)
        assert shard == shard_for(key, SHARDS)

        deposit = client.envelope(key, "deposit", 100)
        place = await client.push(shard, [deposit])
        assert place == "1", "the shard's first push"
        # The reply, byte for byte as documented; committed before it was published. The stored
        # outcome carries the op's binding too.
        expected = (
            '{"v":1,"r":[['
            + json.dumps(deposit["id"])
            + f',{{"ok":100,"s":{shard},"g":0,"e":["{place}"]}}]]}}'
        )
        assert await client.next_message() == expected
        stored = await client.commands.hget(client.results(shard), deposit["id"])
        assert re.fullmatch(r'\{"ok":100,"b":"[0-9a-f]{16}"\}', stored)
        assert await client.commands.hget(client.state(shard), key) == "100"
        # The owner moved the item out of the inbox, and trims a committed entry from the
        # stream: XLEN plus LLEN is the backlog of entries not committed yet.
        assert await client.commands.get(client.taken(shard)) == "1"
        assert await client.commands.llen(client.inbox(shard)) == 0
        await eventually(lambda: _backlog_is_empty(client, shard), message="an empty backlog")

        withdraw = client.envelope(key, "withdraw", 500)
        await client.push(shard, [withdraw])
        outcome = (await client.replies([withdraw["id"]]))[withdraw["id"]]
        assert outcome == {
            "error": {
                "type": "keyserial.InsufficientFunds",
                "message": "balance 100 is less than 500",
                "data": {"balance": 100, "amount": 500},
            }
        }
        assert await client.stored(shard, withdraw["id"]) == outcome
        assert await client.commands.hget(client.state(shard), key) == "100"

        # A resubmitted op id returns the stored outcome and does not run again.
        assert await client.push_one(shard, deposit) == {"ok": 100}
        balance = client.envelope(key, "balance")
        assert await client.push_one(shard, balance) == {"ok": 100}


async def test_the_submit_script_appends_an_entry_of_several_ops_run_in_array_order(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "wallet:7"
        shard = client.shard(key)
        ops = [
            client.envelope(key, "deposit", 10),
            client.envelope(key, "withdraw", 4),
            client.envelope(key, "withdraw", 6),
            client.envelope(key, "balance"),
        ]
        await client.eval_submit(shard, ops)
        outcomes = await client.replies([op["id"] for op in ops])
        assert [outcomes[op["id"]] for op in ops] == [{"ok": 10}, {"ok": 6}, {"ok": 0}, {"ok": 0}]
        for op in ops:
            assert await client.stored(shard, op["id"]) == outcomes[op["id"]]

        # Without a reply channel nothing is published, but the outcome is stored.
        silent = client.envelope(key, "deposit", 5, reply=False)
        await client.eval_submit(shard, [silent])
        assert await eventually(lambda: client.stored(shard, silent["id"])) == {"ok": 5}
        assert await client.pubsub.get_message(timeout=0.1) is None


async def test_a_delayed_entry_waits_in_the_timers_and_runs_once_due(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "wallet:8"
        shard = client.shard(key)
        later, now = client.envelope(key, "deposit", 7), client.envelope(key, "deposit", 1)
        pushed_at = time.time()
        place = await client.eval_submit(shard, [later], due="+400")
        timers = f"ks:{{{namespace}:{shard}}}:timers"
        assert await eventually(lambda: client.commands.zscore(timers, f"{int(place):016d}"))
        await client.eval_submit(shard, [now])
        outcomes = await client.replies([now["id"], later["id"]])
        assert outcomes == {now["id"]: {"ok": 1}, later["id"]: {"ok": 8}}
        assert time.time() >= pushed_at + 0.4
        assert await client.commands.zcard(timers) == 0


async def test_another_op_under_a_used_op_id_is_refused_by_the_worker(
    redis_url: str, namespace: str
) -> None:
    """The worker itself refuses another op appended under an op id that has an outcome: it
    replies MalformedOperation, never the first op's outcome, and runs nothing (a client of
    another language gets no binding check of its own)."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "account:6"
        shard = client.shard(key)
        deposit = client.envelope(key, "deposit", 100)
        assert await client.push_one(shard, deposit) == {"ok": 100}
        await client.push(shard, [{**deposit, "args": [7]}])
        refused = (await client.replies([deposit["id"]]))[deposit["id"]]
        assert refused["error"]["type"] == "keyserial.MalformedOperation"
        assert "belongs to another op" in refused["error"]["message"]
        assert await client.commands.hget(client.state(shard), key) == "100"


async def test_refused_ops_carry_the_documented_error_types(redis_url: str, namespace: str) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "account:1"
        shard = client.shard(key)
        misrouted_key = next(
            f"account:{n}" for n in range(100) if client.shard(f"account:{n}") != shard
        )
        unknown = client.envelope(key, "teleport", 1)
        bad_args = {**client.envelope(key, "deposit"), "args": "not an array"}
        misrouted = client.envelope(misrouted_key, "deposit", 1)
        bad_type = client.envelope(key, "deposit", -5)
        no_id = {"key": key, "op": "deposit", "args": [1]}
        ops = [unknown, bad_args, misrouted, bad_type]
        place = await client.push(shard, [*ops, no_id])
        outcomes = await client.replies([op["id"] for op in ops])
        types = {op_id: outcome["error"]["type"] for op_id, outcome in outcomes.items()}
        assert types == {
            unknown["id"]: "keyserial.UnknownOperation",
            bad_args["id"]: "keyserial.MalformedOperation",
            misrouted["id"]: "keyserial.MalformedOperation",
            bad_type["id"]: "ValueError",
        }
        assert "routes to shard" in outcomes[misrouted["id"]]["error"]["message"]
        # The misrouted op's result is stored on the shard it was pushed to.
        assert await client.stored(shard, misrouted["id"]) == outcomes[misrouted["id"]]
        # The unknown op's refusal is not stored: its answered record names the entry's place.
        assert await client.stored(shard, unknown["id"]) is None
        answered = await client.commands.hget(client.results(shard), f"{unknown['id']}#u")
        assert json.loads(answered)["e"] == [place]

        # A failure is stored under its op id: resubmitting the id, fixed, returns the failure.
        await client.push(shard, [{**bad_args, "args": [1]}])
        assert (await client.replies([bad_args["id"]]))[bad_args["id"]] == outcomes[bad_args["id"]]

        # An envelope with no id and an entry of another version are dead-lettered; the
        # entry's readable envelopes still get a MalformedOperation reply.
        wrong_version = client.envelope(key, "deposit", 1)
        other_place = await client.push(shard, [wrong_version], version="2")
        refused = (await client.replies([wrong_version["id"]]))[wrong_version["id"]]
        assert refused["error"]["type"] == "keyserial.MalformedOperation"
        assert "unsupported wire version '2'" in refused["error"]["message"]

        async def two_dead_letters() -> list[Any] | None:
            dead: list[Any] = await client.commands.xrange(client.dead(shard))
            return dead if len(dead) >= 2 else None

        no_id_letter, other_letter = (fields for _, fields in await eventually(two_dead_letters))
        assert "no string 'id'" in no_id_letter["reason"]
        assert re.fullmatch(r"\d+-\d+", no_id_letter["entry"]), "the stream entry's id"
        assert json.loads(no_id_letter["raw"]) == no_id
        assert "unsupported wire version '2'" in other_letter["reason"]
        assert json.loads(other_letter["raw"]) == {
            "v": "2",
            "ops": _packed([wrong_version]),
            "p": other_place,
        }
        assert await client.stored(shard, wrong_version["id"]) == refused
        assert await client.commands.hget(client.state(shard), key) is None


async def test_the_submit_script_refuses_an_entry_when_the_backlog_is_full(
    redis_url: str, namespace: str
) -> None:
    """The backlog counts the inbox's items and the stream's entries together."""
    # No worker serves this namespace, so pushed items stay in the inbox.
    async with ForeignClient.connect(redis_url, namespace) as client:
        meta = f"ks:{{{namespace}}}:meta"
        await client.commands.hsetnx(meta, "shards", SHARDS)
        assert await client.read_shard_count() == SHARDS
        key = "account:3"
        shard = client.shard(key)
        await client.eval_submit(shard, [client.envelope(key, "deposit", 1)], backlog=0)
        with pytest.raises(redis_errors.ResponseError, match=r"^BACKLOG 1$"):
            await client.eval_submit(shard, [client.envelope(key, "deposit", 1)], backlog=1)
        assert await client.commands.llen(client.inbox(shard)) == 1
        assert await client.commands.xlen(client.stream(shard)) == 0
        # An entry in the stream (one a client of an earlier release appended) counts too.
        ops = _packed([client.envelope(key, "deposit", 1)])
        await client.commands.xadd(client.stream(shard), {"v": "1", "ops": ops})
        with pytest.raises(redis_errors.ResponseError, match=r"^BACKLOG 2$"):
            await client.eval_submit(shard, [client.envelope(key, "deposit", 1)], backlog=2)
        assert await client.commands.llen(client.inbox(shard)) == 1


async def test_the_submit_script_called_with_too_few_arguments_appends_nothing(
    redis_url: str, namespace: str
) -> None:
    """An error reply means nothing was pushed (a client retries it under a new op id):
    without its wake channel the script used to append, then fail to publish. Called with the
    stream, as the submit script of an earlier release was, it refuses too."""
    async with ForeignClient.connect(redis_url, namespace) as client:
        inbox, stream = client.inbox(0), client.stream(0)
        ops = json.dumps([{"id": "short", "key": "k", "op": "deposit", "args": [1]}])
        calls: list[tuple[list[str], list[str]]] = [
            ([inbox], ["0", "1", ops]),
            ([inbox], []),
            ([stream], ["0", "1", ops, client.wake(0)]),
        ]
        for keys, argv in calls:
            with pytest.raises(redis_errors.ResponseError, match="nothing was pushed"):
                await client.commands.eval(doc_submit_script(), len(keys), *keys, *argv)
        assert await client.commands.llen(inbox) == 0
        assert await client.commands.xlen(stream) == 0


async def test_a_multi_key_op_across_shards_is_appended_to_its_lowest_shard(
    redis_url: str, namespace: str
) -> None:
    """As documented: the envelope with ``keys`` goes to the home (lowest) shard, which replies
    and stores the result; pushed to another of its shards it is refused."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        source = "account:1"
        target = next(
            f"account:{n}"
            for n in range(2, 100)
            if client.shard(f"account:{n}") > client.shard(source)
        )
        home, other = client.shard(source), client.shard(target)
        await client.push(home, [client.envelope(source, "deposit", 10)])
        move = {
            "id": "move-1",
            "keys": [source, target],
            "op": "transfer",
            "args": [4],
            "reply": client.reply_channel,
        }
        await client.push(other, [{**move, "id": "move-2"}])
        refused = (await client.replies(["move-2"]))["move-2"]
        assert refused["error"]["type"] == "keyserial.MalformedOperation"
        assert "a multi-key op goes to the lowest" in refused["error"]["message"]
        assert (
            f"{source!r} on {home}, {target!r} on {other}" in refused["error"]["message"]
        )  # (each key with its own shard)
        await client.push(home, [move])
        assert (await client.replies(["move-1"]))["move-1"] == {"ok": {source: 6, target: 4}}
        assert await client.stored(home, "move-1") == {"ok": {source: 6, target: 4}}


async def test_an_entry_of_1500_ops_on_1500_keys_commits_and_dedups_in_one_piece(
    redis_url: str, namespace: str
) -> None:
    """The step script reads and writes many keys and results per command, in chunks (Lua's
    unpack has a stack limit): an entry larger than a chunk loses nothing, and resubmitting it
    replays every stored outcome without running anything again."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        keys = [key for key in (f"many:{n}" for n in range(8_000)) if client.shard(key) == 1]
        keys = keys[:1_500]
        assert len(keys) == 1_500
        deposits = [client.envelope(key, "deposit", n + 1) for n, key in enumerate(keys)]
        await client.eval_submit(1, deposits)
        outcomes = await client.replies([op["id"] for op in deposits])
        assert [outcomes[op["id"]] for op in deposits] == [{"ok": n + 1} for n in range(1_500)]
        states = await client.commands.hmget(client.state(1), keys)
        assert states == [str(n + 1) for n in range(1_500)]

        await client.eval_submit(1, deposits)  # every id again: replayed, not run
        again = await client.replies([op["id"] for op in deposits])
        assert again == outcomes
        balances = [client.envelope(key, "balance") for key in keys]
        await client.eval_submit(1, balances)
        read = await client.replies([op["id"] for op in balances])
        assert [read[op["id"]] for op in balances] == [{"ok": n + 1} for n in range(1_500)]


async def test_the_ledger_ops_take_plain_json_integers_and_refuse_as_documented(
    redis_url: str, namespace: str
) -> None:
    """The built-in ops' arguments, results and errors, as the document lists them."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key, listed = "account:1", "account:2"
        shard = client.shard(key)
        plain = client.envelope(key, "deposit", 10)
        # What some JSON encoders write for the number ten: a float to a Python worker.
        as_float, as_exponent, as_string = (client.envelope(key, "deposit", 0) for _ in range(3))
        as_float["args"], as_string["args"], as_exponent["args"] = [10.0], ["10"], ["EXP"]
        ops = [plain, as_float, as_string, client.envelope(key, "balance")]
        await client.push(shard, ops)
        exponent_entry = json.dumps([as_exponent]).replace('"EXP"', "1e1")
        await client.push_item(shard, f"1\n{exponent_entry}")
        outcomes = await client.replies([*(op["id"] for op in ops), as_exponent["id"]])
        assert outcomes[plain["id"]] == {"ok": 10}
        for refused, shown in ((as_float, "10.0"), (as_exponent, "10.0"), (as_string, "'10'")):
            assert outcomes[refused["id"]] == {
                "error": {
                    "type": "ValueError",
                    "message": f"amount must be a positive integer, not {shown}",
                }
            }
        assert outcomes[ops[3]["id"]] == {"ok": 10}

        # A key whose state is not an integer is not a ledger balance.
        listed_shard = client.shard(listed)
        await client.push(listed_shard, [client.envelope(listed, "append", "x")])
        not_a_balance = client.envelope(listed, "balance")
        await client.push(listed_shard, [not_a_balance])
        outcome = (await client.replies([not_a_balance["id"]]))[not_a_balance["id"]]
        assert outcome == {
            "error": {
                "type": "TypeError",
                "message": "key 'account:2' holds ['x'], not a ledger balance",
            }
        }

        # transfer takes exactly two keys, source first.
        three: dict[str, Any] = {
            "id": "three-keys",
            "keys": [key, "account:3", "account:4"],
            "op": "transfer",
            "args": [1],
            "reply": client.reply_channel,
        }
        home = min(client.shard(k) for k in three["keys"])
        await client.push(home, [three])
        outcome = (await client.replies(["three-keys"]))["three-keys"]
        assert outcome["error"]["type"] == "ValueError"
        assert outcome["error"]["message"].startswith("transfer takes two keys (source, target)")


async def test_non_finite_numbers_are_read_but_never_written(
    redis_url: str, namespace: str
) -> None:
    """``NaN`` and ``Infinity`` in arguments reach the op (as Python's json reads them), but an
    op that would store or return one fails with TypeError and its key keeps its state."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS, apps=["tests.apps"]),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "list:1"
        shard = client.shard(key)
        stored, refused = client.envelope(key, "append", "x"), client.envelope(key, "append", 0)
        entry = json.dumps([stored, refused]).replace('"args": [0]', '"args": [NaN]')
        await client.push_item(shard, f"1\n{entry}")
        outcomes = await client.replies([stored["id"], refused["id"]])
        assert outcomes[stored["id"]] == {"ok": ["x"]}
        error = outcomes[refused["id"]]["error"]
        assert error["type"] == "TypeError" and "returned or stored non-JSON" in error["message"]
        assert await client.commands.hget(client.state(shard), key) == '["x"]'


@pytest.mark.parametrize(
    "broken", [{"args": "x"}, {"op": ""}, {"v": "2"}], ids=["bad args", "no op", "bad version"]
)
async def test_a_malformed_copy_of_an_op_that_ran_is_answered_with_its_outcome(
    redis_url: str, namespace: str, broken: dict[str, str]
) -> None:
    """One outcome per op id: a foreign client's retry that went wrong (a bad envelope, or an
    entry of another wire version) neither stores a refusal over the op's stored result nor
    replies one."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "account:7"
        shard = client.shard(key)
        deposit = client.envelope(key, "deposit", 5)
        assert await client.push_one(shard, deposit) == {"ok": 5}
        copy = {**deposit, **{name: value for name, value in broken.items() if name != "v"}}
        await client.push(shard, [copy], version=broken.get("v", "1"))
        assert (await client.replies([deposit["id"]]))[deposit["id"]] == {"ok": 5}
        assert await client.stored(shard, deposit["id"]) == {"ok": 5}
        assert await client.commands.hget(client.state(shard), key) == "5"


async def _backlog_is_empty(client: ForeignClient, shard: int) -> bool:
    """Whether the shard's inbox and stream are both empty (LLEN plus XLEN is its backlog)."""
    inbox: int = await client.commands.llen(client.inbox(shard))
    stream: int = await client.commands.xlen(client.stream(shard))
    return inbox + stream == 0


async def test_an_item_not_of_the_documented_form_is_dead_lettered_and_answered_by_no_one(
    redis_url: str, namespace: str
) -> None:
    """An item with no newline, or whose first line is neither a version nor a version and
    `` fresh``, becomes an entry ``{raw, p}``: dead-lettered as an entry of no version, no op
    of it run, replied or stored (none can be read); the shard moves on."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "account:8"
        shard = client.shard(key)
        lost = [client.envelope(key, "deposit", 1) for _ in range(3)]
        items = [
            _packed([lost[0]]),  # (no version line)
            f"1 stale\n{_packed([lost[1]])}",
            f"\n{_packed([lost[2]])}",
        ]
        places = [await client.push_item(shard, item) for item in items]
        after = client.envelope(key, "deposit", 2)
        await client.push(shard, [after])
        # The only reply is the op pushed after them.
        assert await client.replies([after["id"]]) == {after["id"]: {"ok": 2}}

        async def three_dead_letters() -> list[Any] | None:
            dead: list[Any] = await client.commands.xrange(client.dead(shard))
            return dead if len(dead) >= 3 else None

        letters = [fields for _, fields in await eventually(three_dead_letters)]
        for letter, item, place in zip(letters, items, places, strict=True):
            assert letter["reason"].startswith("unsupported wire version none")
            assert json.loads(letter["raw"]) == {"raw": item, "p": place}
            assert re.fullmatch(r"\d+-\d+", letter["entry"]), "the stream entry's id"
        for op in lost:
            assert await client.stored(shard, op["id"]) is None
        assert await client.commands.hget(client.state(shard), key) == "2"
        assert await client.pubsub.get_message(timeout=0.1) is None


async def test_an_entry_an_earlier_client_appended_to_the_stream_runs_named_by_its_id(
    redis_url: str, namespace: str
) -> None:
    """A worker of this version still runs an entry appended to the stream itself, as clients
    of an earlier release did (with the ACL they had): its reply names it by its entry id."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "account:9"
        shard = client.shard(key)
        deposit = client.envelope(key, "deposit", 3)
        fields = {"v": "1", "ops": _packed([deposit])}
        entry_id = await client.commands.xadd(client.stream(shard), fields)
        await client.node.publish(client.wake(shard), entry_id)
        assert await client.next_message() == (
            '{"v":1,"r":[['
            + json.dumps(deposit["id"])
            + f',{{"ok":3,"s":{shard},"g":0,"e":["{entry_id}"]}}]]}}'
        )


async def test_the_submit_script_wakes_the_owner_with_the_place_or_a_push(
    redis_url: str, namespace: str
) -> None:
    """The submit script pushes the documented items, and publishes the bare place, or, for a
    fresh entry, ``push <place> <item>``."""
    async with ForeignClient.connect(redis_url, namespace) as client:
        await client.commands.hsetnx(f"ks:{{{namespace}}}:meta", "shards", SHARDS)
        await client.read_shard_count()
        wake = client.node.pubsub(ignore_subscribe_messages=True)
        await wake.subscribe(client.wake(2))
        try:
            plain, fresh = [client.envelope("k", "deposit", 1)], [client.envelope("k", "balance")]
            first = await client.eval_submit(2, plain)
            second = await client.eval_submit(2, fresh, fresh=True)
            heard = [await _next_message(wake), await _next_message(wake)]
        finally:
            await wake.aclose()  # type: ignore[no-untyped-call]
        items = [f"1\n{_packed(plain)}", f"1 fresh\n{_packed(fresh)}"]
        assert (first, second) == ("1", "2")
        assert heard == [(client.wake(2), "1"), (client.wake(2), f"push 2 {items[1]}")]
        assert await client.commands.lrange(client.inbox(2), 0, -1) == items


async def test_the_complete_exchange_runs_as_documented(redis_url: str, namespace: str) -> None:
    """The commands of "A complete exchange", run as written (in this test's namespace), get
    the answers and messages it shows."""
    steps = doc_exchange(namespace)
    assert [args[0] for args, _ in steps].count("RPUSH") == 2
    async with (
        running_worker(redis_url, namespace, shard_count=16),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        subscriber = client.node.pubsub(ignore_subscribe_messages=True)
        try:
            for args, shown in steps:
                if args[0] == "SUBSCRIBE":
                    await subscriber.subscribe(*args[1:])
                elif args[0] == "message":
                    assert await _next_message(subscriber) == (args[1], args[2])
                elif args[0] == "PUBLISH":
                    await client.node.publish(args[1], args[2])
                else:
                    answer = await client.commands.execute_command(*args)
                    assert shown is not None, args
                    assert _shows(shown, answer), (args, shown, answer)
        finally:
            await subscriber.aclose()  # type: ignore[no-untyped-call]


async def test_a_plain_rpush_to_a_sealed_shard_is_forwarded_to_the_new_layout(
    redis_url: str, namespace: str
) -> None:
    """The submit script refuses a push to a shard a reshard sealed; a plain RPUSH is not
    refused: the sealed shard's owner forwards its op to the new layout until the flip, and the
    owner of the shard's heir after it. Each outcome is stored there."""
    async with (
        running_worker(redis_url, namespace, shard_count=SHARDS),
        ForeignClient.connect(redis_url, namespace) as client,
    ):
        await client.read_shard_count()
        key = "account:5"
        old = client.shard(key)
        first = client.envelope(key, "deposit", 1)
        assert await client.push_one(old, first) == {"ok": 1}
        backend = await Backend.connect(redis_url)
        try:
            move = Move(Layout(namespace, SHARDS), Layout(namespace, 8, 1))
            await backend.run_call(record_move(move))
            await backend.run_call(seal(Layout(namespace, SHARDS).keys(old), move))
            with pytest.raises(redis_errors.ResponseError, match=r"^RESHARDED"):
                await client.eval_submit(old, [client.envelope(key, "deposit", 100)])
            past_seal = client.envelope(key, "deposit", 2)
            await client.push(old, [past_seal])
            await move_namespace(backend, Settings(namespace=namespace), 8)
            retired = client.envelope(key, "deposit", 4)
            await client.push(old, [retired])
        finally:
            await backend.aclose()
        meta = f"ks:{{{namespace}}}:meta"
        assert await client.commands.hmget(meta, "shards", "generation") == ["8", "1"]
        results = f"ks:{{{namespace}:{zlib.crc32(key.encode()) % 8}@1}}:results"
        for op, balance in ((past_seal, 3), (retired, 7)):
            raw = await eventually(partial(client.commands.hget, results, op["id"]), timeout=30)
            assert _as_read(json.loads(raw)) == {"ok": balance}


def doc_exchange(namespace: str) -> list[tuple[list[str], str | None]]:
    """The lines of "A complete exchange", in ``namespace`` for ``default``: each command's
    arguments, as redis-cli splits them, with the answer shown (None: none), and each message
    as ``["message", channel, payload]``."""
    section = DOC[DOC.index("\n## A complete exchange\n") :]
    match = re.search(r"```\n(.*?)```", section, re.DOTALL)
    assert match, "A complete exchange has no ``` block"
    text = match.group(1).replace("ks:{default", f"ks:{{{namespace}")
    text = text.replace("ks:default:", f"ks:{namespace}:")
    steps: list[tuple[list[str], str | None]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith(" "):  # the answer to the command above
            assert steps and line.strip().startswith("->"), line
            steps[-1] = (steps[-1][0], line.strip().removeprefix("->").strip())
        elif line.startswith("message "):
            _, channel, payload = line.split(" ", 2)
            steps.append((["message", channel, payload], None))
        else:
            command, _, shown = line.partition(" ->")
            command = re.sub(r"\s+\(on a separate connection\)$", "", command)
            steps.append((_cli_args(command), shown.strip() or None))
    return steps


_CLI_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"|\'((?:[^\'\\]|\\.)*)\'|(\S+)')
_CLI_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "a": "\a"}


def _cli_args(line: str) -> list[str]:
    """``line`` split as redis-cli splits what is typed: in double quotes ``\\n``, ``\\"``,
    ``\\xHH``… are escapes; in single quotes only ``\\'``."""
    args = []
    for double, single, bare in _CLI_ARG.findall(line):
        if double:
            args.append(
                re.sub(
                    r"\\(x[0-9a-fA-F]{2}|.)",
                    lambda escape: (
                        chr(int(escape[1][1:], 16))
                        if len(escape[1]) == 3
                        else _CLI_ESCAPES.get(escape[1], escape[1])
                    ),
                    double,
                )
            )
        else:
            args.append(single.replace("\\'", "'") if single else bare)
    return args


def _shows(shown: str, answer: Any) -> bool:
    """Whether ``answer`` is what redis-cli would show as ``shown`` (``…``: any text)."""
    if shown == "nil":
        return answer is None
    if integer := re.fullmatch(r"\(integer\) (-?\d+)", shown):
        return isinstance(answer, int) and answer == int(integer[1])
    (text,) = _cli_args(shown)
    pattern = ".*".join(re.escape(part) for part in text.split("…"))
    return isinstance(answer, str) and re.fullmatch(pattern, answer) is not None


async def _next_message(pubsub: PubSub, *, timeout: float = 10) -> tuple[str, str]:
    """The next message on ``pubsub``: its channel and its data."""
    with anyio.fail_after(timeout):
        while (message := await pubsub.get_message(timeout=0.2)) is None:
            pass
    return message["channel"], message["data"]
