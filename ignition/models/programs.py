"""Per-shape programs: a ``GraphDescriptor`` becomes an exportable module plus its signature.

``build_program`` returns a ``ProgramSpec``; capture exports ``spec.module``
with ``spec.example_args`` (non-strict, no decompositions), and the runtime
calls the loaded program with ``weights`` (a dict in ``weight_keys`` order)
followed by the tensors of ``input_names[1:]``. The full contract (names,
shapes, dtypes, which inputs the program mutates) is in
docs/program-contract.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from helios.scheduler.types import GraphDescriptor, GraphKind
from ignition.models.frame import FrameInputs, FrameShape, run_frame
from ignition.models.qwen3 import Qwen3, Qwen3Config, Weights


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The persistent device state every program of a catalog shares."""

    request_slots: int
    page_size: int
    num_pages: int
    max_pages_per_slot: int
    cache_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("request_slots", "page_size", "num_pages", "max_pages_per_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"StateLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_context(self) -> int:
        """Tokens one slot can hold (its page-table row full)."""
        return self.page_size * self.max_pages_per_slot

    def new_state(self, config: Qwen3Config, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Zeroed state tensors, keyed by their program input names."""
        cache = (config.num_layers, self.num_pages, self.page_size, config.num_kv_heads, config.head_dim)
        return {
            "k_cache": torch.zeros(cache, dtype=self.cache_dtype, device=device),
            "v_cache": torch.zeros(cache, dtype=self.cache_dtype, device=device),
            "pending": torch.zeros(self.request_slots, dtype=torch.int64, device=device),
            "seq_lens": torch.zeros(self.request_slots, dtype=torch.int32, device=device),
        }


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a program signature, as a manifest records it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mutated: bool = False  # the program writes it in place

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ProgramSpec:
    descriptor: GraphDescriptor
    module: nn.Module
    example_args: tuple  # (weights dict, *tensors in input_names[1:] order)
    input_names: tuple[str, ...]  # "weights" first
    output_names: tuple[str, ...]
    weight_keys: tuple[str, ...]  # the weights dict's key order (part of the contract)
    inputs: tuple[TensorSpec, ...]  # every tensor input after the weights dict
    outputs: tuple[TensorSpec, ...]

    @property
    def mutated_inputs(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs if spec.mutated)


STATE_INPUTS = ("k_cache", "v_cache", "pending", "seq_lens")
FRAME_INPUTS = ("page_table", "row_slots", "query_lens", "temperature", "top_k", "top_p", "seed")
PROMPT_INPUTS = ("prompt_tokens", "prompt_start", "prompt_final")


class _Program(nn.Module):
    input_extras: tuple[str, ...] = ()  # kind-specific inputs after the common ones

    def __init__(self, config: Qwen3Config, shape: FrameShape) -> None:
        super().__init__()
        self.model = Qwen3(config)
        self.shape = shape

    def run(self, weights: Weights, common: tuple[Tensor, ...], **extras: Tensor) -> dict[str, Tensor]:
        inputs = FrameInputs(*common, **extras)
        return run_frame(self.model, weights, self.shape, inputs)


class PrefillProgram(_Program):
    """One prompt chunk of one request (B = 1)."""

    input_extras = PROMPT_INPUTS

    def forward(self, weights, k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens,
                temperature, top_k, top_p, seed, prompt_tokens, prompt_start, prompt_final):
        common = (k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens, temperature, top_k, top_p, seed)
        out = self.run(weights, common, prefill_row=torch.zeros(1, dtype=torch.int32, device=query_lens.device), prompt_tokens=prompt_tokens,
                       prompt_start=prompt_start, prompt_final=prompt_final)
        return out["tokens"], out["num_tokens"]


class ScoredPrefillProgram(_Program):
    """A prefill chunk that also returns the log-probability of each following prompt token."""

    input_extras = (*PROMPT_INPUTS, "next_prompt_token")

    def forward(self, weights, k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens,
                temperature, top_k, top_p, seed, prompt_tokens, prompt_start, prompt_final, next_prompt_token):
        common = (k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens, temperature, top_k, top_p, seed)
        out = self.run(weights, common, prefill_row=torch.zeros(1, dtype=torch.int32, device=query_lens.device), prompt_tokens=prompt_tokens,
                       prompt_start=prompt_start, prompt_final=prompt_final, next_prompt_token=next_prompt_token)
        return out["tokens"], out["num_tokens"], out["logprobs"]


class DecodeProgram(_Program):
    """B rows of width one: feed each slot's pending token, sample the next."""

    def forward(self, weights, k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens,
                temperature, top_k, top_p, seed):
        common = (k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens, temperature, top_k, top_p, seed)
        out = self.run(weights, common)
        return out["tokens"], out["num_tokens"]


class SpeculativeProgram(_Program):
    """Target verification of host drafts: pending token plus up to W - 1 drafts per row.

    The proposal stage (``draft``) is not in the program yet: drafts come from
    the host. A later issue adds it in front of verification, with the same
    outputs, so the runtime contract only loses the ``draft_tokens`` input.
    """

    input_extras = ("draft_tokens",)

    def forward(self, weights, k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens,
                temperature, top_k, top_p, seed, draft_tokens):
        common = (k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens, temperature, top_k, top_p, seed)
        out = self.run(weights, common, draft_tokens=self.draft(draft_tokens))
        return out["tokens"], out["num_tokens"]

    def draft(self, host_drafts: Tensor) -> Tensor:
        """Seam for the proposal stage; today the host's drafts pass through."""
        return host_drafts


class MixedProgram(SpeculativeProgram):
    """At most one prompt row (``prefill_row``) plus decode/verification rows (spec C14)."""

    input_extras = ("prefill_row", *PROMPT_INPUTS, "draft_tokens")

    def forward(self, weights, k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens,
                temperature, top_k, top_p, seed, prefill_row, prompt_tokens, prompt_start, prompt_final,
                draft_tokens):
        common = (k_cache, v_cache, pending, seq_lens, page_table, row_slots, query_lens, temperature, top_k, top_p, seed)
        out = self.run(weights, common, prefill_row=prefill_row, prompt_tokens=prompt_tokens,
                       prompt_start=prompt_start, prompt_final=prompt_final, draft_tokens=self.draft(draft_tokens))
        return out["tokens"], out["num_tokens"]


_PROGRAMS: dict[GraphKind, type[_Program]] = {
    GraphKind.PREFILL: PrefillProgram,
    GraphKind.SCORED_PREFILL: ScoredPrefillProgram,
    GraphKind.DECODE: DecodeProgram,
    GraphKind.SPECULATIVE: SpeculativeProgram,
    GraphKind.MIXED: MixedProgram,
}


def frame_shape(desc: GraphDescriptor) -> FrameShape:
    """The fixed frame sizes a descriptor prepares, validated for its kind."""
    kind = desc.kind
    if kind not in _PROGRAMS:
        raise ValueError(f"{desc.id}: no program builder for kind {kind.value!r}; supported: "
                         f"{', '.join(k.value for k in _PROGRAMS)}")
    prompt = desc.prefill_capacity
    if kind in (GraphKind.PREFILL, GraphKind.SCORED_PREFILL):
        if desc.batch_capacity != 1 or desc.width != 1 or prompt < 1:
            raise ValueError(f"{desc.id}: {kind.value} needs batch_capacity 1, width 1, prefill_capacity >= 1")
    elif kind is GraphKind.MIXED:
        if prompt < desc.width:
            raise ValueError(f"{desc.id}: mixed prefill_capacity {prompt} must be >= width {desc.width} (C14)")
    elif prompt:
        raise ValueError(f"{desc.id}: {kind.value} programs take no prompt (prefill_capacity must be 0)")
    if kind is GraphKind.DECODE and desc.width != 1:
        raise ValueError(f"{desc.id}: decode has width 1; wider rows are speculative programs")
    return FrameShape(desc.batch_capacity, desc.width, desc.max_packed_tokens, prompt,
                      scored=kind is GraphKind.SCORED_PREFILL)


def build_program(desc: GraphDescriptor, model_config: Qwen3Config, layout: StateLayout,
                  example_weights: Weights | None = None) -> ProgramSpec:
    """The program for one descriptor. ``example_weights`` (e.g. the loaded checkpoint)
    avoids allocating zero weights for the example arguments."""
    shape = frame_shape(desc)
    program = _PROGRAMS[desc.kind]
    inputs = _input_specs(program, shape, model_config, layout)
    weights = example_weights if example_weights is not None else _zero_weights(model_config, layout)
    if tuple(weights) != model_config.weight_keys():
        raise ValueError("example_weights must hold exactly the config's weight_keys(), in that order")
    example = (weights, *(_example_tensor(spec) for spec in inputs))
    return ProgramSpec(
        descriptor=desc,
        module=program(model_config, shape),
        example_args=example,
        input_names=("weights", *(spec.name for spec in inputs)),
        output_names=tuple(spec.name for spec in _output_specs(shape)),
        weight_keys=model_config.weight_keys(),
        inputs=inputs,
        outputs=_output_specs(shape),
    )


def _input_specs(program: type[_Program], shape: FrameShape, config: Qwen3Config,
                 layout: StateLayout) -> tuple[TensorSpec, ...]:
    state = layout.new_state(config)
    specs = [TensorSpec(name, tuple(t.shape), t.dtype, mutated=True) for name, t in state.items()]
    per_frame = {
        "page_table": ((layout.request_slots, layout.max_pages_per_slot), torch.int32),
        "row_slots": ((shape.batch,), torch.int32),
        "query_lens": ((shape.batch,), torch.int32),
        "temperature": ((shape.batch,), torch.float32),
        "top_k": ((shape.batch,), torch.int32),
        "top_p": ((shape.batch,), torch.float32),
        "seed": ((shape.batch,), torch.int64),
        "prefill_row": ((1,), torch.int32),
        "prompt_tokens": ((shape.prompt,), torch.int64),
        "prompt_start": ((1,), torch.int32),
        "prompt_final": ((1,), torch.bool),
        "next_prompt_token": ((1,), torch.int64),
        "draft_tokens": ((shape.batch, shape.width - 1), torch.int64),
    }
    for name in (*FRAME_INPUTS, *program.input_extras):
        specs.append(TensorSpec(name, *per_frame[name]))
    return tuple(specs)


def _output_specs(shape: FrameShape) -> tuple[TensorSpec, ...]:
    specs = [
        TensorSpec("tokens", (shape.batch, shape.width), torch.int64),
        TensorSpec("num_tokens", (shape.batch,), torch.int32),
    ]
    if shape.scored:
        specs.append(TensorSpec("logprobs", (shape.prompt,), torch.float32))
    return tuple(specs)


def _example_tensor(spec: TensorSpec) -> Tensor:
    if spec.name == "top_p":
        return torch.ones(spec.shape, dtype=spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype)


def _zero_weights(config: Qwen3Config, layout: StateLayout) -> Weights:
    return {key: torch.zeros(shape, dtype=layout.cache_dtype) for key, shape in config.weight_shapes().items()}
