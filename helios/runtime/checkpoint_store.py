"""The engine's checkpoint rows: which token prefixes they hold, and who owns each row now (docs/checkpoints.md).

The scheduler decides *when* a restore or snapshot runs (P1-P4, P6, K2); this
store decides *which rows* (K1 anchors offered at admission, K3 destinations
and victims at bind time) and keeps them fenced:

- a row being restored from is ``COPYING`` from admission until the last
  pending restore from it completes or its request goes, so no snapshot
  evicts it meanwhile;
- a snapshot's destination is *armed* from bind until its frame completes:
  no other snapshot is given it, and it joins the index only once the copy
  has completed (a failed or cancelled copy publishes nothing);
- a published checkpoint is a victim only while nothing holds it.

Plain numbers and token ids: no torch here; the programs that copy are run
by the engine (``helios.runtime.state_ops``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from helios.scheduler.checkpoints import AnchorRole, Checkpoint, CheckpointIndex, RowUse, anchor_order
from helios.scheduler.types import RequestHandle


@dataclass(frozen=True, slots=True)
class Reuse:
    """What admission tells the scheduler about one prompt's state operations."""

    restore_row: int = -1  # a retained checkpoint holding the prompt's first ``cached_tokens`` tokens
    cached_tokens: int = 0
    snapshot_points: tuple[int, ...] = ()  # K1 anchors worth capturing, best first
    terminal_snapshot: bool = False


@dataclass(slots=True)
class StoreCounters:
    """Cumulative figures for ``/metrics``."""

    hits: int = 0  # admissions that restored a checkpoint
    misses: int = 0  # admissions that found none
    cached_tokens: int = 0  # prompt tokens restored instead of prefilled
    captures: int = 0  # snapshots published into the index
    evictions: int = 0  # checkpoints given up for a new destination (K3)


@dataclass(slots=True)
class CheckpointStore:
    """``rows`` checkpoint rows of ``row_bytes`` each; ``rows`` 0 turns prefix reuse off."""

    rows: int
    row_bytes: int = 0
    index: CheckpointIndex = field(default_factory=CheckpointIndex)
    counters: StoreCounters = field(default_factory=StoreCounters)
    _armed: dict[int, RequestHandle] = field(default_factory=dict)  # destination row -> its snapshot's request
    _restoring: dict[RequestHandle, Checkpoint] = field(default_factory=dict)
    _stamp: int = 0

    @property
    def enabled(self) -> bool:
        return self.rows > 0

    @property
    def bytes_held(self) -> int:
        return len(self.index) * self.row_bytes

    def _tick(self) -> int:
        self._stamp += 1
        return self._stamp

    # -- admission ---------------------------------------------------------------

    def admission(self, prompt: Sequence[int], message_ends: Sequence[int], reuse: bool = True) -> tuple[Reuse, Checkpoint | None]:
        """The prompt's restore (the longest retained strict prefix) and its anchors past it (K1).

        ``reuse`` False (a prompt whose every position must be scored, say) looks nothing up and
        offers no restore; its anchors are still offered. The checkpoint returned must be handed to
        ``admitted`` with the request's handle, or to ``released`` if admission fails.
        """
        if not self.enabled:
            return Reuse(), None
        found = self.index.lookup(prompt, self._tick()).checkpoint if reuse else None
        cached = 0 if found is None else found.length
        if found is not None:
            found.use = RowUse.COPYING
            self.counters.hits += 1
            self.counters.cached_tokens += cached
        else:
            self.counters.misses += 1
        points = tuple(anchor.length for anchor in anchor_order(message_ends, len(prompt), cached=cached)
                       if self.index.alias(prompt[:anchor.length]) is None)
        return Reuse(found.row if found else -1, cached, points, True), found

    def admitted(self, handle: RequestHandle, checkpoint: Checkpoint | None) -> None:
        if checkpoint is not None:
            self._restoring[handle] = checkpoint

    def restored(self, handle: RequestHandle) -> None:
        """The request's restore completed (or will never run): its source row may be evicted again,
        once no other request's restore from it is still pending."""
        self._unfence(self._restoring.pop(handle, None))

    def released(self, handle: RequestHandle, checkpoint: Checkpoint | None = None) -> None:
        """The request is gone: whatever it held is given back."""
        self._unfence(checkpoint)
        self.restored(handle)
        self.disarm(handle)

    def _unfence(self, checkpoint: Checkpoint | None) -> None:
        if checkpoint is None or checkpoint.use is not RowUse.COPYING:
            return
        if any(pending is checkpoint for pending in self._restoring.values()):
            return  # another request still copies from this row: it stays fenced
        checkpoint.use = RowUse.FREE_TO_EVICT

    # -- snapshots -----------------------------------------------------------------

    def destination(self, handle: RequestHandle) -> int:
        """K3: a row for ``handle``'s snapshot, armed until ``captured``/``abandoned``; -1 when none is
        obtainable (every row is armed, restoring, or otherwise held)."""
        held = self.index.rows()
        row = self.index.destination(r for r in range(self.rows) if r not in self._armed)
        if row is None:
            return -1
        if row in held:
            self.counters.evictions += 1
        self._armed[row] = handle
        return row

    def captured(self, row: int, tokens: Sequence[int], prompt_length: int, message_ends: Sequence[int]) -> None:
        """The snapshot into ``row`` completed: publish its tokens (an alias only refreshes the existing one)."""
        self._armed.pop(row, None)
        length = len(tokens)
        role = (AnchorRole.TERMINAL if length > prompt_length
                else AnchorRole.MESSAGE if length in message_ends else AnchorRole.PROMPT_END)
        if self.index.alias(tokens) is None and row in self.index.rows():
            return  # the row was re-taken meanwhile; cannot happen while it is armed, kept as a guard
        self.index.add(tokens, row, role, self._tick())
        self.counters.captures += 1

    def disarm(self, handle: RequestHandle) -> None:
        """Every destination armed for ``handle``'s snapshots is free again (its frame failed or never ran)."""
        for row in [row for row, owner in self._armed.items() if owner == handle]:
            del self._armed[row]

    def abandoned(self, row: int) -> None:
        """The snapshot into ``row`` failed or copied nothing: the row is free again, nothing published."""
        self._armed.pop(row, None)
