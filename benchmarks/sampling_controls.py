"""What the in-program sampling controls and output logprobs cost per frame (issue 18, items 2 and 4).

    .venv/bin/python benchmarks/sampling_controls.py [--threads 2] [--repeats 30] [--context 256]

Runs eager frames of the bundled flare-tiny target (V = 4096) in three
variants, calls interleaved so load on a shared machine hits them alike:

- ``full``: what the programs run (penalties over the token history, logit
  bias, min_p, history write, logprobs with the top 20);
- ``no controls``: the logits go to the sampler untouched and no history is written;
- ``neither``: no controls and no logprob outputs.

Then the controls alone (``process_logits`` plus the history update) on
``[B, W, V]`` logits at Qwen3's vocabulary (151,936), to show how the cost
scales with the vocabulary: it is elementwise work over B * W * V entries
plus a [B, V] state row per active row, independent of the context.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import ignition.models.frame as frame
from flare_contract.graphs import GraphDescriptor, GraphKind
from flare_contract.sampling import BIAS_CAPACITY
from ignition.models.checkpoint import load_checkpoint
from ignition.models.programs import StateLayout, build_program
from ignition.models.sampling import LogitControls, TokenHistory, process_logits

BUNDLED = Path(__file__).resolve().parents[1] / "ignition" / "models" / "bundled" / "flare-tiny" / "target"
LAYOUT = StateLayout(request_slots=4, page_size=16, num_pages=4 * 256, max_pages_per_slot=256)
SHAPES = {
    "decode B=4": GraphDescriptor("decode-4", GraphKind.DECODE, 4),
    "spec B=4 W=4": GraphDescriptor("spec-4x4", GraphKind.SPECULATIVE, 4, proposal_depth=3, width=4,
                                    proposal_source="copy"),
}


def frame_args(spec, weights, state) -> list:
    b, w = spec.descriptor.batch_capacity, spec.descriptor.width
    pages = torch.arange(LAYOUT.num_pages, dtype=torch.int32).view(LAYOUT.request_slots, -1)
    bias_ids = torch.randint(0, 4096, (b, BIAS_CAPACITY))
    named = {
        "page_table": pages, "row_slots": torch.arange(b, dtype=torch.int32),
        "query_lens": torch.full((b,), w, dtype=torch.int32), "temperature": torch.full((b,), 0.8),
        "top_k": torch.zeros(b, dtype=torch.int32), "top_p": torch.ones(b), "seed": torch.arange(b),
        "min_p": torch.full((b,), 0.05), "repetition_penalty": torch.full((b,), 1.1),
        "presence_penalty": torch.full((b,), 0.5), "frequency_penalty": torch.full((b,), 0.5),
        "bias_ids": bias_ids, "bias_values": torch.ones(b, BIAS_CAPACITY),
        "bias_until": torch.full((b, BIAS_CAPACITY), 2**31 - 1, dtype=torch.int32),
        "draft_tokens": torch.randint(0, 4096, (b, w - 1)),
    }
    return [weights] + [state[n] if n in state else named[n] for n in spec.input_names[1:]]


@contextmanager
def variant(name: str):
    """Patch the frame's control and logprob stages out for the comparison variants."""
    saved = frame.process_logits, frame._write_history, frame._logprob_outputs
    if name in ("no controls", "neither"):
        frame.process_logits = lambda logits, *_: logits
        frame._write_history = lambda *_: None
    if name == "neither":
        frame._logprob_outputs = lambda *_: {}
    try:
        yield
    finally:
        frame.process_logits, frame._write_history, frame._logprob_outputs = saved


def frame_medians(spec, args, state, context: int, repeats: int) -> dict[str, float]:
    names = ("full", "no controls", "neither")
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats + 3):
        for name in names:
            state["seq_lens"].fill_(context)
            with variant(name), torch.no_grad():
                start = time.perf_counter()
                spec.module.forward(*args) if name == "full" else _partial(spec, args)
                elapsed = time.perf_counter() - start
            if i >= 3:
                times[name].append(elapsed * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def _partial(spec, args):
    """The module's forward without its output selection (a variant may leave logprob outputs out)."""
    named = dict(zip(spec.module.names, args[1:], strict=True))
    return frame.run_frame(spec.module.model, args[0], spec.module.shape, frame.FrameInputs(**named), None)


def controls_alone(b: int, w: int, vocab: int, repeats: int) -> float:
    """Median ms of process_logits plus the history row update on [b, w, vocab] logits."""
    logits = torch.randn(b, w, vocab)
    controls = LogitControls(torch.full((b,), 1.1), torch.full((b,), 0.5), torch.full((b,), 0.5),
                             torch.randint(0, vocab, (b, BIAS_CAPACITY)), torch.ones(b, BIAS_CAPACITY),
                             torch.full((b, BIAS_CAPACITY), 2**31 - 1, dtype=torch.int32))
    counts = torch.zeros(b, vocab, dtype=torch.int32)
    seen = torch.zeros(b, vocab, dtype=torch.bool)
    positions = torch.arange(w).expand(b, w) + 100
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        rows = counts[:b]
        history = TokenHistory(rows.float()[:, None].expand(-1, w, -1), seen[:b, None].expand(-1, w, -1))
        process_logits(logits, controls, history, positions)
        counts[:b] = rows + 1
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(BUNDLED, torch.float32)
    print(f"flare-tiny target (V={ckpt.config.sampled_vocab_size}), {args.threads} threads, context {args.context}, "
          f"median of {args.repeats} eager frames (ms), variants interleaved")
    for label, desc in SHAPES.items():
        spec = build_program(desc, ckpt.config, LAYOUT, ckpt.weights)
        state = LAYOUT.new_state(ckpt.config)
        ms = frame_medians(spec, frame_args(spec, ckpt.weights, state), state, args.context, args.repeats)
        print(f"{label:13s} full {ms['full']:7.2f}   no controls {ms['no controls']:7.2f}   "
              f"neither {ms['neither']:7.2f}   controls {ms['full'] / ms['no controls'] - 1:+.1%}   "
              f"logprobs {ms['no controls'] / ms['neither'] - 1:+.1%}")
    for b, w in ((4, 1), (4, 4), (16, 1)):
        for vocab in (4096, 151936):
            print(f"controls alone B={b:<2d} W={w} V={vocab:<6d} {controls_alone(b, w, vocab, args.repeats):7.3f} ms")


if __name__ == "__main__":
    main()
