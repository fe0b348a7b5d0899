"""In-graph token sampling whose randomness is a pure function of (seed, position, token id).

Temperature 0 is greedy argmax. Otherwise logits are scaled by temperature,
filtered by top-k and top-p, and the token is ``argmax(probs / q)`` with
``q ~ Exp(1)`` drawn per vocabulary entry. That is an exact sample from the
filtered distribution (the exponential race), and because ``q`` comes from an
integer hash rather than a global RNG, the same seed gives the same token at
the same absolute position whatever program shape or cohort served it. In
particular speculative verification reproduces plain decoding exactly. The
draw itself is the ``flare::sample`` op (``helios.ops.sampling`` holds its
reference kernel and the hash), so greedy rows cost an argmax only.

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

import helios.ops  # noqa: F401  (defines flare::sample)
from helios.ops.sampling import exponential_noise, filter_top_k_top_p, mix32  # noqa: F401  (re-exported)


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
    """Tokens ``[B, W]`` from logits ``[B, W, V]``; ``positions`` are the produced tokens' positions.

    One ``flare::sample`` op (helios.ops.sampling): greedy rows take the argmax, and only sampled rows
    pay for the filter and the noise, where the graph used to compute both for every row.
    """
    return torch.ops.flare.sample(logits, temperature, top_k, top_p, seed, positions, min_p)
