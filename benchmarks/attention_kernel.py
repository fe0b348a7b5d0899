"""``flare::paged_attention`` alone on the 0.6B model's attention shapes: decode rows over a paged cache.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.attention_kernel [--rows 1,4,16] [--context 160]
        [--layers 28] [--threads 1] [--repeats 7] [--shape 16,8,128]

Qwen3-0.6B attends with 16 query heads over 8 KV heads of 128 (4 KB per cached K or V row), pages of 16
positions. A cache of ``--layers`` layers for ``max(--rows)`` slots of ``--context`` positions is filled
with random values, each slot's pages scattered over the pool; one pass calls the op once per layer
(as a decode step does) for B one-token rows. Prints ms per pass, ms per row per layer, the K and V bytes
read over the time (GB/s), and the largest error against a float64 attention on one layer. Whatever
kernels the process installed serve the op (``FLARE_OPS_KERNELS``), so running this file with another
checkout on ``PYTHONPATH`` measures that checkout's kernel. ``--shape heads,kv_heads,head_dim`` takes
another model's heads (flare-tiny: ``6,2,64``).
"""

from __future__ import annotations

import argparse
import math

import torch

import helios.ops  # noqa: F401  (installs the flare:: kernels)
from benchmarks.linear_kernel import median_ms
from helios.ops import kernels

PAGE = 16


def float64_attention(q, k_cache, v_cache, layer, page_table, slots, context, scale):
    heads, kv_heads = q.shape[1], k_cache.shape[3]
    out = []
    for b, slot in enumerate(slots.tolist()):
        positions = torch.arange(context)
        pages = page_table[slot].long()[positions // PAGE]
        k = k_cache[layer, pages, positions % PAGE].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[layer, pages, positions % PAGE].double().repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,khd->hk", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", probs, v))
    return torch.stack(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shape", default="16,8,128", help="query heads, KV heads, head size")
    args = p.parse_args()
    heads, kv_heads, dim = (int(v) for v in args.shape.split(","))
    torch.set_num_threads(args.threads)
    batches = [int(r) for r in args.rows.split(",")]
    slots, per_slot = max(batches), -(-args.context // PAGE)
    gen = torch.Generator().manual_seed(0)
    shape = (args.layers, slots * per_slot, PAGE, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    page_table = torch.randperm(slots * per_slot, generator=gen).view(slots, per_slot).int()
    scale = 1 / math.sqrt(dim)
    print(f"kernels {kernels.active()}, {args.threads} thread(s), heads {args.shape}, {args.layers} layers, "
          f"context {args.context}, "
          f"cache {2 * k_cache.numel() * 4 / 1e6:.0f} MB")
    print(f"{'B':>3s} {'ms/pass':>8s} {'ms/row/layer':>12s} {'GB/s':>6s} {'max err vs f64':>14s}")
    for batch in batches:
        q = torch.randn(batch, heads, dim, generator=gen)
        row_slots = torch.randperm(slots, generator=gen)[:batch].int()
        lens = torch.ones(batch, dtype=torch.int32)
        start = torch.full((batch,), args.context - 1, dtype=torch.int32)

        def one_pass():
            for layer in range(args.layers):
                torch.ops.flare.paged_attention(q, k_cache, v_cache, layer, page_table, row_slots, lens, start, scale)

        ms = median_ms(one_pass, args.repeats)
        got = torch.ops.flare.paged_attention(q, k_cache, v_cache, 0, page_table, row_slots, lens, start, scale)
        error = float((got.double() - float64_attention(q, k_cache, v_cache, 0, page_table, row_slots,
                                                        args.context, scale)).abs().max())
        read = 2 * batch * args.context * kv_heads * dim * 4 * args.layers
        print(f"{batch:3d} {ms:8.2f} {ms / batch / args.layers:12.4f} {read / ms / 1e6:6.1f} {error:14.2e}")


if __name__ == "__main__":
    main()
