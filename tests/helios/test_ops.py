"""The flare:: custom ops against plain dense references (spec C14: packed rows,
inactive rows and unused capacity mutate nothing).

Every behaviour test runs twice: through ``torch.ops.flare`` (the kernels this
process installed, native C++ where a compiler built them) and through the
Python reference kernels called directly, so both implementations are held to
the same rules and the same error messages."""

from __future__ import annotations

import math

import pytest
import torch

from helios.ops.layout import NO_PAGE
from numerics import assert_close_paths, chain_tolerance

import helios.ops  # noqa: F401  (registers flare::)
from helios.ops import attention, kernels, kv_cache, linear, sampling, slot_state

LAYERS, PAGES, PAGE, KV_HEADS, HEADS, DIM = 2, 24, 4, 2, 4, 8
SLOTS, MAX_PAGES = 4, 6


class _PythonKernels:
    write_kv = staticmethod(kv_cache.write_kv)
    paged_attention = staticmethod(attention.paged_attention)
    write_slot_state = staticmethod(slot_state.write_slot_state)
    write_token_history = staticmethod(slot_state.write_token_history)


@pytest.fixture(params=["installed", "python"])
def flare(request):
    """The op namespace under test: the installed kernels, or the Python references."""
    return torch.ops.flare if request.param == "installed" else _PythonKernels


def _page_table(gen: torch.Generator) -> torch.Tensor:
    """Each slot owns MAX_PAGES distinct pages, scattered over the pool."""
    return torch.randperm(PAGES, generator=gen)[: SLOTS * MAX_PAGES].view(SLOTS, MAX_PAGES).int()


def _ragged_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch = 1 + seed % 4
    row_slots = torch.randperm(SLOTS, generator=gen)[:batch].int()
    query_lens = torch.randint(0, 6, (batch,), generator=gen).int()
    query_lens[0] = max(int(query_lens[0]), 1)  # at least one active row
    start = torch.randint(0, 14, (batch,), generator=gen).int()
    return gen, row_slots, query_lens, start


def _dense_attention(q, k, v, start: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with GQA by repetition and a causal offset."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _empty_cache():
    return torch.zeros(LAYERS, PAGES, PAGE, KV_HEADS, DIM), torch.zeros(LAYERS, PAGES, PAGE, KV_HEADS, DIM)


@pytest.mark.numerics
@pytest.mark.parametrize("seed", range(12))
def test_C14_paged_attention_matches_dense_reference_on_ragged_rows(seed, flare):
    gen, row_slots, query_lens, start = _ragged_case(seed)
    page_table = _page_table(gen)
    k_cache, v_cache = _empty_cache()
    ends = (start + query_lens).tolist()
    # Each row's whole sequence: committed context followed by its new tokens.
    seqs = [(torch.randn(e, KV_HEADS, DIM, generator=gen), torch.randn(e, KV_HEADS, DIM, generator=gen)) for e in ends]
    zeros = torch.zeros_like(start)
    for layer in range(LAYERS):
        flare.write_kv(
            k_cache, v_cache, layer, torch.cat([k for k, _ in seqs]), torch.cat([v for _, v in seqs]),
            page_table, row_slots, start + query_lens, zeros,
        )
    capacity = int(query_lens.sum()) + 3  # unused packed capacity at the end
    q = torch.randn(capacity, HEADS, DIM, generator=gen)
    out = flare.paged_attention(
        q, k_cache, v_cache, 1, page_table, row_slots, query_lens, start, 1 / math.sqrt(DIM)
    )
    offset = 0
    for (k, v), length, s in zip(seqs, query_lens.tolist(), start.tolist()):
        if length:
            want = _dense_attention(q[offset : offset + length], k, v, s)
            # Scores over DIM, then the softmax sum and the weighted sum over the context: three
            # reductions that the op and the dense reference block differently.
            tolerance = chain_tolerance(torch.float32, [DIM, s + length, s + length])
            assert_close_paths(out[offset : offset + length], want, tolerance, f"row at {offset}")
        offset += length
    assert torch.all(out[offset:] == 0), "unused packed capacity must stay zero"


@pytest.mark.parametrize("seed", range(8))
def test_C14_write_kv_touches_exactly_the_addressed_slots(seed, flare):
    gen, row_slots, query_lens, start = _ragged_case(seed)
    page_table = _page_table(gen)
    k_cache = torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    capacity = int(query_lens.sum()) + 5
    k = torch.randn(capacity, KV_HEADS, DIM, generator=gen)
    v = torch.randn(capacity, KV_HEADS, DIM, generator=gen)
    flare.write_kv(k_cache, v_cache, 1, k, v, page_table, row_slots, query_lens, start)

    touched = torch.zeros(LAYERS, PAGES, PAGE, dtype=torch.bool)
    offset = 0
    for slot, length, s in zip(row_slots.tolist(), query_lens.tolist(), start.tolist()):
        for i in range(length):
            page, off = int(page_table[slot, (s + i) // PAGE]), (s + i) % PAGE
            assert torch.equal(k_cache[1, page, off], k[offset + i])
            assert torch.equal(v_cache[1, page, off], v[offset + i])
            touched[1, page, off] = True
        offset += length
    assert torch.equal(k_cache[~touched], before_k[~touched])
    assert torch.equal(v_cache[~touched], before_v[~touched])
    assert int(touched.sum()) == int(query_lens.sum())


def test_C14_inactive_rows_write_nothing(flare):
    k_cache, v_cache = _empty_cache()
    page_table = _page_table(torch.Generator().manual_seed(0))
    row_slots = torch.tensor([2, 2], dtype=torch.int32)  # padding rows may repeat a slot
    query_lens = torch.zeros(2, dtype=torch.int32)
    k = torch.ones(4, KV_HEADS, DIM)
    flare.write_kv(k_cache, v_cache, 0, k, k, page_table, row_slots, query_lens, torch.zeros(2, dtype=torch.int32))
    assert not k_cache.any() and not v_cache.any()

    pending, seq_lens = torch.arange(SLOTS), torch.arange(SLOTS, dtype=torch.int32)
    flare.write_slot_state(
        pending, seq_lens, torch.tensor([1, 3], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
        torch.tensor([70, 90]), torch.tensor([7, 9], dtype=torch.int32),
    )
    assert pending.tolist() == [0, 70, 2, 3] and seq_lens.tolist() == [0, 7, 2, 3]


def test_write_kv_rejects_context_beyond_the_slot_capacity(flare):
    k_cache, v_cache = _empty_cache()
    page_table = _page_table(torch.Generator().manual_seed(0))
    k = torch.zeros(2, KV_HEADS, DIM)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="exceeds the slot capacity"):
        flare.write_kv(
            k_cache, v_cache, 0, k, k, page_table, one, one * 2, one * (MAX_PAGES * PAGE - 1)
        )


def test_S3_ops_refuse_a_block_the_slot_does_not_own(flare):
    """A frame that outran its reservation fails loudly instead of writing page 0 (another slot's)."""
    k_cache, v_cache = _empty_cache()
    page_table = _page_table(torch.Generator().manual_seed(0))
    page_table[1, 1:] = NO_PAGE  # slot 1 owns only its first block
    k = torch.ones(2, KV_HEADS, DIM)
    slot, two = torch.ones(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32)
    start = torch.full((1,), PAGE - 1, dtype=torch.int32)  # the second token falls in block 1
    with pytest.raises(ValueError, match="slot 1 has no page for block 1"):
        flare.write_kv(k_cache, v_cache, 0, k, k, page_table, slot, two, start)
    assert not k_cache.any()
    q = torch.ones(2, HEADS, DIM)
    with pytest.raises(ValueError, match="slot 1 has no page for block 1"):
        flare.paged_attention(q, k_cache, v_cache, 0, page_table, slot, two, start, 1.0)


def test_ops_pass_opcheck():
    gen, row_slots, query_lens, start = _ragged_case(3)
    page_table = _page_table(gen)
    k_cache = torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    tokens = int((query_lens).sum()) + 2
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    meta = (page_table, row_slots, query_lens, start)
    torch.library.opcheck(torch.ops.flare.write_kv.default, (k_cache, v_cache, 0, k, k, *meta))
    torch.library.opcheck(torch.ops.flare.paged_attention.default, (q, k_cache, v_cache, 0, *meta, 0.35))
    state = (torch.arange(SLOTS), torch.arange(SLOTS, dtype=torch.int32))
    new = (torch.arange(len(row_slots)) + 50, torch.arange(len(row_slots), dtype=torch.int32) + 9)
    torch.library.opcheck(torch.ops.flare.write_slot_state.default, (*state, row_slots, query_lens, *new))
    torch.library.opcheck(torch.ops.flare.write_token_history.default, _history_case(3))


def test_paged_attention_reads_only_the_live_context(flare):
    """Work follows the real lengths: positions past each row's context are never read,
    so NaN there and garbage page ids past the used pages change nothing."""
    gen, row_slots, query_lens, start = _ragged_case(5)
    page_table = _page_table(gen)
    k_cache = torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen)
    q = torch.randn(int(query_lens.sum()), HEADS, DIM, generator=gen)
    args = (row_slots, query_lens, start, 0.3)
    want = flare.paged_attention(q, k_cache, v_cache, 0, page_table, *args)

    live = torch.zeros(PAGES, PAGE, dtype=torch.bool)
    garbage_table = torch.full_like(page_table, 10**6)
    for slot, end in zip(row_slots.tolist(), (start + query_lens).tolist()):
        used = -(-end // PAGE)
        garbage_table[slot, :used] = page_table[slot, :used]
        for pos in range(end):
            live[page_table[slot, pos // PAGE], pos % PAGE] = True
    k_cache[:, ~live] = float("nan")
    v_cache[:, ~live] = float("nan")
    got = flare.paged_attention(q, k_cache, v_cache, 0, garbage_table, *args)
    assert torch.equal(got, want)  # the same op on the same live values: one path, so bitwise


VOCAB = 10


def _history_case(seed: int):
    """Slot histories, and a frame whose active rows carry new histories for their slots."""
    gen, row_slots, query_lens, _ = _ragged_case(seed)
    counts = torch.randint(0, 5, (SLOTS, VOCAB), generator=gen, dtype=torch.int32)
    seen = torch.rand(SLOTS, VOCAB, generator=gen) < 0.5
    new_counts = torch.randint(5, 9, (len(row_slots), VOCAB), generator=gen, dtype=torch.int32)
    new_seen = torch.rand(len(row_slots), VOCAB, generator=gen) < 0.5
    return counts, seen, row_slots, query_lens, new_counts, new_seen


@pytest.mark.parametrize("seed", range(6))
def test_token_history_replaces_only_the_active_rows_slots(seed, flare):
    counts, seen, row_slots, query_lens, new_counts, new_seen = _history_case(seed)
    want_counts, want_seen = counts.clone(), seen.clone()
    for b, (slot, length) in enumerate(zip(row_slots.tolist(), query_lens.tolist())):
        if length > 0:
            want_counts[slot], want_seen[slot] = new_counts[b], new_seen[b]
    flare.write_token_history(counts, seen, row_slots, query_lens, new_counts, new_seen)
    assert torch.equal(counts, want_counts) and torch.equal(seen, want_seen)


def test_token_history_refuses_a_slot_outside_the_state(flare):
    counts, seen, row_slots, query_lens, new_counts, new_seen = _history_case(1)
    before = counts.clone()
    row_slots[0] = SLOTS
    with pytest.raises(ValueError, match=f"outside 0..{SLOTS - 1}"):
        flare.write_token_history(counts, seen, row_slots, query_lens, new_counts, new_seen)
    assert torch.equal(counts, before)


def test_active_rows_sharing_a_slot_are_rejected(flare):
    pending, seq_lens = torch.zeros(SLOTS, dtype=torch.int64), torch.zeros(SLOTS, dtype=torch.int32)
    two = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="share a slot"):
        flare.write_slot_state(pending, seq_lens, two, two, torch.ones(2, dtype=torch.int64), two)


@pytest.mark.numerics
@pytest.mark.parametrize("seed", range(6))
def test_installed_kernels_agree_with_the_python_references(seed):
    """The native kernels compute what the Python ones do: writes bitwise, attention within its
    three reductions' bound (the native kernel sums in its own order)."""
    gen, row_slots, query_lens, start = _ragged_case(seed)
    page_table = _page_table(gen)
    caches = [torch.randn(LAYERS, PAGES, PAGE, KV_HEADS, DIM, generator=gen) for _ in range(2)]
    tokens = int(query_lens.sum()) + 2
    k, v = torch.randn(tokens, KV_HEADS, DIM, generator=gen), torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    meta = (page_table, row_slots, query_lens, start)
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    torch.ops.flare.write_kv(*mine, 1, k, v, *meta)
    kv_cache.write_kv(*theirs, 1, k, v, *meta)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    got = torch.ops.flare.paged_attention(q, *mine, 1, *meta, 0.3)
    want = attention.paged_attention(q, *theirs, 1, *meta, 0.3)
    context = int((start + query_lens).max())
    assert_close_paths(got, want, chain_tolerance(torch.float32, [DIM, context, context]), "attention")


def test_kernel_choice_is_reported_and_checked():
    assert kernels.active() in ("native", "python")
    assert kernels.install("python") == kernels.active()  # chosen once per process; later calls report it


def test_native_kernels_that_cannot_be_built_are_one_clear_error(tmp_path, monkeypatch):
    """A failing compiler or an unwritable cache raises NativeKernelsUnavailable (auto then falls back to
    the Python kernels with a warning); nothing half-built is left where a later start would load it."""
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails at once
    with pytest.raises(kernels.NativeKernelsUnavailable, match="failed.*build.log"):
        kernels.native_library(cache=tmp_path)
    assert not list(tmp_path.rglob(kernels.LIBRARY_NAME))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(kernels.NativeKernelsUnavailable, match="cannot build into"):
        kernels.native_library(cache=blocker / "cache")


@pytest.mark.numerics
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 17, 40, 256, 257])
@pytest.mark.parametrize("inner, outer", [(64, 9), (100, 13), (384, 4)])
def test_linear_matches_a_float64_product(rows, inner, outer):
    """flare::linear is x @ weight.T + bias for any row count (its native kernel serves up to 256 rows,
    ATen more), any inner length (a tail past the 16-wide lanes) and any number of outputs (a tail past
    its panels of four), within one K-long reduction's bound of the exact product."""
    gen = torch.Generator().manual_seed(rows * 1000 + inner + outer)
    x = torch.randn(rows, inner, generator=gen)
    weight, bias = torch.randn(outer, inner, generator=gen), torch.randn(outer, generator=gen)
    want = (x.double() @ weight.double().T + bias.double()).float()
    tolerance = chain_tolerance(torch.float32, [inner + 1])
    assert_close_paths(torch.ops.flare.linear(x, weight, bias), want, tolerance, "linear with bias")
    assert_close_paths(torch.ops.flare.linear(x, weight), (x.double() @ weight.double().T).float(), tolerance,
                       "linear")
    batched = torch.ops.flare.linear(x.view(1, rows, inner), weight, bias)  # leading dimensions are kept
    assert batched.shape == (1, rows, outer)
    assert_close_paths(batched[0], want, tolerance, "linear [1, rows, inner]")


@pytest.fixture
def native_rows():
    """Set flare::linear's native row bound for one test; the process's bound is restored after it."""
    before = kernels.native_linear_rows()
    yield kernels.native_linear_rows
    kernels.native_linear_rows(before)


@pytest.mark.skipif(kernels.active() != "native", reason="ATen's product (the Python kernel) blocks by batch size")
def test_linear_rows_do_not_depend_on_the_batch(native_rows):
    """A row's product is the same whatever other rows share the call, up to the native kernel's 256 rows:
    a decode step's output for one stream does not change with how many streams run beside it."""
    native_rows(256)
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(256, 200, generator=gen), torch.randn(11, 200, generator=gen)
    alone = torch.cat([torch.ops.flare.linear(x[i:i + 1], weight) for i in range(256)])
    for rows in (2, 3, 4, 5, 8, 16, 17, 40, 64, 129, 256):
        assert torch.equal(torch.ops.flare.linear(x[:rows], weight), alone[:rows]), rows


@pytest.mark.skipif(kernels.active() != "native", reason="the row bound is the native kernel's")
def test_the_row_bound_sends_larger_products_to_aten_and_keeps_decode_steps_native(native_rows):
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(64, 200, generator=gen), torch.randn(24, 200, generator=gen)
    alone = torch.cat([torch.ops.flare.linear(x[i:i + 1], weight) for i in range(64)])
    aten = torch.nn.functional.linear(x, weight)
    assert not torch.equal(alone, aten)  # the two kernels sum in different orders: the checks below can tell them apart
    assert native_rows(32) == 32
    assert torch.equal(torch.ops.flare.linear(x[:32], weight), alone[:32])  # at the bound: native
    assert torch.equal(torch.ops.flare.linear(x, weight), aten)  # above it: ATen's GEMM
    assert native_rows(3) == 16  # decode steps (up to 16 rows) are never sent to ATen ...
    assert torch.equal(torch.ops.flare.linear(x[:16], weight), alone[:16])
    assert native_rows(1000) == 256  # ... and the native kernel serves at most 256
    assert torch.equal(torch.ops.flare.linear(x, weight), alone)


def test_pick_native_rows_stops_at_the_first_size_the_native_kernel_loses():
    assert linear.pick_native_rows([(32, 1.0, 2.0), (64, 2.0, 3.0), (128, 5.0, 4.0), (256, 8.0, 9.0)]) == 64
    assert linear.pick_native_rows([(32, 3.0, 2.0), (64, 1.0, 3.0)]) == 16  # lost at once: decode steps only
    assert linear.pick_native_rows([(32, 1.0, 1.0), (64, 1.0, 2.0), (128, 1.0, 2.0), (256, 1.0, 2.0)]) == 256


@pytest.mark.skipif(kernels.active() != "native", reason="the row bound is the native kernel's")
def test_choose_native_rows_measures_or_takes_the_environment(native_rows):
    weights = [torch.randn(48, 32), torch.randn(32, 48), torch.randn(48, 32), torch.randn(5)]
    choice = linear.choose_native_rows(weights, environ={}, repeats=1)
    assert choice.source == "measured" and choice.rows in (16, *linear.CANDIDATE_ROWS)
    assert native_rows() == choice.rows
    assert choice.rows == linear.pick_native_rows(choice.timings)  # it lists every size up to the first loss
    fixed = linear.choose_native_rows(weights, environ={linear.NATIVE_ROWS_ENV: "64"})
    assert (fixed.rows, fixed.source, native_rows()) == (64, linear.NATIVE_ROWS_ENV, 64)
    for bad in ("8", "257", "many"):
        with pytest.raises(ValueError, match=f"{linear.NATIVE_ROWS_ENV}='{bad}'"):
            linear.choose_native_rows(weights, environ={linear.NATIVE_ROWS_ENV: bad})


@pytest.fixture
def chunk_rows():
    """Set the native kernel's chunked-order bound for one test; the process's bound is restored after it."""
    before = kernels.native_linear_chunk_rows()
    yield kernels.native_linear_chunk_rows
    kernels.native_linear_chunk_rows(before)


@pytest.fixture
def row_rows():
    """Set the native kernel's row-order bound for one test; the process's bound is restored after it."""
    before = kernels.native_linear_row_rows()
    yield kernels.native_linear_row_rows
    kernels.native_linear_row_rows(before)


def _has_chunked_order() -> bool:
    return kernels.active() == "native" and kernels.native_linear_chunk_rows() != 0


@pytest.mark.skipif(not _has_chunked_order(), reason="the native kernel's two loop orders (an AVX-512 build)")
@pytest.mark.parametrize("inner", [64, 200, 300])  # one chunk of K; a chunk and a masked tail; three chunks
def test_linear_loop_orders_give_the_same_bits(chunk_rows, row_rows, native_rows, inner):
    """The chunked, row and panel orders run the same FMAs in the same order per output (csrc/flare_ops.cpp),
    so choosing them per process (choose_chunk_rows, choose_row_rows) never changes a token: equal bits at
    every row count those orders serve, tails of rows (not a multiple of 4) and of outputs (11: a panel of 4
    short) too."""
    native_rows(256)
    gen = torch.Generator().manual_seed(inner)
    x, weight, bias = torch.randn(64, inner, generator=gen), torch.randn(11, inner, generator=gen), torch.randn(11, generator=gen)
    for rows in (1, 2, 3, 4, 5, 8, 13, 16, 17, 32, 33, 64):
        row_rows(0)
        chunk_rows(64)
        chunked = torch.ops.flare.linear(x[:rows], weight, bias), torch.ops.flare.linear(x[:rows], weight)
        chunk_rows(0)
        panel = torch.ops.flare.linear(x[:rows], weight, bias), torch.ops.flare.linear(x[:rows], weight)
        row_rows(64)
        by_row = torch.ops.flare.linear(x[:rows], weight, bias), torch.ops.flare.linear(x[:rows], weight)
        assert all(torch.equal(a, b) for a, b in zip(chunked, panel)), rows
        assert all(torch.equal(a, b) for a, b in zip(by_row, panel)), rows
        want = (x[:rows].double() @ weight.double().T + bias.double()).float()
        assert_close_paths(chunked[0], want, chain_tolerance(torch.float32, [inner + 1]), f"chunked, {rows} rows")


@pytest.mark.skipif(not _has_chunked_order(), reason="the native kernel's two loop orders (an AVX-512 build)")
def test_the_chunked_order_bound_is_clamped(chunk_rows):
    assert chunk_rows(1000) == 64  # its accumulators live on the stack: at most 64 rows
    assert chunk_rows(0) == 0  # 0: the panel order throughout
    assert chunk_rows(8) == 8


def test_pick_native_rows_takes_its_floor_for_the_chunked_order():
    assert linear.pick_native_rows([(16, 1.0, 2.0), (32, 3.0, 2.0)], floor=8) == 16
    assert linear.pick_native_rows([(16, 2.0, 1.0), (32, 1.0, 2.0)], floor=8) == 8  # lost at once: the floor
    assert linear.pick_native_rows([(16, 1.0, 2.0), (32, 1.0, 2.0)], floor=8) == 32
    # the chunked order's candidates start at one row: losing there is the panel order throughout
    assert linear.pick_native_rows([(1, 2.0, 1.0), (4, 1.0, 2.0)], floor=0) == 0
    assert linear.pick_native_rows([(1, 1.0, 2.0), (4, 1.0, 2.0), (8, 3.0, 2.0)], floor=0) == 4


@pytest.mark.skipif(not _has_chunked_order(), reason="the native kernel's two loop orders (an AVX-512 build)")
def test_choose_chunk_rows_measures_or_takes_the_environment(chunk_rows, native_rows):
    weights = [torch.randn(48, 32), torch.randn(32, 48), torch.randn(5), torch.randn(4, 8)]
    native_rows(16)
    choice = linear.choose_chunk_rows(weights, environ={}, repeats=1)
    assert choice.source == "measured" and choice.rows in (0, *linear.CHUNK_CANDIDATE_ROWS)
    assert chunk_rows() == choice.rows and native_rows() == 16  # the row bound it raised to measure is restored
    assert choice.rows == linear.pick_native_rows(choice.timings, floor=0)
    assert choice.timings[0][0] == 1  # measured from one row up ...
    measured = [m for m, _, _ in choice.timings]
    assert measured == list(linear.CHUNK_CANDIDATE_ROWS[:len(measured)])  # ... in order, up to the first loss
    assert all(c <= p for _, c, p in choice.timings[:-1])
    assert choice.megabytes == pytest.approx((48 * 32 * 2) * 4 / 1e6)  # matrices only, K >= 16
    fixed = linear.choose_chunk_rows(weights, environ={linear.CHUNK_ROWS_ENV: "0"})
    assert (fixed.rows, fixed.source, chunk_rows()) == (0, linear.CHUNK_ROWS_ENV, 0)
    for bad in ("-1", "65", "many"):
        with pytest.raises(ValueError, match=f"{linear.CHUNK_ROWS_ENV}='{bad}'"):
            linear.choose_chunk_rows(weights, environ={linear.CHUNK_ROWS_ENV: bad})
    before = kernels.native_linear_ahead_from()
    try:
        both = linear.choose_linear_kernels(weights, environ={
            linear.CHUNK_ROWS_ENV: "16", linear.ROW_ROWS_ENV: "2", linear.NATIVE_ROWS_ENV: "32",
            linear.AHEAD_FROM_ENV: "8"})
        assert [c.rows for c in both] == [16, 2, 32, 8] and (chunk_rows(), native_rows()) == (16, 32)
        assert kernels.native_linear_ahead_from() == 8
    finally:
        kernels.native_linear_ahead_from(before)


@pytest.mark.skipif(kernels.active() != "native", reason="the row order is the native kernel's")
def test_choose_row_rows_measures_against_the_order_chosen_before_or_takes_the_environment(chunk_rows, row_rows,
                                                                                            native_rows):
    weights = [torch.randn(48, 32), torch.randn(32, 48), torch.randn(5), torch.randn(4, 8)]
    native_rows(16)
    chunk_rows(0)
    choice = linear.choose_row_rows(weights, environ={}, repeats=1)
    assert choice.source == "measured" and choice.other == "panel" and choice.rows in (0, *linear.ROW_CANDIDATE_ROWS)
    assert row_rows() == choice.rows and native_rows() == 16  # the row bound it raised to measure is restored
    assert choice.rows == linear.pick_native_rows(choice.timings, floor=0)
    measured = [m for m, _, _ in choice.timings]
    assert measured == list(linear.ROW_CANDIDATE_ROWS[:len(measured)])  # from one row, in order, to the first loss
    assert all(mine <= theirs for _, mine, theirs in choice.timings[:-1])
    assert choice.describe().startswith(f"flare::linear: row order up to {choice.rows} rows, panel order above (row/panel")
    chunk_rows(8)
    assert linear.choose_row_rows(weights, environ={}, repeats=1).other == "chunked"
    fixed = linear.choose_row_rows(weights, environ={linear.ROW_ROWS_ENV: "0"})
    assert (fixed.rows, fixed.source, row_rows()) == (0, linear.ROW_ROWS_ENV, 0)
    assert row_rows(1000) == 64 and row_rows(0) == 0  # clamped to the kernel's bound
    for bad in ("-1", "65", "many"):
        with pytest.raises(ValueError, match=f"{linear.ROW_ROWS_ENV}='{bad}'"):
            linear.choose_row_rows(weights, environ={linear.ROW_ROWS_ENV: bad})


def _packs() -> bool:
    return kernels.active() == "native" and kernels.packs_linear_weights()


@pytest.mark.numerics
@pytest.mark.skipif(not _packs(), reason="packed weights are the native AVX-512 kernel's")
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 16, 17, 300])
@pytest.mark.parametrize("inner, outer", [(64, 9), (100, 32), (384, 33), (37, 70), (700, 40)])
def test_packed_linear_matches_a_float64_product(rows, inner, outer):
    """A packed weight gives x @ weight.T + bias at any row count, past the 8-row blocks (tails 1-7) and
    past 256 rows (no ATen fallback can read it), and at any output count (a last panel under 32, whose
    padding must not reach the output), within one K-long chain's bound of the exact product."""
    gen = torch.Generator().manual_seed(rows * 1000 + inner + outer)
    x = torch.randn(rows, inner, generator=gen)
    weight, bias = torch.randn(outer, inner, generator=gen), torch.randn(outer, generator=gen)
    packed = torch.ops.flare.pack_linear_weight(weight)
    assert packed.shape == weight.shape and packed.stride() == weight.stride()
    assert torch.ops.flare.linear_weight_packed(packed) and not torch.ops.flare.linear_weight_packed(weight)
    assert torch.ops.flare.pack_linear_weight(packed) is not None  # packing a packed weight keeps it
    assert torch.ops.flare.linear_weight_packed(torch.ops.flare.pack_linear_weight(packed))
    tolerance = chain_tolerance(torch.float32, [inner + 1])
    want = (x.double() @ weight.double().T + bias.double()).float()
    assert_close_paths(torch.ops.flare.linear(x, packed, bias), want, tolerance, "packed linear with bias")
    assert_close_paths(torch.ops.flare.linear(x, packed), (x.double() @ weight.double().T).float(), tolerance,
                       "packed linear")
    out = torch.ops.flare.linear(x.view(1, rows, inner), packed, bias)
    assert out.shape == (1, rows, outer)


@pytest.fixture
def ahead_from():
    """Set from how many rows the packed products ask ahead, for one test; the process's setting is restored
    after it."""
    before = kernels.native_linear_ahead_from()
    yield kernels.native_linear_ahead_from
    kernels.native_linear_ahead_from(before)


@pytest.mark.skipif(not _packs(), reason="packed weights are the native AVX-512 kernel's")
@pytest.mark.parametrize("inner", [200, 700])  # one chunk of K (256 steps); three, the last short
def test_packed_linear_rows_do_not_depend_on_the_batch(inner, ahead_from):
    """A row's product through a packed weight is the same bits whatever rows share the call, at every row
    count (8-row blocks, their tails, and above the unpacked kernel's 256-row bound), whether or not the
    products ask for weights ahead (a prefetch moves no arithmetic), and across the chunks of K that every
    block visits in turn (each output stays one chain over k in order)."""
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(300, inner, generator=gen), torch.randn(45, inner, generator=gen)
    bias = torch.randn(45, generator=gen)
    packed = torch.ops.flare.pack_linear_weight(weight)
    ahead_from(kernels.NEVER_AHEAD)
    alone = torch.cat([torch.ops.flare.linear(x[i:i + 1], packed, bias) for i in range(300)])
    # one chain of fused multiply-adds over k in order is what every block must reproduce, chunks of K or
    # not: each step rounds x * w + acc once to float32 (the float64 product of two float32 values is exact;
    # rounding the float64 sum first changes the float32 result only at an exact float64 tie, which these
    # random values do not hit)
    chain = torch.zeros(300, 45)
    for k in range(inner):
        chain = (chain.double() + x[:, k:k + 1].double() * weight[:, k].double()).float()
    assert torch.equal(alone, chain + bias)
    for setting in (kernels.NEVER_AHEAD, 1):
        ahead_from(setting)
        for rows in (1, 2, 3, 7, 8, 9, 15, 16, 17, 64, 257, 300):
            assert torch.equal(torch.ops.flare.linear(x[:rows], packed, bias), alone[:rows]), (setting, rows)
            assert torch.equal(torch.ops.flare.linear(x[300 - rows:], packed, bias), alone[300 - rows:]), (setting, rows)


@pytest.mark.skipif(kernels.active() != "native", reason="the native kernel's")
def test_a_product_without_an_inner_dimension_is_the_bias():
    """K = 0: no multiply-adds, so every output is its bias (or zero); an unwritten output would be whatever
    the allocation held."""
    x, weight, bias = torch.randn(5, 0), torch.randn(40, 0), torch.randn(40)
    assert torch.equal(torch.ops.flare.linear(x, weight, bias), bias.expand(5, 40))
    assert torch.equal(torch.ops.flare.linear(x, weight), torch.zeros(5, 40))


@pytest.mark.skipif(not _packs(), reason="packed weights are the native AVX-512 kernel's")
def test_choose_ahead_from_measures_on_packed_weights_or_takes_the_environment(ahead_from):
    weights = [torch.ops.flare.pack_linear_weight(torch.randn(64, 300)) for _ in range(3)] + [torch.randn(48, 32)]
    choice = linear.choose_ahead_from(weights, environ={}, repeats=1)
    assert choice.source == "measured"
    measured = [m for m, _, _ in choice.timings]
    assert measured == list(linear.AHEAD_CANDIDATE_ROWS[:len(measured)])  # from one row, in order, to the first win
    assert all(asking > not_asking for _, asking, not_asking in choice.timings[:-1])
    last, asking, not_asking = choice.timings[-1]
    if asking <= not_asking:
        assert choice.rows == last and ahead_from() == last
    else:  # lost at every candidate
        assert choice.rows is None and len(measured) == len(linear.AHEAD_CANDIDATE_ROWS)
        assert ahead_from() == kernels.NEVER_AHEAD
    assert choice.megabytes == pytest.approx(3 * 64 * 300 * 4 / 1e6)  # the packed matrices only
    fixed = linear.choose_ahead_from(weights, environ={linear.AHEAD_FROM_ENV: "4"})
    assert (fixed.rows, fixed.source, ahead_from()) == (4, linear.AHEAD_FROM_ENV, 4)
    never = linear.choose_ahead_from(weights, environ={linear.AHEAD_FROM_ENV: "0"})
    assert never.rows is None and ahead_from() == kernels.NEVER_AHEAD
    assert never.describe().startswith("flare::linear: packed products never ask ahead")
    for bad in ("-1", "257", "many"):
        with pytest.raises(ValueError, match=f"{linear.AHEAD_FROM_ENV}='{bad}'"):
            linear.choose_ahead_from(weights, environ={linear.AHEAD_FROM_ENV: bad})
    unpacked = linear.choose_ahead_from([torch.randn(48, 32)], environ={})
    assert unpacked.source == "no packed weights to measure on" and unpacked.timings == ()


def test_choose_ahead_from_takes_the_first_size_at_which_asking_is_not_slower(monkeypatch, ahead_from):
    """The rule, on given timings: the first candidate at which asking ran no slower; never when it lost at
    all of them."""
    if not _packs():
        pytest.skip("packed weights are the native AVX-512 kernel's")
    weights = [torch.ops.flare.pack_linear_weight(torch.randn(32, 64))]
    losses = {1: (2.0, 1.0), 2: (1.5, 1.0), 4: (1.0, 1.0), 8: (0.5, 1.0)}
    monkeypatch.setattr(linear, "_time_ahead", lambda w, rows, repeats: losses.get(rows, (0.1, 1.0)))
    choice = linear.choose_ahead_from(weights, environ={})
    assert (choice.rows, ahead_from(), [m for m, _, _ in choice.timings]) == (4, 4, [1, 2, 4])
    monkeypatch.setattr(linear, "_time_ahead", lambda w, rows, repeats: (2.0, 1.0))
    choice = linear.choose_ahead_from(weights, environ={})
    assert choice.rows is None and ahead_from() == kernels.NEVER_AHEAD
    assert [m for m, _, _ in choice.timings] == list(linear.AHEAD_CANDIDATE_ROWS)


@pytest.mark.skipif(not _packs(), reason="packed weights are the native AVX-512 kernel's")
def test_packing_refuses_what_it_cannot_lay_out():
    """Only 2-D float32 weights are packed; a packed weight takes float32 rows only (ATen, which serves
    other dtypes, cannot read it): each refusal names the problem."""
    with pytest.raises(ValueError, match="2-D float32"):
        torch.ops.flare.pack_linear_weight(torch.randn(8))
    with pytest.raises(ValueError, match="2-D float32"):
        torch.ops.flare.pack_linear_weight(torch.randn(4, 8, dtype=torch.float64))
    packed = torch.ops.flare.pack_linear_weight(torch.randn(4, 8))
    with pytest.raises(ValueError, match="packed float32 weight takes float32"):
        torch.ops.flare.linear(torch.randn(2, 8, dtype=torch.float64), packed)


@pytest.mark.skipif(not _packs(), reason="packed weights are the native AVX-512 kernel's")
def test_start_up_measurements_skip_packed_weights(native_rows):
    """The loop orders and the row bound are timed on the weights they serve: a packed weight takes the
    packed kernel at every row count, so on packed weights alone there is nothing to measure."""
    packed = [torch.ops.flare.pack_linear_weight(torch.randn(64, 128)) for _ in range(3)]
    for choice in (linear.choose_chunk_rows(packed, environ={}), linear.choose_row_rows(packed, environ={}),
                   linear.choose_native_rows(packed, environ={})):
        assert choice.source == "no float32 matrix to measure on", choice


def test_packing_follows_flare_linear_pack(monkeypatch):
    """FLARE_LINEAR_PACK=0 turns packing off; a value other than 0 or 1 is refused as bad input."""
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    assert not kernels.packs_linear_weights()
    monkeypatch.setenv(kernels.PACK_ENV, "yes")
    with pytest.raises(kernels.KernelChoiceError, match="FLARE_LINEAR_PACK='yes' is not 0 or 1"):
        kernels.packs_linear_weights()


def test_linear_passes_opcheck_and_refuses_a_wrong_shape():
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(3, 32, generator=gen), torch.randn(8, 32, generator=gen), torch.randn(8, generator=gen)
    torch.library.opcheck(torch.ops.flare.linear.default, (x, weight, bias))
    torch.library.opcheck(torch.ops.flare.linear.default, (x, weight))
    for kernel in (torch.ops.flare.linear, linear.linear):
        with pytest.raises(ValueError, match="does not fit weight"):
            kernel(torch.randn(3, 31), weight)


# Model-shaped attention: Qwen3-0.6B's heads (16 query heads over 8 KV heads of 128) and a head size with a
# tail past the 16-wide lanes (40, four query heads per KV head); pages of 16 positions, so contexts end
# inside a page; prefill rows longer than the native kernel's tile of 16 queries.
ATTENTION_SHAPES = [(16, 8, 128, 16), (8, 2, 40, 16), (4, 4, 24, 5)]  # heads, kv_heads, dim, page_size


def _attention_case(shape, rows, seed: int):
    """Random caches, a scattered page table, and one frame: rows as (start, length), each in its own slot."""
    heads, kv_heads, dim, page = shape
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-(s + n) // page) for s, n in rows) + 1
    slots = len(rows) + 2
    num_pages = slots * max_pages + 3
    k_cache = torch.randn(2, num_pages, page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(2, num_pages, page, kv_heads, dim, generator=gen)
    page_table = torch.randperm(num_pages, generator=gen)[: slots * max_pages].view(slots, max_pages).int()
    row_slots = torch.randperm(slots, generator=gen)[: len(rows)].int()
    start = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    query_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(int(query_lens.sum()) + 2, heads, dim, generator=gen)
    return q, k_cache, v_cache, page_table, row_slots, query_lens, start


def _float64_attention(q, k_cache, v_cache, layer, page_table, row_slots, query_lens, start, scale):
    """The same attention in float64 from the cache positions each row's slot addresses (GQA by repetition)."""
    page = k_cache.shape[2]
    out, offset = torch.zeros(q.shape, dtype=torch.float64), 0
    for slot, length, s in zip(row_slots.tolist(), query_lens.tolist(), start.tolist()):
        positions = torch.arange(s + length)
        pages = page_table[slot].long()[positions // page]
        k = k_cache[layer, pages, positions % page].double()
        v = v_cache[layer, pages, positions % page].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[offset:offset + length].double(), k) * scale
        allowed = positions[None, :] <= torch.arange(s, s + length)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[offset:offset + length] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        offset += length
    return out


ATTENTION_ROWS = [
    [(159, 1)],  # one decode row whose context ends inside its last page
    [(159, 1), (0, 1), (31, 1), (16, 1), (47, 1)],  # decode rows of several lengths, page boundaries on both sides
    [(0, 37), (5, 1), (11, 20)],  # prefill rows beyond one tile of queries, beside a decode row
    [(64, 16), (3, 17)],  # a full tile, and a tile plus one query
]


@pytest.mark.numerics
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("rows", ATTENTION_ROWS)
def test_paged_attention_matches_float64_on_model_shapes(shape, rows, flare):
    """Each row's output is the exact (float64) causal attention over its slot's pages, within the bound of
    the float32 arithmetic: a dim-long dot product, then the softmax normaliser and the weighted sum of values
    over at most the row's context."""
    case = _attention_case(shape, rows, seed=sum(shape) + len(rows))
    scale = 1 / math.sqrt(shape[2])
    got = flare.paged_attention(*case[:3], 1, *case[3:], scale)
    want = _float64_attention(*case[:3], 1, *case[3:], scale)
    context = max(s + n for s, n in rows)
    tolerance = chain_tolerance(torch.float32, [shape[2], context, context])
    used = sum(n for _, n in rows)
    assert_close_paths(got[:used], want[:used].float(), tolerance, f"{shape} {rows}")
    assert torch.all(got[used:] == 0), "unused packed capacity must stay zero"


@pytest.mark.skipif(kernels.active() != "native", reason="the Python kernel batches each row's heads through bmm")
@pytest.mark.parametrize("shape", ATTENTION_SHAPES[:2])
def test_paged_attention_rows_do_not_depend_on_the_batch(shape):
    """A row's attention is bitwise the same alone or beside other rows, and a prefill row's query is bitwise
    what that query gives as a one-token row at its position: the kernel sums in a fixed order per query, so a
    stream's output does not change with the streams beside it or with how its prompt was split into frames."""
    rows = [(0, 37), (159, 1), (11, 20), (47, 1)]
    q, k_cache, v_cache, page_table, row_slots, query_lens, start = _attention_case(shape, rows, seed=3)
    scale = 1 / math.sqrt(shape[2])
    together = torch.ops.flare.paged_attention(q, k_cache, v_cache, 0, page_table, row_slots, query_lens, start, scale)
    offset = 0
    for r, (s, n) in enumerate(rows):
        one = lambda x: x[r:r + 1]  # noqa: E731
        alone = torch.ops.flare.paged_attention(q[offset:offset + n], k_cache, v_cache, 0, page_table,
                                                one(row_slots), one(query_lens), one(start), scale)
        assert torch.equal(alone, together[offset:offset + n]), f"row {r} alone"
        for i in (0, n // 2, n - 1):  # the first query, one in the middle (another tile when n > 16), the last
            single = torch.ops.flare.paged_attention(
                q[offset + i:offset + i + 1], k_cache, v_cache, 0, page_table, one(row_slots),
                torch.ones(1, dtype=torch.int32), torch.tensor([s + i], dtype=torch.int32), scale)
            assert torch.equal(single[0], together[offset + i]), f"row {r} query {i} as a one-token row"
        offset += n


def _whole_batch_sample(logits, temperature, top_k, top_p, seed, positions, min_p):
    """What the programs computed before flare::sample: every row filtered and drawn, greedy rows' draws
    thrown away (the oracle: a row's token must not depend on whether the other rows sample)."""
    scaled = logits / temperature.clamp(min=1e-5)[:, None, None]
    probs = sampling.filter_top_k_top_p(scaled, top_k, top_p, min_p).softmax(-1)
    drawn = (probs / sampling.exponential_noise(seed, positions, logits.shape[-1])).argmax(-1)
    return torch.where(temperature[:, None] > 0, drawn, logits.argmax(-1))


def _sampling_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch, width, vocab = 1 + seed % 5, 1 + seed % 3, 37 + 11 * seed
    logits = torch.randn(batch, width, vocab, generator=gen) * 3
    logits[0, 0, seed % vocab] = float("-inf")  # a banned token (logit bias) stays banned
    sampled = torch.rand(batch, generator=gen) < 0.6
    temperature = torch.where(sampled, 0.2 + 1.5 * torch.rand(batch, generator=gen), 0.0)
    top_k = torch.randint(0, 8, (batch,), generator=gen).int()
    top_p = torch.where(torch.rand(batch, generator=gen) < 0.5, 1.0, 0.3 + 0.6 * torch.rand(batch, generator=gen))
    min_p = torch.where(torch.rand(batch, generator=gen) < 0.5, 0.0, 0.2 * torch.rand(batch, generator=gen))
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    positions = torch.randint(0, 4096, (batch, width), generator=gen)
    return logits, temperature, top_k, top_p, seeds, positions, min_p


@pytest.mark.numerics
@pytest.mark.parametrize("seed", range(16))
def test_sample_follows_the_rows_and_draws_what_the_whole_batch_formula_draws(seed):
    """Greedy rows take the argmax; sampled rows draw bit for bit what filtering and drawing every row
    did (the same ATen operations on fewer rows), in the installed kernel and the Python reference."""
    case = _sampling_case(seed)
    for min_p in (case[-1], None):
        args = (*case[:-1], min_p)
        want = _whole_batch_sample(*args)
        assert torch.equal(torch.ops.flare.sample(*args), want), "installed kernel"
        assert torch.equal(sampling.sample(*args), want), "Python reference"
    greedy = case[1] <= 0
    assert torch.equal(torch.ops.flare.sample(*case)[greedy], case[0].argmax(-1)[greedy])


def test_sample_passes_opcheck_and_refuses_mismatched_shapes():
    logits, temperature, top_k, top_p, seeds, positions, min_p = _sampling_case(3)
    torch.library.opcheck(torch.ops.flare.sample.default, (logits, temperature, top_k, top_p, seeds, positions, min_p))
    torch.library.opcheck(torch.ops.flare.sample.default, (logits, temperature, top_k, top_p, seeds, positions))
    if kernels.active() == "native":
        with pytest.raises(ValueError, match="flare::sample"):
            torch.ops.flare.sample(logits[0], temperature, top_k, top_p, seeds, positions, min_p)
