"""A discrete-event driver for baseline schedulers, with the simulator's device model.

``helios.sim.simulator`` drives only the real Helios scheduler, so the baselines
get this small driver. It mirrors the simulator's synthetic device exactly and
reuses its pieces (``SyntheticDevice`` for seeded durations, ``accepted_drafts``
for acceptance draws, the result types): frames run one after another in
commit order, each for its graph's duration plus seeded jitter drawn at commit;
a prompt lane that finishes its prompt emits one token; a decode lane of width
L offers L - 1 drafts and commits the accepted prefix plus one token; nothing
is emitted past ``max_tokens``; every lane with tokens is one visible burst at
the frame's completion. Arrivals wait in arrival order until the scheduler
admits them. ``tests/scripts/test_scheduling_sim.py`` runs the real scheduler
through this driver (``helios_adapter``) and through ``helios.sim.simulator`` and
checks that both give the same outcome.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from helios.sim.files import SyntheticCatalog, Trace
from helios.sim.simulator import Burst, PlanRecord, RequestOutcome, SimulationResult, SyntheticDevice, accepted_drafts
from scripts.scheduling_sim.interface import Baseline, Frame, FrameDone, Lane, LaneResult, Stream


class DriverError(RuntimeError):
    """A scheduler broke the driver's contract (a frame that does not fit its program, say)."""


@dataclass(frozen=True, slots=True)
class _Running:
    frame: Frame
    fence: int
    start_ns: int
    end_ns: int


@dataclass(slots=True)
class _Request:
    stream: Stream
    outcome: RequestOutcome


class Driver:
    def __init__(self, catalog: SyntheticCatalog, trace: Trace, scheduler: Baseline, clients: dict[str, str]):
        self.scheduler = scheduler
        self.device = SyntheticDevice(catalog, random.Random(trace.seed))
        ordered = sorted(trace.requests, key=lambda r: r.arrival_ns)
        self.everyone = [
            _Request(Stream(r, clients.get(r.id, "default")), RequestOutcome(r.id, r.arrival_ns)) for r in ordered
        ]
        self.by_stream = {id(r.stream): r for r in self.everyone}
        self.arrivals = deque(self.everyone)
        self.waiting: deque[_Request] = deque()
        self.frames: deque[_Running] = deque()
        self.plans: list[PlanRecord] = []
        self.now = 0

    def run(self) -> SimulationResult:
        while True:
            self._admit_arrivals()
            self._submit_frames()
            next_ns = self._next_event_ns()
            if next_ns is None:
                break
            self.now = next_ns
            if self.frames and self.frames[0].end_ns == self.now:
                self._complete(self.frames.popleft())
        stalled = any(r.outcome.finished_ns is None for r in self.everyone)
        outcomes = tuple(r.outcome for r in self.everyone)
        return SimulationResult(outcomes, tuple(self.plans), self.now, stalled, cold=False)

    def _admit_arrivals(self) -> None:
        while self.arrivals and self.arrivals[0].outcome.arrival_ns <= self.now:
            self.waiting.append(self.arrivals.popleft())
        while self.waiting and self.scheduler.admit(self.waiting[0].stream, self.now):
            self.waiting.popleft().outcome.admitted_ns = self.now

    def _submit_frames(self) -> None:
        while (frame := self.scheduler.plan(self.now)) is not None:
            try:
                frame.check()
            except ValueError as exc:
                raise DriverError(f"{self.scheduler.name}: {exc}") from None
            start = max(self.now, self.frames[-1].end_ns if self.frames else 0)
            running = _Running(frame, len(self.plans) + 1, start, start + self.device.duration_ns(frame.graph))
            self.frames.append(running)
            self.plans.append(self._record(running))

    def _record(self, running: _Running) -> PlanRecord:
        duration = running.end_ns - running.start_ns
        cohort = tuple(lane.stream.spec.id for lane in running.frame.lanes)
        return PlanRecord(running.fence, running.start_ns, running.end_ns, running.frame.graph, cohort,
                          self.scheduler.name, duration, duration)

    def _next_event_ns(self) -> int | None:
        candidates = [self.frames[0].end_ns] if self.frames else []
        if self.arrivals:
            candidates.append(self.arrivals[0].outcome.arrival_ns)
        return min(candidates, default=None)

    def _complete(self, running: _Running) -> None:
        results = tuple(self._run_lane(lane) for lane in running.frame.lanes)
        duration = running.end_ns - running.start_ns
        self.scheduler.complete(FrameDone(running.frame, results, self.now, duration))
        for result in results:
            request = self.by_stream[id(result.lane.stream)]
            if result.tokens:
                request.outcome.bursts.append(Burst(self.now, result.tokens))
            if request.stream.finished and request.outcome.finished_ns is None:
                request.outcome.finished_ns = self.now

    def _run_lane(self, lane: Lane) -> LaneResult:
        stream = lane.stream
        if lane.is_prompt:
            stream.prompt_done += lane.prompt_tokens
            tokens = _emit(stream, 1) if stream.prompt_left == 0 else 0
            return LaneResult(lane, prompt_consumed=lane.prompt_tokens, tokens=tokens)
        offered = lane.width - 1
        accepted = accepted_drafts(stream.spec.acceptance_after(stream.produced), offered, self.device.rng)
        return LaneResult(lane, tokens=_emit(stream, accepted + 1), offered=offered, accepted=accepted)


def _emit(stream: Stream, count: int) -> int:
    """Commit up to ``count`` output tokens; the device never emits past the output limit."""
    count = max(0, min(count, stream.spec.max_tokens - stream.produced))
    stream.produced += count
    return count


def run(
    catalog: SyntheticCatalog, trace: Trace, scheduler: Baseline, clients: dict[str, str] | None = None
) -> SimulationResult:
    """Run ``trace`` on ``catalog`` under ``scheduler``; ``clients`` maps request ids to client names."""
    return Driver(catalog, trace, scheduler, clients or {}).run()
