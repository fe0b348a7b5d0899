"""A tiny stand-in model source: builds a real catalog in well under a second.

It follows the program contract's shape (a weights dict input, persistent
``pending``/``seq_lens``/``cache`` state updated in place, per-frame
``row_slots`` and ``prompt_tokens``) with a toy network, so the catalog writer,
loader and CLI can be tested without the real model. Not model code the
runtime ever runs.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind
from flare_contract.manifest import Envelope
from ignition.capture.source import CaptureSource

SLOTS, CONTEXT, HIDDEN, VOCAB = 4, 32, 8, 16


class StandInProgram(torch.nn.Module):
    """One frame: each active row consumes its tokens, writes the cache, samples greedily.

    prefill rows take ``prompt_tokens`` (batch 1); decode rows take ``pending[slot]``.
    """

    def __init__(self, prompt_capacity: int):
        super().__init__()
        self.prompt_capacity = prompt_capacity

    def forward(self, weights, prompt_tokens, row_slots, pending, seq_lens, cache):
        if self.prompt_capacity:  # tokens: [1, T]
            tokens = prompt_tokens.unsqueeze(0)
        else:  # tokens: [B, 1]
            tokens = pending[row_slots].unsqueeze(1)
        positions = seq_lens[row_slots].unsqueeze(1) + torch.arange(tokens.shape[1], dtype=torch.int32)
        hidden = torch.tanh(weights["embed"][tokens] @ weights["proj"])  # [B, T, H]
        rows = row_slots.unsqueeze(1).expand_as(positions)
        cache.index_put_((rows.long(), positions.long()), hidden)
        logits = hidden[:, -1] @ weights["embed"].T  # [B, V]
        next_tokens = logits.argmax(-1)
        pending.index_put_((row_slots.long(),), next_tokens)
        seq_lens.index_put_((row_slots.long(),), seq_lens[row_slots] + tokens.shape[1])
        return next_tokens, logits


@dataclass(frozen=True)
class StandInSpec:
    module: torch.nn.Module
    example_args: tuple
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    weight_keys: tuple[str, ...]


def stand_in_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(VOCAB, HIDDEN, generator=generator),
        "proj": torch.randn(HIDDEN, HIDDEN, generator=generator),
    }


def stand_in_state() -> dict[str, torch.Tensor]:
    return {
        "pending": torch.zeros(SLOTS, dtype=torch.int64),
        "seq_lens": torch.zeros(SLOTS, dtype=torch.int32),
        "cache": torch.zeros(SLOTS, CONTEXT, HIDDEN),
    }


def stand_in_inputs(desc: GraphDescriptor) -> dict[str, torch.Tensor]:
    """Per-frame example inputs for ``desc`` (distinct slots, deterministic tokens)."""
    prompt = max(desc.prefill_capacity, 1)
    return {
        "prompt_tokens": torch.arange(prompt, dtype=torch.int64) % VOCAB,
        "row_slots": torch.arange(desc.batch_capacity, dtype=torch.int32),
    }


def build_stand_in(desc: GraphDescriptor, weights: dict[str, torch.Tensor]) -> StandInSpec:
    named = {"weights": weights, **stand_in_inputs(desc), **stand_in_state()}
    names = ("weights", "prompt_tokens", "row_slots", "pending", "seq_lens", "cache")
    return StandInSpec(
        module=StandInProgram(desc.prefill_capacity),
        example_args=tuple(named[n] for n in names),
        input_names=names,
        output_names=("tokens", "logits"),
        weight_keys=tuple(weights),
    )


STAND_IN_GRAPHS = (
    GraphDescriptor(id="prefill_p8", kind=GraphKind.PREFILL, batch_capacity=1, prefill_capacity=8),
    GraphDescriptor(id="decode_b1", kind=GraphKind.DECODE, batch_capacity=1),
    GraphDescriptor(id="decode_b4", kind=GraphKind.DECODE, batch_capacity=4),
)


def stand_in_source(
    tokenizer_file, graphs: tuple[GraphDescriptor, ...] = STAND_IN_GRAPHS, seed: int = 0
) -> CaptureSource:
    weights = stand_in_weights(seed)
    return CaptureSource(
        recipe={"name": "stand-in", "description": "hand-written stand-in programs for catalog tests"},
        model={"hidden_size": HIDDEN, "vocab_size": VOCAB},
        tokenizer_reference="stand-in/tokenizer.json",
        tokenizer_files=(tokenizer_file,),
        device={"kind": "cpu", "dtype": "float32"},
        envelope=Envelope(
            request_slots=SLOTS, prefill_chunk=8, draft_depth=0, speculative_token_capacity=0, mixed=False
        ),
        layout={"request_slots": SLOTS, "context": CONTEXT},
        weights={"target": weights},
        graphs=graphs,
        build=lambda desc: build_stand_in(desc, weights),
        rebuild=functools.partial(stand_in_source, tokenizer_file, graphs, seed),
    )
