"""Engine figures on a captured catalog (loaded programs), without HTTP.

    .venv/bin/python benchmarks/engine_figures.py CATALOG [--threads 2] [--tokens 128] [--speculation off]
        [--streams 1,4] [--frame-slots 2,1]

Prints, for each number of concurrent streams (greedy, ``--tokens`` output
tokens each, distinct short prompts): output tokens per second, host
overhead per frame (control-thread time in admit/plan/commit/bind/complete/
detokenize/publish, as a share of summed device time), the device's busy
share (program time over wall time: what the host loop leaves idle), the
planning calls per frame, and the share of commits that were queued behind
a running frame; each with the engine's two frame slots and with one (no
queued frame), which is what the worker-thread overlap buys. Programs are warmed up first and every configuration runs once
untimed so durations are learned before timing.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from helios.catalog.load import load
from helios.ops.linear import choose_linear_kernels
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams


async def _stream(engine: HeliosEngine, rid: str, tokens: int) -> int:
    prompt = tuple(engine.tokenizer.encode(f"Request {rid}: tell me something about the number {rid}.",
                                           add_special_tokens=True))
    request = GenerationRequest(rid, prompt, tokens, SamplingParams(temperature=0.0))
    return sum([len(d.token_ids) async for d in engine.submit(request)])


async def _measure(engine: HeliosEngine, streams: int, tokens: int, tag: str) -> dict:
    await asyncio.gather(*(_stream(engine, f"warm{tag}{i}", tokens) for i in range(streams)))
    before = engine.frame_counters()
    began = time.perf_counter()
    produced = sum(await asyncio.gather(*(_stream(engine, f"{tag}{i}", tokens) for i in range(streams))))
    seconds = time.perf_counter() - began
    after = engine.frame_counters()
    frames = after.frames - before.frames
    return {
        "tokens_per_s": produced / seconds,
        "host_share": (after.host_ns - before.host_ns) / max(after.device_ns - before.device_ns, 1),
        "host_ms_per_frame": (after.host_ns - before.host_ns) / 1e6 / max(frames, 1),
        "device_ms_per_frame": (after.device_ns - before.device_ns) / 1e6 / max(frames, 1),
        "queued_share": (after.queued_commits - before.queued_commits) / max(frames, 1),
        "busy_share": (after.device_ns - before.device_ns) / 1e9 / seconds,
        "plans_per_frame": (getattr(after, "plans", 0) - getattr(before, "plans", 0)) / max(frames, 1),
    }


async def _run(catalog_path: str, threads: int, tokens: int, speculation: str,
               streams_list: list[int], slots_list: list[int]) -> None:
    catalog = load(catalog_path, trust=True)  # compiled programs run native code: our own captures only
    for slots in slots_list:
        engine = HeliosEngine(catalog, EngineConfig(threads=threads, speculation=speculation, frame_slots=slots))
        if slots == slots_list[0]:  # flare run's choice of flare::linear's kernel, before its warm-up
            for choice in choose_linear_kernels(t for weights in catalog.weights.values() for t in weights.values()):
                print(choice.describe())
        engine.warm_up()
        await engine.start()
        try:
            for streams in streams_list:
                f = await _measure(engine, streams, tokens, f"s{slots}n{streams}-")
                print(f"frame slots {slots}, {streams} stream(s): {f['tokens_per_s']:.1f} tok/s, "
                      f"host {f['host_ms_per_frame']:.2f} ms/frame = {100 * f['host_share']:.1f}% of device "
                      f"({f['device_ms_per_frame']:.2f} ms/frame), device busy {100 * f['busy_share']:.0f}%, "
                      f"{f['plans_per_frame']:.2f} plans/frame, queued commits {100 * f['queued_share']:.0f}%")
        finally:
            await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("catalog")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--speculation", default="adaptive", choices=("off", "fixed", "adaptive"))
    parser.add_argument("--streams", default="1,4", help="concurrent stream counts, comma-separated")
    parser.add_argument("--frame-slots", default="2,1", help="frame slot settings to run, comma-separated")
    args = parser.parse_args()
    streams = [int(v) for v in args.streams.split(",")]
    slots = [int(v) for v in args.frame_slots.split(",")]
    asyncio.run(_run(args.catalog, args.threads, args.tokens, args.speculation, streams, slots))


if __name__ == "__main__":
    main()
