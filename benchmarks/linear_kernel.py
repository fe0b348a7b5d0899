"""``flare::linear`` (the native small-batch kernel) against ATen's ``F.linear`` on a model's shapes.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.linear_kernel [--model qwen3-0.6b|flare-tiny] [--layers 8]
        [--rows 1,2,4,8,16,17] [--threads 1]

One decoder layer of Qwen3-0.6B has seven products (q 1024->2048, k and v 1024->1024, o 2048->1024, gate and
up 1024->3072, down 3072->1024); ``--layers`` copies of them (8: 503 MB, far beyond the caches, so every
weight comes from memory as in a decode step) are run at each row count M, the two kernels interleaved three
times, best median of each. The native kernel is timed in both of its loop orders (chunked and panel: the
same arithmetic, csrc/flare_ops.cpp). Prints ms per pass, the weights' bytes over it (GB/s), the ratios, and
each kernel's largest error against a float64 product on one layer.

``--model flare-tiny``: the bundled model's step instead, its 4 layers (``--layers`` defaults to 4) of
seven products (hidden 384, intermediate 1024, 6 query and 2 KV heads of 64) and the tied vocabulary head
(4,096 x 384), 30 MB in all, which the last-level cache may hold: what a decode step or prompt chunk of
the bundled catalog multiplies. The native kernel serves every row count here up to 256 (a fresh
process's bound; ``flare run`` measures its own, docs/runtime.md "Programs and kernels").
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import helios.ops  # noqa: F401  (installs the flare:: kernels)
from helios.ops import kernels
from helios.ops.linear import MAX_CHUNK_ROWS

SHAPES = ((2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072))
TINY_SHAPES = ((384, 384), (128, 384), (128, 384), (384, 384), (1024, 384), (1024, 384), (384, 1024))
TINY_HEAD = (4096, 384)


def median_ms(call, repeats: int = 9) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("qwen3-0.6b", "flare-tiny"), default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; flare-tiny: its 4)")
    p.add_argument("--rows", default="1,2,4,8,16,17")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    tiny = args.model == "flare-tiny"
    shapes, count = (TINY_SHAPES, args.layers or 4) if tiny else (SHAPES, args.layers or 8)
    layers = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes] for _ in range(count)]
    if tiny:
        layers.append([torch.randn(*TINY_HEAD, generator=gen) * 0.02])  # the tied head, once per step
    gigabytes = sum(w.numel() for layer in layers for w in layer) * 4 / 1e9
    print(f"kernels {kernels.active()}, {args.threads} thread(s), {args.model}: {count} layers"
          f"{' and the head' if tiny else ''} ({gigabytes * 1e3:.0f} MB)")
    # the same weights laid out for the packed kernel (csrc/flare_ops.cpp, "Packed weights"), where it exists
    packed = ([[torch.ops.flare.pack_linear_weight(w) for w in layer] for layer in layers]
              if kernels.packs_linear_weights() else None)
    chunk_before = kernels.native_linear_chunk_rows()
    if chunk_before is None:
        raise SystemExit("error: the native kernels are not installed (FLARE_OPS_KERNELS); nothing to compare")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for layer in layers for w in layer}}
        errors = {"aten": 0.0, "flare": 0.0}
        for w in layers[0]:
            exact = xs[w.shape[1]].double() @ w.double().T
            errors["aten"] = max(errors["aten"], float((torch.nn.functional.linear(xs[w.shape[1]], w) - exact).abs().max()))
            errors["flare"] = max(errors["flare"], float((torch.ops.flare.linear(xs[w.shape[1]], w) - exact).abs().max()))

        def aten():
            for layer in layers:
                for w in layer:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

        def flare(order: int):
            def run():
                kernels.native_linear_chunk_rows(order)
                for layer in layers:
                    for w in layer:
                        torch.ops.flare.linear(xs[w.shape[1]], w)
            return run

        def flare_packed():
            for layer in packed:
                for w in layer:
                    torch.ops.flare.linear(xs[w.shape[1]], w)

        # the native kernel's two loop orders (csrc/flare_ops.cpp; the same bits): chunked, then panel
        chunked, panel = flare(rows), flare(rows - 1)
        a, c, p_, k_ = [], [], [], []
        for _ in range(3):
            a.append(median_ms(aten))
            if packed is not None:
                k_.append(median_ms(flare_packed))
            if rows <= MAX_CHUNK_ROWS:  # above, the chunked order does not serve
                c.append(median_ms(chunked))
            p_.append(median_ms(panel))
        kernels.native_linear_chunk_rows(chunk_before)
        a_ms, c_ms, p_ms = min(a), min(c, default=math.inf), min(p_)
        f_ms = min(c_ms, p_ms)
        k_ms = min(k_, default=math.inf)
        if packed is not None:
            errors["packed"] = max(float((torch.ops.flare.linear(xs[w.shape[1]], pw) - xs[w.shape[1]].double()
                                          @ w.double().T).abs().max()) for w, pw in zip(layers[0], packed[0]))
        chunked_text = f"{c_ms:7.1f} ms" if c else "    n/a"  # the chunked order serves at most 64 rows
        ratio_text = f"{p_ms / c_ms:4.2f}" if c else " n/a"
        print(f"M={rows:3d}: aten {a_ms:7.1f} ms ({gigabytes / a_ms * 1e3:5.1f} GB/s)  flare chunked {chunked_text}, "
              f"panel {p_ms:7.1f} ms ({gigabytes / f_ms * 1e3:5.1f} GB/s at the better)  panel/chunked "
              f"{ratio_text}  aten/flare {a_ms / f_ms:4.2f}  max error aten {errors['aten']:.1e} flare "
              f"{errors['flare']:.1e}")
        if packed is not None:
            print(f"        packed {k_ms:7.1f} ms ({gigabytes / k_ms * 1e3:5.1f} GB/s, {2 * rows * gigabytes / 4 / k_ms * 1e3:5.1f} "
                  f"GFLOP/s)  unpacked/packed {f_ms / k_ms:4.2f}  aten/packed {a_ms / k_ms:4.2f}  max error packed "
                  f"{errors['packed']:.1e}")

if __name__ == "__main__":
    main()
