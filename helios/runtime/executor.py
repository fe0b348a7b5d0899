"""The executor: the one place the runtime touches tensors (DESIGN.md, "The data path").

``bind`` turns a ``ScheduledPlan`` into a program's per-frame inputs
(docs/program-contract.md): the dense lane list becomes rows ``0..len(lanes)-1``
(padding rows are inactive, ``query_lens = 0``), the prompt row's chunk goes
into ``prompt_tokens`` from index 0 (the program places it at the row's packed
offset, the prefix sum of the earlier rows' lengths, spec C14), decode rows
of copy programs carry host drafts after their pending token, and every row its own sampling
parameters and seed. All per-row tensors of a frame are built on the host and
moved to the device once each: one ``query_lens`` upload per frame.

Proposals (program contract version 2): wider learned programs draw their
own drafts; copy programs take host ``draft_tokens`` (prompt lookup), and
width-one and ordinary mixed ones an empty ``[B, 0]``. A prefix-limit program gets each lane's immutable ceiling in
``query_lens`` and allocates the target rows itself (S2); the host never fits
rows into P for it.

``Executor.run`` calls the program on the persistent state and turns its
outputs into ``CompletionRecord``s: a prompt row commits its whole scheduled
chunk and may publish one first token (A13); a decode row commits its
accepted drafts plus one, cut after an end-of-sequence token, and offers
``verified_lens - 1`` drafts. Confidence (C12) and survival (C13) rows ride on
the records, survival trimmed to what the row verified. Outputs are checked
(``helios.runtime.frame_outputs``) before any record exists, so a malformed frame
never reaches the scheduler (A2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind
from flare_contract.sampling import BIAS_CAPACITY, BIAS_FOREVER
from helios.runtime.frame_outputs import FrameOutputs, read_outputs
from helios.ops.layout import NO_PAGE
from helios.runtime.pages import PageAllocator, PageLayout
from helios.runtime.state_ops import BoundState, StateResult, run_state
from helios.scheduler import rounds
from helios.scheduler.types import CompletionRecord, ExecutionTiming, LanePhase, PlannedLane, ScheduledPlan

PROMPT_KINDS = (GraphKind.PREFILL, GraphKind.SCORED_PREFILL, GraphKind.MIXED)
Program = Callable[..., Mapping[str, torch.Tensor]]


INT32_MAX = 2**31 - 1
INT64_RANGE = (-(2**63), 2**63 - 1)
# The smallest normal float32: a smaller top_p becomes zero (or a subnormal a GPU may flush to zero)
# in the float32 input, and a zero top_p would keep no token at all.
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True, slots=True)
class BiasEntry:
    """One ``bias_*`` row: add ``value`` to token ``token_id``'s logit at produced positions below ``until``."""

    token_id: int
    value: float  # -inf: the token cannot be produced there
    until: int = BIAS_FOREVER


@dataclass(frozen=True, slots=True)
class RowSampling:
    """One row's sampling inputs; temperature 0 is greedy, top_k 0 and top_p 1 cut nothing,
    ``min_p`` 0, ``repetition_penalty`` 1, the other penalties 0 and no bias change nothing.

    Each value must fit the program input that carries it (``top_k`` int32,
    ``seed`` int64, ``top_p`` a positive float32): ``row_sampling`` fits a
    request's parameters, so a bad value is refused when the request is
    submitted, never while the control thread packs a frame.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bias: tuple[BiasEntry, ...] = ()

    def __post_init__(self) -> None:
        if len(self.bias) > BIAS_CAPACITY:
            raise ValueError(f"at most {BIAS_CAPACITY} bias entries fit a program row, got {len(self.bias)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be in 0..{INT32_MAX} (an int32 input), got {self.top_k}")
        if not INT64_RANGE[0] <= self.seed <= INT64_RANGE[1]:
            raise ValueError(f"seed must be a signed 64-bit integer (an int64 input), got {self.seed}")
        if not FLOAT32_TINY <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [{FLOAT32_TINY}, 1] (a positive float32), got {self.top_p}")


def row_sampling(temperature: float, top_k: int | None, top_p: float, seed: int, vocab_size: int,
                 **controls) -> RowSampling:
    """A request's sampling parameters as the program inputs can hold them, with the same meaning.

    ``top_k`` above the vocabulary cuts nothing, so it is clamped to it (None:
    no cut). The sampler reads a seed's 64 bits, so any integer becomes the
    int64 with the same low 64 bits (2**64 - 1 and -1 are one seed). A
    ``top_p`` below the smallest normal float32 is raised to it, which keeps
    only the most likely token, as top-p sampling always keeps at least one.
    """
    return RowSampling(temperature=temperature, top_k=min(top_k or 0, vocab_size), top_p=max(top_p, FLOAT32_TINY),
                       seed=int64_seed(seed), **controls)


def int64_seed(seed: int) -> int:
    """The int64 congruent to ``seed`` modulo 2**64 (two's complement of its low 64 bits)."""
    return (seed - INT64_RANGE[0]) % 2**64 + INT64_RANGE[0]


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class LaneContext:
    """What a lane's request contributes beyond the plan: its prompt, drafts and sampling."""

    sampling: RowSampling
    prompt: tuple[int, ...] = ()  # the whole prompt; a prompt lane uploads its chunk of it
    drafts: tuple[int, ...] = ()  # proposals following the pending token (decode lanes)
    stop_ids: frozenset[int] | None = None  # ids that end the request (None: the executor's end-of-sequence ids)
    logprobs: bool = False  # read the logprob outputs of this lane's tokens


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class BoundRow:
    """How one lane was laid out in the frame."""

    lane: PlannedLane
    row: int  # index in the dense active lane list
    query_length: int  # packed tokens the row owns; a prefix-limit row: its ceiling (the device allocates)
    offset: int  # first packed token of the row (prefix sum of earlier lengths; host-allocated frames)
    offered: int  # drafts the host asked to verify (decode rows); the program's verified_lens has the last word


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class BoundFrame:
    """A plan bound to host tensors, ready for the device."""

    plan: ScheduledPlan
    rows: tuple[BoundRow, ...]
    inputs: Mapping[str, torch.Tensor]  # per-frame inputs by name (no weights, no state)
    contexts: Mapping = field(default_factory=dict)  # lane handle -> LaneContext (stop ids, logprobs wanted)


@dataclass(slots=True, unsafe_hash=True)  # per-frame: not frozen (docs/runtime.md, "Per-frame records")
class FrameResult:
    records: tuple[CompletionRecord, ...]
    timing: ExecutionTiming
    logprobs: Mapping = None  # handle -> TokenLogprobs of the record's tokens, for lanes that asked
    prompt_logprobs: Mapping = None  # handle -> scored prefill: TokenLogprobs of the prompt tokens it scored


class PageTable:
    """The host copy of the ``page_table`` input, kept in step with the allocator.

    Entries a slot does not own hold ``NO_PAGE``: page 0 is a real page, so a
    zero would let a frame that outran its reservation write another slot's
    cache silently; the ops refuse a negative entry instead.
    """

    def __init__(self, layout: PageLayout) -> None:
        self.tensor = torch.full((layout.request_slots, layout.max_pages_per_slot), NO_PAGE, dtype=torch.int32)
        self._snapshot: torch.Tensor | None = None  # the last copy handed out, while the table is unchanged

    def sync(self, allocator: PageAllocator, slot: int) -> None:
        pages = allocator.slot_pages(slot)
        self.tensor[slot].fill_(NO_PAGE)
        if pages:
            self.tensor[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self._snapshot = None

    def snapshot(self) -> torch.Tensor:
        """A frame's own copy: later reservations for queued frames cannot race the running one.

        Frames share one copy until a ``sync`` changes the table (programs only
        read ``page_table``), so a decode frame that reserved no new page copies
        nothing: the copy was the largest host cost of binding a batch-1 frame.
        """
        if self._snapshot is None:
            self._snapshot = self.tensor.clone()
        return self._snapshot


# ---------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------


def row_lengths(plan: ScheduledPlan) -> list[int]:
    """``query_lens`` per lane: a prompt chunk, a host-chosen length, or a prefix-limit ceiling (S1, S2)."""
    graph = plan.graph
    return [_lane_length(lane, graph) for lane in plan.lanes]


def _lane_length(lane: PlannedLane, graph: GraphDescriptor) -> int:
    if lane.phase is LanePhase.PROMPT:
        return lane.prompt_tokens
    if graph.is_prefix_limit:
        return lane.ceiling or rounds.prefix_ceiling(graph, graph.width)
    return lane.query_length


def takes_host_drafts(graph: GraphDescriptor) -> bool:
    """Whether the program has a ``draft_tokens`` input ([B, W-1]; [B, 0] at width one).

    Every speculative and mixed program has one except the wider learned ones,
    which draw their own proposals.
    """
    learned = graph.proposal_source == "learned" and graph.width > 1
    return graph.kind in (GraphKind.SPECULATIVE, GraphKind.MIXED) and not learned


class RowInputCache:
    """The per-row input tensors of recent frames, by the values they hold, for frames that repeat them.

    A decode frame at a steady batch binds the same slots, query lengths and
    sampling frame after frame, and programs only read these inputs, so the
    tensors made for one frame serve every later frame with the same values
    (a frame still queued keeps reading the same, unchanged values). Making
    them afresh was about a dozen tensor constructions per frame, each one a
    point where the control thread gives up the GIL and waits to get it back:
    the largest part of binding a batch-1 frame (benchmarks/host_loop.py).
    """

    __slots__ = ("_inputs",)
    LIMIT = 64  # distinct row sets kept; past it the cache starts afresh

    def __init__(self) -> None:
        self._inputs: dict[tuple, dict[str, torch.Tensor]] = {}

    def row_inputs(self, graph: GraphDescriptor, rows: Sequence[BoundRow], contexts: Mapping) -> dict[str, torch.Tensor]:
        key = (graph.batch_capacity, tuple((r.row, r.lane.handle.slot, r.query_length, contexts[r.lane.handle].sampling)
                                           for r in rows))
        found = self._inputs.get(key)
        if found is None:
            if len(self._inputs) >= self.LIMIT:
                self._inputs.clear()
            found = self._inputs[key] = _all_row_inputs(graph, rows, contexts)
        return found


def bind(plan: ScheduledPlan, contexts: Mapping, page_table: torch.Tensor,
         cache: RowInputCache | None = None) -> BoundFrame:
    """The program inputs for ``plan`` (``contexts`` maps each lane's handle to a ``LaneContext``).

    With a ``cache`` (the engine's), row inputs equal to a recent frame's are that frame's tensors.
    """
    graph = plan.graph
    if len(plan.lanes) > graph.batch_capacity:
        raise ValueError(f"{graph.id}: {len(plan.lanes)} lanes exceed B = {graph.batch_capacity}")
    rows = _layout(plan, row_lengths(plan))
    per_row = cache.row_inputs(graph, rows, contexts) if cache is not None else _all_row_inputs(graph, rows, contexts)
    inputs = {"page_table": page_table, **per_row}
    if graph.kind in PROMPT_KINDS:
        inputs.update(_prompt_inputs(plan, rows, contexts))
    if takes_host_drafts(graph):
        inputs["draft_tokens"] = _draft_tokens(graph, rows, contexts)
    return BoundFrame(plan, tuple(rows), inputs, contexts)


def _layout(plan: ScheduledPlan, lengths: Sequence[int]) -> list[BoundRow]:
    """Rows in lane order at prefix-sum offsets; ceilings are checked one by one (they may sum above P)."""
    graph = plan.graph
    rows, offset = [], 0
    for index, (lane, length) in enumerate(zip(plan.lanes, lengths)):
        offered = length - 1 if lane.phase is LanePhase.DECODE else 0
        rows.append(BoundRow(lane, index, length, offset, offered))
        offset += length
    if graph.is_prefix_limit:
        bound = rounds.prefix_ceiling(graph, graph.width)
        wrong = [r.query_length for r in rows if not 1 <= r.query_length <= bound]
        if wrong:
            raise ValueError(f"{graph.id}: lane ceilings {wrong} outside 1..min(D + 1, W) = 1..{bound} (S2)")
    elif offset > graph.max_packed_tokens:
        raise ValueError(f"{graph.id}: {offset} packed tokens exceed its capacity {graph.max_packed_tokens}")
    return rows


def _all_row_inputs(graph: GraphDescriptor, rows: Sequence[BoundRow], contexts: Mapping) -> dict[str, torch.Tensor]:
    return {**_row_inputs(graph, rows, contexts), **_control_inputs(graph.batch_capacity, rows, contexts)}


def _row_inputs(graph: GraphDescriptor, rows: Sequence[BoundRow], contexts: Mapping) -> dict[str, torch.Tensor]:
    """Slots, lengths and sampling per row; padding rows stay inactive and greedy."""
    b = graph.batch_capacity
    slots, lengths = [0] * b, [0] * b
    temperature, top_k, top_p, seed = [0.0] * b, [0] * b, [1.0] * b, [0] * b
    for r in rows:
        s = contexts[r.lane.handle].sampling
        slots[r.row], lengths[r.row] = r.lane.handle.slot, r.query_length
        temperature[r.row], top_k[r.row], top_p[r.row], seed[r.row] = s.temperature, s.top_k, s.top_p, s.seed
    return {
        "row_slots": torch.tensor(slots, dtype=torch.int32),
        "query_lens": torch.tensor(lengths, dtype=torch.int32),
        "temperature": torch.tensor(temperature, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.int32),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
        "seed": torch.tensor(seed, dtype=torch.int64),
    }


def neutral_control_inputs(batch: int) -> dict[str, torch.Tensor]:
    """The control inputs of ``batch`` rows that ask for nothing (for callers that bind frames by hand)."""
    return _control_inputs(batch, (), {})


def _control_inputs(b: int, rows: Sequence[BoundRow], contexts: Mapping) -> dict[str, torch.Tensor]:
    """min_p, penalties and bias rows (program contract version 3); padding rows change nothing."""
    columns = {name: torch.zeros(b) for name in ("min_p", "presence_penalty", "frequency_penalty")}
    columns["repetition_penalty"] = torch.ones(b)
    ids = torch.zeros(b, BIAS_CAPACITY, dtype=torch.int64)
    values = torch.zeros(b, BIAS_CAPACITY)
    until = torch.zeros(b, BIAS_CAPACITY, dtype=torch.int32)
    for r in rows:
        s = contexts[r.lane.handle].sampling
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            columns[name][r.row] = getattr(s, name)
        if s.bias:
            ids[r.row, : len(s.bias)] = torch.tensor([e.token_id for e in s.bias], dtype=torch.int64)
            values[r.row, : len(s.bias)] = torch.tensor([e.value for e in s.bias])
            until[r.row, : len(s.bias)] = torch.tensor([e.until for e in s.bias], dtype=torch.int32)
    return {**columns, "bias_ids": ids, "bias_values": values, "bias_until": until}


def _prompt_inputs(plan: ScheduledPlan, rows: Sequence[BoundRow], contexts: Mapping) -> dict[str, torch.Tensor]:
    graph = plan.graph
    prompt_rows = [r for r in rows if r.lane.phase is LanePhase.PROMPT]
    if len(prompt_rows) > 1:
        raise ValueError(f"{graph.id}: at most one prompt row per frame (C14), got {len(prompt_rows)}")
    if graph.kind is not GraphKind.MIXED and len(prompt_rows) != 1:
        raise ValueError(f"{graph.id}: a {graph.kind.value} frame has exactly one prompt row")
    if graph.kind is GraphKind.MIXED:
        expected = prompt_rows[0].row if prompt_rows else None
        if plan.prefill_row != expected:
            raise ValueError(f"{graph.id}: plan.prefill_row {plan.prefill_row} but the prompt lane is row {expected}")
    chunk = torch.zeros(graph.prefill_capacity, dtype=torch.int64)
    start, final, following = 0, False, 0
    if prompt_rows:
        lane = prompt_rows[0].lane
        prompt = contexts[lane.handle].prompt
        start, final = lane.prompt_start, lane.finishes_prompt
        chunk[: lane.prompt_tokens] = torch.tensor(prompt[start:start + lane.prompt_tokens], dtype=torch.int64)
        following = prompt[start + lane.prompt_tokens] if start + lane.prompt_tokens < len(prompt) else 0
    inputs = {
        "prompt_tokens": chunk,
        "prompt_start": torch.tensor([start], dtype=torch.int32),
        "prompt_final": torch.tensor([final]),
    }
    if graph.kind is GraphKind.MIXED:
        inputs["prefill_row"] = torch.tensor([-1 if not prompt_rows else prompt_rows[0].row], dtype=torch.int32)
    if graph.kind is GraphKind.SCORED_PREFILL:
        inputs["next_prompt_token"] = torch.tensor([following], dtype=torch.int64)
    return inputs


def _draft_tokens(graph: GraphDescriptor, rows: Sequence[BoundRow], contexts: Mapping) -> torch.Tensor:
    drafts = torch.zeros(graph.batch_capacity, max(graph.width - 1, 0), dtype=torch.int64)
    for r in rows:
        if r.offered:
            proposals = contexts[r.lane.handle].drafts[: r.offered]
            drafts[r.row, : len(proposals)] = torch.tensor(proposals, dtype=torch.int64)
    return drafts


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


_NO_CONTEXT = LaneContext(RowSampling())


def _scored_prompt(frame: BoundFrame, read: FrameOutputs) -> dict:
    """A scored prefill's prompt scores with the prompt token each one scores (positions start + 1 on)."""
    if read.prompt_scores is None:
        return {}
    lane = frame.rows[0].lane
    prompt = frame.contexts[lane.handle].prompt if lane.handle in frame.contexts else ()
    following = prompt[lane.prompt_start + 1:lane.prompt_start + 1 + len(read.prompt_scores)]
    if len(following) != len(read.prompt_scores):
        return {}  # no prompt to name the tokens by (a hand-bound frame)
    return {lane.handle: tuple(replace(s, token_id=t) for s, t in zip(read.prompt_scores, following))}


def _context_of(contexts: Mapping, row: BoundRow) -> LaneContext:
    return contexts.get(row.lane.handle, _NO_CONTEXT)


class Executor:
    """Runs bound frames on the persistent state; returns records and timing.

    ``program_for`` maps a graph id to a callable taking inputs by name and
    returning outputs by name (``Catalog.program`` in production). Every call
    gets the whole persistent state; a program takes what it declares, so
    programs that never run the draft model leave the draft caches alone.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], program_for: Callable[[str], Program],
                 eos_ids: frozenset[int], device: torch.device | str = "cpu") -> None:
        self.state = state
        self.program_for = program_for
        self.eos_ids = eos_ids
        self.device = torch.device(device)

    def run(self, frame: BoundFrame, dispatched_ns: int) -> FrameResult:
        """Execute ``frame``; wall time counts from ``dispatched_ns`` (``time.monotonic_ns``).

        The frame's lane contexts say which ids end each lane and which lanes want logprobs (a
        lane without one ends on the end-of-sequence ids and gets none).
        """
        return self.finish(frame, *self.call(frame), dispatched_ns)

    def call(self, frame: BoundFrame) -> tuple[Mapping[str, torch.Tensor], int, int]:
        """The program call of ``frame`` alone: its outputs as the program returned them, its device
        interval, and when the call returned (``time.monotonic_ns``: the frame's wall interval ends there,
        A3, whenever the outputs are read). Nothing a later frame writes backs them: a call's outputs are tensors of its own, or (a
        rectangular round's ``verified_lens``) the frame's ``query_lens``, which no program or binding
        writes (``RowInputCache``); no output of the bundled catalog's programs shares storage with the
        state (checked 2026-12-05). ``finish`` reads them, on whichever thread has the time:
        the engine's device worker hands them to the control thread, since Python run on the core a
        program just swept through its caches ran 5-10x slower (docs/runtime.md, "Threads")."""
        program = self.program_for(frame.plan.graph.id)
        inputs = frame.inputs
        if self.device.type != "cpu":  # on CPU the bound tensors are the program's inputs as they are
            inputs = {name: t.to(self.device, non_blocking=True) for name, t in inputs.items()}
        outputs, device_ns = self._timed_call(program, {**inputs, **self.state})
        return outputs, device_ns, time.monotonic_ns()

    def finish(self, frame: BoundFrame, outputs: Mapping[str, torch.Tensor], device_ns: int, ended_ns: int,
               dispatched_ns: int) -> FrameResult:
        """``frame``'s completion records from the outputs of its ``call`` (checked: FrameOutputError names a
        broken program contract)."""
        contexts = frame.contexts
        slots = frame.inputs["page_table"].shape[0]
        wanting = [r for r in frame.rows if _context_of(contexts, r).logprobs]
        read = read_outputs(frame.plan.graph, frame.rows, outputs, slots, wanting)
        records = tuple(self._record(r, read, _context_of(contexts, r)) for r in frame.rows)
        logprobs = {rec.handle: read.logprobs[r.row][: len(rec.tokens)] for r, rec in zip(frame.rows, records)
                    if r.row in read.logprobs}
        wall_ns = max(0, ended_ns - dispatched_ns)
        timing = ExecutionTiming(device_ns=max(device_ns, 1), wall_ns=wall_ns)
        return FrameResult(records, timing, logprobs, _scored_prompt(frame, read))

    def run_state(self, bound: BoundState, dispatched_ns: int) -> StateResult:
        """Execute a bound snapshot, restore or init (``helios.runtime.state_ops.bind_state``)."""
        return run_state(self, bound, dispatched_ns)

    def _timed_call(self, program: Program, named: dict) -> tuple[Mapping[str, torch.Tensor], int]:
        """The program's own device interval: CUDA events on a GPU, the call's host interval on CPU."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outputs = program(**named)
            end.record()
            end.synchronize()
            return outputs, int(start.elapsed_time(end) * 1e6)
        began = time.perf_counter_ns()
        outputs = program(**named)
        return outputs, time.perf_counter_ns() - began

    def _record(self, row: BoundRow, read: FrameOutputs, context: LaneContext) -> CompletionRecord:
        lane = row.lane
        tokens = read.tokens[row.row]
        stop_ids = self.eos_ids if context.stop_ids is None else context.stop_ids
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
        committed = tuple(tokens[:cut])
        if lane.phase is LanePhase.PROMPT:
            return CompletionRecord(lane.handle, prompt_consumed=lane.prompt_tokens,
                                    tokens=committed if lane.finishes_prompt else (), terminated=cut is not None)
        offered = read.offered(row)
        return CompletionRecord(lane.handle, tokens=committed, offered=offered, terminated=cut is not None,
                                confidence=read.confidence_row(lane.handle.slot),
                                survival=read.survival_row(row.row, offered))
