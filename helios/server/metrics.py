"""``/metrics``: Prometheus families measured by the server plus those pulled from the engine.

The server measures what it sees: requests by outcome, prompt and generated
tokens, time to first token and the gaps between deliveries, and per finished
request its latency split at the two moments the server can observe (the
hand-off to the engine and the first output token) and its token counts.
Every family carries a ``model_name`` label, as vLLM's do. Everything the
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

from helios.runtime.engine_api import EngineStats

CATEGORIES = ("ordinary", "discovery", "timing_refresh", "acceptance_learning")  # spec D9, SelectionReason values
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
FINISH_OUTCOMES = ("stop", "length", "abort")  # FinishReason values: the request ran to an end the engine chose
MODEL = ["model_name"]
ABORT_REASONS = ("client_gone", "shutdown_drain")


class EngineCollector(Collector):
    """Turns one ``EngineStats`` snapshot into metric families at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        stats, model = self._stats(), self._model
        yield _gauge("flare_requests_running", "Requests admitted and holding a slot.", model, stats.requests_running)
        yield _gauge("flare_requests_waiting", "Requests submitted and not yet admitted.", model, stats.requests_waiting)
        yield _gauge("flare_kv_pages_used", "KV cache pages held by requests.", model, stats.kv_pages_used)
        yield _gauge("flare_kv_pages_free", "KV cache pages free.", model, stats.kv_pages_free)
        yield _shed_family(stats, model)
        yield _preemption_family(model)
        yield from _execution_families(stats, model)
        yield from _speculative_families(stats, model)
        yield from _checkpoint_families(stats, model)


def _checkpoint_families(stats: EngineStats, model: str) -> Iterable[Metric]:
    """Prefix reuse (docs/checkpoints.md): lookups that restored or found nothing, tokens restored,
    snapshots published, checkpoints evicted, and what the store holds now."""
    c = stats.checkpoints
    for name, documentation, value in (
            ("flare_prefix_cache_hits", "Admissions that restored a retained checkpoint.", c.hits),
            ("flare_prefix_cache_misses", "Admissions (with a checkpoint store) that found no checkpoint.", c.misses),
            ("flare_prefix_cache_cached_tokens", "Prompt tokens restored from checkpoints instead of prefilled.",
             c.cached_tokens),
            ("flare_checkpoint_captures", "Snapshots published into the checkpoint store.", c.captures),
            ("flare_checkpoint_evictions", "Checkpoints given up for a new one (K3).", c.evictions)):
        family = CounterMetricFamily(name, documentation, labels=MODEL)
        family.add_metric([model], value)
        yield family
    yield _gauge("flare_checkpoint_rows", "Checkpoint rows the catalog keeps (0: no store or prefix reuse off).",
                 model, c.rows)
    yield _gauge("flare_checkpoint_rows_held", "Checkpoint rows holding a published checkpoint.", model, c.held)
    yield _gauge("flare_checkpoint_bytes", "Memory of the checkpoint rows holding a checkpoint.", model, c.bytes_held)


def _gauge(name: str, documentation: str, model: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=MODEL)
    gauge.add_metric([model], value)
    return gauge


def _shed_family(stats: EngineStats, model: str) -> Metric:
    shed = CounterMetricFamily("flare_requests_shed_total", "Requests turned away under load before they got a slot "
                               "(503): the waiting line was full (--max-waiting) or they waited too long (--queue-timeout).",
                               labels=[*MODEL, "reason"])
    shed.add_metric([model, "waiting_full"], stats.shed_waiting_full)
    shed.add_metric([model, "queue_timeout"], stats.shed_queue_timeout)
    return shed


def _preemption_family(model: str) -> Metric:
    # vLLM's dashboards read a preemption counter; Helios has no preemption to count, and says so.
    family = CounterMetricFamily(
        "flare_num_preemptions_total", "Running requests preempted (their KV pages taken back before they ended). "
        "Helios never preempts: an admitted request keeps its slot and pages until it finishes, is cancelled or is "
        "aborted, so this stays 0; aborts are in flare_request_aborts_total.", labels=MODEL)
    family.add_metric([model], 0)
    return family


def _execution_families(stats: EngineStats, model: str) -> Iterable[Metric]:
    labels = [*MODEL, "graph_kind", "category"]
    count = CounterMetricFamily("flare_scheduler_executions_total", "Executed programs by graph kind and selection category (spec D9).", labels=labels)
    nanos = CounterMetricFamily(
        "flare_scheduler_execution_nanoseconds_total", "Device nanoseconds of executed programs by graph kind and selection category (spec D9).", labels=labels)
    seen = {(t.graph_kind, t.category): t for t in stats.executions}
    # Every category appears for every graph kind seen, so rate() works before the first refresh.
    for kind in sorted({t.graph_kind for t in stats.executions}):
        for category in CATEGORIES:
            totals = seen.get((kind, category))
            count.add_metric([model, kind, category], totals.executions if totals else 0)
            nanos.add_metric([model, kind, category], totals.nanoseconds if totals else 0)
    return count, nanos


def _speculative_families(stats: EngineStats, model: str) -> Iterable[Metric]:
    """Per proposal source, over complete speculative programs only (never producer and target apart)."""
    rows = (
        ("flare_speculative_rounds_total", "Lane rounds of complete speculative programs that verified drafts.", "rounds"),
        ("flare_speculative_draft_tokens_total", "Draft tokens offered for verification.", "draft_tokens"),
        ("flare_speculative_accepted_tokens_total", "Draft tokens the target accepted.", "accepted_tokens"),
        ("flare_speculative_emitted_tokens_total", "Tokens committed by speculative rounds: accepted drafts plus one.", "emitted_tokens"),
    )
    families = []
    for name, doc, attribute in rows:
        family = CounterMetricFamily(name, doc, labels=[*MODEL, "source"])
        for totals in stats.speculative:
            family.add_metric([model, totals.source], getattr(totals, attribute))
        families.append(family)
    per_position = CounterMetricFamily(
        "flare_speculative_accepted_per_position_total",
        "Rounds whose draft at this position (1 = first after the pending token) was accepted.",
        labels=[*MODEL, "source", "position"])
    for totals in stats.speculative:
        for index, count in enumerate(totals.accepted_by_position):
            per_position.add_metric([model, totals.source, str(index + 1)], count)
    return [*families, per_position]


class ServerMetrics:
    """The server's own families and the engine collector, in one registry, all labelled ``model_name``."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.model_name = model_name
        registry = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("flare_requests", "Finished HTTP generation requests by endpoint and outcome.",
                                [*MODEL, "endpoint", "outcome"], registry=registry)
        self.prompt_tokens = self._counter("flare_prompt_tokens", "Prompt tokens of accepted generation requests.")
        self.generation_tokens = self._counter("flare_generation_tokens", "Output tokens delivered to clients.")
        self.aborts = Counter(
            "flare_request_aborts", "Requests that ended before the engine finished them: reason client_gone (the client "
            "disconnected or stopped reading its stream; the server cancelled the request) or shutdown_drain (a drain's "
            "grace ran out and the engine ended it with finish reason abort).", [*MODEL, "reason"], registry=registry)
        for reason in ABORT_REASONS:  # both series from the start, so rate() works before the first abort
            self.aborts.labels(model_name, reason)
        self.ttft = self._histogram(
            "flare_time_to_first_token_seconds", "From request arrival to the first delivered output text.", TTFT_BUCKETS)
        self.inter_token = self._histogram(
            "flare_inter_token_seconds", "Gap between successive deliveries of output tokens (a burst counts once).", GAP_BUCKETS)
        self.e2e = self._histogram(
            "flare_e2e_request_latency_seconds", "Finished requests (finish reason stop, length or abort): from the "
            "request's arrival at the server to its last delta from the engine.", PHASE_BUCKETS)
        self.queue_time = self._histogram(
            "flare_request_queue_time_seconds", "Finished requests: from arrival to the hand-off to the engine (reading "
            "the body, validation, tokenization). The engine's wait for a slot is not visible to the server and is "
            "counted in flare_request_prefill_time_seconds.", PHASE_BUCKETS)
        self.prefill_time = self._histogram(
            "flare_request_prefill_time_seconds", "Finished requests that produced output: from the hand-off to the "
            "engine to the first output token, that is the wait for a slot plus the prompt's prefill.", PHASE_BUCKETS)
        self.decode_time = self._histogram(
            "flare_request_decode_time_seconds", "Finished requests that produced output: from the first output token "
            "to the last delta from the engine.", PHASE_BUCKETS)
        self.request_prompt_tokens = self._histogram(
            "flare_request_prompt_tokens", "Finished requests: prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = self._histogram(
            "flare_request_generation_tokens", "Finished requests: output tokens per request (EOS included).", TOKEN_BUCKETS)
        registry.register(EngineCollector(stats, model_name))

    def _counter(self, name: str, documentation: str):
        return Counter(name, documentation, MODEL, registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]):
        return Histogram(name, documentation, MODEL, buckets=buckets, registry=self.registry).labels(self.model_name)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def finished(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(model_name=self.model_name, endpoint=endpoint, outcome=outcome).inc()

    def aborted(self, reason: str) -> None:
        self.aborts.labels(model_name=self.model_name, reason=reason).inc()

    def completed(self, clock: DeliveryClock, prompt_tokens: int, output_tokens: int) -> None:
        """One request that reached a finish reason: its latency phases and token counts."""
        end = clock.last if clock.last is not None else time.perf_counter()
        submitted = clock.submitted if clock.submitted is not None else clock.arrived
        self.e2e.observe(end - clock.arrived)
        self.queue_time.observe(submitted - clock.arrived)
        if clock.first is not None:
            self.prefill_time.observe(clock.first - submitted)
            self.decode_time.observe(end - clock.first)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(output_tokens)

    def totals(self) -> tuple[float, float]:
        """Prompt tokens accepted and output tokens delivered since start (for the periodic stats line)."""
        labels = {"model_name": self.model_name}
        prompt = self.registry.get_sample_value("flare_prompt_tokens_total", labels) or 0.0
        generated = self.registry.get_sample_value("flare_generation_tokens_total", labels) or 0.0
        return prompt, generated


@dataclass(slots=True)
class DeliveryClock:
    """One request's moments as the server sees them, feeding the latency histograms.

    ``arrived``: the route began; ``submitted``: the engine accepted it;
    ``first`` / ``last``: the first and latest delta carrying tokens, or the
    final delta (which may carry none) for ``last``.
    """

    metrics: ServerMetrics
    arrived: float = field(default_factory=time.perf_counter)
    submitted: float | None = None
    first: float | None = None
    last: float | None = None

    def handed_over(self) -> None:
        self.submitted = time.perf_counter()

    def delivered(self, tokens: int) -> None:
        if tokens <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.inter_token.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(tokens)

    def ended(self) -> None:
        """The final delta arrived (it may carry no token: the end of a stop-string hold)."""
        self.last = time.perf_counter()

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.arrived
