"""The KV page allocator: which physical cache pages each request slot owns.

Pure Python (no torch): the executor copies ``slot_pages`` into the
``page_table`` tensor each frame. Two layers keep running out of pages from
ever crashing a frame:

- a *claim* per admitted request, made at admission, covers the most cache
  positions the request can ever write (prompt plus output, plus the widest
  verification row of the catalog, spec A13/S3), capped by the slot. The sum of
  claims never exceeds the pool, so a request that is admitted can always get
  its pages; one whose claim does not fit waits (``can_claim``) and one that
  could never fit is refused by the engine before admission.
- pages are handed out lazily, per lane, when a frame is committed
  (``reserve``): just enough for the lane's maximum extent in that frame.

Pages stay owned until ``release``, which the engine calls only after the
request's last submitted frame completed (spec A6), so a later occupant of the
slot can never receive a page a queued frame still writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class PagesExhausted(RuntimeError):
    """A reservation beyond a request's claim (a bug in the caller, not a full pool)."""


@dataclass(frozen=True, slots=True)
class PageLayout:
    """The catalog's cache geometry (``StateLayout`` in docs/program-contract.md)."""

    request_slots: int
    page_size: int
    num_pages: int
    max_pages_per_slot: int

    def __post_init__(self) -> None:
        if min(self.request_slots, self.page_size, self.num_pages, self.max_pages_per_slot) < 1:
            raise ValueError(f"every page layout size must be >= 1, got {self}")

    @property
    def slot_capacity(self) -> int:
        """Most cache positions one slot can address."""
        return self.page_size * self.max_pages_per_slot

    def pages_for(self, positions: int) -> int:
        return math.ceil(positions / self.page_size)


@dataclass(slots=True)
class _SlotPages:
    claim: int  # pages promised to the slot's request
    pages: list[int] = field(default_factory=list)  # owned, in position order


class PageAllocator:
    """Claims, per-lane reservations and releases over one cache pool."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._free = list(range(layout.num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._slots: dict[int, _SlotPages] = {}
        self._claimed = 0

    # -- admission ------------------------------------------------------------

    def claim_size(self, positions: int) -> int:
        """Pages a request writing up to ``positions`` cache positions must be promised."""
        return self.layout.pages_for(min(positions, self.layout.slot_capacity))

    def can_claim(self, positions: int) -> bool:
        return self._claimed + self.claim_size(positions) <= self.layout.num_pages

    def claim(self, slot: int, positions: int) -> None:
        """Promise the request entering ``slot`` enough pages for ``positions`` positions."""
        if slot in self._slots:
            raise ValueError(f"slot {slot} still owns pages; release it after its last frame first")
        if not 0 <= slot < self.layout.request_slots:
            raise ValueError(f"slot {slot} outside 0..{self.layout.request_slots - 1}")
        if not self.can_claim(positions):
            raise PagesExhausted(f"claim of {self.claim_size(positions)} pages does not fit: "
                                 f"{self.layout.num_pages - self._claimed} unclaimed")
        size = self.claim_size(positions)
        self._slots[slot] = _SlotPages(size)
        self._claimed += size

    # -- frames ---------------------------------------------------------------

    def reserve(self, slot: int, extent: int) -> bool:
        """Own pages covering positions ``0..extent-1`` of ``slot``; True when pages were added."""
        owned = self._slots.get(slot)
        if owned is None:
            raise ValueError(f"slot {slot} has no claim; claim at admission before reserving")
        needed = self.layout.pages_for(min(extent, self.layout.slot_capacity))
        if needed > owned.claim:
            raise PagesExhausted(f"slot {slot}: extent {extent} needs {needed} pages, beyond its claim of {owned.claim}")
        added = needed > len(owned.pages)
        while len(owned.pages) < needed:
            owned.pages.append(self._free.pop())
        return added

    def slot_pages(self, slot: int) -> tuple[int, ...]:
        owned = self._slots.get(slot)
        return () if owned is None else tuple(owned.pages)

    def release(self, slot: int) -> None:
        """Return the slot's pages and claim (after its request's last submitted frame)."""
        owned = self._slots.pop(slot, None)
        if owned is None:
            return
        self._free.extend(reversed(owned.pages))
        self._claimed -= owned.claim

    # -- accounting -----------------------------------------------------------

    @property
    def used(self) -> int:
        return self.layout.num_pages - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def owners(self) -> tuple[int, ...]:
        return tuple(sorted(self._slots))

    def assert_no_leaks(self) -> None:
        """Every page is either free or owned by a slot with a claim, and nothing is counted twice."""
        owned = [p for s in self._slots.values() for p in s.pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert not set(owned) & set(self._free), "a page is both owned and free"
        assert len(owned) + len(self._free) == self.layout.num_pages, (
            f"{self.layout.num_pages - len(owned) - len(self._free)} pages leaked"
        )
        assert self._claimed == sum(s.claim for s in self._slots.values()), "claims drifted from their owners"
        assert all(len(s.pages) <= s.claim for s in self._slots.values()), "a slot owns beyond its claim"
