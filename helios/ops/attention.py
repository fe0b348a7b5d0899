"""``flare::paged_attention``: attention for packed variable-length rows over the paged cache.

Each active row's queries attend to the row's committed context plus its own
new tokens, causally (query ``i`` sees positions ``<= start + i``). The new
keys must already be in the cache (``flare::write_kv`` first). Work follows
the real context of each row; unused packed capacity gets zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helios.ops.layout import PackedRows, active_rows, slot_positions


@torch.library.custom_op("flare::paged_attention", mutates_args=(), device_types="cpu")
def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim] packed queries
    k_cache: torch.Tensor,  # [layers, num_pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,  # int32 [slots, max_pages_per_slot]
    row_slots: torch.Tensor,  # int32 [B]
    query_lens: torch.Tensor,  # int32 [B]
    start_pos: torch.Tensor,  # int32 [B]
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    for row in active_rows(row_slots, query_lens, start_pos):
        packed = slice(row.offset, row.offset + row.length)
        out[packed] = _row_attention(q[packed], k_cache[layer], v_cache[layer], page_table, row, scale)
    return out


def _row_attention(q, k_layer, v_layer, page_table, row: PackedRows, scale: float) -> torch.Tensor:
    k, v = _row_context(k_layer, v_layer, page_table, row)  # [context, kv_heads, head_dim]
    causal = None
    if row.length > 1:  # a single query sees the whole context: no mask needed
        key_pos = torch.arange(row.end)
        causal = key_pos[None, :] <= torch.arange(row.start, row.end)[:, None]  # [length, context]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def _row_context(k_layer, v_layer, page_table, row: PackedRows):
    """The row's first ``row.end`` cached keys and values, gathered page by page."""
    page_size = k_layer.shape[1]
    used = -(-row.end // page_size)
    if used > page_table.shape[1] or not 0 <= row.slot < page_table.shape[0]:
        slot_positions(page_table, page_size, row, 0, row.end)  # raises the descriptive error
    pages = page_table[row.slot, :used].long()
    k = k_layer[pages].flatten(0, 1)[: row.end]
    v = v_layer[pages].flatten(0, 1)[: row.end]
    return k, v


@paged_attention.register_fake
def _(q, k_cache, v_cache, layer, page_table, row_slots, query_lens, start_pos, scale):
    return torch.empty_like(q)
