"""What is measured and in which order: the benchmark cells, their interleaving, the ``flare bench`` command.

Systems are interleaved within each repetition and cell (A B C, A B C, ...),
so a slow drift of the machine (another process, thermal state) spreads over
every system instead of landing on whichever ran last.
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
    return [Run(rep, cell, system) for rep in range(repetitions) for cell in cells for system in systems]


def bench_argv(flare: Path, url: str, dataset: Path, cell: Cell, out: Path, seed: int) -> list[str]:
    """The project's own client against one server; the dataset fixes prompt and output lengths."""
    argv = [str(flare), "bench", "--url", url, "--dataset", str(dataset), "--num-prompts", str(cell.num_prompts),
            "--seed", str(seed), "--json", str(out)]
    if cell.concurrency is not None:
        return [*argv, "--max-concurrency", str(cell.concurrency), "--request-rate", "inf"]
    return [*argv, "--request-rate", f"{cell.rate:g}"]
