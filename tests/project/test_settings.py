"""Settings: defaults, KEYSERIAL_* variables and explicit values, through Python and the CLI."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys

import pytest
import redis

import keyserial
from keyserial import ConfigError, Settings
from keyserial.ledger import deposit
from keyserial.testing import LocalServer, ShardKeys, running_worker
from tests.helpers import ROOT


def test_settings_come_from_keyserial_environment_variables() -> None:
    settings = Settings.from_env(
        {
            "KEYSERIAL_LEASE_TTL": "2.5",
            "KEYSERIAL_SHARD_COUNT": "32",
            "KEYSERIAL_NAMESPACE": "orders",
            "OTHER": "x",
        }
    )
    assert (settings.lease_ttl, settings.shard_count, settings.namespace) == (2.5, 32, "orders")


def test_a_misspelled_variable_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match="unknown setting KEYSERIAL_LEASE_TLL"):
        Settings.from_env({"KEYSERIAL_LEASE_TLL": "2"})


def test_a_value_of_the_wrong_type_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KEYSERIAL_MAX_STRIKES='many'"):
        Settings.from_env({"KEYSERIAL_MAX_STRIKES": "many"})


@pytest.mark.parametrize(
    "changes",
    [
        {"lease_ttl": 0},
        {"lease_ttl": 0.099},
        {"shard_count": 0},
        {"namespace": "a{b}"},
        {"namespace": ""},
        {"service": "billing.eu"},
        {"service": "bill*"},
        {"service": "x" * 65},
        {"max_backlog": -1},
        {"preload_states": -1},
    ],
)
def test_unworkable_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Settings(**changes)  # type: ignore[arg-type]


_POSITIVE = [
    "result_ttl",
    "max_payload_bytes",
    "max_strikes",
    "fetch_batch",
    "max_inflight",
    "idle_poll",
    "submit_timeout",
    "health_interval",
    "max_state_bytes",
    "max_cached_states",
]
_NOT_NEGATIVE = ["max_backlog", "preload_states", "durable_replicas"]


@pytest.mark.parametrize("name", _POSITIVE)
def test_a_setting_that_must_be_positive_refuses_zero(name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be positive, not 0$"):
        Settings(**{name: 0})


@pytest.mark.parametrize("name", _NOT_NEGATIVE)
def test_a_count_may_be_zero_but_not_negative(name: str) -> None:
    assert getattr(Settings(**{name: 0}), name) == 0
    with pytest.raises(ConfigError, match=f"^{name} must be 0 or positive, not -1$"):
        Settings(**{name: -1})


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_number_of_seconds_must_be_finite(value: float) -> None:
    with pytest.raises(ConfigError, match=r"^lease_ttl must be a finite number"):
        Settings(lease_ttl=value)


def test_every_numeric_setting_has_a_lower_bound() -> None:
    fields = dataclasses.fields(Settings)
    numeric = {field.name for field in fields if field.type in ("int", "float")}
    assert numeric == set(_POSITIVE) | set(_NOT_NEGATIVE) | {"lease_ttl"}  # (0.1 s at least)


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(TypeError):
        Settings(lease_tll=3)  # type: ignore[call-arg]


async def test_connect_names_its_shard_count_argument_when_given_the_settings_name() -> None:
    with pytest.raises(TypeError, match="shards="):
        async with keyserial.connect("redis://127.0.0.1:1/0", shard_count=4):
            pass
    with pytest.raises(TypeError, match="shards="):
        keyserial.connect_sync("redis://127.0.0.1:1/0", shard_count=4)


@pytest.mark.parametrize(
    ("changes", "wanted"),
    [
        ({"shard_count": 2.5}, "a whole number or None"),
        ({"max_strikes": True}, "a whole number"),
        ({"max_payload_bytes": 0.5}, "a whole number"),
        ({"durable_fsync": "no"}, "True or False"),
        ({"lease_ttl": "10"}, "a number"),
        ({"namespace": 5}, "a string"),
        ({"namespace": "a\ud800"}, "unpaired surrogates"),
    ],
)
def test_a_setting_of_the_wrong_type_is_refused(changes: dict[str, object], wanted: str) -> None:
    """A string "no" is not False, nor 0.5 a byte count: refused, naming the field."""
    with pytest.raises(ConfigError, match=wanted):
        Settings(**changes)  # type: ignore[arg-type]


async def test_a_fractional_shard_count_is_refused_before_a_namespace_records_it(
    standalone_server: LocalServer, namespace: str
) -> None:
    """Recorded, it would leave the namespace unusable by every client and worker."""
    with pytest.raises(ConfigError, match="shard_count must be a whole number"):
        async with keyserial.connect(
            standalone_server.url,
            shards=2.5,  # type: ignore[arg-type]
            namespace=namespace,
        ):
            pass
    with redis.Redis(port=standalone_server.port) as admin:
        assert admin.hget(f"ks:{{{namespace}}}:meta", "shards") is None


def test_explicit_values_win_over_variables_which_win_over_defaults() -> None:
    settings = Settings.resolve(
        {"KEYSERIAL_LEASE_TTL": "2.5", "KEYSERIAL_NAMESPACE": "env"},
        namespace="explicit",
        shard_count=None,
    )
    assert (settings.namespace, settings.lease_ttl, settings.shard_count) == ("explicit", 2.5, None)
    assert settings.result_ttl == Settings().result_ttl


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KEYSERIAL_LEASE_TTL", "0"),
        ("KEYSERIAL_LEASE_TTL", "nan"),
        ("KEYSERIAL_SHARD_COUNT", "0"),
        ("KEYSERIAL_NAMESPACE", "a{b}"),
        ("KEYSERIAL_MAX_BACKLOG", "-1"),
    ],
)
def test_an_unworkable_value_names_its_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}="):
        Settings.resolve({variable: value})


# -- through the command line ------------------------------------------------------------------


def _worker(url: str, *flags: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "keyserial", "worker", "--redis", url, *flags],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_the_worker_command_takes_flags_over_variables_over_defaults(
    standalone_server: LocalServer, namespace: str
) -> None:
    process = _worker(
        standalone_server.url,
        "--namespace",
        namespace,
        env={
            "KEYSERIAL_NAMESPACE": "not-this-one",
            "KEYSERIAL_SHARD_COUNT": "3",
            "KEYSERIAL_LEASE_TTL": "30",
        },
    )
    try:
        assert process.stderr is not None
        named = process.stderr.readline()  # (the server first: docs/deployment.md)
        assert f"worker using Redis at {standalone_server.url} (--redis)" in named, named
        serving = process.stderr.readline()
        assert f"serving shards 0-2 of 3 in namespace {namespace!r}" in serving, serving
        acquired = process.stderr.readline()
        assert "acquired" in acquired, acquired
        lease = redis.Redis.from_url(standalone_server.url)
        try:  # the lease TTL came from KEYSERIAL_LEASE_TTL: 30 s, not the default 10
            shard = int(acquired.split("shard ")[1].split(":")[0])
            assert lease.pttl(ShardKeys(namespace, shard).lease) > 10_000
        finally:
            lease.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KEYSERIAL_LEASE_TLL", "2", "unknown setting KEYSERIAL_LEASE_TLL"),
        ("KEYSERIAL_MAX_STRIKES", "many", "KEYSERIAL_MAX_STRIKES='many' is not a whole number"),
    ],
)
def test_the_worker_command_refuses_a_bad_variable_in_one_line(
    variable: str, value: str, expected: str
) -> None:
    process = _worker("redis://127.0.0.1:1/0", env={variable: value})
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 2
    (line,) = stderr.splitlines()  # one line, no traceback
    assert line.startswith("keyserial: error: ") and expected in line


# -- through connect() -------------------------------------------------------------------------


async def test_connect_takes_arguments_over_variables_over_defaults(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYSERIAL_NAMESPACE", namespace)
    monkeypatch.setenv("KEYSERIAL_SHARD_COUNT", "2")
    monkeypatch.setenv("KEYSERIAL_RESULT_TTL", "600")
    monkeypatch.setenv("KEYSERIAL_REDIS_URL", redis_url)
    async with running_worker(redis_url, namespace, shard_count=2):
        async with keyserial.connect() as ks:
            assert (ks.settings.namespace, ks.shard_count, ks.settings.result_ttl) == (
                namespace,
                2,
                600,
            )
            assert await ks.submit("account:1", deposit(5), timeout=10) == 5
        async with keyserial.connect(
            namespace=f"{namespace}-other", shards=3, result_ttl=60
        ) as other:
            assert (other.settings.namespace, other.shard_count, other.settings.result_ttl) == (
                f"{namespace}-other",
                3,
                60,
            )


async def test_connect_refuses_a_misspelled_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSERIAL_SHARDS", "16")
    with pytest.raises(ConfigError, match="unknown setting KEYSERIAL_SHARDS"):
        async with keyserial.connect("redis://127.0.0.1:1/0"):
            pass
