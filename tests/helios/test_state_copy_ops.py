"""The state programs' copy kernels (helios/ops/state_copy.py) against a position-by-position reference."""

from __future__ import annotations

import random

import pytest
import torch

from helios.ops import state_copy

LAYERS, PAGES, PAGE, HEADS, DIM, MAX_PAGES = 2, 12, 4, 2, 3, 4


def _caches(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, PAGES, PAGE, HEADS, DIM)
    return tuple(torch.randn(shape, generator=g) for _ in range(4))  # dst_k, dst_v, src_k, src_v


def _reference(dst, src, dst_pages, src_pages, tokens) -> torch.Tensor:
    """Row by row in row order, one position at a time: what the op's docstring says it writes."""
    out = dst.clone()
    for b, n in enumerate(tokens.tolist()):
        for position in range(max(n, 0)):
            page, offset = divmod(position, PAGE)
            out[:, dst_pages[b, page], offset] = src[:, src_pages[b, page], offset]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_copy_kv_positions_writes_each_active_rows_positions_and_nothing_else(seed):
    rng = random.Random(seed)
    rows = rng.randint(1, 4)
    free = rng.sample(range(PAGES), PAGES)
    shared = seed % 3 == 0  # every third case: two rows name one destination page (the last writer wins)
    tokens = torch.tensor([rng.choice([0, -1, *range(1, MAX_PAGES * PAGE + 1)]) for _ in range(rows)],
                          dtype=torch.int32)
    dst_pages = torch.full((rows, MAX_PAGES), -1, dtype=torch.int32)
    src_pages = torch.full((rows, MAX_PAGES), -1, dtype=torch.int32)
    for b in range(rows):
        needed = -(-max(int(tokens[b]), 0) // PAGE)
        src_pages[b, :needed] = torch.tensor(rng.sample(range(PAGES), needed), dtype=torch.int32)
        dst_pages[b, :needed] = torch.tensor([free.pop() for _ in range(needed)], dtype=torch.int32)
    active = [b for b in range(rows) if tokens[b] > 0]
    if shared and len(active) >= 2:
        dst_pages[active[1], 0] = dst_pages[active[0], 0]
    dst_k, dst_v, src_k, src_v = _caches(seed)
    want_k = _reference(dst_k, src_k, dst_pages, src_pages, tokens)
    want_v = _reference(dst_v, src_v, dst_pages, src_pages, tokens)
    torch.ops.flare.copy_kv_positions(dst_k, dst_v, src_k, src_v, dst_pages, src_pages, tokens)
    assert torch.equal(dst_k, want_k) and torch.equal(dst_v, want_v)


def test_a_missing_page_in_any_row_is_refused_before_any_row_is_written():
    dst_k, dst_v, src_k, src_v = _caches(0)
    before = dst_k.clone(), dst_v.clone()
    tokens = torch.tensor([PAGE + 1, PAGE], dtype=torch.int32)  # row 0 complete, row 1 lacks its page
    dst_pages = torch.tensor([[0, 1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    src_pages = torch.tensor([[2, 3, -1, -1], [4, -1, -1, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1: a page of positions 0..3 is missing"):
        state_copy.copy_kv_positions(dst_k, dst_v, src_k, src_v, dst_pages, src_pages, tokens)
    assert torch.equal(dst_k, before[0]) and torch.equal(dst_v, before[1])


def test_copy_rows_and_lengths_take_the_active_rows_and_refuse_what_the_docstring_refuses():
    dst, src = torch.zeros(4, 3, dtype=torch.int64), torch.arange(12, dtype=torch.int64).reshape(4, 3)
    tokens = torch.tensor([5, 0, 7], dtype=torch.int32)
    state_copy.copy_rows(dst, src, torch.tensor([2, 0, 1]), torch.tensor([3, 3, 0]), tokens)
    assert dst.tolist() == [[0] * 3, src[0].tolist(), src[3].tolist(), [0] * 3]  # row 1 (index 0 <- 3) is inactive
    with pytest.raises(ValueError, match=r"destination rows \[4, 1\] outside 0..3"):
        state_copy.copy_rows(dst, src, torch.tensor([4, 0, 1]), torch.tensor([0, 0, 0]), tokens)
    with pytest.raises(ValueError, match=r"share a destination \(\[1, 1\]\)"):
        state_copy.copy_rows(dst, src, torch.tensor([1, 0, 1]), torch.tensor([0, 0, 0]), tokens)
    lengths, committed = torch.zeros(4, dtype=torch.int32), torch.tensor([7, 5, 0, 0], dtype=torch.int32)
    state_copy.copy_lengths(lengths, committed, torch.tensor([3, 0, 2]), torch.tensor([1, 0, 0]), tokens)
    assert lengths.tolist() == [0, 0, 7, 5]
    with pytest.raises(ValueError, match=r"committed lengths \[5, 5\] differ from the copied positions \[5, 7\]"):
        state_copy.copy_lengths(lengths, committed, torch.tensor([3, 0, 2]), torch.tensor([1, 0, 1]), tokens)


def test_rows_naming_one_destination_page_write_in_row_order_whole_or_partial():
    """Row 0 fills part of page 5 and row 1 all of it: row 1, the later row, wins every position of it."""
    dst_k, dst_v, src_k, src_v = _caches(3)
    tokens = torch.tensor([2, PAGE], dtype=torch.int32)
    dst_pages = torch.tensor([[5, -1, -1, -1], [5, -1, -1, -1]], dtype=torch.int32)
    src_pages = torch.tensor([[1, -1, -1, -1], [2, -1, -1, -1]], dtype=torch.int32)
    want_k = _reference(dst_k, src_k, dst_pages, src_pages, tokens)
    state_copy.copy_kv_positions(dst_k, dst_v, src_k, src_v, dst_pages, src_pages, tokens)
    assert torch.equal(dst_k, want_k) and torch.equal(dst_k[:, 5], src_k[:, 2])
