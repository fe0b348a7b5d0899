"""``/metrics``: Prometheus families measured by the server plus those pulled from the engine.

The server measures what it sees: requests by outcome, prompt and generated
tokens, time to first token and the gaps between deliveries. Everything the
engine knows (running/waiting requests, KV pages, executions by graph kind and
selection category, speculative totals) is *pulled* on each scrape from
``engine.stats()`` by ``EngineCollector``; the engine pushes nothing and needs
no Prometheus code. Each app has its own registry, so several servers can live
in one process (tests do).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from helios.engine_api import EngineStats

CATEGORIES = ("ordinary", "discovery", "timing_refresh", "acceptance_learning")  # spec D9, SelectionReason values
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EngineCollector(Collector):
    """Turns one ``EngineStats`` snapshot into metric families at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        yield _gauge("flare_requests_running", "Requests admitted and holding a slot.", stats.requests_running)
        yield _gauge("flare_requests_waiting", "Requests submitted and not yet admitted.", stats.requests_waiting)
        yield _gauge("flare_kv_pages_used", "KV cache pages held by requests.", stats.kv_pages_used)
        yield _gauge("flare_kv_pages_free", "KV cache pages free.", stats.kv_pages_free)
        yield _shed_family(stats)
        yield from _execution_families(stats)
        yield from _speculative_families(stats)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _shed_family(stats: EngineStats) -> Metric:
    shed = CounterMetricFamily("flare_requests_shed_total", "Requests turned away under load before they got a slot "
                               "(503): the waiting line was full (--max-waiting) or they waited too long (--queue-timeout).",
                               labels=["reason"])
    shed.add_metric(["waiting_full"], stats.shed_waiting_full)
    shed.add_metric(["queue_timeout"], stats.shed_queue_timeout)
    return shed


def _execution_families(stats: EngineStats) -> Iterable[Metric]:
    labels = ["graph_kind", "category"]
    count = CounterMetricFamily("flare_scheduler_executions_total", "Executed programs by graph kind and selection category (spec D9).", labels=labels)
    nanos = CounterMetricFamily(
        "flare_scheduler_execution_nanoseconds_total", "Device nanoseconds of executed programs by graph kind and selection category (spec D9).", labels=labels)
    seen = {(t.graph_kind, t.category): t for t in stats.executions}
    # Every category appears for every graph kind seen, so rate() works before the first refresh.
    for kind in sorted({t.graph_kind for t in stats.executions}):
        for category in CATEGORIES:
            totals = seen.get((kind, category))
            count.add_metric([kind, category], totals.executions if totals else 0)
            nanos.add_metric([kind, category], totals.nanoseconds if totals else 0)
    return count, nanos


def _speculative_families(stats: EngineStats) -> Iterable[Metric]:
    """Per proposal source, over complete speculative programs only (never producer and target apart)."""
    rows = (
        ("flare_speculative_rounds_total", "Lane rounds of complete speculative programs that verified drafts.", "rounds"),
        ("flare_speculative_draft_tokens_total", "Draft tokens offered for verification.", "draft_tokens"),
        ("flare_speculative_accepted_tokens_total", "Draft tokens the target accepted.", "accepted_tokens"),
        ("flare_speculative_emitted_tokens_total", "Tokens committed by speculative rounds: accepted drafts plus one.", "emitted_tokens"),
    )
    families = []
    for name, doc, attribute in rows:
        family = CounterMetricFamily(name, doc, labels=["source"])
        for totals in stats.speculative:
            family.add_metric([totals.source], getattr(totals, attribute))
        families.append(family)
    per_position = CounterMetricFamily(
        "flare_speculative_accepted_per_position_total",
        "Rounds whose draft at this position (1 = first after the pending token) was accepted.", labels=["source", "position"])
    for totals in stats.speculative:
        for index, count in enumerate(totals.accepted_by_position):
            per_position.add_metric([totals.source, str(index + 1)], count)
    return [*families, per_position]


class ServerMetrics:
    """The server's own families and the engine collector, in one registry."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("flare_requests", "Finished HTTP generation requests by endpoint and outcome.", ["endpoint", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("flare_prompt_tokens", "Prompt tokens of accepted generation requests.", registry=self.registry)
        self.generation_tokens = Counter("flare_generation_tokens", "Output tokens delivered to clients.", registry=self.registry)
        self.ttft = Histogram(
            "flare_time_to_first_token_seconds", "From request arrival to the first delivered output text.", buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token = Histogram(
            "flare_inter_token_seconds", "Gap between successive deliveries of output tokens (a burst counts once).", buckets=GAP_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(stats))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def finished(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()


@dataclass(slots=True)
class DeliveryClock:
    """One request's delivery times, feeding the TTFT and inter-token histograms."""

    metrics: ServerMetrics
    arrived: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def delivered(self, tokens: int) -> None:
        if tokens <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.inter_token.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(tokens)
