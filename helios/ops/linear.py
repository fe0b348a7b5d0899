"""``flare::linear``, Python reference kernel: the model's matrix products.

The native kernel (csrc/flare_ops.cpp) streams each weight once for the rows
of a decode step or a prompt chunk and calls ATen's GEMM above a row bound
(at most 256); this one is ATen throughout, with the same shape check.

Which of the two is faster for prompt chunks depends on the CPU, so the bound
is measured once per process on the catalog's own weights
(``choose_native_rows``, called by ``flare run`` before the warm-up), or
fixed by ``FLARE_LINEAR_NATIVE_ROWS``; decode steps (up to 16 rows) always
run on the native kernel, whose rows do not depend on the batch.

The native kernel has two loop orders with the same arithmetic (the same
bits): "panel", best where the weights sit in the last-level cache, and
"chunked", best where they stream from memory. Which one serves 16 and 32
rows is measured too, on the catalog's whole weight set, since that is what
decides where it lives (``choose_chunk_rows``), or fixed by
``FLARE_LINEAR_CHUNK_ROWS``; up to 8 rows the chunked order serves.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by ATen (the native kernel computes the same with its own small-batch loop)."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"flare::linear: x [..., {x.shape[-1] if x.dim() else '?'}] does not fit weight "
                         f"{list(weight.shape)}")
    return torch.nn.functional.linear(x, weight, bias)


# ---- which kernel serves prompt chunks: measured on this machine, on the catalog's own weights ----

NATIVE_ROWS_ENV = "FLARE_LINEAR_NATIVE_ROWS"  # a fixed bound instead of the measurement (16..256)
DECODE_ROWS, MAX_NATIVE_ROWS = 16, 256  # the native kernel always serves decode steps; ATen above 256
CANDIDATE_ROWS = (32, 64, 128, 256)  # prompt chunk sizes the measurement tries, in order
MAX_MEASURED_ELEMENTS = 8 << 20  # larger weights (a big vocabulary's head) would make the start slow


@dataclass(frozen=True, slots=True)
class RowsChoice:
    """The native kernel's row bound for this process, and what decided it."""

    rows: int
    source: str  # "measured", or the environment variable that fixed it
    timings: tuple[tuple[int, float, float], ...] = ()  # (rows, native ms, ATen ms) per candidate measured

    def describe(self) -> str:
        if not self.timings:
            return f"flare::linear: native kernel up to {self.rows} rows, ATen above ({self.source})"
        measured = ", ".join(f"{m} rows {native:.2f}/{aten:.2f} ms" for m, native, aten in self.timings)
        return (f"flare::linear: native kernel up to {self.rows} rows, ATen above "
                f"(native/ATen on the catalog's weights: {measured})")


def pick_native_rows(timings: Sequence[tuple[int, float, float]], floor: int = DECODE_ROWS) -> int:
    """The bound from measured (rows, native ms, ATen ms), ascending: the native kernel serves every
    size up to the first it loses (never fewer than ``floor``: the decode steps' 16 rows). The chunked
    order's bound is picked the same way from (rows, chunked ms, panel ms)."""
    rows = floor
    for m, native, aten in timings:
        if native > aten:
            break
        rows = m
    return rows


def choose_native_rows(weights: Iterable[torch.Tensor], environ: Mapping[str, str] = os.environ,
                       repeats: int = 3) -> RowsChoice | None:
    """Set the native kernel's row bound for this process: ``FLARE_LINEAR_NATIVE_ROWS`` when set, else the
    sizes at which it beat ATen's GEMM on ``weights``' distinct matrix shapes (each kernel timed ``repeats``
    times, interleaved, best of each). None with the Python kernels, where ATen serves every call."""
    from helios.ops import kernels  # kernels imports this module for its Python kernel

    if kernels.active() != "native":
        return None
    rows = _fixed_rows(environ, NATIVE_ROWS_ENV, DECODE_ROWS, MAX_NATIVE_ROWS)
    if rows is not None:
        kernels.native_linear_rows(rows)
        return RowsChoice(rows, NATIVE_ROWS_ENV)
    shapes = {}
    for w in weights:
        if w.dim() == 2 and w.dtype == torch.float32 and 0 < w.numel() <= MAX_MEASURED_ELEMENTS and not _packed(w):
            shapes.setdefault(tuple(w.shape), w)
    if not shapes:
        return RowsChoice(kernels.native_linear_rows(), "no float32 matrix to measure on")
    kernels.native_linear_rows(MAX_NATIVE_ROWS)  # every candidate on the native kernel while measuring
    timings = []
    for m in CANDIDATE_ROWS:  # ascending, up to the first size the native kernel loses: larger ones cannot count
        timings.append((m, *_time_kernels(list(shapes.values()), m, repeats)))
        if timings[-1][1] > timings[-1][2]:
            break
    rows = pick_native_rows(timings)
    kernels.native_linear_rows(rows)
    return RowsChoice(rows, "measured", tuple(timings))


def _fixed_rows(environ: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    """The row bound environment variable ``name`` fixes (None when unset); ValueError names a value that
    is not an integer from ``low`` to ``high``."""
    fixed = environ.get(name, "").strip()
    if not fixed:
        return None
    try:
        rows = int(fixed)
    except ValueError:
        rows = low - 1
    if not low <= rows <= high:
        raise ValueError(f"{name}={fixed!r}: expected a row count from {low} to {high}")
    return rows


def _time_kernels(weights: list[torch.Tensor], rows: int, repeats: int) -> tuple[float, float]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    native, aten = torch.ops.flare.linear, torch.nn.functional.linear

    def once(kernel) -> float:
        began = time.perf_counter()
        for w in weights:
            kernel(inputs[w.shape[1]], w)
        return (time.perf_counter() - began) * 1e3

    once(native), once(aten)  # first touches
    best = [math.inf, math.inf]
    for _ in range(repeats):
        best[0] = min(best[0], once(native))
        best[1] = min(best[1], once(aten))
    return best[0], best[1]


# ---- which loop order serves decode steps: measured on the catalog's whole weight set ----

CHUNK_ROWS_ENV = "FLARE_LINEAR_CHUNK_ROWS"  # a fixed bound instead of the measurement (0..64)
DEFAULT_CHUNK_ROWS, MAX_CHUNK_ROWS = 8, 64  # csrc/flare_ops.cpp: kChunkRowsDefault, kMaxChunkRows
# Decode batches of the catalogs' buckets, from one row: which order streams a step's weights faster depends on
# the machine (on a 2-core AVX-512 Xeon the chunked one at 1-8 rows; on an AVX-512 EPYC with a 32 MiB L3 the
# panel order at one row, 1.8x on flare-tiny's K = 384). Above 32, prompt chunks are compute-bound.
CHUNK_CANDIDATE_ROWS = (1, 4, 8, 16, 32)


@dataclass(frozen=True, slots=True)
class OrderChoice:
    """A loop order's row bound for this process (the chunked order's, or the row order's), and what
    decided it."""

    rows: int
    source: str  # "measured", the environment variable that fixed it, or why nothing was measured
    megabytes: float = 0.0  # the weights measured on
    timings: tuple[tuple[int, float, float], ...] = ()  # (rows, this order's ms, the other's ms) per candidate
    order: str = "chunked"
    other: str = "panel"  # what serves the rows above the bound

    def describe(self) -> str:
        head = f"flare::linear: {self.order} order up to {self.rows} rows, {self.other} order above"
        if not self.timings:
            return f"{head} ({self.source})"
        measured = ", ".join(f"{m} rows {mine:.1f}/{theirs:.1f} ms" for m, mine, theirs in self.timings)
        return f"{head} ({self.order}/{self.other} over the catalog's {self.megabytes:.0f} MB of weights: {measured})"


def choose_chunk_rows(weights: Iterable[torch.Tensor], environ: Mapping[str, str] = os.environ,
                      repeats: int = 2) -> OrderChoice | None:
    """Set the row bound of the native kernel's chunked order for this process: ``FLARE_LINEAR_CHUNK_ROWS``
    when set, else the candidate sizes, from one row up, at which a pass over every float32 matrix of
    ``weights``, in order (what a step reads, so the last-level cache holds what it would), ran faster
    chunked than in the panel order (interleaved, best of ``repeats``), up to the first it lost: 0 (the
    panel order throughout) when it lost at one row. None with the Python kernels; a build without AVX-512
    has one order (bound 0). Call it before ``choose_native_rows``: 32 rows are measured on the native kernel."""
    from helios.ops import kernels

    if kernels.active() != "native":
        return None
    rows = _fixed_rows(environ, CHUNK_ROWS_ENV, 0, MAX_CHUNK_ROWS)
    if rows is not None:
        kernels.native_linear_chunk_rows(rows)
        return OrderChoice(kernels.native_linear_chunk_rows(), CHUNK_ROWS_ENV)
    if kernels.native_linear_chunk_rows(MAX_CHUNK_ROWS) == 0:
        return OrderChoice(0, "built without AVX-512: one loop order")
    matrices = _streamed_matrices(weights)
    if not matrices:
        kernels.native_linear_chunk_rows(DEFAULT_CHUNK_ROWS)
        return OrderChoice(DEFAULT_CHUNK_ROWS, "no float32 matrix to measure on")
    kernels.native_linear_row_rows(0)  # measured against the panel order alone; choose_row_rows comes after
    return _measured_order(matrices, CHUNK_CANDIDATE_ROWS, repeats, kernels.native_linear_chunk_rows, "chunked", "panel")


ROW_ROWS_ENV = "FLARE_LINEAR_ROW_ROWS"  # a fixed bound instead of the measurement (0..64)
MAX_ROW_ROWS = 64  # csrc/flare_ops.cpp: kMaxRowRows
ROW_CANDIDATE_ROWS = (1, 2, 4, 8, 16)  # decode batches; one row's stream matters where little arithmetic hides it


def choose_row_rows(weights: Iterable[torch.Tensor], environ: Mapping[str, str] = os.environ,
                    repeats: int = 2) -> OrderChoice | None:
    """Set the row bound of the native kernel's row order (one weight row at a time, one sequential stream)
    for this process: ``FLARE_LINEAR_ROW_ROWS`` when set, else the candidate sizes, from one row up, at which a
    pass over every float32 matrix of ``weights`` in order ran faster in the row order than in the order that
    serves them otherwise (``choose_chunk_rows``'s choice, so call it after that one), up to the first it
    lost (0: never). None with the Python kernels."""
    from helios.ops import kernels

    if kernels.active() != "native":
        return None
    other = "chunked" if kernels.native_linear_chunk_rows() else "panel"
    rows = _fixed_rows(environ, ROW_ROWS_ENV, 0, MAX_ROW_ROWS)
    if rows is not None:
        kernels.native_linear_row_rows(rows)
        return OrderChoice(rows, ROW_ROWS_ENV, order="row", other=other)
    matrices = _streamed_matrices(weights)
    if not matrices:
        kernels.native_linear_row_rows(0)
        return OrderChoice(0, "no float32 matrix to measure on", order="row", other=other)
    return _measured_order(matrices, ROW_CANDIDATE_ROWS, repeats, kernels.native_linear_row_rows, "row", other)


def _streamed_matrices(weights: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The float32 matrices a decode step streams through ``flare::linear``, in catalog order."""
    return [w for w in weights if w.dim() == 2 and w.dtype == torch.float32 and w.shape[1] >= 16
            and w.is_contiguous() and not _packed(w)]


def _packed(weight: torch.Tensor) -> bool:
    """A weight laid out for the packed kernel, which serves it at every row count: no order or bound to
    measure on it (csrc/flare_ops.cpp, "Packed weights")."""
    from helios.ops import kernels

    return kernels.active() == "native" and bool(torch.ops.flare.linear_weight_packed(weight))


def _measured_order(matrices: list[torch.Tensor], candidates: Sequence[int], repeats: int, set_bound,
                    order: str, other: str) -> OrderChoice:
    """An order's bound (``set_bound``: a kernels setting): the candidates, ascending, up to the first at
    which a pass over ``matrices`` ran slower with the order serving it (bound m) than without (bound m - 1);
    the bound is set before returning. Measured on the native kernel at any row count."""
    from helios.ops import kernels

    native_before = kernels.native_linear_rows()
    kernels.native_linear_rows(MAX_NATIVE_ROWS)
    timings = []
    try:
        for m in candidates:
            mine, theirs = _time_bound(matrices, m, repeats, set_bound)
            timings.append((m, mine, theirs))
            if mine > theirs:
                break
    finally:
        kernels.native_linear_rows(native_before)
    rows = pick_native_rows(timings, floor=0)
    set_bound(rows)
    megabytes = sum(w.numel() for w in matrices) * 4 / 1e6
    return OrderChoice(rows, "measured", megabytes, tuple(timings), order, other)


def _time_bound(weights: list[torch.Tensor], rows: int, repeats: int, set_bound,
                other: int | None = None) -> tuple[float, float]:
    """Best ms of one pass over ``weights`` at ``rows`` rows with the setting at ``rows`` (for an order's
    bound: the order serves them), then at ``other`` (default ``rows - 1``: the next order does),
    interleaved."""
    other = rows - 1 if other is None else other
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def once(bound: int) -> float:
        set_bound(bound)
        began = time.perf_counter()
        for w in weights:
            torch.ops.flare.linear(inputs[w.shape[1]], w)
        return (time.perf_counter() - began) * 1e3

    once(rows)  # first touch
    best = [math.inf, math.inf]
    for _ in range(repeats):
        best[0] = min(best[0], once(rows))
        best[1] = min(best[1], once(other))
    return best[0], best[1]


# ---- whether the packed products ask for weights ahead: measured on the catalog's packed weights ----

AHEAD_FROM_ENV = "FLARE_LINEAR_AHEAD_FROM"  # a fixed row count instead of the measurement (0: never, 1..256)
AHEAD_CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32)  # decode batches, then a small prompt chunk


@dataclass(frozen=True, slots=True)
class AheadChoice:
    """The fewest rows at which the packed products ask for the next chunk of weights ahead of use in this
    process (None: never), and what decided it."""

    rows: int | None
    source: str  # "measured", the environment variable that fixed it, or why nothing was measured
    megabytes: float = 0.0  # the packed weights measured on
    timings: tuple[tuple[int, float, float], ...] = ()  # (rows, asking ms, not asking ms) per candidate

    def describe(self) -> str:
        head = ("flare::linear: packed products never ask ahead" if self.rows is None
                else f"flare::linear: packed products ask ahead from {self.rows} rows")
        if not self.timings:
            return f"{head} ({self.source})"
        measured = ", ".join(f"{m} rows {mine:.1f}/{theirs:.1f} ms" for m, mine, theirs in self.timings)
        return f"{head} (asking/not over the catalog's {self.megabytes:.0f} MB of packed weights: {measured})"


def choose_ahead_from(weights: Iterable[torch.Tensor], environ: Mapping[str, str] = os.environ,
                      repeats: int = 2) -> AheadChoice | None:
    """Set the fewest rows at which the packed kernel asks for the next chunk of weights ahead of use, for
    this process: ``FLARE_LINEAR_AHEAD_FROM`` when set (0: never), else the first candidate size, from one
    row up, at which a pass over every packed matrix of ``weights``, in order (what a step reads, so the
    last-level cache holds what it would), ran no slower asking than not (interleaved, best of ``repeats``);
    never when it lost at every candidate. Asking overlaps streaming from memory with the arithmetic and
    only adds work where the last-level cache holds the weights (csrc/flare_ops.cpp, "Packed weights").
    None with the Python kernels; the setting is left alone where nothing is packed."""
    from helios.ops import kernels

    if kernels.active() != "native":
        return None
    rows = _fixed_rows(environ, AHEAD_FROM_ENV, 0, MAX_NATIVE_ROWS)
    if rows is not None:
        kernels.native_linear_ahead_from(rows or kernels.NEVER_AHEAD)
        return AheadChoice(rows or None, AHEAD_FROM_ENV)
    packed = [w for w in weights if w.dim() == 2 and w.dtype == torch.float32 and _packed(w)]
    if not packed:
        return AheadChoice(_ahead_rows(kernels.native_linear_ahead_from()), "no packed weights to measure on")
    timings = []
    chosen = kernels.NEVER_AHEAD
    for m in AHEAD_CANDIDATE_ROWS:
        asking, not_asking = _time_ahead(packed, m, repeats)
        timings.append((m, asking, not_asking))
        if asking <= not_asking:
            chosen = m
            break
    kernels.native_linear_ahead_from(chosen)
    megabytes = sum(w.numel() for w in packed) * 4 / 1e6
    return AheadChoice(_ahead_rows(chosen), "measured", megabytes, tuple(timings))


def _time_ahead(weights: list[torch.Tensor], rows: int, repeats: int) -> tuple[float, float]:
    """Best ms of one pass over ``weights`` at ``rows`` rows asking ahead (the setting at ``rows``), then not
    (at ``rows + 1``), interleaved."""
    from helios.ops import kernels

    return _time_bound(weights, rows, repeats, kernels.native_linear_ahead_from, other=rows + 1)


def _ahead_rows(setting: int) -> int | None:
    from helios.ops import kernels

    return None if setting >= kernels.NEVER_AHEAD else setting


def choose_linear_kernels(weights: Iterable[torch.Tensor], environ: Mapping[str, str] = os.environ
                          ) -> tuple[OrderChoice | RowsChoice, ...]:
    """What ``flare run`` sets before its warm-up: the loop orders (``choose_chunk_rows``, then
    ``choose_row_rows`` against it), then the native kernel's row bound (``choose_native_rows``), then from
    how many rows the packed products ask ahead (``choose_ahead_from``), each measured on ``weights`` or
    fixed by its environment variable. The choices made (none with the Python
    kernels); ValueError names a bad variable."""
    weights = list(weights)
    choices = (choose_chunk_rows(weights, environ), choose_row_rows(weights, environ),
               choose_native_rows(weights, environ), choose_ahead_from(weights, environ))
    return tuple(c for c in choices if c is not None)
