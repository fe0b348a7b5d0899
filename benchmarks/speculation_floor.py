"""Adaptive speculation against none, on catalogs that differ in what they compiled (issue 22, item 6).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speculation_floor.py off=CATALOG adaptive=CATALOG \\
        [adaptive:draft=CATALOG adaptive=OTHER_CATALOG ...] [--streams 1,4,16] [--tokens 64] [--repetitions 3] [--threads 1]

Each ``MODE[:FLOOR]=CATALOG`` is one engine (``FLOOR``: ``EngineConfig.adaptive_floor``, plain or
draft; without it the engine's default) (``HeliosEngine``, no HTTP; catalogs are
loaded trusted, as ``flare run`` loads its bundled one), all of them started
at once in this process and warmed up (every program called once, then one
untimed pass per stream count so durations are learned). Then, for each
repetition, for each stream count, every engine in turn (interleaved, so the
load of a shared machine hits all of them alike, and in reverse order every
other repetition: the engine served second ran 2-8 % faster in either order,
so use an even ``--repetitions``) serves ``streams`` concurrent
greedy requests of ``--tokens`` output tokens each, prompts of 128 tokens cut
from standard-library source. Prints median output tokens per second per
engine and stream count, each with its ratio to the first engine (of the
medians, and the median and range of each repetition's own ratio), and each
engine's frames by program kind and scheduling reason, and by program.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace

from helios.catalog.load import load
from helios.runtime.engine import EngineConfig, HeliosEngine
from helios.runtime.engine_api import GenerationRequest, SamplingParams


class Calls:
    """Counts the engine's program calls by program id (wraps the executor's ``program_for``)."""

    def __init__(self, engine: HeliosEngine) -> None:
        self.counts: Counter[str] = Counter()
        executor, inner = engine.executor, engine.executor.program_for

        def program_for(program_id: str):
            program = inner(program_id)

            def run(**named):
                self.counts[program_id] += 1
                return program(**named)
            return run
        executor.program_for = program_for


@dataclass(frozen=True, slots=True)
class Contender:
    label: str
    engine: HeliosEngine
    calls: Calls


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
        mode, _, floor = mode.partition(":")
        config = EngineConfig(threads=args.threads, speculation=mode)
        if floor:
            config = replace(config, adaptive_floor=floor)
        engine = HeliosEngine(load(path, trust=True), config)
        calls = Calls(engine)
        engine.warm_up()
        await engine.start()
        contenders.append(Contender(f"{mode}{':' + floor if floor else ''} {path}", engine, calls))
    streams = [int(s) for s in args.streams.split(",")]
    prompts = _prompts(contenders[0].engine, max(streams))
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for c in contenders:
            for n in streams:
                await _serve(c.engine, prompts[:n], args.tokens, f"warm{n}")
        for rep in range(args.repetitions):
            for n in streams:
                # the engine served second ran 2-8 % faster in either order on this machine (2026-12-05):
                # each repetition reverses the order, so an even count gives every engine each place equally
                for c in (contenders if rep % 2 == 0 else contenders[::-1]):
                    before, calls = _frames(c.engine), Counter(c.calls.counts)
                    produced, seconds = await _serve(c.engine, prompts[:n], args.tokens, f"r{rep}s{n}")
                    results.setdefault((c.label, n), []).append(produced / seconds)
                    print(f"rep {rep + 1} streams {n:2d} {c.label}: {produced / seconds:.1f} tok/s; "
                          f"{_delta(before, _frames(c.engine), c.calls.counts - calls, c.engine)}", flush=True)
    finally:
        for c in contenders:
            await c.engine.stop()
    print(f"\nmedian output tok/s over {args.repetitions} interleaved repetitions (ratio to the first engine; "
          "then the median and range of the repetitions' own ratios)")
    for n in streams:
        first = results[(contenders[0].label, n)]
        base = statistics.median(first)
        for c in contenders:
            value = statistics.median(results[(c.label, n)])
            paired = sorted(v / b for v, b in zip(results[(c.label, n)], first))
            print(f"streams {n:2d}  {c.label:60s} {value:8.1f} ({value / base:.3f}x; paired "
                  f"{statistics.median(paired):.3f}, {paired[0]:.3f}-{paired[-1]:.3f})")
    for c in contenders:
        executions = c.engine.frame_counters().executions
        print(f"{c.label}: frames by (kind, reason): "
              + ", ".join(f"{k}/{r}={n}" for (k, r), (n, _) in sorted(executions.items())))
        print(f"{c.label}: calls by program (warm-up included): "
              + ", ".join(f"{p}={n}" for p, n in sorted(c.calls.counts.items())))
        print(f"{c.label}: {_width_one_estimates(c.engine)}")
        print(f"{c.label}: {_state_estimates(c.engine)}")


def _frames(engine: HeliosEngine) -> dict:
    return {key: n for key, (n, _) in engine.frame_counters().executions.items()}


def _delta(before: dict, after: dict, calls: Counter, engine: HeliosEngine) -> str:
    """One serve's frames: exploration (non-ordinary) ones by reason, and generation calls by what they ran."""
    explored = Counter()
    for (kind, reason), n in after.items():
        if reason != "ordinary" and n > before.get((kind, reason), 0):
            explored[reason] += n - before.get((kind, reason), 0)
    graphs = {g.id: g for g in engine.scheduler.graphs}
    runs = Counter()
    for program, n in calls.items():
        g = graphs.get(program)
        if g is None or g.kind.value not in ("decode", "speculative", "mixed"):
            continue
        runs["plain" if g.proposal_source is None else "width-one" if not g.draws_proposals
             else f"wider {g.proposal_source}"] += n
    return (", ".join(f"{k}={n}" for k, n in sorted(runs.items())) + "; explored "
            + (", ".join(f"{k}={n}" for k, n in sorted(explored.items())) or "none"))


def _width_one_estimates(engine: HeliosEngine) -> str:
    """The scheduler's duration estimates of plain decode and the draft-keeping width-one twin per batch
    size at the end (what its choice between them rests on), with the number of calls each had."""
    graphs, ms = engine.scheduler.graphs, engine.learned_durations()
    out = []
    for b in sorted({g.batch_capacity for g in graphs if g.kind.value in ("decode", "speculative")
                     and not g.draws_proposals}):
        pair = [g.id for g in graphs if g.batch_capacity == b and g.kind.value in ("decode", "speculative")
                and not g.draws_proposals]
        out.append(" / ".join(f"{p} {ms[p] / 1e6:.2f} ms" if p in ms else f"{p} unmeasured" for p in pair))
    return "width-one estimates: " + "; ".join(out)


def _state_estimates(engine: HeliosEngine) -> str:
    """The duration estimates of the snapshot and restore programs at the end (terminal snapshots run
    beside every stream count's serve, so their choice moves each serve's time too)."""
    ms = engine.learned_durations()
    out = [f"{g.id} {ms[g.id] / 1e6:.2f} ms" if g.id in ms else f"{g.id} unmeasured"
           for g in engine.scheduler.graphs if g.kind.value in ("snapshot", "restore")]
    return "state-program estimates: " + "; ".join(out)


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
