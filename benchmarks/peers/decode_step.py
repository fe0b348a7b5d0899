"""One decode step of a captured catalog against the memory-bandwidth floor and the same program run eagerly.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.peers.decode_step CATALOG --checkpoint DIR \\
        [--batches 1,4,16] [--repeats 10] [--context 160] [--threads 1] [--profile B]

Issue 22, item 5, on the Qwen3-0.6B-shaped model (``benchmarks.peers.random_model``
writes it, ``ignition capture ignition/recipes/qwen3-0.6b-random.yaml`` captures it).
For each batch bucket B: ``loaded`` is ``decode_bB`` as the engine runs it (its
AOTInductor package in a ``compile: aoti`` catalog), ``eager`` the same program
module built from the checkpoint and run by PyTorch op by op. Calls are
interleaved (loaded, eager, loaded, ...) so load on a shared machine hits both
alike; every row is active at ``--context`` tokens, greedy. The floor is the
weights' bytes over the copy and the read bandwidth measured in the same
process (``random_model.bandwidths``), since a decode step reads every weight
once whatever B is. ``--profile B`` then prints ``torch.profiler``'s top ops of
one loaded step at B (where the time goes: matrix products, attention, the
``flare::`` kernels, copies).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.catalog_programs import frame_inputs
from benchmarks.peers.random_model import Floor, bandwidths, weight_bytes
from helios.catalog.load import load
from helios.ops.linear import choose_linear_kernels
from ignition.models.checkpoint import load_checkpoint
from ignition.models.programs import StateLayout, build_program


def eager_program(catalog, program_id: str, checkpoint: Path, weights: dict):
    graph = next(g for g in catalog.descriptors if g.id == program_id)
    fields = ("request_slots", "page_size", "num_pages", "max_pages_per_slot")
    layout = StateLayout(**{k: catalog.state.layout[k] for k in fields})
    spec = build_program(graph, load_checkpoint(checkpoint).config, layout, weights)
    return spec


def timed(call, repeats_log: list[float]) -> None:
    started = time.perf_counter()
    call()
    repeats_log.append((time.perf_counter() - started) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("catalog", type=Path)
    p.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint folder the catalog was captured from")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", type=int, default=None, help="profile one loaded decode step at this batch")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    floor = Floor(weight_bytes(args.checkpoint), *bandwidths())
    catalog = load(args.catalog, trust=True, verify_hashes=False)
    for choice in choose_linear_kernels(t for weights in catalog.weights.values() for t in weights.values()):
        print(choice.describe())  # as flare run sets them before its warm-up (FLARE_LINEAR_* fix them)
    state = catalog.allocate_state()
    weights = load_checkpoint(args.checkpoint, torch.float32).weights
    print(f"{args.catalog.name}: {args.threads} thread(s), context {args.context}, median of {args.repeats}; "
          f"weights {floor.weight_bytes / 1e6:.0f} MB, copy {floor.copy_gbs:.1f} GB/s (floor "
          f"{floor.ms(floor.copy_gbs):.1f} ms), read {floor.read_gbs:.1f} GB/s (floor {floor.ms(floor.read_gbs):.1f} ms); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'B':>3s} {'loaded ms':>10s} {'eager ms':>9s} {'loaded/eager':>12s} {'loaded/copy floor':>17s} "
          f"{'loaded/read floor':>17s} {'tok/s loaded':>12s}")
    for batch in (int(b) for b in args.batches.split(",")):
        program_id = f"decode_b{batch}"
        inputs = frame_inputs(catalog, program_id)
        loaded = catalog.program(program_id)
        spec = eager_program(catalog, program_id, args.checkpoint, weights)
        eager_args = [weights] + [state[n] if n in state else inputs[n] for n in spec.input_names[1:]]
        logs: dict[str, list[float]] = {"loaded": [], "eager": []}
        calls = {"loaded": lambda: loaded(**inputs, **state), "eager": lambda: spec.module(*eager_args)}
        for i in range(args.repeats + 2):
            for name, call in calls.items():
                state["seq_lens"].fill_(args.context)
                state["pending"].fill_(7)
                with torch.no_grad():
                    timed(call, logs[name] if i >= 2 else [])
        ms = {name: statistics.median(t) for name, t in logs.items()}
        print(f"{batch:3d} {ms['loaded']:10.1f} {ms['eager']:9.1f} {ms['loaded'] / ms['eager']:12.2f} "
              f"{ms['loaded'] / floor.ms(floor.copy_gbs):17.2f} {ms['loaded'] / floor.ms(floor.read_gbs):17.2f} "
              f"{batch * 1e3 / ms['loaded']:12.1f}")
        if args.profile == batch:
            profile(lambda: loaded(**inputs, **state), state, args.context)


def profile(call, state: dict, context: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    state["seq_lens"].fill_(context)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        call()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
