"""Catalog load figures: validation (hashes), weights, and program materialization.

Usage: .venv/bin/python benchmarks/catalog_load.py CATALOG [--threads N]
Prints seconds for helios.catalog.load.load, the weights, the first program, and
the mean of the remaining programs (each loaded once; nothing is run).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("catalog")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from helios.catalog.load import load

    catalog = load(args.catalog)
    loaded = time.perf_counter()
    catalog.weights
    weighted = time.perf_counter()
    ids = [d.id for d in catalog.descriptors]
    catalog.program(ids[0])
    first = time.perf_counter()
    for program_id in ids[1:]:
        catalog.program(program_id)
    rest = time.perf_counter()
    print(f"load (manifest + sha256 of every file): {loaded - started:.2f} s (includes importing torch-side helios)")
    print(f"weights: {weighted - loaded:.2f} s")
    print(f"first program ({ids[0]}): {first - weighted:.2f} s")
    if len(ids) > 1:
        print(f"other {len(ids) - 1} programs: {(rest - first) / (len(ids) - 1):.2f} s each, {rest - first:.1f} s total")


if __name__ == "__main__":
    main()
