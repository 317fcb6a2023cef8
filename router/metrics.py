"""Every Prometheus object of the router, on its own registry; the only prometheus_client importer in router/."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from router.decider import DeciderStats
from router.kv_events.view import KvEventReport
from router.tracing.exemplars import ExemplarGate

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Router metrics. Labels are bounded: endpoint, mode, outcome, leg, role, kind and configured workers."""

    def __init__(self, *, exemplars: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.exemplars = exemplars  # OpenMetrics exposition on request (the trace-id exemplars): tracing on
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.exemplar_gate = ExemplarGate(_LATENCY_BUCKETS)  # one exemplar per bucket per second (its docstring)
        r = self.registry
        self.requests = Counter(
            "kvpush_requests",
            "Client requests finished, by endpoint, mode and outcome.",
            ["endpoint", "mode", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvpush_ttft_seconds",
            "Router-side time from request arrival to the first relayed byte.",
            ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvpush_e2e_seconds",
            "Router-side time from request arrival to the last relayed byte.",
            ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.leg = Histogram(
            "kvpush_leg_seconds",
            "Duration of one upstream leg (prefill: to its answer; decode: to its end).",
            ["leg", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.handoff = Histogram(
            "kvpush_handoff_seconds",
            "KV handoff: prefill leg answered to decode's first byte.",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvpush_worker_in_flight",
            "Requests in flight through this router, per worker.",
            ["role", "worker"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvpush_worker_healthy", "1 when the worker passes health checks, else 0.", ["role", "worker"], registry=r
        )
        self.errors = Counter(
            "kvpush_errors",
            "Errors by kind (bad_request, connect, timeout, status, protocol, no_worker, ...).",
            ["kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvpush_retries", "Dispatch attempts retried with fresh ids, by the leg that failed.", ["leg"], registry=r
        )
        self.decode_ttft = Histogram(
            "kvpush_decode_ttft_seconds",
            "Router-side time to first byte, by mode and decode worker.",
            ["mode", "worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pool_members = Gauge("kvpush_pool_members", "Workers in the pool, by role.", ["role"], registry=r)
        self.pool_healthy = Gauge("kvpush_pool_healthy", "Healthy workers in the pool, by role.", ["role"], registry=r)
        self.ejections = Counter(
            "kvpush_ejections", "Workers taken out of rotation after failures, by role.", ["role"], registry=r
        )
        self.in_flight_total = Gauge("kvpush_in_flight", "Client requests in flight.", registry=r)
        self.queued = Gauge("kvpush_admission_queued", "Client requests waiting for admission.", registry=r)
        self.rejected = Counter(
            "kvpush_admission_rejected", "Client requests refused with 429 (admission bound reached).", registry=r
        )
        self.scrape_errors = Counter(
            "kvpush_scrape_errors", "Failed scrapes of a worker's /metrics, by role.", ["role"], registry=r
        )
        self.discovery_errors = Counter(
            "kvpush_discovery_errors", "Failed discovery lookups (DNS, Kubernetes API), by role.", ["role"], registry=r
        )
        self.draining = Gauge("kvpush_draining", "1 while the router drains before it exits.", registry=r)
        self.decisions = Counter(
            "kvpush_decisions", "Dispatch attempts by the route the P/D decider chose.", ["route"], registry=r
        )
        self.loop_errors = Counter(
            "kvpush_loop_errors",
            "Errors that ended a background loop (it is restarted), by loop.",
            ["loop"],
            registry=r,
        )

    def watch_decider(self, stats: Callable[[], DeciderStats | None]) -> None:
        """Exports a decider's index figures, read at scrape time (nothing for the "none" decider)."""
        self.registry.register(_DeciderCollector(stats))

    def watch_kv_events(self, report: Callable[[], KvEventReport]) -> None:
        """Exports the KV-event subscriber's counters and each worker's view, read at scrape time."""
        self.registry.register(_KvEventCollector(report))

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, bound once: the hot path looks children up in a dict, not through
        prometheus_client's locked label resolution (labels are bounded, so the dict is too)."""
        key = (id(metric), labels)
        bound = self._children.get(key)
        if bound is None:
            bound = self._children[key] = metric.labels(*labels)
        return bound

    def observe(self, series: Any, value: float, exemplar: dict[str, str] | None) -> None:
        """A latency observation on a histogram child (`child`); a traced one's exemplar goes with it when the
        gate admits it (router/tracing/exemplars.py: one per bucket per second), else it is observed plain."""
        if exemplar is not None and self.exemplar_gate.admit(series, value):
            series.observe(value, exemplar)
        else:
            series.observe(value)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The Prometheus text exposition; OpenMetrics (with the exemplars: trace ids on the TTFT and handoff
        histograms) when exemplars are on (tracing) and the scraper asks for it, as Prometheus does."""
        if self.exemplars and "application/openmetrics-text" in accept:
            page: bytes = openmetrics_latest(self.registry)  # type: ignore[no-untyped-call]
            return page, OPENMETRICS_CONTENT_TYPE
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _DeciderCollector(Collector):
    """kvpush_decider_*: the P/D decider's prefix index, sessions and the accuracy of its bypass predictions."""

    def __init__(self, stats: Callable[[], DeciderStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        links = GaugeMetricFamily("kvpush_decider_index_links", "Prefix-index links held, by role.", labels=["role"])
        for role, n in sorted(s.index_links.items()):
            links.add_metric([role], n)
        yield links
        yield GaugeMetricFamily("kvpush_decider_sessions", "Sessions in the session table.", value=s.sessions)
        evictions = CounterMetricFamily(
            "kvpush_decider_evictions", "Index entries dropped, by table and cause.", labels=["table", "cause"]
        )
        for key, n in sorted(s.evictions.items()):
            table, _, cause = key.partition("/")
            evictions.add_metric([table, cause], n)
        yield evictions
        for name, help_text, value in (
            (
                "kvpush_bypass_predicted_cached_tokens",
                "Cached tokens predicted by checked bypasses.",
                s.predicted_cached_tokens,
            ),
            (
                "kvpush_bypass_actual_cached_tokens",
                "Cached tokens the engine reported for them.",
                s.actual_cached_tokens,
            ),
            ("kvpush_bypass_checked", "Bypass decisions whose usage reported cached tokens.", s.checked_bypasses),
            (
                "kvpush_bypass_accurate",
                "Checked bypasses predicted within 20 % of the actual uncached tokens.",
                s.accurate_bypasses,
            ),
            (
                "kvpush_decider_answers_checked",
                "Relayed answers whose re-tokenization decode reported.",
                s.answers_checked,
            ),
            (
                "kvpush_decider_answers_short",
                "Checked answers that re-tokenized to fewer generated tokens than first credited.",
                s.answers_short,
            ),
            (
                "kvpush_decider_event_decisions",
                "Decode picks judged by a caught-up KV-event view.",
                s.event_decisions,
            ),
            (
                "kvpush_decider_event_corrections",
                "Learned prefix matches the KV events cut down (evicted, restarted).",
                s.event_corrections,
            ),
            (
                "kvpush_decider_event_matches",
                "Prefix matches only the KV events knew of (another replica routed the session).",
                s.event_matches,
            ),
            (
                "kvpush_decider_event_answer_checks",
                "Answers another replica relayed, checked against the engine's stored token ids before a bypass.",
                s.event_answer_checks,
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
        yield GaugeMetricFamily(
            "kvpush_decider_tokens_per_char", "Learned prompt tokens per character.", value=s.tokens_per_char
        )
        yield GaugeMetricFamily(
            "kvpush_decider_answers_trusted",
            "1 while relayed answers are credited as cached.",
            value=1.0 if s.answers_trusted else 0.0,
        )


_KV_COUNTERS = {  # counter group of subscriber.counters() -> (metric, help)
    "frames": ("kvpush_kv_events_frames", "KV-event messages by what happened to them (messages: live ones)."),
    "sequence": ("kvpush_kv_events_sequence", "KV-event sequence events: gaps, replays, holes, restarts, ..."),
    "index": ("kvpush_kv_events_blocks", "KV-event blocks by what the index did with them (stored, removed, ...)."),
    "layout": ("kvpush_kv_events_layouts", "KV-event batches by the frame layout they used."),
}


class _KvEventCollector(Collector):
    """kvpush_kv_events_*: what the subscriber consumed, and per worker whether its view is caught up."""

    def __init__(self, report: Callable[[], KvEventReport]) -> None:
        self._report = report

    def collect(self) -> Iterator[Metric]:
        r = self._report()
        families = {
            group: CounterMetricFamily(name, text, labels=["kind"]) for group, (name, text) in _KV_COUNTERS.items()
        }
        gauges = {}
        for key, value in sorted(r.counters.items()):
            group, _, kind = key.partition(".")
            if group in families:
                families[group].add_metric([kind], value)
            else:
                gauges[key] = value
        yield from families.values()
        yield GaugeMetricFamily("kvpush_kv_events_streams", "Publishers followed.", value=gauges.get("streams", 0))
        yield GaugeMetricFamily(
            "kvpush_kv_events_streams_caught_up",
            "Publishers whose view is caught up (in sync, history complete).",
            value=gauges.get("streams_caught_up", 0),
        )
        caught_up = GaugeMetricFamily(
            "kvpush_kv_events_caught_up", "1 when every rank of the worker is caught up.", labels=["worker"]
        )
        held = GaugeMetricFamily("kvpush_kv_events_held_blocks", "Blocks the worker's engine holds.", labels=["worker"])
        for worker, (up, blocks) in sorted(r.workers.items()):
            caught_up.add_metric([worker], 1.0 if up else 0.0)
            held.add_metric([worker], blocks)
        yield caught_up
        yield held
