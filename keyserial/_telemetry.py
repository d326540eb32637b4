"""OpenTelemetry tracing, with the ``otel`` extra (``pip install 'keyserial[otel]'``).

A submit is a span (kind PRODUCER) whose W3C trace context travels in the op's envelope (``tc``:
the ``traceparent`` and ``tracestate`` headers), and the worker runs the op in a span (kind
CONSUMER) that is its child: an op's run shows under the request that submitted it, across
processes, and the spans an op makes itself nest under its run. Spans are made only when
opentelemetry-api is installed and an SDK tracer provider is set, by the app or by
``opentelemetry-instrument`` from the ``OTEL_*`` variables; otherwise an op costs one check.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace

    _INSTALLED = True
except ImportError:  # (the otel extra is not installed)
    _INSTALLED = False

#: A trace context as it travels: W3C headers (``traceparent``, ``tracestate``).
Carrier = dict[str, str]


#: Seconds between two looks for a tracer provider while none is set: a look costs about a
#: microsecond, too much for every op and every submit.
LOOK_EVERY = 1.0
_tracer: Any = None
_looked_at = -LOOK_EVERY


def tracer() -> Any:
    """keyserial's tracer, or None when nothing would record its spans. A provider can be set
    once per process (the API refuses a second): once found, its tracer is kept; one set
    later than keyserial first looked is used within :data:`LOOK_EVERY` seconds."""
    global _tracer, _looked_at
    if _tracer is not None or not _INSTALLED:
        return _tracer
    now = time.monotonic()
    if now - _looked_at < LOOK_EVERY:
        return None
    _looked_at = now
    provider = _trace.get_tracer_provider()
    if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
        return None
    _tracer = provider.get_tracer("keyserial")
    return _tracer


@contextmanager
def submitting(traced: Any, op: str, keys: str | Sequence[str], op_id: str) -> Iterator[Carrier]:
    """A submit's span (``traced``: :func:`tracer`'s), current while it runs; yields the trace
    context to send with the op."""
    attributes = {"keyserial.op": op, "keyserial.op_id": op_id, "keyserial.key": _key(keys)}
    with traced.start_as_current_span(
        f"keyserial submit {op}", kind=_trace.SpanKind.PRODUCER, attributes=attributes
    ):
        carrier: Carrier = {}
        _propagate.inject(carrier)
        yield carrier


class RunSpan:
    """An op's run as its span hears of it: the executor sets ``error`` when the op raised, and
    the span records it as it ends (the run itself goes on: a raised error is an outcome)."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BaseException | None = None


@contextmanager
def running(
    traced: Any, op: str, keys: str | Sequence[str], op_id: str, sent: Mapping[str, str] | None
) -> Iterator[RunSpan]:
    """An op's run on the worker, a child of the submit that ``sent`` its trace context (a
    root span if it sent none)."""
    parent = _propagate.extract(dict(sent)) if sent else None
    attributes = {"keyserial.op": op, "keyserial.op_id": op_id, "keyserial.key": _key(keys)}
    with traced.start_as_current_span(
        f"keyserial run {op}",
        context=parent,
        kind=_trace.SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=False,
    ) as span:
        run = RunSpan()
        yield run
        if (error := run.error) is not None:
            span.record_exception(error)
            span.set_status(
                _trace.Status(_trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")
            )


def _key(keys: str | Sequence[str]) -> str | list[str]:
    return keys if isinstance(keys, str) else list(keys)
