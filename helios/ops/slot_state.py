"""``flare::write_slot_state`` and ``flare::write_token_history``, Python reference kernels: commit each active
row's pending token and length, and its token history (the penalties' counts and prompt ids).

Programs keep per-slot request state on the device (``pending`` next input
token, ``seq_lens`` committed KV length) so that a decode frame can be queued
behind another without the host seeing the first one's output. Only rows with
a positive query length write; inactive rows may carry any slot id.
"""

from __future__ import annotations

import torch


def write_slot_state(
    pending: torch.Tensor,  # int64 [slots]
    seq_lens: torch.Tensor,  # int32 [slots]
    row_slots: torch.Tensor,  # int32 [B]
    query_lens: torch.Tensor,  # int32 [B]
    new_pending: torch.Tensor,  # int64 [B]
    new_seq_lens: torch.Tensor,  # int32 [B]
) -> None:
    active = query_lens > 0
    slots = row_slots[active].long()
    if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < pending.shape[0]):
        raise ValueError(f"row_slots {slots.tolist()} outside 0..{pending.shape[0] - 1}")
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"active rows share a slot ({slots.tolist()}): each slot appears in at most one active row")
    pending.index_put_((slots,), new_pending[active])
    seq_lens.index_put_((slots,), new_seq_lens[active])



def write_token_history(
    token_counts: torch.Tensor,  # int32 [slots, V]: output tokens the slot's request committed, by id
    prompt_seen: torch.Tensor,  # bool [slots, V]: ids in the slot's prompt so far
    row_slots: torch.Tensor,  # int32 [B]
    query_lens: torch.Tensor,  # int32 [B]
    new_counts: torch.Tensor,  # int32 [B, V]: each active row's slot's counts after this frame
    new_seen: torch.Tensor,  # bool [B, V]
) -> None:
    """Replace the history rows of every active row's slot (the penalties' token history, program
    contract version 3); inactive rows write nothing (the native kernel in ``csrc/flare_ops.cpp`` does the same)."""
    active = query_lens > 0
    slots = row_slots[active].long()
    if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < token_counts.shape[0]):
        raise ValueError(f"row_slots {slots.tolist()} outside 0..{token_counts.shape[0] - 1}")
    token_counts.index_put_((slots,), new_counts[active])
    prompt_seen.index_put_((slots,), new_seen[active])
