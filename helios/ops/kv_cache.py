"""``flare::write_kv``, Python reference kernel: store a packed frame's new keys and values in the paged cache.

Caches are ``[layers, num_pages, page_size, kv_heads, head_dim]``; one tensor
for all layers lets each program take a single K and a single V input, and
the op writes the base tensor in place (a view input would make compilers
copy the whole cache).
"""

from __future__ import annotations

import torch

from helios.ops.layout import active_rows, slot_positions


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,  # [T, kv_heads, head_dim] packed new keys
    v: torch.Tensor,
    page_table: torch.Tensor,  # int32 [slots, max_pages_per_slot]
    row_slots: torch.Tensor,  # int32 [B]
    query_lens: torch.Tensor,  # int32 [B]; 0 = inactive, writes nothing
    start_pos: torch.Tensor,  # int32 [B] position of each row's first new token
) -> None:
    page_size = k_cache.shape[2]
    for row in active_rows(row_slots, query_lens, start_pos):
        pages, offsets = slot_positions(page_table, page_size, row, row.start, row.end)
        packed = slice(row.offset, row.offset + row.length)
        k_cache[layer].index_put_((pages, offsets), k[packed])
        v_cache[layer].index_put_((pages, offsets), v[packed])

