"""Who gets the next free request slot: first come first served, or the Virtual Token Counter.

A queue policy sees three moments: a stream joins the waiting list
(``enqueue``), a slot frees and one waiting stream must be chosen (``take``),
and a frame finished and served some streams (``served``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scripts.scheduling_sim.interface import LaneResult, Stream


class QueuePolicy(Protocol):
    def enqueue(self, stream: Stream, waiting: list[Stream]) -> None: ...

    def take(self, waiting: list[Stream]) -> Stream: ...

    def served(self, results: tuple[LaneResult, ...]) -> None: ...


class FifoQueue:
    """Arrival order: the oldest waiting request runs first."""

    def enqueue(self, stream: Stream, waiting: list[Stream]) -> None:
        pass

    def take(self, waiting: list[Stream]) -> Stream:
        return waiting.pop(0)

    def served(self, results: tuple[LaneResult, ...]) -> None:
        pass


@dataclass(slots=True)
class VirtualTokenCounter:
    """Virtual Token Counter fair queueing (Sheng et al., "Fairness in Serving Large Language Models", 2024).

    Each client owns a counter of the weighted service it received: prompt
    tokens count ``input_weight`` each, charged when the request gets a slot;
    output tokens count ``output_weight`` each, charged as they are committed.
    A free slot goes to the earliest waiting request of the backlogged client
    (one with a waiting request) whose counter is smallest. A client that
    becomes backlogged is lifted to the smallest counter among backlogged
    clients (or, with none, to the counter of the client that last left the
    backlog), so idling earns no credit it could later spend starving others.
    """

    input_weight: float = 1.0
    output_weight: float = 2.0
    counters: dict[str, float] = field(default_factory=dict)
    last_left: float = 0.0  # counter of the last client whose backlog emptied

    def enqueue(self, stream: Stream, waiting: list[Stream]) -> None:
        backlogged = {s.client for s in waiting}
        if stream.client in backlogged:
            return
        floor = min((self.counters[c] for c in backlogged), default=self.last_left)
        self.counters[stream.client] = max(self.counters.get(stream.client, 0.0), floor)

    def take(self, waiting: list[Stream]) -> Stream:
        chosen = min(waiting, key=lambda s: self.counters[s.client])  # min keeps the earliest on ties
        waiting.remove(chosen)
        self.counters[chosen.client] += self.input_weight * chosen.spec.prompt_tokens
        if all(s.client != chosen.client for s in waiting):
            self.last_left = self.counters[chosen.client]
        return chosen

    def served(self, results: tuple[LaneResult, ...]) -> None:
        for result in results:
            self.counters[result.lane.stream.client] += self.output_weight * result.tokens
