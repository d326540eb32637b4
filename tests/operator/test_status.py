"""``keyserial status``: owners, epochs, leases, backlog, oldest op, dead letters and ops/s of
every shard, as JSON and as a table, through the real command line."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from typing import Any

import anyio
import pytest
import redis.asyncio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

import keyserial
from keyserial._backend.backend import Backend
from keyserial._operator import status as _status
from keyserial._operator.pauses import pause
from keyserial._wire.layout import Layout, owner_channel, roster_key, worker_channel
from keyserial._wire.roster import ROSTER_SILENT, ROSTER_STALE, WorkerEntry
from keyserial._wire.signing import encode_public_key
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests.helpers import ROOT, Starter, eventually, keys_on_shard, wait_for_log


async def keyserial_cli(*args: str) -> tuple[int, str, str]:
    """Run ``python -m keyserial ARGS``; its exit code, stdout and stderr."""
    with anyio.fail_after(30):
        result = await anyio.run_process(
            [sys.executable, "-m", "keyserial", *args], cwd=ROOT, check=False
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


#: ``python -m keyserial ARGS`` as a shell in a terminal starts it, SIGINT neither blocked nor
#: ignored, for the tests that send it Ctrl-C. Both survive fork and exec, so a child has them
#: from pytest, and pytest from whatever started the run: a non-interactive shell's background
#: job (``python -m pytest > log &``, ``nohup``) has SIGINT ignored, and its one-shot status
#: then never sees the signal. (A command ignores a Ctrl-C its parent chose to ignore, as it
#: should: what is tested is the one a terminal sends.)
_KEYSERIAL_AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'keyserial', *sys.argv[1:]])",
]


@pytest.mark.slow
async def test_status_json_reports_every_field_and_exits_1_when_a_shard_has_no_owner(
    redis_url: str, namespace: str
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with (
            running_worker(
                redis_url, namespace, shards=[0], shard_count=2, lease_ttl=5.0
            ) as worker,
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            await ks.submit(keys_on_shard(0, 2, 1)[0], deposit(1))
            # A malformed entry on the owned shard becomes its one dead letter.
            await client.xadd(ShardKeys(namespace, 0).stream, {"v": "1", "ops": "{not json"})
            await eventually(lambda: client.xlen(ShardKeys(namespace, 0).dead))
            # Shard 1 has no worker: three entries wait there.
            appended = time.time()
            for n in range(3):
                await client.xadd(
                    ShardKeys(namespace, 1).stream,
                    {
                        "v": "1",
                        "ops": json.dumps(
                            [
                                {
                                    "id": f"wait-{n}",
                                    "key": keys_on_shard(1, 2, 1)[0],
                                    "op": "deposit",
                                    "args": [1],
                                }
                            ]
                        ),
                    },
                )
            epoch = int(await client.get(ShardKeys(namespace, 0).epoch))
            started = time.time()
            code, out, err = await keyserial_cli(
                "status",
                "--json",
                "--redis",
                redis_url,
                "--namespace",
                namespace,
                "--interval",
                "0.1",
            )
            assert worker.owned_shards  # still serving when the command read it
    finally:
        await client.aclose()
    assert code == 1, err
    report = json.loads(out)
    assert report["namespace"] == namespace and report["shard_count"] == 2
    assert report["healthy"] is False
    owned, orphan = report["shards"]
    assert owned["shard"] == 0 and orphan["shard"] == 1
    assert owned["owner"]["pid"] == os.getpid()
    assert owned["owner"]["host"] == socket.gethostname()
    assert owned["owner"]["worker"] == worker.token  # (the lease's value, less the public key)
    assert owned["epoch"] == epoch
    assert 0 < owned["lease_expires_in_ms"] <= 5000
    assert owned["backlog"] == 0 and owned["oldest_waiting_age_ms"] is None
    assert owned["dead_letters"] == 1
    assert owned["ops_per_s"] == 0
    assert orphan["owner"] is None and orphan["epoch"] is None
    assert orphan["lease_expires_in_ms"] is None
    assert orphan["backlog"] == 3
    waited_at_least = (started - appended) * 1000
    assert waited_at_least - 50 <= orphan["oldest_waiting_age_ms"] <= 30_000
    assert orphan["dead_letters"] == 0


@pytest.mark.slow
async def test_status_table_lists_every_shard_and_exits_0_when_all_are_owned(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    async with running_worker(url, namespace, shard_count=3):
        code, out, err = await keyserial_cli(
            "status", "--redis", url, "--namespace", namespace, "--interval", "0.1"
        )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"namespace {namespace!r}: 3 shards"
    assert lines[1].split()[:2] == ["SHARD", "OWNER"]
    for shard, line in enumerate(lines[2:5]):
        assert line.split()[:2] == [str(shard), f"{socket.gethostname()}:{os.getpid()}"]
    assert lines[5].split()[:3] == ["WORKER", "(host:pid)", "OWNS"]
    assert lines[6].split()[:3] == [f"{socket.gethostname()}:{os.getpid()}", "0-2", "-"]
    assert lines[7] == "ok: every shard has an owner"


@pytest.mark.slow
async def test_status_lists_standby_workers_and_workers_whose_ops_differ(
    redis_url: str, namespace: str, start: Starter
) -> None:
    """Every running worker is on the roster: status shows which shards each owns and stands
    by for, and flags two workers of the same shards with other op sets; the one started
    second says so in its log, naming the ops it lacks."""
    async with running_worker(
        redis_url, namespace, shards=[0, 1], shard_count=2, apps=["tests.apps"]
    ) as owner:
        standby = start(redis_url, namespace, shards="0-1", shard_count=2, apps=())
        await wait_for_log(standby, "also serves shards 0-1, with other ops")
        assert "it runs append, " in standby.log()  # (tests.apps' ops, which it lacks)
        code, out, err = await keyserial_cli(
            "status", "--json", "--redis", redis_url, "--namespace", namespace, "--interval", "0.1"
        )
    assert code == 0, err
    by_pid = {worker["pid"]: worker for worker in json.loads(out)["workers"]}
    assert set(by_pid) == {os.getpid(), standby.pid}
    mine, theirs = by_pid[os.getpid()], by_pid[standby.pid]
    assert mine["worker"] == owner.token
    assert (mine["serves"], mine["owns"], mine["standby"]) == ([0, 1], [0, 1], [])
    assert (theirs["serves"], theirs["owns"], theirs["standby"]) == ([0, 1], [], [0, 1])
    assert "append" in mine["ops"] and "append" not in theirs["ops"]
    assert "deposit" in mine["ops"] and "deposit" in theirs["ops"]
    assert mine["ops_differ_from"] == [theirs["worker"]]
    assert theirs["ops_differ_from"] == [mine["worker"]]


@pytest.mark.slow
async def test_status_shows_each_shard_s_paused_keys_the_longest_paused_first(
    redis_url: str, namespace: str
) -> None:
    """A paused key's ops wait, so its shard's backlog and oldest waiting entry grow: status
    counts each shard's paused keys and names the longest paused few, beside those figures."""
    held = keys_on_shard(0, 2, _status.PAUSED_SHOWN + 2, "held")
    backend = await Backend.connect(redis_url)
    try:
        async with (
            running_worker(redis_url, namespace, shard_count=2),
            keyserial.connect(redis_url, namespace=namespace) as ks,
        ):
            for key in held:
                await pause(backend, namespace, key, pausing=True)
                await anyio.sleep(0.005)  # (each paused a millisecond or more after the last)
            await ks.enqueue(held[0], deposit(1))  # waits: the shard's backlog
            await eventually(lambda: _stream_length(redis_url, ShardKeys(namespace, 0)))
            options = ["--redis", redis_url, "--namespace", namespace, "--interval", "0.1"]
            code, out, err = await keyserial_cli("status", "--json", *options)
            assert code == 0, err
            code, table, err = await keyserial_cli("status", *options)
            assert code == 0, err
            # (Its op then runs: the worker's stop has no op to wait a lease TTL for.)
            await pause(backend, namespace, held[0], pausing=False)
    finally:
        await backend.aclose()
    holding, other = json.loads(out)["shards"]
    assert holding["backlog"] == 1 and holding["oldest_waiting_age_ms"] is not None
    assert holding["paused"] == len(held)
    assert holding["paused_keys"] == held[: _status.PAUSED_SHOWN]
    assert (other["paused"], other["paused_keys"]) == (0, [])
    lines = table.splitlines()
    assert lines[1].split()[-3:] == ["PAUSED", "TIMERS", "NEXT"]
    assert lines[2].split()[-3] == str(len(held)) and lines[3].split()[-3] == "0"
    named = ", ".join(repr(key) for key in held[: _status.PAUSED_SHOWN])
    at = lines.index("paused keys (their ops wait until `keyserial keys resume KEY`):")
    assert lines[at + 1] == f"  shard 0: {named} and 2 more (`keyserial keys paused` lists them)"
    assert lines[-1] == "ok: every shard has an owner"


async def _stream_length(redis_url: str, keys: ShardKeys) -> int:
    """(An op that runs on, a paused key's, moves from the inbox into the stream.)"""
    async with redis.asyncio.Redis.from_url(redis_url) as client:
        return int(await client.xlen(keys.stream))


@pytest.mark.slow
async def test_status_says_when_each_worker_last_renewed_and_flags_one_that_missed_two(
    redis_url: str, namespace: str
) -> None:
    """A worker killed without a word stays on the roster until its entry is 30 s old: status
    shows each entry's age, and flags one that missed two renewals as maybe gone; an entry
    past 30 s is left out."""
    now = time.time()
    silent = WorkerEntry("gone-host:4321:feed", (0, 1), ("deposit",), now - ROSTER_SILENT - 3)
    stale = WorkerEntry("old-host:1234:beef", (0, 1), ("deposit",), now - ROSTER_STALE - 5)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        async with running_worker(redis_url, namespace, shard_count=2) as worker:
            for entry in (silent, stale):
                await client.hset(roster_key(namespace), entry.token, entry.encode())
            options = ["--redis", redis_url, "--namespace", namespace, "--interval", "0.1"]
            code, out, err = await keyserial_cli("status", "--json", *options)
            assert code == 0, err
            code, table, err = await keyserial_cli("status", *options)
            assert code == 0, err
    finally:
        await client.aclose()
    listed = {entry["worker"]: entry for entry in json.loads(out)["workers"]}
    assert set(listed) == {worker.token, silent.token}
    live, gone = listed[worker.token], listed[silent.token]
    assert live["renewed_ms_ago"] < ROSTER_SILENT * 1000 and live["maybe_gone"] is False
    assert (ROSTER_SILENT + 3) * 1000 <= gone["renewed_ms_ago"] < ROSTER_STALE * 1000
    assert gone["maybe_gone"] is True and gone["standby"] == [0, 1]
    rows = {line.split()[0]: line for line in table.splitlines()}
    assert rows["gone-host:4321"].endswith("s ago (gone?)")
    mine = rows[f"{socket.gethostname()}:{os.getpid()}"]
    assert mine.endswith(" ago") and "gone?" not in mine


async def test_ops_per_second_counts_the_ops_committed_between_two_snapshots(
    redis_url: str, namespace: str
) -> None:
    keys = keys_on_shard(1, 2, 5)
    async with (
        running_worker(redis_url, namespace, shard_count=2),
        keyserial.connect(redis_url, namespace=namespace) as ks,
    ):
        backend = await Backend.connect(redis_url)
        try:
            before = await _status.snapshot(backend, Layout(namespace, 2))
            for n in range(40):
                await ks.submit(keys[n % len(keys)], deposit(1))
            after = await _status.snapshot(backend, Layout(namespace, 2))
        finally:
            await backend.aclose()
    idle, busy = _status.compare(before, after)
    seconds = (after[1].time_ms - before[1].time_ms) / 1000
    assert idle.ops_per_s == 0
    assert busy.ops_per_s is not None
    assert round(busy.ops_per_s * seconds) == 40


@pytest.mark.slow
async def test_status_of_an_unused_namespace_is_an_error_that_says_so(
    standalone_server: LocalServer, namespace: str
) -> None:
    code, _, err = await keyserial_cli(
        "status", "--redis", standalone_server.url, "--namespace", namespace
    )
    assert code == 2
    assert f"namespace {namespace!r} has no shard count recorded" in err


def _shard_at(time_ms: int, results: int) -> _status.Snapshot:
    return _status.Snapshot(0, None, None, None, 0, None, 0, results, "0", time_ms)


def test_ops_per_second_is_taken_over_at_least_a_second_whoever_asked_last() -> None:
    """Two viewers of the dashboard a moment apart: the second is not shown the rate of the
    last few milliseconds (most often none), but of the last second or more."""
    rates = _status.Rates()
    window = _status.RATE_WINDOW_MS
    assert rates.of([_shard_at(0, 0)])[0].ops_per_s is None  # (nothing to compare with)
    assert rates.of([_shard_at(2 * window, 200)])[0].ops_per_s == 100_000 / window
    # 20 ms later (a second viewer): since the first, a window or more before, not since 20 ms.
    assert rates.of([_shard_at(2 * window + 20, 200)])[0].ops_per_s == 200_000 / (2 * window + 20)
    # Later, from the newest snapshot a window old or more: the second viewer's.
    assert rates.of([_shard_at(3 * window + 500, 300)])[0].ops_per_s == 100_000 / (window + 480)
    # A snapshot of another layout (a reshard) starts the series again.
    two_shards = [_shard_at(4 * window, 0), _shard_at(4 * window, 0)]
    assert [status.ops_per_s for status in rates.of(two_shards)] == [None, None]


@pytest.mark.slow
async def test_status_watch_prints_a_report_per_interval_until_interrupted(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    async with running_worker(url, namespace, shard_count=2):
        process = await anyio.open_process(
            [
                *_KEYSERIAL_AS_FROM_A_TERMINAL,
                "status",
                "--watch",
                "--json",
                "--redis",
                url,
                "--namespace",
                namespace,
                "--interval",
                "0.1",
            ],
            cwd=ROOT,
        )
        try:
            assert process.stdout is not None
            output = b""
            with anyio.fail_after(20):
                while output.count(b"\n") < 3:
                    output += await process.stdout.receive()
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                code = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
            await process.aclose()
    reports: list[dict[str, Any]] = [json.loads(line) for line in output.splitlines()[:3]]
    assert code == 0
    assert all(report["healthy"] for report in reports)
    assert [len(report["shards"]) for report in reports] == [2, 2, 2]


@pytest.mark.parametrize(
    ("token", "host", "pid"),
    [
        ("web-1:4242:0a1b2c3d", "web-1", 4242),
        ("host.example:12:abcd1234", "host.example", 12),
        ("weird", "weird", None),
        ("weird.not-a-key", "weird.not-a-key", None),
    ],
)
def test_an_owner_token_reads_as_host_pid_and_nonce(token: str, host: str, pid: int | None) -> None:
    owner = _status.Owner.parse(token)
    assert (owner.worker, owner.host, owner.pid) == (token, host, pid)


def test_a_lease_value_reads_as_its_holder_s_token_less_the_public_key() -> None:
    """A lease holds ``<token>.<public key>`` (the holder's channel less its prefix): the owner
    is the token, which the roster names the worker by (a host name may have dots)."""
    key = encode_public_key(X25519PrivateKey.generate().public_key())
    assert len(key) == 43
    owner = _status.Owner.parse(f"host.example:12:abcd1234.{key}")
    assert (owner.worker, owner.host, owner.pid) == ("host.example:12:abcd1234", "host.example", 12)
    assert owner.host_pid == "host.example:12"


async def test_a_shard_s_lease_names_the_coordination_channel_of_its_owner(
    redis_url: str, namespace: str, backend: Backend
) -> None:
    """Another worker finds where to message a shard's owner by reading the shard's lease
    (``Backend.lease_holders``, one GET a shard): through ``owner_channel`` it is the owner's
    mailbox channel, exactly; and status still names the owner by its token, as the roster
    does."""
    layout = Layout(namespace, 3)
    async with running_worker(redis_url, namespace, shards=[0, 2], shard_count=3) as worker:
        holders = await backend.lease_holders(layout.all_keys())
        snapshots = await _status.snapshot(backend, layout)
    channel = worker._mailbox.channel
    assert channel.startswith(f"{worker_channel(namespace, worker.token)}.")
    assert holders[1] is None
    assert [owner_channel(namespace, held.decode()) for held in holders if held] == [channel] * 2
    owners = [None if now.owner is None else now.owner.worker for now in snapshots]
    assert owners == [worker.token, None, worker.token]
    entry = WorkerEntry(worker.token, (0, 2), ("deposit",), time.time())
    (listed,) = _status.workers([entry], _status.compare(snapshots, snapshots))
    assert listed.owns == (0, 2)  # (what `keyserial status` shows of each worker on the roster)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("watch", "expected"), [([], 130), (["--watch"], 0)], ids=["one shot", "watch"]
)
async def test_ctrl_c_before_the_first_report_stops_status_without_a_traceback(
    namespace: str, watch: list[str], expected: int
) -> None:
    """One shot: code 130. ``--watch`` stops on the signal, with the exit code of its last
    report: 0 when it is stopped before its first one (docs/operations.md)."""
    with LocalServer() as server:  # (its own: the only client there running a script is ours)
        async with running_worker(server.url, namespace, shard_count=1):
            pass  # records the namespace
        admin = redis.asyncio.Redis.from_url(server.url)
        # (The worker's connections may linger in CLIENT LIST a while, their last command a
        # script: only a connection opened after this one is the status process's.)
        before = {client["id"] for client in await admin.client_list()}
        process = await anyio.open_process(
            [
                *_KEYSERIAL_AS_FROM_A_TERMINAL,
                "status",
                "--redis",
                server.url,
                "--namespace",
                namespace,
                "--interval",
                "30",
                *watch,
            ],
            cwd=ROOT,
        )
        try:
            # It sent its first snapshot: keyserial's code runs, and its SIGINT handling is set.
            await eventually(lambda: _ran_a_script(admin, before), timeout=20)
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                code = await process.wait()
            assert process.stdout is not None and process.stderr is not None
            out = await _rest(process.stdout)
            err = await _rest(process.stderr)
        finally:
            if process.returncode is None:
                process.kill()
            await process.aclose()
            await admin.aclose()
    assert (code, out) == (expected, "")
    assert "Traceback" not in err
    assert err.strip() == ("keyserial: interrupted" if expected == 130 else "")


async def _rest(stream: Any) -> str:
    """What a finished process wrote to ``stream``."""
    chunks = []
    try:
        while True:
            chunks.append(await stream.receive())
    except anyio.EndOfStream:
        return b"".join(chunks).decode()


async def _ran_a_script(admin: Any, before: set[str]) -> bool:
    """A connection opened since ``before`` (client ids) ran a script."""
    clients = await admin.client_list()
    return any(
        client.get("cmd") in ("eval", "evalsha") and client["id"] not in before
        for client in clients
    )
