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

Sampling reads the logits after the request's controls (penalties over the
slot's token history, logit bias; ``ignition.models.sampling``), and the
commit updates that history. Every sampled position also reports the raw
model distribution's log-probability of its token and its top
``TOP_LOGPROBS`` alternatives, so logprobs never need a host pass over the
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

import helios.ops  # noqa: F401  (registers flare::write_slot_state)
from ignition.models.qwen3 import PagedBatch, Qwen3, Weights
from ignition.models.packing import packing
from ignition.models.proposals import Proposals, absorb, allocate, draft_weights, propose, survival
from flare_contract.sampling import TOP_LOGPROBS
from ignition.models.sampling import LogitControls, TokenHistory, output_logprobs, process_logits, sample


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
    token_counts: Tensor | None = None  # int32 [S, V] state: output tokens committed per slot, by id
    prompt_seen: Tensor | None = None  # bool [S, V] state: ids of each slot's prompt
    min_p: Tensor | None = None
    repetition_penalty: Tensor | None = None
    presence_penalty: Tensor | None = None
    frequency_penalty: Tensor | None = None
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    bias_until: Tensor | None = None

    @property
    def controls(self) -> LogitControls:
        return LogitControls(self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                             self.bias_ids, self.bias_values, self.bias_until)


@dataclass(frozen=True, slots=True)
class SlotHistory:
    """Each row's token history at its first sampled position, ``[B, V]`` (prompt rows: fresh at start 0)."""

    counts: Tensor  # int32
    seen: Tensor  # bool


def top_logprobs_width(vocab: int) -> int:
    """Alternatives per position the programs report: ``TOP_LOGPROBS``, or the whole vocabulary if smaller."""
    return min(TOP_LOGPROBS, vocab)


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
    vocab = model.config.sampled_vocab_size
    dw = draft_weights(w) if shape.uses_draft else {}
    history = _slot_history(shape, x, _rows(shape, x), vocab)
    proposals = _propose(model, draft, dw, shape, x, history) if shape.learned_depth else None
    if proposals is not None:
        lens = allocate(proposals.joint, x.query_lens, shape.packed) if shape.prefix_limit else x.query_lens
        x = replace(x, query_lens=lens, draft_tokens=proposals.tokens)
    rows = _rows(shape, x)
    tokens, positions = _packed_tokens(shape, x, rows)
    batch = PagedBatch(x.page_table, x.row_slots, x.query_lens, rows.start_pos.int())
    hidden = model(w, tokens, positions, batch, x.k_cache, x.v_cache)  # [T, hidden]
    picks = _sample_index(shape, rows)  # [B, W]
    logits = model.logits(w, hidden[picks])[..., :vocab]  # [B, W, V]
    produced = rows.start_pos[:, None] + (picks - rows.starts[:, None]) + 1
    processed = process_logits(logits, x.controls, _position_history(shape, x, history), produced)
    targets = sample(processed, x.temperature, x.top_k, x.top_p, x.seed, produced, x.min_p)
    out, committed_lens, (new_pending, new_seq) = _verify_and_commit(shape, x, rows, targets)
    out.update(_logprob_outputs(logits, targets, out["num_tokens"]))
    if shape.absorb:
        absorb(draft, dw, x, tokens, rows.starts, rows.start_pos, committed_lens)
    if shape.scored:
        out.update(_prompt_logprobs(model, w, shape, x, hidden))
    if shape.speculative:
        out["verified_lens"] = x.query_lens.int()
    if proposals is not None:
        out.update(_sidecars(shape, x, rows, processed, proposals))
    # The slot state is written last. Every value above was read from the state as it was before the frame
    # (start positions, pending tokens, token history), and Inductor may compute such a read lazily inside a
    # later kernel: a write placed before the draft's absorption once let AOTInductor read the advanced
    # seq_lens there, so compiled draft-keeping programs wrote the draft's K/V one or more positions late.
    torch.ops.flare.write_slot_state(
        x.pending, x.seq_lens, x.row_slots, x.query_lens, new_pending, new_seq.to(x.seq_lens.dtype)
    )
    _write_history(x, history, out, vocab)
    return out


def _slot_history(shape: FrameShape, x: FrameInputs, rows: Rows, vocab: int) -> SlotHistory:
    """Each row's history before its first sampled position.

    A decode row reads its slot's state. The prompt row starts afresh when its
    chunk begins the prompt (the slot's state belongs to its previous request)
    and adds its chunk's ids to the prompt ids; it has no output yet.
    """
    slots = x.row_slots.long().clamp(0, x.pending.shape[0] - 1)
    counts, seen = x.token_counts[slots], x.prompt_seen[slots]
    if not shape.prompt:
        return SlotHistory(counts, seen)
    fresh = (rows.is_prompt & (rows.start_pos == 0))[:, None]
    i = torch.arange(shape.prompt, device=seen.device)
    chunk_len = (rows.lens * rows.is_prompt).sum()
    ids = x.prompt_tokens
    in_chunk = (i < chunk_len) & (ids < vocab)
    chunk = torch.zeros(vocab, device=seen.device).scatter_add(0, ids.clamp(0, vocab - 1), in_chunk.float()) > 0
    seen = torch.where(fresh, False, seen) | (rows.is_prompt[:, None] & chunk[None, :])
    return SlotHistory(torch.where(fresh, 0, counts), seen)


def _position_history(shape: FrameShape, x: FrameInputs, history: SlotHistory) -> TokenHistory:
    """``[B, W, V]``: position k of a decode row has also seen the k drafts it verifies before it."""
    counts = history.counts.float()[:, None, :].expand(-1, shape.width, -1)
    if shape.width > 1:
        drafts = torch.nn.functional.one_hot(x.draft_tokens.clamp(0, counts.shape[-1] - 1), counts.shape[-1])
        counts = counts + torch.cat([torch.zeros_like(drafts[:, :1]), drafts.cumsum(1)], 1).float()[:, : shape.width]
    return TokenHistory(counts, history.seen[:, None, :].expand(-1, shape.width, -1))


def _write_history(x: FrameInputs, history: SlotHistory, out: dict[str, Tensor], vocab: int) -> None:
    """The slot's history after the frame: its committed output tokens counted."""
    tokens, count = out["tokens"], out["num_tokens"]
    k = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    added = torch.zeros_like(history.counts).scatter_add(1, tokens.clamp(0, vocab - 1), (k < count[:, None]).int())
    torch.ops.flare.write_token_history(x.token_counts, x.prompt_seen, x.row_slots, x.query_lens,
                                        history.counts + added, history.seen)


def _logprob_outputs(logits: Tensor, targets: Tensor, count: Tensor) -> dict[str, Tensor]:
    """Raw-distribution logprobs of each committed token (position k: the target there, which is the
    accepted draft or the bonus token) and the top alternatives; 0 past ``num_tokens``."""
    picked, best, best_ids = output_logprobs(logits, targets, top_logprobs_width(logits.shape[-1]))
    real = torch.arange(targets.shape[1], device=targets.device)[None, :] < count[:, None]
    return {"token_logprobs": torch.where(real, picked, 0.0),
            "top_logprobs": torch.where(real[..., None], best, 0.0),
            "top_token_ids": torch.where(real[..., None], best_ids, 0)}


def _propose(model: Qwen3, draft: Qwen3, dw: Weights, shape: FrameShape, x: FrameInputs,
             history: SlotHistory) -> Proposals:
    """Learned proposals: every active row draws all D (prefix_limit) or the ones it verifies."""
    rows = _rows(shape, x)
    wanted = (x.query_lens > 0).long() * shape.learned_depth if shape.prefix_limit else rows.lens - 1
    steps = torch.where(rows.is_prompt, 0, wanted.clamp(min=0))
    return propose(draft, dw, x, rows.start_pos, steps, shape.learned_depth, model.config.sampled_vocab_size,
                   TokenHistory(history.counts.float()[:, None], history.seen[:, None]))


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


def _verify_and_commit(shape: FrameShape, x: FrameInputs, rows: Rows,
                       targets: Tensor) -> tuple[dict[str, Tensor], Tensor, tuple[Tensor, Tensor]]:
    """Outputs ``tokens``/``num_tokens``, each row's committed input tokens (0 when inactive), and the
    slot state after the frame (pending token, sequence length per row) for ``run_frame`` to write last."""
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
    committed_lens = torch.where(active, new_seq - rows.start_pos, 0)
    return {"tokens": committed, "num_tokens": count.int()}, committed_lens, (new_pending, new_seq)


def _accepted_drafts(shape: FrameShape, x: FrameInputs, rows: Rows, targets: Tensor) -> Tensor:
    """Leading drafts of each decode row that equal the target sampled before them."""
    if shape.width == 1:
        return torch.zeros(shape.batch, dtype=torch.int64, device=targets.device)
    k = torch.arange(shape.width - 1, device=targets.device)[None, :]
    offered = (k + 1 < rows.lens[:, None]) & ~rows.is_prompt[:, None]
    match = (x.draft_tokens == targets[:, :-1]) & offered
    return match.long().cumprod(dim=1).sum(dim=1)


def _prompt_logprobs(model: Qwen3, w: Weights, shape: FrameShape, x: FrameInputs, hidden: Tensor) -> dict[str, Tensor]:
    """log P(token after position i) for the prompt row's tokens ``[C]`` (prompt row 0 at offset 0), and the
    raw distribution's best ``[C, K]`` there; 0 at and after the chunk's length."""
    vocab = model.config.sampled_vocab_size
    logits = model.logits(w, hidden[: shape.prompt])[..., :vocab]
    i = torch.arange(shape.prompt, device=hidden.device)
    length = x.query_lens[0].long()
    following = x.prompt_tokens[(i + 1).clamp(max=shape.prompt - 1)]
    following = torch.where(i == length - 1, x.next_prompt_token, following).clamp(0, logits.shape[-1] - 1)
    logprobs = logits.log_softmax(-1)
    picked = logprobs.gather(1, following[:, None])[:, 0]
    best = logprobs.topk(top_logprobs_width(vocab), dim=-1)
    real = i < length
    return {"logprobs": torch.where(real, picked, 0.0),
            "prompt_top_logprobs": torch.where(real[:, None], best.values, 0.0),
            "prompt_top_token_ids": torch.where(real[:, None], best.indices, 0)}
