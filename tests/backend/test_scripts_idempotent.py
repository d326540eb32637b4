"""Every script keyserial may send twice (its reply lost to a reset or a timeout, so the caller
cannot tell "not executed" from "executed") gives the same answer the second time and writes
nothing more. Each test sends the call as the runtime builds it, twice."""

from __future__ import annotations

import json
from collections.abc import Sequence

import anyio
import pytest
import redis.asyncio

import keyserial
from keyserial._backend.backend import Backend
from keyserial._scripts.calls import ScriptCall
from keyserial._scripts.commit import StepCommit, StepReply, step
from keyserial._scripts.lease import AcquireArgs, LeaseGrant, LeaseHeld, acquire
from keyserial._scripts.refusals import Fenced, OwnedElsewhere, Replayed
from keyserial._wire.codec import Envelope, decode_reply
from keyserial._wire.layout import part_id
from keyserial._wire.messages import GrantRequest
from keyserial._worker.execution import Run
from keyserial._worker.intake import accept
from keyserial.testing import ShardKeys, running_worker
from tests.entries import envelope, push_item, step_args
from tests.helpers import keys_on_shard, stored_outcome

pytestmark = pytest.mark.parametrize("redis_url", ["standalone"], indirect=True)

#: Participants' parts of cross-shard ops, as they are named (``<op id>#<home>.<attempt>``).
PART, OVER, NEW = part_id("op", 0, 1), part_id("over", 0, 1), part_id("new", 0, 1)
ORDER = part_id("order", 0, 1)


async def acquired(
    backend: Backend, keys: ShardKeys, token: str, attempt: str
) -> LeaseGrant | LeaseHeld:
    return await backend.run_call(acquire(keys, AcquireArgs(token, 5000, 3, attempt)))


async def test_an_acquire_sent_again_by_its_owner_returns_the_same_grant_and_no_strike(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """After a crash (horizon past progress), the acquire strikes the first unfinished op. Its
    reply lost, the same worker asks again: same epoch, same grant, no second strike."""
    keys = ShardKeys(namespace, 0)
    entry = await client.xadd(
        keys.stream, {"v": "1", "ops": json.dumps([{"id": "suspect", "key": "k", "op": "record"}])}
    )
    await client.set(keys.horizon, entry)
    first = await acquired(backend, keys, "me", "try-1")
    again = await acquired(backend, keys, "me", "try-1")
    assert again == first
    assert isinstance(first, LeaseGrant)
    assert first.suspect == "suspect", "the grant names the struck op: the new owner runs it alone"
    assert await client.get(keys.epoch) == b"1"
    assert await client.hgetall(keys.suspect) == {b"op": b"suspect", b"strikes": b"1"}
    for token, attempt in (("other", "try-1"), ("me", "try-2")):
        # Another worker, or a new attempt of this one (its old runner's calls may still land),
        # gets nothing while the lease lives, but how long it lives.
        held = await acquired(backend, keys, token, attempt)
        assert isinstance(held, LeaseHeld) and 0 < held.expires_in_ms <= 5000


async def test_an_entry_refused_as_reserved_left_by_a_crash_is_never_a_suspect(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An entry of keyserial's grant op, or under an op id holding '#', runs no code (refused
    at intake, storing nothing): the op behind it takes the strike, and neither is ever
    struck dead, which would store a poison record under a name keyserial keeps for a
    participant's part."""
    keys = ShardKeys(namespace, 2)
    grant = {
        "id": "x",
        "keys": ["k"],
        "op": "keyserial.grant",
        "kwargs": {"home": 0, "op": "x", "attempt": 1, "channel": "c"},
    }
    await client.xadd(keys.stream, {"v": "1", "ops": json.dumps([grant])})
    part = {"id": "y#0.1", "key": "k", "op": "record"}
    await client.xadd(keys.stream, {"v": "1", "ops": json.dumps([part])})
    entry = await client.xadd(
        keys.stream, {"v": "1", "ops": json.dumps([{"id": "after", "key": "k2", "op": "record"}])}
    )
    await client.set(keys.horizon, entry)
    for strike in (1, 2, 3):
        await client.delete(keys.lease)
        await acquired(backend, keys, f"w{strike}", "a")
    assert await client.hget(keys.suspect, "op") == b"after"
    dead = await client.xrange(keys.dead)
    assert [json.loads(fields[b"raw"])["id"] for _, fields in dead] == ["after"]


@pytest.mark.parametrize("stored_where", ["results", "results_old"])
async def test_a_hold_of_an_attempt_whose_part_is_over_is_skipped_and_named_in_the_reply(
    backend: Backend, client: redis.asyncio.Redis, namespace: str, stored_where: str
) -> None:
    """A grant request may reach its participant again after the attempt's part there is over
    (applied or released, its outcome stored in either results generation): its coordinator
    sent it again, or a signed message was replayed. The step records no hold for it (nothing
    would ever answer it: the keys would stay held), names it in its reply's ``skipped``, and
    commits the rest: a hold of an attempt with no outcome beside it is recorded. Sent again,
    the step answers the same."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    await client.hset(getattr(keys, stored_where), OVER, '{"ok":"applied"}')
    commit = StepCommit.of([("a", "5")], holds=[(OVER, _HOLD), (NEW, _HOLD)])
    first = await backend.run_call(_step(keys, commit))
    assert first.skipped == [OVER]
    assert await client.hkeys(keys.held) == [NEW.encode()]
    assert await client.hget(keys.state, "a") == b"5", "the rest of the step committed"
    fetched = (await client.xadd(keys.stream, {"v": "1", "ops": "[]"})).decode()
    again = await backend.run_call(_step(keys, commit, fetch=10))  # (and fetches an entry)
    assert [entry_id for entry_id, _ in again.entries] == [fetched]
    assert again.skipped == [OVER]
    assert await client.hkeys(keys.held) == [NEW.encode()]
    plain = await backend.run_call(_step(keys, StepCommit.of([("a", "5")])))
    assert plain.skipped == [], "a step with no hold skips none"


async def test_a_hold_lasts_until_the_step_that_answers_its_request(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A hold is a record of its own, in the shard's held hash, not among the results: the step
    that stores its request's answer (applied or released) deletes it, and so does that step
    taken as sent again (a hold under the answered attempt is over, whoever left it there). The
    request coming again after its answer holds nothing: its step skips the hold."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    held = await backend.run_call(_step(keys, _with_hold(PART)))
    assert held.skipped == []
    assert await client.hkeys(keys.held) == [PART.encode()]
    applied = StepCommit.of([("a", "6")], [(PART, '{"ok":"applied"}')], released=[PART])
    await backend.run_call(_step(keys, applied))
    assert await client.hlen(keys.held) == 0
    assert await client.hget(keys.results, PART) == b'{"ok":"applied"}'
    again = await backend.run_call(_step(keys, _with_hold(PART, state="6")))
    assert again.skipped == [PART], "the request came again after its answer"
    assert await client.hlen(keys.held) == 0
    # (A hold under the answered attempt all the same, as a worker of an earlier version left
    # one for a copy of the request: the answer's step sent again ends it.)
    await client.hset(keys.held, PART, _HOLD)
    await backend.run_call(_step(keys, applied))
    assert await client.hlen(keys.held) == 0
    assert await client.hget(keys.results, PART) == b'{"ok":"applied"}'


async def test_a_grant_under_an_epoch_that_moved_on_is_refused_and_records_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """A zombie participant (its epoch is over) cannot grant: nothing is recorded or sent."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 3)
    with pytest.raises(Fenced):
        await backend.run_call(_step(keys, _with_hold(PART)))
    assert not await client.hexists(keys.held, PART)


#: A hold's record: the grant of no keys.
_HOLD = '{"s": []}'


def _with_hold(field: str, state: str = "5") -> StepCommit:
    """A step's commit: a write of key "a", and a hold of no keys recorded under ``field``."""
    return StepCommit.of([("a", state)], holds=[(field, _HOLD)])


def _with_decision(outcome: str, state: str, decision: str = '{"w":{}}') -> StepCommit:
    """A step's commit: the decision of attempt 2 of op "op", with its home write and outcome."""
    return StepCommit.of([("a", state)], [("op", outcome)], decisions=[("op#2#d", decision)])


async def test_a_decision_sent_again_after_it_landed_commits_nothing_more(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    call = _step(keys, _with_decision('{"ok":5}', "5"))
    await backend.run_call(call)
    await backend.run_call(call)
    assert await client.hget(keys.results, "op#2#d") == b'{"w":{}}'
    assert await client.hget(keys.results, "op") == b'{"ok":5}'


async def test_a_decision_of_an_op_run_again_is_refused_and_writes_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The op id has an outcome, and this step did not write it: the op ran again (its entry
    appended again as ``fresh``). Its coordinator holds the home keys until its step returns,
    so a step sent again always finds its home writes holding."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    await backend.run_call(_step(keys, _with_decision('{"ok":5}', "5")))
    await client.hset(keys.state, "a", "6")  # a later op moved the key on
    with pytest.raises(Replayed):  # the same attempt run again, on the key as it is now
        await backend.run_call(_step(keys, _with_decision('{"ok":7}', "7")))
    assert await client.hget(keys.state, "a") == b"6"
    assert await client.hget(keys.results, "op") == b'{"ok":5}'


async def test_a_decision_never_wins_over_an_abort(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """An abort a participant recorded first refuses the whole step: nothing is written."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    abort = '{"abort":"the coordinator lost the home shard"}'
    await client.hset(keys.results_old, "op#2#d", abort)
    with pytest.raises(Replayed, match="op#2#d"):
        await backend.run_call(_step(keys, _with_decision('{"ok":5}', "5")))
    assert await client.hget(keys.results_old, "op#2#d") == abort.encode()
    assert not await client.hexists(keys.results, "op")
    assert await client.hget(keys.state, "a") is None


def _across(outcome: str, home_state: str, other_state: str) -> StepCommit:
    """A step's commit: op "op", with its home write, and its write to the step's first other
    shard, owned by epoch 4."""
    return StepCommit.of(
        [("a", home_state)], [("op", outcome)], others=[(1, 4, [("b", other_state)])]
    )


async def test_a_step_writing_another_shard_sent_again_after_it_landed_writes_nothing_more(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Sent again after a lost reply, when the other shard has changed hands meanwhile, it must
    not answer ELSEWHERE (its owner would start again and run the op again): it landed."""
    home, other = ShardKeys(namespace, 0), ShardKeys(namespace, 1)
    await client.set(home.epoch, 2)
    await client.set(other.epoch, 4)
    call = _step(home, _across('{"ok":1}', "9", "11"), others=[other])
    await backend.run_call(call)  # committed (a refusal would raise)
    await client.incr(other.epoch)  # the other shard changed hands
    await client.hset(other.state, "b", "12")  # and its new owner moved b on
    await backend.run_call(call)  # committed: ELSEWHERE would raise
    assert await client.hget(other.state, "b") == b"12"
    assert await client.hget(home.results, "op") == b'{"ok":1}'


async def test_a_step_writing_another_shard_of_an_op_run_again_is_refused_and_writes_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """The op's result is there, but a write to a shard still owned by the epoch it names
    does not hold: not this step sent again, but the op run again (its entry appended again
    as ``fresh``). Answering "landed" would have its owners cache writes Redis does not hold."""
    home, other = ShardKeys(namespace, 0), ShardKeys(namespace, 1)
    await client.set(home.epoch, 2)
    await client.set(other.epoch, 4)
    await backend.run_call(_step(home, _across('{"ok":1}', "9", "11"), others=[other]))
    again = _step(home, _across('{"ok":2}', "9", "12"), others=[other])
    with pytest.raises(Replayed):
        await backend.run_call(again)
    assert await client.hget(home.state, "a") == b"9"
    assert await client.hget(other.state, "b") == b"11"
    assert await client.hget(home.results, "op") == b'{"ok":1}'


async def test_a_step_writing_another_shard_whose_owner_moved_on_writes_nothing(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Its owner's epoch is not the one the step names: no write of the step lands, the home's
    included, and the refusal names the other shard by its place in the step."""
    home, other = ShardKeys(namespace, 0), ShardKeys(namespace, 1)
    await client.set(home.epoch, 2)
    await client.set(other.epoch, 5)
    call = _step(home, _across('{"ok":1}', "9", "11"), others=[other])
    with pytest.raises(OwnedElsewhere) as refused:
        await backend.run_call(call)
    assert refused.value.index == 1
    assert await client.hget(home.state, "a") is None
    assert await client.hget(other.state, "b") is None
    assert not await client.hexists(home.results, "op")


async def test_a_step_sent_again_after_it_landed_commits_nothing_more(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Its outcomes are all stored and its writes all hold: it landed, and its dead letters
    are not written twice."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    call = _step(
        keys,
        StepCommit.of(
            [("a", "5"), ("gone", "")],
            [("op", '{"ok":5}')],
            dead=[("1-1", "malformed", "{}")],
        ),
    )
    for _ in range(2):
        await backend.run_call(call)
    assert await client.hget(keys.state, "a") == b"5"
    assert await client.hget(keys.results, "op") == b'{"ok":5}'
    assert await client.xlen(keys.dead) == 1


@pytest.mark.parametrize("stored_where", ["results", "results_old"])
async def test_a_step_storing_an_outcome_that_is_stored_already_is_refused(
    backend: Backend, client: redis.asyncio.Redis, namespace: str, stored_where: str
) -> None:
    """An op id with an outcome (in either results generation) that a step would store again:
    the op ran again (an entry appended again as ``fresh``, a replayed push). Nothing of the
    step is written, whether its writes differ or another op's outcome is new."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    await client.hset(getattr(keys, stored_where), "op", '{"ok":5}')
    await client.hset(keys.state, "a", "5")
    for commit in (
        StepCommit.of([("a", "10")], [("op", '{"ok":10}')]),
        StepCommit.of([("a", "5")], [("op", '{"ok":5}'), ("new", '{"ok":1}')]),
    ):
        with pytest.raises(Replayed):
            await backend.run_call(_step(keys, commit))
    assert await client.hget(keys.state, "a") == b"5"
    assert not await client.hexists(keys.results, "new")
    assert await client.get(keys.progress) is None


async def test_a_step_whose_delete_no_longer_holds_is_not_taken_for_itself_sent_again(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Its outcome is stored and its other writes hold, but a key it deletes is there: not this
    step sent again (that would have deleted it), but its op run again. Nothing is written."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    await client.hset(keys.results, "op", '{"ok":5}')
    await client.hset(keys.state, mapping={"a": "5", "gone": "1"})
    again = StepCommit.of([("a", "5"), ("gone", "")], [("op", '{"ok":5}')])
    with pytest.raises(Replayed):
        await backend.run_call(_step(keys, again))
    assert await client.hget(keys.state, "gone") == b"1"
    assert await client.get(keys.progress) is None


@pytest.mark.parametrize("stored_where", ["results", "results_old"])
async def test_a_step_storing_an_outcome_stored_in_an_earlier_layout_is_refused(
    backend: Backend, client: redis.asyncio.Redis, namespace: str, stored_where: str
) -> None:
    """An op id whose outcome the layout before a reshard stored (in either generation, at the
    shard the step names for it): the op ran again after the move. Nothing of the step is
    written; the same step naming another op id there, or the op at another old shard,
    commits."""
    keys = ShardKeys(namespace, 0, 1)
    old_home, old_other = ShardKeys(namespace, 2), ShardKeys(namespace, 3)
    await client.set(keys.epoch, 2)
    await client.hset(getattr(old_home, stored_where), "op", '{"ok":5}')
    commit = StepCommit.of([("a", "10")], [("op", '{"ok":10}')])
    for earlier in ([(old_home, ["op"])], [(old_other, ["new"]), (old_home, ["new", "op"])]):
        with pytest.raises(Replayed, match=r"op op \(in a layout before a reshard\)"):
            await backend.run_call(_step(keys, commit, earlier=earlier))
        assert await client.hget(keys.state, "a") is None
        assert not await client.hexists(keys.results, "op")
        assert await client.get(keys.progress) is None
    for earlier in ([(old_home, ["new"])], [(old_other, ["op"])]):
        await backend.run_call(_step(keys, commit, earlier=earlier))
        assert await client.hget(keys.state, "a") == b"10"
        await client.delete(keys.state, keys.results, keys.progress)


async def test_a_replaying_step_finds_the_outcomes_of_an_entry_holding_a_lone_surrogate(
    backend: Backend, client: redis.asyncio.Redis, namespace: str
) -> None:
    """Redis's cjson refuses a lone surrogate escape, which the workers' decoder takes (and
    refuses the op that holds it). A replay must still find the stored outcomes of every op of
    such an entry, or it runs them again and its commit is refused at every takeover (long
    nemesis seed 4465: a shard no owner could keep). Escaped backslashes and surrogate pairs
    stay as they are."""
    keys = ShardKeys(namespace, 0)
    await client.set(keys.epoch, 2)
    ops = (
        '[{"id":"bad","key":"k","op":"append","args":["\\ud83d", "\\udc00x"]},'
        ' {"id":"good\\\\ud83d","key":"k","op":"append","args":["\\ud83d\\ude00"]}]'
    )
    await client.xadd(keys.stream, {"v": "1", "ops": ops}, id="1-2")
    await client.hset(keys.results, mapping={"bad": '{"error":1}', "good\\ud83d": '{"ok":1}'})
    fetched = await backend.run_call(_step(keys, None, fetch=10, replaying=True))
    assert [entry_id for entry_id, _ in fetched.entries] == ["1-2"]
    assert fetched.done == {"bad": '{"error":1}', "good\\ud83d": '{"ok":1}'}


def _step(
    keys: ShardKeys,
    commit: StepCommit | None,
    *,
    fetch: int = 0,
    replaying: bool = False,
    others: Sequence[ShardKeys] = (),
    earlier: Sequence[tuple[ShardKeys, Sequence[str]]] = (),
) -> ScriptCall[StepReply]:
    """A step of the owner of epoch 2 that commits ``commit`` and moves progress (with no
    commit: fetches up to ``fetch`` entries after 1-1, and moves nothing); ``others``: the
    shards its "o" writes; ``earlier``: where it looks its op ids up in an earlier layout."""
    return step(
        keys,
        step_args(
            2,
            progress="1-1" if commit is not None else "",
            cursor="1-1",
            fetch=fetch,
            replaying=replaying,
        ),
        others,
        earlier,
        commit=commit,
    )


async def test_reserved_op_names_and_ids_are_refused(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """A client cannot submit keyserial's own grant op, and a worker refuses a stream entry of
    it (workers ask each other for grants in coordination messages, never in a stream: it holds
    no key and runs nothing) and any op id holding '#' (coordination records are named with
    it), storing nothing under such an id: a refusal stored under a record's name would stand
    in for it. A grant op under a plain id is refused as any malformed op is."""
    with pytest.raises(ValueError, match="keyserial"):
        keyserial.call("keyserial.grant", home=0)

    key = keys_on_shard(1, 4, 1, prefix="reserved")[0]
    forged = [
        # (As a coordinator of an earlier version appended a request, and with a plain id.)
        _stream_grant("x#1", key, {"home": 0, "op": "x", "attempt": 1, "channel": "c"}),
        _stream_grant("victim", key, {"home": 0, "op": "victim", "attempt": 1, "channel": "c"}),
    ]
    async with (
        running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=4, namespace=namespace) as ks,
    ):
        with pytest.raises(ValueError, match="keyserial's own"):
            await ks.submit(key, keyserial.Call("keyserial.grant"))
        shard = ShardKeys(namespace, 1)
        after = envelope("after", key, "record")
        entry = [envelope("a#1#d", key, "record"), *forged, after]
        await client.xadd(shard.stream, {"v": "1", "ops": json.dumps(entry)})
        assert await stored_outcome(ks, "after", key) == 1  # (the entry's step has committed)
        assert await client.hget(shard.results, "a#1#d") is None
        assert await client.hget(shard.results, "x#1") is None
        refusal = json.loads(await client.hget(shard.results, "victim"))
        assert refusal["error"]["type"] == keyserial.MalformedOperation.wire_type
        assert "'keyserial.grant' is reserved" in refusal["error"]["message"]
        assert await client.hlen(shard.held) == 0, "no grant op held a key"
        assert await client.xlen(shard.dead) == 0  # (each refused under its id, not dead)
        assert await ks.submit(key, keyserial.call("record"), timeout=10) == 2


def _stream_grant(op_id: str, key: str, kwargs: dict[str, object]) -> dict[str, object]:
    """An entry's envelope of keyserial's grant op, for ``key``."""
    return {"id": op_id, "keys": [key], "op": "keyserial.grant", "kwargs": kwargs}


async def test_an_op_id_holding_a_hash_never_joins_a_run_nor_takes_its_outcome(
    redis_url: str, namespace: str, client: redis.asyncio.Redis
) -> None:
    """A participant's run of a grant request is in its owner's running map under its part's
    name, ``<op id>#<home>.<attempt>``, and its outcome is stored under that name once its part
    is over. An entry under that id (here with the very op, keys and arguments the run has) is
    refused before it is looked up: joining the run would tie a client's entry and reply
    channel to a worker's request, and the part's outcome is no answer to a client's op."""
    key = keys_on_shard(1, 4, 1, prefix="attempt")[0]
    grant_op = {"id": ORDER, "keys": [key], "op": "keyserial.grant"}
    # The intake, as the owner of a shard holding the attempt's keys runs it:
    run = Run(
        Envelope(ORDER, (key,), "keyserial.grant", [], {}, None, multi=True),
        request=GrantRequest(0, "order", 1, "1", (key,), "ks:ns:worker:w", 0),
    )
    accepted = accept(
        "5-1",
        {b"v": b"1", b"ops": json.dumps([{**grant_op, "reply": "r"}]).encode(), b"p": b"3"},
        place="3",
        shard=1,
        shard_count=4,
        done={},
        running={ORDER: run},
    )
    assert (run.entries, run.replies, accepted.runs) == ([], [], [])
    (refused,) = accepted.finished
    assert (refused.op_id, refused.replies, refused.store) == (ORDER, ["r"], False)
    assert "'#' is reserved" in json.loads(refused.outcome)["error"]["message"]
    # A worker, with the attempt's part over (its outcome stored):
    shard = ShardKeys(namespace, 1)
    await client.hset(shard.results, ORDER, '{"ok":"applied"}')
    reply = f"ks:{namespace}:reply:attacker"
    async with (
        running_worker(redis_url, namespace, shard_count=4, apps=["tests.apps"]),
        client.pubsub() as listener,
    ):
        await listener.subscribe(reply)
        await push_item(
            client, namespace, 1, [{**grant_op, "reply": reply}], fresh=False, wake=True
        )
        with anyio.fail_after(10):
            while not (message := await listener.get_message(True, timeout=1)):
                pass
        ((op_id, outcome),) = decode_reply(message["data"])
    assert op_id == ORDER
    assert outcome["error"]["type"] == keyserial.MalformedOperation.wire_type
    assert "'#' is reserved" in outcome["error"]["message"]
    stored = [await client.hget(each, ORDER) for each in (shard.results, shard.results_old)]
    assert b'{"ok":"applied"}' in stored, "the part's outcome stays as it was"
