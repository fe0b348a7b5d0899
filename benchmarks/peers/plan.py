"""What is measured and in which order: the benchmark cells, their interleaving, the ``flare bench`` command.

Systems are interleaved within each repetition and cell, and the order changes
between repetitions as the rows of a Williams design (a Latin square balanced
for the predecessor): over n repetitions of n systems (2n where n is odd) each
system runs once in every place and right after every other system equally
often. So a slow drift of the machine spreads over every system, and so does
what one server leaves behind for the next: vLLM's server keeps a core partly
busy after its run, and with the earlier order (reversed every second
repetition, rotated every two) Flare with adaptive speculation ran right after
vLLM in two of four repetitions and Flare with it off in none; adaptive read
0.85-0.89x of off in exactly those two, 0.99-1.01x in the others.
(Earlier still, with one fixed order, adaptive always ran straight after off
and read 0.96-0.97x of it at one stream; alternating, 1.00x.)
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
    """Row ``repetition`` of a Williams design over the systems (rows repeat after n, or 2n for odd n).

    Row r is (r + b) mod n for b in 0, 1, n-1, 2, n-2, ...; for odd n the reversed rows follow. Each
    system takes every place once per n rows, and each ordered pair of systems is adjacent equally often.
    """
    n = len(systems)
    if n < 2:
        return list(systems)
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    cycle = 2 * n if n % 2 else n
    r = repetition % cycle
    row = [(r % n + b) % n for b in base]
    return [systems[i] for i in (row[::-1] if r >= n else row)]


def bench_argv(flare: Path, url: str, dataset: Path, cell: Cell, out: Path, seed: int) -> list[str]:
    """The project's own client against one server; the dataset fixes prompt and output lengths."""
    argv = [str(flare), "bench", "--url", url, "--dataset", str(dataset), "--num-prompts", str(cell.num_prompts),
            "--seed", str(seed), "--json", str(out)]
    if cell.concurrency is not None:
        return [*argv, "--max-concurrency", str(cell.concurrency), "--request-rate", "inf"]
    return [*argv, "--request-rate", f"{cell.rate:g}"]
