"""State programs: snapshot, restore and init (docs/checkpoints.md, program contract "State programs").

A snapshot copies request slots' committed state into checkpoint rows, a
restore copies checkpoint rows into (fresh) request slots, an init clears
slots' per-slot state. Each is one fixed batch capacity B of rows; a row is
``(row_slots[b], checkpoint_rows[b], checkpoint_tokens[b])``, and a row whose
``checkpoint_tokens`` is 0 or whose ``checkpoint_rows`` is -1 (init: whose
``active`` is false) is inactive and mutates nothing.

What a copy moves: the first ``checkpoint_tokens`` positions of every paged
cache (the target's and, in a catalog with a learned draft, the draft's; the
partial last page's positions included), the pending token, the committed
length (which must equal ``checkpoint_tokens``) and the penalties' token
history (``token_counts``, ``prompt_seen``). Checkpoint row ``r`` owns the
checkpoint pages ``r * M .. r * M + M - 1`` (M = pages per slot), so it holds
any context a slot can. The programs take no weights and run no model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flare_contract.graphs import GraphDescriptor, GraphKind
from ignition.models.programs import ProgramSpec, StateLayout, TensorSpec
from ignition.models.qwen3 import Qwen3Config

import helios.ops  # noqa: F401  (defines flare::copy_kv_positions, copy_rows, copy_lengths, zero_rows)

# (slot tensor, checkpoint tensor) pairs a copy moves; caches first (copied position by position).
CACHE_PAIRS = (("k_cache", "v_cache", "checkpoint_k", "checkpoint_v"),)
DRAFT_CACHE_PAIRS = (("draft_k_cache", "draft_v_cache", "checkpoint_draft_k", "checkpoint_draft_v"),)
ROW_PAIRS = (("pending", "checkpoint_pending"), ("token_counts", "checkpoint_token_counts"),
             ("prompt_seen", "checkpoint_prompt_seen"))
LENGTHS = ("seq_lens", "checkpoint_seq_lens")
INIT_STATE = ("pending", "seq_lens", "token_counts", "prompt_seen")
COPY_INPUTS = ("page_table", "row_slots", "checkpoint_rows", "checkpoint_tokens")
INIT_INPUTS = ("row_slots", "active")


class StateCopyProgram(nn.Module):
    """A snapshot (slot -> checkpoint row) or a restore (checkpoint row -> slot) of B rows."""

    def __init__(self, names: tuple[str, ...], snapshot: bool, draft: bool, max_pages: int) -> None:
        super().__init__()
        self.names = names
        self.snapshot = snapshot
        self.caches = CACHE_PAIRS + (DRAFT_CACHE_PAIRS if draft else ())
        self.max_pages = max_pages

    def forward(self, *tensors: Tensor) -> tuple[Tensor]:
        x = dict(zip(self.names, tensors, strict=True))
        rows, slots = x["checkpoint_rows"], x["row_slots"]
        tokens = torch.where(rows >= 0, x["checkpoint_tokens"], torch.zeros_like(x["checkpoint_tokens"]))
        tokens = tokens.clamp(min=0)
        # Page lists of both sides; an inactive row may carry any slot or row, so its lookups are clamped.
        slot_pages = x["page_table"].index_select(0, slots.long().clamp(0, x["page_table"].shape[0] - 1))
        first = rows.long().clamp(min=0).unsqueeze(1) * self.max_pages
        row_pages = first + torch.arange(self.max_pages, dtype=torch.int64, device=rows.device)
        slot_side, row_side = (slots, slot_pages), (rows, row_pages)
        (dst_index, dst_pages), (src_index, src_pages) = (row_side, slot_side) if self.snapshot else (slot_side, row_side)
        slot_len, row_len = LENGTHS
        dst_len, src_len = (row_len, slot_len) if self.snapshot else (slot_len, row_len)
        # The length check comes first: a mismatch fails the program before anything is written.
        torch.ops.flare.copy_lengths(x[dst_len], x[src_len], dst_index, src_index, tokens)
        for slot_k, slot_v, row_k, row_v in self.caches:
            pair = (row_k, row_v, slot_k, slot_v) if self.snapshot else (slot_k, slot_v, row_k, row_v)
            torch.ops.flare.copy_kv_positions(*(x[name] for name in pair), dst_pages, src_pages, tokens)
        for slot_name, row_name in ROW_PAIRS:
            dst, src = (row_name, slot_name) if self.snapshot else (slot_name, row_name)
            torch.ops.flare.copy_rows(x[dst], x[src], dst_index, src_index, tokens)
        return (tokens.to(torch.int32),)


class InitProgram(nn.Module):
    """Clears the pending token, committed length and token history of each active row's slot."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def forward(self, *tensors: Tensor) -> tuple[Tensor]:
        x = dict(zip(self.names, tensors, strict=True))
        for name in INIT_STATE:
            torch.ops.flare.zero_rows(x[name], x["row_slots"], x["active"])
        return (x["active"].clone(),)


def build_state_program(desc: GraphDescriptor, config: Qwen3Config, layout: StateLayout,
                        draft: Qwen3Config | None = None) -> ProgramSpec:
    """The program of one state descriptor (``draft``: the catalog keeps draft caches, which copies move)."""
    _check_descriptor(desc, layout)
    b = desc.batch_capacity
    state = {**layout.new_state(config, draft), **layout.checkpoint_state(config, draft)}
    if desc.kind is GraphKind.INIT:
        inputs = [TensorSpec(name, tuple(state[name].shape), state[name].dtype, mutated=True) for name in INIT_STATE]
        inputs += [TensorSpec("row_slots", (b,), torch.int32), TensorSpec("active", (b,), torch.bool)]
        names = tuple(spec.name for spec in inputs)
        module: nn.Module = InitProgram(names)
        outputs = (TensorSpec("reset", (b,), torch.bool),)
    else:
        snapshot = desc.kind is GraphKind.SNAPSHOT
        written = {name for name in state if name.startswith("checkpoint_") == snapshot}
        inputs = [TensorSpec(name, tuple(t.shape), t.dtype, mutated=name in written) for name, t in state.items()]
        inputs += [TensorSpec("page_table", (layout.request_slots, layout.max_pages_per_slot), torch.int32),
                   TensorSpec("row_slots", (b,), torch.int32), TensorSpec("checkpoint_rows", (b,), torch.int32),
                   TensorSpec("checkpoint_tokens", (b,), torch.int32)]
        names = tuple(spec.name for spec in inputs)
        module = StateCopyProgram(names, snapshot, draft is not None, layout.max_pages_per_slot)
        outputs = (TensorSpec("copied_tokens", (b,), torch.int32),)
    return ProgramSpec(
        descriptor=desc, module=module,
        example_args=tuple(torch.zeros(spec.shape, dtype=spec.dtype) for spec in inputs),
        input_names=names, output_names=tuple(spec.name for spec in outputs), weight_keys=(),
        inputs=tuple(inputs), outputs=outputs,
    )


def _check_descriptor(desc: GraphDescriptor, layout: StateLayout) -> None:
    if desc.width != 1 or desc.prefill_capacity or desc.proposal_depth or desc.ragged:
        raise ValueError(f"{desc.id}: a {desc.kind.value} program has only B rows (width 1, no prompt, "
                         "no proposals, not ragged)")
    if desc.kind is not GraphKind.INIT and not layout.checkpoint_rows:
        raise ValueError(f"{desc.id}: a {desc.kind.value} program needs checkpoint rows "
                         "(the recipe's checkpoints.rows >= 1)")
