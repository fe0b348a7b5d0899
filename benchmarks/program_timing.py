"""Eager vs exported+loaded program run time on the bundled flare-tiny target.

    .venv/bin/python benchmarks/program_timing.py [--threads 2] [--repeats 30] [--context 256]

Prints the median milliseconds per call (eager and loaded calls interleaved) of decode B=1, decode B=4 (every row
at ``--context`` committed tokens) and one 256-token prefill chunk, for the
eager module and for the program after torch.export save/load (what the
runtime runs without --compile).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind
from ignition.models.checkpoint import load_checkpoint
from ignition.models.programs import ProgramSpec, StateLayout, build_program

BUNDLED = Path(__file__).resolve().parents[1] / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
LAYOUT = StateLayout(request_slots=4, page_size=16, num_pages=4 * 256, max_pages_per_slot=256)
SHAPES = {
    "decode B=1": GraphDescriptor("decode-1", GraphKind.DECODE, 1),
    "decode B=4": GraphDescriptor("decode-4", GraphKind.DECODE, 4),
    "prefill 256": GraphDescriptor("prefill-256", GraphKind.PREFILL, 1, prefill_capacity=256),
}


def frame_args(spec: ProgramSpec, weights, state, context: int) -> list:
    """Arguments in input order: every row active, sampled, at ``context`` tokens."""
    batch = spec.descriptor.batch_capacity
    pages = torch.arange(LAYOUT.num_pages, dtype=torch.int32).view(LAYOUT.request_slots, -1)
    frame = {
        "page_table": pages, "row_slots": torch.arange(batch, dtype=torch.int32),
        "query_lens": torch.full((batch,), 1 if spec.descriptor.kind is GraphKind.DECODE else 256, dtype=torch.int32),
        "temperature": torch.full((batch,), 0.8), "top_k": torch.full((batch,), 40, dtype=torch.int32),
        "top_p": torch.full((batch,), 0.95), "seed": torch.arange(batch, dtype=torch.int64),
        "prompt_tokens": torch.randint(0, 256, (256,)), "prompt_start": torch.tensor([context], dtype=torch.int32),
        "prompt_final": torch.tensor([True]),
    }
    return [weights] + [state[n] if n in state else frame[n] for n in spec.input_names[1:]]


def median_ms(modules: dict, args, repeats: int, state, context: int) -> dict[str, float]:
    """Median per-call time of each module, calls interleaved so load on a shared
    machine hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for i in range(repeats + 3):
        for name, module in modules.items():
            state["seq_lens"].fill_(context)  # every call sees the same context
            start = time.perf_counter()
            module(*args)
            if i >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def exported(spec: ProgramSpec, folder: Path) -> torch.nn.Module:
    ep = torch.export.export(spec.module, spec.example_args, strict=False)
    ep.example_inputs = None
    path = folder / f"{spec.descriptor.id}.pt2"
    torch.export.save(ep, path)
    return torch.export.load(path).module()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(BUNDLED)
    print(f"flare-tiny target, {args.threads} threads, context {args.context}, median of {args.repeats} (ms)")
    with tempfile.TemporaryDirectory() as tmp:
        for label, desc in SHAPES.items():
            spec = build_program(desc, ckpt.config, LAYOUT, ckpt.weights)
            state = LAYOUT.new_state(ckpt.config)
            call = frame_args(spec, ckpt.weights, state, args.context)
            modules = {"eager": spec.module, "loaded": exported(spec, Path(tmp))}
            ms = median_ms(modules, call, args.repeats, state, args.context)
            print(f"{label:12s} eager {ms['eager']:7.2f}   loaded {ms['loaded']:7.2f}")


if __name__ == "__main__":
    main()
