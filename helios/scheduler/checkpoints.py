"""Checkpoint retention: which token endpoints to capture, how much extra work they may cost, what to evict.

The spec's "Planning and the execution queue" (checkpoint paragraphs) and
CHECKLIST K1-K3. A checkpoint is a request's complete state (KV pages, slot
state, draft state) at an exact token endpoint, copied into a checkpoint row by
a snapshot program; a later request whose tokens start with those tokens
restores it and prefills only the rest. This module holds the decisions, in
plain numbers: no torch, no clock (recency is a logical stamp the caller
passes), so the simulator and the engine can share it.

- ``anchor_order`` (K1): the endpoints a request's prompt offers, best first.
- ``ExtraWorkAllowance`` (K2): extra prefill splits and snapshot copies must fit
  a request-local share of its estimated uncached prefill work.
- ``CheckpointIndex`` (K3 and reuse): retained checkpoints by token prefix, the
  longest match for a new prompt, and victims chosen by demand recency,
  checkpoint role, endpoint length; rows that are guarded, armed as a
  destination or being copied are never victims.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# spec: scheduler_checkpoint_extra_work_fraction defaults to 0.05
DEFAULT_EXTRA_WORK_FRACTION = 0.05


class AnchorRole(enum.IntEnum):
    """What an endpoint is. The value orders eviction: a lower role is given up first (K3)."""

    PROMPT_END = 0  # the whole prompt, generation prompt included: reused only by an identical prefix
    MESSAGE = 1  # the end of a completed message: where the next turn of a conversation resumes
    TERMINAL = 2  # the prompt plus the generated answer, captured at completion (P6)


@dataclass(frozen=True, slots=True)
class Anchor:
    """An exact token endpoint: the prompt's first ``length`` tokens."""

    length: int
    role: AnchorRole


def anchor_order(message_ends: Sequence[int], prompt_end: int, *, cached: int = 0) -> list[Anchor]:
    """K1: the endpoints worth capturing for one prompt, best first.

    ``message_ends`` are the token counts at which completed messages end, exactly
    (the frontend renders each message prefix and keeps only ends that are true
    token prefixes of the prompt); ``cached`` is the length already restored from
    a checkpoint. An endpoint is eligible when it lies past the cached part and
    inside the prompt. The last eligible completed message comes first (the
    conversation anchor), or the prompt end when there is none; then earlier
    messages in reverse order; then the prompt end, if distinct.
    """
    eligible = sorted({end for end in message_ends if cached < end <= prompt_end}, reverse=True)
    anchors = [Anchor(end, AnchorRole.MESSAGE) for end in eligible]
    if prompt_end > cached and prompt_end not in eligible:
        anchors.append(Anchor(prompt_end, AnchorRole.PROMPT_END))
    return anchors


@dataclass(slots=True)
class ExtraWorkAllowance:
    """K2: the request-local budget for work that exists only to leave a checkpoint behind.

    The budget is ``fraction`` of the estimated uncached prefill work; unknown
    costs (no estimate yet) disable extras, though anchors stay eligible for the
    captures that cost nothing extra (a split that falls where a chunk ends
    anyway). Productive decode earns the same fraction of its measured time, for
    a distinct terminal capture. There is no fixed capture count.
    """

    fraction: float = DEFAULT_EXTRA_WORK_FRACTION
    budget_ms: float | None = None
    spent_ms: float = 0.0

    @classmethod
    def for_prefill(cls, estimated_prefill_ms: float | None,
                    fraction: float = DEFAULT_EXTRA_WORK_FRACTION) -> ExtraWorkAllowance:
        if not 0 <= fraction <= 1:
            raise ValueError(f"checkpoint extra-work fraction {fraction} is outside [0, 1]")
        budget = None if estimated_prefill_ms is None else fraction * max(estimated_prefill_ms, 0.0)
        return cls(fraction, budget)

    @property
    def left_ms(self) -> float:
        return 0.0 if self.budget_ms is None else max(self.budget_ms - self.spent_ms, 0.0)

    def admits(self, extra_ms: float | None) -> bool:
        """Whether an extra split or copy of this estimated cost fits; an unknown cost never does."""
        if self.budget_ms is None or extra_ms is None:
            return False
        return self.spent_ms + extra_ms <= self.budget_ms

    def spend(self, extra_ms: float) -> None:
        self.spent_ms += extra_ms

    def earn_decode(self, measured_ms: float) -> None:
        """Productive completed decode adds ``fraction`` of its measured time (for the terminal capture)."""
        self.budget_ms = (self.budget_ms or 0.0) + self.fraction * max(measured_ms, 0.0)


class RowUse(enum.Enum):
    """Why a checkpoint row may not be taken (K3); ``FREE_TO_EVICT`` when nothing holds it."""

    FREE_TO_EVICT = "free"
    GUARDED = "guarded"  # protected for a later anchor of a running request
    ARMED = "armed"  # the destination of a planned snapshot
    COPYING = "copying"  # a submitted snapshot or restore has not completed yet


@dataclass(slots=True)
class Checkpoint:
    """A retained state: the tokens it covers, its row, and what eviction compares."""

    tokens: tuple[int, ...]
    row: int
    role: AnchorRole
    last_demand: int  # logical stamp of its capture or its latest hit
    use: RowUse = RowUse.FREE_TO_EVICT

    @property
    def length(self) -> int:
        return len(self.tokens)

    def victim_key(self) -> tuple[int, int, int]:
        """K3: least recently demanded first, then the cheaper role, then the shorter endpoint
        (every row is the same size, so a shorter endpoint saves less prefill per row held)."""
        return (self.last_demand, int(self.role), self.length)


@dataclass(slots=True)
class Lookup:
    """The longest retained checkpoint whose tokens start a prompt, or none."""

    checkpoint: Checkpoint | None

    @property
    def cached_tokens(self) -> int:
        return 0 if self.checkpoint is None else self.checkpoint.length


@dataclass(slots=True)
class CheckpointIndex:
    """Retained checkpoints, found by exact token prefix.

    Aliases: two anchors with the same tokens are one state, held once (the
    later capture only refreshes its demand and may raise its role).
    """

    by_tokens: dict[tuple[int, ...], Checkpoint] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)  # endpoint length -> how many checkpoints have it

    def __len__(self) -> int:
        return len(self.by_tokens)

    def rows(self) -> set[int]:
        return {checkpoint.row for checkpoint in self.by_tokens.values()}

    def lookup(self, prompt: Sequence[int], stamp: int) -> Lookup:
        """The longest retained endpoint that is a strict prefix of ``prompt`` (at least one token is
        left to prefill, since the last token's logits are needed); a hit refreshes its demand."""
        for length in sorted(self.lengths, reverse=True):
            if length >= len(prompt):
                continue
            found = self.by_tokens.get(tuple(prompt[:length]))
            if found is not None:
                found.last_demand = stamp
                return Lookup(found)
        return Lookup(None)

    def alias(self, tokens: Sequence[int]) -> Checkpoint | None:
        return self.by_tokens.get(tuple(tokens))

    def add(self, tokens: Sequence[int], row: int, role: AnchorRole, stamp: int) -> Checkpoint:
        key = tuple(tokens)
        existing = self.by_tokens.get(key)
        if existing is not None:
            existing.last_demand = stamp
            existing.role = max(existing.role, role)
            return existing
        if row in self.rows():
            raise ValueError(f"checkpoint row {row} already holds another state")
        checkpoint = Checkpoint(key, row, role, stamp)
        self.by_tokens[key] = checkpoint
        self.lengths[len(key)] = self.lengths.get(len(key), 0) + 1
        return checkpoint

    def remove(self, checkpoint: Checkpoint) -> None:
        if checkpoint.use is not RowUse.FREE_TO_EVICT:
            raise ValueError(f"checkpoint row {checkpoint.row} is {checkpoint.use.value}; it cannot be released")
        del self.by_tokens[checkpoint.tokens]
        left = self.lengths[checkpoint.length] - 1
        if left:
            self.lengths[checkpoint.length] = left
        else:
            del self.lengths[checkpoint.length]

    def victim(self) -> Checkpoint | None:
        """K3: the checkpoint to give up when a destination row is needed, or none if every row is held."""
        candidates = [c for c in self.by_tokens.values() if c.use is RowUse.FREE_TO_EVICT]
        return min(candidates, key=Checkpoint.victim_key, default=None)

    def destination(self, free_rows: Iterable[int]) -> int | None:
        """K3: an obtainable destination row: a free one, else a victim's (evicted here), else none."""
        for row in free_rows:
            if row not in self.rows():
                return row
        victim = self.victim()
        if victim is None:
            return None
        self.remove(victim)
        return victim.row
