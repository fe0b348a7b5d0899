"""In-graph token sampling whose randomness is a pure function of (seed, position, token id).

Temperature 0 is greedy argmax. Otherwise logits are scaled by temperature,
filtered by top-k and top-p, and the token is ``argmax(probs / q)`` with
``q ~ Exp(1)`` drawn per vocabulary entry. That is an exact sample from the
filtered distribution (the exponential race), and because ``q`` comes from an
integer hash rather than a global RNG, the same seed gives the same token at
the same absolute position whatever program shape or cohort served it. In
particular speculative verification reproduces plain decoding exactly.
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


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Logits with entries outside each row's top-k / top-p set to -inf.

    ``top_k`` int32 [B] (0 keeps every token), ``top_p`` float32 [B] (1.0 keeps all).
    """
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = top_k.long()[:, None, None]
    keep = (k <= 0) | (rank < k)
    probs = ordered.softmax(-1)
    # A token stays while the mass strictly before it is below top_p: the first always stays.
    keep = keep & ((probs.cumsum(-1) - probs) < top_p[:, None, None])
    keep_unsorted = torch.zeros_like(keep).scatter(-1, order, keep)
    return logits.masked_fill(~keep_unsorted, float("-inf"))


def sampling_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The distribution ``sample`` draws from, ``[B, W, V]``: the filtered softmax at
    temperature > 0, a one-hot of the argmax at temperature 0."""
    scaled = logits / temperature.clamp(min=1e-5)[:, None, None]
    probs = filter_top_k_top_p(scaled, top_k, top_p).softmax(-1)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(temperature[:, None, None] > 0, probs, greedy)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
           seed: Tensor, positions: Tensor) -> Tensor:
    """Tokens ``[B, W]`` from logits ``[B, W, V]``; ``positions`` are the produced tokens' positions."""
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp(min=1e-5)[:, None, None]
    probs = filter_top_k_top_p(scaled, top_k, top_p).softmax(-1)
    drawn = (probs / exponential_noise(seed, positions, logits.shape[-1])).argmax(-1)
    return torch.where(temperature[:, None] > 0, drawn, greedy)
