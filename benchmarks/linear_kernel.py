"""``flare::linear`` (the native small-batch kernel) against ATen's ``F.linear`` on the 0.6B model's shapes.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.linear_kernel [--layers 8] [--rows 1,2,4,8,16,17] [--threads 1]

One decoder layer of Qwen3-0.6B has seven products (q 1024->2048, k and v 1024->1024, o 2048->1024, gate and
up 1024->3072, down 3072->1024); ``--layers`` copies of them (8: 503 MB, far beyond the caches, so every
weight comes from memory as in a decode step) are run at each row count M, the two kernels interleaved three
times, best median of each. Prints ms per pass, the weights' bytes over it (GB/s), the ratio, and each
kernel's largest error against a float64 product on one layer.
"""

from __future__ import annotations

import argparse
import time

import torch

import helios.ops  # noqa: F401  (installs the flare:: kernels)
from helios.ops import kernels

SHAPES = ((2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072))


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
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="1,2,4,8,16,17")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES] for _ in range(args.layers)]
    gigabytes = sum(n * k for n, k in SHAPES) * 4 * args.layers / 1e9
    print(f"kernels {kernels.active()}, {args.threads} thread(s), {args.layers} layers ({gigabytes * 1e3:.0f} MB)")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
        errors = {"aten": 0.0, "flare": 0.0}
        for w in layers[0]:
            exact = xs[w.shape[1]].double() @ w.double().T
            errors["aten"] = max(errors["aten"], float((torch.nn.functional.linear(xs[w.shape[1]], w) - exact).abs().max()))
            errors["flare"] = max(errors["flare"], float((torch.ops.flare.linear(xs[w.shape[1]], w) - exact).abs().max()))

        def aten():
            for layer in layers:
                for w in layer:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

        def flare():
            for layer in layers:
                for w in layer:
                    torch.ops.flare.linear(xs[w.shape[1]], w)

        a, f = [], []
        for _ in range(3):
            a.append(median_ms(aten))
            f.append(median_ms(flare))
        a_ms, f_ms = min(a), min(f)
        print(f"M={rows:3d}: aten {a_ms:7.1f} ms ({gigabytes / a_ms * 1e3:5.1f} GB/s)  flare {f_ms:7.1f} ms "
              f"({gigabytes / f_ms * 1e3:5.1f} GB/s)  aten/flare {a_ms / f_ms:4.2f}  max error aten "
              f"{errors['aten']:.1e} flare {errors['flare']:.1e}")


if __name__ == "__main__":
    main()
