"""The KV page allocator (helios.runtime.pages): claims, per-lane reservations, fenced release (A6, A13)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.runtime.pages import PageAllocator, PageLayout, PagesExhausted

LAYOUT = PageLayout(request_slots=4, page_size=16, num_pages=20, max_pages_per_slot=8)
EXAMPLES = 30 if os.environ.get("FLARE_TEST_SCALE") == "ci" else 150


def test_reserve_hands_out_distinct_pages_covering_the_extent():
    pages = PageAllocator(LAYOUT)
    pages.claim(0, 100)
    pages.claim(2, 40)
    assert pages.reserve(0, 17) is True  # 17 positions need 2 pages of 16
    assert pages.reserve(0, 32) is False  # already covered
    pages.reserve(2, 40)
    assert len(pages.slot_pages(0)) == 2 and len(pages.slot_pages(2)) == 3
    assert not set(pages.slot_pages(0)) & set(pages.slot_pages(2))
    assert pages.used == 5 and pages.free == LAYOUT.num_pages - 5
    pages.assert_no_leaks()


def test_claims_never_exceed_the_pool_so_admission_waits_instead_of_crashing():
    pages = PageAllocator(LAYOUT)
    pages.claim(0, 8 * 16)  # a whole slot: 8 pages
    pages.claim(1, 8 * 16)
    assert not pages.can_claim(5 * 16)  # 4 pages left
    with pytest.raises(PagesExhausted):
        pages.claim(2, 5 * 16)
    assert pages.can_claim(4 * 16)
    pages.release(0)
    assert pages.can_claim(5 * 16)


def test_a_claim_is_capped_by_the_slot_and_a_reservation_by_the_claim():
    pages = PageAllocator(LAYOUT)
    assert pages.claim_size(10_000) == LAYOUT.max_pages_per_slot
    pages.claim(1, 20)
    with pytest.raises(PagesExhausted, match="beyond its claim"):
        pages.reserve(1, 33)


def test_A6_a_slot_keeps_its_pages_until_released_and_cannot_be_claimed_twice():
    pages = PageAllocator(LAYOUT)
    pages.claim(3, 64)
    pages.reserve(3, 64)
    with pytest.raises(ValueError, match="release it after its last frame"):
        pages.claim(3, 16)
    held = pages.slot_pages(3)
    pages.release(3)
    pages.release(3)  # idempotent
    assert pages.used == 0 and pages.owners == ()
    pages.claim(3, 64)
    pages.reserve(3, 64)
    assert set(pages.slot_pages(3)) == set(held)  # freed pages are reused
    pages.assert_no_leaks()


def test_reserve_without_claim_is_a_clear_error():
    with pytest.raises(ValueError, match="no claim"):
        PageAllocator(LAYOUT).reserve(0, 1)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_claims_reservations_and_releases_leak_nothing(seed):
    rng = random.Random(seed)
    pages = PageAllocator(LAYOUT)
    extents: dict[int, int] = {}
    claims: dict[int, int] = {}
    for _ in range(60):
        slot = rng.randrange(LAYOUT.request_slots)
        if slot in extents and rng.random() < 0.3:
            pages.release(slot)
            del extents[slot]
        elif slot in extents:
            extents[slot] = min(extents[slot] + rng.randint(1, 20), claims[slot])
            pages.reserve(slot, extents[slot])
        else:
            want = rng.randint(1, 128)
            if pages.can_claim(want):
                pages.claim(slot, want)
                extents[slot], claims[slot] = 0, want
        pages.assert_no_leaks()
    for slot in list(extents):
        pages.release(slot)
    assert pages.used == 0
    pages.assert_no_leaks()


def test_page_table_snapshots_are_shared_until_the_table_changes():
    """A frame's page table copy never changes after it was handed out; unchanged tables share one copy."""
    from helios.ops.layout import NO_PAGE
    from helios.runtime.executor import PageTable

    pages, table = PageAllocator(LAYOUT), PageTable(LAYOUT)
    pages.claim(0, 64)
    pages.reserve(0, 16)
    table.sync(pages, 0)
    first = table.snapshot()
    assert table.snapshot() is first  # nothing changed: no copy
    held = first.clone()
    pages.reserve(0, 40)
    table.sync(pages, 0)
    second = table.snapshot()
    assert torch.equal(first, held)  # the running frame's copy is untouched by the later reservation
    assert second is not first and int((second[0] != NO_PAGE).sum()) == len(pages.slot_pages(0)) == 3
