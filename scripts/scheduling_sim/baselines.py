"""The baseline schedulers: two engines, composed with a queue policy and a width policy.

- ``PrefillFirst`` (vLLM v0 style continuous batching): whenever a running
  request still has prompt left, the next frame prefills it (one prompt per
  frame, or several when the catalog has batched prefill programs); otherwise
  every decoder takes one decode round. Composed with FIFO admission it is
  FCFS; with the Virtual Token Counter it is VTC; with a fixed or goodput
  width policy it is fixed-k or SmartSpec speculation.
- ``DecodeFirst`` (Sarathi-Serve / vLLM v1 style chunked prefill): each frame
  first takes every running decoder (one token each), then spends what is left
  of a token budget on one prompt chunk in a mixed program. Without mixed
  programs it alternates decode frames and prefill frames of at most the
  budget.

Each engine runs one frame at a time: it plans again only after the previous
frame completed, as a synchronous engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from scripts.scheduling_sim.interface import Frame, FrameDone, Lane, RunningSet, Stream
from scripts.scheduling_sim.queues import FifoQueue, QueuePolicy, VirtualTokenCounter
from scripts.scheduling_sim.shapes import Shapes
from scripts.scheduling_sim.speculation import FixedLength, GoodputLength, PlainDecode, WidthPolicy


class _Engine:
    """Admission through a queue policy into ``request_slots`` running rows; one frame in flight."""

    def __init__(self, name: str, shapes: Shapes, queue: QueuePolicy):
        self.name = name
        self.shapes = shapes
        self.queue = queue
        self.rows = RunningSet(shapes.request_slots)
        self.in_flight = False

    def admit(self, stream: Stream, now_ns: int) -> bool:
        self.queue.enqueue(stream, self.rows.waiting)
        self.rows.waiting.append(stream)
        return True

    def plan(self, now_ns: int) -> Frame | None:
        if self.in_flight:
            return None
        self.rows.retire_finished()
        while self.rows.waiting and self.rows.free_slots() > 0:
            self.rows.running.append(self.queue.take(self.rows.waiting))
        frame = self.next_frame()
        self.in_flight = frame is not None
        return frame

    def complete(self, done: FrameDone) -> None:
        self.in_flight = False
        self.queue.served(done.results)

    def next_frame(self) -> Frame | None:
        raise NotImplementedError

    def _decode_frame(self, decoders: list[Stream], width: int = 1) -> Frame:
        graph = self.shapes.decode(len(decoders), width)
        if graph is None:
            raise ValueError(f"{self.name}: the catalog has no width-{width} decode program for {len(decoders)} rows")
        return Frame(graph, tuple(Lane(s, width=width) for s in decoders))

    def _prefill_frame(self, chunks: list[tuple[Stream, int]]) -> Frame:
        total = sum(tokens for _, tokens in chunks)
        graph = self.shapes.prefill(total, len(chunks))
        if graph is None:
            raise ValueError(f"{self.name}: the catalog has no prefill program for {len(chunks)} rows, {total} tokens")
        return Frame(graph, tuple(Lane(s, prompt_tokens=tokens) for s, tokens in chunks))


class PrefillFirst(_Engine):
    def __init__(self, name: str, shapes: Shapes, queue: QueuePolicy, widths: WidthPolicy):
        super().__init__(name, shapes, queue)
        self.widths = widths
        self.turn = 0  # rotates decoders when a wide program holds fewer rows than are running

    def next_frame(self) -> Frame | None:
        prompts = self.rows.prompts()
        if prompts:
            return self._prefill_frame(self._pack_prompts(prompts))
        decoders = self.rows.decoders()
        if not decoders:
            return None
        width = self.widths.width(decoders)
        return self._decode_frame(self._rotate(decoders, self.shapes.max_decode_rows(width)), width)

    def complete(self, done: FrameDone) -> None:
        super().complete(done)
        self.widths.observe(done.results)

    def _pack_prompts(self, prompts: list[Stream]) -> list[tuple[Stream, int]]:
        """Oldest prompts first, as many as one captured prefill program holds; the first may be a chunk."""
        chunks: list[tuple[Stream, int]] = []
        for stream in prompts[: self.shapes.max_prefill_rows()]:
            room = self.shapes.max_prefill_chunk(len(chunks) + 1) - sum(t for _, t in chunks)
            if room <= 0 or (chunks and stream.prompt_left > room):
                break  # later prompts join only whole: a chunked prompt goes first and alone
            chunks.append((stream, min(stream.prompt_left, room)))
        return chunks

    def _rotate(self, decoders: list[Stream], rows: int) -> list[Stream]:
        if len(decoders) <= rows:
            return decoders
        start = self.turn % len(decoders)
        self.turn += rows
        return (decoders[start:] + decoders[:start])[:rows]


class DecodeFirst(_Engine):
    def __init__(self, name: str, shapes: Shapes, queue: QueuePolicy, budget: int):
        super().__init__(name, shapes, queue)
        self.budget = budget
        self.decoded_last = False  # alternation state when the catalog has no mixed programs

    def next_frame(self) -> Frame | None:
        decoders = self.rows.decoders()[: self.shapes.max_decode_rows()]
        prompts = self.rows.prompts()
        if prompts and self.shapes.has_mixed():
            mixed = self._mixed_frame(decoders, prompts[0])
            if mixed is not None:
                return mixed
        elif prompts and (self.decoded_last or not decoders):
            self.decoded_last = False
            chunk = min(prompts[0].prompt_left, self.budget, self.shapes.max_prefill_chunk())
            return self._prefill_frame([(prompts[0], chunk)])
        if not decoders:
            return None
        self.decoded_last = True
        return self._decode_frame(decoders)

    def _mixed_frame(self, decoders: list[Stream], prompt: Stream) -> Frame | None:
        """Every decoder, then one chunk of what remains of the budget (None: no room for a chunk)."""
        if not decoders:  # a prompt alone fits a plain prefill program, which is cheaper than a mixed one
            chunk = min(prompt.prompt_left, self.budget, self.shapes.max_prefill_chunk())
            return self._prefill_frame([(prompt, chunk)])
        room = min(self.budget - len(decoders), self.shapes.max_mixed_chunk(len(decoders)))
        chunk = min(prompt.prompt_left, room)
        if chunk <= 0:
            return None
        graph = self.shapes.mixed(len(decoders), chunk)
        lanes = (*(Lane(s) for s in decoders), Lane(prompt, prompt_tokens=chunk))
        return Frame(graph, lanes)


SARATHI_BUDGETS = (64, 256, 512, 2048)


@dataclass(frozen=True, slots=True)
class BaselineSpec:
    """A named baseline and how to build it for one catalog."""

    name: str
    build: Callable[[Shapes], _Engine]
    speculative: bool = False


def baseline_specs(shapes: Shapes) -> tuple[BaselineSpec, ...]:
    """Every baseline the report runs: FCFS, Sarathi at each budget, VTC, fixed-k per captured k, SmartSpec."""
    specs = [
        BaselineSpec("fcfs", lambda s: PrefillFirst("fcfs", s, FifoQueue(), PlainDecode())),
        *(_sarathi(budget) for budget in SARATHI_BUDGETS),
        BaselineSpec("vtc", lambda s: PrefillFirst("vtc", s, VirtualTokenCounter(), PlainDecode())),
        *(_fixed(width - 1) for width in shapes.speculative_widths()),
        BaselineSpec("smartspec", lambda s: PrefillFirst("smartspec", s, FifoQueue(), GoodputLength(s)), True),
    ]
    return tuple(specs)


def _sarathi(budget: int) -> BaselineSpec:
    name = f"sarathi-{budget}"
    return BaselineSpec(name, lambda s: DecodeFirst(name, s, FifoQueue(), budget))


def _fixed(drafts: int) -> BaselineSpec:
    name = f"fixed-k{drafts}"
    return BaselineSpec(name, lambda s: PrefillFirst(name, s, FifoQueue(), FixedLength(drafts)), True)
