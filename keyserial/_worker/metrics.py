"""A worker's Prometheus metrics (``keyserial worker --metrics-port``; see docs/metrics.md).

The numbers live in plain Python objects that only the worker's event loop touches: shard
runners add to them (a dict update and a bisect per op, no lock), and the scrape endpoint, a
task on the same loop, reads them. ``prometheus_client`` writes the text format from a registry
of the worker's own, so two workers in one process never share a metric.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest

from .._wire.codec import error_type
from ..errors import ConfigError
from .activity import Activity

if TYPE_CHECKING:
    from .._scripts.lease import LeaseGrant
    from .commits import Finished
    from .execution import Run
    from .timers import TimerAlarm

log = logging.getLogger("keyserial.worker")

#: The op label of an op whose name this worker does not serve (an unknown op, a malformed or
#: poisoned one): names sent by clients must not become label values.
UNKNOWN_OP = "(unknown)"
#: Error types whose outcome class is not plain "failed" (an op's own refusal).
_ERROR_CLASSES = {
    "keyserial.MalformedOperation": "malformed",
    "keyserial.UnknownOperation": "unknown_op",
    "keyserial.PoisonOperation": "poison",
}
#: Seconds: from sub-millisecond steps on a local server to ops that wait on slow I/O.
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Ops per step and calls per pipeline: powers of two up to the default ``max_inflight``.
SIZE_BUCKETS = tuple(float(2**power) for power in range(13))
#: Seconds a scrape may take to send its request before the connection is dropped.
_REQUEST_TIMEOUT = 5.0
_MAX_REQUEST = 16 * 1024
#: The text format every Prometheus server reads (what ``generate_latest`` writes).
_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def outcome_class(outcome: str) -> str:
    """``ok``, or the class of an error outcome: failed, malformed, unknown_op or poison."""
    kind = error_type(outcome)
    return "ok" if kind is None else _ERROR_CLASSES.get(kind, "failed")


class _Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return cumulative


class _Histograms(defaultdict[tuple[str, ...], _Histogram]):
    def __init__(self, bounds: Sequence[float]) -> None:
        super().__init__(lambda: _Histogram(bounds))


class Gauged(Protocol):
    """What the per-shard gauges read of a shard's runner at scrape time."""

    @property
    def uncommitted(self) -> int: ...

    @property
    def states(self) -> Sized: ...

    @property
    def timers(self) -> TimerAlarm: ...


class Metrics:
    """One worker's metrics. ``owned`` gives the runners of the shards it holds now (read at
    scrape time for the per-shard gauges); ``ops`` are the op names it serves."""

    def __init__(
        self,
        namespace: str,
        ops: Iterable[str],
        owned: Callable[[], Mapping[int, Gauged]],
        port: int | None,
    ) -> None:
        self.namespace = namespace
        #: Recorded whether or not metrics are served: ``keyserial dashboard`` shows it.
        self.activity = Activity()
        self.port = port
        #: The port actually served (``port`` 0 picks a free one); None until serving.
        self.bound_port: int | None = None
        self._ops = frozenset(ops)
        self._owned = owned
        self.ops: defaultdict[tuple[str, str, str], int] = defaultdict(int)  # shard, op, outcome
        self.latency = _Histograms(LATENCY_BUCKETS)  # op
        self.step = _Histograms(LATENCY_BUCKETS)  # shard
        self.ops_per_step = _Histograms(SIZE_BUCKETS)  # shard
        self.pipeline_calls = _Histogram(SIZE_BUCKETS)
        self.renew_failures: defaultdict[str, int] = defaultdict(int)  # shard
        self.takeovers: defaultdict[tuple[str, str], int] = defaultdict(int)  # shard, mode
        self.dead_letters: defaultdict[tuple[str, str], int] = defaultdict(int)  # shard, reason
        self.timers_fired: defaultdict[str, int] = defaultdict(int)  # shard
        self.timer_lateness = _Histogram(LATENCY_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    @property
    def enabled(self) -> bool:
        return self.port is not None

    def op_label(self, name: str) -> str:
        return name if name in self._ops else UNKNOWN_OP

    # -- hooks: the worker and its runners call these ----------------------------------------

    def acquired(self, shard: int, grant: LeaseGrant) -> ShardMetrics:
        """Count a takeover; return what the shard's runner reports to."""
        label = str(shard)
        if not self.enabled:
            return ShardMetrics(None, label, self.activity, shard)
        mode = "careful" if grant.careful_until else "replay" if grant.replay_until else "clean"
        self.takeovers[label, mode] += 1
        if grant.poisoned:  # the acquire script dead-lettered it and stored its outcome
            self.dead_letters[label, "poison"] += 1
            self.ops[label, UNKNOWN_OP, "poison"] += 1
        return ShardMetrics(self, label, self.activity, shard)

    def renew_failed(self, shards: Iterable[int]) -> None:
        for shard in shards:
            self.renew_failures[str(shard)] += 1

    def pipelined(self, calls: int) -> None:
        if self.enabled:
            self.pipeline_calls.observe(calls)

    # -- serving -----------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the text format over HTTP on every interface until cancelled (nothing if no
        port was given). Started once the port is bound.

        :raises ConfigError: if the port cannot be bound.
        """
        if self.port is None:
            task_status.started()
            return
        try:
            listener = await anyio.create_tcp_listener(local_host="0.0.0.0", local_port=self.port)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on port {self.port}: {exc.strerror or exc}"
                " (is the port taken? choose another --metrics-port or KEYSERIAL_METRICS_PORT)"
            ) from None
        async with listener:
            self.bound_port = listener.extra(SocketAttribute.local_port)
            log.info("serving metrics on http://0.0.0.0:%d/metrics", self.bound_port)
            task_status.started()
            try:
                await listener.serve(self._answer)
            finally:
                self.bound_port = None

    async def _answer(self, stream: SocketStream) -> None:
        """Answer one HTTP request, then close: a GET of ``/metrics`` gets the metrics. A
        client that goes away or stalls is dropped; it never disturbs the worker."""
        async with stream:
            try:
                with anyio.fail_after(_REQUEST_TIMEOUT):
                    request = await _read_head(stream)
                    await stream.send(self._response(request))
            except (TimeoutError, OSError, anyio.EndOfStream, anyio.BrokenResourceError):
                return

    def _response(self, request: bytes) -> bytes:
        method, _, rest = request.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _http(b"405 Method Not Allowed", b"text/plain", b"GET only\n", method)
        if path != b"/metrics":
            return _http(b"404 Not Found", b"text/plain", b"the metrics are at /metrics\n", method)
        try:
            body = generate_latest(self.registry)
        except Exception as exc:  # a defect here must not end the worker
            log.error("writing the metrics failed", exc_info=exc)
            return _http(b"500 Internal Server Error", b"text/plain", b"see the log\n", method)
        return _http(b"200 OK", _CONTENT_TYPE, body, method)


async def _read_head(stream: SocketStream) -> bytes:
    request = b""
    while b"\r\n\r\n" not in request and b"\n\n" not in request:
        if len(request) > _MAX_REQUEST:
            break
        request += await stream.receive()
    return request


def _http(status: bytes, content_type: bytes, body: bytes, method: bytes) -> bytes:
    head = (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )
    return head if method == b"HEAD" else head + body


class ShardMetrics:
    """What one shard runner reports, for the life of its lease: when each op was dispatched,
    and what each step committed (to the worker's metrics, if served, and its activity)."""

    __slots__ = ("_activity", "_dispatched", "_metrics", "_number", "_shard")

    def __init__(
        self,
        metrics: Metrics | None,
        shard: str,
        activity: Activity | None = None,
        number: int = -1,
    ) -> None:
        self._metrics = metrics
        self._shard = shard
        self._activity = activity
        self._number = number
        #: op id -> (op label, when it was dispatched), until its outcome commits.
        self._dispatched: dict[str, tuple[str, float]] = {}

    def dispatched(self, runs: Sequence[Run]) -> None:
        """Ops that are about to run (not the ones answered from a stored outcome)."""
        if self._activity is not None:
            self._activity.ran(self._number, runs)
        if self._metrics is None or not runs:
            return
        now = time.monotonic()
        label = self._metrics.op_label
        for run in runs:
            self._dispatched[run.envelope.op_id] = (label(run.envelope.name), now)

    def stepped(self, batch: Sequence[Finished], dead: int, began: float) -> None:
        """A step script began at ``began`` (``time.monotonic``) has committed ``batch`` and
        ``dead`` dead letters. Counted: the ops this runner ran, ops it refused (malformed), and
        poison outcomes; not the stored outcomes it merely answered again."""
        if self._activity is not None:
            self._activity.committed(batch)
        metrics = self._metrics
        if metrics is None:
            return
        now = time.monotonic()
        shard = self._shard
        metrics.step[(shard,)].observe(now - began)
        if dead:
            metrics.dead_letters[shard, "malformed"] += dead
        committed = 0
        for finished in batch:
            if not finished.op_id:
                continue  # an entry dead-lettered whole (counted above)
            committed += 1
            name = self._ran(metrics, finished.op_id, now)
            if name is None:
                if not finished.store:
                    continue  # a stored outcome answered again
                name = UNKNOWN_OP  # refused before it ran (malformed, misrouted)
            metrics.ops[shard, name, outcome_class(finished.outcome)] += 1
        if committed:
            metrics.ops_per_step[(shard,)].observe(committed)

    def fired(self, due_ms: bytes) -> None:
        """A timer's entry (a delayed op, or a timer an op set) due at ``due_ms`` is taken in
        now: counted, and how late observed (by this process's clock against Redis's: on one
        machine they agree)."""
        metrics = self._metrics
        if metrics is None:
            return
        metrics.timers_fired[self._shard] += 1
        try:
            late = time.time() - int(due_ms) / 1000
        except ValueError:
            return
        metrics.timer_lateness.observe(max(0.0, late))

    def ended(self, op_id: str) -> None:
        """A grant request that ended with nothing to commit (a lent grant): counted as a
        committed one is."""
        metrics = self._metrics
        if metrics is not None and (name := self._ran(metrics, op_id, time.monotonic())):
            metrics.ops[self._shard, name, "ok"] += 1

    def _ran(self, metrics: Metrics, op_id: str, now: float) -> str | None:
        """The name of the op ``op_id`` dispatched here, its latency observed; None if it was
        not dispatched (refused before it ran, or answered from a stored outcome)."""
        ran = self._dispatched.pop(op_id, None)
        if ran is None:
            return None
        name, dispatched = ran
        metrics.latency[(name,)].observe(now - dispatched)
        return name


#: The runners' reporter when metrics are off: every hook returns at once.
NO_METRICS = ShardMetrics(None, "")


class _Collector:
    """Turns a :class:`Metrics` into metric families at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m, ns = self._m, self._m.namespace
        yield _counter(
            "keyserial_ops",
            "Ops committed, by op name and outcome.",
            ["shard", "op", "outcome"],
            m.ops,
            ns,
        )
        yield _histogram(
            "keyserial_op_latency_seconds",
            "Seconds from an op's dispatch to the commit of its outcome.",
            ["op"],
            m.latency,
            ns,
        )
        yield _histogram(
            "keyserial_step_duration_seconds",
            "Seconds of one step script's round trip (commit and fetch).",
            ["shard"],
            m.step,
            ns,
        )
        yield _histogram(
            "keyserial_ops_per_step",
            "Ops committed by one step (steps that commit none are not observed).",
            ["shard"],
            m.ops_per_step,
            ns,
        )
        yield _histogram(
            "keyserial_pipeline_calls",
            "Script calls sent in one pipeline.",
            [],
            {(): m.pipeline_calls},
            ns,
        )
        yield _counter(
            "keyserial_lease_renew_failures",
            "Lease renewals that failed (an error, no answer in time, or the lease was gone).",
            ["shard"],
            {(shard,): n for shard, n in m.renew_failures.items()},
            ns,
        )
        yield _counter(
            "keyserial_takeovers",
            "Shard leases acquired, by what the new owner had"
            " to do: clean, replay (look up outcomes) or careful (run the op blamed"
            " for a crash alone).",
            ["shard", "mode"],
            m.takeovers,
            ns,
        )
        yield _counter(
            "keyserial_dead_letters",
            "Entries or ops moved to a dead-letter stream, by reason: malformed or poison.",
            ["shard", "reason"],
            m.dead_letters,
            ns,
        )
        yield _counter(
            "keyserial_timers_fired",
            "Timers (delayed ops, and timers ops set) whose entries this worker took in.",
            ["shard"],
            {(shard,): n for shard, n in m.timers_fired.items()},
            ns,
        )
        yield _histogram(
            "keyserial_timer_lateness_seconds",
            "Seconds from a timer's due time to its entry's intake by the shard's owner.",
            [],
            {(): m.timer_lateness},
            ns,
        )
        yield from self._shard_gauges(ns)

    def _shard_gauges(self, ns: str) -> Iterator[Metric]:
        labels = ["namespace", "shard"]
        backlog = GaugeMetricFamily(
            "keyserial_shard_backlog_ops",
            "Ops this worker fetched from the shard's stream and has not committed yet.",
            labels=labels,
        )
        cached = GaugeMetricFamily(
            "keyserial_shard_cached_keys",
            "Keys whose state this worker holds in memory for the shard.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "keyserial_shard_timers_waiting",
            "Timers waiting on the shard, as its owner's last fetch read them.",
            labels=labels,
        )
        next_due = GaugeMetricFamily(
            "keyserial_shard_next_timer_seconds",
            "Seconds until the shard's next timer is due (shards with one waiting).",
            labels=labels,
        )
        owned = dict(self._m._owned())
        for shard, runner in sorted(owned.items()):
            backlog.add_metric([ns, str(shard)], runner.uncommitted)
            cached.add_metric([ns, str(shard)], len(runner.states))
            waiting.add_metric([ns, str(shard)], runner.timers.waiting)
            if (next_in := runner.timers.next_in) is not None:
                next_due.add_metric([ns, str(shard)], next_in)
        yield backlog
        yield cached
        yield waiting
        yield next_due
        yield _owned_gauge(ns, len(owned))


def _owned_gauge(ns: str, count: int) -> Metric:
    gauge = GaugeMetricFamily(
        "keyserial_shards_owned", "Shards whose lease this worker holds.", labels=["namespace"]
    )
    gauge.add_metric([ns], count)
    return gauge


def _counter(name: str, text: str, labels: list[str], values: Mapping[Any, int], ns: str) -> Metric:
    family = CounterMetricFamily(name, text, labels=["namespace", *labels])
    return _samples(family, ns, {key: (value,) for key, value in values.items()})


def _histogram(
    name: str, text: str, labels: list[str], values: Mapping[Any, _Histogram], ns: str
) -> Metric:
    family = HistogramMetricFamily(name, text, labels=["namespace", *labels])
    return _samples(family, ns, {key: (h.buckets(), h.total) for key, h in values.items()})


def _samples(
    family: CounterMetricFamily | HistogramMetricFamily,
    ns: str,
    samples: Mapping[Any, tuple[Any, ...]],
) -> Metric:
    """``family`` with one sample per label key, in label order."""
    for key, sample in sorted(samples.items()):
        family.add_metric([ns, *_labels(key)], *sample)
    return family


def _labels(key: Any) -> list[str]:
    return list(key) if isinstance(key, tuple) else [key]
