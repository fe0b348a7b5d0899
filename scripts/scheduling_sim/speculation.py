"""How wide a decode round the prefill-first baselines run: 1, a fixed k + 1, or SmartSpec's choice.

A width policy answers ``width(decoders)`` before each decode frame and sees
every completed frame through ``observe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scripts.scheduling_sim.interface import LaneResult, Stream
from scripts.scheduling_sim.shapes import Shapes


class WidthPolicy(Protocol):
    def width(self, decoders: list[Stream]) -> int: ...

    def observe(self, results: tuple[LaneResult, ...]) -> None: ...


class PlainDecode:
    """No speculation: every decode lane has width one."""

    def width(self, decoders: list[Stream]) -> int:
        return 1

    def observe(self, results: tuple[LaneResult, ...]) -> None:
        pass


@dataclass(frozen=True, slots=True)
class FixedLength:
    """Always k drafts: the width k + 1 program whenever a request decodes."""

    drafts: int

    def width(self, decoders: list[Stream]) -> int:
        return self.drafts + 1

    def observe(self, results: tuple[LaneResult, ...]) -> None:
        pass


class GoodputLength:
    """SmartSpec-style length choice (Liu et al., "Optimizing Speculative Decoding for Serving
    Large Language Models Using Goodput", 2024).

    Before each decode step it picks the width (1 or any captured speculative
    width that holds the whole batch) maximizing expected committed tokens per
    unit of batch time. A token acceptance rate ``alpha`` is kept as a moving
    average over completed rounds; with independent per-position acceptance a
    round of k drafts is expected to commit 1 + alpha + ... + alpha^k tokens,
    capped by each request's remaining output. Batch time is the catalog
    duration of the smallest program for that batch and width.
    """

    def __init__(self, shapes: Shapes, decay: float = 0.9, prior_alpha: float = 0.5):
        self.shapes = shapes
        self.decay = decay
        # Moving sums of accepted positions and examined positions (prior: two positions at prior_alpha).
        self.accepted = 2.0 * prior_alpha
        self.examined = 2.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.examined

    def width(self, decoders: list[Stream]) -> int:
        candidates = [1, *self.shapes.speculative_widths()]
        return max(candidates, key=lambda w: self.goodput(decoders, w))

    def goodput(self, decoders: list[Stream], width: int) -> float:
        """Expected committed tokens per millisecond of a round of ``width`` over ``decoders``."""
        graph = self.shapes.decode(len(decoders), width)
        if graph is None:
            return -1.0  # no program holds the whole batch at this width
        per_round = sum(self.alpha**i for i in range(width))
        tokens = sum(min(per_round, s.spec.max_tokens - s.produced) for s in decoders)
        return tokens / (self.shapes.duration_ns(graph) / 1e6)

    def observe(self, results: tuple[LaneResult, ...]) -> None:
        rounds = [r for r in results if r.offered > 0]
        if not rounds:
            return
        self.accepted *= self.decay
        self.examined *= self.decay
        for r in rounds:
            # Positions up to the first rejection were examined; the rejected one counts too.
            self.accepted += r.accepted
            self.examined += r.accepted + (1 if r.accepted < r.offered else 0)
