"""``flare::sample``, Python reference kernel: a token per position, a pure function of (seed, position, id).

Temperature 0 is greedy argmax. Otherwise logits are scaled by temperature,
filtered by top-k, top-p and min-p, and the token is ``argmax(probs / q)``
with ``q ~ Exp(1)`` drawn per vocabulary entry: an exact sample from the
filtered distribution (the exponential race). ``q`` comes from an integer
hash, not a global RNG, so the same seed gives the same token at the same
absolute position whatever program shape or cohort served it, and speculative
verification reproduces plain decoding exactly.

A fixed-shape program computed the filter and the noise for every row and
threw greedy rows' draws away (at 16 greedy rows of a 4,096-token vocabulary,
most of a compiled decode step's own loops: docs/benchmarks.md). As an op, the
work follows the rows: greedy rows take the argmax, and only sampled rows are
filtered and drawn, each on its own, so a row's token does not depend on the
other rows. The native kernel (csrc/flare_ops.cpp) runs the same ATen
operations on the sampled rows in the same order, so both give the same bits.
"""

from __future__ import annotations

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


def draw(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, positions: Tensor,
         min_p: Tensor | None) -> Tensor:
    """The exponential race's tokens ``[B, W]`` for rows that all sample (temperature > 0)."""
    scaled = logits / temperature.clamp(min=1e-5)[:, None, None]
    probs = filter_top_k_top_p(scaled, top_k, top_p, min_p).softmax(-1)
    return (probs / exponential_noise(seed, positions, logits.shape[-1])).argmax(-1)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, positions: Tensor,
           min_p: Tensor | None = None) -> Tensor:
    """Tokens ``[B, W]`` (int64) from logits ``[B, W, V]``; ``positions`` are the produced tokens' positions."""
    tokens = logits.argmax(-1)
    rows = (temperature > 0).nonzero().flatten()
    if rows.numel():
        pick = (lambda t: t.index_select(0, rows))
        drawn = draw(pick(logits), pick(temperature), pick(top_k), pick(top_p), pick(seed), pick(positions),
                     None if min_p is None else pick(min_p))
        tokens = tokens.index_copy(0, rows, drawn)
    return tokens
