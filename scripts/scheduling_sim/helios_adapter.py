"""The real ``helios.scheduler.Scheduler`` behind the baseline interface.

The report runs Helios through ``helios.sim.simulator`` itself. This adapter runs
the same scheduler through this package's driver, the way ``helios.sim.simulator``
drives it (measured catalog at time zero, admission while a slot is free,
plan/commit until it declines, complete then publish), so a test can check
that the driver's device model and the simulator's agree on a trace.
Device-allocated (prefix-limit) rounds and preseeded acceptance are the
simulator's alone; the adapter refuses them.
"""

from __future__ import annotations

from collections import deque

from helios.scheduler import AdmitRequest, CompletionRecord, ExecutionTiming, RequestHandle, Scheduler
from helios.scheduler.config import PolicyConfig
from helios.sim.files import SyntheticCatalog
from scripts.scheduling_sim.interface import Frame, FrameDone, Lane, LaneResult, Stream


class HeliosAdapter:
    name = "helios"

    def __init__(self, catalog: SyntheticCatalog, policy: PolicyConfig):
        self.scheduler = Scheduler(catalog.descriptors(), request_slots=catalog.request_slots, policy=policy)
        self.scheduler.advance_to(0)
        for graph in catalog.graphs:  # a measured synthetic catalog, as ``flare simulate`` without --cold
            self.scheduler.observe_duration(graph.descriptor.id, graph.duration_ns)
        self.slots = catalog.request_slots
        self.active = 0
        self.streams: dict[RequestHandle, Stream] = {}
        self.handles: dict[int, RequestHandle] = {}  # id(stream) -> its handle
        self.fences: deque[int] = deque()  # committed, not yet completed
        self.fence = 0

    def admit(self, stream: Stream, now_ns: int) -> bool:
        if stream.spec.preseed_acceptance:
            raise ValueError(f"request {stream.spec.id!r}: preseed_acceptance runs only in helios.sim.simulator")
        self.scheduler.advance_to(now_ns)
        if self.active >= self.slots:
            return False
        spec = stream.spec
        admit = AdmitRequest(spec.prompt_tokens, spec.max_tokens, spec.prompt_tokens + spec.max_tokens,
                             proposal_sources=(spec.proposal_source,))
        try:
            handle = self.scheduler.admit(admit)
        except ValueError:
            return False  # finished requests hold their slots until their last frame completes (spec A1)
        self.streams[handle] = stream
        self.handles[id(stream)] = handle
        self.active += 1
        return True

    def plan(self, now_ns: int) -> Frame | None:
        self.scheduler.advance_to(now_ns)
        plan = self.scheduler.plan()
        if plan is None:
            return None
        if plan.graph.is_prefix_limit:
            raise ValueError(f"{plan.graph.id}: device-allocated rounds run only in helios.sim.simulator")
        self.fence += 1
        self.scheduler.commit(plan, self.fence)
        self.fences.append(self.fence)
        lanes = tuple(Lane(self.streams[lane.handle], lane.prompt_tokens, lane.query_length) for lane in plan.lanes)
        return Frame(plan.graph, lanes)

    def complete(self, done: FrameDone) -> None:
        self.scheduler.advance_to(done.end_ns)
        fence = self.fences.popleft()
        records = [self._record(result) for result in done.results]
        timing = ExecutionTiming(device_ns=done.duration_ns, wall_ns=done.duration_ns)
        for token in self.scheduler.complete(fence, records, timing):
            if token.tokens:
                self.scheduler.published_output(token.handle, fence)
            if token.finished:
                self.active -= 1

    def _record(self, result: LaneResult) -> CompletionRecord:
        stream = result.lane.stream
        tokens = tuple(range(stream.produced - result.tokens, stream.produced))
        return CompletionRecord(self.handles[id(stream)], prompt_consumed=result.prompt_consumed,
                                tokens=tokens, offered=result.offered)
