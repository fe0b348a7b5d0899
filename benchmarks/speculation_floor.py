"""Adaptive speculation against none, on catalogs that differ in what they compiled (issue 22, item 6).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speculation_floor.py off=CATALOG adaptive=CATALOG \\
        [adaptive=OTHER_CATALOG ...] [--streams 1,4,16] [--tokens 64] [--repetitions 3] [--threads 1]

Each ``MODE=CATALOG`` is one engine (``HeliosEngine``, no HTTP; catalogs are
loaded trusted, as ``flare run`` loads its bundled one), all of them started
at once in this process and warmed up (every program called once, then one
untimed pass per stream count so durations are learned). Then, for each
repetition, for each stream count, every engine in turn (interleaved, so the
load of a shared machine hits all of them alike) serves ``streams`` concurrent
greedy requests of ``--tokens`` output tokens each, prompts of 128 tokens cut
from standard-library source. Prints median output tokens per second per
engine and stream count, each with its ratio to the first engine, and each
engine's frames by program kind and scheduling reason.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from dataclasses import dataclass

from helios.catalog.load import load
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams


@dataclass(frozen=True, slots=True)
class Contender:
    label: str
    engine: HeliosEngine


def _prompts(engine: HeliosEngine, count: int, length: int = 128) -> list[tuple[int, ...]]:
    ids = engine.tokenizer.encode(inspect.getsource(asyncio.base_events), add_special_tokens=False)
    return [tuple(ids[i * length:(i + 1) * length]) for i in range(count)]


async def _serve(engine: HeliosEngine, prompts, tokens: int, tag: str) -> tuple[int, float]:
    async def one(i: int, prompt) -> int:
        request = GenerationRequest(f"{tag}-{i}", prompt, tokens, SamplingParams(temperature=0.0), ignore_eos=True)
        return sum([len(d.token_ids) async for d in engine.submit(request)])

    began = time.perf_counter()
    produced = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return produced, time.perf_counter() - began


async def _run(args) -> None:
    contenders = []
    for spec in args.engines:
        mode, _, path = spec.partition("=")
        engine = HeliosEngine(load(path, trust=True), EngineConfig(threads=args.threads, speculation=mode))
        engine.warm_up()
        await engine.start()
        contenders.append(Contender(f"{mode} {path}", engine))
    streams = [int(s) for s in args.streams.split(",")]
    prompts = _prompts(contenders[0].engine, max(streams))
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for c in contenders:
            for n in streams:
                await _serve(c.engine, prompts[:n], args.tokens, f"warm{n}")
        for rep in range(args.repetitions):
            for n in streams:
                for c in contenders:
                    produced, seconds = await _serve(c.engine, prompts[:n], args.tokens, f"r{rep}s{n}")
                    results.setdefault((c.label, n), []).append(produced / seconds)
                    print(f"rep {rep + 1} streams {n:2d} {c.label}: {produced / seconds:.1f} tok/s", flush=True)
    finally:
        for c in contenders:
            await c.engine.stop()
    print(f"\nmedian output tok/s over {args.repetitions} interleaved repetitions (ratio to the first engine)")
    for n in streams:
        base = statistics.median(results[(contenders[0].label, n)])
        for c in contenders:
            value = statistics.median(results[(c.label, n)])
            print(f"streams {n:2d}  {c.label:60s} {value:8.1f} ({value / base:.2f}x)")
    for c in contenders:
        executions = c.engine.frame_counters().executions
        print(f"{c.label}: frames by (kind, reason): "
              + ", ".join(f"{k}/{r}={n}" for (k, r), (n, _) in sorted(executions.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+", help="MODE=CATALOG, MODE one of off, fixed, adaptive")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
