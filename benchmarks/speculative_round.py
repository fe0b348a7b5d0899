"""Per-frame cost of one learned speculative round against plain decode (eager, bundled flare-tiny).

    nice -n 10 .venv/bin/python benchmarks/speculative_round.py [--threads 1] [--repeats 30] [--context 256]

Every row sits at ``--context`` committed tokens and samples at temperature 0.8.
Prints the median milliseconds per call of decode, the width-one speculative
variant (draft absorption only), and learned rounds at full width (D draft
steps, verification, commit, absorption) at B=1 and B=4, plus each one's
ratio to plain decode at the same B. A learned round pays for itself when
its expected committed tokens exceed that ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flare_contract.graphs import GraphDescriptor, GraphKind, ValueSource
from ignition.models.checkpoint import load_checkpoint
from ignition.models.programs import StateLayout, build_program
from ignition.recipes import load_recipe

LAYOUT = StateLayout(request_slots=4, page_size=16, num_pages=4 * 64, max_pages_per_slot=64)
QL, PL = ValueSource.QUERY_LENGTH, ValueSource.PREFIX_LIMIT


def _spec(id_: str, b: int, w: int, p: int = 0, source: ValueSource | None = QL) -> GraphDescriptor:
    return GraphDescriptor(id_, GraphKind.SPECULATIVE, b, proposal_depth=w - 1, width=w, aggregate=p or b * w,
                           ragged=bool(p), value_source=source if w > 1 else None, proposal_source="learned",
                           speculation_enabled=True, confidence_width=w - 1 if source is PL else 0)


SHAPES = {
    1: [GraphDescriptor("decode_b1", GraphKind.DECODE, 1), _spec("spec_b1_w1", 1, 1), _spec("spec_b1_w2", 1, 2),
        _spec("spec_b1_w4", 1, 4)],
    4: [GraphDescriptor("decode_b4", GraphKind.DECODE, 4), _spec("spec_b4_w1", 4, 1), _spec("spec_b4_w2", 4, 2),
        _spec("spec_b4_w4_p8_pl", 4, 4, 8, PL)],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)  # 2 oversubscribe a loaded 2-core machine badly
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe("flare-tiny").resolve()
    target, draft = load_checkpoint(recipe.checkpoint_folder()), load_checkpoint(recipe.draft.checkpoint)
    weights = {**target.weights, **{f"draft.{k}": t for k, t in draft.weights.items()}}
    print(f"eager, context {args.context}, {args.threads} threads, median of {args.repeats} interleaved calls")
    for batch, shapes in SHAPES.items():
        specs = [build_program(d, target.config, LAYOUT, weights, draft_config=draft.config) for d in shapes]
        runs = [_runner(spec, target.config, draft.config, args.context) for spec in specs]
        times = [[] for _ in runs]
        for _ in range(args.repeats + 3):  # interleaved, so load changes hit every program alike
            for run, spent in zip(runs, times):
                spent.append(run())
        medians = [statistics.median(t[3:]) * 1e3 for t in times]
        for desc, ms in zip(shapes, medians):
            print(f"  B={batch} {desc.id:<18} {ms:8.2f} ms   x{ms / medians[0]:4.2f} of decode")


def _runner(spec, config, draft, context: int):
    """A closure that runs one frame (every row at ``context`` tokens) and returns its seconds."""
    state = LAYOUT.new_state(config, draft)
    batch, width = spec.descriptor.batch_capacity, spec.descriptor.width
    frame = {
        "page_table": torch.arange(LAYOUT.num_pages, dtype=torch.int32).view(LAYOUT.request_slots, -1),
        "row_slots": torch.arange(batch, dtype=torch.int32),
        "query_lens": torch.full((batch,), width, dtype=torch.int32),
        "temperature": torch.full((batch,), 0.8), "top_k": torch.zeros(batch, dtype=torch.int32),
        "top_p": torch.ones(batch), "seed": torch.arange(batch, dtype=torch.int64),
    }

    def run() -> float:
        state["seq_lens"].fill_(context)
        named = {**state, **frame}
        args = [named.get(s.name, torch.zeros(s.shape, dtype=s.dtype)) for s in spec.inputs]  # width one: empty drafts
        started = time.perf_counter()
        spec.module(spec.example_args[0], *args)
        return time.perf_counter() - started

    return run


if __name__ == "__main__":
    main()
