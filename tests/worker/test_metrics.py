"""``--metrics-port``: workers (real processes, and in-process) serve Prometheus text whose
numbers match what was done to them; the Grafana dashboard only asks for metrics that exist."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable

import anyio
import pytest
import redis.asyncio
from prometheus_client.parser import text_string_to_metric_families

import keyserial
from keyserial import InsufficientFunds, PoisonOperation, Settings, UnknownOperation, Worker
from keyserial._worker.metrics import Metrics
from keyserial.ledger import deposit, withdraw
from keyserial.testing import LocalServer, ShardKeys, free_port
from tests import apps
from tests.helpers import ROOT, WorkerProcess, holder_pid, keys_on_shard, wait_for_log

SHARDS = 4
Starter = Callable[..., WorkerProcess]


# -- helpers ---------------------------------------------------------------------------------


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text: str = response.read().decode()
        return text


async def scrape(port: int) -> str:
    """One scrape, from a thread: an in-process worker serves it on this event loop."""
    return await anyio.to_thread.run_sync(_get, port)


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def scraped_when(port: int, check: Callable[[str], bool], *, timeout: float = 15) -> str:
    """Scrape until ``check`` holds for the text (the port may not be served yet)."""
    text = ""
    with anyio.fail_after(timeout):
        while True:
            try:
                text = await scrape(port)
            except OSError:
                pass
            else:
                if check(text):
                    return text
            await anyio.sleep(0.05)


def refuses(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


async def owns_all(url: str, namespace: str, pid: int) -> None:
    with anyio.fail_after(15):
        while [holder_pid(url, namespace, s) for s in range(SHARDS)] != [pid] * SHARDS:
            await anyio.sleep(0.02)


def metrics_args(port: int) -> list[str]:
    return ["--metrics-port", str(port)]


# -- a worker process ------------------------------------------------------------------------


async def test_a_worker_counts_its_ops_by_name_and_outcome(
    standalone_server: LocalServer, namespace: str, start: Starter
) -> None:
    url, port = standalone_server.url, free_port()
    worker = start(url, namespace, extra_args=metrics_args(port))
    async with (
        keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks,
        redis.asyncio.Redis.from_url(url) as client,
    ):
        for _ in range(3):
            await ks.submit("account:1", deposit(10), timeout=10)
        with pytest.raises(InsufficientFunds):
            await ks.submit("account:1", withdraw(100), timeout=10)
        with pytest.raises(UnknownOperation):
            await ks.submit("account:1", keyserial.call("no_such_op"), timeout=10)
        shard = ks.shard_of("account:1")
        keys = ShardKeys(namespace, shard)
        # One envelope instead of an array of them: the entry is dead-lettered whole.
        entry = await client.xadd(
            keys.stream,
            {"v": "1", "ops": json.dumps({"id": "bad", "key": "account:1", "op": "deposit"})},
        )
        await client.publish(keys.wake_channel, entry)

    def settled(text: str) -> bool:
        return value(text, "keyserial_dead_letters_total", reason="malformed") == 1

    text = await scraped_when(port, settled)
    on = {"namespace": namespace, "shard": str(shard)}
    assert value(text, "keyserial_ops_total", op="deposit", outcome="ok", **on) == 3
    assert value(text, "keyserial_ops_total", op="withdraw", outcome="failed", **on) == 1
    assert value(text, "keyserial_ops_total", op="(unknown)", outcome="unknown_op", **on) == 1
    assert value(text, "keyserial_ops_total") == 5
    assert value(text, "keyserial_op_latency_seconds_count", op="deposit") == 3
    assert value(text, "keyserial_op_latency_seconds_bucket", op="deposit", le="+Inf") == 3
    assert value(text, "keyserial_ops_per_step_sum", **on) == 5
    assert value(text, "keyserial_step_duration_seconds_count", **on) >= 5
    assert value(text, "keyserial_pipeline_calls_count") >= 5
    assert value(text, "keyserial_shards_owned", namespace=namespace) == SHARDS
    assert value(text, "keyserial_shard_cached_keys", **on) >= 1
    assert value(text, "keyserial_shard_backlog_ops", **on) == 0
    assert value(text, "keyserial_takeovers_total", mode="clean") == SHARDS
    assert worker.process.poll() is None


async def test_a_participant_counts_each_grant_it_lent_once_its_op_is_decided(
    standalone_server: LocalServer, namespace: str, start: Starter
) -> None:
    """A participant on one server lends its keys and commits nothing for the op: each grant
    request is counted once its decision is known, as a committed op is (no step counts it)."""
    url, port = standalone_server.url, free_port()
    start(url, namespace, shards="0", shard_count=2)
    start(url, namespace, shards="1", shard_count=2, extra_args=metrics_args(port))
    source, target = (keys_on_shard(shard, 2, 1, "acct")[0] for shard in (0, 1))
    async with keyserial.connect(url, shards=2, namespace=namespace) as ks:
        await ks.submit(source, deposit(10), timeout=10)
        for _ in range(3):
            await ks.transfer(source, target, 1, timeout=10)

    def counted(text: str) -> bool:
        return value(text, "keyserial_ops_total", shard="1", outcome="ok") == 3

    text = await scraped_when(port, counted)
    assert value(text, "keyserial_ops_total", shard="1", op="keyserial.grant", outcome="ok") == 3
    assert value(text, "keyserial_op_latency_seconds_count", op="keyserial.grant") == 3


@pytest.mark.slow
async def test_a_standby_counts_the_takeovers_after_a_kill_9_of_the_owner(
    standalone_server: LocalServer, namespace: str, start: Starter
) -> None:
    url, port = standalone_server.url, free_port()
    owner = start(url, namespace, lease_ttl=0.5)
    await owns_all(url, namespace, owner.pid)
    standby = start(url, namespace, lease_ttl=0.5, extra_args=metrics_args(port))
    await wait_for_log(standby, "serving metrics", timeout=15)
    assert value(await scrape(port), "keyserial_takeovers_total") == 0
    owner.signal(signal.SIGKILL)

    def took_all(text: str) -> bool:
        return value(text, "keyserial_takeovers_total", namespace=namespace) == SHARDS

    text = await scraped_when(port, took_all)
    assert value(text, "keyserial_shards_owned") == SHARDS


@pytest.mark.slow
async def test_a_poisoned_op_is_counted_as_a_dead_letter_and_a_poison_outcome(
    standalone_server: LocalServer, namespace: str, start: Starter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYSERIAL_MAX_STRIKES", "1")  # the first death dead-letters the op
    url, port = standalone_server.url, free_port()
    owner = start(url, namespace, lease_ttl=0.5)
    await owns_all(url, namespace, owner.pid)
    standby = start(url, namespace, lease_ttl=0.5, extra_args=metrics_args(port))
    await wait_for_log(standby, "serving metrics", timeout=15)
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        with pytest.raises(PoisonOperation):
            await ks.submit("poison:1", apps.crash(), timeout=20)
        shard = ks.shard_of("poison:1")

    def counted(text: str) -> bool:
        return value(text, "keyserial_dead_letters_total", reason="poison") == 1

    text = await scraped_when(port, counted)
    on = {"namespace": namespace, "shard": str(shard)}
    assert value(text, "keyserial_ops_total", outcome="poison", op="(unknown)", **on) == 1
    assert value(text, "keyserial_takeovers_total", mode="careful", **on) == 1


async def test_the_metrics_port_can_come_from_the_environment(
    standalone_server: LocalServer, namespace: str, start: Starter, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("KEYSERIAL_METRICS_PORT", str(port))
    start(standalone_server.url, namespace)
    await scraped_when(port, lambda text: value(text, "keyserial_shards_owned") == SHARDS)


async def test_only_the_metrics_path_serves_the_metrics(
    standalone_server: LocalServer, namespace: str, start: Starter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/metrics.md gives ``/metrics``: any other path is a 404 (a query string is fine)."""
    port = free_port()
    monkeypatch.setenv("KEYSERIAL_METRICS_PORT", str(port))
    start(standalone_server.url, namespace)
    await scraped_when(port, lambda text: "keyserial_shards_owned" in text)

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as refused:
            return refused.code

    statuses = [
        await anyio.to_thread.run_sync(status, path)
        for path in ("/", "/metricsx", "/other/metrics", "/metrics?name[]=x")
    ]
    assert statuses == [404, 404, 404, 200]


async def test_the_metrics_port_flag_wins_over_the_environment(
    standalone_server: LocalServer, namespace: str, start: Starter, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, variable = free_port(), free_port()
    monkeypatch.setenv("KEYSERIAL_METRICS_PORT", str(variable))
    worker = start(standalone_server.url, namespace, extra_args=metrics_args(flag))
    await scraped_when(flag, lambda text: value(text, "keyserial_shards_owned") == SHARDS)
    assert f"metrics on http://0.0.0.0:{flag}/" in worker.log()
    assert refuses(variable)


def test_a_bad_metrics_port_variable_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KEYSERIAL_METRICS_PORT", "ninety")
    result = subprocess.run(
        [sys.executable, "-m", "keyserial", "worker", "--redis", "redis://127.0.0.1:1/0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "KEYSERIAL_METRICS_PORT='ninety'" in result.stderr


@pytest.mark.slow
async def test_a_taken_metrics_port_stops_the_worker_with_an_error(
    standalone_server: LocalServer, namespace: str, start: Starter
) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = start(standalone_server.url, namespace, extra_args=metrics_args(port))
        with anyio.fail_after(15):
            while worker.process.poll() is None:
                await anyio.sleep(0.05)
    assert worker.process.returncode == 2
    assert f"cannot serve metrics on port {port}" in worker.log()
    # Stopped before it subscribed: no subscription's pending futures left to complain.
    assert "Future exception was never retrieved" not in worker.log()


# -- in-process workers ----------------------------------------------------------------------


async def test_the_metrics_port_closes_when_the_worker_stops(
    standalone_server: LocalServer, namespace: str
) -> None:
    settings = Settings(namespace=namespace, shard_count=SHARDS)
    worker = Worker(standalone_server.url, settings=settings, metrics_port=0)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await worker.wait_started()
        port = worker.metrics.bound_port
        assert port is not None
        assert "keyserial_shards_owned" in await scrape(port)
        worker.stop()
    assert refuses(port)


async def test_an_op_id_resubmitted_is_counted_once(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    worker = Worker(url, settings=Settings(namespace=namespace, shard_count=SHARDS), metrics_port=0)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await worker.wait_started()
        async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
            for _ in range(3):
                assert await ks.submit("account:1", deposit(7), op_id="once", timeout=10) == 7
        assert worker.metrics.bound_port is not None
        text = await scrape(worker.metrics.bound_port)
        assert value(text, "keyserial_ops_total", op="deposit") == 1
        assert value(text, "keyserial_op_latency_seconds_count", op="deposit") == 1
        worker.stop()


async def test_lease_renewals_that_time_out_are_counted(namespace: str) -> None:
    with LocalServer() as server:  # private: the whole server is paused
        worker = Worker(
            server.url,
            metrics_port=0,
            settings=Settings(namespace=namespace, shard_count=SHARDS, lease_ttl=0.5),
        )
        async with anyio.create_task_group() as group:
            group.start_soon(worker.run)
            await worker.wait_started()
            port = worker.metrics.bound_port
            assert port is not None
            assert value(await scrape(port), "keyserial_lease_renew_failures_total") == 0
            async with redis.asyncio.Redis.from_url(server.url) as client:
                await client.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
            await scraped_when(
                port, lambda text: value(text, "keyserial_lease_renew_failures_total") >= 1
            )
            worker.stop()


async def test_two_workers_in_one_process_keep_their_own_metrics(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    workers = [
        Worker(
            url, settings=Settings(namespace=f"{namespace}-{n}", shard_count=SHARDS), metrics_port=0
        )
        for n in range(2)
    ]
    async with anyio.create_task_group() as group:
        for worker in workers:
            group.start_soon(worker.run)
            await worker.wait_started()
        async with keyserial.connect(url, shards=SHARDS, namespace=f"{namespace}-0") as ks:
            await ks.submit("account:1", deposit(1), timeout=10)
        ports = [worker.metrics.bound_port for worker in workers]
        assert None not in ports
        first, second = [await scrape(port) for port in ports if port is not None]
        assert value(first, "keyserial_ops_total", op="deposit") == 1
        assert value(second, "keyserial_ops_total", op="deposit") == 0
        assert f'namespace="{namespace}-1"' in second
        assert f'namespace="{namespace}-0"' not in second
        for worker in workers:
            worker.stop()


# -- keyserial dev ---------------------------------------------------------------------------


@pytest.mark.slow
def test_dev_serves_the_same_metrics() -> None:
    port, metrics_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keyserial",
            "dev",
            "--port",
            str(port),
            "--shard-count",
            "2",
            "--metrics-port",
            str(metrics_port),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        while "ready" not in (line := process.stdout.readline()):
            assert line, "keyserial dev exited before it was ready"

        async def deposit_and_scrape() -> str:
            async with keyserial.connect(f"redis://127.0.0.1:{port}/0", shards=2) as ks:
                await ks.submit("account:1", deposit(5), timeout=10)
            return await scraped_when(
                metrics_port,
                lambda text: value(text, "keyserial_ops_total", op="deposit", outcome="ok") == 1,
            )

        text = anyio.run(deposit_and_scrape)
        assert value(text, "keyserial_shards_owned", namespace="default") == 2
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        process.wait()


# -- the dashboard ---------------------------------------------------------------------------


def _exported_names() -> set[str]:
    """Every sample name a worker's registry can write."""
    metrics = Metrics("default", [], dict, None)
    suffixes: dict[str, tuple[str, ...]] = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
    }
    return {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes[family.type]
    }


def test_the_grafana_dashboard_uses_only_metrics_that_exist() -> None:
    text = (ROOT / "docs" / "grafana-dashboard.json").read_text()
    dashboard = json.loads(text)
    used = set(re.findall(r"\bkeyserial_[a-z_]+", text))
    assert used, "the dashboard queries keyserial metrics"
    assert used <= _exported_names(), used - _exported_names()
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("throughput", "latency", "step", "backlog", "takeover", "dead letter"):
        assert topic in titles


def test_the_metrics_doc_describes_every_metric() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    metrics = Metrics("default", [], dict, None)
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in doc, name


async def test_timer_metrics_count_fired_timers_their_lateness_and_what_waits(
    standalone_server: LocalServer, namespace: str, start: Callable[..., WorkerProcess]
) -> None:
    url, port = standalone_server.url, free_port()
    start(url, namespace, extra_args=metrics_args(port))
    async with keyserial.connect(url, shards=SHARDS, namespace=namespace) as ks:
        shard = ks.shard_of("account:7")
        await ks.submit("account:7", deposit(1), timeout=10)
        for _ in range(2):
            await ks.submit("account:7", deposit(1), delay=0.2, timeout=10)
        await ks.enqueue("account:7", deposit(1), delay=3600)

        def settled(text: str) -> bool:
            return value(text, "keyserial_shard_timers_waiting", shard=str(shard)) == 1

        text = await scraped_when(port, settled)
    on = {"namespace": namespace, "shard": str(shard)}
    assert value(text, "keyserial_timers_fired_total", **on) == 2
    assert value(text, "keyserial_timer_lateness_seconds_count", namespace=namespace) == 2
    assert value(text, "keyserial_timer_lateness_seconds_sum", namespace=namespace) < 2
    assert 3500 < value(text, "keyserial_shard_next_timer_seconds", **on) <= 3600.1
    other = {"namespace": namespace, "shard": str((shard + 1) % SHARDS)}
    assert value(text, "keyserial_shard_timers_waiting", **other) == 0
