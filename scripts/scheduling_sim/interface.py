"""What every baseline scheduler sees and returns: streams, frames and lane results.

A baseline is driven by ``driver.run`` through three calls, mirroring the way
``helios.sim.simulator`` drives the real scheduler:

- ``admit(stream, now_ns) -> bool``: a request arrived (the driver offers
  waiting requests in arrival order; False keeps it in the driver's queue);
- ``plan(now_ns) -> Frame | None``: the next frame to run, or None to wait;
  the driver keeps asking until None, so a scheduler may queue frames;
- ``complete(done)``: a frame ran (frames complete in commit order);
  ``done.results`` says what each lane did.

A ``Stream`` is the one object holding a request's progress; the driver
advances it from the device's results, baselines only read it. Frames name a
captured program (``GraphDescriptor``) and its lanes; the driver checks every
frame against the program's capacities, so a baseline cannot run a shape the
catalog lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from flare_contract.graphs import GraphDescriptor, GraphKind
from helios.sim.files import TraceRequest


@dataclass(slots=True)
class Stream:
    """One request in a baseline run: what it asked for and how far it got."""

    spec: TraceRequest
    client: str = "default"
    prompt_done: int = 0  # prompt tokens consumed
    produced: int = 0  # output tokens committed

    @property
    def prompt_left(self) -> int:
        return self.spec.prompt_tokens - self.prompt_done

    @property
    def decoding(self) -> bool:
        return self.prompt_left == 0 and not self.finished

    @property
    def finished(self) -> bool:
        return self.produced >= self.spec.max_tokens


@dataclass(frozen=True, slots=True)
class Lane:
    """One row of a frame: a prompt chunk (``prompt_tokens`` > 0) or a decode round of ``width`` positions."""

    stream: Stream
    prompt_tokens: int = 0
    width: int = 1  # target positions, pending token included: offers width - 1 drafts

    @property
    def is_prompt(self) -> bool:
        return self.prompt_tokens > 0


@dataclass(frozen=True, slots=True)
class Frame:
    graph: GraphDescriptor
    lanes: tuple[Lane, ...]

    def prompt_lanes(self) -> tuple[Lane, ...]:
        return tuple(lane for lane in self.lanes if lane.is_prompt)

    def check(self) -> None:
        """Raise ValueError unless the lanes fit the captured program (the catalog's contract)."""
        graph, prompts = self.graph, self.prompt_lanes()
        decoders = [lane for lane in self.lanes if not lane.is_prompt]
        problems = [
            (len(self.lanes) > graph.batch_capacity, f"{len(self.lanes)} lanes exceed B={graph.batch_capacity}"),
            (len({id(lane.stream) for lane in self.lanes}) < len(self.lanes), "a stream appears twice"),
            (sum(lane.prompt_tokens for lane in prompts) > graph.prefill_capacity,
             f"prompt tokens exceed prefill_capacity={graph.prefill_capacity}"),
            (any(lane.width > graph.width for lane in decoders), f"a decode lane is wider than W={graph.width}"),
            (any(lane.prompt_tokens > lane.stream.prompt_left for lane in prompts), "a chunk runs past its prompt"),
            (any(not lane.stream.decoding for lane in decoders), "a decode lane's stream is not decoding"),
            (bool(decoders) and graph.kind is GraphKind.PREFILL, "a prefill program has a decode lane"),
            (bool(prompts) and graph.kind in (GraphKind.DECODE, GraphKind.SPECULATIVE),
             "a decode program has a prompt lane"),
            (graph.kind is GraphKind.MIXED and len(prompts) > 1, "a mixed program has more than one prompt row"),
        ]
        for failed, problem in problems:
            if failed:
                raise ValueError(f"frame on {graph.id}: {problem}")


@dataclass(frozen=True, slots=True)
class LaneResult:
    """What the device did for one lane."""

    lane: Lane
    prompt_consumed: int = 0
    tokens: int = 0  # output tokens committed (accepted drafts + the bonus token)
    offered: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted (before the output limit cut)


@dataclass(frozen=True, slots=True)
class FrameDone:
    frame: Frame
    results: tuple[LaneResult, ...]  # one per lane, in lane order
    end_ns: int
    duration_ns: int


class Baseline(Protocol):
    name: str

    def admit(self, stream: Stream, now_ns: int) -> bool: ...

    def plan(self, now_ns: int) -> Frame | None: ...

    def complete(self, done: FrameDone) -> None: ...


@dataclass(slots=True)
class RunningSet:
    """Requests holding a slot, in the order they got it, plus those waiting for one.

    Shared by the baselines: ``waiting`` is where admitted-but-not-running
    streams queue; a queue policy (FIFO or VTC) decides who moves into
    ``running`` when a slot frees.
    """

    slots: int
    running: list[Stream] = field(default_factory=list)
    waiting: list[Stream] = field(default_factory=list)

    def retire_finished(self) -> list[Stream]:
        done = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        return done

    def free_slots(self) -> int:
        return self.slots - len(self.running)

    def decoders(self) -> list[Stream]:
        return [s for s in self.running if s.decoding]

    def prompts(self) -> list[Stream]:
        return [s for s in self.running if s.prompt_left > 0]
