"""Eager vs exported vs AOTInductor-compiled program run time on the bundled flare-tiny target.

    .venv/bin/python benchmarks/program_timing.py [--threads 1] [--repeats 30] [--context 160] \\
        [--shapes decode1,decode16,prefill256] [--no-compiled]

Prints the median milliseconds per call of each shape for three forms of the
same program, calls interleaved (eager, exported, compiled, eager, ...) so
load on a shared machine hits them alike:

- ``eager``: the program module run by PyTorch op by op;
- ``exported``: the program after ``torch.export`` save/load (an FX interpreter
  of the graph; what a ``compile: none`` catalog runs);
- ``compiled``: its AOTInductor package (what ``compile: aoti`` runs), compiled
  here with capture's settings (``ignition.capture.export.AOTI_CONFIGS``).

Every row is active at ``--context`` committed tokens and greedy. The flare::
ops run on whichever kernels this process installed (``FLARE_OPS_KERNELS``:
native or python; printed first).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import helios.ops
from flare_contract.graphs import GraphDescriptor, GraphKind
from ignition.capture.export import AOTI_CONFIGS
from ignition.models.checkpoint import load_checkpoint
from ignition.models.programs import ProgramSpec, StateLayout, build_program

BUNDLED = Path(__file__).resolve().parents[1] / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
LAYOUT = StateLayout(request_slots=16, page_size=16, num_pages=16 * 64, max_pages_per_slot=64)
SHAPES = {
    "decode1": GraphDescriptor("decode-1", GraphKind.DECODE, 1),
    "decode4": GraphDescriptor("decode-4", GraphKind.DECODE, 4),
    "decode16": GraphDescriptor("decode-16", GraphKind.DECODE, 16),
    "prefill256": GraphDescriptor("prefill-256", GraphKind.PREFILL, 1, prefill_capacity=256),
}


def frame_args(spec: ProgramSpec, weights, state, context: int) -> list:
    """Arguments in input order: every row active and greedy, at ``context`` tokens."""
    batch = spec.descriptor.batch_capacity
    pages = torch.arange(LAYOUT.num_pages, dtype=torch.int32).view(LAYOUT.request_slots, -1)
    prompt = spec.descriptor.kind is GraphKind.PREFILL
    frame = {
        "page_table": pages, "row_slots": torch.arange(batch, dtype=torch.int32),
        "query_lens": torch.full((batch,), 256 if prompt else 1, dtype=torch.int32),
        "temperature": torch.zeros(batch), "top_k": torch.zeros(batch, dtype=torch.int32),
        "top_p": torch.ones(batch), "seed": torch.arange(batch, dtype=torch.int64),
        "prompt_tokens": torch.randint(0, 256, (256,)), "prompt_start": torch.tensor([context], dtype=torch.int32),
        "prompt_final": torch.tensor([True]),
    }
    return [weights] + [state[n] if n in state else frame[n] for n in spec.input_names[1:]]


def median_ms(modules: dict, args, repeats: int, state, context: int) -> dict[str, float]:
    """Median per-call time of each module, calls interleaved; the state is reset before each call."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for i in range(repeats + 3):
        for name, module in modules.items():
            state["seq_lens"].fill_(context)  # every call sees the same context and input token
            state["pending"].fill_(7)
            start = time.perf_counter()
            module(*args)
            if i >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def forms(spec: ProgramSpec, folder: Path, compiled: bool) -> dict:
    ep = torch.export.export(spec.module, spec.example_args, strict=False)
    out = {"eager": spec.module}
    if compiled:
        started = time.perf_counter()
        package = folder / f"{spec.descriptor.id}.aoti.pt2"
        torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs=AOTI_CONFIGS)
        print(f"  ({spec.descriptor.id}: AOTInductor compile {time.perf_counter() - started:.1f} s)")
    ep.example_inputs = None
    path = folder / f"{spec.descriptor.id}.pt2"
    torch.export.save(ep, path)
    out["exported"] = torch.export.load(path).module()
    if compiled:
        out["compiled"] = torch._inductor.aoti_load_package(str(package))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--shapes", default="decode1,decode16", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--no-compiled", action="store_true", help="skip the AOTInductor form (no compiler, or quick)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(BUNDLED, torch.float32)
    print(f"flare-tiny target, {args.threads} threads, context {args.context}, flare ops kernels: "
          f"{helios.ops.kernels.active()}, median of {args.repeats} (ms)")
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.shapes.split(","):
            spec = build_program(SHAPES[label], ckpt.config, LAYOUT, ckpt.weights)
            state = LAYOUT.new_state(ckpt.config)
            call = frame_args(spec, ckpt.weights, state, args.context)
            ms = median_ms(forms(spec, Path(tmp), not args.no_compiled), call, args.repeats, state, args.context)
            eager = ms["eager"]
            print(f"{label:11s} " + "   ".join(f"{name} {value:7.2f} ({value / eager:.2f}x)" for name, value in ms.items()))


if __name__ == "__main__":
    main()
