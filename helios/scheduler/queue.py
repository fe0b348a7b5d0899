"""The execution queue: two frame slots, the feedback gate and the projection to the queue's end.

Checklist A6-A11, in one place:

- A6: a committed plan is frozen into a ``Frame`` (its lanes, participants,
  normalizer and expected end); the requests it names hold their queued work
  (``hold``) until its completion releases it (``release``), so a cancelled
  request's slot stays owned through its last submitted fence.
- A7: ``FRAME_SLOTS`` frames at most; a plan that needs completion feedback,
  or one committed behind a frame that does, waits for the empty window
  (``FrameQueue.check_feedback``, ``FrameQueue.accepts_more``).
- A8: selection sees prices and ages projected to the queue's end
  (``FrameQueue.end_ns``, ``FrameQueue.project``); the core asks the gate
  only after selecting, so a winner that needs the empty window waits.
- A9: no cap in milliseconds: a frame that overruns its expected end suspends
  queueing until feedback arrives, and makes no graph ineligible.
- A10: each frame freezes, at commit, its expected service per participant
  (``Frame.terms``); the projection folds those into the observed rates and
  never commits or publishes anything.
- A11: a queued lane may commit at most ``lane_output_bound`` tokens (for a
  prefix-limit row min(ceiling, P) rows' worth, ``rounds.queued_advance``),
  and the request's limits and positions count that bound while it is queued.

Pure bookkeeping: no torch, no clock (time comes in as ``now_ns``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from flare_contract.graphs import GENERATION_KINDS, GraphDescriptor
from helios.scheduler import rounds
from helios.scheduler.service import MIN_RATE_PER_MS, decay_factor
from helios.scheduler.types import Fence, LanePhase, PlannedLane, RequestHandle, ScheduledPlan

FRAME_SLOTS = 2  # A7: the transport holds two frames

_NO_SERVICE = (0.0, 0.0, 0.0, False)  # a participant without a lane in the frame


def lane_output_bound(lane: PlannedLane, graph: GraphDescriptor) -> int:
    """Most output tokens a lane may commit (A11 for prefix-limit rows)."""
    if lane.phase is LanePhase.PROMPT:
        return 1 if lane.finishes_prompt else 0
    if lane.ceiling:
        return rounds.queued_advance(lane.ceiling, graph)
    return lane.query_length


def hold(state, lane: PlannedLane, graph: GraphDescriptor) -> None:
    """A6/A11: ``state`` (a ``core.RequestState``) now has ``lane`` queued: count its frame and bounds."""
    state.inflight += 1
    state.queued_prompt += lane.prompt_tokens
    state.queued_output += lane_output_bound(lane, graph)


def release(state, lane: PlannedLane, graph: GraphDescriptor) -> None:
    """The frame holding ``lane`` completed: undo what ``hold`` counted."""
    state.inflight -= 1
    state.queued_prompt -= lane.prompt_tokens
    state.queued_output -= lane_output_bound(lane, graph)


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class Frame:
    """A committed plan awaiting completion, with what accounting needs (A1, A10)."""

    fence: Fence
    plan: ScheduledPlan
    participants: tuple[RequestHandle, ...]
    normalizer: float | None
    end_ns: int  # expected end: planning start of the next frame (A9)
    queued: bool  # committed behind another frame: its service interval is the device one (A3)
    members: frozenset[RequestHandle] = frozenset()  # the participants, for membership tests
    lanes_by_handle: dict[RequestHandle, PlannedLane] = field(default_factory=dict)
    # A10 queue projection, frozen at commit: the frame's decay factor, shared by all, and per
    # participant (zero service for those without a lane) the parts of ``service.blend`` over
    # this frame that do not depend on the rate: ((1 - decay) * tokens / duration, the same for
    # deliveries, the first-burst delivery rate of A5, whether it delivers). Keyed by the
    # participant's ``RequestState.key``: every decision's snapshot looks each request up, and
    # a handle's generated hash is a Python call where a tuple of two ints hashes in C.
    decay: float = 1.0
    terms: dict[tuple[int, int], tuple[float, float, float, bool]] = field(default_factory=dict)

    @classmethod
    def submitted(cls, fence, plan, states, normalizer, end_ns, queued, adaptation_ms,
                  prompt_weight: float = 1.0) -> "Frame":
        """The frame of ``plan``, whose participants are the live requests ``states``.

        ``prompt_weight``: what a prompt token adds to the token rate (``PolicyConfig.prompt_service_weight``).
        """
        participants = tuple(state.handle for state in states)
        lanes = {lane.handle: lane for lane in plan.lanes}
        duration_ms = max(plan.estimated_duration_ns, 1) / 1e6
        decay = decay_factor(duration_ms, adaptation_ms)
        rest = 1.0 - decay
        terms = dict.fromkeys((state.key for state in states), _NO_SERVICE)
        for state in states:
            lane = lanes.get(state.handle)
            if lane is not None:
                tokens = lane.expected_tokens + lane.prompt_tokens * prompt_weight
                deliveries = 1.0 if lane.phase is LanePhase.DECODE else 0.0
                terms[state.key] = (rest * tokens / duration_ms, rest * deliveries / duration_ms,
                                    deliveries / duration_ms, deliveries > 0)
        return cls(fence, plan, participants, normalizer, end_ns, queued, frozenset(participants), lanes,
                   decay, terms)

    def ending_at(self, end_ns: int) -> "Frame":
        """This frame re-anchored to end at ``end_ns`` (``dataclasses.replace`` without its per-call field
        introspection: every completion behind a queued frame re-anchors it)."""
        return Frame(self.fence, self.plan, self.participants, self.normalizer, end_ns, self.queued, self.members,
                     self.lanes_by_handle, self.decay, self.terms)


@dataclass(slots=True)
class Projected:
    """Decoders' service projected through the queued frames (A10), one entry per state, in order."""

    token_rates: list[float]
    delivery_rates: list[float | None]  # None: no delivery yet, even counting the queue
    reference_ns: list[int]  # what output age counts from: the last expected or observed delivery


def follows(queued: ScheduledPlan, plan: ScheduledPlan) -> bool:
    """Behind a queued frame that is not generation (a prefill that needs no feedback, where
    ``PolicyConfig.prefill_fills_second_slot`` lets one be queued), only another such frame: a generation
    plan waits for the completion, when the prompts it finishes have their decoders (A7)."""
    return queued.graph.kind in GENERATION_KINDS or plan.graph.kind not in GENERATION_KINDS


class FrameQueue:
    """The submitted, uncompleted frames in fence order (see the module docstring)."""

    def __init__(self, slots: int = FRAME_SLOTS) -> None:
        self.slots = slots
        self._frames: list[Frame] = []

    def __len__(self) -> int:
        return len(self._frames)

    def __bool__(self) -> bool:
        return bool(self._frames)

    @property
    def frames(self) -> tuple[Frame, ...]:
        """The queued frames, oldest first."""
        return tuple(self._frames)

    @property
    def fences(self) -> tuple[Fence, ...]:
        return tuple(f.fence for f in self._frames)

    def accepts_more(self, now_ns: int) -> bool:
        """A7 and A9: a free slot, behind nothing that needs feedback or has overrun its expected end."""
        frames = self._frames
        if len(frames) >= self.slots:
            return False
        if not frames:
            return True
        last = frames[-1]
        return not last.plan.requires_feedback and now_ns <= last.end_ns

    def end_ns(self, now_ns: int) -> int:
        """When queued work is expected to finish: where the next plan starts (A10)."""
        return max(now_ns, self._frames[-1].end_ns) if self._frames else now_ns

    def follows_last(self, plan: ScheduledPlan) -> bool:
        """Whether ``plan`` may be queued behind the last queued frame as far as their kinds go (``follows``)."""
        return not self._frames or follows(self._frames[-1].plan, plan)

    def check_slot(self) -> None:
        """A7 at commit: a free frame slot."""
        if len(self._frames) >= self.slots:
            raise ValueError("both frame slots are occupied; complete a frame before committing")

    def check_feedback(self, plan: ScheduledPlan, cost_needs_feedback: bool) -> None:
        """A7 at commit: no feedback dependence between ``plan`` and the queued frame.

        ``cost_needs_feedback``: the plan's program is unknown or stale now (D5), which its
        plan may not have seen.
        """
        if not self._frames:
            return
        last = self._frames[-1].plan
        if last.requires_feedback or plan.requires_feedback or not follows(last, plan):
            raise ValueError("this plan or the queued one needs completion feedback: commit after the queue drains")
        if cost_needs_feedback:
            raise ValueError(f"{plan.graph.id}'s cost went stale since planning (D5); replan after the queue drains")

    def submit(self, fence: Fence, plan: ScheduledPlan, states: Sequence, normalizer: float | None,
               now_ns: int, adaptation_ms: float, prompt_weight: float = 1.0) -> Frame:
        """Queue ``plan`` (``check_slot`` and ``check_feedback`` passed) with the live requests ``states`` as participants."""
        queued = bool(self._frames)
        end_ns = self.end_ns(now_ns) + plan.estimated_duration_ns
        frame = Frame.submitted(fence, plan, states, normalizer, end_ns, queued, adaptation_ms, prompt_weight)
        self._frames.append(frame)
        return frame

    def oldest(self, fence: Fence) -> Frame:
        """The frame ``fence`` names, which must be the oldest (completions come in fence order)."""
        if not self._frames:
            raise ValueError(f"no submitted frame to complete (fence {fence})")
        if self._frames[0].fence != fence:
            raise ValueError(f"completions come in fence order: expected {self._frames[0].fence}, got {fence}")
        return self._frames[0]

    def pop(self, now_ns: int) -> Frame:
        """Remove the oldest frame (its completion was validated at ``now_ns``) and re-anchor the rest.

        The transport runs frames in fence order, so the next frame started when this one
        completed: its expected end is ``now_ns`` plus its frozen estimate, and each later
        frame's is the one before's plus its own (A9's expected finish times, from the
        latest feedback). Chained from commit-time ends instead, the queue's expected end
        falls behind by whatever each frame takes beyond its estimate (the worker's time
        around the program call, which the device-interval estimates leave out); within a
        few frames of one stream it is in the past, and queueing stops as if a frame had
        overrun (docs/runtime.md, "Two frame slots").
        """
        done = self._frames.pop(0)
        anchor = now_ns
        for i, frame in enumerate(self._frames):
            anchor += frame.plan.estimated_duration_ns
            if frame.end_ns != anchor:
                self._frames[i] = frame.ending_at(anchor)
        return done

    def project(self, states: Sequence) -> Projected:
        """A10: each decoder's token and delivery rates and age reference at the queue's end.

        The same operations in the same order as ``service.blend`` over each queued frame the
        request has a share in, written out (this runs for every decoder of every decision).
        """
        if not self._frames:
            services = [s.service for s in states]
            return Projected([service.token_rate for service in services],
                             [service.delivery_rate for service in services],
                             [s.last_output_ns or s.decoder_since_ns or s.admitted_ns for s in states])
        frames = [(frame.terms, frame.decay, frame.end_ns) for frame in self._frames]
        rates, deliveries, references = [], [], []
        add_rate, add_delivery, add_reference = rates.append, deliveries.append, references.append
        for s in states:
            service = s.service
            x, z, delivered_ns = service.token_rate, service.delivery_rate, None
            for terms, decay, end_ns in frames:
                served = terms.get(s.key)
                if served is None:
                    continue
                token_term, delivery_term, first_rate, delivers = served
                x = decay * x + token_term
                if x < MIN_RATE_PER_MS:
                    x = MIN_RATE_PER_MS
                if z is not None:
                    z = decay * z + delivery_term
                    if z < MIN_RATE_PER_MS:
                        z = MIN_RATE_PER_MS
                elif delivers:
                    z = first_rate
                if delivers:
                    delivered_ns = end_ns
            add_rate(x)
            add_delivery(z)
            add_reference(delivered_ns or s.last_output_ns or s.decoder_since_ns or s.admitted_ns)
        return Projected(rates, deliveries, references)

    def projected_token_rate(self, state) -> float:
        """A10 for a prompter: its token rate at the queue's end."""
        x = state.service.token_rate
        for frame in self._frames:
            served = frame.terms.get(state.key)
            if served is not None:
                x = frame.decay * x + served[0]
                if x < MIN_RATE_PER_MS:
                    x = MIN_RATE_PER_MS
        return x
