"""OpenTelemetry (the ``otel`` extra): a traced submit sends its trace context with the op, and
the worker runs the op in a span that is the submit's child, in another process. Both
processes run under ``opentelemetry-instrument``, configured by the ``OTEL_*`` variables alone,
and export their spans to the console, where this test reads them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keyserial._wire.codec import decode_entry, encode_envelope
from keyserial.ledger import deposit
from tests.helpers import ROOT

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")

CLIENT = """
import sys
import anyio
import keyserial
from keyserial.ledger import deposit, withdraw
from opentelemetry import trace

async def main() -> None:
    async with keyserial.connect(sys.argv[1], shards=2, namespace=sys.argv[2]) as ks:
        with trace.get_tracer("shop").start_as_current_span("checkout"):
            assert await ks.submit("acct:1", deposit(5), timeout=30) == 5
            try:
                await ks.submit("acct:1", withdraw(7), timeout=30)
            except keyserial.InsufficientFunds:
                pass
            else:
                raise AssertionError("the withdraw of 7 from 5 succeeded")

anyio.run(main)
"""


def _environment(service: str) -> dict[str, str]:
    return {
        **os.environ,
        "OTEL_SERVICE_NAME": service,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }


def _flags(url: str, namespace: str) -> list[str]:
    return ["--redis", url, "--namespace", namespace, "--shard-count", "2", "--log-level", "ERROR"]


def _spans(printed: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed (one JSON object each), skipping other lines."""
    decoder, spans, at = json.JSONDecoder(), [], printed.find("{")
    while at != -1:
        span, end = decoder.raw_decode(printed, at)
        spans.append(span)
        at = printed.find("{", end)
    return spans


@pytest.mark.slow
def test_a_traced_submit_and_the_op_s_run_are_one_trace_across_processes(
    redis_url: str, namespace: str
) -> None:
    worker = subprocess.Popen(
        [INSTRUMENT, sys.executable, "-m", "keyserial", "worker", *_flags(redis_url, namespace)],
        cwd=ROOT,
        env=_environment("ks-worker"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        client = subprocess.run(
            [INSTRUMENT, sys.executable, "-c", CLIENT, redis_url, namespace],
            cwd=ROOT,
            env=_environment("shop"),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker_printed, _ = worker.communicate(timeout=30)
    spans = {span["name"]: span for span in _spans(client.stdout) + _spans(worker_printed)}
    checkout, submit = spans["checkout"], spans["keyserial submit deposit"]
    run = spans["keyserial run deposit"]
    assert run["resource"]["attributes"]["service.name"] == "ks-worker"
    assert submit["parent_id"] == checkout["context"]["span_id"]
    assert run["parent_id"] == submit["context"]["span_id"]
    trace_ids = {span["context"]["trace_id"] for span in (checkout, submit, run)}
    assert len(trace_ids) == 1
    assert (submit["kind"], run["kind"]) == ("SpanKind.PRODUCER", "SpanKind.CONSUMER")
    assert run["attributes"]["keyserial.key"] == "acct:1"
    assert run["status"]["status_code"] == "UNSET" and not run["events"]
    # The op that raised: its run's span records the error, and ends with it.
    failed = spans["keyserial run withdraw"]
    assert [event["name"] for event in failed["events"]] == ["exception"]
    error = failed["events"][0]["attributes"]
    assert error["exception.type"].endswith("InsufficientFunds")
    assert failed["status"] == {
        "status_code": "ERROR",
        "description": f"InsufficientFunds: {error['exception.message']}",
    }


def test_a_trace_context_travels_in_the_envelope_and_a_bad_one_is_dropped() -> None:
    headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    sent = encode_envelope("op-1", "k", deposit(1), None, headers)
    assert json.loads(sent)["tc"] == headers
    for carried, kept in ((headers, headers), ("00-bad", None), ({"a": 1}, None)):
        fields = {
            b"v": b"1",
            b"ops": json.dumps(
                [{"id": "op-1", "key": "k", "op": "deposit", "tc": carried}]
            ).encode(),
        }
        (envelope,) = decode_entry(fields)
        assert not isinstance(envelope, Exception) and envelope.trace == kept


def test_the_tracer_is_looked_up_once_a_second_until_a_provider_is_set() -> None:
    """Looking for a provider costs about a microsecond, so it is not done for every op: a
    provider set after the first look is used from the next look on, and then kept. (In a
    process of its own: a provider is set once per process.)"""
    code = "\n".join(
        [
            "from opentelemetry import trace",
            "from opentelemetry.sdk.trace import TracerProvider",
            "from keyserial import _telemetry as telemetry",
            "assert telemetry.tracer() is None",
            "trace.set_tracer_provider(TracerProvider())",
            "assert telemetry.tracer() is None  # (looked less than LOOK_EVERY ago)",
            "telemetry._looked_at -= telemetry.LOOK_EVERY  # (as a second later)",
            "found = telemetry.tracer()",
            "assert found is not None and telemetry.tracer() is found",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
