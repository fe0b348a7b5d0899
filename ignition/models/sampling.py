"""In-graph token sampling whose randomness is a pure function of (seed, position, token id).

Temperature 0 is greedy argmax. Otherwise logits are scaled by temperature,
filtered by top-k and top-p, and the token is ``argmax(probs / q)`` with
``q ~ Exp(1)`` drawn per vocabulary entry. That is an exact sample from the
filtered distribution (the exponential race), and because ``q`` comes from an
integer hash rather than a global RNG, the same seed gives the same token at
the same absolute position whatever program shape or cohort served it. In
particular speculative verification reproduces plain decoding exactly.

Before sampling, ``process_logits`` applies the request's logit controls in
vLLM's order: repetition penalty (prompt and output tokens), frequency and
presence penalties (output tokens), then logit bias (which also carries
``min_tokens``' suppression of end-of-sequence ids: entries that apply only
below a position). Greedy rows take the argmax of the processed logits;
``min_p`` filters with top-k and top-p. The token history the penalties read
is the program's ``token_counts`` / ``prompt_seen`` state plus the drafts a
speculative row verifies before each position, so a verified draft is judged
exactly as plain decoding would judge it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so
# int64 arithmetic never overflows and every backend computes the same bits.
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)


def mix32(h: Tensor) -> Tensor:
    """A 32-bit avalanche mix on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MULTIPLIERS[0]) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MULTIPLIERS[1]) & _MASK32
    return h ^ (h >> 16)


def exponential_noise(seed: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """``q ~ Exp(1)`` of shape ``[B, W, vocab]`` from seed ``[B]`` and positions ``[B, W]``."""
    low, high = seed & _MASK32, (seed >> 32) & _MASK32
    key = mix32(low[:, None] ^ mix32(high[:, None] ^ mix32(positions.long() & _MASK32)))
    ids = (torch.arange(vocab, dtype=torch.int64, device=seed.device) * _MULTIPLIERS[2]) & _MASK32
    h = mix32(key[..., None] ^ mix32(ids))
    uniform = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # (0, 1), exact in float32
    return -torch.log(uniform)


@dataclass(frozen=True, slots=True)
class LogitControls:
    """Per-row logit processing inputs; zeros everywhere ask for nothing."""

    repetition_penalty: Tensor  # float32 [B]; 0 or 1: none
    presence_penalty: Tensor  # float32 [B]
    frequency_penalty: Tensor  # float32 [B]
    bias_ids: Tensor  # int64 [B, E]
    bias_values: Tensor  # float32 [B, E] (-inf: never this token)
    bias_until: Tensor  # int32 [B, E]: the entry applies to produced positions below this (0: unused entry)


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What each sampled position has seen: output token counts and prompt tokens, ``[B, W, V]``."""

    counts: Tensor  # float32: output tokens before this position (committed and verified-before drafts)
    seen: Tensor  # bool: tokens of the prompt


def process_logits(logits: Tensor, controls: LogitControls, history: TokenHistory, positions: Tensor) -> Tensor:
    """``logits`` [B, W, V] after penalties and logit bias, for tokens produced at ``positions`` [B, W]."""
    r = controls.repetition_penalty
    r = torch.where(r > 0, r, 1.0)[:, None, None]
    repeated = history.seen | (history.counts > 0)
    logits = torch.where(repeated, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - controls.frequency_penalty[:, None, None] * history.counts
    logits = logits - controls.presence_penalty[:, None, None] * (history.counts > 0).to(logits.dtype)
    return logits + _bias(controls, positions, logits.shape[-1])


def _bias(controls: LogitControls, positions: Tensor, vocab: int) -> Tensor:
    """``[B, W, V]``: each entry's value at its id where the produced position is below its ``until``."""
    b, w = positions.shape
    live = positions.long()[:, :, None] < controls.bias_until.long()[:, None, :]  # [B, W, E]
    live = live & (controls.bias_ids < vocab)[:, None, :]  # an id the programs never produce changes nothing
    values = torch.where(live, controls.bias_values[:, None, :], 0.0)
    ids = controls.bias_ids.clamp(0, vocab - 1)[:, None, :].expand(b, w, -1)
    # -inf entries: counted apart, so -inf + a finite bias on the same id stays -inf (never inf - inf)
    banned = torch.zeros(b, w, vocab, device=positions.device).scatter_add(-1, ids, (values == float("-inf")).float())
    finite = torch.zeros(b, w, vocab, device=positions.device).scatter_add(
        -1, ids, torch.where(values == float("-inf"), 0.0, values))
    return finite.masked_fill(banned > 0, float("-inf"))


def output_logprobs(logits: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """The raw model distribution's log-probability of ``tokens`` [B, W] and its ``top`` best entries.

    Returns (token_logprobs [B, W], top_logprobs [B, W, top], top_token_ids [B, W, top]).
    """
    logprobs = logits.log_softmax(-1)
    picked = logprobs.gather(-1, tokens[..., None])[..., 0]
    best = logprobs.topk(top, dim=-1)
    return picked, best.values, best.indices


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | None = None) -> Tensor:
    """Logits with entries outside each row's top-k / top-p / min-p set to -inf.

    ``top_k`` int32 [B] (0 keeps every token), ``top_p`` float32 [B] (1.0 keeps
    all), ``min_p`` float32 [B] (0 keeps all; else a token stays when its
    probability is at least ``min_p`` times the most likely token's).
    """
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = top_k.long()[:, None, None]
    keep = (k <= 0) | (rank < k)
    probs = ordered.softmax(-1)
    # A token stays while the mass strictly before it is below top_p: the first always stays.
    keep = keep & ((probs.cumsum(-1) - probs) < top_p[:, None, None])
    if min_p is not None:
        keep = keep & (probs >= min_p[:, None, None] * probs[..., :1])
    keep_unsorted = torch.zeros_like(keep).scatter(-1, order, keep)
    return logits.masked_fill(~keep_unsorted, float("-inf"))


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                   min_p: Tensor | None = None) -> Tensor:
    """The distribution ``sample`` draws from, ``[B, W, V]``: the filtered softmax at
    temperature > 0, a one-hot of the argmax at temperature 0."""
    scaled = logits / temperature.clamp(min=1e-5)[:, None, None]
    probs = filter_top_k_top_p(scaled, top_k, top_p, min_p).softmax(-1)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(temperature[:, None, None] > 0, probs, greedy)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
           seed: Tensor, positions: Tensor, min_p: Tensor | None = None) -> Tensor:
    """Tokens ``[B, W]`` from logits ``[B, W, V]``; ``positions`` are the produced tokens' positions."""
    greedy = logits.argmax(-1)
    sampled = (temperature > 0)[:, None, None]
    # A greedy row's draw is thrown away below, but a fixed-shape program still filters every row, and the
    # filter sorts the whole vocabulary. Handing it a constant row for the greedy ones costs the sort a
    # fraction of sorting real logits (a frame of greedy rows at B = 16: about a fifth), and changes no
    # sampled row: each row is filtered, normalised and drawn on its own.
    scaled = torch.where(sampled, logits / temperature.clamp(min=1e-5)[:, None, None], 0.0)
    probs = filter_top_k_top_p(scaled, top_k, top_p, min_p).softmax(-1)
    drawn = (probs / exponential_noise(seed, positions, logits.shape[-1])).argmax(-1)
    return torch.where(temperature[:, None] > 0, drawn, greedy)
