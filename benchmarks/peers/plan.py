"""What is measured and in which order: the benchmark cells, their interleaving, the ``flare bench`` command.

Systems are interleaved within each repetition and cell, and the order changes
between repetitions: reversed in every second one, rotated by one every two
(A B C, C B A, B C A, A C B, ...). So a slow drift of the machine (another
process, thermal state) spreads over every system, and no system always runs
in the same place or right after the same other one. (Measured: with a fixed
order, Flare with adaptive speculation, always run straight after Flare with
it off, read 0.96-0.97x of it at one stream; alternating which went first,
the two read 1.00x.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Cell:
    """One load shape: a closed loop of ``concurrency`` streams, or open Poisson arrivals at ``rate``."""

    num_prompts: int
    concurrency: int | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        assert (self.concurrency is None) != (self.rate is None), "a cell is a concurrency or a rate, not both"
        assert self.num_prompts >= 1, "a cell sends at least one prompt"

    @property
    def key(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"


@dataclass(frozen=True, slots=True)
class Run:
    repetition: int
    cell: Cell
    system: str


def cells(quick: bool, rate: float, concurrencies: tuple[int, ...] = (1, 4, 16)) -> list[Cell]:
    """Enough prompts that every stream gets at least two requests (quick: one wave)."""
    per_stream = 1 if quick else 2
    closed = [Cell(max(4 if quick else 16, per_stream * c), concurrency=c) for c in concurrencies]
    return [*closed, Cell(16 if quick else 32, rate=rate)]


def schedule(systems: list[str], cells: list[Cell], repetitions: int) -> list[Run]:
    """Every (repetition, cell, system), cells in order; repetition r runs ``order(systems, r)``."""
    return [Run(rep, cell, system) for rep in range(repetitions) for cell in cells for system in order(systems, rep)]


def order(systems: list[str], repetition: int) -> list[str]:
    """The systems rotated left by ``repetition // 2``, reversed when ``repetition`` is odd."""
    shift = (repetition // 2) % len(systems) if systems else 0
    rotated = systems[shift:] + systems[:shift]
    return rotated[::-1] if repetition % 2 else rotated


def bench_argv(flare: Path, url: str, dataset: Path, cell: Cell, out: Path, seed: int) -> list[str]:
    """The project's own client against one server; the dataset fixes prompt and output lengths."""
    argv = [str(flare), "bench", "--url", url, "--dataset", str(dataset), "--num-prompts", str(cell.num_prompts),
            "--seed", str(seed), "--json", str(out)]
    if cell.concurrency is not None:
        return [*argv, "--max-concurrency", str(cell.concurrency), "--request-rate", "inf"]
    return [*argv, "--request-rate", f"{cell.rate:g}"]
