"""Per-call time of a captured catalog's programs, as loaded and (optionally) compiled here.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/catalog_programs.py CATALOG \\
        --programs decode_b1,spec_b1_d0_w1_p1,spec_b1_d1_w2_p2 [--compile] [--threads 1] [--repeats 30] [--context 160] \\
        [--profile]

For each program: ``loaded`` is what the engine runs (its AOTInductor package
in a ``compile: aoti`` catalog when the program has one, else the exported
graph); with ``--compile``, a program without a package is also compiled here
with capture's settings (``ignition.capture.export.AOTI_CONFIGS``) and timed
as ``compiled here``. Every row is active at ``--context`` committed tokens,
greedy, verifying the program's full width; calls of all programs and forms
are interleaved so load on a shared machine hits them alike. The table gives
the median milliseconds per call and per row-token (``ms / (B x W)``), which is
what the scheduler's value-per-time comparison of widths turns on. ``--profile``
then prints, for each loaded program, ``torch.profiler``'s top entries of a few
calls (the ``flare::`` kernels, ATen calls the compiled code makes, and the
compiled code's own loops as what is left of the call's time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from helios.catalog.load import Catalog, CatalogProgram, load
from helios.ops.linear import choose_linear_kernels
from ignition.capture.export import AOTI_CONFIGS

OPEN_INPUTS = {"top_p": 1.0, "repetition_penalty": 1.0}


def frame_inputs(catalog: Catalog, program_id: str) -> dict[str, torch.Tensor]:
    """Per-frame inputs with every row active at the program's full width (state tensors excluded)."""
    entry = catalog.entry(program_id)
    layout = catalog.state.layout
    graph = next(g for g in catalog.descriptors if g.id == program_id)
    state = {t.name for t in catalog.manifest.state.tensors}
    inputs = {a.name: torch.full(a.shape, OPEN_INPUTS.get(a.name, 0), dtype=getattr(torch, a.dtype))
              for a in entry.inputs if a.weights is None and a.name not in state}
    per_slot = min(layout["num_pages"] // layout["request_slots"], layout["max_pages_per_slot"])
    table = inputs["page_table"]
    table.fill_(-1)
    table[:, :per_slot] = torch.arange(layout["request_slots"] * per_slot, dtype=torch.int32).view(-1, per_slot)
    batch = graph.batch_capacity
    inputs["row_slots"] = torch.arange(batch, dtype=torch.int32)
    inputs["query_lens"] = torch.full((batch,), max(graph.width, 1), dtype=torch.int32)
    inputs["seed"] = torch.arange(batch, dtype=torch.int64)
    if "prefill_row" in inputs:
        inputs["prefill_row"].fill_(-1)
    return inputs


def compiled_here(catalog: Catalog, program_id: str, folder: Path) -> tuple[CatalogProgram, float]:
    entry = catalog.entry(program_id)
    exported = torch.export.load(catalog.path / entry.file)
    package = folder / f"{program_id}.aoti.pt2"
    started = time.perf_counter()
    torch._inductor.aoti_compile_and_package(exported, package_path=str(package), inductor_configs=AOTI_CONFIGS)
    seconds = time.perf_counter() - started
    state = frozenset(t.name for t in catalog.manifest.state.tensors)
    module = torch._inductor.aoti_load_package(str(package))
    return CatalogProgram(entry, module, catalog.program_weights, state), seconds


def median_ms(forms: dict, inputs: dict, state: dict, repeats: int, context: int) -> dict[tuple, float]:
    times: dict[tuple, list[float]] = {key: [] for key in forms}
    for i in range(repeats + 3):
        for key, program in forms.items():
            state["seq_lens"].fill_(context)
            state["pending"].fill_(7)
            if "draft_seq_lens" in state:
                state["draft_seq_lens"].fill_(context)
            started = time.perf_counter()
            program(**inputs[key[0]], **state)
            if i >= 3:
                times[key].append((time.perf_counter() - started) * 1e3)
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("catalog")
    parser.add_argument("--programs", required=True, help="comma-separated program ids")
    parser.add_argument("--compile", action="store_true", help="also compile programs that have no package")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--profile", action="store_true", help="profile each loaded program after timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    catalog = load(args.catalog, trust=True)
    packed = catalog.pack_linear_weights()  # as the engine does (FLARE_LINEAR_PACK=0: the weights as read)
    print(f"{packed} weights packed for flare::linear's packed kernel")
    for choice in choose_linear_kernels(t for weights in catalog.weights.values() for t in weights.values()):
        print(choice.describe())  # as flare run sets them before its warm-up (FLARE_LINEAR_* fix them)
    state = catalog.allocate_state()
    ids = args.programs.split(",")
    forms, inputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for program_id in ids:
            inputs[program_id] = frame_inputs(catalog, program_id)
            has_package = catalog.entry(program_id).compiled_file is not None
            forms[(program_id, "loaded (compiled)" if has_package else "loaded (exported)")] = catalog.program(program_id)
            if args.compile and not has_package:
                program, seconds = compiled_here(catalog, program_id, Path(tmp))
                print(f"({program_id}: AOTInductor compile {seconds:.1f} s)")
                forms[(program_id, "compiled here")] = program
        ms = median_ms(forms, inputs, state, args.repeats, args.context)
    graphs = {g.id: g for g in catalog.descriptors}
    print(f"{catalog.path.name}: {args.threads} thread(s), context {args.context}, median of {args.repeats} calls")
    print(f"{'program':28s} {'form':20s} {'ms/call':>8s} {'ms/(B*W)':>9s}")
    for (program_id, form), value in ms.items():
        g = graphs[program_id]
        print(f"{program_id:28s} {form:20s} {value:8.2f} {value / (g.batch_capacity * max(g.width, 1)):9.3f}")
    if args.profile:
        for (program_id, form), program in forms.items():
            if form.startswith("loaded"):
                profile(program_id, program, inputs[program_id], state, args.context)


def profile(program_id: str, program, inputs: dict, state: dict, context: int, calls: int = 5) -> None:
    """Where one program's time goes: the profiler's top entries over ``calls`` calls, and the share of the
    calls' time that no profiled op accounts for (the compiled code's own loops)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    wall = 0.0
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        for _ in range(calls):
            state["seq_lens"].fill_(context)
            state["pending"].fill_(7)
            started = time.perf_counter()
            program(**inputs, **state)
            wall += time.perf_counter() - started
    events = prof.key_averages()
    ops = sum(e.self_cpu_time_total for e in events if not e.key.startswith("aten::fill_")) / calls / 1e3
    wall_ms = wall / calls * 1e3
    print(f"\n{program_id}: {wall_ms:.2f} ms per call under the profiler, {ops:.2f} ms in profiled ops, "
          f"{max(wall_ms - ops, 0):.2f} ms ({max(1 - ops / wall_ms, 0):.0%}) in the compiled code's own loops")
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
