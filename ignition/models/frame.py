"""One packed frame: gather row inputs, run the model, sample, verify, commit slot state.

Every program kind is this function at fixed sizes (``FrameShape``). Rows are
the dense active lane list; row ``b`` owns ``query_lens[b]`` packed tokens at
the prefix sum of the earlier lengths (spec C14). At most one row is the
prompt row (``prefill_row``); the others are decode rows whose first token is
the slot's ``pending`` token and whose further tokens are host drafts.

Decode and verification rows sample a target token after each of their
positions, accept the leading drafts that equal those targets, and commit the
accepted drafts plus one target token (bonus or replacement). The prompt row
commits its whole chunk and, when the chunk ends the prompt, samples the first
output token. Inactive rows (length 0) and unused capacity write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

import helios.ops  # noqa: F401  (registers flare::write_slot_state)
from ignition.models.qwen3 import PagedBatch, Qwen3, Weights
from ignition.models.sampling import sample


@dataclass(frozen=True, slots=True)
class FrameShape:
    batch: int  # B rows
    width: int  # W target positions per decode row, the pending token included
    packed: int  # T packed token capacity
    prompt: int  # C prompt tokens of the prompt row (0: no prompt row)
    scored: bool = False  # also score the prompt's tokens (scored prefill)


@dataclass(frozen=True, slots=True)
class FrameInputs:
    """A frame's tensors; the program modules name and order them."""

    k_cache: Tensor
    v_cache: Tensor
    pending: Tensor
    seq_lens: Tensor
    page_table: Tensor
    row_slots: Tensor
    query_lens: Tensor
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    seed: Tensor
    prefill_row: Tensor | None = None  # int32[1]; -1 = no prompt row this frame
    prompt_tokens: Tensor | None = None
    prompt_start: Tensor | None = None
    prompt_final: Tensor | None = None
    draft_tokens: Tensor | None = None
    next_prompt_token: Tensor | None = None


@dataclass(frozen=True, slots=True)
class Rows:
    """Per-row and per-packed-token geometry of a frame."""

    lens: Tensor  # int64 [B]
    starts: Tensor  # int64 [B] packed offset of each row
    is_prompt: Tensor  # bool [B]
    slot_pending: Tensor  # int64 [B] pending token of each row's slot
    start_pos: Tensor  # int64 [B] absolute position of each row's first token
    row_of: Tensor  # int64 [T] row owning each packed token
    index_in_row: Tensor  # int64 [T]
    valid: Tensor  # bool [T]


def run_frame(model: Qwen3, w: Weights, shape: FrameShape, x: FrameInputs) -> dict[str, Tensor]:
    rows = _rows(shape, x)
    tokens, positions = _packed_tokens(shape, x, rows)
    batch = PagedBatch(x.page_table, x.row_slots, x.query_lens, rows.start_pos.int())
    hidden = model(w, tokens, positions, batch, x.k_cache, x.v_cache)  # [T, hidden]
    picks = _sample_index(shape, rows)  # [B, W]
    logits = model.logits(w, hidden[picks])[..., : model.config.sampled_vocab_size]  # [B, W, V]
    produced = rows.start_pos[:, None] + (picks - rows.starts[:, None]) + 1
    targets = sample(logits, x.temperature, x.top_k, x.top_p, x.seed, produced)
    out = _verify_and_commit(shape, x, rows, targets)
    if shape.scored:
        out["logprobs"] = _prompt_logprobs(model, w, shape, x, hidden)
    return out


def _rows(shape: FrameShape, x: FrameInputs) -> Rows:
    lens = x.query_lens.long()
    ends = lens.cumsum(0)
    starts = ends - lens
    t = torch.arange(shape.packed, device=lens.device)
    row_of = torch.searchsorted(ends, t, right=True).clamp(max=shape.batch - 1)
    # Inactive rows may carry any slot id: clamp reads, never write through them.
    slots = x.row_slots.long().clamp(0, x.pending.shape[0] - 1)
    is_prompt = _prompt_rows(shape, x)
    seq = x.seq_lens.long()[slots]
    start_pos = torch.where(is_prompt, x.prompt_start.long(), seq) if shape.prompt else seq
    return Rows(lens, starts, is_prompt, x.pending[slots], start_pos, row_of, t - starts[row_of], t < ends[-1])


def _prompt_rows(shape: FrameShape, x: FrameInputs) -> Tensor:
    device = x.query_lens.device
    if not shape.prompt:
        return torch.zeros(shape.batch, dtype=torch.bool, device=device)
    return torch.arange(shape.batch, device=device) == x.prefill_row.long()


def _packed_tokens(shape: FrameShape, x: FrameInputs, rows: Rows) -> tuple[Tensor, Tensor]:
    """Input token and absolute position of every packed token (``[T]`` each)."""
    j = rows.index_in_row
    tokens = rows.slot_pending[rows.row_of]
    if shape.width > 1:
        drafts = x.draft_tokens[rows.row_of, (j - 1).clamp(0, shape.width - 2)]
        tokens = torch.where(j > 0, drafts, tokens)
    if shape.prompt:
        prompt = x.prompt_tokens[j.clamp(max=shape.prompt - 1)]
        tokens = torch.where(rows.is_prompt[rows.row_of], prompt, tokens)
    positions = rows.start_pos[rows.row_of] + j
    return torch.where(rows.valid, tokens, 0), torch.where(rows.valid, positions, 0)


def _sample_index(shape: FrameShape, rows: Rows) -> Tensor:
    """Packed index whose logits produce each row's targets ``[B, W]``.

    Decode rows: each of their positions. The prompt row: its last token.
    """
    k = torch.arange(shape.width, device=rows.lens.device)
    picks = rows.starts[:, None] + k[None, :]
    last = (rows.starts + rows.lens - 1).clamp(min=0)[:, None].expand(-1, shape.width)
    picks = torch.where(rows.is_prompt[:, None], last, picks)
    return picks.clamp(0, shape.packed - 1)


def _verify_and_commit(shape: FrameShape, x: FrameInputs, rows: Rows, targets: Tensor) -> dict[str, Tensor]:
    accepted = _accepted_drafts(shape, x, rows, targets)  # [B]
    bonus = targets.gather(1, accepted[:, None])[:, 0]
    k = torch.arange(shape.width, device=targets.device)[None, :]
    committed = torch.where(k == accepted[:, None], bonus[:, None], 0)
    if shape.width > 1:
        drafts = torch.cat([x.draft_tokens, torch.zeros_like(x.draft_tokens[:, :1])], dim=1)
        committed = torch.where(k < accepted[:, None], drafts, committed)
    active = rows.lens > 0
    decoding = active & ~rows.is_prompt
    count = torch.where(decoding, accepted + 1, 0)
    new_pending = bonus
    new_seq = rows.start_pos + accepted + 1
    if shape.prompt:
        final = rows.is_prompt & x.prompt_final
        count = torch.where(final, 1, count)
        new_pending = torch.where(rows.is_prompt & ~x.prompt_final, rows.slot_pending, bonus)
        new_seq = torch.where(rows.is_prompt, rows.start_pos + rows.lens, new_seq)
    committed = torch.where(k < count[:, None], committed, 0)
    torch.ops.flare.write_slot_state(
        x.pending, x.seq_lens, x.row_slots, x.query_lens, new_pending, new_seq.to(x.seq_lens.dtype)
    )
    return {"tokens": committed, "num_tokens": count.int()}


def _accepted_drafts(shape: FrameShape, x: FrameInputs, rows: Rows, targets: Tensor) -> Tensor:
    """Leading drafts of each decode row that equal the target sampled before them."""
    if shape.width == 1:
        return torch.zeros(shape.batch, dtype=torch.int64, device=targets.device)
    k = torch.arange(shape.width - 1, device=targets.device)[None, :]
    offered = (k + 1 < rows.lens[:, None]) & ~rows.is_prompt[:, None]
    match = (x.draft_tokens == targets[:, :-1]) & offered
    return match.long().cumprod(dim=1).sum(dim=1)


def _prompt_logprobs(model: Qwen3, w: Weights, shape: FrameShape, x: FrameInputs, hidden: Tensor) -> Tensor:
    """log P(token after position i) for the prompt row's tokens ``[C]`` (prompt row 0 at offset 0)."""
    logits = model.logits(w, hidden[: shape.prompt])[..., : model.config.sampled_vocab_size]
    i = torch.arange(shape.prompt, device=hidden.device)
    length = x.query_lens[0].long()
    following = x.prompt_tokens[(i + 1).clamp(max=shape.prompt - 1)]
    following = torch.where(i == length - 1, x.next_prompt_token, following).clamp(0, logits.shape[-1] - 1)
    picked = logits.log_softmax(-1).gather(1, following[:, None])[:, 0]
    return torch.where(i < length, picked, 0.0)
