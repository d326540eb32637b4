"""``keyserial.register_client_metrics``: an app that exposes Prometheus sees how its submits
ended and how long they took, by namespace."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import keyserial
from keyserial.ledger import deposit, withdraw
from keyserial.testing import running_worker


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_submits_are_counted_by_outcome_and_timed(redis_url: str, namespace: str) -> None:
    registry = CollectorRegistry()
    keyserial.register_client_metrics(registry)
    submits = "keyserial_client_submits_total"
    before = {
        outcome: _sample(registry, submits, namespace=namespace, outcome=outcome)
        for outcome in ("ok", "failed", "timeout")
    }
    async with keyserial.connect(redis_url, shards=2, namespace=namespace) as ks:
        with pytest.raises(keyserial.SubmitTimeout):  # no worker yet
            await ks.submit("account:1", deposit(1), timeout=0.2)
        async with running_worker(redis_url, namespace, shard_count=2):
            for _ in range(3):
                await ks.submit("account:2", deposit(1))
            with pytest.raises(keyserial.InsufficientFunds):
                await ks.submit("account:2", withdraw(100))
    after = {
        outcome: _sample(registry, submits, namespace=namespace, outcome=outcome)
        for outcome in ("ok", "failed", "timeout")
    }
    assert {outcome: after[outcome] - before[outcome] for outcome in after} == {
        "ok": 3,
        "failed": 1,
        "timeout": 1,
    }
    assert _sample(registry, "keyserial_client_waiting", namespace=namespace) == 0
    count = _sample(registry, "keyserial_client_submit_seconds_count", namespace=namespace)
    assert count >= 5
    assert _sample(registry, "keyserial_client_submit_seconds_sum", namespace=namespace) >= 0.2
    assert b'keyserial_client_submits_total{namespace="' in generate_latest(registry)
