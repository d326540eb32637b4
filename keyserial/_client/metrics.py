"""What an app's clients did, for an app that exposes Prometheus metrics:
``keyserial.register_client_metrics()`` adds them to its registry (the default one, unless it
passes another). Every client of the process counts, by namespace, whether or not they are
registered: a counter and a histogram bucket per submit, no I/O.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import REGISTRY, Collector

from ..errors import (
    BackendUnavailable,
    BacklogFull,
    OperationFailed,
    PayloadTooLarge,
    SubmitTimeout,
)

#: Seconds: a submit answered in a millisecond to one that waited out a 30 s timeout.
SUBMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: How a submit ended, as the ``outcome`` label says it.
OUTCOMES = ("ok", "failed", "timeout", "unavailable", "refused", "cancelled", "error")


def outcome_of(error: BaseException | None) -> str:
    """The ``outcome`` label of a submit that ended with ``error`` (None: its value)."""
    if error is None:
        return "ok"
    if isinstance(error, OperationFailed):
        return "failed"  # the op's own error: it ran (or was refused) and said so
    if isinstance(error, SubmitTimeout):
        return "timeout"
    if isinstance(error, BackendUnavailable):
        return "unavailable"
    if isinstance(error, (BacklogFull, PayloadTooLarge)):
        return "refused"
    if not isinstance(error, Exception):
        return "cancelled"
    return "error"


class _Namespace:
    __slots__ = ("buckets", "outcomes", "seconds", "waiting")

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.buckets = [0] * (len(SUBMIT_BUCKETS) + 1)
        self.seconds = 0.0
        self.waiting = 0


class ClientMetrics(Collector):
    """The process's client counts, by namespace."""

    def __init__(self) -> None:
        self._by_namespace: defaultdict[str, _Namespace] = defaultdict(_Namespace)

    def began(self, namespace: str) -> float:
        """A submit began: it waits until :meth:`ended`; its start time."""
        self._by_namespace[namespace].waiting += 1
        return time.monotonic()

    def ended(self, namespace: str, began: float, error: BaseException | None) -> None:
        counts = self._by_namespace[namespace]
        counts.waiting -= 1
        counts.outcomes[outcome_of(error)] += 1
        took = time.monotonic() - began
        counts.buckets[bisect_left(SUBMIT_BUCKETS, took)] += 1
        counts.seconds += took

    def collect(self) -> Iterator[Metric]:
        submits = CounterMetricFamily(
            "keyserial_client_submits",
            "Submits of this process's keyserial clients, by how they ended: ok, failed (the"
            " op's own error), timeout, unavailable (Redis), refused (backlog full, payload"
            " too large), cancelled, error.",
            labels=["namespace", "outcome"],
        )
        seconds = HistogramMetricFamily(
            "keyserial_client_submit_seconds",
            "Seconds from a submit's call to its outcome (or error), on the caller's side.",
            labels=["namespace"],
        )
        waiting = GaugeMetricFamily(
            "keyserial_client_waiting",
            "Submits waiting for their outcome now.",
            labels=["namespace"],
        )
        for namespace, counts in sorted(self._by_namespace.items()):
            for outcome, count in counts.outcomes.items():
                submits.add_metric([namespace, outcome], count)
            cumulative, running = [], 0
            for bound, count in zip([*SUBMIT_BUCKETS, float("inf")], counts.buckets, strict=True):
                running += count
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
            seconds.add_metric([namespace], cumulative, counts.seconds)
            waiting.add_metric([namespace], counts.waiting)
        yield from (submits, seconds, waiting)


#: Every client of this process counts here.
CLIENT_METRICS = ClientMetrics()


def register_client_metrics(registry: CollectorRegistry = REGISTRY) -> None:
    """Expose this process's client metrics (``keyserial_client_*``) in ``registry``, the
    default registry of ``prometheus_client`` unless given another (docs/metrics.md). Call it
    once per registry."""
    registry.register(CLIENT_METRICS)
