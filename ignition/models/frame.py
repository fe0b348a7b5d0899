"""One packed frame: gather row inputs, run the model, sample, verify, commit slot state.

Every program kind is this function at fixed sizes (``FrameShape``). Rows are
the dense active lane list; row ``b`` owns ``query_lens[b]`` packed tokens at
the prefix sum of the earlier lengths (spec C14). At most one row is the
prompt row (``prefill_row``); the others are decode rows whose first token is
the slot's ``pending`` token and whose further tokens are drafts: the host's
(copy proposals) or the draft model's, drawn first in the same frame
(learned proposals, ``ignition.models.proposals``; prefix_limit frames also
allocate their packed rows from the draft's confidence).

Decode and verification rows sample a target token after each of their
positions, accept the leading drafts that equal those targets, and commit the
accepted drafts plus one target token (bonus or replacement). The prompt row
commits its whole chunk and, when the chunk ends the prompt, samples the first
output token. Draft-keeping frames then run the draft model over the
committed input tokens, so its cache covers every committed position.
Inactive rows (length 0) and unused capacity write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

import helios.ops  # noqa: F401  (registers flare::write_slot_state)
from ignition.models.qwen3 import PagedBatch, Qwen3, Weights
from ignition.models.packing import packing
from ignition.models.proposals import Proposals, absorb, allocate, draft_weights, propose, survival
from ignition.models.sampling import sample


@dataclass(frozen=True, slots=True)
class FrameShape:
    batch: int  # B rows
    width: int  # W target positions per decode row, the pending token included
    packed: int  # T packed token capacity
    prompt: int  # C prompt tokens of the prompt row (0: no prompt row)
    scored: bool = False  # also score the prompt's tokens (scored prefill)
    absorb: bool = False  # keeps the draft cache: draft forward over the committed input tokens
    learned_depth: int = 0  # D learned proposal steps (0: drafts, if any, come from the host)
    prefix_limit: bool = False  # query_lens are ceilings; the frame allocates its packed rows (S2)
    speculative: bool = False  # reports verified_lens (speculative and mixed kinds)

    @property
    def uses_draft(self) -> bool:
        return self.absorb or self.learned_depth > 0


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
    draft_k_cache: Tensor | None = None
    draft_v_cache: Tensor | None = None


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


def run_frame(model: Qwen3, w: Weights, shape: FrameShape, x: FrameInputs, draft: Qwen3 | None = None) -> dict[str, Tensor]:
    """One frame; ``draft`` (with ``draft.``-prefixed weights in ``w``) when ``shape.uses_draft``."""
    dw = draft_weights(w) if shape.uses_draft else {}
    proposals = _propose(model, draft, dw, shape, x) if shape.learned_depth else None
    if proposals is not None:
        lens = allocate(proposals.joint, x.query_lens, shape.packed) if shape.prefix_limit else x.query_lens
        x = replace(x, query_lens=lens, draft_tokens=proposals.tokens)
    rows = _rows(shape, x)
    tokens, positions = _packed_tokens(shape, x, rows)
    batch = PagedBatch(x.page_table, x.row_slots, x.query_lens, rows.start_pos.int())
    hidden = model(w, tokens, positions, batch, x.k_cache, x.v_cache)  # [T, hidden]
    picks = _sample_index(shape, rows)  # [B, W]
    logits = model.logits(w, hidden[picks])[..., : model.config.sampled_vocab_size]  # [B, W, V]
    produced = rows.start_pos[:, None] + (picks - rows.starts[:, None]) + 1
    targets = sample(logits, x.temperature, x.top_k, x.top_p, x.seed, produced)
    out, committed_lens = _verify_and_commit(shape, x, rows, targets)
    if shape.absorb:
        absorb(draft, dw, x, tokens, rows.starts, rows.start_pos, committed_lens)
    if shape.scored:
        out["logprobs"] = _prompt_logprobs(model, w, shape, x, hidden)
    if shape.speculative:
        out["verified_lens"] = x.query_lens.int()
    if proposals is not None:
        out.update(_sidecars(shape, x, rows, logits, proposals))
    return out


def _propose(model: Qwen3, draft: Qwen3, dw: Weights, shape: FrameShape, x: FrameInputs) -> Proposals:
    """Learned proposals: every active row draws all D (prefix_limit) or the ones it verifies."""
    rows = _rows(shape, x)
    wanted = (x.query_lens > 0).long() * shape.learned_depth if shape.prefix_limit else rows.lens - 1
    steps = torch.where(rows.is_prompt, 0, wanted.clamp(min=0))
    return propose(draft, dw, x, rows.start_pos, steps, shape.learned_depth, model.config.sampled_vocab_size)


def _sidecars(shape: FrameShape, x: FrameInputs, rows: Rows, logits: Tensor, proposals: Proposals) -> dict[str, Tensor]:
    """Survival (C13) and, for prefix_limit programs, the confidence sidecar (C12)."""
    offered = torch.where(rows.is_prompt, 0, (rows.lens - 1).clamp(min=0))
    out = {"survival": survival(logits, proposals, x, offered)}
    if shape.prefix_limit:
        out["confidence"] = _confidence(x, proposals)
    return out


def _confidence(x: FrameInputs, proposals: Proposals) -> Tensor:
    """``[2, S, D]``: per-position and joint prefix draft probabilities by slot; 0 for slots not in the frame."""
    slots = x.pending.shape[0]
    target = torch.where(x.query_lens > 0, x.row_slots.long(), slots)  # inactive rows land on a spare row
    per_position = torch.zeros(slots + 1, proposals.tokens.shape[1], device=x.pending.device)
    per_position = per_position.index_copy(0, target, proposals.confidence)[:slots]
    return torch.stack([per_position, per_position.cumprod(dim=1)])


def _rows(shape: FrameShape, x: FrameInputs) -> Rows:
    lens = x.query_lens.long()
    pack = packing(lens, shape.packed)
    # Inactive rows may carry any slot id: clamp reads, never write through them.
    slots = x.row_slots.long().clamp(0, x.pending.shape[0] - 1)
    is_prompt = _prompt_rows(shape, x)
    seq = x.seq_lens.long()[slots]
    start_pos = torch.where(is_prompt, x.prompt_start.long(), seq) if shape.prompt else seq
    return Rows(lens, pack.starts, is_prompt, x.pending[slots], start_pos, pack.row_of, pack.index_in_row, pack.valid)


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


def _verify_and_commit(shape: FrameShape, x: FrameInputs, rows: Rows, targets: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """Outputs ``tokens``/``num_tokens`` and each row's committed input tokens (0 when inactive)."""
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
    committed_lens = torch.where(active, new_seq - rows.start_pos, 0)
    return {"tokens": committed, "num_tokens": count.int()}, committed_lens


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
