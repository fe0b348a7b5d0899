"""A tiny discrete-event driver of the real Scheduler for the scheduler's own tests.

The simulator (helios/sim/simulator.py) is the full test bed; this keeps the
scheduler tests independent of it. Frames run back to back on one device:
each starts when it is committed or when the previous one ends, whichever is
later, and lasts its graph's synthetic duration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helios.scheduler import (
    AdmitRequest,
    CompletionRecord,
    ExecutionTiming,
    GraphDescriptor,
    GraphKind,
    LanePhase,
    PolicyConfig,
    Scheduler,
    ValueSource,
)

MS = 1_000_000
# A7's second frame slot whatever the completions' host time: these harnesses complete frames with wall
# time equal to device time, which the default reads as "no host time to hide" and then plans only into
# an empty queue (``PolicyConfig.queue_ahead_by_host_time``). Tests of the queue's own rules use this.
QUEUE_AHEAD = PolicyConfig(queue_ahead_by_host_time=0)


def prefill(cap: int, batch: int = 1) -> GraphDescriptor:
    return GraphDescriptor(f"prefill_b{batch}_c{cap}", GraphKind.PREFILL, batch, prefill_capacity=cap)


def decode(batch: int) -> GraphDescriptor:
    return GraphDescriptor(f"decode_b{batch}", GraphKind.DECODE, batch)


def spec(batch: int, width: int, depth: int | None = None, aggregate: int = 0, source: ValueSource | None = None,
         proposal: str = "learned") -> GraphDescriptor:
    depth = width - 1 if depth is None else depth
    ragged = bool(aggregate) and aggregate != batch * width
    return GraphDescriptor(
        f"spec_b{batch}_w{width}_d{depth}_p{aggregate or batch * width}_{source.value if source else 'rect'}",
        GraphKind.SPECULATIVE, batch, proposal_depth=depth, width=width, aggregate=aggregate,
        ragged=ragged, value_source=source, proposal_source=proposal,
    )


def mixed(batch: int, cap: int, width: int = 1, depth: int = 0) -> GraphDescriptor:
    return GraphDescriptor(f"mixed_b{batch}_c{cap}_w{width}", GraphKind.MIXED, batch, proposal_depth=depth,
                           width=width, prefill_capacity=cap,
                           proposal_source="learned" if depth else None)


def measured(durations: dict[GraphDescriptor, float], *, slots: int = 16, policy: PolicyConfig | None = None,
             cold: tuple[GraphDescriptor, ...] = ()) -> Scheduler:
    """A Scheduler whose catalog was measured once at t=0 (durations in ms), except ``cold`` graphs."""
    s = Scheduler(list(durations), request_slots=slots, policy=policy)
    for g, ms in durations.items():
        if g not in cold:
            s.observe_duration(g.id, int(ms * MS))
    return s


def ask(prompt: int = 64, max_tokens: int = 64, *, context: int = 1 << 20, sources=(), endpoints=()) -> AdmitRequest:
    return AdmitRequest(prompt_tokens=prompt, max_tokens=max_tokens, context_limit=context,
                        proposal_sources=tuple(sources), endpoints=tuple(endpoints))


@dataclass
class Executed:
    fence: int
    plan: object
    start_ms: float
    end_ms: float


@dataclass
class Driver:
    """Runs plans to completion; ``accepted[slot]`` drafts are accepted per speculative round."""

    sched: Scheduler
    durations: dict[GraphDescriptor, float]
    accepted: dict[int, int] = field(default_factory=dict)
    now_ns: int = 0
    fence: int = 0
    queue: list = field(default_factory=list)  # (fence, plan, start_ns, end_ns)
    executed: list[Executed] = field(default_factory=list)
    bursts: dict = field(default_factory=dict)  # handle -> [(t_ms, tokens)]
    finished: dict = field(default_factory=dict)  # handle -> t_ms

    def admit(self, request: AdmitRequest):
        h = self.sched.admit(request)
        self.bursts[h] = []
        return h

    def fill(self) -> None:
        while (plan := self.sched.plan()) is not None:
            self.fence += 1
            self.sched.commit(plan, self.fence)
            start = max(self.now_ns, self.queue[-1][3]) if self.queue else self.now_ns
            end = start + int(self.durations[plan.graph] * MS)
            self.queue.append((self.fence, plan, start, end))

    def step(self) -> Executed | None:
        """Fill the window, then complete the oldest frame; None when idle."""
        self.fill()
        if not self.queue:
            return None
        fence, plan, start, end = self.queue.pop(0)
        self.now_ns = max(self.now_ns, end)
        self.sched.advance_to(self.now_ns)
        budget = [plan.graph.target_rows - len(plan.lanes)]  # spare rows the device allocates within P
        records = [self.record(plan, lane, budget) for lane in plan.lanes if self.sched.is_active(lane.handle)]
        duration = end - start
        timing = ExecutionTiming(device_ns=duration, wall_ns=duration)
        if plan.graph.is_prefix_limit:
            out = self.sched.complete_packed_round(fence, records, timing, None)
        else:
            out = self.sched.complete(fence, records, timing)
        for token in out:
            self.sched.published_output(token.handle, fence)
            self.bursts.setdefault(token.handle, []).append((self.now_ns / MS, len(token.tokens)))
            if token.finished:
                self.finished[token.handle] = self.now_ns / MS
        done = Executed(fence, plan, start / MS, end / MS)
        self.executed.append(done)
        return done

    def record(self, plan, lane, budget) -> CompletionRecord:
        if lane.phase is LanePhase.PROMPT:
            return CompletionRecord(lane.handle, prompt_consumed=lane.prompt_tokens,
                                    tokens=(7,) if lane.finishes_prompt else ())
        g = plan.graph
        rows = lane.ceiling or lane.query_length
        if lane.ceiling:
            extra = min(rows - 1, budget[0])
            budget[0] -= extra
            rows = 1 + extra
        offered = min(g.proposal_depth, rows - 1) if g.draws_proposals else 0
        accepted = min(self.accepted.get(lane.handle.slot, 0), offered)
        return CompletionRecord(lane.handle, tokens=(5,) * min(1 + accepted, rows), offered=offered)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.step() is None:
                return

    def idle_until(self, t_ms: float) -> None:
        self.now_ns = max(self.now_ns, int(t_ms * MS))
        self.sched.advance_to(self.now_ns)

    def output_gaps(self, handle) -> list[float]:
        times = [t for t, _ in self.bursts[handle]]
        return [b - a for a, b in zip(times, times[1:])]

    def produced(self, handle) -> int:
        return sum(n for _, n in self.bursts[handle])
