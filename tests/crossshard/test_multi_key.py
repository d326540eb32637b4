"""Multi-key ops on one shard: atomic, isolated, and never deadlocked (G4, one-shard part)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import anyio
import pytest

import keyserial
from keyserial import InsufficientFunds, MalformedOperation
from keyserial.ledger import LEDGER_OPS, balance, deposit, transfer
from keyserial.testing import running_worker
from tests import apps
from tests.helpers import eventually

ACCOUNTS = [f"acct:{n}" for n in range(6)]


@pytest.mark.slow
async def test_transfer_moves_money_atomically_and_refuses_overdrafts(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        await ks.submit("acct:a", deposit(100))
        assert await ks.transfer("acct:a", "acct:b", 30) == {"acct:a": 70, "acct:b": 30}
        with pytest.raises(InsufficientFunds) as refused:
            await ks.transfer("acct:b", "acct:a", 31)
        assert (refused.value.balance, refused.value.amount) == (30, 31)
        assert [await ks.read("acct:a"), await ks.read("acct:b")] == [70, 30]
        assert await ks.submit_many(["acct:b", "acct:a"], transfer(30)) == {
            "acct:b": 0,
            "acct:a": 100,
        }


@pytest.mark.slow
async def test_concurrent_transfers_both_ways_conserve_money_and_never_go_negative(
    redis_url: str, namespace: str
) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        for account in ACCOUNTS:
            await ks.submit(account, deposit(100))
        rng = random.Random(7)
        moved: list[tuple[str, str, int]] = []
        refused: list[InsufficientFunds] = []

        async def mover() -> None:
            for _ in range(25):
                source, target = rng.sample(ACCOUNTS, 2)
                amount = rng.randint(1, 60)
                try:
                    await ks.transfer(source, target, amount)
                except InsufficientFunds as error:
                    assert (error.key, error.amount) == (source, amount)
                    refused.append(error)
                else:
                    moved.append((source, target, amount))

        async with anyio.create_task_group() as group:
            for _ in range(16):
                group.start_soon(mover)
        balances = {account: await ks.submit(account, balance()) for account in ACCOUNTS}
        # 400 transfers of up to 60 between accounts of 100: some are refused, each for a
        # balance below its amount, and the rest moved exactly what they said.
        assert refused and all(error.balance < error.amount for error in refused)
        assert len(moved) + len(refused) == 16 * 25
        expected = dict.fromkeys(ACCOUNTS, 100)
        for source, target, amount in moved:
            expected[source] -= amount
            expected[target] += amount
        assert balances == expected
        assert min(balances.values()) >= 0


async def test_overlapping_slow_multi_key_ops_are_isolated_and_all_complete(
    redis_url: str, namespace: str
) -> None:
    """Random key sets in random orders, each op reading, waiting and writing all its keys:
    no lost update and no deadlock (the test finishes) when sets overlap in both directions."""
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        rng = random.Random(11)
        plans = [(f"op-{n}", rng.sample(ACCOUNTS, rng.randint(2, 4))) for n in range(60)]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for op_id, keys in plans:
                    group.start_soon(
                        lambda i=op_id, k=keys: ks.submit_many(k, apps.slow_move(0.002), op_id=i)
                    )
        for account in ACCOUNTS:
            applied = await ks.read(account) or []
            expected = {op_id for op_id, keys in plans if account in keys}
            assert sorted(applied) == sorted(expected), account


async def test_a_multi_key_op_waits_for_earlier_ops_on_its_keys_only(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    note = tmp_path / "slow-started"
    async with (
        running_worker(redis_url, namespace, shard_count=1, apps=["tests.apps"]),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        order: list[str] = []

        async def slow_then_record() -> None:
            await ks.submit("acct:x", apps.noted_slow_record(0.5, str(note)), op_id="slow")
            order.append("slow")

        async def move() -> None:
            await ks.submit_many(["acct:x", "acct:y"], apps.slow_move(0), op_id="move")
            order.append("move")

        async with anyio.create_task_group() as group:
            group.start_soon(slow_then_record)
            await eventually(note.exists, message="the slow op started")
            group.start_soon(move)
            await ks.submit("acct:z", deposit(1))  # an uninvolved key is not held up
            order.append("other")
        assert order == ["other", "slow", "move"]
        assert await ks.read("acct:x") == ["slow", "move"]


async def test_an_op_sent_with_the_wrong_arity_is_refused(redis_url: str, namespace: str) -> None:
    async with (
        running_worker(redis_url, namespace, shard_count=1),
        keyserial.connect(redis_url, shards=1, namespace=namespace) as ks,
    ):
        with pytest.raises(MalformedOperation, match="takes a list of keys"):
            await ks.submit("acct:a", transfer(1))
        with pytest.raises(MalformedOperation, match=r"takes one key \(submit\)"):
            await ks.submit_many(["acct:a", "acct:b"], deposit(1))


async def test_bad_key_lists_are_refused_at_submit(redis_url: str, namespace: str) -> None:
    async with keyserial.connect(redis_url, shards=16, namespace=namespace) as ks:
        with pytest.raises(TypeError):
            await ks.submit_many("acct:a", transfer(1))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="distinct"):
            await ks.submit_many(["acct:a", "acct:a"], transfer(1))
        with pytest.raises(ValueError, match="without '#'"):
            await ks.transfer("acct:a", "acct:b", 1, op_id="mine#1")  # '#' is reserved


@pytest.mark.parametrize("decorate", [keyserial.op, keyserial.multi_op])
def test_the_op_decorators_take_a_named_function_only(decorate: Any) -> None:
    def named(ctx: Any) -> None: ...

    for what in (42, decorate(named)):
        with pytest.raises(TypeError, match="take a function"):
            decorate(what)
    for nameless in (functools.partial(named), lambda ctx: None):
        with pytest.raises(TypeError, match="no name of its own"):
            decorate(nameless)
    assert decorate(name="given")(lambda ctx: None).name == "given"
    with pytest.raises(keyserial.ConfigError, match="non-empty"):
        decorate(name="")(named)


def test_an_app_op_named_as_a_ledger_op_is_refused_naming_both() -> None:
    def deposit(ctx: keyserial.Context, amount: int) -> None: ...

    with pytest.raises(keyserial.ConfigError, match=r"keyserial\.ledger\.deposit and "):
        keyserial.Registry([*LEDGER_OPS, keyserial.op(deposit)])


def test_op_names_in_keyserial_s_own_namespace_are_refused() -> None:
    """``keyserial.grant`` and the like are the workers' own: an app cannot shadow them."""

    def grant(ctx: keyserial.Context) -> None: ...

    with pytest.raises(keyserial.ConfigError, match="reserved"):
        keyserial.Registry().add(keyserial.op(name="keyserial.grant")(grant))
