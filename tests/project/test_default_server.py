"""Which Redis a command or a client uses, and that it says so (docs/deployment.md#the-default-
server): no URL given means the server ``keyserial dev`` starts, never one on the standard port;
every command names its server, password hidden; a timeout for want of a worker names it too."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import pytest

import keyserial
from keyserial._settings import DEFAULT_URL, default_url
from keyserial.cli import build_parser
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, free_port, running_worker
from tests.helpers import ROOT
from tests.users import documented_users

NOTE = "keyserial: using "


def _env(url: str | None) -> dict[str, str]:
    """This process's environment, ``KEYSERIAL_REDIS_URL`` set to ``url`` (None: unset)."""
    env = {name: value for name, value in os.environ.items() if name != "KEYSERIAL_REDIS_URL"}
    return env if url is None else {**env, "KEYSERIAL_REDIS_URL": url}


def _hidden(url: str) -> str:
    """``redis://user:password@host...`` as keyserial shows it: ``redis://user:***@host...``."""
    password = url.split("@")[0].rsplit(":", 1)[1]
    return url.replace(f":{password}@", ":***@")


async def _cli(*args: str, url: str | None) -> tuple[int, str, str]:
    """``python -m keyserial ARGS`` with ``KEYSERIAL_REDIS_URL=url``; code, stdout, stderr."""
    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-m", "keyserial", *args], cwd=ROOT, check=False, env=_env(url)
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def test_no_url_means_the_server_keyserial_dev_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEYSERIAL_REDIS_URL", raising=False)
    dev_port = build_parser().parse_args(["dev"]).port
    assert default_url() == DEFAULT_URL == f"redis://127.0.0.1:{dev_port}/0"
    assert dev_port != 6379  # (the standard port: on a developer's machine, often anyone's)
    monkeypatch.setenv("KEYSERIAL_REDIS_URL", "")  # (set and empty: not a URL)
    assert default_url() == DEFAULT_URL
    monkeypatch.setenv("KEYSERIAL_REDIS_URL", "redis://elsewhere:7000/1")
    assert default_url() == "redis://elsewhere:7000/1"


@pytest.mark.slow
async def test_every_command_names_its_server_unless_its_command_line_does(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    said = f"{NOTE}{url} ($KEYSERIAL_REDIS_URL)\n"
    ns = ["--namespace", namespace]
    async with running_worker(url, namespace, shard_count=2):
        commands = [
            ["status", "--interval", "0.1", *ns],  # (ops/s over 0.1 s, not 1 s)
            ["call", "account:1", "deposit", "5", *ns],
            ["read", "account:1", *ns],
            ["dead-letters", "list", *ns],
            ["keys", "paused", *ns],
            ["reshard", "--to", "2", *ns],  # (2 already: nothing to do)
        ]
        for command in commands:
            code, _, err = await _cli(*command, url=url)
            assert code == 0 and err.startswith(said), (command, err)
        for command in commands[:2]:  # (--redis wins over the variable, and is not repeated)
            code, _, err = await _cli(*command, "--redis", url, url="redis://127.0.0.1:1/0")
            assert code == 0 and NOTE not in err, (command, err)


@pytest.mark.slow
async def test_the_server_named_is_the_default_or_hides_its_password() -> None:
    unused = free_port()
    code, _, err = await _cli("status", url=None)
    assert err.startswith(f"{NOTE}{DEFAULT_URL} (the default, keyserial dev's;"), err
    secret = f"redis://app:s3cret@127.0.0.1:{unused}/0"
    code, out, err = await _cli("read", "account:1", url=secret)
    assert (code, out) == (2, "")
    assert err.startswith(f"{NOTE}redis://app:***@127.0.0.1:{unused}/0 ($KEYSERIAL_REDIS_URL)")
    assert "s3cret" not in err


@pytest.mark.slow
def test_the_worker_logs_the_server_it_serves_before_it_serves(namespace: str) -> None:
    with LocalServer() as server, documented_users(server.url) as users:
        shown = _hidden(users.worker_url)
        command = ["worker", "--shard-count", "1", "--namespace", namespace]
        process = subprocess.Popen(
            [sys.executable, "-m", "keyserial", *command],
            cwd=ROOT,
            env=_env(users.worker_url),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert process.stdout is not None
            lines = []
            while not any("serving shards" in line for line in lines):
                line = process.stdout.readline()
                assert line, lines
                lines.append(line)
            named = [line for line in lines if "worker using Redis at" in line]
            assert len(named) == 1 and f"at {shown} ($KEYSERIAL_REDIS_URL)" in named[0], lines
            assert f"in namespace '{namespace}' on asyncio at {shown} (ops:" in lines[-1], lines[-1]
            assert not any(users.worker_url in line for line in lines)
        finally:
            process.terminate()
            process.wait(timeout=15)


@pytest.mark.slow
async def test_a_timeout_for_want_of_a_worker_names_the_server_password_hidden(
    standalone_server: LocalServer, namespace: str
) -> None:
    async with keyserial.connect(standalone_server.url, shards=2, namespace=namespace):
        pass  # (records the namespace: the client user may not)
    with documented_users(standalone_server.url) as users:
        shown = _hidden(users.client_url)
        password = users.client_url.split("@")[0].rsplit(":", 1)[1]
        async with keyserial.connect(users.client_url, shards=2, namespace=namespace) as ks:
            shard = ks.shard_of("account:9")
            with pytest.raises(keyserial.SubmitTimeout) as caught:
                await ks.submit("account:9", deposit(1), timeout=0.3)
        message = str(caught.value)
        assert f"no worker holds shard {shard} of namespace {namespace!r} at {shown}" in message
        assert caught.value.server == shown and password not in message


@pytest.mark.slow
async def test_call_says_which_server_has_no_worker_for_its_shard(
    standalone_server: LocalServer, namespace: str
) -> None:
    url = standalone_server.url
    async with keyserial.connect(url, shards=2, namespace=namespace) as ks:
        shard = ks.shard_of("account:9")
    command = ["call", "account:9", "deposit", "1", "--timeout", "0.5", "--namespace", namespace]
    code, out, err = await _cli(*command, url=url)
    assert (code, out) == (1, "")
    assert f"no worker holds shard {shard} of namespace {namespace!r} at {url}" in err
