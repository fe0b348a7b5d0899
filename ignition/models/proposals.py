"""The draft model's part of a speculative frame: proposals, allocation, survival, absorption.

Learned proposals are drawn by the draft model one position at a time with the
row's own sampling parameters and the same (seed, position) exponential noise
the target uses (``ignition.models.sampling``). Verification accepts a
proposal only when it equals the target's token at that position, so the
committed stream is exactly the target's, and the shared noise makes the
draft agree with the target as often as their distributions allow.

Device allocation (spec S2, prefix_limit programs) spends the packed rows left
after every active row's pending token on (row, depth) pairs in decreasing
joint prefix probability, ties to shorter prefixes then lower rows, within
each row's ceiling. Joint probabilities never increase with depth, so that
order always picks whole prefixes.

Absorption keeps the draft cache equal to a draft forward over every
committed token (program contract version 2, "Draft state").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ignition.models.packing import packing
from ignition.models.qwen3 import PagedBatch, Qwen3, Weights
from ignition.models.sampling import TokenHistory, process_logits, sample, sampling_probs

if TYPE_CHECKING:
    from ignition.models.frame import FrameInputs

DRAFT_PREFIX = "draft."  # the draft's keys in a program's weights dict


def draft_weights(w: Weights) -> Weights:
    """The draft model's weights from a program's combined dict, unprefixed."""
    return {key[len(DRAFT_PREFIX):]: value for key, value in w.items() if key.startswith(DRAFT_PREFIX)}


@dataclass(frozen=True, slots=True)
class Proposals:
    tokens: Tensor  # int64 [B, D] proposal for positions L+1 .. L+D
    q: Tensor  # float32 [B, D] draft probability of each proposal under the row's sampling transform
    confidence: Tensor  # float32 [B, D] as q, but greedy rows use the temperature-1 softmax (stays informative)

    @property
    def joint(self) -> Tensor:
        """Joint prefix probability of the first i+1 proposals, ``[B, D]``."""
        return self.confidence.cumprod(dim=1)


def propose(draft: Qwen3, dw: Weights, x: FrameInputs, start_pos: Tensor, steps: Tensor,
            depth: int, vocab: int, history: TokenHistory) -> Proposals:
    """``depth`` sequential draft steps; row ``b`` runs (and writes draft K/V) only in its first ``steps[b]``.

    Step k feeds the token at position ``L + k`` (the slot's pending token, then
    the previous proposal) and samples the proposal for ``L + k + 1``, with the
    row's logit controls over ``history`` ([B, 1, V] before step 0) plus the
    proposals drawn so far: the transform the target applies when it verifies.
    """
    slots = x.row_slots.long().clamp(0, x.pending.shape[0] - 1)
    token, tokens, qs, confidences = x.pending[slots], [], [], []
    counts = history.counts
    for k in range(depth):
        position = (start_pos + k + 1)[:, None]
        raw = _draft_step(draft, dw, x, token, start_pos + k, (k < steps).int())[:, None, :vocab]
        logits = process_logits(raw, x.controls, TokenHistory(counts, history.seen), position)
        token = sample(logits, x.temperature, x.top_k, x.top_p, x.seed, position, x.min_p)[:, 0]
        q = _prob_of(sampling_probs(logits, x.temperature, x.top_k, x.top_p, x.min_p), token)
        confidences.append(torch.where(x.temperature > 0, q, _prob_of(logits.softmax(-1), token)))
        counts = counts + torch.nn.functional.one_hot(token, vocab)[:, None].to(counts.dtype)
        tokens.append(token)
        qs.append(q)
    return Proposals(torch.stack(tokens, 1), torch.stack(qs, 1), torch.stack(confidences, 1))


def _prob_of(probs: Tensor, token: Tensor) -> Tensor:
    """``probs[b, 0, token[b]]`` for ``probs`` [B, 1, V]."""
    return probs[:, 0].gather(1, token[:, None])[:, 0]


def _draft_step(draft: Qwen3, dw: Weights, x: FrameInputs, token: Tensor, position: Tensor, lens: Tensor) -> Tensor:
    """Draft logits ``[B, V]`` after feeding one token per row (rows with ``lens`` 0 write nothing)."""
    pack = packing(lens.long(), lens.shape[0])
    tokens = torch.where(pack.valid, token[pack.row_of], 0)
    positions = torch.where(pack.valid, position[pack.row_of], 0)
    batch = PagedBatch(x.page_table, x.row_slots, lens, position.int())
    hidden = draft(dw, tokens, positions, batch, x.draft_k_cache, x.draft_v_cache)
    own = (lens.long().cumsum(0) - 1).clamp(min=0)  # each active row's packed token
    return draft.logits(dw, hidden[own])


def allocate(joint: Tensor, ceilings: Tensor, budget: int) -> Tensor:
    """Target rows per row (int32 [B]) within ``budget`` packed rows (spec S2).

    Every row with a positive ceiling gets its pending token; the rest go to
    (row, depth) pairs by decreasing ``joint`` [B, D], ties to shorter
    prefixes then lower rows, never beyond the row's ceiling.
    """
    rows, depth = joint.shape
    active = ceilings > 0
    d = torch.arange(1, depth + 1, device=joint.device).expand(rows, depth).flatten()
    r = torch.arange(rows, device=joint.device)[:, None].expand(rows, depth).flatten()
    allowed = (active[:, None] & (d.view(rows, depth) < ceilings[:, None])).flatten()
    value = joint.flatten()
    ahead = (value[:, None] > value[None, :]) | (value[:, None] == value[None, :]) & (
        (d[:, None] < d[None, :]) | (d[:, None] == d[None, :]) & (r[:, None] < r[None, :]))
    rank = (allowed[:, None] & ahead).sum(0)  # allowed candidates ordered before each one
    chosen = allowed & (rank < budget - active.sum())
    return (active.long() + chosen.view(rows, depth).sum(1)).int()


def survival(target_logits: Tensor, proposals: Proposals, x: FrameInputs, offered: Tensor) -> Tensor:
    """Cumulative products of min(1, p/q) over each row's first ``offered`` proposals (C13), 0 beyond.

    ``target_logits`` [B, >= D, V] (after the row's logit controls): entry i is the
    target's distribution of the token at position L+i+1, the one proposal i claims.
    """
    depth = proposals.tokens.shape[1]
    p_all = sampling_probs(target_logits[:, :depth], x.temperature, x.top_k, x.top_p, x.min_p)
    p = p_all.gather(-1, proposals.tokens[..., None])[..., 0]
    ratio = (p / proposals.q.clamp(min=torch.finfo(p.dtype).tiny)).clamp(max=1.0)
    i = torch.arange(depth, device=p.device)[None, :]
    return torch.where(i < offered[:, None], ratio.cumprod(dim=1), 0.0)


def absorb(draft: Qwen3, dw: Weights, x: FrameInputs, tokens: Tensor, source_starts: Tensor,
           start_pos: Tensor, lens: Tensor) -> None:
    """Draft K/V for each row's first ``lens[b]`` packed input tokens (read from ``tokens`` at
    ``source_starts[b]``), at positions from ``start_pos[b]``."""
    capacity = tokens.shape[0]
    pack = packing(lens, capacity)
    source = (source_starts[pack.row_of] + pack.index_in_row).clamp(0, capacity - 1)
    packed = torch.where(pack.valid, tokens[source], 0)
    positions = torch.where(pack.valid, start_pos[pack.row_of] + pack.index_in_row, 0)
    batch = PagedBatch(x.page_table, x.row_slots, lens.int(), start_pos.int())
    draft(dw, packed, positions, batch, x.draft_k_cache, x.draft_v_cache)
