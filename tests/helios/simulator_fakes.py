"""A deliberately simple scheduler that follows the public Scheduler API.

It exists only to test the simulator's own mechanics (clock, frame order,
publication, admission, acceptance sampling) independently of the real
policy. Its rule: prefill waiting prompts first, one per frame and only with an
empty queue; otherwise put every decoder that is not already queued into the
widest generation graph, keeping at most two frames queued.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.scheduler.types import (
    GeneratedToken,
    LanePhase,
    PlannedLane,
    RequestHandle,
    ScheduledPlan,
    SelectionReason,
)


@dataclass(slots=True)
class FakeRequest:
    prompt_left: int
    max_tokens: int
    produced: int = 0
    queued: bool = False


@dataclass(slots=True)
class FakeScheduler:
    graphs: tuple[GraphDescriptor, ...]
    request_slots: int
    now: int = 0
    requests: dict[RequestHandle, FakeRequest] = field(default_factory=dict)
    queue: deque = field(default_factory=deque)
    calls: list[tuple] = field(default_factory=list)  # (method, now, details)
    next_slot: int = 0
    last_fence: int = 0
    never_plan: bool = False

    def admit(self, request) -> RequestHandle:
        if len(self.requests) >= self.request_slots:
            raise ValueError("no free request slot")
        handle = RequestHandle(slot=self.next_slot % self.request_slots, generation=self.next_slot)
        self.next_slot += 1
        self.requests[handle] = FakeRequest(request.prompt_tokens, request.max_tokens)
        self.calls.append(("admit", self.now, handle))
        return handle

    def advance_to(self, now_ns: int) -> None:
        assert now_ns >= self.now, "the clock went backwards"
        self.now = now_ns

    def observe_duration(self, graph_id: str, device_ns: int) -> None:
        self.calls.append(("observe_duration", self.now, (graph_id, device_ns)))

    def plan(self) -> ScheduledPlan | None:
        if self.never_plan or len(self.queue) >= 2:
            return None
        prompt = next(((h, r) for h, r in self.requests.items() if r.prompt_left), None)
        if prompt is not None:
            return None if self.queue else self._prefill_plan(*prompt)
        decoders = [h for h, r in self.requests.items() if not r.queued]
        return self._decode_plan(decoders) if decoders else None

    def _prefill_plan(self, handle: RequestHandle, request: FakeRequest) -> ScheduledPlan:
        graph = next(g for g in self.graphs if g.kind is GraphKind.PREFILL)
        take = min(request.prompt_left, graph.prefill_capacity)
        lane = PlannedLane(handle, LanePhase.PROMPT, prompt_tokens=take, finishes_prompt=take == request.prompt_left)
        return ScheduledPlan(graph, (lane,), SelectionReason.ORDINARY, 0, 0.0, 0.0)

    def _decode_plan(self, decoders: list[RequestHandle]) -> ScheduledPlan:
        graph = max((g for g in self.graphs if g.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE)), key=lambda g: g.width)
        lanes = tuple(
            PlannedLane(h, LanePhase.DECODE, query_length=graph.width, ceiling=graph.width)
            for h in decoders[: graph.batch_capacity]
        )
        return ScheduledPlan(graph, lanes, SelectionReason.ORDINARY, 1_000_000, 0.0, 0.0)

    def commit(self, plan: ScheduledPlan, fence: int) -> None:
        assert fence > self.last_fence, "fences must increase"
        self.last_fence = fence
        for lane in plan.lanes:
            if lane.phase is LanePhase.DECODE:
                self.requests[lane.handle].queued = True
        self.queue.append((fence, plan))
        self.calls.append(("commit", self.now, fence))

    def complete(self, fence, records, timing) -> list[GeneratedToken]:
        expected, plan = self.queue.popleft()
        assert fence == expected, "completions must arrive in commit order"
        self.calls.append(("complete", self.now, (fence, tuple(records), timing)))
        return [self._complete_lane(fence, record) for record in records]

    def complete_packed_round(self, fence, records, timing, confidence) -> list[GeneratedToken]:
        self.calls.append(("complete_packed_round", self.now, (fence, confidence)))
        return self.complete(fence, records, timing)

    def _complete_lane(self, fence: int, record) -> GeneratedToken:
        request = self.requests[record.handle]
        request.prompt_left -= record.prompt_consumed
        request.produced += len(record.tokens)
        request.queued = False
        finished = request.produced >= request.max_tokens
        if finished:
            del self.requests[record.handle]
        return GeneratedToken(record.handle, fence, record.tokens, finished, "length" if finished else None)

    def published_output(self, handle: RequestHandle, fence: int) -> None:
        self.calls.append(("published_output", self.now, (handle, fence)))

    def called(self, method: str) -> list[tuple]:
        return [(now, details) for name, now, details in self.calls if name == method]
