"""Host-side view of a packed frame, shared by the CPU kernels.

A frame packs B logical rows into one token axis: row ``b`` owns the
``query_lens[b]`` tokens starting at the prefix sum of the earlier lengths
(spec C14), whatever physical slot it serves. Rows with length 0 are
inactive. Inside a kernel the op is opaque to export, so reading the small
per-row tensors into Python here is fine and keeps the work proportional to
the live rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


NO_PAGE = -1  # a page-table entry the slot does not own (page 0 is a real page)


@dataclass(frozen=True, slots=True)
class PackedRows:
    """One active row of a packed frame."""

    row: int  # index in the dense active lane list
    slot: int  # physical request slot (row of the page table)
    offset: int  # first packed token of the row
    length: int  # logical query length (> 0)
    start: int  # committed context before this row's tokens

    @property
    def end(self) -> int:
        """Context length once the row's tokens are written."""
        return self.start + self.length


def active_rows(row_slots: torch.Tensor, query_lens: torch.Tensor, start_pos: torch.Tensor) -> list[PackedRows]:
    """The rows with a positive query length, with their packed offsets."""
    rows, offset = [], 0
    for row, (slot, length, start) in enumerate(
        zip(row_slots.tolist(), query_lens.tolist(), start_pos.tolist(), strict=True)
    ):
        if length < 0:
            raise ValueError(f"query_lens[{row}] = {length}: query lengths must be >= 0")
        if length:
            rows.append(PackedRows(row, slot, offset, length, start))
        offset += length
    return rows


def slot_positions(page_table: torch.Tensor, page_size: int, row: PackedRows, first: int, stop: int):
    """(pages, offsets) addressing cache positions ``first..stop-1`` of the row's slot."""
    num_slots, max_pages = page_table.shape
    if not 0 <= row.slot < num_slots:
        raise ValueError(f"row {row.row}: slot {row.slot} outside the page table's {num_slots} slots")
    if stop > max_pages * page_size:
        raise ValueError(
            f"row {row.row}: context {stop} exceeds the slot capacity "
            f"{max_pages} pages x {page_size} tokens"
        )
    positions = torch.arange(first, stop, dtype=torch.long)
    pages = page_table[row.slot].long()[positions // page_size]
    if bool((pages < 0).any()):
        block = int((positions // page_size)[pages < 0][0])
        raise ValueError(
            f"row {row.row}: slot {row.slot} has no page for block {block} (positions {first}..{stop - 1}); "
            "the host must reserve every page a frame writes or reads before submitting it"
        )
    return pages, positions % page_size
