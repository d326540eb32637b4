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
from typing import Any

import anyio
import pytest
import redis.asyncio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from redis import exceptions as redis_errors
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from keyserial import shard_for
from keyserial._scripts.submit import SubmitArgs
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
            # Subscribe before appending anything.
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

    def stream(self, shard: int) -> str:
        return f"ks:{{{self.namespace}:{shard}}}:stream"

    def results(self, shard: int) -> str:
        return f"ks:{{{self.namespace}:{shard}}}:results"

    def state(self, shard: int) -> str:
        return f"ks:{{{self.namespace}:{shard}}}:state"

    def dead(self, shard: int) -> str:
        return f"ks:{{{self.namespace}:{shard}}}:dead"

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

    async def xadd(
        self, shard: int, envelopes: Sequence[dict[str, Any]], *, version: str = "1"
    ) -> str:
        """Append with XADD, then PUBLISH the wake channel."""
        ops = json.dumps(list(envelopes), separators=(",", ":"))
        entry_id: str = await self.commands.xadd(self.stream(shard), {"v": version, "ops": ops})
        await self.node.publish(self.wake(shard), entry_id)
        return entry_id

    async def eval_submit(
        self, shard: int, envelopes: Sequence[dict[str, Any]], *, backlog: int = 100_000
    ) -> str:
        """Append with the document's submit script."""
        ops = json.dumps(list(envelopes), separators=(",", ":"))
        entry_id: str = await self.commands.eval(
            doc_submit_script(), 1, self.stream(shard), backlog, "1", ops, self.wake(shard)
        )
        return entry_id

    async def next_message(self, *, timeout: float = 10) -> str:
        """The next message on the reply channel, as published."""
        with anyio.fail_after(timeout):
            while (message := await self.pubsub.get_message(timeout=0.2)) is None:
                pass
        assert message["channel"] == self.reply_channel
        data: str = message["data"]
        return data

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


def _as_replied(outcome: dict[str, Any]) -> dict[str, Any]:
    """An outcome as a reply carries it: as stored, with the shard, layout generation and
    entries it answers."""
    assert isinstance(outcome.pop("s"), int), "s is the op's shard"
    assert outcome.pop("g") == 0, "g is its layout generation (0: never resharded)"
    entries = outcome.pop("e")  # (none for an op of an entry that could not be read)
    assert all(re.fullmatch(r"[0-9]+-[0-9]+", entry) for entry in entries)
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
        entry_id = await client.xadd(shard, [deposit])
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
            "r": [[deposit["id"], {"ok": 100, "s": shard, "g": 0, "e": [entry_id]}]],
        }


async def test_xadd_and_publish_then_reply_stored_result_state_and_dedup(
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
        entry_id = await client.xadd(shard, [deposit])
        assert re.fullmatch(r"\d+-\d+", entry_id)
        # The reply, byte for byte as documented; committed before it was published. The stored
        # outcome carries the op's binding too.
        expected = (
            '{"v":1,"r":[['
            + json.dumps(deposit["id"])
            + f',{{"ok":100,"s":{shard},"g":0,"e":["{entry_id}"]}}]]}}'
        )
        assert await client.next_message() == expected
        stored = await client.commands.hget(client.results(shard), deposit["id"])
        assert re.fullmatch(r'\{"ok":100,"b":"[0-9a-f]{16}"\}', stored)
        assert await client.commands.hget(client.state(shard), key) == "100"
        # A committed entry is trimmed: XLEN is the backlog of entries not committed yet.
        assert await client.commands.xlen(client.stream(shard)) == 0

        withdraw = client.envelope(key, "withdraw", 500)
        await client.xadd(shard, [withdraw])
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
        await client.xadd(shard, [deposit])
        assert (await client.replies([deposit["id"]]))[deposit["id"]] == {"ok": 100}
        balance = client.envelope(key, "balance")
        await client.xadd(shard, [balance])
        assert (await client.replies([balance["id"]]))[balance["id"]] == {"ok": 100}


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
        await client.xadd(shard, [deposit])
        assert (await client.replies([deposit["id"]]))[deposit["id"]] == {"ok": 100}
        await client.xadd(shard, [{**deposit, "args": [7]}])
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
        entry_id = await client.xadd(shard, [*ops, no_id])
        outcomes = await client.replies([op["id"] for op in ops])
        types = {op_id: outcome["error"]["type"] for op_id, outcome in outcomes.items()}
        assert types == {
            unknown["id"]: "keyserial.UnknownOperation",
            bad_args["id"]: "keyserial.MalformedOperation",
            misrouted["id"]: "keyserial.MalformedOperation",
            bad_type["id"]: "ValueError",
        }
        assert "routes to shard" in outcomes[misrouted["id"]]["error"]["message"]
        # The misrouted op's result is stored on the shard it was appended to.
        assert await client.stored(shard, misrouted["id"]) == outcomes[misrouted["id"]]

        # A failure is stored under its op id: resubmitting the id, fixed, returns the failure.
        await client.xadd(shard, [{**bad_args, "args": [1]}])
        assert (await client.replies([bad_args["id"]]))[bad_args["id"]] == outcomes[bad_args["id"]]

        # An envelope with no id and an entry of another version are dead-lettered; the
        # entry's readable envelopes still get a MalformedOperation reply.
        wrong_version = client.envelope(key, "deposit", 1)
        other_entry = await client.xadd(shard, [wrong_version], version="2")
        refused = (await client.replies([wrong_version["id"]]))[wrong_version["id"]]
        assert refused["error"]["type"] == "keyserial.MalformedOperation"
        assert "unsupported wire version '2'" in refused["error"]["message"]

        async def two_dead_letters() -> list[Any] | None:
            dead: list[Any] = await client.commands.xrange(client.dead(shard))
            return dead if len(dead) >= 2 else None

        letters = {fields["entry"]: fields for _, fields in await eventually(two_dead_letters)}
        assert "no string 'id'" in letters[entry_id]["reason"]
        assert "unsupported wire version" in letters[other_entry]["reason"]
        assert await client.stored(shard, wrong_version["id"]) == refused
        assert await client.commands.hget(client.state(shard), key) is None


async def test_the_submit_script_refuses_an_entry_when_the_backlog_is_full(
    redis_url: str, namespace: str
) -> None:
    # No worker serves this namespace, so appended entries stay in the stream.
    async with ForeignClient.connect(redis_url, namespace) as client:
        meta = f"ks:{{{namespace}}}:meta"
        await client.commands.hsetnx(meta, "shards", SHARDS)
        assert await client.read_shard_count() == SHARDS
        key = "account:3"
        shard = client.shard(key)
        await client.eval_submit(shard, [client.envelope(key, "deposit", 1)], backlog=0)
        with pytest.raises(redis_errors.ResponseError, match=r"^BACKLOG 1$"):
            await client.eval_submit(shard, [client.envelope(key, "deposit", 1)], backlog=1)
        assert await client.commands.xlen(client.stream(shard)) == 1


async def test_the_submit_script_called_with_too_few_arguments_appends_nothing(
    redis_url: str, namespace: str
) -> None:
    """An error reply means nothing was appended (a client retries it under a new op id):
    without its wake channel the script used to append, then fail to publish."""
    async with ForeignClient.connect(redis_url, namespace) as client:
        stream = f"ks:{{{namespace}:0}}:stream"
        ops = json.dumps([{"id": "short", "key": "k", "op": "deposit", "args": [1]}])
        for argv in (["0", "1", ops], []):
            with pytest.raises(redis_errors.ResponseError, match="nothing was appended"):
                await client.commands.eval(doc_submit_script(), 1, stream, *argv)
        assert await client.commands.xlen(stream) == 0


async def test_a_multi_key_op_across_shards_is_appended_to_its_lowest_shard(
    redis_url: str, namespace: str
) -> None:
    """As documented: the envelope with ``keys`` goes to the home (lowest) shard, which replies
    and stores the result; appended to another of its shards it is refused."""
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
        await client.xadd(home, [client.envelope(source, "deposit", 10)])
        move = {
            "id": "move-1",
            "keys": [source, target],
            "op": "transfer",
            "args": [4],
            "reply": client.reply_channel,
        }
        await client.xadd(other, [{**move, "id": "move-2"}])
        refused = (await client.replies(["move-2"]))["move-2"]
        assert refused["error"]["type"] == "keyserial.MalformedOperation"
        assert "a multi-key op goes to the lowest" in refused["error"]["message"]
        assert (
            f"{source!r} on {home}, {target!r} on {other}" in refused["error"]["message"]
        )  # (each key with its own shard)
        await client.xadd(home, [move])
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
        await client.xadd(shard, ops)
        exponent_entry = json.dumps([as_exponent]).replace('"EXP"', "1e1")
        await client.commands.xadd(client.stream(shard), {"v": "1", "ops": exponent_entry})
        await client.node.publish(client.wake(shard), "x")
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
        await client.xadd(listed_shard, [client.envelope(listed, "append", "x")])
        not_a_balance = client.envelope(listed, "balance")
        await client.xadd(listed_shard, [not_a_balance])
        outcome = (await client.replies([not_a_balance["id"]]))[not_a_balance["id"]]
        assert outcome == {
            "error": {
                "type": "TypeError",
                "message": "key 'account:2' holds ['x'], not a ledger balance",
            }
        }

        # transfer takes exactly two keys, source first.
        three = {
            "id": "three-keys",
            "keys": [key, "account:3", "account:4"],
            "op": "transfer",
            "args": [1],
            "reply": client.reply_channel,
        }
        home = min(client.shard(k) for k in three["keys"])
        await client.xadd(home, [three])
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
        await client.commands.xadd(client.stream(shard), {"v": "1", "ops": entry})
        await client.node.publish(client.wake(shard), "x")
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
        await client.xadd(shard, [deposit])
        assert (await client.replies([deposit["id"]]))[deposit["id"]] == {"ok": 5}
        copy = {**deposit, **{name: value for name, value in broken.items() if name != "v"}}
        await client.xadd(shard, [copy], version=broken.get("v", "1"))
        assert (await client.replies([deposit["id"]]))[deposit["id"]] == {"ok": 5}
        assert await client.stored(shard, deposit["id"]) == {"ok": 5}
        assert await client.commands.hget(client.state(shard), key) == "5"
