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

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from flare_contract.sampling import BIAS_CAPACITY
from ignition.models.frame import FrameInputs, FrameShape, run_frame, top_logprobs_width
from ignition.models.proposals import DRAFT_PREFIX
from ignition.models.qwen3 import Qwen3, Qwen3Config, Weights


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The persistent device state every program of a catalog shares."""

    request_slots: int
    page_size: int
    num_pages: int
    max_pages_per_slot: int
    cache_dtype: torch.dtype = torch.float32
    checkpoint_rows: int = 0  # rows of the checkpoint store (state programs; docs/checkpoints.md)

    def __post_init__(self) -> None:
        for name in ("request_slots", "page_size", "num_pages", "max_pages_per_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"StateLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_rows < 0:
            raise ValueError(f"StateLayout.checkpoint_rows must be >= 0, got {self.checkpoint_rows}")

    def new_state(self, config: Qwen3Config, draft: Qwen3Config | None = None,
                  device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Zeroed state tensors, keyed by their program input names; the draft's
        caches (same pages, the draft's sizes) when ``draft`` is given; then the
        penalties' token history (output token counts and prompt ids per slot)."""
        state = {
            "k_cache": self._cache(config, device),
            "v_cache": self._cache(config, device),
            "pending": torch.zeros(self.request_slots, dtype=torch.int64, device=device),
            "seq_lens": torch.zeros(self.request_slots, dtype=torch.int32, device=device),
        }
        if draft is not None:
            state.update(draft_k_cache=self._cache(draft, device), draft_v_cache=self._cache(draft, device))
        history = (self.request_slots, config.sampled_vocab_size)
        state.update(token_counts=torch.zeros(history, dtype=torch.int32, device=device),
                     prompt_seen=torch.zeros(history, dtype=torch.bool, device=device))
        return state

    def checkpoint_state(self, config: Qwen3Config, draft: Qwen3Config | None = None,
                         device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """The checkpoint store, zeroed: ``checkpoint_rows`` rows, each a full context of pages
        (row ``r`` owns checkpoint pages ``r * max_pages_per_slot ...``) and one entry of every
        per-slot tensor; empty without checkpoint rows."""
        rows = self.checkpoint_rows
        if not rows:
            return {}
        pages = rows * self.max_pages_per_slot
        store = {"checkpoint_k": self._cache(config, device, pages), "checkpoint_v": self._cache(config, device, pages)}
        if draft is not None:
            store.update(checkpoint_draft_k=self._cache(draft, device, pages),
                         checkpoint_draft_v=self._cache(draft, device, pages))
        history = (rows, config.sampled_vocab_size)
        store.update(checkpoint_pending=torch.zeros(rows, dtype=torch.int64, device=device),
                     checkpoint_seq_lens=torch.zeros(rows, dtype=torch.int32, device=device),
                     checkpoint_token_counts=torch.zeros(history, dtype=torch.int32, device=device),
                     checkpoint_prompt_seen=torch.zeros(history, dtype=torch.bool, device=device))
        return store

    def _cache(self, config: Qwen3Config, device: torch.device | str, pages: int | None = None) -> Tensor:
        shape = (config.num_layers, pages or self.num_pages, self.page_size, config.num_kv_heads, config.head_dim)
        return torch.zeros(shape, dtype=self.cache_dtype, device=device)


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


STATE_KINDS = (GraphKind.SNAPSHOT, GraphKind.RESTORE, GraphKind.INIT)  # ignition.models.state_programs
STATE_INPUTS = ("k_cache", "v_cache", "pending", "seq_lens")
DRAFT_STATE = ("draft_k_cache", "draft_v_cache")  # only in programs that run the draft model
HISTORY_STATE = ("token_counts", "prompt_seen")  # every program: the penalties' token history
FRAME_INPUTS = ("page_table", "row_slots", "query_lens", "temperature", "top_k", "top_p", "seed", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "bias_ids", "bias_values", "bias_until")
PROMPT_INPUTS = ("prompt_tokens", "prompt_start", "prompt_final")


class FrameProgram(nn.Module):
    """One descriptor's frame: ``forward(weights, *tensors)`` with tensors in ``names`` order."""

    def __init__(self, config: Qwen3Config, draft: Qwen3Config | None, shape: FrameShape,
                 names: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model = Qwen3(config)
        self.draft = Qwen3(draft) if draft is not None else None
        self.shape = shape
        self.names = names
        self.output_names = outputs

    def forward(self, weights: Weights, *tensors: Tensor) -> tuple[Tensor, ...]:
        named = dict(zip(self.names, tensors, strict=True))
        if "prefill_row" not in named and self.shape.prompt:  # prefill kinds: the one row is the prompt row
            named["prefill_row"] = torch.zeros(1, dtype=torch.int32, device=named["query_lens"].device)
        out = run_frame(self.model, weights, self.shape, FrameInputs(**named), self.draft)
        return tuple(out[name] for name in self.output_names)


_KIND_INPUTS: dict[GraphKind, tuple[str, ...]] = {
    GraphKind.PREFILL: PROMPT_INPUTS,
    GraphKind.SCORED_PREFILL: (*PROMPT_INPUTS, "next_prompt_token"),
    GraphKind.DECODE: (),
    GraphKind.SPECULATIVE: ("draft_tokens",),
    GraphKind.MIXED: ("prefill_row", *PROMPT_INPUTS, "draft_tokens"),
}
_DRAFT_KEEPING = (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.SPECULATIVE)


def frame_shape(desc: GraphDescriptor, has_draft: bool = False) -> FrameShape:
    """The fixed frame sizes a descriptor prepares, validated for its kind.

    ``has_draft``: the catalog keeps draft state (a draft model and learned
    proposals), so prefill, speculative and speculation-enabled mixed frames absorb.
    """
    kind = desc.kind
    if kind not in _KIND_INPUTS:
        raise ValueError(f"{desc.id}: no program builder for kind {kind.value!r}; supported: "
                         f"{', '.join(k.value for k in _KIND_INPUTS)}")
    _check_capacities(desc)
    learned = _learned_depth(desc, has_draft)
    return FrameShape(
        desc.batch_capacity, desc.width, desc.max_packed_tokens, desc.prefill_capacity,
        scored=kind is GraphKind.SCORED_PREFILL,
        absorb=has_draft and (kind in _DRAFT_KEEPING or (kind is GraphKind.MIXED and desc.speculation_enabled)),
        learned_depth=learned,
        prefix_limit=desc.value_source is ValueSource.PREFIX_LIMIT,
        speculative=kind in (GraphKind.SPECULATIVE, GraphKind.MIXED),
    )


def _check_capacities(desc: GraphDescriptor) -> None:
    kind, prompt = desc.kind, desc.prefill_capacity
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


def _learned_depth(desc: GraphDescriptor, has_draft: bool) -> int:
    """D learned proposal steps, or 0 when drafts come from the host (copy) or there are none."""
    learned = desc.proposal_source == "learned" and desc.width > 1
    if desc.value_source is ValueSource.PREFIX_LIMIT and not learned:
        raise ValueError(f"{desc.id}: prefix_limit allocation needs learned proposals (proposal_source "
                         f"'learned' and width > 1), got {desc.proposal_source!r} at width {desc.width}")
    if not learned:
        return 0
    if not has_draft:
        raise ValueError(f"{desc.id}: learned proposals need the recipe's draft model; pass draft_config")
    if desc.proposal_depth != desc.width - 1:
        raise ValueError(f"{desc.id}: learned proposals need proposal_depth = width - 1 "
                         f"({desc.width - 1}), got {desc.proposal_depth}")
    return desc.proposal_depth


def build_program(desc: GraphDescriptor, model_config: Qwen3Config, layout: StateLayout,
                  example_weights: Weights | None = None, draft_config: Qwen3Config | None = None) -> ProgramSpec:
    """The program for one descriptor.

    ``draft_config``: the recipe's draft model, in a catalog with learned
    proposals (programs that run it take its weights as ``draft.<key>``).
    ``example_weights`` (e.g. the loaded checkpoints, target keys plus
    ``draft.``-prefixed draft keys) avoids allocating zero weights; programs
    take the keys they need from it.
    """
    if desc.kind in STATE_KINDS:
        from ignition.models.state_programs import build_state_program  # it builds on this module's types

        return build_state_program(desc, model_config, layout, draft_config)
    shape = frame_shape(desc, draft_config is not None)
    draft = draft_config if shape.uses_draft else None
    if draft is not None and draft.vocab_size < model_config.sampled_vocab_size:
        raise ValueError(f"draft vocabulary {draft.vocab_size} is smaller than the target's sampled vocabulary "
                         f"{model_config.sampled_vocab_size}; the draft must share the target's tokenizer")
    keys = program_weight_keys(model_config, draft)
    inputs = _input_specs(desc.kind, shape, model_config, draft, layout)
    outputs = _output_specs(shape, layout.request_slots, top_logprobs_width(model_config.sampled_vocab_size))
    weights = _example_weights(keys, model_config, draft, layout, example_weights)
    names = tuple(spec.name for spec in inputs)
    output_names = tuple(spec.name for spec in outputs)
    return ProgramSpec(
        descriptor=desc,
        module=FrameProgram(model_config, draft, shape, names, output_names),
        example_args=(weights, *(_example_tensor(spec) for spec in inputs)),
        input_names=("weights", *names),
        output_names=output_names,
        weight_keys=keys,
        inputs=inputs,
        outputs=outputs,
    )


def program_weight_keys(config: Qwen3Config, draft: Qwen3Config | None = None) -> tuple[str, ...]:
    """A program's weights dict order: the target's keys, then the draft's prefixed ``draft.``."""
    return config.weight_keys() + tuple(DRAFT_PREFIX + key for key in (draft.weight_keys() if draft else ()))


def _input_specs(kind: GraphKind, shape: FrameShape, config: Qwen3Config, draft: Qwen3Config | None,
                 layout: StateLayout) -> tuple[TensorSpec, ...]:
    state = layout.new_state(config, draft)
    specs = [TensorSpec(name, tuple(t.shape), t.dtype, mutated=True) for name, t in state.items()]
    per_frame = {
        "page_table": ((layout.request_slots, layout.max_pages_per_slot), torch.int32),
        "row_slots": ((shape.batch,), torch.int32),
        "query_lens": ((shape.batch,), torch.int32),
        "temperature": ((shape.batch,), torch.float32),
        "top_k": ((shape.batch,), torch.int32),
        "top_p": ((shape.batch,), torch.float32),
        "seed": ((shape.batch,), torch.int64),
        "min_p": ((shape.batch,), torch.float32),
        "repetition_penalty": ((shape.batch,), torch.float32),
        "presence_penalty": ((shape.batch,), torch.float32),
        "frequency_penalty": ((shape.batch,), torch.float32),
        "bias_ids": ((shape.batch, BIAS_CAPACITY), torch.int64),
        "bias_values": ((shape.batch, BIAS_CAPACITY), torch.float32),
        "bias_until": ((shape.batch, BIAS_CAPACITY), torch.int32),
        "prefill_row": ((1,), torch.int32),
        "prompt_tokens": ((shape.prompt,), torch.int64),
        "prompt_start": ((1,), torch.int32),
        "prompt_final": ((1,), torch.bool),
        "next_prompt_token": ((1,), torch.int64),
        "draft_tokens": ((shape.batch, shape.width - 1), torch.int64),
    }
    extras = [name for name in _KIND_INPUTS[kind] if not (name == "draft_tokens" and shape.learned_depth)]
    specs += [TensorSpec(name, *per_frame[name]) for name in (*FRAME_INPUTS, *extras)]
    return tuple(specs)


def _output_specs(shape: FrameShape, slots: int, top: int) -> tuple[TensorSpec, ...]:
    depth = shape.learned_depth
    specs = [
        TensorSpec("tokens", (shape.batch, shape.width), torch.int64),
        TensorSpec("num_tokens", (shape.batch,), torch.int32),
        TensorSpec("token_logprobs", (shape.batch, shape.width), torch.float32),
        TensorSpec("top_logprobs", (shape.batch, shape.width, top), torch.float32),
        TensorSpec("top_token_ids", (shape.batch, shape.width, top), torch.int64),
    ]
    if shape.scored:
        specs += [TensorSpec("logprobs", (shape.prompt,), torch.float32),
                  TensorSpec("prompt_top_logprobs", (shape.prompt, top), torch.float32),
                  TensorSpec("prompt_top_token_ids", (shape.prompt, top), torch.int64)]
    if shape.speculative:
        specs.append(TensorSpec("verified_lens", (shape.batch,), torch.int32))
    if shape.prefix_limit:
        specs.append(TensorSpec("confidence", (2, slots, depth), torch.float32))
    if depth:
        specs.append(TensorSpec("survival", (shape.batch, depth), torch.float32))
    return tuple(specs)


def _example_tensor(spec: TensorSpec) -> Tensor:
    if spec.name == "top_p":
        return torch.ones(spec.shape, dtype=spec.dtype)
    return torch.zeros(spec.shape, dtype=spec.dtype)


def _example_weights(keys: tuple[str, ...], config: Qwen3Config, draft: Qwen3Config | None, layout: StateLayout,
                     given: Weights | None) -> Weights:
    if given is None:
        draft_shapes = draft.weight_shapes() if draft else {}
        shapes = {**config.weight_shapes(), **{DRAFT_PREFIX + k: s for k, s in draft_shapes.items()}}
        return {key: torch.zeros(shapes[key], dtype=layout.cache_dtype) for key in keys}
    missing = [key for key in keys if key not in given]
    if missing:
        raise ValueError(f"example_weights lacks {len(missing)} keys the program reads, e.g. {missing[:3]}; "
                         "pass the target's weights plus the draft's prefixed 'draft.'")
    return {key: given[key] for key in keys}
