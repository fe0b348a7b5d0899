"""``flare::paged_attention``, Python reference kernel: attention for packed variable-length rows
over the paged cache (the native kernel in ``csrc/flare_ops.cpp`` computes the same).

Each active row's queries attend to the row's committed context plus its own
new tokens, causally (query ``i`` sees positions ``<= start + i``). The new
keys must already be in the cache (``flare::write_kv`` first). Work follows
the real context of each row; unused packed capacity gets zeros.
"""

from __future__ import annotations

import torch

from helios.ops.layout import PackedRows, active_rows, slot_positions


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
    """Grouped-query attention of one row: each KV head serves its group of query heads
    with one batched matmul (no KV repetition; several times faster than SDPA's GQA
    path on CPU for decode)."""
    k, v = _row_context(k_layer, v_layer, page_table, row)  # [context, kv_heads, head_dim]
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = q.view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * length, dim)
    scores = torch.bmm(q, k.permute(1, 2, 0)) * scale  # [kv_heads, group * length, context]
    if length > 1:  # a single query sees the whole context: no mask needed
        key_pos = torch.arange(row.end)
        causal = key_pos[None, :] <= torch.arange(row.start, row.end)[:, None]  # [length, context]
        scores = scores.view(kv_heads, group, length, row.end).masked_fill(~causal, float("-inf"))
        scores = scores.view(kv_heads, group * length, row.end)
    probs = scores.float().softmax(-1).to(v.dtype)  # softmax in fp32 whatever the cache dtype
    out = torch.bmm(probs, v.transpose(0, 1))  # [kv_heads, group * length, head_dim]
    return out.view(kv_heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads, dim)


def _row_context(k_layer, v_layer, page_table, row: PackedRows):
    """The row's first ``row.end`` cached keys and values, gathered page by page."""
    page_size = k_layer.shape[1]
    used = -(-row.end // page_size)
    if used > page_table.shape[1] or not 0 <= row.slot < page_table.shape[0]:
        slot_positions(page_table, page_size, row, 0, row.end)  # raises the descriptive error
    pages = page_table[row.slot, :used].long()
    if bool((pages < 0).any()):
        slot_positions(page_table, page_size, row, 0, row.end)  # names the missing block
    k = k_layer[pages].flatten(0, 1)[: row.end]
    v = v_layer[pages].flatten(0, 1)[: row.end]
    return k, v
